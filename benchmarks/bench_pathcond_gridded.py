"""PathCond's grouping + Newton solve on an MLP with its dense layers kept factored or materialised.

The MLP is alexnet's classifier by default (9216-4096-4096-1000 with biases, inputs and outputs
pinned); each weight's diag G is an outer product b aᵀ of positive random factors, as a dense
layer's is (docs/math.md §6). Materialised: g grouped by `group_compact` and Newton on the
`Pairs` (what ``cm.pathcond()`` does today); factored: `FactoredGrid.of_outer` on b and a, the
biases grouped, Newton on the `GriddedPairs`. Both are checked to give the same z first. Times
are measured in one process; best and median of --repeat.

Run:  python benchmarks/bench_pathcond_gridded.py [--widths 9216 4096 4096 1000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from pathir.analyses.unit_rows import CompactRows
from pathir.pairs.factored_grid import FactoredGrid
from pathir.pairs.gridded_pairs import GriddedPairs
from pathir.pairs.unit_pairs import group_compact
from pathir.pathcond.solvers import solve_newton


def mlp(widths, seed=0):
    """(H, weights as (b, a, enter units, leave units), biases as (b, enter units), rows, groups)."""
    rng = np.random.default_rng(seed)
    H = sum(widths[1:-1])
    starts = np.cumsum([0] + list(widths[1:-1]))
    units = [np.full(widths[0], H)] + [starts[k] + np.arange(w) for k, w in enumerate(widths[1:-1])]
    units.append(np.full(widths[-1], H))
    weights = [(rng.uniform(0.5, 2.0, widths[k + 1]), rng.uniform(0.5, 2.0, widths[k]), units[k + 1], units[k])
               for k in range(len(widths) - 1)]
    biases = [(b * rng.uniform(0.5, 2.0, b.size), e) for b, _, e, _ in weights]
    ends = [(e[:, None], l[None, :]) for _, _, e, l in weights] + [(e, np.full(e.size, H)) for _, e in biases]
    shapes = [(b.size, a.size) for b, a, _, _ in weights] + [(b.size,) for b, _ in biases]
    bias_rows = CompactRows(tuple(ends[len(weights):]), tuple(shapes[len(weights):]), np.zeros(H))
    rows = CompactRows(tuple(ends), tuple(shapes), np.zeros(H))
    return H, weights, biases, rows, bias_rows, np.repeat(np.arange(len(widths) - 2), widths[1:-1])


def materialised(H, weights, biases, rows, bias_rows, groups):
    g = [np.outer(b, a) for b, a, _, _ in weights] + [b for b, _ in biases]
    t0 = time.perf_counter()
    pairs = group_compact(g, rows)
    del g
    t1 = time.perf_counter()
    result = solve_newton(None, None, row_key=rows, pairs=pairs, groups=groups)
    return result, t1 - t0, time.perf_counter() - t1


def factored(H, weights, biases, rows, bias_rows, groups):
    t0 = time.perf_counter()
    grids = tuple(FactoredGrid.of_outer(b, a, e, l, H) for b, a, e, l in weights)
    pairs = GriddedPairs(group_compact([b for b, _ in biases], bias_rows), grids)
    t1 = time.perf_counter()
    result = solve_newton(None, None, row_key=rows, pairs=pairs, groups=groups)
    return result, t1 - t0, time.perf_counter() - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="+", default=[9216, 4096, 4096, 1000])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    problem = mlp(args.widths)
    runs = {"materialised": [], "factored": []}
    for _ in range(args.repeat):
        m, f = materialised(*problem), factored(*problem)
        np.testing.assert_allclose(f[0].z, m[0].z, rtol=1e-9, atol=1e-9)
        runs["materialised"].append(m[1:])
        runs["factored"].append(f[1:])
    print(f"MLP {args.widths}: {m[0].extra['pairs']} materialised pairs, {args.repeat} repeats, same z checked")
    print(f"{'':14s} {'group best':>10s} {'median':>8s} {'solve best':>10s} {'median':>8s}")
    for name, times in runs.items():
        group, solve = [t[0] for t in times], [t[1] for t in times]
        print(f"{name:14s} {min(group):10.4f} {statistics.median(group):8.4f} {min(solve):10.4f} {statistics.median(solve):8.4f}")
    for step, k in (("group", 0), ("solve", 1)):
        m, f = [t[k] for t in runs["materialised"]], [t[k] for t in runs["factored"]]
        print(f"{step} ratio materialised / factored: best {min(m) / min(f):.1f}x, "
              f"median {statistics.median(m) / statistics.median(f):.1f}x")


if __name__ == "__main__":
    main()
