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


def test_a_negated_running_variance_of_a_kept_batch_norm_sets_the_bound_by_its_values():
    """A batch-norm after a ReLU is not folded: its running variance bounds the rescaling (the default
    max_log_scale), read by `Compiled` itself, where torch's RuntimeError stopped pathcond and equalize."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.BatchNorm1d(6), nn.Linear(6, 2)).double().eval()
    net[2].running_var = torch._neg_view(-torch.rand(6, dtype=torch.float64) - 0.5)
    x = torch.randn(5, 4, dtype=torch.float64)
    before = net(x).detach().clone()
    cm = pathir.compile(net, input_shape=(4,))
    bound = pathir.compile(_materialised(net), input_shape=(4,)).pathcond(write_back=False).max_log_scale
    assert cm.pathcond().max_log_scale == bound
    torch.testing.assert_close(net(x).detach(), before, rtol=1e-12, atol=1e-12)
    cm.equalize()
    torch.testing.assert_close(net(x).detach(), before, rtol=1e-12, atol=1e-12)
