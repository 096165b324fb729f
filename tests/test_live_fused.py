"""A live Compiled follows torch's fused optimizers, whose in-place steps bump no version counter."""

import pytest
import torch
import torch.nn as nn

import pathir


def _path_norm(net: nn.Sequential, q: float) -> float:
    """‖Φ‖_q of Linear-ReLU-Linear by its definition: |w|^q on the ones vector (biases start paths)."""
    h = net[0].weight.abs() ** q @ torch.ones(net[0].in_features, dtype=torch.float64) + net[0].bias.abs() ** q
    return float(((net[2].weight.abs() ** q @ h + net[2].bias.abs() ** q).sum()) ** (1 / q))


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "Adagrad"])
def test_a_fused_optimizer_step_is_followed(name):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    cm = pathir.compile(net, input_shape=(3,))
    penalty = pathir.PathNormPenalty(net, q=2, compiled=cm)
    opt = getattr(torch.optim, name)(net.parameters(), lr=0.1, fused=True)
    x = torch.randn(8, 3, dtype=torch.float64)
    for _ in range(3):
        before = _path_norm(net, 2)
        opt.zero_grad()
        (net(x).pow(2).mean() + penalty()).backward()
        opt.step()
        now = _path_norm(net, 2)
        assert now != before  # the step moved the weights
        assert cm.path_norm(2) == pytest.approx(now, rel=1e-12)
        assert float(penalty().detach()) == pytest.approx(now, rel=1e-12)
