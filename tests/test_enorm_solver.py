"""ENorm on arrays (docs/math.md §8) against its definition E(z) = Σ c_i w_i e^{-(Bz)_i}."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.special import logsumexp
from test_pathcond_solvers import dead_units_by_definition, incidence, mlp_rows, problems, resnet_rows

from pathir.enorm.solver import enorm_objective, solve_enorm, solve_enorm_block, solve_enorm_coordinate, unit_balance


def e_reference(m, B, z):
    return math.exp(logsumexp(np.log(m) - B.toarray() @ z))


def sides(m, B, z):
    """(O_h, I_h): cost-weighted rescaled mass leaving / entering each unit, from dense B."""
    dense = B.toarray()
    u = m * np.exp(-dense @ z)
    return (dense > 0).T @ u, (dense < 0).T @ u


@st.composite
def enorm_problems(draw, spreads=(0.1, 1.0, 3.0)):
    w, B = draw(problems(spreads=spreads))
    c = None
    if draw(st.booleans()):
        c = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).uniform(0.5, 4.0, w.size)
    return w, B, c


@given(enorm_problems())
@settings(max_examples=40)
def test_sweeps_decrease_e_and_reach_the_balanced_fixed_point(problem):
    w, B, c = problem
    m = w if c is None else w * c
    results = [solve_enorm_coordinate(w, B, c, tol=1e-14, max_sweeps=5000),
               solve_enorm_block(w, B, c, tol=1e-14, max_sweeps=5000)]
    for r in results:
        assert r.converged and r.degenerate.size == 0
        assert np.all(np.diff(r.history) <= 1e-12 * r.history[1:])  # monotone
        assert r.e_initial == pytest.approx(e_reference(m, B, np.zeros(B.shape[1])), rel=1e-12)
        assert r.e_final == pytest.approx(e_reference(m, B, r.z), rel=1e-12)
        out_mass, in_mass = sides(m, B, r.z)
        np.testing.assert_allclose(out_mass, in_mass, rtol=1e-9)  # every unit balanced
        assert r.imbalance < 1e-9
        np.testing.assert_allclose(unit_balance(w, B, r.z, c), np.log(out_mass / in_mass), atol=1e-12)
    coord, block = results
    assert block.e_final == pytest.approx(coord.e_final, rel=1e-9)


@given(enorm_problems(spreads=(0.1, 3.0, 30.0, 300.0)))
@settings(max_examples=40)
def test_one_coordinate_step_is_the_exact_unit_minimiser(problem):
    w, B, c = problem
    m = w if c is None else w * c
    r = solve_enorm_coordinate(w, B, c, max_sweeps=1, tol=0.0)
    out_mass, in_mass = sides(m, B, np.zeros(B.shape[1]))
    assert r.z[0] == pytest.approx(0.5 * math.log(out_mass[0] / in_mass[0]), rel=1e-12, abs=1e-12)
    last = B.shape[1] - 1  # nothing moved after it: it is balanced against the final z
    out_mass, in_mass = sides(m, B, r.z)
    assert math.log(out_mass[last] / in_mass[last]) == pytest.approx(0, abs=1e-9)
    for t in np.linspace(-3, 3, 61):  # and no shift of that unit alone lowers E
        z = r.z.copy()
        z[last] += t
        assert e_reference(m, B, z) >= r.e_final * (1 - 1e-12)


@given(enorm_problems(), st.integers(0, 2**32 - 1))
@settings(max_examples=30)
def test_rescaled_start_reaches_the_same_normal_form(problem, seed):
    """ENorm of w e^{-Bz0} gives the same E* and the same rescaled w."""
    w, B, c = problem
    z0 = np.random.default_rng(seed).normal(scale=2.0, size=B.shape[1])
    w2 = w * np.exp(-(B @ z0))
    a, b = solve_enorm(w, B, c, tol=1e-14), solve_enorm(w2, B, c, tol=1e-14)
    assert b.e_final == pytest.approx(a.e_final, rel=1e-9)
    np.testing.assert_allclose(np.log(w) - B @ a.z, np.log(w2) - B @ b.z, atol=1e-5)


@given(enorm_problems(), st.data())
@settings(max_examples=30)
def test_degenerate_units_stay_at_zero(problem, data):
    w, B, c = problem
    dense = B.toarray()
    h = data.draw(st.integers(0, B.shape[1] - 1))
    w = w.copy()
    w[dense[:, h] == data.draw(st.sampled_from([-1.0, 1.0]))] = 0.0  # pruned: one whole side is zero
    expected = dead_units_by_definition(w, B)
    m = w if c is None else w * c
    for r in (solve_enorm_block(w, B, c, tol=1e-13), solve_enorm_coordinate(w, B, c, tol=1e-13)):
        assert r.degenerate.tolist() == expected
        assert np.all(r.z[expected] == 0.0)
        live = np.setdiff1d(np.arange(B.shape[1]), expected)
        out_mass, in_mass = sides(m, B, r.z)
        np.testing.assert_allclose(out_mass[live], in_mass[live], rtol=1e-9)


def test_costs_weight_the_balance():
    """With c, the fixed point balances Σ c w' (not Σ w'); doubling every cost changes nothing but E."""
    rows, H = resnet_rows(2, 2, 1, 2, 2)
    B = incidence(rows, H)
    rng = np.random.default_rng(0)
    w, c = rng.uniform(0.1, 2.0, len(rows)), rng.uniform(0.5, 3.0, len(rows))
    r = solve_enorm(w, B, c, tol=1e-14)
    out_c, in_c = sides(w * c, B, r.z)
    np.testing.assert_allclose(out_c, in_c, rtol=1e-9)
    out_1, in_1 = sides(w, B, r.z)
    assert np.max(np.abs(np.log(out_1 / in_1))) > 1e-3
    r2 = solve_enorm(w, B, 2 * c, tol=1e-14)
    np.testing.assert_allclose(r2.z, r.z, atol=1e-9)
    assert r2.e_final == pytest.approx(2 * r.e_final, rel=1e-12)
    assert enorm_objective(w, B, r.z, c) == pytest.approx(r.e_final, rel=1e-12)


def test_mlp_layers_are_one_block_each_colour():
    rows, H = mlp_rows([3, 4, 4, 4, 2])
    B = incidence(rows, H)
    w = np.random.default_rng(1).uniform(0.01, 3.0, len(rows))
    block, coord = solve_enorm_block(w, B, tol=1e-14), solve_enorm_coordinate(w, B, tol=1e-14)
    assert block.e_final == pytest.approx(coord.e_final, rel=1e-10)
    with pytest.raises(ValueError, match="unknown ENorm method"):
        solve_enorm(w, B, method="sinkhorn")
