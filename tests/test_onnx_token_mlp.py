"""ONNX MatMul on the last axis of an activation with more axes, ``(batch, *S, F) @ B`` (an ``nn.Linear`` on
tokens or a channels-last map, as both exporters write it: MatMul then Add of the bias along the last axis):
a convolution of kernel size 1 whose kernel is B entry by entry, checked against onnxruntime's forward, the
torch frontend's path-norms of the same model, and write-backs (PathCond, equalization) that onnxruntime runs
to the same outputs."""

import re

import numpy as np
import pytest
import torch
import torch.nn as nn

pytest.importorskip("onnxruntime")

from onnx_cases import assert_export_matches, export, ort_run, rel  # noqa: E402

import pathir  # noqa: E402


class TokenMLP(nn.Module):
    """(B, T, 6) -> Linear(6, 8) -> ReLU -> Linear(8, 5, bias=...) -> ReLU -> mean over T -> Linear(5, 3)."""

    def __init__(self, bias=True, spatial=1):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(6, 8), nn.Linear(8, 5, bias=bias), nn.Linear(5, 3)
        self.spatial = spatial

    def forward(self, x):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        return self.head(h.mean(dim=tuple(range(1, 1 + self.spatial))))


@pytest.mark.parametrize("exporter", ["legacy-nofold", "legacy", "dynamo-noopt", "dynamo"])
@pytest.mark.parametrize("bias, shape", [(True, (4, 6)), (False, (4, 6)), (True, (3, 2, 6))],
                         ids=["tokens", "no-bias", "channels-last map"])
def test_matmul_on_the_last_axis_is_a_pointwise_layer(exporter, bias, shape):
    model = TokenMLP(bias, len(shape) - 1).eval()
    proto = export(model, shape, exporter)
    assert any(n.op_type == "MatMul" for n in proto.graph.node)  # not Gemm: the activation has more than 2 axes
    cm, _ = assert_export_matches(proto, model, shape)
    x = np.random.default_rng(1).normal(size=(4, *shape)).astype(np.float32)
    before = ort_run(proto, x)[0]
    cm.pathcond()
    cm.equalize(bits=6)
    assert rel(ort_run(cm.to_onnx(), x)[0], before) <= 1e-5  # the written file computes what the original did


def test_a_constant_varying_along_another_axis_is_still_refused():
    """A bias along the last axis is per output feature; one that also varies over the tokens is not a bias."""
    from onnx import TensorProto, helper, numpy_helper

    W = numpy_helper.from_array(np.ones((6, 4), dtype=np.float32), "W")
    C = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "C")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "C"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 4])], [W, C])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(pathir.errors.UnsupportedOperation, match="varies over positions"):
        pathir.compile(proto)


@pytest.mark.parametrize("shape", [(4,), (1, 1, 4)])
def test_a_non_finite_bias_along_the_last_axis_is_refused_by_its_stored_shape(shape):
    from onnx import TensorProto, helper, numpy_helper

    c = np.ones(shape, dtype=np.float32)
    c.reshape(-1)[2] = np.nan
    W = numpy_helper.from_array(np.ones((6, 4), dtype=np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "C"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 4])],
                              [W, numpy_helper.from_array(c, "C")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(pathir.errors.UnsupportedOperation, match=re.escape(f"shape {list(shape)} with a non-finite entry")):
        pathir.compile(proto)


def test_min_of_a_token_wise_relu_is_a_clipped_relu():
    """Min(Relu(x @ W), t) with t per channel of axis 1: the Relu of a token-wise MatMul is lowered in the
    MatMul's layout and permuted back, and the Min of it (what a rescaled Clip writes) was refused."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in (
        ("W", rng.normal(size=(5, 5))), ("c", rng.normal(size=5)), ("t", np.array([[1.0], [2.0], [0.5], [3.0]])),
        ("V", rng.normal(size=(3, 20))), ("d", rng.normal(size=3)))]
    inits.append(numpy_helper.from_array(np.array([0, -1], dtype=np.int64), "shape"))
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Add", ["m", "c"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]), helper.make_node("Min", ["r", "t"], ["k"]),
             helper.make_node("Reshape", ["k", "shape"], ["f"]), helper.make_node("Gemm", ["f", "V", "d"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.normal(size=(6, 4, 5)).astype(np.float32) * 3
    cm = pathir.compile(proto)
    before = ort_run(proto, x)[0]
    assert rel(cm.forward(x, backend="numpy"), before) <= 1e-5
    cm.pathcond(progress=False)
    assert rel(ort_run(cm.to_onnx(), x)[0], before) <= 1e-5


class TokenClipMLP(nn.Module):
    """(B, *S, 6) -> Linear(6, 8) -> a clipped ReLU -> Linear(8, 3): nn.ReLU6 (exported as Clip), or
    torch.minimum(relu(h), t) with t one threshold per feature (exported as Relu then Min of a (8,) constant)."""

    def __init__(self, act):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.act = nn.Linear(6, 8), nn.Linear(8, 3), act
        with torch.no_grad():
            self.a.weight.mul_(torch.logspace(-1, 1, 8)[:, None])
        self.register_buffer("t", torch.linspace(0.5, 3.0, 8))

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.minimum(torch.relu(h), self.t) if self.act == "min" else self.act(h))


@pytest.mark.parametrize("exporter", ["legacy-nofold", "dynamo"])
@pytest.mark.parametrize("act", ["relu6", "min"])
@pytest.mark.parametrize("shape", [(4, 6), (3, 2, 6)], ids=["tokens", "channels-last map"])
def test_a_clipped_relu_on_the_last_axis_has_a_unit_per_feature(act, shape, exporter):
    """Clip(0, 6) and Min(Relu(h), t) of a token-wise MatMul: one threshold and one unit per feature, as the torch
    frontend lowers them (they tied every feature into one unit); a write-back that moves them writes a Min whose
    constant lies along the last axis, which onnxruntime runs to the original's outputs."""
    model = TokenClipMLP(nn.ReLU6() if act == "relu6" else "min").eval()
    proto = export(model, shape, exporter)
    cm, _ = assert_export_matches(proto, model, shape)
    assert len(cm.units) == 8
    x = 3 * np.random.default_rng(1).normal(size=(4, *shape)).astype(np.float32)
    before, norm = ort_run(proto, x)[0], cm.path_norm(2)
    cm.pathcond()
    written = cm.to_onnx()
    assert rel(ort_run(written, x)[0], before) <= 1e-5
    constants = {i.name: tuple(i.dims) for i in written.graph.initializer}
    mins = [n for n in written.graph.node if n.op_type == "Min"]
    assert len(mins) == 1 and any(constants.get(name, ())[-1:] == (8,) for name in mins[0].input)
    assert pathir.compile(written).path_norm(2) == pytest.approx(norm, rel=1e-5)


class _HeldMin(nn.Module):
    """Min(Relu(h), t) whose constant holds one threshold per channel in a shape that broadcasts to none: the full
    per-sample (T, F) of a token-wise layer (rows equal), or a channels-last map flattened (channels along no axis)."""

    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        if kind == "tokens":
            self.l0, self.l1, self.l2 = nn.Linear(4, 4), nn.Linear(4, 5), nn.Linear(5, 2)
            self.register_buffer("t", (torch.rand(5) + 0.5).repeat(3, 1))
        else:
            self.c, self.l1, self.l2 = nn.Conv2d(2, 5, 3), nn.Linear(30, 4), nn.Linear(4, 3)
            self.register_buffer("t", (torch.rand(5) + 0.5).repeat(6))

    def forward(self, x):
        if self.kind == "tokens":
            return self.l2(torch.minimum(torch.relu(self.l1(torch.relu(self.l0(x)))), self.t))
        h = self.c(x).permute(0, 2, 3, 1).reshape(x.shape[0], -1)
        return self.l2(torch.relu(self.l1(torch.minimum(torch.relu(h), self.t))))


@pytest.mark.parametrize("kind, shape", [("tokens", (3, 4)), ("flattened", (2, 4, 5))])
def test_a_min_constant_no_shape_holds_per_channel_is_held_and_the_rest_written(kind, shape):
    """Its channels are held (the constant kept), and a write-back rescales the rest: every write-back raised a
    raw TypeError from the writer (clip review)."""
    model = _HeldMin(kind).eval()
    proto = export(model, shape, "legacy-nofold")
    cm = pathir.compile(proto)
    x = 3 * np.random.default_rng(1).normal(size=(4, *shape)).astype(np.float32)
    before = ort_run(proto, x)[0]
    assert rel(cm.forward(x, backend="numpy"), before) <= 1e-5 and len(cm.units) > 0
    cm.pathcond()
    assert rel(ort_run(cm.to_onnx(), x)[0], before) <= 1e-5


class LeftMatrix(nn.Module):
    """(B, 4, 5) -> Linear(5, 5) -> ReLU -> W @ h (W (3, 4) learnable, + a bias per row) -> ReLU -> Linear(5, 2)."""

    def __init__(self, bias):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.out, self.bias = nn.Linear(5, 5), nn.Linear(5, 2), bias
        self.W, self.b = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(3, 1))

    def forward(self, x):
        y = self.W @ torch.relu(self.a(x))
        return self.out(torch.relu(y + self.b if self.bias else y))


@pytest.mark.parametrize("exporter", ["legacy-nofold", "legacy", "dynamo-noopt", "dynamo"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_matmul_by_an_initializer_on_the_left_is_a_pointwise_layer_over_the_rows(exporter, bias):
    """MatMul(W, x) with x (batch, N, F): the dense layer (xᵀ Wᵀ)ᵀ over x's rows at every column (refused as
    'W @ activation is not lowered' before), against onnxruntime and the torch frontend; write-backs keep the
    function and rescale W."""
    model = LeftMatrix(bias).eval()
    proto = export(model, (4, 5), exporter)
    cm, _ = assert_export_matches(proto, model, (4, 5))
    x = np.random.default_rng(1).normal(size=(4, 4, 5)).astype(np.float32)
    before = ort_run(proto, x)[0]
    cm.pathcond()
    cm.equalize(bits=6)
    written = cm.to_onnx()
    assert rel(ort_run(written, x)[0], before) <= 1e-5
    from onnx import numpy_helper

    W = {i.name: numpy_helper.to_array(i) for i in written.graph.initializer}
    old = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    assert any(v.shape == (3, 4) and not np.array_equal(v, old[k]) for k, v in W.items() if k in old)  # W rescaled
