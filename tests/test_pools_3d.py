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
    with pytest.raises(pathir.errors.PathirError, match="windows overlap"):
        pathir.compile(_net(nn.AdaptiveMaxPool3d((2, 2, 2))), input_shape=SHAPE)
