"""sorted_unique against np.unique, its definition."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from pathir.support.sorted_unique import sorted_unique


@settings(derandomize=True, max_examples=200, deadline=None)
@given(arrays(np.int64, st.integers(0, 60), elements=st.integers(-5, 40)))
def test_matches_np_unique(values):
    expected, expected_inverse = np.unique(values, return_inverse=True)
    got = sorted_unique(values)
    got_values, got_inverse = sorted_unique(values, return_inverse=True)
    assert got.tolist() == expected.tolist() == got_values.tolist()
    assert got_inverse.tolist() == expected_inverse.reshape(-1).tolist()
    assert got_values[got_inverse].tolist() == values.tolist()
