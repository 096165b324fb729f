"""Coordinate descent (the published PathCond algorithm) vs the block solver.

The network is the PathCond paper's MLP 3072-500-500-500-10 with biases
(2,042,510 parameters, 1,500 units) at torch's default nn.Linear init
(weights and biases uniform in ±1/sqrt(fan_in)). Its diag G has a closed form
(docs/math.md §6): for the weight j <- i of layer l,

    g = F_{l-1}(i) * K_l(j),   F_0 = 1, F_l(j) = b_l(j)² + Σ_i W_l(j,i)² F_{l-1}(i),
                               K_L = 1, K_{l-1}(i) = Σ_j W_l(j,i)² K_l(j),

and g = K_l(j) for the bias b_l(j). Both solvers run to convergence; the
speedup is the ratio of the times each takes to reach the same F (the larger
of the two final values, with 1e-9 relative slack), both given B with its row
keys (as ``cm.pathcond()`` passes them), then both given the bare matrix.

Run:  python benchmarks/bench_pathcond_solvers.py [--widths 3072 500 500 500 10] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import scipy.sparse as sp

from pathir.analyses.unit_rows import RowKeys
from pathir.pathcond.solvers import solve_block, solve_coordinate


def mlp(widths, seed=0, scale=1.0):
    """(g, B, rows) of a layered MLP with biases, init bounds times ``scale``; parameters layer by
    layer, W row-major then b. ``rows`` (a RowKeys) holds each row's (entered, left) units and the
    column balance, as ``Compiled.row_keys()`` would; B is built from them."""
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
    L = len(Ws)

    def units(layer, width):  # unit ids of the neurons of a layer, H for the (pinned) input and output
        return offsets[layer - 1] + np.arange(width) if 0 < layer < L else np.full(width, H)

    gs, keys = [], []
    for l, W in enumerate(Ws, start=1):
        d_out, d_in = W.shape
        gs += [np.outer(bwd[l], fwd[l - 1]).ravel(), bwd[l].copy()]
        enter = units(l, d_out)
        keys += [(enter[:, None] * (H + 1) + units(l - 1, d_in)[None, :]).ravel(), enter * (H + 1) + H]
    key = np.concatenate(keys)
    enter, leave = np.divmod(key, H + 1)
    rows = np.arange(key.size)
    into, out_of = enter < H, leave < H
    B = sp.csr_array((np.r_[-np.ones(into.sum()), np.ones(out_of.sum())],
                      (np.r_[rows[into], rows[out_of]], np.r_[enter[into], leave[out_of]])), shape=(key.size, H))
    # the column balance A_h = #rows entering h - #rows leaving h, as a Compiled builds it with the keys
    balance = (np.bincount(enter, minlength=H + 1) - np.bincount(leave, minlength=H + 1))[:H]
    return np.concatenate(gs), B, RowKeys(key, balance)


def first_at_or_below(result, target):
    hit = np.flatnonzero(result.history <= target)
    return int(hit[0]) if hit.size else None


def timed(solver, g, B, sweeps, repeats, row_key=None):
    """Best (CPU seconds, wall seconds) over ``repeats`` runs of exactly ``sweeps`` sweeps, and the last result."""
    best_cpu = best_wall = float("inf")
    for _ in range(repeats):
        cpu, wall = time.process_time(), time.perf_counter()
        result = solver(g, B, max_sweeps=sweeps, tol=0.0, row_key=row_key)
        best_cpu, best_wall = min(best_cpu, time.process_time() - cpu), min(best_wall, time.perf_counter() - wall)
    return best_cpu, best_wall, result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[3072, 500, 500, 500, 10])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-12)
    ap.add_argument("--max-sweeps", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)

    t = time.perf_counter()
    g, B, key = mlp(args.widths, args.seed)
    print(f"MLP {args.widths}: n = {B.shape[0]:,} params, H = {B.shape[1]:,} units, nnz(B) = {B.nnz:,}, "
          f"log10 g in [{np.log10(g.min()):.1f}, {np.log10(g.max()):.1f}]  (built in {time.perf_counter() - t:.2f}s)")

    # 1. both solvers to convergence
    runs = {"coordinate": solve_coordinate(g, B, tol=args.tol, max_sweeps=args.max_sweeps, row_key=key),
            "block": solve_block(g, B, tol=args.tol, max_sweeps=args.max_sweeps, row_key=key)}
    for r in runs.values():
        print(f"{r.method:>10}: F {r.f_initial:.10e} -> {r.f_final:.10e}  sweeps {r.sweeps:4d}  converged {r.converged}  "
              f"{r.seconds:7.3f}s wall  (setup {r.times[0]:.3f}s, {(r.times[-1] - r.times[0]) / max(r.sweeps, 1) * 1e3:.2f} "
              f"ms/sweep)  max|z| {r.max_abs_z:.3f}  |grad|max {r.grad_max:.2e}  grad_rel {r.grad_rel:.2e}  "
              f"log-spread of g {r.log_spread_initial:.2f} -> {r.log_spread_final:.2f}")
    coord, fast = runs["coordinate"], runs["block"]
    print(f"F(block) - F(coordinate) = {fast.f_final - coord.f_final:+.3e}  "
          f"(relative {(fast.f_final - coord.f_final) / abs(coord.f_final):+.2e})")

    # 2. time each to the same F: the worse of the two final values, 1e-9 relative slack; each solver
    # given B with its row keys (as cm.pathcond() does), then the bare B (keys re-derived, B re-checked)
    target = max(coord.f_final, fast.f_final)
    target += 1e-9 * abs(target)
    k_coord, k_fast = first_at_or_below(coord, target), first_at_or_below(fast, target)
    print(f"to reach F <= {target:.10e}: coordinate {k_coord} sweeps, block {k_fast} sweeps "
          f"(best of {args.repeat}, setup and report included)")
    speedups = []
    for label, row_key in (("B with row keys", key), ("bare B", None)):
        cpu_c, wall_c, _ = timed(solve_coordinate, g, B, k_coord, args.repeat, row_key)
        cpu_f, wall_f, check = timed(solve_block, g, B, k_fast, args.repeat, row_key)
        assert check.f_final <= target, (check.f_final, target)
        speedups.append(cpu_c / cpu_f)
        print(f"  {label:>15}: coordinate {cpu_c:.3f}s CPU ({wall_c:.3f}s wall), block {cpu_f:.4f}s CPU "
              f"({wall_f:.4f}s wall)  ->  speedup {cpu_c / cpu_f:.1f}x CPU, {wall_c / wall_f:.1f}x wall")
    iter_c = coord.times[k_coord] - coord.times[0]
    iter_f = fast.times[k_fast] - fast.times[0]
    print(f"sweeps only (wall, from the converged runs): coordinate {iter_c:.3f}s, block {iter_f:.4f}s -> "
          f"{iter_c / iter_f:.0f}x; setup: coordinate {coord.times[0]:.3f}s, block {fast.times[0]:.3f}s")
    return speedups


if __name__ == "__main__":
    main()
