"""FactoredGrid's separable sums against its pairs formed one by one (the definition) and against
`PairLaplacian` on the materialised pairs, masses and z spanning far more than float64's range; rank
one (a dense layer) and rank k (a 1×1 convolution: rows U_e, V_l of k entries within 1e100)."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pathir.analyses.unit_rows import CompactRows
from pathir.pairs.factored_grid import FactoredGrid
from pathir.pairs.pair_laplacian import PairLaplacian
from pathir.pairs.unit_pairs import group_compact, pad


@st.composite
def grids(draw):
    """A grid over H units, "no unit" (H) allowed on either side, units possibly on both sides,
    log-masses spread over up to ~1600 nats, and a z of spread up to ~1000 nats."""
    H = draw(st.integers(1, 9))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spread = draw(st.sampled_from([0.0, 1.0, 50.0, 400.0]))
    sides = []
    for _ in range(2):
        units = np.flatnonzero(rng.random(H + 1) < rng.uniform(0.2, 1.0))
        sides.append(units if units.size else np.array([rng.integers(H + 1)]))
    enter, leave = sides
    factors = ()
    k = draw(st.sampled_from([0, 0, 1, 3]))  # 0: rank one; else rank-k rows
    if k:
        factors = tuple(_bounded_rows(rng, n, k, draw(st.sampled_from([1.0, 1e6, 1e99]))) for n in (enter.size, leave.size))
    grid = FactoredGrid(enter, leave, rng.uniform(-spread, spread, enter.size),
                        rng.uniform(-spread, spread, leave.size), H, *factors)
    z = rng.normal(size=H) * draw(st.sampled_from([0.0, 0.5, 30.0, 250.0]))
    return grid, z, rng.normal(size=H)


def _bounded_rows(rng, n: int, k: int, spread: float) -> np.ndarray:
    """n rows of k entries in [1/spread, 1], each row's largest exactly 1."""
    rows = np.exp(rng.uniform(-math.log(spread), 0.0, (n, k)))
    return rows / rows.max(axis=1, keepdims=True)


def _log_terms(grid: FactoredGrid, z: np.ndarray):
    """(enter, leave, log t) of every pair: t = P e^{z_e - z_l}."""
    pairs, zp = grid.materialise(), pad(z)
    return pairs.enter, pairs.leave, pairs.log_mass + zp[pairs.enter] - zp[pairs.leave]


def _log_sum_by(unit: np.ndarray, v: np.ndarray, size: int) -> np.ndarray:
    out = np.full(size, -math.inf)
    for h in np.unique(unit):
        w = v[unit == h]
        out[h] = w.max() + math.log(np.exp(w - w.max()).sum())
    return out


@settings(derandomize=True, max_examples=200, deadline=None)
@given(grids())
def test_logs_match_the_pairs_one_by_one(case):
    grid, z, _ = case
    e, l, v = _log_terms(grid, z)
    point = grid.point(z)
    top = v.max()
    assert math.isclose(point.log_total(), top + math.log(np.exp(v - top).sum()), rel_tol=1e-12, abs_tol=1e-9)
    log_in, log_out = point.log_sides()
    H = grid.num_units
    np.testing.assert_allclose(log_in, _log_sum_by(e, v, H + 1)[grid.enter], rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(log_out, _log_sum_by(l, v, H + 1)[grid.leave], rtol=1e-12, atol=1e-9)
    lo, hi = point.log_extremes()
    assert math.isclose(lo, v.min(), rel_tol=1e-12, abs_tol=1e-9)
    assert math.isclose(hi, v.max(), rel_tol=1e-12, abs_tol=1e-9)
    assert math.isclose(grid.log_mass_sum(), float(grid.materialise().log_mass.sum()), rel_tol=1e-12, abs_tol=1e-8)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(grids())
def test_linear_sums_and_hessian_match_the_pair_laplacian(case):
    grid, z, p = case
    H = grid.num_units
    reference = PairLaplacian(grid.materialise()).point(z)
    scale = reference.log_e - math.log(reference.total)
    point = grid.point(z)
    inc, out = np.zeros(H + 1), np.zeros(H + 1)
    point.add_sides(inc, out, scale)
    np.testing.assert_allclose(inc[:H], reference.inc, rtol=1e-11, atol=1e-290)
    np.testing.assert_allclose(out[:H], reference.out, rtol=1e-11, atol=1e-290)
    hp = np.zeros(H + 1)
    point.add_hessian_times(pad(p), hp, scale)
    # the definition: Σ_k t_k (p_e - p_l)(δ_e - δ_l), t in the reference's scale
    e, l, v = _log_terms(grid, z)
    t, pp = np.exp(v - scale), pad(p)
    d = t * (pp[e] - pp[l])
    definition = (np.bincount(e, d, H + 1) - np.bincount(l, d, H + 1))[:H]
    bound = np.bincount(e, t * np.abs(pp[e] - pp[l]), H + 1)[:H] + np.bincount(l, t * np.abs(pp[e] - pp[l]), H + 1)[:H]
    assert np.all(np.abs(hp[:H] - definition) <= 1e-11 * (bound + np.abs(t).max() * np.abs(pp).max()) + 1e-290)
    assert np.all(np.abs(hp[:H] - reference.hessian_times(p)) <= 1e-10 * (bound + (reference.inc + reference.out) * np.abs(p)) + 1e-290)


@st.composite
def dense_layers(draw):
    """A dense param's g = b aᵀ over H units: rows entering units (or all pinned, H), columns leaving
    units in runs of equal units (a flatten) or one each, some factors 0 (dead units), factors spread
    over up to ~1400 nats (grouping then runs in log space)."""
    H = draw(st.integers(1, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    out, channels, run = draw(st.integers(1, 6)), draw(st.integers(1, 5)), draw(st.sampled_from([1, 1, 3]))
    enter = np.full(out, H) if draw(st.booleans()) else rng.permutation(H + 1)[:out] if out <= H + 1 else rng.integers(0, H + 1, out)
    leave = np.repeat(rng.permutation(H + 1)[:channels], run) if channels <= H + 1 else np.repeat(np.arange(channels) % (H + 1), run)
    spread = draw(st.sampled_from([0.0, 2.0, 350.0]))
    b = np.exp(rng.uniform(-spread, spread, out)) * (rng.random(out) < 0.8)
    a = np.exp(rng.uniform(-spread, spread, leave.size)) * (rng.random(leave.size) < 0.8)
    return H, b, a, np.asarray(enter, dtype=np.int64), leave.astype(np.int64)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(dense_layers())
def test_of_outer_gives_the_pairs_that_grouping_g_gives(layer):
    H, b, a, enter, leave = layer
    g = np.outer(b, a)
    rows = CompactRows(((enter[:, None], leave[None, :]),), (g.shape,), np.zeros(H))
    expected = group_compact(g.ravel(), rows)
    grid = FactoredGrid.of_outer(b, a, enter, leave, H)
    if grid is None:
        assert expected.size == 0
        return
    got = grid.materialise()
    np.testing.assert_array_equal(got.enter, expected.enter)
    np.testing.assert_array_equal(got.leave, expected.leave)
    np.testing.assert_allclose(got.log_mass, expected.log_mass, rtol=1e-12, atol=1e-12)


@settings(derandomize=True, max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 4), st.sampled_from([1.0, 1e3, 1e99]), st.booleans())
def test_of_low_rank_gives_the_pairs_that_grouping_g_gives(seed, k, spread, pinned):
    """g = b aᵀ of rank k (rows within ``spread``, some all zero), outputs entering distinct units or all
    pinned, inputs leaving units in runs (a flatten) or one each: the grid's pairs are g's grouped."""
    rng = np.random.default_rng(seed)
    H = int(rng.integers(1, 8))
    out, channels, run = int(rng.integers(1, 6)), int(rng.integers(1, 5)), int(rng.choice([1, 3]))
    enter = np.full(out, H) if pinned else rng.integers(0, H + 1, out)
    leave = np.repeat(rng.integers(0, H + 1, channels), run)
    b = _bounded_rows(rng, out, k, spread) * np.exp(rng.uniform(-300, 300, (out, 1))) * (rng.random((out, 1)) < 0.8)
    a = _bounded_rows(rng, leave.size, k, spread) * np.exp(rng.uniform(-300, 300, (leave.size, 1))) \
        * (rng.random((leave.size, 1)) < 0.8)
    expected_logs = np.full((out, leave.size), -np.inf)
    live = np.outer(b.max(1) > 0, a.max(1) > 0)
    bs, as_ = b.max(1, keepdims=True), a.max(1, keepdims=True)
    with np.errstate(divide="ignore"):  # log g in log space: row scales apart, the normalised rows' products
        expected_logs[live] = (np.log(bs) + np.log(as_).T + np.log((b / np.where(bs > 0, bs, 1)) @ (a / np.where(as_ > 0, as_, 1)).T))[live]
    pairs = {}  # (unit entered, unit left) -> log Σ g over its entries, the grouping's definition
    for o, i in zip(*np.nonzero(live)):
        pairs.setdefault((int(enter[o]), int(leave[i])), []).append(expected_logs[o, i])
    keys = sorted(pairs)
    grid = FactoredGrid.of_low_rank(b, a, enter, leave, H)
    if grid is None:
        assert not keys
        return
    got = grid.materialise()
    assert list(zip(got.enter.tolist(), got.leave.tolist())) == keys
    want = [max(v) + math.log(sum(math.exp(x - max(v)) for x in v)) for v in (pairs[key] for key in keys)]
    np.testing.assert_allclose(got.log_mass, want, rtol=1e-12, atol=1e-9)


@settings(derandomize=True, max_examples=150, deadline=None)
@given(grids(), st.integers(1, 4), st.integers(0, 2**32 - 1), st.booleans())
def test_grouped_table_and_self_terms_match_the_pair_laplacian(case, m1, seed, masked):
    grid, z, _ = case
    H = grid.num_units
    rng = np.random.default_rng(seed)
    groups = rng.integers(0, m1, H + 1)
    keep = (rng.random(H + 1) < 0.7).astype(float) if masked else None
    reference = PairLaplacian(grid.materialise()).point(z)
    scale = reference.log_e - math.log(reference.total)
    point = grid.point(z)
    table = np.zeros((m1, m1))
    point.add_grouped(table, groups, keep, scale)
    np.testing.assert_allclose(table, reference.grouped(groups, m1, keep), rtol=1e-11, atol=1e-290)
    selfs = np.zeros(H + 1)
    point.add_self_terms(selfs, scale)
    np.testing.assert_allclose(selfs[:H], reference.self_terms(), rtol=1e-11, atol=1e-290)


@settings(derandomize=True, max_examples=150, deadline=None)
@given(grids(), st.integers(0, 2**32 - 1))
def test_freeze_gives_the_pairs_that_freezing_the_materialised_pairs_gives(case, seed):
    grid, _, _ = case
    H = grid.num_units
    units = np.flatnonzero(np.random.default_rng(seed).random(H) < 0.4)
    got, expected = grid.freeze(units).materialise(), grid.materialise().freeze(units)
    np.testing.assert_array_equal(got.enter, expected.enter)
    np.testing.assert_array_equal(got.leave, expected.leave)
    np.testing.assert_allclose(got.log_mass, expected.log_mass, rtol=1e-12, atol=1e-9)
