"""group_pairs' sums per unit pair against a dictionary sum (the definition), on both of its linear paths."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pathir.pairs.unit_pairs import _sum_by_key, group_pairs


@st.composite
def keyed_rows(draw):
    """Keys in non-decreasing runs (a parameter's rows), runs overlapping, with positive masses."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    runs = [np.sort(rng.integers(0, draw(st.integers(1, 40)), rng.integers(1, 30))) for _ in range(draw(st.integers(1, 6)))]
    key = np.concatenate(runs).astype(np.int64)
    return key, rng.uniform(0.1, 3.0, key.size)


def by_definition(key, w):
    sums = {}
    for k, v in zip(key.tolist(), w.tolist()):
        sums[k] = sums.get(k, 0.0) + v
    return sorted(sums), [sums[k] for k in sorted(sums)]


@settings(derandomize=True, max_examples=150, deadline=None)
@given(keyed_rows())
def test_sum_by_key_matches_the_definition(rows):
    key, w = rows
    keys, total = _sum_by_key(key, w)
    expected_keys, expected_total = by_definition(key, w)
    assert keys.tolist() == expected_keys
    np.testing.assert_allclose(total, expected_total, rtol=1e-13)


@settings(derandomize=True, max_examples=40, deadline=None)
@given(keyed_rows(), st.sampled_from([3, 5000]))
def test_group_pairs_on_small_and_large_unit_counts(rows, H):
    """H = 5000 makes the (H + 1)² key grid too large for one bincount: the run-wise sums are used."""
    key, w = rows
    key = (key % (H + 1)) * (H + 1) + (key * 7 % (H + 1))  # spread the keys over the grid, runs kept
    pairs = group_pairs(w, key, H)
    expected_keys, expected_total = by_definition(key, w)
    assert (pairs.enter * (H + 1) + pairs.leave).tolist() == expected_keys
    np.testing.assert_allclose(np.exp(pairs.log_mass), expected_total, rtol=1e-12)
    assert math.isclose(pairs.log_top, math.log(max(expected_total)), rel_tol=1e-12)
