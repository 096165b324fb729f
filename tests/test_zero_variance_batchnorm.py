"""A batch-norm whose running variance plus eps is 0 divides by zero: the model itself computes inf. pathir refuses
it naming the tensor and how it was made, on both frontends, whether the batch-norm is folded into the layer before
it or kept (it was a GraphVerificationError blaming the fold pass and naming finite tensors on ONNX, and a raw numpy
divide-by-zero warning on torch)."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

import pathir
from pathir.errors import GraphVerificationError, PathirError


def _torch_model():
    m = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3, eps=0.0), nn.ReLU(), nn.Conv2d(3, 2, 1)).double().eval()
    with torch.no_grad():
        m[1].running_var[0] = 0.0
    return m


def test_torch_refuses_by_name_without_a_raw_warning():
    model = _torch_model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(PathirError, match=r"sqrt\(1.running_var \+ 0\).*NaN or infinite"):
            pathir.compile(model, input_shape=(2, 6, 6))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("folded", [True, False], ids=["folded", "kept"])
def test_onnx_refuses_by_name_folded_or_kept(folded):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    init = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in [
        ("W1", rng.normal(size=(3, 2, 3, 3))), ("g", np.ones(3)), ("be", np.zeros(3)), ("mu", np.zeros(3)),
        ("var", np.array([0.0, 1.0, 1.0])), ("W2", rng.normal(size=(2, 3, 1, 1)))]]
    bn = helper.make_node("BatchNormalization", ["c1" if folded else "r", "g", "be", "mu", "var"], ["b"], epsilon=0.0)
    nodes = [helper.make_node("Conv", ["x", "W1"], ["c1"]), bn, helper.make_node("Relu", ["b"], ["r2"]),
             helper.make_node("Conv", ["r2", "W2"], ["y"])] if folded else [
        helper.make_node("Conv", ["x", "W1"], ["c1"]), helper.make_node("Relu", ["c1"], ["r"]), bn,
        helper.make_node("Conv", ["b", "W2"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2, 4, 4])], init)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    with pytest.raises(PathirError, match=r"'g' \(made as g / sqrt\(var \+ 0\)\) has 1 NaN or infinite") as err:
        pathir.compile(proto, self_check=False).path_norm(1)  # (kept: refused at the first query)
    assert not isinstance(err.value, GraphVerificationError)


def test_onnx_matmul_by_a_rank_1_initializer_on_the_left_is_refused_as_such():
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones(5, dtype=np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["w", "x"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 5, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])], [w])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    with pytest.raises(pathir.errors.UnsupportedOperation, match="'mm'.*weight of rank 1 on the left"):
        pathir.compile(proto)
