"""Pairs.freeze (only the pairs touching the frozen units regrouped, then merged) against its definition:
every pair's ends remapped to "no unit", all pairs sorted again and equal keys summed in log space."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pathir.pairs.unit_pairs import Pairs


def _frozen_by_definition(pairs: Pairs, units) -> tuple[np.ndarray, np.ndarray]:
    H = pairs.num_units
    remap = np.arange(H + 1)
    remap[units] = H
    keys = remap[pairs.enter] * (H + 1) + remap[pairs.leave]
    out = {}
    for k, m in zip(keys.tolist(), pairs.log_mass.tolist()):
        out[k] = np.logaddexp(out[k], m) if k in out else m
    order = sorted(out)
    return np.array(order, dtype=np.int64), np.array([out[k] for k in order])


@settings(derandomize=True, max_examples=200, deadline=None)
@given(st.integers(1, 9), st.integers(0, 2**32 - 1), st.floats(0.0, 1.0), st.sampled_from([1.0, 300.0]))
def test_freeze_equals_regrouping_every_pair(H, seed, fill, spread):
    rng = np.random.default_rng(seed)
    grid = np.array([(e, l) for e in range(H + 1) for l in range(H + 1)])
    chosen = grid[rng.random(len(grid)) < fill]
    log_mass = rng.uniform(-spread, spread, len(chosen))
    pairs = Pairs(log_mass, chosen[:, 0].astype(np.int64), chosen[:, 1].astype(np.int64), H)
    units = np.flatnonzero(rng.random(H) < 0.4)
    got = pairs.freeze(units)
    keys, logs = _frozen_by_definition(pairs, units)
    np.testing.assert_array_equal(got.enter * (H + 1) + got.leave, keys)
    np.testing.assert_allclose(got.log_mass, logs, rtol=1e-13, atol=1e-12)
