"""pathir side by side with the published path-norm toolkit (A. Gonon et al., ``pathnorm_toolkit``).

    python benchmarks/bench_toolkit.py --toolkit /path/to/pathnorm_toolkit [resnet18,resnet50,vgg16]
    PATHNORM_TOOLKIT=/path/to/pathnorm_toolkit python benchmarks/bench_toolkit.py

The toolkit is imported from the given checkout (its root: ``src/pathnorm/`` and
``ok_models.json``, which it reads from the working directory); it is never part
of this repository. Without it the script says so and exits 0.

Three workloads per model, each timed end to end in this process (median of ``--repeat``):

(a) one l1 path-norm: ``pathir.compile`` (with its default self-check) + ``cm.path_norm()``
    against ``get_path_norm(model, name, cpu, exponent=1)``;
(b) q = 1, 2, 4 at once: compile + ``cm.path_norms((1, 2, 4))`` against
    ``compute_path_norms(model, name, [1, 2, 4], cpu, False)``;
(c) training tracking: 10 SGD steps, one l1 path-norm after each. pathir compiles once and
    queries the live Compiled (it re-reads the model after each step, docs/live.md); the
    toolkit recomputes. Only the path-norm work is timed (pathir's includes its compile).

ratio = toolkit time / pathir time (> 1: pathir faster). Goals: (a) ratio ≥ 1/1.5, (b) and (c) ≥ 2.
The toolkit computes in the model's dtype (float32 here), pathir in float64 without overflow
(its log10, as norms pass 1e308 after a few steps on resnet50): the gap of the two log10 values
is printed too (inf where the toolkit overflowed).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import sys
import time

import torch
from rows_out import measured, save_json  # run as a script: benchmarks/ is on sys.path

import pathir
from pathir.app import zoo


def load_toolkit(root: str | None):
    """The toolkit's ``compute_path_norm`` module from its checkout ``root``, or None."""
    if not root or not os.path.isdir(os.path.join(root, "src", "pathnorm")):
        return None
    sys.path.insert(0, os.path.join(root, "src"))
    from pathnorm.path_norm import compute_path_norm as toolkit

    return toolkit


@contextlib.contextmanager
def inside(directory: str):
    """The toolkit reads ok_models.json from the working directory."""
    old = os.getcwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(old)


def timed(fn, repeat: int):
    """(median seconds, last result) of ``repeat`` calls."""
    times, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], out


def sgd_steps(model, shape, steps: int, seed: int = 0):
    """Yield after each of ``steps`` SGD steps (eval mode: batch-norm statistics stay)."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randn(2, *shape, generator=gen)
        target = torch.randint(0, 1000, (2,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), target).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # random-init resnet50 diverges to NaN without
        opt.step()
        yield


def _log10_gap(ours_log10: float, theirs: float) -> float:
    """|log10 of pathir's norm - log10 of the toolkit's| (inf where the toolkit's float32 overflowed)."""
    if math.isnan(theirs):  # the toolkit failed
        return math.nan
    return abs(ours_log10 - math.log10(theirs)) if 0 < theirs < math.inf else math.inf


def bench(name: str, toolkit, root: str, repeat: int, steps: int, workloads: str = "abc") -> dict:
    cpu = torch.device("cpu")
    shape = zoo.input_shape(name)
    model = zoo.build(name).eval()
    row = {"model": name}

    def ours_one():
        return pathir.compile(model, input_shape=shape).path_norm(1, log10=True)

    def ours_many():
        return pathir.compile(model, input_shape=shape).path_norms((1, 2, 4), log10=True)

    def theirs(fn, repeat=1):
        """The toolkit on its own copy of the model (made untimed): its in-place max-pool swap does
        not always restore the layer it replaced (resnets keep a padding of 3 after the reset)."""
        times, out = [], None
        for _ in range(repeat):
            twin = copy.deepcopy(model)
            start = time.perf_counter()
            try:
                out = fn(twin)
            except Exception as err:  # the toolkit's own failure is a result too (vgg16 in (b))
                row.setdefault("toolkit_errors", []).append(f"{type(err).__name__}: {err}")
                return math.nan, math.nan
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2], out

    with inside(root):
        if "a" in workloads:
            _workload_a(row, timed(ours_one, repeat), theirs(lambda m: toolkit.get_path_norm(m, name, cpu, exponent=1),
                                                             repeat))
        if "b" in workloads:
            row["b_pathir_s"], _ = timed(ours_many, repeat)
            row["b_toolkit_s"], _ = theirs(lambda m: toolkit.compute_path_norms(m, name, [1, 2, 4], cpu, False), repeat)
        if "c" in workloads:
            _workload_c(row, model, shape, steps, theirs, lambda m: toolkit.get_path_norm(m, name, cpu, exponent=1))
    for k in workloads:
        row[f"{k}_ratio"] = row[f"{k}_toolkit_s"] / row[f"{k}_pathir_s"]
    return row


def _workload_a(row, ours, theirs):
    (row["a_pathir_s"], ours), (row["a_toolkit_s"], value) = ours, theirs
    row["a_log10_gap"] = _log10_gap(ours, value)


def _workload_c(row, model, shape, steps, theirs, toolkit_norm):
    """Compile once, then after each SGD step one l1 path-norm of the live Compiled (timed: the
    compile and the queries) against the toolkit's recomputation (timed: its calls)."""
    ours_c = theirs_c = 0.0
    start = time.perf_counter()
    cm = pathir.compile(model, input_shape=shape)
    ours_c += time.perf_counter() - start
    ours = value = math.nan
    for _ in sgd_steps(model, shape, steps):
        start = time.perf_counter()
        ours = cm.path_norm(1, log10=True)
        ours_c += time.perf_counter() - start
        seconds, value = theirs(toolkit_norm)
        theirs_c += seconds
    row["c_pathir_s"], row["c_toolkit_s"], row["c_log10_gap"] = ours_c, theirs_c, _log10_gap(ours, value)


def _cell(r, k) -> str:
    if f"{k}_ratio" not in r:
        return "not run | |"
    return f"{r[f'{k}_pathir_s']:.2f} s / {r[f'{k}_toolkit_s']:.2f} s | {r[f'{k}_ratio']:.2f}× |"


def table(rows) -> str:
    out = ["| model | (a) one path-norm: pathir / toolkit | ratio | (b) q = 1, 2, 4 | ratio | "
           f"(c) {rows[0]['steps'] if rows else 10} SGD steps | ratio |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {_cell(r, 'a')} {_cell(r, 'b')} {_cell(r, 'c')}")
    return "\n".join(out)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="?", default="resnet18,resnet50,vgg16")
    ap.add_argument("--toolkit", default=os.environ.get("PATHNORM_TOOLKIT"),
                    help="root of a pathnorm_toolkit checkout (or env PATHNORM_TOOLKIT)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--workloads", default="abc", help="which of a, b, c to run (e.g. c)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    toolkit = load_toolkit(args.toolkit)
    if toolkit is None:
        print("pathnorm_toolkit not found (give --toolkit or PATHNORM_TOOLKIT): nothing to compare, skipped")
        return []
    root = os.path.abspath(args.toolkit)
    rows = measured({**bench(name, toolkit, root, args.repeat, args.steps, args.workloads), "steps": args.steps}
                    for name in args.models.split(","))
    print(table(rows))
    save_json(rows, args.json)
    return rows


if __name__ == "__main__":
    main()
