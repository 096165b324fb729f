"""Cross-layer equalization before post-training weight quantization (Nagel et al. 2019, "Data-Free
Quantization"): Brevitas's graph equalization side by side with pathir's.

    python benchmarks/bench_equalize.py [--models vgg11_bn,resnet18,...] [--bits 8,6] [--sides brevitas,pathir]
                                        [--repeat 1] [--seeds 0,1,2,3] [--json out.json]

Brevitas is an optional dependency (``pip install -e '.[bench-equalize]'``); without it the Brevitas side is
skipped with a message, and without any equalizer to run the script says so and exits 0.

Setup, the same for every side:

1. the model (``equalize_models.build``): a torchvision network, random init, ``--size``² inputs, whose batch
   norms look trained: gamma = exp(N(0, ``--gamma-sigma``)), beta = N(0, ``--beta-std``), running statistics
   measured in train mode (cumulative average) on ``--calib-batches`` batches of structured random images;
2. batch norm folded into the conv/linear before it (``equalize_models.fold_bn``; batch norms after a concat
   or an add stay float). This folded float model is the reference and every side's input;
3. a side's equalization (timed, median of ``--repeat``), and a check that it kept the float function:
   max|y_eq − y| / max|y| ≤ ``--float-tol`` on the scoring batch (a ✗ in the table where not);
4. every conv/linear weight quantized, symmetric, at b bits: Q(w) = Δ·round(w/Δ), Δ = max|w| / (2^(b−1) − 1),
   per tensor (or per output channel); biases float unless ``--quant-bias``; activations float;
5. the score: output SQNR in dB against the folded float model on a fixed batch of ``--batch`` structured
   random images, 10·log10(Σ y² / Σ (y − y_q)²), every image pooled (run in chunks of ``--chunk``). The default
   128 images: on a model that amplifies its rounding (shufflenet_v2 at 6 bits) the score of 16 images moves
   by up to 30 dB from one batch to the next, and neither side's figure means anything at that size.

With ``--seeds`` every model is built, calibrated and scored once per seed, and a second table gives per
model and width the medians over the seeds of each side's pooled SQNR and of its median per-image SQNR (each
image's own 10·log10(Σ y² / Σ (y − y_q)²), the median over the batch: not decided by one image), and on how
many seeds pathir's pooled figure is at least each other side's. The JSON rows carry ``seed`` and the
per-image medians (``sqnr_<side>_image_median``).

Columns: ``none`` per tensor (the floor), ``none`` per channel (the ceiling that equalization aims at), and
each equalizer per tensor (its per-channel figure is in the JSON rows).

Brevitas side: ``brevitas.graph.quantize.preprocess_for_quantize(model, equalize_iters=--eq-iters,
equalize_merge_bias=..., merge_bn=True, equalize_bias_shrinkage=--bias-shrinkage,
equalize_scale_computation=--scale-computation, relu6_to_relu=False)`` on a copy of the folded model: it
fx-traces, merges any batch norm left foldable (none: step 2 folded them; counted and reported), then runs
``EqualizeGraph``. Its ``equalize_merge_bias`` matches what is scored: False (weight ranges only, as in the paper)
where biases stay float, True with ``--quant-bias`` (``--merge-bias`` / ``--no-merge-bias`` override it). Merging
biases that are never quantized spends the rescaling on ranges no quantizer sees (mnasnet0_5, seed 2, 6 bits:
0.0 dB merged against 4.9 weight-only) and doubles the call's time on resnet18. ``brevitas_merged`` is the
library's default, ``equalize_merge_bias=True``, whatever is scored. The regions it found are counted with ``EqualizeGraph(iterations=0,
return_regions=True)`` on its output, the conv/linear layers whose weights it changed against the input, and
the iterations it ran (it stops before ``--eq-iters`` once no scale factor moves by more than 5 %).

pathir side: ``pathir_equalize`` below, ``pathir.equalize(model, input_shape=..., bits=6, objective=--objective)``
(compile included; the default objective, ``noise``, unless ``--objective`` names another). ``pathir_data`` (not
run by default): ``objective="output-noise"`` on ``--calib`` calibration images drawn apart from the batch-norm
statistics' batches and the scoring batch (data-aware; Brevitas reads no data). Its time cell reads
"total (equalize)": the whole call, and in brackets the part after compile (``report.seconds``: pairs, solve,
report and the write-back with its checks; compile and its self-check are the rest).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
import warnings

import equalize_models as em  # run as a script: benchmarks/ is on sys.path
import torch
from rows_out import measured, save_json


class Skipped(Exception):
    """A side that cannot run here (its package is missing); the message says why."""


# --- the equalizers: each takes (folded float model, input shape, args) and returns (model, info) -----------

def pathir_equalize(model, input_shape, objective: str = "noise", inputs=None):
    """pathir's equalization of ``model`` (a folded float torch model), returned as a torch model with the
    same float function (a write-back), compile included. ``inputs``: a calibration batch (output-noise)."""
    import pathir

    equalize = getattr(pathir, "equalize", None)
    if equalize is None:
        raise Skipped("pathir.equalize does not exist yet")
    report = equalize(model, input_shape=input_shape, bits=6, objective=objective, inputs=inputs, progress=False)
    # report.seconds: the equalization after compile (pairs, solve, report, write-back with its checks)
    return model, {"objective_after": report.objective_after, "iterations": sum(report.iterations),
                   "equalize_s": report.seconds}


def _pathir_side(model, input_shape, args):
    return pathir_equalize(model, input_shape, args.objective)


def _pathir_data_side(model, input_shape, args):
    """pathir with ``objective="output-noise"`` on ``--calib`` images drawn apart from the BN statistics' batches and
    the scoring batch (the data a deployment engineer calibrates on; Brevitas's side reads none)."""
    return pathir_equalize(model, input_shape, "output-noise", em.calibration_inputs(args.size, args.calib, args.seed))


def _import_brevitas():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "fast_hadamard_transform package not found" at import
            from brevitas.graph.equalize import EqualizeGraph
            from brevitas.graph.quantize import preprocess_for_quantize
    except ImportError as err:
        raise Skipped(f"brevitas is not installed ({err}; pip install -e '.[bench-equalize]')") from None
    return preprocess_for_quantize, EqualizeGraph


class _CountedCLE:
    """Brevitas's per-region step (``brevitas.graph.equalize._cross_layer_equalization``) wrapped while
    ``preprocess_for_quantize`` runs, to record each call's max |1 − s| over its scale factors s: with the
    region count this gives the iterations run and the last iteration's largest change (Brevitas stops early
    once that is below its fixed threshold, 0.05)."""

    def __init__(self):
        from brevitas.graph import equalize

        self.module, self.inner, self.changes = equalize, equalize._cross_layer_equalization, []

    def __call__(self, *a, **k):
        scales, rewriters = self.inner(*a, **k)
        self.changes.append(float(torch.max(torch.abs(1 - scales.detach().float()))))
        return scales, rewriters

    def __enter__(self):
        self.module._cross_layer_equalization = self
        return self

    def __exit__(self, *exc):
        self.module._cross_layer_equalization = self.inner


def _brevitas(model, args, merge_bias: bool):
    preprocess_for_quantize, EqualizeGraph = _import_brevitas()
    bn_before = sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    with warnings.catch_warnings(), _CountedCLE() as counted:
        warnings.simplefilter("ignore")
        out = preprocess_for_quantize(
            model,  # a copy: the traced GraphModule shares (and rescales) the input's modules
            trace_model=True,
            relu6_to_relu=False,  # would change the float function (none of the default models has ReLU6)
            equalize_iters=args.eq_iters,
            equalize_merge_bias=merge_bias,
            merge_bn=True,
            equalize_bias_shrinkage=args.bias_shrinkage,
            equalize_scale_computation=args.scale_computation,
            channel_splitting_ratio=0.0)
    return out, {"bn_before": bn_before, "EqualizeGraph": EqualizeGraph, "changes": counted.changes}


def _brevitas_info(model_in, out, info):
    """What Brevitas did: regions found, layers it changed, batch norms it merged on top of ours."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, regions = info.pop("EqualizeGraph")(iterations=0, return_regions=True).apply(out)
    bn_after = sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in out.modules())
    changes, n = info["changes"], max(len(regions), 1)
    return {"regions": len(regions), "layers_changed": em.changed_layers(model_in, out),
            "bn_merged": info["bn_before"] - bn_after, "iterations": math.ceil(len(changes) / n),
            "last_change": max(changes[-(len(changes) % n or n):], default=0.0)}


def _brevitas_side(model, input_shape, args):
    """Brevitas with ``equalize_merge_bias`` as what is scored: biases merged where they are quantized."""
    return _brevitas(model, args, merge_bias=args.quant_bias if args.merge_bias is None else args.merge_bias)


def _brevitas_merged_side(model, input_shape, args):
    return _brevitas(model, args, merge_bias=True)


SIDES = {
    "brevitas": _brevitas_side,
    "brevitas_merged": _brevitas_merged_side,
    "pathir": _pathir_side,
    "pathir_data": _pathir_data_side,
}
TITLES = {"brevitas": "Brevitas", "brevitas_merged": "Brevitas (merge_bias)", "pathir": "pathir",
          "pathir_data": "pathir output-noise"}


def available(sides: list[str]) -> tuple[list[str], list[str]]:
    """(the sides that can run here, a note for each one that cannot)."""
    ok, notes = [], []
    for side in sides:
        try:
            if side.startswith("brevitas"):
                _import_brevitas()
            elif side in ("pathir", "pathir_data"):
                import pathir

                if not hasattr(pathir, "equalize"):
                    raise Skipped("pathir.equalize does not exist yet")
                _warm_up(pathir)
            else:
                raise Skipped(f"unknown side (one of {', '.join(SIDES)})")
            ok.append(side)
        except Skipped as why:
            notes.append(f"{side}: skipped, {why}")
    return ok, notes


def _warm_up(pathir) -> None:
    """Pay once, untimed, what a process pays on its first compile (torch's lazily imported modules, a few
    seconds): as Brevitas's import, which is not timed either."""
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    pathir.equalize(net, input_shape=(2,), progress=False)


# --- one model -----------------------------------------------------------------------------------------------

def _timed(fn, prepare, repeat: int):
    """(median seconds, last result) of ``repeat`` calls ``fn(prepare())`` (``prepare`` untimed)."""
    times, out = [], None
    for _ in range(repeat):
        arg = prepare()
        start = time.perf_counter()
        out = fn(arg)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], out


def bench(name: str, args, sides: list[str]) -> list[dict]:
    """One row per bit width for model ``name``."""
    shape = (3, args.size, args.size)
    model = em.build(name, size=args.size, seed=args.seed, gamma_sigma=args.gamma_sigma, beta_std=args.beta_std,
                  calib_batches=args.calib_batches)
    x = em.eval_inputs(args.size, args.batch, args.seed)
    chunks = x.split(args.chunk)
    with torch.no_grad():
        y_model = torch.cat([model(c) for c in chunks])
        folded, n_folded, n_left = em.fold_bn(model)
        y = torch.cat([folded(c) for c in chunks])
    del model
    base = {"model": name, "size": args.size, "weight_layers": len(em.weight_layers(folded)), "bn_folded": n_folded,
            "bn_left": n_left, "fold_rel_err": em.relative_error(y_model, y), "quant_bias": args.quant_bias}

    def scores(m, bits, per_channel):
        """(pooled SQNR, median per-image SQNR) in dB."""
        with torch.no_grad():
            q = em.quantize_weights(m, bits, per_channel, args.quant_bias)
            y_q = torch.cat([q(c) for c in chunks])
            return em.sqnr_db(y, y_q), em.median_image_sqnr_db(y, y_q)

    def score(m, bits, per_channel):
        return scores(m, bits, per_channel)[0]

    rows = {}
    for bits in args.bits:
        none, none_image = scores(folded, bits, False)
        rows[bits] = dict(base, bits=bits, seed=args.seed, sqnr_none=none, sqnr_none_image_median=none_image,
                          sqnr_per_channel=score(folded, bits, True))
    for side in sides:
        try:
            seconds, (eq, info) = _timed(lambda m: SIDES[side](m, shape, args), lambda: copy.deepcopy(folded),
                                         args.repeat)
        except Skipped as why:
            for row in rows.values():
                row[f"{side}_skipped"] = str(why)
            continue
        except Exception as err:  # the tool's own failure is a result too
            for row in rows.values():
                row[f"{side}_error"] = f"{type(err).__name__}: {err}"
            continue
        if side.startswith("brevitas"):
            info = _brevitas_info(folded, eq, info)
        eq.eval()
        with torch.no_grad():
            float_err = em.relative_error(y, torch.cat([eq(c) for c in chunks]))
        if not float_err <= args.float_tol:
            print(f"warning: {name}, {side}: the equalized float model differs from the original by {float_err:.1e} "
                  f"(relative, > {args.float_tol:g})", file=sys.stderr)
        for bits, row in rows.items():
            pooled, image = scores(eq, bits, False)
            row.update({f"{side}_s": seconds, f"{side}_float_rel_err": float_err,
                        f"{side}_float_ok": float_err <= args.float_tol,
                        f"sqnr_{side}": pooled, f"sqnr_{side}_image_median": image,
                        f"sqnr_{side}_per_channel": score(eq, bits, True)})
            row.update({f"{side}_{k}": v for k, v in info.items()})
        del eq
    return list(rows.values())


# --- output ----------------------------------------------------------------------------------------------------

def _db(v) -> str:
    return "–" if v is None else ("inf" if v == math.inf else f"{v:.1f}")


def _side_cells(r, side) -> list[str]:
    if f"sqnr_{side}" not in r:
        why = r.get(f"{side}_error") or r.get(f"{side}_skipped") or "not run"
        return [why.replace("|", "\\|"), "–"] + (["–"] if side.startswith("brevitas") else [])
    sqnr = _db(r[f"sqnr_{side}"]) + ("" if r[f"{side}_float_ok"] else f" (float ✗ {r[f'{side}_float_rel_err']:.0e})")
    seconds = f"{r[f'{side}_s']:.2f}"
    if f"{side}_equalize_s" in r:  # the time after compile (compile and its self-check are the rest)
        seconds += f" ({r[f'{side}_equalize_s']:.2f})"
    cells = [sqnr, seconds]
    if side.startswith("brevitas"):
        cells.append(f"{r[f'{side}_regions']} / {r[f'{side}_layers_changed']} of {r['weight_layers']} / "
                     f"{r[f'{side}_iterations']}" + (f", merged {r[f'{side}_bn_merged']} BN" if r[f"{side}_bn_merged"] else ""))
    return cells


def table(rows: list[dict], sides: list[str]) -> str:
    head = ["model", "W bits", "none, per-tensor (dB)", "none, per-channel: ceiling (dB)"]
    for side in sides:
        head += [f"{TITLES[side]}, per-tensor (dB)", f"{TITLES[side]} time (s)"]
        if side.startswith("brevitas"):
            head.append(f"{TITLES[side]}: regions / layers changed / iterations")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    several = len({r.get("seed") for r in rows}) > 1
    for r in rows:
        model = f"{r['model']} (seed {r['seed']})" if several else r["model"]
        cells = [model, str(r["bits"]), _db(r["sqnr_none"]), _db(r["sqnr_per_channel"])]
        for side in sides:
            cells += _side_cells(r, side)
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def seed_summary(rows: list[dict], sides: list[str]) -> str:
    """Per model and bit width over the seeds run: each side's median pooled SQNR, its median per-image
    SQNR (medians over the seeds), and on how many seeds pathir's pooled figure is at least each other
    side's. A single seed's pooled figure can be decided by one image (shufflenet_v2 at 6 bits)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["bits"]), []).append(r)
    head = ["model", "W bits", "seeds"]
    for side in ["none", *sides]:
        title = "none" if side == "none" else TITLES[side]
        head += [f"{title}: median pooled (dB)", f"{title}: median per-image (dB)"]
    ours = [s for s in sides if s.startswith("pathir")]
    others = [s for s in sides if not s.startswith("pathir")]
    head += [f"{TITLES[p]} ≥ {TITLES[s]} (seeds)" for p in ours for s in others]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (model, bits), rs in groups.items():
        cells = [model, str(bits), ",".join(str(r["seed"]) for r in rs)]
        for side in ["none", *sides]:
            for key in (f"sqnr_{side}", f"sqnr_{side}_image_median"):
                vals = [r[key] for r in rs if r.get(key) is not None]
                cells.append(_db(statistics.median(vals)) if vals else "–")
        for ours_side in ours:
            for other in others:
                both = [r for r in rs if f"sqnr_{ours_side}" in r and f"sqnr_{other}" in r]
                wins = sum(r[f"sqnr_{ours_side}"] >= r[f"sqnr_{other}"] for r in both)
                cells.append(f"{wins} of {len(both)}")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    """The command line; ``parser().parse_args([])`` gives every default (the sides' settings among them)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=[",".join(em.MODELS)], help="comma- or space-separated torchvision names")
    ap.add_argument("--bits", default="8,6", help="weight bit widths, comma-separated")
    ap.add_argument("--sides", default="brevitas,pathir", help=f"equalizers, of {', '.join(SIDES)}")
    ap.add_argument("--repeat", type=int, default=1, help="equalization timings per side (median); scores use the last")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", type=int, default=64, help="input height and width")
    ap.add_argument("--batch", type=int, default=128, help="images in the scoring batch")
    ap.add_argument("--chunk", type=int, default=32, help="images per forward when scoring")
    ap.add_argument("--calib", type=int, default=32, help="calibration images of the pathir_data side")
    ap.add_argument("--calib-batches", type=int, default=4, help="train-mode batches of 16 for the BN statistics")
    ap.add_argument("--gamma-sigma", type=float, default=1.0, help="BN gamma = exp(N(0, sigma))")
    ap.add_argument("--beta-std", type=float, default=0.5, help="BN beta = N(0, std)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", help="several seeds, comma-separated (each: its own BN statistics and scoring batch); "
                                    "adds a table of medians over them")
    ap.add_argument("--quant-bias", action="store_true", help="quantize biases too (per tensor, at the same bits)")
    ap.add_argument("--float-tol", type=float, default=1e-4, help="max relative change of the float output")
    ap.add_argument("--eq-iters", type=int, default=20, help="Brevitas equalize_iters (its ImageNet PTQ default)")
    ap.add_argument("--merge-bias", action=argparse.BooleanOptionalAction, default=None,
                    help="Brevitas equalize_merge_bias of the 'brevitas' side (default: as --quant-bias, what is scored)")
    ap.add_argument("--bias-shrinkage", default="vaiq", help="Brevitas equalize_bias_shrinkage: 'vaiq' or a number")
    ap.add_argument("--scale-computation", default="maxabs", choices=["maxabs", "range"],
                    help="Brevitas equalize_scale_computation")
    ap.add_argument("--objective", default="noise", choices=["noise", "range", "path-metric"],
                    help="pathir's objective (its default: noise)")
    ap.add_argument("--json", help="also write the rows here")
    return ap


def main(argv=None) -> list[dict]:
    args = parser().parse_args(argv)
    args.bits = [int(b) for b in args.bits.split(",")]
    if args.bias_shrinkage != "vaiq":
        args.bias_shrinkage = float(args.bias_shrinkage)
    torch.set_num_threads(args.threads)
    sides, notes = available([s for s in args.sides.split(",") if s])
    for note in notes:
        print(note)
    if not sides:
        print("no equalizer to run: nothing to compare, skipped")
        return []
    names = [n for arg in args.models for n in arg.split(",") if n]
    seeds = [int(v) for v in args.seeds.split(",")] if args.seeds else [args.seed]

    def seeded(seed):
        args.seed = seed
        return args

    rows = measured(row for name in names for seed in seeds for row in bench(name, seeded(seed), sides))
    print(table(rows, sides))
    if len(seeds) > 1:
        print()
        print(seed_summary(rows, sides))
    save_json(rows, args.json)
    return rows


if __name__ == "__main__":
    main()
