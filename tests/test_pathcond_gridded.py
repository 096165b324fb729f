"""solve_newton on pairs whose dense layers stay factored (`GriddedPairs`) against the same solver
on every pair materialised (`group_compact` of g): the same z, F, degenerate and bound units; the
report's summary with those layers factored (`GridSummary`) against `summarize` of g."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pathir.analyses.unit_rows import CompactRows
from pathir.pairs.factored_grid import FactoredGrid
from pathir.pairs.gridded_pairs import GriddedPairs
from pathir.pairs.unit_pairs import group_compact
from pathir.pathcond.g_summary import summarize, with_grids
from pathir.pathcond.grid_summary import GridSummary
from pathir.pathcond.solvers import solve, solve_newton


@st.composite
def mlps(draw):
    """A layered MLP's g: each weight's an outer product b aᵀ (some factors 0: dead units), each
    bias's its b; inputs and outputs pinned ("no unit"), factors spread over up to ~1200 nats."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    widths = [draw(st.integers(1, 5)) for _ in range(draw(st.integers(3, 5)))]
    spread = draw(st.sampled_from([0.5, 3.0, 150.0]))
    dead = draw(st.sampled_from([0.0, 0.2]))
    H = sum(widths[1:-1])
    starts = np.cumsum([0] + widths[1:-1])
    units = [np.full(widths[0], H)] + [starts[k] + np.arange(w) for k, w in enumerate(widths[1:-1])] + [np.full(widths[-1], H)]
    weights, biases = [], []
    for k in range(len(widths) - 1):
        b = np.exp(rng.uniform(-spread, spread, widths[k + 1])) * (rng.random(widths[k + 1]) >= dead)
        a = np.exp(rng.uniform(-spread, spread, widths[k])) * (rng.random(widths[k]) >= dead)
        weights.append((b, a, units[k + 1], units[k]))
        biases.append((b * np.exp(rng.uniform(-spread, spread)), units[k + 1]))
    groups = np.repeat(np.arange(len(widths) - 2), widths[1:-1])
    return H, weights, biases, groups


def rows_of(H, weights, biases):
    ends = [(e[:, None], l[None, :]) for _, _, e, l in weights] + [(e, np.full(e.size, H)) for _, e in biases]
    shapes = [(b.size, a.size) for b, a, _, _ in weights] + [(b.size,) for b, _ in biases]
    return CompactRows(tuple(ends), tuple(shapes), np.zeros(H))


def both_ways(mlp, **options):
    H, weights, biases, groups = mlp
    rows = rows_of(H, weights, biases)
    g = [np.outer(b, a) for b, a, _, _ in weights] + [b for b, _ in biases]
    materialised = solve_newton(None, None, row_key=rows, pairs=group_compact(g, rows), groups=groups, **options)
    bias_rows = rows_of(H, [], biases)
    grids = tuple(grid for grid in (FactoredGrid.of_outer(b, a, e, l, H) for b, a, e, l in weights) if grid is not None)
    gridded = GriddedPairs(group_compact([b for b, _ in biases], bias_rows), grids)
    factored = solve_newton(None, None, row_key=rows, pairs=gridded, groups=groups, **options)
    return materialised, factored, gridded, rows, groups


def assert_same(a, b):
    assert a.converged == b.converged
    np.testing.assert_array_equal(a.degenerate, b.degenerate)
    np.testing.assert_allclose(b.z, a.z, rtol=1e-9, atol=1e-9 * max(1.0, np.abs(a.z).max(initial=0.0)))
    np.testing.assert_allclose([b.f_initial, b.f_final], [a.f_initial, a.f_final], rtol=1e-12, atol=1e-9)


@settings(derandomize=True, max_examples=60, deadline=None)
@given(mlps(), st.sampled_from([float("inf"), 2.0]))
def test_newton_on_factored_grids_matches_the_materialised_pairs(mlp, bound):
    materialised, factored, _, _, _ = both_ways(mlp, max_log_scale=bound)
    assert_same(materialised, factored)
    assert materialised.extra["at_bound"] == factored.extra["at_bound"]


@settings(derandomize=True, max_examples=20, deadline=None)
@given(mlps())
def test_block_solver_and_warm_sweeps_read_gridded_pairs_materialised(mlp):
    materialised, _, gridded, rows, groups = both_ways(mlp, warm_sweeps=3)
    assert_same(materialised, solve_newton(None, None, row_key=rows, pairs=gridded, groups=groups, warm_sweeps=3))
    H, weights, biases, _ = mlp
    g = [np.outer(b, a) for b, a, _, _ in weights] + [b for b, _ in biases]
    block = solve(None, None, method="block", row_key=rows, pairs=group_compact(g, rows))
    assert_same(block, solve(None, None, method="block", row_key=rows, pairs=gridded))


def balance_of(H, weights, biases):
    """A = -Bᵀ1: per unit, the rows entering it minus the rows leaving it."""
    A = np.zeros(H + 1)
    for b, a, e, l in weights:
        np.add.at(A, e, a.size)
        np.add.at(A, l, -b.size)
    for b, e in biases:
        np.add.at(A, e, 1)
    return A[:H]


@settings(derandomize=True, max_examples=100, deadline=None)
@given(mlps(), st.integers(0, 2**32 - 1))
def test_summary_with_factored_grids_matches_the_summary_of_g(mlp, seed):
    H, weights, biases, _ = mlp
    rows = rows_of(H, weights, biases)
    g = [np.outer(b, a) for b, a, _, _ in weights] + [b for b, _ in biases]
    _, expected = summarize(g, rows)
    _, rest = summarize([b for b, _ in biases], rows_of(H, [], biases))
    got = with_grids(rest, tuple(GridSummary.of_outer(b, a, e, l) for b, a, e, l in weights))
    assert (got.n, got.kept) == (expected.n, expected.kept)
    assert np.isclose(got.sum_log, expected.sum_log, rtol=1e-12, atol=1e-9)
    rng = np.random.default_rng(seed)
    z = rng.normal(size=H) * 5
    balance = balance_of(H, weights, biases)
    np.testing.assert_allclose(got.spreads(z), expected.spreads(z), rtol=1e-12, atol=1e-9)
    assert np.isclose(got.kept_shift(z, balance), expected.kept_shift(z, balance), rtol=1e-12, atol=1e-9)
    f0, f1 = rng.normal(size=2) * 100
    np.testing.assert_allclose(got.divergences(f0, f1, z, balance), expected.divergences(f0, f1, z, balance),
                               rtol=1e-12, atol=1e-8)
