"""PathCond on real models: the default solver against the published coordinate descent, and end to end.

1. The PathCond paper's MLP 3072-500-500-500-10 (2,042,510 parameters) and
2. torchvision's resnet18 at 224x224 (BatchNorm folded, random running
   statistics), each through pathir: the graph-level B (``cm.incidence()``)
   with its row keys (``cm.row_keys()``), as ``cm.pathcond()`` hands them to
   the solver, and the real diag G (``diag_g_flat``). Both solvers run to
   convergence; the target is the larger of the two final values, with 1e-9
   relative slack; then each is timed over exactly the sweeps it needs to
   reach it (setup and report included) and the speedup is their ratio.
3. ``cm.pathcond()`` end to end on resnet18 (units, B, diag G, solve,
   write-back into the model) on a freshly compiled model, against one
   forward + backward pass of the torch model itself (batch 1, 224x224,
   float32 as one would train, and float64), with the same thread count.

Each timing is the best of ``--repeat`` runs (the least disturbed on a shared
machine): compare ratios measured in one run, not absolute seconds across runs.

Run:  python benchmarks/bench_pathcond.py [--threads 2] [--repeat 3] [--skip-mlp] [--skip-resnet]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import pathir
from pathir.lifting.diag_g import diag_g_flat
from pathir.pathcond.solvers import solve


def first_at_or_below(result, target):
    hit = np.flatnonzero(result.history <= target)
    return int(hit[0]) if hit.size else None


def best_time(fn, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def solvers(name, cm, max_sweeps, repeat):
    """Coordinate vs block on one compiled model, each given B with its row keys as cm.pathcond()
    does; returns the speedup in time to the same F."""
    t = time.perf_counter()
    B, _ = cm.incidence()
    rows = cm.row_keys()
    g, _ = diag_g_flat(cm.graph, cm.get_backend())
    print(f"{name}: n = {B.shape[0]:,} params, H = {B.shape[1]:,} units, nnz(B) = {B.nnz:,}  "
          f"(B, row keys and diag G in {time.perf_counter() - t:.2f}s)")
    runs = [solve(g, B, method=m, max_sweeps=max_sweeps, tol=1e-13, row_key=rows) for m in ("coordinate", "block")]
    for r in runs:
        print(f"  {r.method:>10}: F {r.f_initial:.12e} -> {r.f_final:.12e}  sweeps {r.sweeps:5d}  "
              f"converged {r.converged}  {r.seconds:8.3f}s (setup {r.times[0]:.3f}s)  grad_rel {r.grad_rel:.1e}")
    coord, block = runs
    target = max(coord.f_final, block.f_final)
    target += 1e-9 * abs(target)
    rel = (block.f_final - coord.f_final) / abs(coord.f_final)
    seconds = {}
    for r in runs:  # time exactly the sweeps each needs to reach the target, setup and report included
        k = first_at_or_below(r, target)
        seconds[r.method] = best_time(lambda: solve(g, B, method=r.method, max_sweeps=k, tol=0.0, row_key=rows), repeat)
        print(f"  {r.method:>10}: {k} sweeps to F <= {target:.12e}: {seconds[r.method]:.4f}s (best of {repeat})")
    speedup = seconds["coordinate"] / seconds["block"]
    print(f"  F(block) - F(coordinate), relative: {rel:+.2e};  speedup {speedup:.1f}x")
    return speedup


def end_to_end(repeat):
    from pathir.app.zoo import build

    shape = (3, 224, 224)
    model = build("resnet18")
    t_compile = best_time(lambda: pathir.compile(model, input_shape=shape), repeat)
    runs = []
    for _ in range(repeat):  # each on a fresh model: pathcond() rescales it in place
        cm = pathir.compile(build("resnet18"), input_shape=shape)
        t = time.perf_counter()
        report = cm.pathcond()
        runs.append((time.perf_counter() - t, report))
    t_pathcond, r = min(runs, key=lambda tr: tr[0])
    steps = ", ".join(f"{k} {v:.2f}s" for k, v in r.timings.items())
    print(f"resnet18 pathcond() end to end: {t_pathcond:.2f}s (best of {repeat}; compile {t_compile:.2f}s "
          f"before it)\n  one run: {steps}; {r.sweeps} sweeps, F {r.objective_before:.6e} -> {r.objective_after:.6e}")
    out = {}
    for dtype in (torch.float32, torch.float64):
        m = build("resnet18").to(dtype)
        x = torch.randn(1, *shape, dtype=dtype)

        def step():
            m.zero_grad(set_to_none=True)
            m(x).sum().backward()

        step()  # warm-up
        t = best_time(step, repeat)
        out[dtype] = t
        print(f"  one forward+backward of resnet18 (batch 1, {dtype}): {t:.3f}s  ->  "
              f"pathcond() = {t_pathcond / t:.1f} passes")
    return t_pathcond, out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-sweeps", type=int, default=20_000)
    ap.add_argument("--skip-mlp", action="store_true")
    ap.add_argument("--skip-resnet", action="store_true")
    ap.add_argument("--skip-end-to-end", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    if not args.skip_mlp:
        torch.manual_seed(0)
        widths = [3072, 500, 500, 500, 10]
        layers = []
        for a, b in zip(widths[:-1], widths[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        mlp = torch.nn.Sequential(*layers[:-1])
        solvers("MLP 3072-500-500-500-10", pathir.compile(mlp, input_shape=(3072,)), args.max_sweeps, args.repeat)
    if not args.skip_resnet:
        from pathir.app.zoo import build

        solvers("resnet18 (224x224)", pathir.compile(build("resnet18"), input_shape=(3, 224, 224)), args.max_sweeps,
                args.repeat)
    if not args.skip_end_to_end:
        end_to_end(args.repeat)


if __name__ == "__main__":
    main()
