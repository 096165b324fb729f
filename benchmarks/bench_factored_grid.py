"""What keeping a dense layer's pairs factored would save the Newton solver, per point.

One grid of alexnet's fc2 shape (4096 entered x 4096 left units, masses u_e v_l): the
materialised pairs as ``cm.pathcond()`` builds them today (g = b aᵀ grouped by `group_compact`,
`PairLaplacian` on its dense `PairMatrix` block) against `FactoredGrid` (`of_outer` on b and a),
for the grouping and for the work of one Newton iteration (E, I and O at z, then one
Hessian-vector product), and the memory each holds. Both answers are
checked equal before timing. Ratios are measured in one process; best and median of --repeat.

Run:  python benchmarks/bench_factored_grid.py [--rows 4096] [--cols 4096] [--repeat 7]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import tracemalloc

import numpy as np

from pathir.analyses.unit_rows import CompactRows
from pathir.pairs.factored_grid import FactoredGrid
from pathir.pairs.pair_laplacian import PairLaplacian
from pathir.pairs.unit_pairs import Pairs, group_compact, pad


def grid_and_pairs(rows: int, cols: int, seed: int = 0) -> tuple[FactoredGrid, Pairs]:
    rng = np.random.default_rng(seed)
    H = rows + cols
    grid = FactoredGrid(np.arange(rows), rows + np.arange(cols), rng.normal(size=rows), rng.normal(size=cols), H)
    log_mass = (grid.log_u[:, None] + grid.log_v[None, :]).ravel()
    top = float(log_mass.max())
    pairs = Pairs(None, np.repeat(grid.enter, cols), np.tile(grid.leave, rows), H,
                  mass=np.exp(log_mass - top), log_top=top)
    return grid, pairs


def materialised_iteration(lap: PairLaplacian, z: np.ndarray, p: np.ndarray):
    point = lap.point(z, both=True)
    return point.log_e, point.hessian_times(p), point.log_e - math.log(point.total)


def factored_iteration(grid: FactoredGrid, z: np.ndarray, p: np.ndarray):
    H = grid.num_units
    point = grid.point(z)
    inc, out, hp = np.zeros(H + 1), np.zeros(H + 1), np.zeros(H + 1)
    point.add_sides(inc, out, point.log_scale)
    point.add_hessian_times(pad(p), hp, point.log_scale)
    return point.log_total(), hp[:H], point.log_scale


def timed(fn, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def peak_bytes(fn) -> int:
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    grid, pairs = grid_and_pairs(args.rows, args.cols)
    rng = np.random.default_rng(1)
    z, p = rng.normal(size=grid.num_units) * 0.3, rng.normal(size=grid.num_units)
    lap = PairLaplacian(pairs)
    (log_m, hp_m, scale_m), (log_f, hp_f, scale_f) = materialised_iteration(lap, z, p), factored_iteration(grid, z, p)
    assert math.isclose(log_m, log_f, rel_tol=1e-12)
    # each product is over its own point's scale
    np.testing.assert_allclose(hp_m, hp_f * math.exp(scale_f - scale_m), rtol=1e-9, atol=1e-12 * np.abs(hp_m).max())
    b, a = np.exp(grid.log_u), np.exp(grid.log_v)
    g = np.outer(b, a)
    layout = CompactRows(((grid.enter[:, None], grid.leave[None, :]),), (g.shape,), np.zeros(grid.num_units))
    grouped = group_compact(g, layout)
    of_outer = FactoredGrid.of_outer(b, a, grid.enter, grid.leave, grid.num_units).materialise()
    assert np.array_equal(grouped.enter, of_outer.enter) and np.array_equal(grouped.leave, of_outer.leave)
    np.testing.assert_allclose(grouped.log_mass, of_outer.log_mass, rtol=1e-12, atol=1e-12)
    del grouped, of_outer
    rows = {
        "group g (group_compact)": timed(lambda: group_compact(g, layout), args.repeat),
        "grid of b, a (of_outer)": timed(lambda: FactoredGrid.of_outer(b, a, grid.enter, grid.leave, grid.num_units),
                                         args.repeat),
        "PairLaplacian build": timed(lambda: PairLaplacian(pairs), args.repeat),
        "iteration, materialised": timed(lambda: materialised_iteration(lap, z, p), args.repeat),
        "iteration, factored": timed(lambda: factored_iteration(grid, z, p), args.repeat),
    }
    print(f"grid {args.rows} x {args.cols} ({grid.size / 1e6:.1f} M pairs), {args.repeat} repeats")
    print(f"{'step':26s} {'best s':>10s} {'median s':>10s}")
    for name, times in rows.items():
        print(f"{name:26s} {min(times):10.5f} {statistics.median(times):10.5f}")
    for what, (slow, fast) in {"grouping": ("group g (group_compact)", "grid of b, a (of_outer)"),
                               "iteration": ("iteration, materialised", "iteration, factored")}.items():
        m, f = rows[slow], rows[fast]
        print(f"{what} ratio materialised / factored: best {min(m) / min(f):.0f}x, "
              f"median {statistics.median(m) / statistics.median(f):.0f}x")
    print(f"held: pairs {(pairs.mass.nbytes + pairs.enter.nbytes + pairs.leave.nbytes) / 2**20:.0f} MiB, "
          f"grid {(grid.log_u.nbytes + grid.log_v.nbytes + grid.enter.nbytes + grid.leave.nbytes) / 2**10:.0f} KiB")
    print(f"peak of one iteration: materialised {peak_bytes(lambda: materialised_iteration(lap, z, p)) / 2**20:.2f} MiB, "
          f"factored {peak_bytes(lambda: factored_iteration(grid, z, p)) / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
