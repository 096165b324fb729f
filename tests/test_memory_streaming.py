"""The memory-lean paths (streamed unit masses, in-place results, owned arrays) equal their definitions."""

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from pathir.analyses.find_units import find_units
from pathir.analyses.incidence import incidence
from pathir.analyses.unit_rows import row_units
from pathir.errors import PathirError
from pathir.ir import Param
from pathir.lifting.diag_g import diag_g, diag_g_flat
from pathir.lifting.pruning import path_magnitude_scores, prune_graph, prune_masks
from pathir.rescaling.apply import rescale_graph
from pathir.testing import relu_dags, rescalings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
normalize_module = importlib.import_module("pathir.enorm.normalize")  # the module, not the pass
param_pairs = importlib.import_module("pathir.pairs.param_pairs")


def _masses_from_b(graph, units, p):
    """b and M of pathir/enorm/normalize.py read from the full B and flat θ (the definition)."""
    B, layout = incidence(graph, units)
    H = B.shape[1]
    w = np.abs(layout.theta()) ** p
    enter, leave, _ = row_units(B)
    enters = (enter < H) & (w > 0)
    free = enters & (leave == H)
    b = np.bincount(enter[free], weights=w[free], minlength=H)
    pair = enters & (leave < H)
    M = sp.csr_array((w[pair], (enter[pair], leave[pair])), shape=(H, H))
    M.sum_duplicates()
    M.eliminate_zeros()
    return b, M


@settings(max_examples=40, deadline=None)
@given(graph=relu_dags(), p=st.sampled_from([1.0, 2.0, 3.0]), block=st.sampled_from([1, 3, 1 << 20]))
def test_streamed_unit_masses_equal_the_ones_read_from_b(graph, p, block):
    units = find_units(graph)[1]
    old = param_pairs.BLOCK
    param_pairs.BLOCK = block  # blocks of one row, a few rows, whole params
    try:
        b, M = normalize_module.unit_masses(graph, units, p)
    finally:
        param_pairs.BLOCK = old
    b_ref, M_ref = _masses_from_b(graph, units, p)
    np.testing.assert_allclose(b, b_ref, rtol=1e-12, atol=0)
    assert M.shape == M_ref.shape
    np.testing.assert_allclose(M.toarray(), M_ref.toarray(), rtol=1e-12, atol=0)
    assert np.array_equal(M.indices, M_ref.indices) and np.array_equal(M.indptr, M_ref.indptr)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), graph=relu_dags())
def test_in_place_results_leave_the_graph_alone(data, graph):
    graph = rescale_graph(graph, find_units(graph)[1], data.draw(rescalings(graph)))
    before = [p.value.copy() for p in graph.params()]
    g = diag_g(graph, "numpy")
    flat, log_top = diag_g_flat(graph, "numpy")
    scores = path_magnitude_scores(graph, "numpy")
    for p, old in zip(graph.params(), before):
        assert np.array_equal(p.value, old) and not p.value.flags.writeable
    # the flat, normalised diag G is the per-source one, concatenated
    if np.isfinite(log_top):
        whole = np.concatenate([g[p.source_name].ravel() for p in graph.params()])
        np.testing.assert_allclose(flat * np.exp(log_top), whole, rtol=1e-12, atol=0)
    assert all(not np.shares_memory(scores[p.source_name], p.value) for p in graph.params())


@settings(max_examples=30, deadline=None)
@given(graph=relu_dags(), amount=st.sampled_from([0.0, 0.3, 1.0]))
def test_pruned_graph_owns_fresh_read_only_values(graph, amount):
    try:
        masks = prune_masks(graph, amount, backend="numpy")
    except PathirError as err:  # a DAG of fixed maps only
        assert "nothing to prune" in str(err)
        return
    pruned = prune_graph(graph, masks)
    for p, q in zip(graph.params(), pruned.params()):
        assert not q.value.flags.writeable
        if p.name in masks:
            assert not np.shares_memory(p.value, q.value)
            np.testing.assert_array_equal(q.value, p.value * masks[p.name])


def test_owned_value_is_taken_without_a_copy_and_frozen():
    p = Param("w", np.ones((2, 3)))
    fresh = np.full((2, 3), 2.0)
    q = p.with_value(fresh, owned=True)
    assert np.shares_memory(q.value, fresh) and not q.value.flags.writeable
    r = p.with_value(fresh.copy())
    assert not np.shares_memory(r.value, fresh)
    with pytest.raises(ValueError, match="shape"):
        p.with_value(np.ones(3), owned=True)


def test_peak_meter_sees_a_transient_allocation():
    import bench_memory

    base = bench_memory.settle()
    meter = bench_memory.PeakMeter()
    block = np.ones(64 << 17)  # 64 MiB, touched, then freed
    del block
    assert meter.peak() - base >= 48 << 20
    assert bench_memory.settle() - base < 48 << 20


def test_toolkit_benchmark_skips_without_the_toolkit(tmp_path, capsys):
    import bench_toolkit

    assert bench_toolkit.main(["resnet18", "--toolkit", str(tmp_path / "absent")]) == []
    assert "skipped" in capsys.readouterr().out


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 300), H=st.integers(1, 40))
def test_pair_sums_by_range_and_by_sort_agree(seed, n, H):
    rng = np.random.default_rng(seed)
    e, l = rng.integers(0, H, n), rng.integers(0, H, n)
    w = rng.uniform(0.1, 2.0, n)
    by_range = param_pairs.pair_sums(e, l, w, H, max_span=10**9)
    by_sort = param_pairs.pair_sums(e, l, w, H, max_span=0)
    assert np.array_equal(by_range[0], by_sort[0])
    np.testing.assert_allclose(by_range[1], by_sort[1], rtol=1e-13)
    keys = e * (H + 1) + l
    assert np.array_equal(by_sort[0], np.unique(keys))
    np.testing.assert_allclose(by_sort[1], [w[keys == k].sum() for k in by_sort[0]], rtol=1e-13)


@settings(max_examples=60, deadline=None)
@given(graph=relu_dags(), data=st.data(), spread=st.sampled_from([1.0, 50.0, 800.0]), zeros=st.booleans())
def test_pairs_grouped_param_by_param_equal_the_ones_from_row_keys(graph, data, spread, zeros):
    from pathir.analyses.incidence import row_ends, row_keys
    from pathir.pairs.unit_pairs import group_compact, group_pairs

    units = find_units(graph)[1]
    keys, ends = row_keys(units), row_ends(units)
    assert ends.size == keys.key.size and np.array_equal(ends.balance, keys.balance)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    m = np.exp(rng.uniform(-spread, spread, keys.key.size) / 2)  # 800 nats: the log-space sums
    if zeros:
        m[rng.random(m.size) < 0.4] = 0.0
    got, want = group_compact(m, ends), group_pairs(m, keys.key, len(units))
    assert np.array_equal(got.enter, want.enter) and np.array_equal(got.leave, want.leave)
    np.testing.assert_allclose(got.log_mass, want.log_mass, rtol=1e-12, atol=1e-12)
    assert np.array_equal(got.degenerate(), want.degenerate())


@settings(max_examples=30, deadline=None)
@given(graph=relu_dags(), data=st.data())
def test_row_ends_shifts_equal_the_row_keys_ones(graph, data):
    from pathir.analyses.incidence import row_ends, row_keys
    from pathir.analyses.unit_rows import row_shifts

    units = find_units(graph)[1]
    z = np.asarray(data.draw(rescalings(graph)), dtype=np.float64)
    got = np.concatenate([bz for _, bz in row_ends(units).shifts(z)] or [np.zeros(0)])
    want = np.concatenate([bz for _, bz in row_shifts(row_keys(units).key, z)] or [np.zeros(0)])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("block", [1, 7, 1 << 21])
def test_writer_by_row_blocks_equals_the_whole_tensor_write(block, monkeypatch):
    """TorchWriter.rescale applies a large tensor's factor a block of rows at a time: the
    same float64 products, so the same written values as the whole-tensor path, bit for bit."""
    import torch

    import pathir
    from pathir.frontends.torch import writer as torch_writer
    from pathir.rescaling.apply import log_scales

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(2, 4, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(4)
            self.fc = torch.nn.Linear(4 * 5 * 5, 6)
            self.w = torch.nn.Parameter(torch.randn(6, 3))  # x @ W: a transposed source

        def forward(self, x):
            h = torch.relu(self.bn(self.conv(x)))
            return torch.relu(self.fc(h.flatten(1))) @ self.w

    torch.manual_seed(0)
    nets = [Net().eval(), Net().eval()]
    nets[1].load_state_dict(nets[0].state_dict())
    cm = pathir.compile(nets[0], input_shape=(2, 5, 5))
    z = np.random.default_rng(1).normal(size=len(cm.units))
    scales = log_scales(cm.graph, cm.units, z)
    monkeypatch.setattr(torch_writer, "_BLOCK", block)
    torch_writer.TorchWriter(nets[0]).rescale(cm.graph, scales)
    monkeypatch.setattr(torch_writer, "_by_rows", lambda f, t: False)  # the whole-tensor path
    torch_writer.TorchWriter(nets[1]).rescale(cm.graph, scales)
    for (name, a), b in zip(nets[0].state_dict().items(), nets[1].state_dict().values()):
        assert torch.equal(a, b), name


class _ConcatNet:
    """A conv reading a concatenation whose channels are not in unit order (``with_input``: the input's
    pinned channels too), then a Linear on the flattened output."""

    def __new__(cls, with_input):
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.Conv2d(2, 4, 1)
                self.c = torch.nn.Conv2d(9 if with_input else 7, 5, 1)
                self.d = torch.nn.Linear(5 * 4 * 4, 3)

            def forward(self, x):
                a, b = torch.relu(self.a(x)), torch.relu(self.b(x))
                h = torch.relu(self.c(torch.cat([b, x, a] if with_input else [b, a], 1)))
                return self.d(torch.flatten(h, 1))

        return Net()


def _flattened_conv_net(spatial):
    import torch

    h, w = spatial
    return torch.nn.Sequential(torch.nn.Conv2d(2, 5, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(5 * h * w, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3)), (2, h, w)


def _sparse_grid_net():
    """A grouped conv and a batch-norm after a ReLU (a per-channel scale): grids far smaller than their
    units' (entered x left) table."""
    import torch

    return torch.nn.Sequential(torch.nn.Conv2d(2, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.BatchNorm2d(16).eval(),
                               torch.nn.Conv2d(16, 16, 3, padding=1, groups=8), torch.nn.ReLU(),
                               torch.nn.Conv2d(16, 3, 1)).eval()


@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("case", ["flatten 1x1", "flatten 3x2", "concat", "concat with input", "sparse grids"])
def test_pairs_read_by_runs_and_permutations_equal_the_ones_from_row_keys(zeros, case):
    """A Linear on a flattened conv output reads each channel at several places in a row (runs of one
    unit); a conv on a concatenation reads its units out of order (placed by a column permutation):
    the pairs, sums and per-pair extremes are those of the row keys."""
    import torch

    import pathir
    from pathir.analyses.incidence import row_ends, row_keys
    from pathir.pairs.unit_pairs import group_compact, group_pairs

    torch.manual_seed(0)
    if case.startswith("flatten"):
        net, shape = _flattened_conv_net((1, 1) if case.endswith("1x1") else (3, 2))
    elif case == "sparse grids":
        net, shape = _sparse_grid_net(), (2, 4, 4)
    else:
        net, shape = _ConcatNet(case.endswith("input")), (2, 4, 4)
    units = pathir.compile(net, input_shape=shape).units
    keys, ends = row_keys(units), row_ends(units)
    rng = np.random.default_rng(len(case) + zeros)
    m = np.exp(rng.uniform(-3, 3, keys.key.size))
    if zeros:
        m[rng.random(m.size) < 0.4] = 0.0
    got, low, high, count = group_compact(m, ends, extremes=True)
    want = group_pairs(m, keys.key, len(units))
    assert np.array_equal(got.enter, want.enter) and np.array_equal(got.leave, want.leave)
    np.testing.assert_allclose(got.log_mass, want.log_mass, rtol=1e-12)
    pair_keys = got.enter * (len(units) + 1) + got.leave
    for k, key in enumerate(pair_keys):
        mine = m[keys.key == key]
        assert count[k] == np.count_nonzero(mine) and high[k] == mine.max() and low[k] == mine[mine > 0].min()


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), parts=st.integers(1, 6), width=st.integers(2, 12), layout=st.sampled_from(
    ["random", "disjoint columns", "twins", "stream"]), lazy=st.sampled_from(["none", "some", "all"]))
def test_merging_sorted_pair_keys_equals_a_sort_of_them_all(seed, parts, width, layout, lazy):
    """unit_pairs._merge_sorted (placed, woven row by row or as one table of bands, folded or sorted) against
    np.unique of all keys. "stream": every part the same rows and a constant band of columns (a residual
    stream's convolutions, a bias). Every part is a grid of (rows x columns): ``lazy`` gives none, some or
    all of them as `GridKeys` (never written out) instead of arrays."""
    from pathir.pairs.unit_pairs import _STAND_INS, GridKeys, _merge_sorted

    rng = np.random.default_rng(seed)
    keys, sums, lows, grids = [], [], [], []
    for p in range(parts):
        if layout == "twins" and p % 2 and keys:
            k, grid = keys[-1].copy(), grids[-1]  # a bias beside its weights: the very same pairs
        elif layout == "stream":
            if p == 0:
                stream_rows = np.sort(rng.choice(8, size=rng.integers(1, 8), replace=False))
            lo = p * width + int(rng.integers(0, width // 2))
            cols = np.arange(lo, lo + int(rng.integers(1, width - (lo - p * width) + 1)))
            k = (stream_rows[:, None] * (width * parts) + cols[None, :]).reshape(-1)
            grid = (stream_rows * (width * parts), cols)
        else:
            rows = rng.choice(8, size=rng.integers(1, 8), replace=False)
            if layout == "disjoint columns":
                lo, hi = sorted(rng.choice(np.arange(p * width, (p + 1) * width), 2, replace=False))
                cols = np.arange(lo, hi + 1)
            else:
                cols = rng.choice(width * parts, size=rng.integers(1, width), replace=False)
            k = np.unique((rows[:, None] * (width * parts) + cols[None, :]).reshape(-1))
            grid = (np.sort(rows) * (width * parts), np.sort(cols))
        keys.append(k)
        grids.append(grid)
        sums.append(rng.uniform(0.1, 1.0, k.size))
        lows.append(rng.uniform(0.1, 1.0, k.size))
    # a member whose pairs are one row each gives None: its lows stand in as its sums, its counts as 1
    one_row = rng.random(parts) < 0.5
    counts = [np.full(k.size, 1 if single else 3, dtype=np.int32) for k, single in zip(keys, one_row)]
    want_keys = np.unique(np.concatenate(keys))
    everything = np.concatenate(keys)
    want_sums = np.array([np.concatenate(sums)[everything == k].sum() for k in want_keys])
    all_lows = np.concatenate([s if single else low for s, low, single in zip(sums, lows, one_row)])
    want_lows = np.array([all_lows[everything == k].min() for k in want_keys])
    want_counts = np.array([np.concatenate(counts)[everything == k].sum() for k in want_keys])
    given = [list(sums), [None if single else low for low, single in zip(lows, one_row)],
             [None if single else c for c, single in zip(counts, one_row)]]
    as_grid = {"none": np.zeros(parts, bool), "some": rng.random(parts) < 0.5, "all": np.ones(parts, bool)}[lazy]
    for p in np.flatnonzero(as_grid):
        lazy_keys = GridKeys(*grids[p])
        assert np.array_equal(np.asarray(lazy_keys), keys[p])  # the grid's keys are the part's
        keys[p] = lazy_keys
    got_keys, (got_sums, got_lows, got_counts), single = _merge_sorted(
        keys, given, (np.add, np.minimum, np.add), width * parts, (None, _STAND_INS[2], _STAND_INS[1]))
    assert np.array_equal(got_keys, want_keys)
    np.testing.assert_allclose(got_sums, want_sums, rtol=1e-13)
    # the lists past the first hold the pairs not ``single`` only; a single pair's low is its sum, count 1
    assert single.shape == got_keys.shape and got_lows.size == got_counts.size == np.count_nonzero(~single)
    assert np.array_equal(np.where(single, got_sums, 0.0)[single], want_lows[single])
    assert np.array_equal(got_lows, want_lows[~single]) and np.all(want_counts[single] == 1)
    assert np.array_equal(got_counts, want_counts[~single])
    if not one_row.any():
        assert not single.any()


@settings(max_examples=30, deadline=None)
@given(relu_dags(), st.integers(0, 2**32 - 1), st.sampled_from([3.0, 900.0]))
def test_g_as_one_array_per_param_groups_and_summarises_as_the_flat_g(graph, seed, spread):
    """group_compact and summarize take diag_g_parts' list (no flat copy of g) and give what they give
    for the flat g, bit for bit; g spanning 900 nats takes the log-space path (the list concatenated)."""
    from pathir.analyses.incidence import row_ends
    from pathir.lifting.diag_g import diag_g_parts
    from pathir.pairs.unit_pairs import group_compact
    from pathir.pathcond.g_summary import summarize

    _, units = find_units(graph)
    rows = row_ends(units)
    rng = np.random.default_rng(seed)
    flat = np.exp(-spread * rng.random(rows.size)) * (rng.random(rows.size) < 0.8)
    sizes = [int(np.prod(s)) for s in rows.shapes]
    parts = [x.reshape(s) for x, s in zip(np.split(flat, np.cumsum(sizes)[:-1]), rows.shapes)]
    a, b = group_compact(flat, rows, extremes=True), group_compact(parts, rows, extremes=True)
    assert np.array_equal(a[0].enter, b[0].enter) and np.array_equal(a[0].leave, b[0].leave)
    assert np.array_equal(a[0].log_mass, b[0].log_mass)
    for x, y in zip(a[1:], b[1:]):
        assert np.array_equal(x, y)
    (_, sa), (_, sb) = summarize(flat, rows), summarize(parts, rows)
    assert (sa.n, sa.kept) == (sb.n, sb.kept) and sa.sum_log == pytest.approx(sb.sum_log, rel=1e-13, abs=1e-9)
    g, top = diag_g_flat(graph, "numpy")
    got, top_parts = diag_g_parts(graph, "numpy")
    assert top_parts == top
    assert np.array_equal(np.concatenate([x.reshape(-1) for x in got]) if got else np.zeros(0), g)


def test_memory_baseline_is_the_models_own_float64_forward_backward():
    import bench_memory

    row = bench_memory.child("squeezenet1_1", bench_memory.BASELINE)
    # the pass ran in float64 and kept its gradients: one float64 copy of the parameters
    assert row["kept_copies"] > 0.9
    assert row["peak_copies"] >= row["kept_copies"]


def test_the_reread_skeleton_holds_no_copy_of_the_parameters():
    """The skeleton's params were meant as zero-size broadcasts, but a view of a writable zero is copied by Param:
    every live torch Compiled held a float64 copy of the parameters, all zeros (memory review)."""
    import torch

    import pathir
    from pathir.frontends.torch.reread import Reread

    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 3)).double()
    graph = pathir.compile(net, input_shape=(64,)).graph
    skeleton = Reread(graph, {}, frozenset()).skeleton
    assert [p.shape for p in skeleton.params()] == [p.shape for p in graph.params()]
    assert all(not any(p.value.strides) and not p.value.flags.writeable for p in skeleton.params())


def test_release_frees_the_blocks_kept_for_the_next_re_read():
    """After a write-back the lowering's pool keeps the old values' memory for the next re-read; cm.release()
    left it (a pruned 36M-parameter MLP kept 2.14 copies where docs/performance.md says 1.16: memory review)."""
    import gc

    import torch

    import pathir
    from pathir.support import array_pool

    net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 3)).double()
    cm = pathir.compile(net, input_shape=(64,))
    cm.prune(0.5)
    cm.path_norm(1)  # the re-read after the write: the compile's values die into the pool
    reread = next(c.cell_contents for c in cm._relower.__closure__ if type(c.cell_contents).__name__ == "Reread")
    block = reread.pool.empty((1 << 15,))  # one block surely back in the pool, whatever the collector did
    del block
    gc.collect()
    assert any(reread.pool._free.values())
    cm.release()
    assert not any(reread.pool._free.values()) and not array_pool._RESERVE.blocks
    assert cm.path_norm(1) > 0
