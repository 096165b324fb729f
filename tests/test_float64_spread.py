"""Models whose weights span more than float64 holds at one scale (a layer at 1e-170 beside layers at 1):
each rescaling method answers exactly or refuses by name, never takes a live unit for a dead one."""

import copy

import pytest
import torch

import pathir
from pathir.errors import PathirError, PathNormOverflow


def _tiny_first_layer(seed: int = 0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 5), torch.nn.ReLU(),
                              torch.nn.Linear(5, 3)).double()
    with torch.no_grad():
        net[0].weight.mul_(1e-170), net[0].bias.mul_(1e-170)  # its |θ|² (1e-340) and its paths' diag G underflow
    return net


def _state(net):
    return {k: v.clone() for k, v in net.state_dict().items()}


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("method", ["pathcond", "enorm"])
def test_a_layer_beyond_float64_is_refused_and_the_model_untouched(method):
    net = _tiny_first_layer()
    before = _state(net)
    cm = pathir.compile(net, input_shape=(4,))
    match = "PathCond's diag G: param '2.weight'" if method == "pathcond" else "ENorm: \\|θ\\|\\^2 underflows"
    with pytest.raises(PathirError, match=match):  # before: every unit listed degenerate, z = 0 (PathCond)
        getattr(cm, method)()
    assert _same(before, _state(net))


def test_pathcond_refusal_is_an_overflow_error():
    cm = pathir.compile(_tiny_first_layer(), input_shape=(4,))
    with pytest.raises(PathNormOverflow, match="cm.enorm\\(p=1\\) balances them first"):
        cm.pathcond(write_back=False)


def test_the_suggested_enorm_p1_brings_the_layers_into_range_then_pathcond_is_exact():
    net = _tiny_first_layer()
    x = torch.randn(16, 4, dtype=torch.float64)
    y = net(x).detach()
    cm = pathir.compile(net, input_shape=(4,))
    assert not cm.enorm(p=1).degenerate_units
    report = cm.pathcond()
    assert not report.degenerate_units and report.max_abs_log_scale > 1.0  # the units move: nothing dead
    assert torch.allclose(net(x), y, rtol=1e-12, atol=1e-12 * float(y.abs().max()))


def test_normalize_underflow_advises_a_smaller_p():
    cm = pathir.compile(copy.deepcopy(_tiny_first_layer()), input_shape=(4,))
    with pytest.raises(PathirError, match="use a smaller p"):
        cm.normalize(p=2)


def _overflowing_representative():
    """An MLP rescaled unit by unit (function kept, every weight below 1e109) whose hidden values reach e^750."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(3, 4, bias=False)]
    for i in range(5):
        layers += [torch.nn.ReLU(), torch.nn.Linear(4, 4 if i < 4 else 2, bias=False)]
    net = torch.nn.Sequential(*layers).double()
    shifts = [0.0, 250.0, 500.0, 750.0, 500.0, 250.0, 0.0]
    with torch.no_grad():
        for k, lin in enumerate(m for m in net if isinstance(m, torch.nn.Linear)):
            lin.weight.mul_(torch.exp(torch.tensor(shifts[k + 1] - shifts[k], dtype=torch.float64)))
    return net


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_active_quantities_refuse_a_forward_that_overflows(backend):
    """Before: active path counts [0, 162, 0, ...] (numpy) and all 0 (torch) against the exact [48, 648, 288, ...],
    read off inf and NaN pre-activations."""
    cm = pathir.compile(_overflowing_representative(), input_shape=(3,))
    x = torch.randn(8, 3, dtype=torch.float64).numpy() * 3
    for query in (lambda: cm.active_path_counts(x, log10=False, backend=backend),
                  lambda: cm.active_path_norm(x, 1, backend=backend), lambda: cm.local_affine(x)):
        with pytest.raises(PathirError, match="pre-activation at x is not finite: the float64 forward does not fit"):
            query()
    cm.enorm()  # the suggested cure: balanced, the same function in range
    assert (cm.active_path_counts(x, log10=False, backend=backend) > 0).any()
