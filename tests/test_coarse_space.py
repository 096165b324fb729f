"""The coarse space of the rescaling solvers (pathir.pairs.coarse, pathir.pathcond.coarse_start)
against dense matrices and a generic minimiser."""

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize

import pathir
from pathir.pairs.coarse import CoarseSpace, unit_groups
from pathir.pairs.pair_laplacian import PairLaplacian
from pathir.pairs.unit_pairs import Pairs
from pathir.pathcond.coarse_start import coarse_shift
from pathir.testing import relu_dags


@st.composite
def pair_problems(draw):
    """Distinct unit pairs over H units ("no unit" = H), positive masses, random groups."""
    H = draw(st.integers(1, 7))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    cells = rng.choice((H + 1) ** 2, size=draw(st.integers(1, (H + 1) ** 2)), replace=False)
    cells.sort()
    enter, leave = cells // (H + 1), cells % (H + 1)
    mass = np.exp(rng.uniform(-3, 3, cells.size))
    if draw(st.booleans()):  # linear masses: the factored point (mass matrix, dense blocks)
        pairs = Pairs(None, enter, leave, H, mass / mass.max(), math.log(mass.max()))
    else:  # log masses: the explicit point (pair by pair)
        pairs = Pairs(np.log(mass), enter, leave, H)
    groups = rng.integers(0, draw(st.integers(1, H)), H)
    return pairs, mass, groups, rng


def dense_laplacian(pairs, t):
    """Σ_k t_k (u_e - u_l)(u_e - u_l)ᵀ over the units (the "no unit" row and column dropped)."""
    H = pairs.num_units
    L = np.zeros((H + 1, H + 1))
    for e, l, w in zip(pairs.enter, pairs.leave, t):
        v = np.zeros(H + 1)
        v[e] += 1.0
        v[l] -= 1.0
        L += w * np.outer(v, v)
    return L[:H, :H]


@given(pair_problems(), st.data())
@settings(max_examples=80, deadline=None)
def test_the_preconditioner_is_jacobi_plus_the_galerkin_coarse_solve(problem, data):
    pairs, t, groups, rng = problem
    H = pairs.num_units
    free = rng.random(H) < 0.8
    damping = data.draw(st.sampled_from([0.0, 0.3]))
    space = CoarseSpace(groups, H)
    point = PairLaplacian(pairs).point(np.zeros(H))
    assert math.isclose(point.total * math.exp(point.log_e - math.log(point.total)), t.sum(), rel_tol=1e-12)
    q = t / t.sum()
    inc = np.bincount(pairs.enter, weights=q, minlength=H + 1)[:H]
    out = np.bincount(pairs.leave, weights=q, minlength=H + 1)[:H]
    c = (out - inc) * free
    L = dense_laplacian(pairs, q)
    D = np.diag(L).copy()
    hess = L + damping * np.diag(D) - np.outer(c, c)
    jacobi = np.where(free & (D > 0), 1.0 / np.where(D > 0, D, 1.0), 0.0)
    table = space.aggregate(point, free) / point.total
    apply = space.preconditioner(table, space.restrict(inc + out + damping * D, free), c, free, jacobi)
    # the definition: P restricted to the free units, the Galerkin matrix PᵀHP, groups without free units
    # or without mass on them (a zero diagonal) dropped
    _, dense_groups = np.unique(groups, return_inverse=True)
    P = np.zeros((H, space.m))
    P[np.arange(H), dense_groups] = free
    galerkin = np.diag(P.T @ hess @ P)
    keep = P.any(axis=0) & (galerkin > 1e-10 * (P.T @ (inc + out + damping * D)))
    P = P[:, keep]
    coarse = P.T @ hess @ P
    if apply is None:  # refused only where the Galerkin matrix is singular (or has no scale)
        assert not keep.any() or np.linalg.eigvalsh(coarse).min() <= 1e-9 * max(1.0, np.abs(coarse).max())
        return
    well_posed = not keep.any() or np.linalg.cond(coarse) < 1e8
    for _ in range(3):
        r = rng.normal(size=H) * free
        out = apply(r)
        assert np.all(np.isfinite(out)) and float(r @ out) >= 0  # positive semi-definite: CG stays sound
        if well_posed:  # (a singular Galerkin matrix, F flat along a group shift, is regularised)
            expected = jacobi * r + P @ np.linalg.solve(coarse, P.T @ r) if keep.any() else jacobi * r
            np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-9 * np.abs(expected).max())


def f_tilde(T, a, n, w):
    wp = np.append(w, 0.0)
    terms = T * np.exp(wp[None, :] - wp[:, None])
    return n * math.log(terms.sum()) + a @ w


@given(pair_problems(), st.sampled_from([0.3, 2.0, math.inf]))
@settings(max_examples=60, deadline=None)
def test_the_coarse_shift_minimises_f_over_the_box(problem, bound):
    """F restricted to one shift per group, for the pairs of a network (c_k rows per pair, so that F is
    bounded below), against L-BFGS-B on the same function."""
    pairs, mass, groups, rng = problem
    H = pairs.num_units
    counts = rng.integers(1, 4, mass.size)
    n = int(counts.sum())
    A = (np.bincount(pairs.enter, weights=counts, minlength=H + 1) - np.bincount(pairs.leave, weights=counts,
                                                                                minlength=H + 1))[:H]
    space = CoarseSpace(groups, H)
    m = space.m
    point = PairLaplacian(pairs).point(np.zeros(H))
    T, a = space.aggregate(point) * (mass.sum() / point.total), space.restrict(A)
    expected = np.zeros((m + 1, m + 1))
    np.add.at(expected, (space.padded[pairs.enter], space.padded[pairs.leave]), mass)
    np.testing.assert_allclose(T, expected, rtol=1e-12, atol=1e-12 * mass.sum())
    lo, hi = np.full(m, -bound), np.full(m, bound)
    w, drop = coarse_shift(T, a, n, lo, hi)
    assert np.all(w >= lo) and np.all(w <= hi)
    assert math.isclose(drop, f_tilde(T, a, n, w) - f_tilde(T, a, n, np.zeros(m)), rel_tol=1e-9, abs_tol=1e-9)
    solvable = (T[:m].sum(axis=1) > 0) & (T[:, :m].sum(axis=0) > 0)
    box = [(lo[i], hi[i]) if solvable[i] else (0.0, 0.0) for i in range(m)]
    box = [(None if math.isinf(l) else l, None if math.isinf(h) else h) for l, h in box]
    ref = minimize(lambda x: f_tilde(T, a, n, x), np.zeros(m), method="L-BFGS-B", bounds=box,
                   options={"ftol": 1e-15, "gtol": 1e-12, "maxiter": 2000})
    assert f_tilde(T, a, n, w) <= ref.fun + 1e-7 * max(1.0, abs(ref.fun))


def test_units_are_grouped_by_the_node_they_start_in():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 5), torch.nn.ReLU(),
                              torch.nn.Linear(5, 2))
    cm = pathir.compile(net, input_shape=(3,))
    groups = unit_groups(cm.units)
    assert groups.tolist() == [0] * 4 + [1] * 5
    first_nodes = [members[0][0] for members in cm.units.members]
    assert len(set(first_nodes)) == len(set(groups.tolist()))


@settings(max_examples=30, deadline=None)
@given(relu_dags())
def test_unit_groups_number_the_first_member_nodes_in_unit_order(graph):
    """From the channel arrays alone, as from the members: units whose first member lies in one node share
    a group, groups numbered in the order their first unit comes."""
    units = pathir.compile(graph).units
    index: dict[str, int] = {}
    expected = [index.setdefault(members[0][0], len(index)) for members in units.members]
    assert unit_groups(units).tolist() == expected
    assert len(units) == len(units.members)
