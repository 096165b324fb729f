"""pathir's PathCond side by side with the published PathCond code (Lebeurrier, Vayer, Gribonval, ``rescaling_path_cond``).

    python benchmarks/bench_pathcond_reference.py --reference /path/to/pathcond [moons_demo,full_conv]
    PATHCOND_REFERENCE=/path/to/pathcond python benchmarks/bench_pathcond_reference.py

The reference is imported from the given checkout (its root, the folder holding the
``pathcond/`` package); it is never part of this repository. Without it the script says so
and exits 0.

For each of the reference's own models (``pathcond/models.py``, built as its demos and
experiment scripts build them, fixed seeds, eval mode), two deep copies of the same initial
model are rescaled in this process, each timed end to end (median of ``--repeat``, the two
alternating):

- the reference: ``rescaling_path_cond(model)`` with its defaults (10 sweeps of its cyclic
  coordinate descent, tol 1e-2);
- pathir: ``pathir.compile(model, input_shape=...).pathcond()`` (compile with its default
  self-check, then the default solver, written back into the model).

Both rescaled models (those of the last repeat) and the original are then measured by ONE
function: diag G from pathir (``pathir.lifting.diag_g.diag_g_flat`` of a fresh compile of the
model, docs/math.md §6) and its log-det divergence from the identity,
n'·log(mean g) − Σ log g over the n' entries g > 0, the quantity PathCond minimises (docs/math.md
§7; ``divergence_before/after`` of pathir's report, ``pathir.pathcond.g_summary``). Lower is
better; 0 iff all g are equal. The same divergence with the reference's own diag G
(``pathcond.network_to_optim.compute_diag_G``) is printed as a second table: the two diag G
differ where a model has max-pools (pathir counts every path through a max-pool window,
docs/math.md §2; the reference's all-ones forward keeps only the window's argmax).

Each rescaled model must compute the original function: max |Δ output| on a seeded random
batch of 64 in eval mode, checked against pathir's float32 self-check tolerance, 1e-4·max |output|.
A model with batch-norms is also compared in train mode (batch statistics, on copies): a
rescaling that scales the weights a batch-norm normalises changes the function there.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import math
import os
import sys
import time
import warnings

import numpy as np
import torch
from rows_out import measured, save_json  # run as a script: benchmarks/ is on sys.path

import pathir
from pathir.lifting.diag_g import diag_g_flat
from pathir.self_check import TOLERANCE

BATCH = 64

# name: (how the reference builds it, input shape, where the reference uses it)
MODELS = {
    "moons_demo": (lambda m: m.MLP([2, 64, 64, 64, 64, 2], seed=0), (2,),
                   "MLP 2-64-64-64-64-2, pathcond_demo.ipynb"),
    "moons_32x5": (lambda m: _kaiming(m.MLP([2] + [32] * 5 + [2], seed=123)), (2,),
                   "MLP 2-32x5-2, Kaiming normal, expes/run_experiments.py"),
    "mnist_500x3": (lambda m: m.MLP([28 * 28] + [500] * 3 + [10], seed=1234), (28 * 28,),
                    "MLP 784-500x3-10, expes/train_script.py (mnist)"),
    "cifar10_bn_500x3": (lambda m: m.MLP_BN([32 * 32 * 3] + [500] * 3 + [10], seed=1234), (32 * 32 * 3,),
                         "MLP_BN 3072-500x3-10, expes/run_expe_figure_2.py"),
    "full_conv": (lambda m: _seeded(0, lambda: m.FullyConvolutional(bias=True)), (3, 32, 32),
                  "FullyConvolutional (CIFAR-NV), expes/run_expe_figure_3.py"),
    "full_conv_no_bn": (lambda m: _seeded(0, lambda: m.FullyConvolutional_without_bn(bias=True)), (3, 32, 32),
                        "FullyConvolutional_without_bn, expes/train_script.py (full_conv_no_bn)"),
}


def _kaiming(model):
    model.reset_parameters()  # the MLP seeds torch itself: deterministic
    return model


def _seeded(seed, build):
    torch.manual_seed(seed)
    return build()


def load_reference(root: str | None):
    """(``rescaling_path_cond``, the reference's ``models`` module, its ``compute_diag_G``) from the
    checkout ``root``, or None when there is none."""
    if not root or not os.path.isfile(os.path.join(root, "pathcond", "pathcond.py")):
        return None
    sys.path.insert(0, os.path.abspath(root))
    with warnings.catch_warnings():  # its solver is a torch.jit.script function: torch warns about jit
        warnings.simplefilter("ignore", FutureWarning)
        entry = importlib.import_module("pathcond.pathcond")
        models = importlib.import_module("pathcond.models")
        to_optim = importlib.import_module("pathcond.network_to_optim")
    return entry.rescaling_path_cond, models, to_optim.compute_diag_G


def divergence(g: np.ndarray) -> float:
    """n'·log(mean g) − Σ log g over the n' entries g > 0 (scale-free: g may be normalised)."""
    g = np.asarray(g, dtype=np.float64).ravel()
    g = g[g > 0]
    if not g.size:
        return 0.0
    return float(g.size * (math.log(g.sum()) - math.log(g.size)) - np.log(g).sum())


def pathir_divergence(model, shape) -> float:
    """The divergence of diag G of ``model`` as pathir computes it (float64, never overflows)."""
    g, _ = diag_g_flat(pathir.compile(model, input_shape=shape, self_check=False).graph)
    return divergence(g)


def reference_divergence(compute_diag_G, model) -> float:
    """The same divergence with the reference's diag G (on a copy: it edits the model and restores it);
    nan where the reference cannot compute it."""
    try:
        g = compute_diag_G(copy.deepcopy(model))
    except Exception:
        return math.nan
    return divergence(g.detach().double().cpu().numpy())


def _max_diff(model, x, y0) -> float:
    with torch.no_grad():
        return float((model(x) - y0).abs().max())


def _has_batch_norm(model) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _train_mode_output(model, x):
    """The output in train mode (batch statistics), of a copy: the running statistics stay as they are."""
    with torch.no_grad():
        return copy.deepcopy(model).train()(x)


def bench(name: str, reference, repeat: int) -> dict:
    rescale, ref_models, compute_diag_G = reference
    build, shape, where = MODELS[name]
    model = build(ref_models).eval()
    x = torch.randn(BATCH, *shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y0 = model(x)
    row = {"model": name, "source": where, "params": sum(p.numel() for p in model.parameters()),
           "tolerance": TOLERANCE["float32"] * float(y0.abs().max()), "threads": torch.get_num_threads()}

    ref_times, ours_times, theirs, ours, report = [], [], None, None, None
    for _ in range(repeat):  # alternating, so that a change of load hits both
        if "reference_error" not in row:
            twin = copy.deepcopy(model)
            start = time.perf_counter()
            try:
                rescale(twin)
            except Exception as err:  # the reference supports some architectures only: a result too
                row["reference_error"] = f"{type(err).__name__}: {err}"
            else:
                ref_times.append(time.perf_counter() - start)
                theirs = twin
        twin = copy.deepcopy(model)
        start = time.perf_counter()
        report = pathir.compile(twin, input_shape=shape).pathcond()
        ours_times.append(time.perf_counter() - start)
        ours = twin

    row["pathir_s"], row["pathir_s_all"] = float(np.median(ours_times)), ours_times
    row["pathir_converged"], row["pathir_steps"] = report.converged, report.sweeps
    row["pathir_max_abs_z"] = report.max_abs_log_scale
    row["pathir_report_divergence"] = [report.divergence_before, report.divergence_after]
    row["divergence_before"] = pathir_divergence(model, shape)
    row["divergence_pathir"] = pathir_divergence(ours, shape)
    row["max_diff_pathir"] = _max_diff(ours, x, y0)
    row["reference_g_divergence_before"] = reference_divergence(compute_diag_G, model)
    row["reference_g_divergence_pathir"] = reference_divergence(compute_diag_G, ours)
    if theirs is not None:
        row["reference_s"], row["reference_s_all"] = float(np.median(ref_times)), ref_times
        row["ratio"] = row["reference_s"] / row["pathir_s"]
        row["divergence_reference"] = pathir_divergence(theirs, shape)
        row["max_diff_reference"] = _max_diff(theirs, x, y0)
        row["reference_g_divergence_reference"] = reference_divergence(compute_diag_G, theirs)
    if _has_batch_norm(model):
        y_train = _train_mode_output(model, x)
        row["train_tolerance"] = TOLERANCE["float32"] * float(y_train.abs().max())
        for key, twin in (("pathir", ours), ("reference", theirs)):
            if twin is not None:
                row[f"train_max_diff_{key}"] = float((_train_mode_output(twin, x) - y_train).abs().max())
    return row


def _seconds(row, key) -> str:
    runs = row[f"{key}_s_all"]
    text = f"{row[f'{key}_s']:.2f} s"
    return text + f" ({min(runs):.2f}–{max(runs):.2f})" if len(runs) > 1 else text


def _diff(row, key, mode="") -> str:
    value = row.get(f"{mode}max_diff_{key}")
    if value is None:
        return "–"
    return f"{value:.1e} {'✓' if value <= row[f'{mode}tolerance'] else '✗'}"


def _train_diff(row) -> str:
    if "train_max_diff_pathir" not in row:
        return "no batch-norm"
    return f"{_diff(row, 'reference', 'train_')} / {_diff(row, 'pathir', 'train_')}"


def table(rows) -> str:
    """The markdown table: the figures of both rescalings, measured with pathir's diag G."""
    out = ["| model | params | reference time | pathir time | ratio (reference/pathir) | divergence before | "
           "after reference | after pathir | max \\|Δ output\\| reference / pathir | same in train mode |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "reference_error" in r:
            ref = f"failed: {r['reference_error'][:120]}".replace("|", "\\|")
            cells = [ref, _seconds(r, "pathir"), "–", f"{r['divergence_before']:.6g}", "–",
                     f"{r['divergence_pathir']:.6g}"]
        else:
            cells = [_seconds(r, "reference"), _seconds(r, "pathir"), f"{r['ratio']:.1f}×",
                     f"{r['divergence_before']:.6g}", f"{r['divergence_reference']:.6g}",
                     f"{r['divergence_pathir']:.6g}"]
        cells += [f"{_diff(r, 'reference')} / {_diff(r, 'pathir')}", _train_diff(r)]
        out.append(f"| {r['model']} | {r['params']:,} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def reference_g_table(rows) -> str:
    """The same divergences measured with the reference's own diag G."""
    out = ["| model | divergence before | after reference | after pathir |", "|---|---|---|---|"]
    for r in rows:
        after = f"{r['reference_g_divergence_reference']:.6g}" if "reference_g_divergence_reference" in r else "–"
        out.append(f"| {r['model']} | {r['reference_g_divergence_before']:.6g} | {after} | "
                   f"{r['reference_g_divergence_pathir']:.6g} |")
    return "\n".join(out)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="?", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--reference", default=os.environ.get("PATHCOND_REFERENCE"),
                    help="root of a checkout of the published PathCond code (or env PATHCOND_REFERENCE)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    reference = load_reference(args.reference)
    if reference is None:
        print("PathCond reference not found (give --reference or PATHCOND_REFERENCE): nothing to compare, skipped")
        return []
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    print(f"torch threads {torch.get_num_threads()}, load average {load:.2f}, repeat {args.repeat}", file=sys.stderr)
    rows = measured(bench(name, reference, args.repeat) for name in names)
    print(table(rows))
    print()
    print("Divergences measured with the reference's own diag G (compute_diag_G):")
    print()
    print(reference_g_table(rows))
    save_json(rows, args.json)
    return rows


if __name__ == "__main__":
    main()
