"""A parameter or buffer that is a lazily negated view (``torch._neg_view``: torch keeps the storage and a flag) is
read by its values: compile failed on it (numpy reads the storage, torch refused to hand it over), and so did the
re-read after a ``.data`` edit. Checked against the same model with every tensor materialised."""

import copy

import pytest
import torch
import torch.nn as nn

import pathir


def _materialised(model):
    out = copy.deepcopy(model)
    for module in out.modules():
        for k, v in list(module._parameters.items()):
            if v is not None:
                module._parameters[k] = nn.Parameter(v.detach().resolve_neg().clone())
        for k, v in list(module._buffers.items()):
            if v is not None:
                module._buffers[k] = v.resolve_neg().clone()
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_negated_views_are_read_by_their_values_and_written_back(dtype):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(48, 2)).to(dtype).eval()
    m[0].weight = nn.Parameter(torch._neg_view(torch.randn(3, 2, 3, 3, dtype=dtype)))
    m[1].running_mean = torch._neg_view(torch.randn(3, dtype=dtype))
    m[4].bias = nn.Parameter(torch._neg_view(torch.randn(2, dtype=dtype)))
    x = torch.randn(4, 2, 6, 6, dtype=dtype)
    before = m(x).detach().clone()
    cm = pathir.compile(m, input_shape=(2, 6, 6))
    assert cm.path_norm(1) == pytest.approx(pathir.compile(_materialised(m), input_shape=(2, 6, 6)).path_norm(1),
                                            rel=1e-12)
    cm.pathcond()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(m(x).detach(), before, rtol=tol, atol=tol)
    m[0].weight.data = torch._neg_view(torch.randn(3, 2, 3, 3, dtype=dtype))  # re-read after a .data edit
    assert cm.path_norm(2) == pytest.approx(pathir.compile(_materialised(m), input_shape=(2, 6, 6)).path_norm(2),
                                            rel=1e-12)
