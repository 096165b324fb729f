"""normalize's param-by-param forward substitution against the general solver (docs/math.md §8).

The general solver (unit masses, strongly connected components, levels in log
space) is the reference: on every graph where the feed-forward pass applies,
both give the same log-scales and the same degenerate units.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pathir.enorm.normalize_forward as forward
from pathir.analyses.find_units import find_units
from pathir.enorm.normalize import normalize_log_scales
from pathir.errors import PathirError
from pathir.ir import Dense, GraphBuilder
from pathir.rescaling.apply import rescale_graph
from pathir.testing import relu_dags, rescalings


def _general(graph, units, p, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(forward, "feedforward_log_u", lambda *args: None)
        return normalize_log_scales(graph, units, p)


def _same(graph, units, p, monkeypatch):
    """Assert both solvers agree on ``graph``; return whether the feed-forward pass ran."""
    ran = forward.feedforward_log_u(graph.params(), units, p) is not None
    fast = normalize_log_scales(graph, units, p)
    slow = _general(graph, units, p, monkeypatch)
    np.testing.assert_array_equal(fast.degenerate, slow.degenerate)
    np.testing.assert_allclose(fast.z, slow.z, rtol=1e-13, atol=1e-11)
    return ran


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from([1.0, 2.0, 3.0]))
def test_the_feed_forward_pass_is_the_general_solver_on_random_dags(data, p):
    graph = data.draw(relu_dags(skip=data.draw(st.booleans())))
    _, units = find_units(graph)
    z = data.draw(rescalings(graph, max_log=data.draw(st.sampled_from([2.0, 300.0]))))
    with np.errstate(all="ignore"):
        moved = rescale_graph(graph, units, z)
    if not all(np.all(np.isfinite(q.value)) for q in moved.params()):
        return
    with pytest.MonkeyPatch.context() as monkeypatch:
        try:
            _same(moved, units, p, monkeypatch)
        except Exception as err:  # a cycle of units with too much mass: the general solver refuses
            assert "spectral" in str(err) or "only receive" in str(err)


def _chain(weights, biases=None):
    """An MLP x -> relu layers -> identity output with the given weight matrices."""
    b = GraphBuilder()
    x = b.input("x", (np.asarray(weights[0]).shape[1],))
    for i, w in enumerate(weights[:-1]):
        bias = None if biases is None else b.param(f"b{i}", biases[i])
        x = b.relu(f"h{i}", [(x, Dense(b.param(f"w{i}", w)))], bias=bias)
    y = b.identity("y", [(x, Dense(b.param("w_out", weights[-1])))])
    return b.build(outputs=[y])


def test_tiny_and_wide_sums_are_taken_in_log_space(monkeypatch):
    """Masses near the float range's floor (a row sum below 1e-280) and units whose u span more than
    700 nats: the rows go through log space and still equal the general solver."""
    rng = np.random.default_rng(0)
    w0 = rng.uniform(0.5, 1.0, (4, 3))
    w0[1] *= 1e-150  # with p = 2, unit 1's mass is 1e-300: below the linear floor
    w0[2] *= 1e-300  # p = 1: 1e-300
    w1 = rng.uniform(0.5, 1.0, (3, 4))
    w1[:, 3] = 0.0  # a dead column: unit 3 feeds nothing
    w2 = rng.uniform(0.5, 1.0, (2, 3))
    graph = _chain([w0, w1, w2], [np.zeros(4), rng.uniform(0.5, 1, 3)])
    _, units = find_units(graph)
    assert _same(graph, units, 1.0, monkeypatch)
    with pytest.raises(PathirError, match="underflows float64 for the weights entering 1 units"):
        normalize_log_scales(graph, units, 2.0)  # unit 2's mass 1e-600 is 0: it was taken for a dead unit
    for p in (1.0, 2.0):  # u of the first layer spans 1600 nats (y = p z / 2), every mass finite
        z = np.zeros(len(units))
        z[:4] = [0.0, 800.0 / p, -800.0 / p, 0.0]
        moved = rescale_graph(graph, units, z)  # (unit 2's entries underflow to 0 there: a dead unit)
        assert _same(moved, units, p, monkeypatch)


def test_a_unit_with_no_incoming_mass_is_degenerate_as_in_the_general_solver(monkeypatch):
    rng = np.random.default_rng(1)
    w0 = rng.normal(size=(3, 2))
    w0[0] = 0.0  # unit 0 receives nothing (no bias either)
    graph = _chain([w0, rng.normal(size=(2, 3))])
    _, units = find_units(graph)
    result = normalize_log_scales(graph, units, 2.0)
    assert result.degenerate.tolist() == [0] and result.z[0] == 0.0
    assert _same(graph, units, 2.0, monkeypatch)


def test_a_cycle_of_units_is_left_to_the_general_solver():
    from test_enorm_normalize import _residual

    graph = _residual(0.1)
    _, units = find_units(graph)
    assert forward.feedforward_log_u(graph.params(), units, 2.0) is None
    assert normalize_log_scales(graph, units, 2.0).cycles == 1


@pytest.mark.parametrize("p", [1.0, 2.0])
def test_a_row_whose_largest_term_comes_from_a_unit_more_than_700_nats_below_is_summed_in_log_space(p, monkeypatch):
    """u_c = 1e-320 u_e: scaled by u_e, u_c would be a subnormal with three digits, yet its term
    (mass 1e300) outweighs the other (1e-270) by 1e250. The general solver works in log space."""
    masses = [np.array([[1.0, 0.0], [1e-160, 0.0]]), np.array([[1.0, 0.0], [0.0, 1e-160]]),
              np.array([[1e-270, 1e300]]), np.array([[1.0]])]
    graph = _chain([m ** (1 / p) for m in masses])
    _, units = find_units(graph)
    assert _same(graph, units, p, monkeypatch)
    log_u = forward.feedforward_log_u(graph.params(), units, p)[0]
    np.testing.assert_allclose(log_u[4], np.log(1e-20 + 1e-270), rtol=1e-14)
