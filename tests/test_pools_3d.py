"""3-d average pools (AvgPool3d with padding, ceil_mode, count_include_pad, divisor_override;
AdaptiveAvgPool3d with even and uneven windows) and AdaptiveMaxPool3d: lowered like their 1-d and 2-d
kin. The compile self-check holds (the IR computes the model's function), and the l1 path-norm is
its definition: the network with every weight and bias made |w|, ReLUs removed, summed over the
outputs on the all-ones input (an average pool's coefficients are positive, so it stays itself)."""

import copy

import pytest
import torch
import torch.nn as nn

import pathir

SHAPE = (2, 4, 4, 5)
POOLS = {
    "padded": lambda: nn.AvgPool3d(2, stride=1, padding=1),
    "ceil, excluding the padding": lambda: nn.AvgPool3d((2, 2, 3), stride=(1, 2, 1), padding=(0, 1, 1),
                                                        count_include_pad=False, ceil_mode=True),
    "divisor_override": lambda: nn.AvgPool3d(2, divisor_override=3),
    "adaptive, even windows": lambda: nn.AdaptiveAvgPool3d((2, 2, 1)),
    "adaptive, uneven windows": lambda: nn.AdaptiveAvgPool3d((3, 2, 3)),
    "adaptive max, dividing": lambda: nn.AdaptiveMaxPool3d((2, 2, 5)),
}


def _net(pool: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv3d(2, 3, 3, padding=1), nn.ReLU(), pool, nn.Flatten(), nn.LazyLinear(2))
    net(torch.randn(1, *SHAPE))
    return net.double()


def _l1_by_definition(net: nn.Sequential) -> float:
    twin = copy.deepcopy(net)
    with torch.no_grad():
        for m in twin.modules():
            if isinstance(m, (nn.Conv3d, nn.Linear)):
                m.weight.abs_()
                m.bias.abs_()
    twin[1] = nn.Identity()
    with torch.no_grad():
        return float(twin(torch.ones(1, *SHAPE, dtype=torch.float64)).sum())


@pytest.mark.parametrize("case", [c for c in POOLS if "max" not in c])
def test_a_3d_average_pool_has_its_definitions_l1_path_norm(case):
    net = _net(POOLS[case]())
    assert pathir.compile(net, input_shape=SHAPE).path_norm(1) == pytest.approx(_l1_by_definition(net), rel=1e-13)


def test_a_3d_adaptive_max_pool_that_divides_is_a_max_pool_and_one_that_does_not_is_refused():
    net = _net(POOLS["adaptive max, dividing"]())
    cm = pathir.compile(net, input_shape=SHAPE)  # the self-check: the IR computes the model's function
    assert any(n.kind.value == "maxpool" for n in cm.graph.nodes)
    with pytest.raises(pathir.errors.PathirError, match="along spatial axis 2 its windows of 3 positions overlap"):
        pathir.compile(_net(nn.AdaptiveMaxPool3d((2, 2, 2))), input_shape=SHAPE)


class _Indexed(nn.Module):
    """A max-pool (or max over channels) that returns its indices too, the indices dropped or ``read``."""

    def __init__(self, how, read=False):
        super().__init__()
        self.how, self.read = how, read
        self.a, self.pool = nn.Conv2d(2, 3, 3, padding=1), nn.MaxPool2d(2, return_indices=True)

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.how == "module":
            v, i = self.pool(h)
        elif self.how == "functional":
            v, i = torch.nn.functional.max_pool2d(h, 2, return_indices=True)
        else:
            v, i = h.max(1, keepdim=True)
        return v + i.double() if self.read else v


@pytest.mark.parametrize("how", ["module", "functional", "max"])
def test_a_max_returning_its_indices_is_lowered_for_its_values_and_reading_them_is_refused(how):
    """fx refused MaxPool2d(return_indices=True) and F.max_pool2d(..., return_indices=True) even with the indices
    unread (torch.export lowered them); reading torch.max's indices crashed with an AttributeError."""
    from capture_reference import Untraceable, path_norm_q

    torch.manual_seed(0)
    for wrap in (lambda m: m, Untraceable):
        net = wrap(_Indexed(how)).double().eval()
        cm = pathir.compile(net, input_shape=(2, 4, 4))
        x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
        assert torch.allclose(torch.as_tensor(cm.forward(x.numpy())), net(x), rtol=1e-12, atol=1e-12)
        if how != "max":  # the definition's path-norm, on the same layers with a max-pool returning no indices
            plain = nn.Sequential(copy.deepcopy(getattr(net, "inner", net).a), nn.ReLU(), nn.MaxPool2d(2))
            assert cm.path_norm(1) == pytest.approx(path_norm_q(plain, [(2, 4, 4)], 1.0), rel=1e-12)
        with pytest.raises(pathir.UnsupportedOperation, match="reads the indices"):
            pathir.compile(wrap(_Indexed(how, read=True)).double().eval(), input_shape=(2, 4, 4))


@pytest.mark.parametrize("shape,pool", [((1, 1, 3), nn.MaxPool2d(2, stride=1, padding=1, dilation=2)),
                                        ((1, 2, 7), nn.MaxPool2d((1, 2), stride=1, padding=(0, 1), dilation=(1, 8)))])
def test_a_max_pool_window_of_only_padding_is_refused_by_name(shape, pool):
    """PyTorch returns -inf there; pathir failed its own graph verification (k outside 1..0)."""
    net = nn.Sequential(nn.Conv2d(1, 1, 1), nn.ReLU(), pool).double().eval()
    assert torch.isinf(net(torch.randn(1, *shape, dtype=torch.float64))).any()
    with pytest.raises(pathir.UnsupportedOperation, match="holds only padding"):
        pathir.compile(net, input_shape=shape)
