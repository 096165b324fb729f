"""ENorm by projected Newton-CG (pathir.enorm.newton) against the reference sweeps and the definition."""

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_enorm_solver import e_reference, enorm_problems, sides
from test_pathcond_solvers import dead_units_by_definition, incidence, mlp_rows

import pathir
from pathir.analyses.facts import GraphFacts
from pathir.enorm.run import enorm
from pathir.enorm.solver import solve_enorm, solve_enorm_block, solve_enorm_coordinate
from pathir.testing import relu_dags


def unit_steps_by_definition(m, B, z, bound=None, live=None):
    """Per unit, its exact ENorm update (clamped to the box) at z, from dense B: the stopping rule's quantity."""
    out_mass, in_mass = sides(m, B, z)
    with np.errstate(divide="ignore", invalid="ignore"):
        target = z + 0.5 * np.log(out_mass / in_mass)
    if bound is not None:
        target = np.clip(target, -bound, bound)
    step = target - z
    return step if live is None else step[live]


@given(enorm_problems(spreads=(0.1, 1.0, 3.0, 30.0)))
@settings(max_examples=50, deadline=None)
def test_newton_reaches_the_reference_optimum_and_its_stopping_rule_holds(problem):
    w, B, c = problem
    m = w if c is None else w * c
    reference = solve_enorm_coordinate(w, B, c, tol=1e-13, max_sweeps=20000)
    r = solve_enorm(w, B, c, method="newton", tol=1e-10)
    assert r.converged and r.method == "newton" and r.degenerate.size == 0
    assert r.e_final <= reference.e_final * (1 + 1e-12)
    assert r.e_final == pytest.approx(e_reference(m, B, r.z), rel=1e-12)
    assert r.e_initial == pytest.approx(e_reference(m, B, np.zeros(B.shape[1])), rel=1e-12)
    steps = unit_steps_by_definition(m, B, r.z)
    assert np.max(np.abs(steps), initial=0.0) <= 1e-10 * (1 + 1e-3) + 1e-13  # every unit balanced
    assert r.step == pytest.approx(np.max(np.abs(steps), initial=0.0), abs=1e-12)
    assert np.all(np.diff(r.history) <= 1e-12 * r.history[0])  # every iteration lowers E


@given(enorm_problems(spreads=(1.0, 3.0, 30.0)), st.one_of(st.just(0.0), st.floats(0.01, 2.0)))
@settings(max_examples=50, deadline=None)
def test_box_constrained_optimum_matches_the_clamped_sweeps(problem, bound):
    """|z| ≤ L: Newton, block and coordinate reach one E (the box problem is convex); at the end every
    free unit is balanced and every unit at the bound would step out of the box."""
    w, B, c = problem
    m = w if c is None else w * c
    results = [solve_enorm(w, B, c, method=k, tol=1e-11, max_sweeps=20000, max_log_scale=bound)
               for k in ("newton", "block", "coordinate")]
    unbounded = solve_enorm(w, B, c, tol=1e-11)
    best = min(r.e_final for r in results)
    for r in results:
        assert r.converged, r.method
        assert np.all(np.abs(r.z) <= bound)
        assert r.e_final == pytest.approx(best, rel=1e-8)
        assert r.e_final >= unbounded.e_final * (1 - 1e-12)
        assert np.max(np.abs(unit_steps_by_definition(m, B, r.z, bound)), initial=0.0) <= 1.1e-11
        free = np.setdiff1d(np.arange(B.shape[1]), r.at_bound)
        out_mass, in_mass = sides(m, B, r.z)
        np.testing.assert_allclose(out_mass[free], in_mass[free], rtol=1e-9)
        pushing = np.log(out_mass[r.at_bound] / in_mass[r.at_bound]) * np.sign(r.z[r.at_bound])
        assert np.all(pushing >= -1e-9)  # the unconstrained update points out of the box
    if np.max(np.abs(unbounded.z)) > bound * (1 + 1e-6) + 1e-9:
        assert results[0].at_bound.size > 0


@given(enorm_problems(spreads=(0.1, 3.0)), st.data())
@settings(max_examples=30, deadline=None)
def test_newton_keeps_degenerate_units_at_zero(problem, data):
    w, B, c = problem
    dense = B.toarray()
    h = data.draw(st.integers(0, B.shape[1] - 1))
    w = w.copy()
    w[dense[:, h] == data.draw(st.sampled_from([-1.0, 1.0]))] = 0.0
    expected = dead_units_by_definition(w, B)
    m = w if c is None else w * c
    r = solve_enorm(w, B, c, method="newton", tol=1e-11)
    reference = solve_enorm_block(w, B, c, tol=1e-13, max_sweeps=20000)
    assert r.converged and r.degenerate.tolist() == expected and np.all(r.z[expected] == 0.0)
    live = np.setdiff1d(np.arange(B.shape[1]), expected)
    assert np.max(np.abs(unit_steps_by_definition(m, B, r.z, live=live)), initial=0.0) <= 1.1e-11
    assert r.e_final <= reference.e_final * (1 + 1e-12)


@given(relu_dags(), st.sampled_from([1.0, 2.0]))
@settings(max_examples=30, deadline=None)
def test_newton_on_random_dags_against_the_block_reference(graph, p):
    facts = GraphFacts(graph)
    if len(facts.units) == 0:
        return
    newton = enorm(facts, p=p, solver="newton", tol=1e-11)
    block = enorm(facts, p=p, solver="block", tol=1e-13, max_sweeps=20000)
    assert newton.converged and block.converged
    assert newton.criterion_after <= block.criterion_after * (1 + 1e-12)
    assert newton.degenerate_units == block.degenerate_units
    # the criterion is Σ|θ|^p of the rescaled graph
    rescaled = pathir.compile(graph).rescaled(newton.z).incidence()[1].theta()
    assert newton.criterion_after == pytest.approx(np.sum(np.abs(rescaled) ** p), rel=1e-9)


def test_callback_sees_every_sweep_and_the_history():
    rows, H = mlp_rows([5, 6, 6, 6, 3])
    B = incidence(rows, H)
    w = np.random.default_rng(3).uniform(0.01, 9.0, len(rows))
    for method in ("newton", "block", "coordinate"):
        seen = []
        r = solve_enorm(w, B, method=method, callback=lambda k, e: seen.append((k, e)))
        assert [k for k, _ in seen] == list(range(1, r.sweeps + 1))
        np.testing.assert_allclose([e for _, e in seen], r.history[1:], rtol=1e-12)


def test_newton_needs_few_iterations_on_a_deep_narrow_chain():
    """A chain of 60 layers of width 2: the block sweeps crawl (each sweep moves information one layer), Newton does not."""
    rows, H = mlp_rows([2] + [2] * 60 + [1], biases=False)
    B = incidence(rows, H)
    w = np.exp(np.random.default_rng(0).normal(scale=2.0, size=len(rows)))
    newton = solve_enorm(w, B, method="newton")
    block = solve_enorm_block(w, B, max_sweeps=200)
    assert newton.converged and newton.sweeps <= 30 and not block.converged
    assert newton.e_final < block.e_final


def test_max_log_scale_is_checked():
    rows, H = mlp_rows([2, 3, 1])
    B = incidence(rows, H)
    with pytest.raises(ValueError, match="max_log_scale"):
        solve_enorm(np.ones(len(rows)), B, max_log_scale=-1.0)


def test_not_converged_warns_and_bounded_units_are_reported():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 6), torch.nn.ReLU(),
                              torch.nn.Linear(6, 2)).double()
    with torch.no_grad():
        net[2].weight.mul_(50.0)
    x = torch.randn(7, 4, dtype=torch.float64)
    before = net(x).detach()
    cm = pathir.compile(net, input_shape=(4,))
    with pytest.warns(pathir.NotConvergedWarning, match="raise max_sweeps"):
        report = cm.enorm(solver="block", max_sweeps=1, write_back=False)
    assert not report.converged
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        free = cm.enorm(write_back=False)
        bounded = cm.enorm(max_log_scale=0.5)
    assert free.converged and bounded.converged and free.max_abs_log_scale > 0.5
    assert bounded.max_abs_log_scale <= 0.5 and bounded.units_at_bound
    assert set(bounded.units_at_bound) <= set(cm.units.names)
    assert bounded.criterion_after >= free.criterion_after and "units at the bound" in str(bounded)
    assert bounded.to_dict()["max_log_scale"] == 0.5
    assert float((net(x).detach() - before).abs().max()) <= 1e-10
    assert math.isclose(bounded.criterion_after, sum(float(q.detach().pow(2).sum()) for q in net.parameters()),
                        rel_tol=1e-9)


@given(enorm_problems(spreads=(0.1, 1.0, 3.0, 30.0)), st.sampled_from([None, 0.7]))
@settings(max_examples=40, deadline=None)
def test_newton_with_every_layer_as_a_dense_block_meets_the_definition(problem, bound):
    """The mass matrix's dense blocks (`PairMatrix`, from 4096 entries on the zoo) forced on for every run of
    identical rows: the same optimum and stopping rule as the reference sweeps."""
    import pathir.pairs.pair_matrix as pair_matrix

    w, B, c = problem
    m = w if c is None else w * c
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pair_matrix, "MIN_BLOCK", 1)
        r = solve_enorm(w, B, c, method="newton", tol=1e-10, max_log_scale=bound)
    reference = solve_enorm_block(w, B, c, tol=1e-13, max_sweeps=20000, max_log_scale=bound)
    assert r.converged
    assert r.e_final <= reference.e_final * (1 + 1e-12)
    assert r.e_final == pytest.approx(e_reference(m, B, r.z), rel=1e-12)
    if bound is None:
        assert np.max(np.abs(unit_steps_by_definition(m, B, r.z)), initial=0.0) <= 1.1e-10


def test_a_layered_network_is_held_as_dense_blocks():
    """On an MLP every layer's pairs form one dense block of the mass matrix (`PairMatrix`)."""
    from pathir.analyses.unit_rows import matrix_row_keys
    from pathir.pairs.pair_laplacian import PairLaplacian
    from pathir.pairs.unit_pairs import group_pairs

    rows, H = mlp_rows([5, 6, 7, 3])
    B = incidence(rows, H)
    key, H = matrix_row_keys(B)
    with pytest.MonkeyPatch.context() as patch:
        import pathir.pairs.pair_matrix as pair_matrix

        patch.setattr(pair_matrix, "MIN_BLOCK", 6)
        lap = PairLaplacian(group_pairs(np.ones(key.size), key, H))
    # layer 1 (6 units) enters from "no unit" only; layer 2 (7 units) from layer 1 and its bias's "no unit";
    # "no unit" (the output) from layer 2 and the output bias
    shapes = sorted(b.values.shape for b in lap.matrix.blocks)
    assert shapes == [(1, 8), (6, 1), (7, 7)] and lap.matrix.rest.nnz + sum(b.values.size for b in lap.matrix.blocks) == lap.pairs.size
