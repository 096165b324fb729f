"""pairs_from_params (masses summed param by param) against group_pairs over the flat masses and B's row keys."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pathir.pairs.param_pairs as param_pairs
from pathir.analyses.facts import GraphFacts
from pathir.analyses.incidence import ParamLayout
from pathir.errors import PathirError
from pathir.pairs.param_pairs import pairs_from_params
from pathir.pairs.unit_pairs import group_pairs
from pathir.testing import relu_dags


@settings(max_examples=40, deadline=None)
@given(relu_dags(), st.sampled_from([1.0, 2.0, 3.0]), st.booleans(), st.sampled_from([1, 5, 1 << 20]),
       st.integers(0, 2**32 - 1))
def test_the_pairs_are_the_flat_rows_grouped(graph, p, with_costs, block, seed):
    facts = GraphFacts(graph)
    units = facts.units
    layout = ParamLayout(tuple(units.params))
    costs = np.random.default_rng(seed).uniform(0.0, 3.0, len(layout)) if with_costs else None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(param_pairs, "BLOCK", block)  # blocks of one row, a few rows, whole params
        got = pairs_from_params(units, p, costs)
    m = np.abs(layout.theta()) ** p * (1.0 if costs is None else costs)
    if not np.any(m > 0):
        assert got is None
        return
    expected = group_pairs(m, facts.row_keys.key, len(units))
    assert got is not None
    assert got.enter.tolist() == expected.enter.tolist() and got.leave.tolist() == expected.leave.tolist()
    np.testing.assert_allclose(got.log_mass, expected.log_mass, rtol=1e-12, atol=1e-12)


def _chain(first_weight: float, last_weight: float = 2.0) -> GraphFacts:
    from pathir.ir import Dense, GraphBuilder

    b = GraphBuilder()
    x = b.input("x", (2,))
    h = b.relu("h", [(x, Dense(b.param("w1", [[first_weight, 1.0]])))])
    y = b.identity("y", [(h, Dense(b.param("w2", [[last_weight]])))])
    return GraphFacts(b.build(outputs=[y]))


@pytest.mark.parametrize("weight", [1e-160, 1e155, np.inf, np.nan])
def test_tiny_huge_and_non_finite_masses_are_left_to_the_flat_grouping(weight):
    """|θ|^2 = 1e-320 is subnormal (a linear sum may lose it), 1e310 overflows: the flat path groups (log space)
    or refuses them; enorm gives the same answer either way."""
    from pathir.enorm.run import enorm

    assert pairs_from_params(_chain(0.5).units, 2.0) is not None
    facts = _chain(1.0, weight) if weight < 1 else _chain(weight)  # the tiny one alone in its pair
    assert pairs_from_params(facts.units, 2.0) is None
    if weight > 1e150 or not np.isfinite(weight):
        with pytest.raises(PathirError, match="not finite"):
            enorm(facts, p=2.0)
    else:
        newton, block = enorm(facts, p=2.0), enorm(facts, p=2.0, solver="block", tol=1e-13, max_sweeps=20000)
        assert newton.converged and newton.criterion_after == pytest.approx(block.criterion_after, rel=1e-9)
