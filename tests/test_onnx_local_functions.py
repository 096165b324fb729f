"""ONNX model-local functions (``torch.onnx.export(..., export_modules_as_functions=...)``, or written by hand):
read with every call inlined, as onnxruntime runs them. Checked against onnxruntime's forward of the original,
the torch frontend's path-norms of the same model, and write-backs that onnxruntime runs to the original's
outputs; the caller's proto is not modified."""

import io
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

pytest.importorskip("onnxruntime")

import onnx  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402
from onnx_cases import node, ort_run, randomize_batchnorms, rel, tensor_info  # noqa: E402

import pathir  # noqa: E402


class Inner(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.c, self.bn, self.act = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), act

    def forward(self, x):
        return self.act(self.bn(self.c(x)))


class Block(nn.Module):
    """A residual block whose branch is itself a module: two levels of functions where both are exported so."""

    def __init__(self, act):
        super().__init__()
        self.inner = Inner(act)

    def forward(self, x):
        return self.inner(x) + x


class Net(nn.Module):
    def __init__(self, act=torch.relu):
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.b1, self.b2, self.head = nn.Conv2d(3, 4, 3), Block(act), Block(act), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.b2(self.b1(torch.relu(self.stem(x)))).mean((2, 3)))


def _export(model, functions, keep_bn=True) -> onnx.ModelProto:
    f = io.BytesIO()
    mode = torch.onnx.TrainingMode.PRESERVE if keep_bn else torch.onnx.TrainingMode.EVAL
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), (torch.randn(2, 3, 8, 8),), f, dynamo=False, training=mode,
                          export_modules_as_functions=functions)
    return onnx.load_from_string(f.getvalue())


@pytest.mark.parametrize("functions", [{Block}, {Block, Inner}], ids=["blocks", "nested"])
@pytest.mark.parametrize("keep_bn", [True, False], ids=["batchnorm-kept", "batchnorm-folded"])
def test_a_model_with_local_functions_is_read_inlined(functions, keep_bn):
    model = randomize_batchnorms(Net())
    proto = _export(model, functions, keep_bn)
    assert proto.functions and sum(n.op_type == "Conv" for n in proto.graph.node) == 1  # (the blocks': in functions)
    original = proto.SerializeToString()
    cm, ct = pathir.compile(proto), pathir.compile(model, input_shape=(3, 8, 8))
    x = np.random.default_rng(0).normal(size=(2, 3, 8, 8)).astype(np.float32)
    before = ort_run(proto, x)[0]
    assert rel(cm.forward(x, backend="numpy"), before) <= 1e-5
    for q in (1, 2):
        assert cm.path_norm(q) == pytest.approx(ct.path_norm(q), rel=1e-6)  # (the exporter's float32 BN fold)
    assert cm.num_paths() == pytest.approx(ct.num_paths(), rel=1e-12)
    cm.pathcond()
    cm.equalize(bits=6)
    written = cm.to_onnx()
    assert rel(ort_run(written, x)[0], before) <= 1e-5 and not written.functions
    assert proto.SerializeToString() == original  # the caller's proto: not modified


def test_a_non_homogeneous_op_inside_a_function_is_refused_by_name():
    proto = _export(Net(act=nn.functional.gelu), {Block})
    original = proto.SerializeToString()
    with pytest.raises(pathir.UnsupportedOperation, match=r"\(op Gelu\).*not positively homogeneous"):
        pathir.compile(proto)
    assert proto.SerializeToString() == original


def test_a_hand_written_function_called_twice_with_its_own_weights():
    """A function ``dense_relu(x, W, b) = Relu(Gemm(x, W, b))`` called on two layers' initializers: each call is its
    layer; the path-norm is the hand-written one (|W|, |b| layer by layer on ones) and a rescaling is written into
    each call's own initializers."""
    fn = helper.make_function("local", "dense_relu", ["x", "W", "b"], ["y"],
                              [helper.make_node("Gemm", ["x", "W", "b"], ["h"], transB=1),
                               helper.make_node("Relu", ["h"], ["y"])],
                              opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(0)
    W1, b1, W2, b2, W3 = rng.normal(size=(5, 3)), rng.normal(size=5), rng.normal(size=(4, 5)), rng.normal(size=4), \
        rng.normal(size=(2, 4))
    nodes = [helper.make_node("dense_relu", ["x", "W1", "b1"], ["h1"], domain="local", name="call1"),
             helper.make_node("dense_relu", ["h1", "W2", "b2"], ["h2"], domain="local", name="call2"),
             node("MatMul", ["h2", "W3t"], ["y"])]
    inits = [numpy_helper.from_array(v.astype(np.float32), k)
             for k, v in {"W1": W1, "b1": b1, "W2": W2, "b2": b2, "W3t": W3.T}.items()]
    graph = helper.make_graph(nodes, "handmade", [tensor_info("x", [1, 3])], [tensor_info("y", [1, 2])], inits)
    proto = helper.make_model(graph, functions=[fn], opset_imports=[helper.make_opsetid("", 17),
                                                                    helper.make_opsetid("local", 1)])
    proto.ir_version = 9
    onnx.checker.check_model(proto)
    cm = pathir.compile(proto)
    a = lambda v: np.abs(v.astype(np.float32).astype(np.float64))  # noqa: E731 (the file's float32 values)
    ones = a(W3) @ (a(W2) @ (a(W1) @ np.ones(3) + a(b1)) + a(b2))
    assert cm.path_norm(1) == pytest.approx(float(ones.sum()), rel=1e-12)
    x = rng.normal(size=(1, 3)).astype(np.float32)
    before = ort_run(proto, x)[0]
    cm.pathcond()
    assert rel(ort_run(cm.to_onnx(), x)[0], before) <= 1e-5
