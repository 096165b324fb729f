"""Constant factors between activations, against the definition on both frontends: ``torch.add(a, b,
alpha=c)`` (ATen ``add.Tensor`` with alpha on the export path), an activation times / divided by a
constant tensor (a buffer: one fixed factor per channel, position or element), ONNX Mul / Div by
such an initializer. Each is a fixed-weight edge: exact forward, path-norms and counts equal to the
model run on |θ|^q (constants c as |c|^q, and c ≠ 0 in the count), never rescaled."""

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
from capture_reference import Untraceable, assert_definition, assert_forward, eval_forward

import pathir
from pathir.errors import UnsupportedOperation
from pathir.ir import MapKind


class _Fixed(nn.Module):
    """``self.c(v)``: the constant v, |v|^q in the reference (q = 0: v ≠ 0, an edge or none)."""

    q = None

    def c(self, v):
        if self.q is None:
            return v
        if self.q == 0:
            return (torch.as_tensor(v) != 0).double()
        return abs(v) ** self.q


class AddAlpha(_Fixed):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.o = nn.Conv2d(2, 3, 3), nn.Conv2d(2, 3, 3), nn.Conv2d(3, 2, 1)

    def forward(self, x):
        h, g = torch.relu(self.a(x)), torch.relu(self.b(x))
        if self.q is None:
            s = torch.add(h, g, alpha=-0.5)
            s = s.add(self.a(x), alpha=2.0)
        else:
            s = h + self.c(-0.5) * g + self.c(2.0) * self.a(x)
        return self.o(torch.relu(s))


class BufferFactors(_Fixed):
    """Per-channel, per-position and per-element buffers (zeros included), a division, a flat buffer."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.fc, self.o = nn.Conv2d(2, 3, 3), nn.Conv2d(3, 3, 1), nn.Linear(12, 4), nn.Linear(4, 2)
        self.register_buffer("per_channel", torch.tensor([0.5, -2.0, 0.0]).reshape(1, 3, 1, 1))
        self.register_buffer("per_position", torch.tensor([[1.5, -1.0], [0.25, 2.0]]))
        self.register_buffer("per_element", torch.arange(1.0, 13.0).reshape(3, 2, 2) / 4)
        self.register_buffer("divisor", torch.tensor([2.0, -4.0, 0.5]).reshape(3, 1, 1))
        self.register_buffer("flat", torch.tensor([1.0, 0.0, -3.0, 0.5]))

    def forward(self, x):
        h = torch.relu(self.a(x)) * self.c(self.per_channel)
        h = torch.relu(self.b(h)) * self.c(self.per_position)
        h = self.c(self.per_element) * h
        h = h / self.divisor if self.q is None else h * self.c(1 / self.divisor)
        return self.o(torch.relu(self.fc(h.flatten(1))) * self.c(self.flat))


class MaskFactors(_Fixed):
    """A bool mask buffer (torch multiplies by 0 / 1) and an integer buffer: fixed factors, never
    learnable scales (a write-back could not keep the function through a bool tensor)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.o = nn.Linear(4, 4), nn.Conv2d(1, 2, 3), nn.Linear(8, 2)
        self.register_buffer("keep", torch.tensor([True, False, True, True]))
        self.register_buffer("count", torch.tensor([[3, -1], [0, 2]]))

    def forward(self, x):
        h = torch.relu(self.a(x)) * self.c(self.keep if self.q is None else self.keep.double())
        h = torch.relu(self.b(h.reshape(-1, 1, 2, 2).repeat_interleave(2, 2).repeat_interleave(2, 3)))
        h = h * self.c(self.count if self.q is None else self.count.double())
        return self.o(h.flatten(1))


CASES = {"add_alpha": (AddAlpha, (2, 6, 6)), "buffers": (BufferFactors, (2, 4, 4)), "masks": (MaskFactors, (4,))}


def _model(name):
    torch.manual_seed(0)
    cls, shape = CASES[name]
    return cls().double().eval(), shape



@pytest.mark.parametrize("name", list(CASES))
def test_forward_path_norms_and_counts_equal_the_definition(name):
    model, shape = _model(name)
    cm = assert_forward(model, shape, tol=1e-12)
    assert_definition(cm, model, shape)
    assert {p.source_name for p in cm.graph.params()} <= {n for n, _ in model.named_parameters()}  # no buffer



@pytest.mark.parametrize("name", list(CASES))
def test_export_path_gives_the_same_graph_numbers(name):
    model, shape = _model(name)
    wrapped = Untraceable(model)
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(wrapped)
    cm = assert_forward(wrapped, shape, tol=1e-12)
    assert_definition(cm, model, shape)


@pytest.mark.parametrize("name", list(CASES))
def test_constants_are_never_rescaled_and_the_function_is_kept(name):
    model, shape = _model(name)
    cm = pathir.compile(model, input_shape=shape)
    buffers = copy.deepcopy(dict(model.named_buffers()))
    x = torch.randn(3, *shape, dtype=torch.float64)
    before = eval_forward(model, x)
    cm.pathcond()
    assert torch.allclose(eval_forward(model, x), before, rtol=1e-10, atol=1e-12)
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())


def test_a_per_channel_buffer_is_one_fixed_edge_with_a_per_channel_multiplier():
    model, shape = _model("buffers")
    cm = pathir.compile(model, input_shape=shape)
    mults = [e.map.mult for n in cm.graph.nodes for e in n.edges if e.map.kind is MapKind.POOL and e.map.mult is not None]
    per_channel = np.array([0.5, -2.0, 0.0]).reshape(3, 1, 1)
    assert any(m.shape == (3, 2, 2) and np.array_equal(m, np.broadcast_to(per_channel, m.shape)) for m in mults)
    assert not any(e.map.kind is MapKind.SCALE for n in cm.graph.nodes for e in n.edges)


class BadFactor(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.a = nn.Conv2d(2, 3, 3)
        self.register_buffer("k", torch.rand(*shape) + 0.5)

    def forward(self, x):
        return torch.relu(self.a(x)) * self.k


@pytest.mark.parametrize("shape", [(2, 3, 1, 1), (4, 1, 1, 1, 1)])  # over the batch; adds an axis
def test_a_factor_that_does_not_fit_the_activation_is_refused(shape):
    model = BadFactor(shape)
    words = "does not broadcast to one factor per element" if len(shape) == 4 else "adds 1 leading axes"
    with pytest.raises(UnsupportedOperation, match=words):
        pathir.compile(model, input_shape=(2, 6, 6))


# ---------------------------------------------------------------- ONNX

onnx_cases = pytest.importorskip("onnx_cases")


@pytest.mark.parametrize("exporter", ["legacy-nofold", "dynamo-noopt"])
@pytest.mark.parametrize("name", list(CASES))
def test_onnx_export_gives_the_torch_frontends_numbers(name, exporter):
    model, shape = _model(name)
    model = model.float()
    proto = onnx_cases.export(model, shape, exporter)
    cm, ct = onnx_cases.assert_export_matches(proto, model, shape)


def _mul_proto(op, c, x_shape=(1, 3, 2, 2)):
    from onnx_cases import make_model, node, tensor_info

    rng = np.random.default_rng(0)
    nodes = [node("Conv", ["x", "W"], ["h"], name="conv"), node("Relu", ["h"], ["r"], name="relu"),
             node(op, ["r", "c"], ["s"], name="factor"), node("Conv", ["s", "W2"], ["y"], name="out")]
    inits = {"W": rng.normal(size=(3, x_shape[1], 1, 1)), "W2": rng.normal(size=(2, 3, 1, 1)), "c": c}
    return make_model(nodes, [tensor_info("x", list(x_shape))], [tensor_info("y", [x_shape[0], 2, *x_shape[2:]])],
                      inits)


@pytest.mark.parametrize("op,c", [("Mul", np.array([0.5, -2.0, 0.0]).reshape(1, 3, 1, 1)),
                                  ("Mul", np.array([[1.5, -1.0], [0.25, 2.0]])),
                                  ("Div", np.array([2.0, -4.0, 0.5]).reshape(3, 1, 1))])
def test_onnx_mul_and_div_by_a_constant_tensor_equal_onnxruntime_and_the_definition(op, c):
    proto = _mul_proto(op, c)
    cm = pathir.compile(proto)
    x = np.random.default_rng(1).normal(size=(1, 3, 2, 2)).astype(np.float32)
    assert onnx_cases.rel(cm.forward(x, backend="numpy"), onnx_cases.ort_run(proto, x)[0]) <= 1e-6
    factor = np.abs(c if op == "Mul" else 1 / c).astype(np.float32)
    for q in (1.0, 2.0):  # the path-norm network: |W|^q, |c|^q, no ReLU, all-ones input
        from onnx import numpy_helper

        net = copy.deepcopy(proto)
        for t in net.graph.initializer:
            t.CopyFrom(numpy_helper.from_array(np.abs(numpy_helper.to_array(t)) ** q, t.name))
        net.graph.node[1].op_type = "Identity"
        if op == "Div":
            net.graph.node[2].op_type = "Mul"
            net.graph.initializer[2].CopyFrom(numpy_helper.from_array(factor**q, "c"))
        want = float(onnx_cases.ort_run(net, np.ones((1, 3, 2, 2), np.float32))[0].astype(np.float64).sum())
        assert cm.path_norm(q) ** q == pytest.approx(want, rel=1e-5)
    x0 = x.copy()
    before = onnx_cases.ort_run(proto, x0)[0]
    cm.pathcond()
    assert onnx_cases.rel(onnx_cases.ort_run(cm.to_onnx(), x0)[0], before) <= 1e-5


def test_onnx_factor_varying_over_the_batch_is_refused():
    with pytest.raises(UnsupportedOperation, match="does not broadcast"):
        pathir.compile(_mul_proto("Mul", np.ones((2, 3, 1, 1)), x_shape=(2, 3, 2, 2)))
