"""The re-read widens weights into reused memory (pathir.support.array_pool): a block is written
again only once every array over it is gone, and the followed graph stays, bit for bit, a fresh
compile's and, in value, the path-norm's definition."""

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import pathir
from pathir.support.array_pool import ArrayPool

SHAPE = (3, 6, 6)


@pytest.fixture
def pooled(monkeypatch):
    """Every widened array from the pool, however small (the default pools 64 KiB and more)."""
    monkeypatch.setattr(ArrayPool, "min_bytes", 0)


# ------------------------------------------------------------ the pool itself


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["take", "view", "drop"]), st.integers(0, 2), st.integers(0, 5)),
                max_size=40))
def test_a_block_is_handed_out_again_only_once_every_array_over_it_is_gone(ops):
    pool, held, marks = ArrayPool(), [], []
    pool.min_bytes = 0
    for step, (op, size, k) in enumerate(ops):
        if op == "take":
            a = pool.empty((size + 1, 2))
            a.fill(step)  # what every holder of a must keep reading
            held.append(a)
            marks.append(step)
        elif op == "view" and held:
            i = k % len(held)
            held[i] = held[i].T[::-1]  # only a view of the array remains
        elif op == "drop" and held:
            i = k % len(held)
            del held[i], marks[i]
        for a, mark in zip(held, marks):
            assert np.all(a == mark)
    for i, a in enumerate(held):
        assert not any(np.shares_memory(a, b) for b in held[i + 1:])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["take", "view", "drop", "new pool", "drop pool"]), st.integers(0, 2),
                          st.integers(0, 5)), max_size=50))
def test_a_dead_pools_block_is_handed_out_again_only_once_every_array_over_it_is_gone(ops):
    """Through the process-wide reserve of dead pools' blocks, too: no two live arrays share memory,
    and none is written by another pool's holder."""
    import gc

    pools, held, marks = [ArrayPool()], [], []
    for step, (op, size, k) in enumerate(ops):
        if op == "take" and pools:
            pool = pools[k % len(pools)]
            pool.min_bytes = 0
            a = pool.empty((size + 1, 2))
            a.fill(step)
            held.append(a)
            marks.append(step)
        elif op == "view" and held:
            i = k % len(held)
            held[i] = held[i].T[::-1]
        elif op == "drop" and held:
            i = k % len(held)
            del held[i], marks[i]
        elif op == "new pool":
            pools.append(ArrayPool())
        elif op == "drop pool" and pools:
            del pools[k % len(pools)]
            gc.collect()
        for a, mark in zip(held, marks):
            assert np.all(a == mark)
    for i, a in enumerate(held):
        assert not any(np.shares_memory(a, b) for b in held[i + 1:])


def test_a_new_pool_widens_into_a_dead_pools_memory_within_the_reserve(monkeypatch):
    import gc

    from pathir.support import array_pool

    array_pool.release()
    first = ArrayPool()
    a = first.empty((300, 300))  # 720 KB
    block = a.base.base.obj
    del a, first
    gc.collect()
    again = ArrayPool().empty((300, 300))
    assert again.base.base.obj is block  # the memory of the dead pool, already written once
    del again
    gc.collect()
    monkeypatch.setattr(array_pool, "RESERVE_BYTES", 100_000)  # smaller than the block: not kept
    third = ArrayPool()
    b = third.empty((300, 300))
    block = b.base.base.obj
    del b, third
    gc.collect()
    assert ArrayPool().empty((300, 300)).base.base.obj is not block
    array_pool.release()


def test_a_torch_tensor_over_an_array_keeps_its_block():
    pool = ArrayPool()
    pool.min_bytes = 0
    a = pool.empty((4,))
    a[:] = 7.0
    t = torch.from_numpy(a[1:])
    del a
    b = pool.empty((4,))
    b[:] = 0.0
    assert torch.equal(t, torch.full((3,), 7.0, dtype=torch.float64))
    del t
    assert pool.empty((4,)) is not None


# ------------------------------------------------------------ a followed model


class _Net(nn.Module):
    """Every widened layout: a conv weight as it is (folded with its batch-norm), a linear layer
    over the last axis (a pointwise kernel), x @ W (W transposed), a dense layer and its bias."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.last = nn.Linear(6, 5)
        self.W = nn.Parameter(torch.randn(4 * 6 * 5, 7) / 10)
        self.fc = nn.Linear(7, 3)
        with torch.no_grad():
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        x = F.relu(self.last(F.relu(self.bn(self.conv(x)))))
        return self.fc(F.relu(x.flatten(1) @ self.W))


def _l1_by_definition(model: _Net) -> float:
    """Σ_p |Φ_p|: the |θ| network (a batch-norm as its eval-mode affine map) on the all-ones input, float64."""
    m = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        a = m.bn.weight / (m.bn.running_var + m.bn.eps).sqrt()
        c = m.bn.bias - m.bn.running_mean * a
        x = F.conv2d(torch.ones(1, *SHAPE, dtype=torch.float64), m.conv.weight.abs(), padding=1)
        x = x * a.abs().reshape(1, -1, 1, 1) + c.abs().reshape(1, -1, 1, 1)
        x = F.linear(x, m.last.weight.abs(), m.last.bias.abs())
        x = F.linear(x.flatten(1) @ m.W.abs(), m.fc.weight.abs(), m.fc.bias.abs())
    return float(x.sum())


def _edit(model: _Net, kind: str, step: int) -> None:
    """One change a user makes, each seen by autograd's version counters."""
    torch.manual_seed(step)
    if kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model(torch.randn(2, *SHAPE)).pow(2).mean().backward()
        opt.step()
    elif kind == "mul":
        with torch.no_grad():
            model.W.mul_(1.5)
    elif kind == "stats":
        with torch.no_grad():
            model.bn.running_var.mul_(2.0)
            model.bn.running_mean.add_(0.25)
    elif kind == "replace":
        model.last.weight = nn.Parameter(torch.randn_like(model.last.weight))
    elif kind == "load":
        model.load_state_dict({k: v + 0.125 if v.is_floating_point() else v for k, v in model.state_dict().items()})


@settings(max_examples=15, deadline=None)
@given(st.lists(st.sampled_from(["sgd", "mul", "stats", "replace", "load"]), min_size=3, max_size=6))
def test_followed_values_are_a_fresh_compile_and_earlier_graphs_keep_theirs(edits):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ArrayPool, "min_bytes", 0)
        torch.manual_seed(0)
        model = _Net().eval()
        cm = pathir.compile(model, input_shape=SHAPE, self_check=False)
        kept = []  # every earlier graph, and a copy of its values: a reused block must never be one of these
        for step, kind in enumerate(edits):
            graph = cm.graph
            kept.append((graph, [p.value.copy() for p in graph.params()]))
            if step % 2:
                kept[-2:-1] = []  # some earlier graphs die: their blocks are reused from here on
            _edit(model, kind, step)
            fresh = pathir.compile(model, input_shape=SHAPE, self_check=False)
            assert str(cm.graph) == str(fresh.graph)
            for p, q in zip(cm.graph.params(), fresh.graph.params(), strict=True):
                assert np.array_equal(p.value, q.value), (kind, p.name)
            assert cm.path_norm(1) == fresh.path_norm(1)
            assert cm.path_norm(1) == pytest.approx(_l1_by_definition(model), rel=1e-12)
            for old, values in kept:
                for p, v in zip(old.params(), values, strict=True):
                    assert np.array_equal(p.value, v), (kind, p.name)


def test_tracking_reuses_the_memory_of_dead_values(pooled):
    torch.manual_seed(0)
    model = _Net().eval()
    cm = pathir.compile(model, input_shape=SHAPE, self_check=False)
    addresses, folded = set(), set()
    for step in range(4):
        _edit(model, "sgd", step)
        W = next(p for p in cm.graph.params() if p.name == "W")
        addresses.add(W.value.__array_interface__["data"][0])
        conv = next(p for p in cm.graph.params() if p.value.ndim == 4)  # the conv weight folded with its batch-norm
        folded.add(conv.value.__array_interface__["data"][0])
        assert isinstance(conv.value.base.base, memoryview)  # over one of the fold's pool blocks
    assert len(addresses) <= 2  # W's memory: two blocks taken in turn (the live one and the one before)
    assert len(folded) <= 2  # the fold's output too (passes.fold_batchnorm.pooled_folds)
