"""Write-back through parametrized weights: weight_norm (both APIs) exact, the rest refused untouched."""

import pytest
import torch
import torch.nn as nn
from capture_reference import assert_forward, eval_forward
from torch.nn.utils import parametrizations, parametrize

import pathir
from pathir.errors import PathirError


def _convnet():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Conv2d(4, 3, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(3 * 2 * 2, 5), nn.ReLU(), nn.Linear(5, 2)).double()


def _rescale_randomly(cm, seed=0):
    """A random rescaling written back (pathcond moves little on a fresh net; this moves every unit)."""
    import numpy as np

    from pathir.rescaling.apply import log_scales

    z = np.random.default_rng(seed).normal(size=len(cm.units)) * 0.7
    cm.writer.rescale(cm.graph, log_scales(cm.graph, cm.units, z))


def _keeps_function(model, how):
    x = torch.randn(4, 2, 6, 6, dtype=torch.float64)
    before = eval_forward(model, x)
    cm = assert_forward(model, (2, 6, 6))
    how(cm)
    after = eval_forward(model, x)
    assert torch.allclose(after, before, rtol=1e-10, atol=1e-10 * float(before.abs().max()))
    assert_forward(model, (2, 6, 6))  # and the recompiled model is still exact


WEIGHT_NORMS = {
    "param_dim0": lambda m: parametrizations.weight_norm(m),
    "param_dimNone": lambda m: parametrizations.weight_norm(m, dim=None),
    "legacy_dim0": lambda m: torch.nn.utils.weight_norm(m),
    "legacy_dim1": lambda m: torch.nn.utils.weight_norm(m, dim=1),
}


@pytest.mark.parametrize("kind", list(WEIGHT_NORMS))
@pytest.mark.parametrize("how", ["pathcond", "random"])
def test_weight_norm_write_back_keeps_function(kind, how):
    model = _convnet()
    for i in (0, 2, 5):
        WEIGHT_NORMS[kind](model[i])
    _keeps_function(model, (lambda cm: cm.pathcond()) if how == "pathcond" else _rescale_randomly)


def test_weight_norm_per_channel_scale_only_changes_g():
    model = _convnet()
    parametrizations.weight_norm(model[0])
    v = model[0].parametrizations.weight.original1.detach().clone()
    cm = pathir.compile(model, input_shape=(2, 6, 6))
    _rescale_randomly(cm)
    assert torch.equal(model[0].parametrizations.weight.original1, v)


class _Double(nn.Module):
    def forward(self, w):
        return 2 * w


REFUSED = {
    "spectral_param": (lambda m: parametrizations.spectral_norm(m), "spectral"),
    "spectral_legacy": (lambda m: torch.nn.utils.spectral_norm(m), "spectral"),
    "custom": (lambda m: parametrize.register_parametrization(m, "weight", _Double()), "_Double"),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_other_parametrizations_compile_exactly_and_refuse_write_back(kind):
    model = _convnet()
    add, match = REFUSED[kind]
    add(model[2])
    model.eval()
    x = torch.randn(1, 2, 6, 6, dtype=torch.float64)
    model(x)  # a legacy spectral_norm computes its weight in a forward
    cm = assert_forward(model, (2, 6, 6))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PathirError, match=match):
        _rescale_randomly(cm)
    with pytest.raises(PathirError, match=match):
        cm.pathcond()
    after = model.state_dict()
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)


def test_pruning_a_weight_normed_weight_refused():
    model = _convnet()
    parametrizations.weight_norm(model[5])
    cm = pathir.compile(model, input_shape=(2, 6, 6))
    with pytest.raises(PathirError, match="cannot be pruned"):
        cm.prune(0.5, scope="global")
