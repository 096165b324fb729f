"""bfloat16 and float16 models and inputs through every path: written back, queried, or refused by name (a raw
TypeError from numpy, which has no bfloat16, or the model's own RuntimeError, was what users got)."""

import numpy as np
import pytest
import torch
import torch.nn as nn

import pathir
from pathir.errors import InputShapeError, PathirError


def _unfolded_bn(dtype):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.BatchNorm1d(6), nn.Linear(6, 2)).to(dtype).eval()
    with torch.no_grad():
        net[2].running_var.uniform_(0.5, 2.0)
    return net


@pytest.mark.parametrize("method", ["pathcond", "enorm", "normalize", "equalize"])
def test_a_bfloat16_model_with_an_unfolded_batch_norm_is_written_back(method):
    """The running variance's check read the bfloat16 tensor through numpy: TypeError on every write-back."""
    net = _unfolded_bn(torch.bfloat16)
    x = torch.randn(8, 4, dtype=torch.bfloat16)
    y = net(x).float()
    getattr(pathir.compile(net, input_shape=(4,)), method)()
    assert net[2].running_var.dtype == torch.bfloat16
    torch.testing.assert_close(net(x).float(), y, rtol=0.05, atol=0.05)  # bfloat16's own rounding


def test_bfloat16_inputs_are_read_by_every_query_and_backend():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(torch.bfloat16)
    cm = pathir.compile(net, input_shape=(4,))
    x = torch.randn(5, 4, dtype=torch.bfloat16)
    exact = x.float()  # bfloat16 values are float32 values
    np.testing.assert_array_equal(cm.forward(x, backend="numpy"), cm.forward(exact.numpy(), backend="numpy"))
    metric = pathir.active_path_metric(cm, cm, x)  # was a TypeError
    assert np.all(metric.upper == 0)
    np.testing.assert_array_equal(cm.active_path_norm(x), cm.active_path_norm(exact))


def test_a_model_that_cannot_run_is_refused_by_the_write_back_and_named_by_compile():
    """A layer cast to float16 after compile: write-backs raised the model's raw RuntimeError; a fresh compile said
    'where the shape is wrong'."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    cm = pathir.compile(net, input_shape=(4,))
    net[2].half()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(PathirError, match="the model's own forward fails"):
        cm.pathcond()
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())
    with pytest.raises(InputShapeError, match="its tensors are in float16 and float32"):
        pathir.compile(net, input_shape=(4,))
