"""PathCond solvers on arrays (docs/math.md §7) against the definition of F.

B matrices are built like real networks: a layered MLP (unit = hidden neuron;
in = its weight row and bias, out = its column in the next layer) and a
ResNet-like stack whose stream units are tied across every block. g is random,
log-uniform over up to 600 nats.
"""

import math

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize_scalar
from scipy.special import logsumexp

from pathir.analyses.unit_rows import RowKeys, column_balance, key_balance, keys_for, matrix_row_keys, row_units
from pathir.pairs.unit_pairs import Pairs, greedy_coloring, group_pairs, side_sums
from pathir.pathcond.solvers import gradient, objective, solve, solve_block, solve_coordinate

# ---------------------------------------------------------------- networks


def incidence(rows, H):
    """B from one (entered unit, left unit) per parameter, None for "no unit"."""
    r, c, v = [], [], []
    for i, (e, l) in enumerate(rows):
        if e is not None:
            r, c, v = r + [i], c + [e], v + [-1.0]
        if l is not None:
            r, c, v = r + [i], c + [l], v + [1.0]
    return sp.csr_array((np.array(v), (np.array(r, dtype=int), np.array(c, dtype=int))), shape=(len(rows), H))


def mlp_rows(widths, biases=True):
    unit, H = {}, 0
    for layer in range(1, len(widths) - 1):
        for j in range(widths[layer]):
            unit[layer, j], H = H, H + 1
    rows = []
    for layer in range(1, len(widths)):
        for j in range(widths[layer]):
            rows += [(unit.get((layer, j)), unit.get((layer - 1, i))) for i in range(widths[layer - 1])]
            if biases:
                rows.append((unit.get((layer, j)), None))
    return rows, H


def resnet_rows(d_in, width, inner, blocks, d_out, biases=True):
    stream = list(range(width))
    H = width
    rows = [(s, None) for s in stream for _ in range(d_in)] + ([(s, None) for s in stream] if biases else [])
    for _ in range(blocks):
        mids = list(range(H, H + inner))
        H += inner
        rows += [(m, s) for m in mids for s in stream] + ([(m, None) for m in mids] if biases else [])
        rows += [(s, m) for s in stream for m in mids] + ([(s, None) for s in stream] if biases else [])
    rows += [(None, s) for _ in range(d_out) for s in stream] + ([(None, None)] * d_out if biases else [])
    return rows, H


@st.composite
def structures(draw):
    if draw(st.booleans()):
        return mlp_rows(draw(st.lists(st.integers(1, 4), min_size=3, max_size=5)), draw(st.booleans()))
    sizes = [draw(st.integers(1, 3)) for _ in range(5)]
    return resnet_rows(*sizes, biases=draw(st.booleans()))


@st.composite
def problems(draw, spreads=(0.1, 3.0, 30.0, 300.0)):
    rows, H = draw(structures())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    g = np.exp(rng.uniform(-1, 1, len(rows)) * draw(st.sampled_from(spreads)))
    return g, incidence(rows, H)


def f_reference(g, B, z):
    bz = B.toarray() @ z
    return g.size * logsumexp(np.log(g) + bz) - bz.sum()


def rel(a, b):
    return abs(a - b) / max(1.0, abs(b))


def converged_pair(g, B):
    coord = solve_coordinate(g, B, tol=1e-14, max_sweeps=20000)
    block = solve_block(g, B, tol=1e-14, max_sweeps=2000)
    return coord, block


# ---------------------------------------------------------------- the objective


@given(problems(), st.integers(0, 2**32 - 1))
@settings(max_examples=40)
def test_objective_convex_and_gradient_matches_finite_differences(problem, seed):
    g, B = problem
    rng = np.random.default_rng(seed)
    z1, z2 = rng.normal(size=(2, B.shape[1]))
    f1, f2 = objective(g, B, z1), objective(g, B, z2)
    assert rel(f1, f_reference(g, B, z1)) < 1e-12
    assert objective(g, B, (z1 + z2) / 2) <= (f1 + f2) / 2 + 1e-9 * max(1.0, abs(f1))
    grad = gradient(g, B, z1)
    h = 1e-5
    for k in range(B.shape[1]):
        e = np.zeros(B.shape[1])
        e[k] = h
        fd = (objective(g, B, z1 + e) - objective(g, B, z1 - e)) / (2 * h)
        assert abs(fd - grad[k]) <= 1e-5 * (1 + abs(grad[k])) + 1e-9 * abs(f1)


def test_objective_one_unit_by_hand():
    B = incidence([(0, None), (None, 0)], 1)
    g = np.array([1.0, 4.0])
    assert objective(g, B, [0.0]) == pytest.approx(2 * math.log(5))
    assert objective(g, B, [math.log(3)]) == pytest.approx(2 * math.log(1 / 3 + 12))


# ---------------------------------------------------------------- the coordinate update


@given(problems(), st.sampled_from([None, True]))
@settings(max_examples=40)
def test_coordinate_update_is_the_exact_1d_minimiser(problem, log_domain):
    """After one sweep the first unit holds argmin_t F(t e_0) and the last the 1-D argmin given the rest."""
    g, B = problem
    r = solve_coordinate(g, B, max_sweeps=1, tol=0.0, log_domain=log_domain)
    assert r.sweeps == 1
    live = np.setdiff1d(np.arange(B.shape[1]), r.degenerate)
    dense, log_g, n = B.toarray(), np.log(g), g.size
    for h, base in ((live[0], np.zeros(B.shape[1])), (live[-1], r.z)):
        bz = dense @ base - dense[:, h] * base[h]

        def line(t, h=h, bz=bz):  # F with z_h = t, the other units at ``base``
            u = bz + np.multiply.outer(np.atleast_1d(t), dense[:, h])
            return n * logsumexp(log_g + u, axis=1) - u.sum(axis=1)

        t_star = r.z[h]
        f_star = line(t_star)[0]
        assert line(t_star + np.linspace(-4, 4, 801)).min() >= f_star - 1e-10 * max(1.0, abs(f_star))
        best = minimize_scalar(lambda t: line(t)[0], bracket=(t_star - 1, t_star + 1), tol=1e-12)
        assert f_star <= best.fun + 1e-10 * max(1.0, abs(best.fun))


def test_coordinate_linear_and_log_domains_agree():
    rows, H = mlp_rows([3, 4, 2, 2])
    g = np.exp(np.random.default_rng(0).uniform(-5, 5, len(rows)))
    B = incidence(rows, H)
    lin = solve_coordinate(g, B, max_sweeps=7, tol=0.0, log_domain=False)
    log = solve_coordinate(g, B, max_sweeps=7, tol=0.0, log_domain=True)
    assert not lin.extra["log_domain"] and log.extra["log_domain"]
    np.testing.assert_allclose(lin.z, log.z, atol=1e-10)
    np.testing.assert_allclose(lin.history, log.history, rtol=1e-12)


# ---------------------------------------------------------------- solvers to convergence


@given(problems())
@settings(max_examples=60)
def test_block_solver_reaches_coordinate_minimum(problem):
    """The default solver ends at least as low as coordinate descent, with a vanishing gradient.

    With g over hundreds of nats some units carry e^-30 of S: F is flat to
    machine precision along them and coordinate descent may crawl for
    thousands of sweeps; the comparison then holds against wherever it got.
    """
    g, B = problem
    coord = solve_coordinate(g, B, tol=1e-14, max_sweeps=3000)
    block = solve_block(g, B, tol=1e-14, max_sweeps=3000)
    plain = solve_block(g, B, tol=1e-14, max_sweeps=3000, anderson=0)
    assert block.converged
    for r in (coord, block, plain):
        assert rel(r.f_final, f_reference(g, B, r.z)) < 1e-12
        assert r.f_initial == pytest.approx(f_reference(g, B, np.zeros(B.shape[1])), rel=1e-12)
        assert np.all(np.diff(r.history) <= 1e-12 * np.abs(r.history[1:]) + 1e-9)  # monotone
    assert block.f_final <= coord.f_final + 1e-9 * max(1.0, abs(coord.f_final))
    if plain.converged and coord.converged:
        assert rel(plain.f_final, coord.f_final) < 1e-9
    np.testing.assert_allclose(gradient(g, B, block.z), 0, atol=1e-6 * g.size)
    assert block.grad_max <= 1e-6 * g.size


def test_block_solver_balances_a_real_mlp():
    """diag G of a small torch-initialised MLP: every unit balanced to 1e-8 of its own terms."""
    rng = np.random.default_rng(5)
    widths = [12, 8, 6, 8, 3]
    Ws = [rng.uniform(-1, 1, (b, a)) / math.sqrt(a) for a, b in zip(widths[:-1], widths[1:])]
    bs = [rng.uniform(-1, 1, b) / math.sqrt(a) for a, b in zip(widths[:-1], widths[1:])]
    fwd, bwd = [np.ones(widths[0])], [np.ones(widths[-1])]
    for W, b in zip(Ws, bs):
        fwd.append(W**2 @ fwd[-1] + b**2)
    for W in reversed(Ws):
        bwd.insert(0, bwd[0] @ W**2)
    # mlp_rows order: per layer, per neuron j, its weights (j <- i) then its bias
    g = np.concatenate([np.c_[np.outer(bwd[k + 1], fwd[k]), bwd[k + 1]].ravel() for k in range(len(Ws))])
    B = incidence(*mlp_rows(widths))
    block, coord = solve_block(g, B, tol=1e-14), solve_coordinate(g, B, tol=1e-14)
    assert block.converged and coord.converged and block.extra["colours"] == 2
    assert block.grad_rel < 1e-8
    assert block.f_final <= coord.f_final + 1e-12 * abs(coord.f_final)
    assert block.f_final < block.f_initial


@given(structures(), st.floats(1e-300, 1e300))
@settings(max_examples=30)
def test_constant_g_leaves_the_network_as_is(structure, value):
    """docs/math.md §11: all g_i equal => z* = 0."""
    rows, H = structure
    g, B = np.full(len(rows), value), incidence(rows, H)
    for r in (solve_block(g, B), solve_coordinate(g, B)):
        assert r.max_abs_z < 1e-9
        assert r.f_final == pytest.approx(r.f_initial, rel=1e-12)


@given(problems(spreads=(0.1, 3.0, 30.0)), st.integers(0, 2**32 - 1))
@settings(max_examples=40)
def test_rescaling_the_input_changes_nothing(problem, seed):
    """F'(z) = F(z + z0) + Σ(Bz0) for g' = g e^{Bz0}: the same minimum, shifted by Σ(Bz0)."""
    g, B = problem
    z0 = np.random.default_rng(seed).normal(scale=3.0, size=B.shape[1])
    bz0 = B @ z0
    g2 = g * np.exp(bz0)
    a, b = solve(g, B, tol=1e-14), solve(g2, B, tol=1e-14)
    assert b.f_initial == pytest.approx(f_reference(g, B, z0) + bz0.sum(), rel=1e-12)
    # over tens of nats F is ill-conditioned enough that float64 stops both runs a little apart
    assert rel(b.f_final, a.f_final + bz0.sum()) < (1e-10 if np.ptp(np.log(g)) < 10 else 1e-8)


@given(problems(spreads=(0.1, 1.0, 3.0)), st.integers(0, 2**32 - 1))
@settings(max_examples=40)
def test_rescaling_the_input_gives_the_same_rescaled_g(problem, seed):
    """The optimal g e^{Bz*} is unique up to one factor (F is strictly convex in Bz but along 1).

    Only for moderate spreads: with g over hundreds of nats F can be flat to
    machine precision along units that carry e^-30 of S, and z there is not
    determined by F at all.
    """
    g, B = problem
    z0 = np.random.default_rng(seed).normal(scale=3.0, size=B.shape[1])
    g2 = g * np.exp(B @ z0)
    a, b = solve(g, B, tol=1e-14), solve(g2, B, tol=1e-14)
    ga, gb = np.log(g) + B @ a.z, np.log(g2) + B @ b.z
    np.testing.assert_allclose(ga - logsumexp(ga), gb - logsumexp(gb), atol=1e-6)


# ---------------------------------------------------------------- degenerate units


def dead_units_by_definition(g, B):
    dense = B.toarray()
    return [h for h in range(B.shape[1]) if not ((g[dense[:, h] < 0] > 0).any() and (g[dense[:, h] > 0] > 0).any())]


@given(problems(spreads=(0.1, 3.0)), st.data())
@settings(max_examples=30)
def test_degenerate_units_are_found_and_kept_at_zero(problem, data):
    g, B = problem
    H = B.shape[1]
    dense = B.toarray()
    h = data.draw(st.integers(0, H - 1))
    side = data.draw(st.sampled_from([-1.0, 1.0]))
    g = g.copy()
    g[dense[:, h] == side] = 0.0  # a dead (or pruned) neuron: no mass on one whole side
    expected = dead_units_by_definition(g, B)
    assert h in expected
    coord, block = converged_pair(g, B)
    for r in (coord, block):
        assert r.degenerate.tolist() == expected
        assert np.all(r.z[expected] == 0.0)
        assert math.isfinite(r.f_final) and r.f_final <= r.f_initial
    assert block.f_final <= coord.f_final + 1e-9 * max(1.0, abs(coord.f_final))


def test_all_units_degenerate_or_none():
    rows, H = mlp_rows([2, 3, 1])
    B = incidence(rows, H)
    g = np.ones(len(rows))
    g[[i for i, (e, l) in enumerate(rows) if l is not None]] = 0.0  # no unit has outgoing mass
    for r in (solve_block(g, B), solve_coordinate(g, B)):
        assert r.degenerate.tolist() == [0, 1, 2] and r.max_abs_z == 0.0 and r.converged
    empty = sp.csr_array((4, 0))
    r = solve(np.ones(4), empty)
    assert r.z.shape == (0,) and r.f_final == pytest.approx(4 * math.log(4))


# ---------------------------------------------------------------- inputs and plumbing


def test_bad_inputs_are_rejected():
    good = incidence([(0, None), (None, 0)], 1)
    with pytest.raises(ValueError, match="only -1, 0 and"):
        solve(np.ones(2), sp.csr_array(np.array([[-2.0], [1.0]])))
    with pytest.raises(ValueError, match="two -1 entries"):
        solve(np.ones(2), sp.csr_array(np.array([[-1.0, -1.0], [1.0, 1.0]])))
    with pytest.raises(ValueError, match="non-negative"):
        solve(np.array([1.0, -1.0]), good)
    with pytest.raises(ValueError, match="3 entries but B has 2 rows"):
        solve(np.ones(3), good)
    with pytest.raises(ValueError, match="unknown PathCond method"):
        solve(np.ones(2), good, method="gauss-seidel")


@given(structures(), st.integers(0, 2**32 - 1))
@settings(max_examples=30)
def test_unit_pairs_regroup_the_rows_exactly(structure, seed):
    rows, H = structure
    B = incidence(rows, H)
    enter, leave, _ = row_units(B)
    assert [(None if e == H else e, None if l == H else l) for e, l in zip(enter, leave)] == rows
    rng = np.random.default_rng(seed)
    m = np.exp(rng.uniform(-400, 400, len(rows))) * (rng.random(len(rows)) < 0.8)
    z = rng.normal(scale=400.0, size=H)  # exponents far beyond float64: the log-space fallback
    pairs = group_pairs(m, matrix_row_keys(B)[0], H)
    zp = np.append(z, 0.0)
    with np.errstate(divide="ignore"):
        direct = logsumexp(np.log(m) + B @ z)
    via_pairs = logsumexp(pairs.log_mass + zp[pairs.leave] - zp[pairs.enter]) if pairs.log_mass.size else -np.inf
    assert via_pairs == pytest.approx(direct, rel=1e-12, abs=1e-9)
    order = np.argsort(pairs.leave, kind="stable")
    assert np.array_equal(pairs.by_leave.order, order)  # the counting sort is the stable sort
    assert np.array_equal(pairs.by_leave.leave, pairs.leave[order])
    assert np.array_equal(pairs.by_leave.enter, pairs.enter[order])
    sums = side_sums(pairs.leave[order], pairs.enter[order], pairs.log_mass[order], H + 1)
    for row, value in zip(sums.rows, sums(-zp)):
        k = pairs.leave == row
        assert value == pytest.approx(logsumexp(pairs.log_mass[k] - zp[pairs.enter[k]]), rel=1e-12, abs=1e-9)


@given(structures(), st.integers(0, 2**32 - 1), st.sampled_from([0.0, 3.0, 500.0]))
@settings(max_examples=30)
def test_linear_and_log_grouping_agree(structure, seed, spread):
    """Masses within ~650 nats are grouped linearly (``mass`` kept), wider ones in log-space; both
    give the same pair masses, side sums and column balance."""
    rows, H = structure
    B = incidence(rows, H)
    key, _ = matrix_row_keys(B)
    rng = np.random.default_rng(seed)
    m = np.exp(rng.uniform(-spread, spread, len(rows))) * (rng.random(len(rows)) < 0.8)
    pairs = group_pairs(m, key, H)
    positive = m[m > 0]
    if positive.size:
        assert (pairs.mass is not None) == (positive.min() > positive.max() * 1e-282)
    via_sort = Pairs(*_log_grouped(m, key, H), H)
    assert np.array_equal(pairs.enter, via_sort.enter) and np.array_equal(pairs.leave, via_sort.leave)
    np.testing.assert_allclose(pairs.log_mass, via_sort.log_mass, rtol=1e-13, atol=1e-12)
    if pairs.mass is not None:
        np.testing.assert_allclose(np.log(pairs.mass) + pairs.log_top, pairs.log_mass, rtol=1e-13, atol=1e-12)
        by_leave = np.argsort(pairs.leave, kind="stable")
        zp = np.append(rng.normal(scale=3.0, size=H), 0.0)
        args = (pairs.leave[by_leave], pairs.enter[by_leave])
        linear = side_sums(*args, None, H + 1, pairs.mass[by_leave], pairs.log_top)
        logged = side_sums(*args, pairs.log_mass[by_leave], H + 1)
        np.testing.assert_allclose(linear(-zp), logged(-zp), rtol=1e-12, atol=1e-12)
    assert np.array_equal(key_balance(key, H), column_balance(B))


def _log_grouped(m, key, H):
    """(log P_k, enter_k, leave_k) by the definition: sort the rows with m > 0 by key, log-sum-exp each run."""
    keep = m > 0
    m, key = m[keep], key[keep]
    keys = np.unique(key)
    log_mass = np.array([logsumexp(np.log(m[key == k])) for k in keys])
    return log_mass, keys // (H + 1), keys % (H + 1)


def _sequential_greedy(pairs, active):
    """The definition: units in index order, each the smallest colour unused by its lower active neighbours."""
    H = pairs.num_units
    lower = [set() for _ in range(H)]
    for e, l in zip(pairs.enter.tolist(), pairs.leave.tolist()):
        if e < H and l < H and e != l and active[e] and active[l]:
            lower[max(e, l)].add(min(e, l))
    colour = np.full(H, -1)
    for u in np.flatnonzero(active):
        used = {colour[v] for v in lower[u]}
        colour[u] = min(set(range(len(used) + 1)) - used)
    return colour


@given(st.integers(1, 40), st.integers(0, 200), st.integers(0, 2**32 - 1))
@settings(max_examples=150)
def test_greedy_colouring_by_runs_is_the_sequential_greedy(H, num_pairs, seed):
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(0, (H + 1) ** 2, num_pairs))
    pairs = Pairs(np.zeros(keys.size), keys // (H + 1), keys % (H + 1), H)
    active = rng.random(H) < 0.85
    colour = greedy_coloring(pairs, active)
    assert np.array_equal(colour, _sequential_greedy(pairs, active))
    ends = (pairs.enter < H) & (pairs.leave < H) & (pairs.enter != pairs.leave)
    e, l = pairs.enter[ends], pairs.leave[ends]
    both = active[e] & active[l]
    assert (colour[e[both]] != colour[l[both]]).all()


def test_row_keys_given_by_the_caller_are_checked_and_used():
    rows, H = resnet_rows(3, 2, 2, 2, 2)
    B = incidence(rows, H)
    key, _ = matrix_row_keys(B)
    g = np.exp(np.random.default_rng(5).uniform(-2, 2, len(rows)))
    for method in ("block", "coordinate"):
        plain = solve(g, B, method=method, tol=1e-13)
        for keys_given in (key, RowKeys(key, column_balance(B))):
            np.testing.assert_array_equal(plain.z, solve(g, B, method=method, tol=1e-13, row_key=keys_given).z)
    with pytest.raises(ValueError, match="RowKeys for 3 units"):
        keys_for(B, RowKeys(key, np.zeros(3)))
    with pytest.raises(ValueError, match="integer vector of length"):
        keys_for(B, key[:-1])
    with pytest.raises(ValueError, match="must lie in"):
        keys_for(B, key + (H + 1) ** 2)
    with pytest.raises(ValueError, match="does not describe the rows of B"):
        keys_for(B, key[::-1].copy())


def test_frozen_pairs_merge():
    pairs = Pairs(np.log([1.0, 2.0, 4.0]), np.array([0, 1, 2]), np.array([2, 2, 1]), 2)
    frozen = pairs.freeze([1])  # (1, none) and (none, 1) both become (none, none)
    assert frozen.enter.tolist() == [0, 2] and frozen.leave.tolist() == [2, 2]
    np.testing.assert_allclose(np.exp(frozen.log_mass), [1.0, 6.0])
    assert pairs.degenerate().tolist() == [0]  # unit 0 is never left


# ---------------------------------------------------------------- numerics at the edges


@pytest.mark.parametrize("a", [-7, -1, 0, 1, 7])
@pytest.mark.parametrize("log_r", [-900.0, -40.0, 0.0, 3.0, 299.0, 301.0, 900.0])
def test_positive_root_in_log_space(a, log_r):
    """log_positive_root (block: alpha = gamma = n) and the coordinate solver's scalar one vs mpmath."""
    import mpmath

    from pathir.pathcond.coordinate import log_root
    from pathir.pathcond.objective import log_positive_root

    mpmath.mp.dps = 60
    n = 10
    r = mpmath.exp(log_r)
    for alpha, gamma, got in ((n, n, log_positive_root(a, log_r, n, n)),
                              (n + a, n - a, log_positive_root(a, log_r, n + a, n - a)),
                              (n + a, n - a, log_root(a, log_r, n))):
        y = (-a * r + mpmath.sqrt(a * a * r * r + 4 * alpha * gamma)) / (2 * alpha) if a <= 0 else \
            2 * gamma / (a * r + mpmath.sqrt(a * a * r * r + 4 * alpha * gamma))
        # in mpmath throughout: a r y may lie far beyond float64 (and pytest.approx takes float tolerances only)
        assert abs(alpha * y * y + a * r * y - gamma) <= mpmath.mpf(10) ** -40 * (1 + abs(a * r * y))
        assert float(got) == pytest.approx(float(mpmath.log(y)), rel=1e-13, abs=1e-13)


def test_coordinate_switches_to_log_space_when_the_range_outgrows_float64():
    rows, H = resnet_rows(2, 2, 2, 2, 2)
    B = incidence(rows, H)
    g = np.exp(np.random.default_rng(3).uniform(-360, 360, len(rows)))
    forced = solve_coordinate(g, B, tol=1e-14, log_domain=False)
    auto = solve_coordinate(g, B, tol=1e-14)
    assert forced.extra["log_domain"] and auto.extra["log_domain"]
    assert rel(forced.f_final, auto.f_final) < 1e-12
    block = solve_block(g, B, tol=1e-14)
    assert block.f_final <= auto.f_final + 1e-9 * abs(auto.f_final)


def test_many_units_group_by_sorting():
    """H large enough that the (H+1)² pair keys are grouped with np.unique rather than a dense bincount."""
    rows, H = mlp_rows([2, 2100, 1])
    B = incidence(rows, H)
    g = np.exp(np.random.default_rng(4).uniform(-3, 3, len(rows)))
    coord, block = solve_coordinate(g, B, tol=1e-14), solve_block(g, B, tol=1e-14)
    # pairs: (h, none) for 2 weights + bias, (none, h) for the output weight, (none, none) for the output bias
    assert block.extra["colours"] == 1 and block.extra["pairs"] == 2 * H + 1
    assert block.f_final <= coord.f_final + 1e-9 * abs(coord.f_final)
    assert block.grad_rel < 1e-8


# ---------------------------------------------------------------- without B


@given(problems(), st.integers(1, 7))
@settings(max_examples=30)
def test_block_solver_on_row_keys_alone_is_the_solver_on_b(problem, chunk):
    """With a RowKeys the block solver needs no B: same z, same F, same log-spreads (B z read from the
    keys a chunk of rows at a time)."""
    from pathir.analyses.unit_rows import row_shifts
    from pathir.pathcond.objective import bz_log_spreads

    g, B = problem
    key, H = matrix_row_keys(B)
    rows = RowKeys(key, column_balance(B))
    with_b, without = solve(g, B, row_key=rows), solve(g, None, row_key=rows)
    np.testing.assert_array_equal(with_b.z, without.z)
    assert with_b.f_final == without.f_final and without.B is None
    shifts = np.concatenate([bz for _, bz in row_shifts(key, with_b.z, chunk=chunk)])
    np.testing.assert_allclose(shifts, B @ with_b.z, rtol=0, atol=1e-12 * (1 + np.abs(with_b.z).max()))
    expected = bz_log_spreads(g, B, with_b.z)
    assert without.log_spread_initial == pytest.approx(expected[0], rel=1e-9, abs=1e-9)
    assert without.log_spread_final == pytest.approx(expected[1], rel=1e-9, abs=1e-9)


def test_only_the_block_solver_runs_without_b():
    rows, H = mlp_rows([2, 3, 1])
    B = incidence(rows, H)
    keys = RowKeys(matrix_row_keys(B)[0], column_balance(B))
    with pytest.raises(ValueError, match="needs B itself"):
        solve(np.ones(len(rows)), None, method="coordinate", row_key=keys)
    with pytest.raises(ValueError, match="must be a RowKeys"):
        solve(np.ones(len(rows)), None, row_key=keys.key)
