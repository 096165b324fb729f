"""Path-SGD (docs/math.md §10): diag G in the model's coordinates, rescaling equivariance."""

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn

import pathir
from pathir.errors import PathirError
from pathir.frontends.torch.writer import TorchWriter
from pathir.integrations.optim import PathSGD
from pathir.rescaling.apply import log_scales


def mlp():
    return nn.Sequential(nn.Linear(4, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 2))


def bn_mlp():
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


def cnn():
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(4, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 2))


SHAPES = {mlp: (4,), bn_mlp: (3,), cnn: (2, 8, 8)}


def make(factory, seed=0):
    torch.manual_seed(seed)
    net = factory().double()
    with torch.no_grad():  # batch-norms away from their identity initialisation
        for m in net.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return net


def rescaled_twin(net, shape, seed=1):
    """A copy of ``net`` moved along its rescaling orbit by random log-scales in [-2, 2]."""
    cm = pathir.compile(net, input_shape=shape)
    z = np.random.default_rng(seed).uniform(-2, 2, size=len(cm.units))
    twin = copy.deepcopy(net)
    TorchWriter(twin).rescale(cm.graph, log_scales(cm.graph, cm.units, z))
    return twin


def batches(shape, n=20, seed=3):
    """Minibatches of a regression task a ReLU network can learn (a random teacher)."""
    g = torch.Generator().manual_seed(seed)
    d = int(np.prod(shape))
    A, B = torch.randn(d, 6, generator=g, dtype=torch.float64), torch.randn(6, 2, generator=g, dtype=torch.float64)
    out = []
    for _ in range(n):
        x = torch.randn(16, *shape, generator=g, dtype=torch.float64)
        out.append((x, (x.reshape(16, -1) @ A).relu() @ B / d))
    return out


def run(net, shape, data, optimizer, train: bool):
    """Train on ``data``; return the losses and the eval-mode outputs on a fixed input after each step."""
    probe = torch.randn(8, *shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    losses, outputs = [], []
    for x, y in data:
        net.train(train)

        def closure():
            optimizer.zero_grad()
            loss = ((net(x) - y) ** 2).mean()
            loss.backward()
            return loss

        losses.append(optimizer.step(closure).item())
        net.eval()
        with torch.no_grad():
            outputs.append(net(probe).clone())
    return np.array(losses), torch.stack(outputs)


@pytest.mark.parametrize("factory, train, k, momentum", [
    (mlp, True, 1, 0.0), (mlp, True, 3, 0.9), (bn_mlp, True, 1, 0.0), (cnn, True, 2, 0.0), (cnn, False, 1, 0.5),
], ids=["mlp", "mlp-k3-momentum", "bn-mlp-train", "cnn-bn-train-k2", "cnn-bn-eval"])
def test_iterates_stay_rescaling_equivalent_plain_sgd_do_not(factory, train, k, momentum):
    shape, data = SHAPES[factory], batches(SHAPES[factory])
    net = make(factory)
    twin = rescaled_twin(net, shape)
    results = {}
    for name, opt_of in {
        "path-sgd": lambda m: PathSGD(m.parameters(), compiled=pathir.compile(m, input_shape=shape), lr=0.02, k=k, momentum=momentum),
        "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.02, momentum=momentum),
    }.items():
        a, b = copy.deepcopy(net), copy.deepcopy(twin)
        results[name] = (run(a, shape, data, opt_of(a), train), run(b, shape, data, opt_of(b), train))
    (la, oa), (lb, ob) = results["path-sgd"]
    assert la[-5:].mean() < la[:5].mean()  # it trains
    np.testing.assert_allclose(lb, la, rtol=1e-9)
    torch.testing.assert_close(ob, oa, rtol=1e-8, atol=1e-10)
    (_, oa), (_, ob) = results["sgd"]
    assert float((ob[-1] - oa[-1]).abs().max() / oa[-1].abs().max()) > 1e-2


def test_diag_g_of_a_batchnorm_free_model_is_the_graph_diag_g():
    net = make(mlp)
    cm = pathir.compile(net, input_shape=(4,))
    opt = PathSGD(net.parameters(), compiled=cm)
    opt.refresh()
    g = opt.diag_g()
    expected = cm.diag_g()
    assert g.keys() == expected.keys()
    for name in g:
        np.testing.assert_allclose(g[name].numpy(), expected[name], rtol=1e-12)


def explicit_phi(W1, b1, gamma, beta, W2, b2, mean, var, eps):
    """Φ of Linear -> BatchNorm1d (eval) -> ReLU -> Linear, written out path by path."""
    c = gamma / torch.sqrt(var + eps)
    W1f, b1f = W1 * c[:, None], c * (b1 - mean) + beta
    return torch.cat([(W2[:, :, None] * W1f[None]).reshape(-1), (W2 * b1f[None]).reshape(-1), b2])


def test_diag_g_in_model_coordinates_of_a_folded_batchnorm():
    net = make(bn_mlp)
    opt = PathSGD(net.parameters(), compiled=pathir.compile(net, input_shape=(3,)))
    opt.refresh()
    lin1, bn, lin2 = net[0], net[1], net[3]
    leaves = (lin1.weight, lin1.bias, bn.weight, bn.bias, lin2.weight, lin2.bias)
    names = ("0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias")
    jac = torch.autograd.functional.jacobian(
        lambda *t: explicit_phi(*t, bn.running_mean, bn.running_var, bn.eps), tuple(t.detach() for t in leaves))
    g = opt.diag_g()
    for name, J in zip(names, jac):
        np.testing.assert_allclose(g[name].numpy(), (J**2).sum(dim=0).numpy(), rtol=1e-10, atol=1e-14)


def test_pruned_weights_stay_zero():
    net = make(mlp)
    cm = pathir.compile(net, input_shape=(4,))
    cm.prune(0.5)
    zeros = {n: (getattr(net[i], "weight") == 0).clone() for n, i in [("0", 0), ("2", 2), ("4", 4)]}
    opt = PathSGD(net.parameters(), compiled=pathir.compile(net, input_shape=(4,)), lr=0.05)
    run(net, (4,), batches((4,), n=5), opt, train=True)
    for n, i in [("0", 0), ("2", 2), ("4", 4)]:
        assert torch.all(net[i].weight[zeros[n]] == 0)
    assert "0.weight_orig" in opt.diag_g()


def test_state_dict_round_trip_and_param_groups():
    net = make(mlp)
    cm = pathir.compile(net, input_shape=(4,))
    opt = PathSGD([{"params": net[0].parameters(), "lr": 0.01}, {"params": net[2].parameters()}], compiled=cm, lr=0.1, k=4)
    run(net, (4,), batches((4,), n=2), opt, train=True)
    state = opt.state_dict()
    cm = pathir.compile(net, input_shape=(4,))  # the optimizer reads a Compiled of the model as it is now
    again = PathSGD([{"params": net[0].parameters(), "lr": 0.01}, {"params": net[2].parameters()}], compiled=cm, lr=0.1)
    again.load_state_dict(state)
    assert [g["lr"] for g in again.param_groups] == [0.01, 0.1]
    torch.testing.assert_close(again.diag_g()["0.weight"], opt.diag_g()["0.weight"])


def test_clear_errors():
    net = make(mlp)
    cm = pathir.compile(net, input_shape=(4,))
    with pytest.raises(PathirError, match="torch nn.Module"):
        PathSGD(net.parameters(), compiled=pathir.compile(cm.graph))
    with pytest.raises(PathirError, match="not a parameter of the compiled model"):
        PathSGD([torch.nn.Parameter(torch.zeros(2))], compiled=cm)
    with pytest.raises(ValueError, match="k >= 1"):
        PathSGD(net.parameters(), compiled=cm, k=0)
    with pytest.raises(ValueError, match="lr > 0"):
        PathSGD(net.parameters(), compiled=cm, lr=0)
    net[0].weight.data.mul_(2)  # the model moved away from the compiled graph, unseen by autograd's versions
    with pytest.raises(PathirError, match="cannot rebuild param '0.weight'"):
        PathSGD(net.parameters(), compiled=cm)
