"""ONNX Sub, Neg, Mul/Div by a scalar and Max: the same graph quantities as the torch frontend,
and onnxruntime's outputs (compile's self-check compares with onnxruntime)."""

import io
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from test_capture_coverage import Maximum, ScalarMulDiv, Sub

import pathir

pytest.importorskip("onnxruntime")


class Negate(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.relu(-self.a(x)))


def _onnx(model, shape):
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(2, *shape),), f, dynamo=False, input_names=["x"],
                          dynamic_axes={"x": {0: "b"}})
    return f.getvalue()


@pytest.mark.parametrize("cls,shape", [(Sub, (3,)), (ScalarMulDiv, (2, 6, 6)), (Maximum, (2, 6, 6)),
                                       (Negate, (3,))])
def test_onnx_matches_the_torch_frontend(cls, shape):
    torch.manual_seed(0)
    model = cls().eval()
    ct = pathir.compile(model, input_shape=shape)
    co = pathir.compile(_onnx(model, shape))  # self-check: against onnxruntime
    for q in (1, 2):
        assert co.path_norm(q) == pytest.approx(ct.path_norm(q), rel=1e-9)
    assert co.num_paths() == pytest.approx(ct.num_paths(), rel=1e-12)
    x = np.random.default_rng(0).normal(size=(3, *shape))
    np.testing.assert_allclose(np.asarray(co.forward(x, backend="numpy")), np.asarray(ct.forward(x, backend="numpy")),
                               rtol=1e-9, atol=1e-9)


def test_onnx_with_two_inputs():
    from test_input_errors import TwoInputs

    torch.manual_seed(0)
    model = TwoInputs().eval()
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(2, 3), torch.randn(2, 4)), f, dynamo=False, input_names=["x", "y"],
                          dynamic_axes={"x": {0: "b"}, "y": {0: "b"}})
    co = pathir.compile(f.getvalue())  # self-check against onnxruntime, both inputs fed
    ct = pathir.compile(model, input_shape=[(3,), (4,)])
    assert sorted(co.graph.inputs) == ["x", "y"]
    assert co.path_norm(1) == pytest.approx(ct.path_norm(1), rel=1e-9)
