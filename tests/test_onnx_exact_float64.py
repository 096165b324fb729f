"""A float64 ONNX model is lowered to float64 precision against onnxruntime (not only to float32's)."""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx import numpy_helper as nh

import pathir


def test_a_float64_batch_norm_reads_its_float32_epsilon_as_onnxruntime_widens_it():
    """epsilon is a float32 attribute: onnxruntime adds 0.0010000000475 for 1e-3 (the decimal was off by 4e-11)."""
    D = TensorProto.DOUBLE
    g, be, mu, var = (np.array(v, np.float64) for v in ([1.3, -0.7], [0.1, 0.2], [0.3, 0.4], [0.9, 0.5]))
    W = np.random.default_rng(0).normal(size=(2, 3))
    graph = helper.make_graph(
        [helper.make_node("BatchNormalization", ["x", "g", "be", "mu", "var"], ["h"], name="bn", epsilon=1e-3),
         helper.make_node("Relu", ["h"], ["r"], name="relu"), helper.make_node("Gemm", ["r", "W"], ["y"], name="fc")],
        "g", [helper.make_tensor_value_info("x", D, ["N", 2])], [helper.make_tensor_value_info("y", D, ["N", 3])],
        [nh.from_array(a, n) for a, n in ((g, "g"), (be, "be"), (mu, "mu"), (var, "var"), (W, "W"))])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    x = np.random.default_rng(1).normal(size=(4, 2))
    ref = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    out = pathir.compile(proto).forward(x, backend="numpy")
    assert np.abs(out - ref).max() <= 1e-14 * np.abs(ref).max()


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("scale", [2.0, 1.5, 0.6])
def test_resize_at_opset_10_reads_its_scales_from_its_second_input(mode, scale):
    """Resize-10 is (X, scales): its scales were read as opset 11's roi and the model refused."""
    rng = np.random.default_rng(0)
    F = TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "W"], ["h"], name="conv"), helper.make_node("Relu", ["h"], ["r"], name="relu"),
         helper.make_node("Resize", ["r", "scales"], ["y"], name="up", mode=mode)],
        "g", [helper.make_tensor_value_info("x", F, ["N", 2, 5, 5])], [helper.make_tensor_value_info("y", F, ["N", 3, int(5 * scale), int(5 * scale)])],
        [nh.from_array(rng.normal(size=(3, 2, 1, 1)).astype(np.float32), "W"),
         nh.from_array(np.array([1, 1, scale, scale], np.float32), "scales")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 10)])
    proto.ir_version = 5
    x = rng.normal(size=(3, 2, 5, 5)).astype(np.float32)
    ref = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    out = pathir.compile(proto).forward(x.astype(np.float64), backend="numpy")
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
