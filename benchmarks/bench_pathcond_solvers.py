"""Coordinate descent (the published PathCond algorithm) vs the block solver.

The network is the PathCond paper's MLP 3072-500-500-500-10 with biases
(2,042,510 parameters, 1,500 units) at torch's default nn.Linear init
(weights and biases uniform in ±1/sqrt(fan_in)). Its diag G has a closed form
(MATH.md §6): for the weight j <- i of layer l,

    g = F_{l-1}(i) * K_l(j),   F_0 = 1, F_l(j) = b_l(j)² + Σ_i W_l(j,i)² F_{l-1}(i),
                               K_L = 1, K_{l-1}(i) = Σ_j W_l(j,i)² K_l(j),

and g = K_l(j) for the bias b_l(j). Both solvers run to convergence; the
speedup is the ratio of the times each takes to reach the same F (the larger
of the two final values, with 1e-9 relative slack).

Run:  python benchmarks/bench_pathcond_solvers.py [--widths 3072 500 500 500 10] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import scipy.sparse as sp

from pathir.pathcond_solvers import solve_block, solve_coordinate


def mlp(widths, seed=0, scale=1.0):
    """(g, B) of a layered MLP with biases, init bounds times ``scale``; parameters layer by layer, W row-major then b."""
    rng = np.random.default_rng(seed)
    Ws, bs = [], []
    for d_in, d_out in zip(widths[:-1], widths[1:]):
        bound = scale / np.sqrt(d_in)
        Ws.append(rng.uniform(-bound, bound, (d_out, d_in)))
        bs.append(rng.uniform(-bound, bound, d_out))
    fwd = [np.ones(widths[0])]
    for W, b in zip(Ws, bs):
        fwd.append(W**2 @ fwd[-1] + b**2)
    bwd = [np.ones(widths[-1])]
    for W in reversed(Ws):
        bwd.append(bwd[-1] @ W**2)
    bwd.reverse()  # bwd[l]: sums over paths from layer-l neurons to the outputs
    offsets = np.cumsum([0] + list(widths[1:-1]))  # unit ids of hidden layer l start at offsets[l-1]
    H = int(offsets[-1])
    gs, rows, cols, vals = [], [], [], []
    row0 = 0
    L = len(Ws)
    for l, (W, b) in enumerate(zip(Ws, bs), start=1):
        d_out, d_in = W.shape
        gs.append(np.outer(bwd[l], fwd[l - 1]).ravel())
        gs.append(bwd[l].copy())
        widx = row0 + np.arange(d_out * d_in).reshape(d_out, d_in)
        bidx = row0 + d_out * d_in + np.arange(d_out)
        if l < L:  # enters hidden unit j of layer l
            unit = offsets[l - 1] + np.arange(d_out)
            rows += [widx.ravel(), bidx]
            cols += [np.repeat(unit, d_in), unit]
            vals += [-np.ones(d_out * d_in), -np.ones(d_out)]
        if l > 1:  # leaves hidden unit i of layer l-1
            unit = offsets[l - 2] + np.arange(d_in)
            rows.append(widx.ravel())
            cols.append(np.tile(unit, d_out))
            vals.append(np.ones(d_out * d_in))
        row0 += d_out * d_in + d_out
    B = sp.csr_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(row0, H))
    return np.concatenate(gs), B


def first_at_or_below(result, target):
    hit = np.flatnonzero(result.history <= target)
    return int(hit[0]) if hit.size else None


def timed(solver, g, B, sweeps, repeats):
    """Best (CPU seconds, wall seconds) over ``repeats`` runs of exactly ``sweeps`` sweeps, and the last result."""
    best_cpu = best_wall = float("inf")
    for _ in range(repeats):
        cpu, wall = time.process_time(), time.perf_counter()
        result = solver(g, B, max_sweeps=sweeps, tol=0.0)
        best_cpu, best_wall = min(best_cpu, time.process_time() - cpu), min(best_wall, time.perf_counter() - wall)
    return best_cpu, best_wall, result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[3072, 500, 500, 500, 10])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-12)
    ap.add_argument("--max-sweeps", type=int, default=500)
    args = ap.parse_args(argv)

    t = time.perf_counter()
    g, B = mlp(args.widths, args.seed)
    print(f"MLP {args.widths}: n = {B.shape[0]:,} params, H = {B.shape[1]:,} units, nnz(B) = {B.nnz:,}, "
          f"log10 g in [{np.log10(g.min()):.1f}, {np.log10(g.max()):.1f}]  (built in {time.perf_counter() - t:.2f}s)")

    # 1. both solvers to convergence
    runs = {"coordinate": solve_coordinate(g, B, tol=args.tol, max_sweeps=args.max_sweeps),
            "block": solve_block(g, B, tol=args.tol, max_sweeps=args.max_sweeps)}
    for r in runs.values():
        print(f"{r.method:>10}: F {r.f_initial:.10e} -> {r.f_final:.10e}  sweeps {r.sweeps:4d}  converged {r.converged}  "
              f"{r.seconds:7.3f}s wall  (setup {r.times[0]:.3f}s, {(r.times[-1] - r.times[0]) / max(r.sweeps, 1) * 1e3:.2f} "
              f"ms/sweep)  max|z| {r.max_abs_z:.3f}  |grad|max {r.grad_max:.2e}  grad_rel {r.grad_rel:.2e}  "
              f"log-spread of g {r.log_spread_initial:.2f} -> {r.log_spread_final:.2f}")
    coord, fast = runs["coordinate"], runs["block"]
    print(f"F(block) - F(coordinate) = {fast.f_final - coord.f_final:+.3e}  "
          f"(relative {(fast.f_final - coord.f_final) / abs(coord.f_final):+.2e})")

    # 2. time each to the same F: the worse of the two final values, 1e-9 relative slack
    target = max(coord.f_final, fast.f_final)
    target += 1e-9 * abs(target)
    k_coord, k_fast = first_at_or_below(coord, target), first_at_or_below(fast, target)
    cpu_c, wall_c, _ = timed(solve_coordinate, g, B, k_coord, 1)
    cpu_f, wall_f, check = timed(solve_block, g, B, k_fast, 3)
    assert check.f_final <= target, (check.f_final, target)
    print(f"to reach F <= {target:.10e}: coordinate {k_coord} sweeps, {cpu_c:.3f}s CPU ({wall_c:.3f}s wall); "
          f"block {k_fast} sweeps, {cpu_f:.3f}s CPU ({wall_f:.3f}s wall)")
    print(f"speedup: {cpu_c / cpu_f:.1f}x CPU time, {wall_c / wall_f:.1f}x wall time (setup and report included)")
    iter_c = coord.times[k_coord] - coord.times[0]
    iter_f = fast.times[k_fast] - fast.times[0]
    print(f"sweeps only (wall, from the converged runs): coordinate {iter_c:.3f}s, block {iter_f:.4f}s -> "
          f"{iter_c / iter_f:.0f}x; setup: coordinate {coord.times[0]:.3f}s, block {fast.times[0]:.3f}s")
    return cpu_c / cpu_f


if __name__ == "__main__":
    main()
