"""PairMatrix's mat-vecs against the CSR of every pair (the definition)."""

import numpy as np
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from pathir.pairs.pair_matrix import PairMatrix


@st.composite
def pair_sets(draw):
    """Distinct pairs sorted by (enter, leave) over ``size`` units, many rows repeating the previous row's
    columns (the pattern of a dense layer), some gaps, some empty rows."""
    size = draw(st.integers(1, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows, cols = [], []
    previous = np.zeros(0, dtype=np.int64)
    for r in range(size):
        if previous.size and rng.random() < 0.6:
            these = previous
        else:
            these = np.flatnonzero(rng.random(size) < rng.uniform(0.0, 1.0))
        rows.append(np.full(these.size, r))
        cols.append(these)
        previous = these
    enter, leave = np.concatenate(rows).astype(np.int64), np.concatenate(cols).astype(np.int64)
    return enter, leave, rng.uniform(0.1, 2.0, enter.size), size


@settings(derandomize=True, max_examples=150, deadline=None)
@given(pair_sets(), st.sampled_from([1, 3, 8, 4096]), st.integers(0, 2**32 - 1))
def test_matvecs_match_the_csr_of_every_pair(pairs, min_block, seed):
    enter, leave, mass, size = pairs
    M = PairMatrix(enter, leave, mass, size, min_block=min_block)
    reference = sp.csr_array((mass, (enter, leave)), shape=(size, size))
    x = np.random.default_rng(seed).normal(size=size)
    np.testing.assert_allclose(M(x), reference @ x, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(M.T(x), reference.T @ x, rtol=1e-12, atol=1e-12)
    for got, expected in zip(M.both(x, x[::-1].copy()), (reference @ x, reference.T @ x[::-1])):
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    covered = sum(b.values.size for b in M.blocks) + M.rest.nnz
    assert covered == mass.size  # every pair once: in one block or in the rest
    assert all(b.values.size >= min_block for b in M.blocks)


def test_a_dense_layer_is_one_block_of_views():
    out_units, in_units = np.arange(0, 4), np.arange(4, 10)
    enter, leave = np.repeat(out_units, in_units.size), np.tile(in_units, out_units.size)
    mass = np.arange(1.0, enter.size + 1)
    M = PairMatrix(enter, leave, mass, 10, min_block=1)
    assert len(M.blocks) == 1 and M.rest.nnz == 0
    block = M.blocks[0]
    assert block.cols == slice(4, 10) and block.values.shape == (4, 6) and np.shares_memory(block.values, mass)


def test_both_reads_a_block_in_chunks(monkeypatch):
    import pathir.pairs.pair_matrix as pm

    monkeypatch.setattr(pm, "_CHUNK_BYTES", 8 * 3)  # three columns' worth: one row per chunk
    enter, leave = np.repeat(np.arange(5), 7), np.tile(np.arange(5, 12), 5)
    mass = np.random.default_rng(0).uniform(size=enter.size)
    M = PairMatrix(enter, leave, mass, 12, min_block=1)
    reference = sp.csr_array((mass, (enter, leave)), shape=(12, 12))
    x, y = np.arange(12.0), np.arange(12.0)[::-1].copy()
    got = M.both(x, y)
    np.testing.assert_allclose(got[0], reference @ x, rtol=1e-12)
    np.testing.assert_allclose(got[1], reference.T @ y, rtol=1e-12)


@settings(derandomize=True, max_examples=150, deadline=None)
@given(pair_sets(), st.integers(0, 2**32 - 1), st.sampled_from([8, 24, 1 << 18]))
def test_same_as_next_row_matches_its_definition_chunk_by_chunk(pairs, seed, chunk):
    """Row r + 1 holds exactly row r's columns, compared over run views a chunk of rows at a time
    (a chunk of 8 bytes: one row per comparison), against row-by-row array_equal."""
    import pathir.pairs.pair_matrix as pm

    enter, leave, _, size = pairs
    rng = np.random.default_rng(seed)
    if leave.size:  # rows of one length but other columns: the case the views must tell apart
        leave = leave.copy()
        leave[rng.integers(0, leave.size)] = size  # a column no row shared before
        order = np.lexsort((leave, enter))
        enter, leave = enter[order], leave[order]
    indptr = np.searchsorted(enter, np.arange(size + 1))
    lengths = np.diff(indptr)
    expected = [bool(lengths[r] > 0 and np.array_equal(leave[indptr[r]:indptr[r + 1]], leave[indptr[r + 1]:indptr[r + 2]]))
                for r in range(size - 1)] + [False]
    old = pm._CHUNK_BYTES
    pm._CHUNK_BYTES = chunk
    try:
        assert pm._same_as_next_row(leave, indptr, lengths).tolist() == expected[:size]
    finally:
        pm._CHUNK_BYTES = old
