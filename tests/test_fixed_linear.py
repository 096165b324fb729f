"""Linear layers whose matrix is a registered buffer (``nn.Linear`` with a buffer weight,
``F.linear(x, buffer)``, ``x @ buffer``), on a flat input or along the last axis: a fixed map (a
1x1 ``FixedConv`` over the features), never a free weight. Checked on both capture paths: the
forward equals the model's own float64 forward, path-norms and counts equal the model run as its
path-norm network (the buffer as |k|^q, k ≠ 0 in the count), and a PathCond write-back keeps the
function and leaves the buffer bit-identical."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from capture_reference import Untraceable, assert_forward, eval_forward, path_norm_q
from hypothesis import given, settings
from hypothesis import strategies as st

import pathir


class BufferLinear(nn.Module):
    """a (learned) -> ReLU -> the fixed matrix (a buffer) -> ReLU -> o (learned)."""

    def __init__(self, mode, n_in, n_hidden, n_fixed, bias, zeros):
        super().__init__()
        self.mode = mode
        self.a, self.o = nn.Linear(n_in, n_hidden), nn.Linear(n_fixed, 2)
        k = torch.randn(n_fixed, n_hidden, dtype=torch.float64) * (torch.rand(n_fixed, n_hidden) >= zeros)
        if mode == "module":
            self.fixed = nn.Linear(n_hidden, n_fixed, bias=bias)
            del self.fixed.weight
            self.fixed.register_buffer("weight", k)
        elif mode == "matmul":
            self.register_buffer("k", k.T.contiguous())  # x @ k: (in, out)
        else:
            self.register_buffer("k", k)
            self.b = nn.Parameter(torch.randn(n_fixed)) if bias else None

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.mode == "module":
            h = self.fixed(h)
        elif self.mode == "matmul":
            h = h @ self.k
        else:
            h = F.linear(h, self.k, self.b)
        return self.o(torch.relu(h))


def _buffers(model):
    return {k: v.clone() for k, v in model.named_buffers()}


def path_norm_reference(model, shape, q):
    """The model as its path-norm network, the buffer matrix as |k|^q (q = 0: k ≠ 0)."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for _, b in m.named_buffers():
            b.copy_((b != 0).double() if q == 0 else b.abs() ** q)
    return path_norm_q(m, [shape], q)


@settings(max_examples=30, deadline=None)
@given(mode=st.sampled_from(["module", "functional", "matmul"]), n_hidden=st.integers(1, 5),
       n_fixed=st.integers(1, 5), positions=st.sampled_from([(), (3,), (2, 2)]), bias=st.booleans(),
       zeros=st.sampled_from([0.0, 0.5]), export=st.booleans(), seed=st.integers(0, 2**16))
def test_buffer_matrix_is_a_fixed_map(mode, n_hidden, n_fixed, positions, bias, zeros, export, seed):
    torch.manual_seed(seed)
    inner = BufferLinear(mode, 3, n_hidden, n_fixed, bias and mode != "matmul", zeros).double()
    model = Untraceable(inner) if export else inner
    shape = (*positions, 3)
    cm = assert_forward(model, shape)
    buffers = {name for name, _ in model.named_buffers()}
    assert not buffers & {ref.name for p in cm.graph.params() for ref in p.sources}  # no free weight reads it
    for q in (0.5, 1.0, 2.0):
        assert cm.path_norm(q) ** q == pytest.approx(path_norm_reference(model, shape, q), rel=1e-10)
    assert cm.num_paths() == pytest.approx(path_norm_reference(model, shape, 0.0), rel=1e-12)
    x = torch.randn(4, *shape, dtype=torch.float64)
    before, buffers = eval_forward(model, x), _buffers(model)
    cm.pathcond(max_sweeps=20)
    assert all(torch.equal(b, buffers[k]) for k, b in model.named_buffers())  # bit-identical
    torch.testing.assert_close(eval_forward(model, x), before, rtol=1e-10, atol=1e-10 * float(before.abs().max()))


def test_buffer_matrix_ties_the_features_it_mixes():
    """A dense fixed matrix joins every feature it reads and every feature it writes: one unit
    (a rescaling of one of them alone would have to change the buffer)."""
    torch.manual_seed(0)
    model = BufferLinear("module", 3, 4, 5, False, 0.0).double()
    cm = pathir.compile(model, input_shape=(3,))
    assert len(cm.units) == 1
    free = pathir.compile(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 5), nn.ReLU(),
                                        nn.Linear(5, 2)).double(), input_shape=(3,))
    assert len(free.units) == 9
