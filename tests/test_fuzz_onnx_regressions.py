"""Defects the ONNX graph fuzzer (tests/test_fuzz_onnx_graphs.py) found, each as the shrunk graph it drew."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_programs import run

import pathir


def _max_then_dense(zero: np.ndarray, zero_first: bool):
    """x[N,2,3,3] -> Max(x, zero) -> Flatten -> Gemm(transB) (float64: onnxruntime computes in double)."""
    W = np.random.default_rng(0).normal(size=(2, 18))
    ins = ["z", "x"] if zero_first else ["x", "z"]
    g = helper.make_graph(
        [helper.make_node("Max", ins, ["m"], name="max0"), helper.make_node("Flatten", ["m"], ["f"]),
         helper.make_node("Gemm", ["f", "W"], ["y"], transB=1)], "fuzzed",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["N", 2, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["N", 2])],
        [numpy_helper.from_array(zero, "z"), numpy_helper.from_array(W, "W")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), W


@pytest.mark.parametrize("shape", [(), (1,), (2, 1, 1), (1, 2, 3, 3)])
@pytest.mark.parametrize("zero_first", [False, True])
def test_max_with_zero_is_a_relu(shape, zero_first):
    """Max(x, 0) was refused as "clipping at a fixed non-zero level": it is ReLU(x)."""
    model, W = _max_then_dense(np.zeros(shape), zero_first)
    x = np.random.default_rng(1).normal(size=(5, 2, 3, 3))
    cm = pathir.compile(model)
    np.testing.assert_allclose(cm.forward(x, backend="numpy"), run(model, x)[0], rtol=1e-12, atol=1e-12)
    assert cm.path_norm(1) == pytest.approx(np.abs(W).sum(), rel=1e-12)  # one path per weight


@pytest.mark.parametrize("zero,why", [(np.array([0.5]), "non-zero constant"), (np.zeros((2, 2, 3, 3)), "larger shape")])
def test_max_with_another_constant_is_refused(zero, why):
    model, _ = _max_then_dense(zero, False)
    source = model.SerializeToString()
    with pytest.raises(pathir.UnsupportedOperation, match=why) as err:
        pathir.compile(model)
    assert "max0" in str(err.value) and "Max" in str(err.value)
    assert model.SerializeToString() == source


@pytest.mark.parametrize("how", ["sizes", "scales"])
def test_resize_with_axes(how):
    """An opset-18 Resize whose sizes or scales name only the spatial axes (the batch symbolic) was
    refused as "Resize with axes=[2, 3]"."""
    given = np.array([8, 6], np.int64) if how == "sizes" else np.array([2.0, 1.5], np.float32)
    ins = ["x", "", "", "s"] if how == "sizes" else ["x", "", "s"]
    W = np.random.default_rng(0).normal(size=(2 * 8 * 6, 2)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("Resize", ins, ["r"], name="resize", mode="nearest", axes=[2, -1]),
         helper.make_node("Flatten", ["r"], ["f"]), helper.make_node("MatMul", ["f", "W"], ["y"])], "fuzzed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
        [numpy_helper.from_array(given, "s"), numpy_helper.from_array(W, "W")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    x = np.random.default_rng(1).normal(size=(3, 2, 4, 4)).astype(np.float32)
    cm = pathir.compile(model)
    np.testing.assert_allclose(cm.forward(x.astype(np.float64), backend="numpy"), run(model, x)[0], rtol=1e-5, atol=1e-5)
    # nearest: every output position copies one input position, so each weight is one path per input
    assert cm.num_paths() == W.size
