"""The equalization objectives' evaluation against their definitions: the stacked smoothed maxima
(pathir.equalization.stack) cell by cell, and every objective's gradient against finite differences."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pathir
from pathir.equalization import stack as stack_module
from pathir.equalization.objective import Objective
from pathir.equalization.run import _noise_weights, _path_weights
from pathir.equalization.stack import GridStack
from pathir.equalization.tensors import quantized_params, tensor_pairs
from pathir.testing import relu_dags


def _definition(log, zr, zc, sign, p):
    a = log + sign * 0.5 * (zr[:, None] - zc[None, :])
    top = np.max(a)
    if not np.isfinite(top):
        return -np.inf, np.zeros(log.shape[0]), np.zeros(log.shape[1])
    if math.isinf(p):
        return top, None, None
    e = np.exp(p * (a - top))
    return top + np.log(e.sum()) / p, e.sum(1) / e.sum(), e.sum(0) / e.sum()


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1.0, 2.0, 8.0, 32.0, 256.0, math.inf]), st.sampled_from([1.0, -1.0]),
       st.integers(1, 40), st.sampled_from([np.float64, np.float32]))
def test_stacked_smoothed_maxima_equal_the_definition(seed, p, sign, one_by_one, dtype):
    """At a sequence of points (a far move from where the grids were first centred, then a small one),
    every tensor's smoothed max and marginals equal the definition's (to rounding in float64; to
    float32's relative 1e-6 where the stacked grids are float32), and no grid is ever summed cell by
    cell at a finite sharpness: a product that under- or overflows re-centres the grid instead."""
    rng = np.random.default_rng(seed)
    H = 12
    logs, rows, cols = [], [], []
    for _ in range(rng.integers(1, 7)):
        shape = (rows[-1].size, cols[-1].size) if logs and rng.random() < 0.5 else rng.integers(1, 6, size=2)
        r = np.sort(rng.choice(H + 1, shape[0], replace=False))  # H: "no unit"; grids of one shape are stacked
        c = np.sort(rng.choice(H + 1, shape[1], replace=False))
        log = rng.normal(scale=3, size=(r.size, c.size))
        log[rng.random(log.shape) < rng.choice([0.3, 0.8])] = -np.inf  # dense, or kept sparse
        logs.append(log), rows.append(r), cols.append(c)
    old = stack_module.ONE_BY_ONE
    stack_module.ONE_BY_ONE = one_by_one  # dense grids above it stacked by shape, the others in the sparse block
    try:
        stack = GridStack(logs, rows, cols, sign, dtype)
    finally:
        stack_module.ONE_BY_ONE = old
    zp = np.append(rng.normal(scale=2, size=H), 0.0)
    with pytest.MonkeyPatch.context() as mp:
        if not math.isinf(p):
            mp.setattr(stack_module, "_by_cells", _never)
        for move in (0.0, 20.0, 0.1):
            zp[:H] += rng.normal(scale=move, size=H)
            values, rm, cm = stack.lse(zp, p, True)
            for t, (log, r, c) in enumerate(zip(logs, rows, cols)):
                value, mr, mc = _definition(log, zp[r], zp[c], sign, p)
                rel = 1e-12 if dtype is np.float64 else 1e-6
                assert values[t] == pytest.approx(value, rel=rel, abs=rel)
                if mr is not None and rm is not None:
                    tol = dict(rtol=100 * rel, atol=1e-14 if dtype is np.float64 else rel)
                    np.testing.assert_allclose(rm[stack.row_slice(t)], mr, **tol)
                    np.testing.assert_allclose(cm[stack.col_slice(t)], mc, **tol)


def _never(*args, **kwargs):
    raise AssertionError("a grid summed cell by cell at a finite sharpness")


@pytest.mark.parametrize("kind", ["noise", "range", "path-metric"])
@settings(max_examples=10, deadline=None)
@given(graph=relu_dags(max_neurons=30, max_paths=300), seed=st.integers(0, 2**31 - 1))
def test_objective_gradients_equal_finite_differences(kind, graph, seed):
    if not quantized_params(graph):
        return
    cm = pathir.compile(graph)
    facts = cm.facts
    weights = {"noise": _noise_weights, "path-metric": _path_weights}.get(kind)
    weights = weights(facts.graph, cm.get_backend(None)) if weights else None
    objective = Objective(tensor_pairs(facts.graph, facts.units, facts.row_ends, weights), kind)
    H = objective.H
    if H == 0:
        return
    rng = np.random.default_rng(seed)
    z = rng.normal(size=H)
    for p in (2.0, 8.0):
        value, grad = objective.value_and_grad(z, p)
        if not math.isfinite(value):
            continue
        h = 1e-6
        for j in rng.choice(H, min(H, 4), replace=False):
            e = np.zeros(H)
            e[j] = h
            fd = (objective.value(z + e, p) - objective.value(z - e, p)) / (2 * h)
            assert grad[j] == pytest.approx(fd, rel=1e-5, abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 200), st.integers(2, 16), st.integers(1, 64), st.integers(0, 2**31 - 1))
def test_blockwise_quantized_sqnr_equals_the_quantized_copys(n, bits, chunk, seed):
    """The report's per-tensor SQNR, read a block at a time, is the SQNR of the quantized copy."""
    from pathir.equalization.tensors import quantize, quantized_sqnr_db, sqnr_db

    value = np.random.default_rng(seed).standard_cauchy(size=(n, 3))
    value[0, 0] = 0.0
    want = sqnr_db(value, quantize(value, bits))
    got = quantized_sqnr_db(value, bits, chunk=chunk)
    assert got == pytest.approx(want, rel=1e-9) if np.isfinite(want) else got == want


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 100), st.integers(2, 16), st.integers(-900, 900), st.integers(0, 2**31 - 1))
def test_quantized_sqnr_is_scale_free_to_the_ends_of_float64(n, bits, k, seed):
    """A tensor scaled by 2^k (exact in float64, its entries as large as 1e271 or as small as 1e-271)
    quantizes to the same relative grid: the report's SQNR is the same number, not nan or ±inf (the
    squares of such entries leave float64)."""
    from pathir.equalization.tensors import quantize, quantized_sqnr_db, sqnr_db

    value = np.random.default_rng(seed).normal(size=(n, 3))
    scaled = np.ldexp(value, k)
    want = quantized_sqnr_db(value, bits)
    assert quantized_sqnr_db(scaled, bits, chunk=7) == pytest.approx(want, rel=1e-12) if np.isfinite(want) else \
        quantized_sqnr_db(scaled, bits) == want
    assert sqnr_db(scaled, quantize(scaled, bits)) == pytest.approx(sqnr_db(value, quantize(value, bits)), rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.integers(1, 6), st.integers(0, 1), st.booleans(), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_runs_reduce_as_reduceat_does(groups, run, other, axis, ragged, boolean, seed):
    """The pair grid's reduction over runs of one length (a reshaped axis) equals ``reduceat``: maxima
    and counts of booleans exactly, float sums to rounding; ragged runs take ``reduceat`` itself."""
    from pathir.equalization.tensors import _reduce_runs

    rng = np.random.default_rng(seed)
    n = groups * run
    starts = np.arange(0, n, run)
    if ragged and n > 2:
        starts = np.unique(np.r_[0, rng.integers(1, n, size=2)])
    shape = (other, n) if axis == 1 else (n, other)
    v = rng.normal(size=shape) > 0 if boolean else rng.normal(size=shape)
    for ufunc in (np.add,) if boolean else (np.maximum, np.add):
        want = ufunc.reduceat(v, starts, axis=axis, dtype=np.float64)
        got = _reduce_runs(v, ufunc, starts, axis)
        if ufunc is np.add and not boolean:  # float sums in another order: to rounding
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
        else:  # maxima and counts: exact
            np.testing.assert_array_equal(got, want)


@settings(max_examples=15, deadline=None)
@given(graph=relu_dags(max_neurons=30, max_paths=300), seed=st.integers(0, 2**31 - 1),
       margin=st.sampled_from([0.0, 0.05, 0.5, 5.0]), bound=st.sampled_from([8.0, np.inf]))
def test_cutting_planes_reach_the_whole_linear_programs_optimum(graph, seed, margin, bound):
    """The range objective's LP solved on the cells near each tensor's max, cut by cut, ends at the
    optimum of the LP over every cell (whatever the first set: a margin of 0 starts from the maxima
    alone; in a box or without one), or gives up (None) where that optimum lies beyond its reach of
    z0; and it gives up rather than hold more cells than it is allowed."""
    from pathir.equalization.solver import cutting_plane_range_optimum, exact_range_optimum

    if not quantized_params(graph):
        return
    facts = pathir.compile(graph).facts
    objective = Objective(tensor_pairs(facts.graph, facts.units, facts.row_ends), "range")
    H = objective.H
    if H == 0:
        return
    z0 = np.random.default_rng(seed).normal(size=H)
    lo, hi = np.full(H, -bound), np.full(H, bound)
    whole = exact_range_optimum(objective, z0, lo, hi)
    cut = cutting_plane_range_optimum(objective, z0, lo, hi, margin=margin)
    assert whole is not None
    if cut is None:  # only where the optimum nearest z0 needs a move beyond the LP's reach
        assert np.max(np.abs(whole - z0)) > 8.0 - 1e-6
        return
    assert objective.value(cut) == pytest.approx(objective.value(whole), abs=1e-7)
    assert np.all(cut >= lo - 1e-9) and np.all(cut <= hi + 1e-9)
    assert cutting_plane_range_optimum(objective, z0, lo, hi, margin=margin, max_cells=0) is None


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 14), st.sampled_from([1.0, 2.0]), st.sampled_from([1.0, -1.0]))
def test_low_rank_grids_equal_the_definition(seed, rank, p, sign):
    """Grids whose exponential is a sum of ``rank`` positive outer products, one of them spread over many
    decades (as the noise objective's diag-G masses are: mass after a unit times mass before one), are factored (certified cell by cell) and their smoothed
    values and marginals equal the definition's to rounding at every z, far from 0 included; a grid of
    independent entries beside them is not factored and is summed as before; any other sharpness is
    summed cell by cell."""
    from pathir.equalization.low_rank import EPS, factor_grid

    rng = np.random.default_rng(seed)
    H = 150
    logs, rows, cols = [], [], []
    for shape in ((40, 60), (64, 32), (50, 50)):
        scale_r, scale_c = rng.normal(scale=8, size=shape[0]), rng.normal(scale=8, size=shape[1])
        a, b = rng.random((shape[0], rank - 1)), rng.random((shape[1], rank - 1))
        logs.append((np.log(1.0 + a @ b.T) + scale_r[:, None] + scale_c[None, :]) / p)
        rows.append(np.sort(rng.choice(H, shape[0], replace=False)))
        cols.append(np.sort(rng.choice(H, shape[1], replace=False)))
    logs.append(rng.normal(scale=3, size=(48, 48)))  # independent entries: full rank
    rows.append(np.sort(rng.choice(H, 48, replace=False)))
    cols.append(np.sort(rng.choice(H, 48, replace=False)))
    f = factor_grid(logs[0], p, np.random.default_rng(0))
    if rank <= 4:  # (a rank over a quarter of the smaller side is left dense)
        d, e, P, Q = f
        exact = np.exp(p * logs[0] - d[:, None] - e[None, :])
        assert np.all(np.abs(P @ Q.T - exact) <= EPS * exact)
    assert factor_grid(logs[3], p, np.random.default_rng(0)) is None
    stack = GridStack(logs, rows, cols, sign, np.float64, low_rank_at=p)
    factored = [] if stack.low is None else sorted(stack.low.tensors.tolist())
    assert 3 not in factored and (rank > 4 or factored == [0, 1, 2])
    zp = np.append(rng.normal(scale=3, size=H), 0.0)
    for q in (p, 2 * p, math.inf):
        values, rm, cm = stack.lse(zp, q, True)
        for t, (log, r, c) in enumerate(zip(logs, rows, cols)):
            value, mr, mc = _definition(log, zp[r], zp[c], sign, q)
            assert values[t] == pytest.approx(value, rel=1e-12, abs=1e-12)
            if mr is not None:
                np.testing.assert_allclose(rm[stack.row_slice(t)], mr, rtol=1e-8, atol=1e-14)
                np.testing.assert_allclose(cm[stack.col_slice(t)], mc, rtol=1e-8, atol=1e-14)
