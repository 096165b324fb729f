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


class _BiasBeforeBN(nn.Module):
    """Linear without bias, a bias Parameter of its own added, then BatchNorm1d (folded), ReLU, Linear."""

    def __init__(self):
        super().__init__()
        self.lin, self.b, self.bn, self.out = nn.Linear(4, 3, bias=False), nn.Parameter(torch.randn(3)), \
            nn.BatchNorm1d(3), nn.Linear(3, 2)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.lin(x) + self.b)))


def test_diag_g_reaches_a_bias_parameter_added_before_a_folded_batchnorm():
    """The fold adds b, scaled by the batch-norm, into its bias: b's diag G is Σ_p (∂Φ_p/∂b)², where the recipe once
    guessed the layer's own (missing) bias and gave b nothing (found by review of the differentiable path-norm)."""
    torch.manual_seed(1)
    net = _BiasBeforeBN().double().eval()
    with torch.no_grad():
        net.bn.running_mean.uniform_(-1, 1), net.bn.running_var.uniform_(0.5, 2), net.bn.weight.uniform_(-2, 2)
    opt = PathSGD(net.parameters(), compiled=pathir.compile(net, input_shape=(4,)))
    opt.refresh()
    bn = net.bn
    leaves = (net.lin.weight, net.b, bn.weight, bn.bias, net.out.weight, net.out.bias)
    names = ("lin.weight", "b", "bn.weight", "bn.bias", "out.weight", "out.bias")
    jac = torch.autograd.functional.jacobian(
        lambda *t: explicit_phi(*t, bn.running_mean, bn.running_var, bn.eps), tuple(t.detach() for t in leaves))
    g = opt.diag_g()
    for name, J in zip(names, jac):
        np.testing.assert_allclose(g[name].numpy(), (J**2).sum(dim=0).numpy(), rtol=1e-10, atol=1e-14, err_msg=name)


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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_run_resumed_from_its_state_dict_is_the_uninterrupted_run(dtype):
    """With k = 5 the resumed optimizer recomputed diag G at other steps (0.32 off after 8 steps): the step count was
    not saved. On a float32 model torch's load cast the float64 diag G and momentum to float32."""
    data = [(x.to(dtype), y.to(dtype)) for x, y in batches((4,), n=8)]

    def train(net, opt, part):
        for x, y in part:
            opt.zero_grad()
            ((net(x) - y) ** 2).mean().backward()
            opt.step()

    def fresh():
        net = make(mlp).to(dtype)
        cm = pathir.compile(net, input_shape=(4,))
        return net, PathSGD(net.parameters(), compiled=cm, lr=0.05, k=5, momentum=0.9)

    whole, opt = fresh()
    train(whole, opt, data)
    first, opt = fresh()
    train(first, opt, data[:3])
    saved = copy.deepcopy({"model": first.state_dict(), "optimizer": opt.state_dict()})
    resumed, opt = fresh()
    resumed.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    assert all(v.dtype == torch.float64 for s in opt.state.values() for k, v in s.items() if k in ("g", "momentum_buffer"))
    train(resumed, opt, data[3:])
    for a, b in zip(whole.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_param_groups_lr_and_momentum_are_checked_as_the_defaults_are():
    net = make(mlp)
    cm = pathir.compile(net, input_shape=(4,))
    for group, match in (({"lr": -0.5}, "lr must be a finite number >= 0"), ({"momentum": 1.5}, "momentum must be in")):
        with pytest.raises(ValueError, match=match):
            PathSGD([{"params": net.parameters(), **group}], compiled=cm, lr=0.1)
    opt = PathSGD(net.parameters(), compiled=cm, lr=0.1)
    opt.param_groups[0]["lr"] = float("nan")  # set by hand (or a scheduler) after construction
    x, y = batches((4,), n=1)[0]
    ((net(x) - y) ** 2).mean().backward()
    with pytest.raises(ValueError, match="lr must be"):
        opt.step()


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


def test_a_diag_g_below_float64s_range_is_refused_not_read_as_no_path():
    """Four bias-free layers of weights about 1e-60: g ≈ 1e-360 everywhere, which float64 flushes to 0, and
    g = 0 reads as "no path through θ": the step left every parameter where it was, though ∂L/∂θ ≈ 1e-180
    (review). It is refused, and nothing moves."""
    net = torch.nn.Sequential(*[m for _ in range(3) for m in (torch.nn.Linear(2, 2, bias=False), torch.nn.ReLU())],
                              torch.nn.Linear(2, 1, bias=False)).double()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.tensor([[1.0, 0.5], [0.5, 1.0]], dtype=torch.float64)[: p.shape[0]] * 1e-60)
    opt = PathSGD(net.parameters(), compiled=pathir.compile(net, input_shape=(2,)), lr=1e-3)
    (net(torch.ones(1, 2, dtype=torch.float64)) - 1.0).pow(2).sum().backward()
    assert float(net[0].weight.grad.abs().max()) > 0
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(PathirError, match=r"diag G of '0.weight' is about 10\^-36\d.*below float64"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, net.parameters())) and opt.diag_g() == {}


# ------------------------------------------------------------ following the model after construction


def brute_force_g(phi, tensors):
    """g = Σ_p (∂Φ_p/∂θ)² for each tensor, by autograd on every enumerated path (float64)."""
    jac = torch.autograd.functional.jacobian(phi, tuple(t.detach().clone() for t in tensors))
    return [(J**2).sum(dim=0) for J in jac]


def mlp2_phi(W1, b1, W2, b2):
    """Φ of Linear -> ReLU -> Linear, path by path."""
    return torch.cat([(W2[:, :, None] * W1[None]).reshape(-1), (W2 * b1[None]).reshape(-1), b2])


@pytest.mark.parametrize("how", ["cm.prune", "torch.nn.utils.prune"])
def test_follows_pruning_done_after_construction(how):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)).double()
    cm = pathir.compile(net, input_shape=(3,))
    opt = PathSGD(net.parameters(), compiled=cm, lr=0.1)
    opt.refresh()
    if how == "cm.prune":
        cm.prune(0.5)
    else:
        torch.nn.utils.prune.l1_unstructured(net[0], "weight", amount=0.4)
    masks = [getattr(net[i], "weight_mask", torch.ones_like(net[i].weight)).clone() for i in (0, 2)]
    assert (masks[0] == 0).any()
    x, y = batches((3,), n=1)[0]
    for _ in range(3):
        before = {n: p.detach().clone() for n, p in net.named_parameters()}
        opt.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        opt.step()
        # the definition in the coordinates of weight_orig (its mask a constant factor), at the point stepped from
        names = ("0.weight_orig", "0.bias", "2.weight_orig" if "2.weight_orig" in before else "2.weight", "2.bias")
        g = brute_force_g(lambda W1, b1, W2, b2: mlp2_phi(W1 * masks[0], b1, W2 * masks[1], b2), [before[n] for n in names])
        for name, gd in zip(names, g):
            np.testing.assert_allclose(opt.diag_g()[name].numpy(), gd.numpy(), rtol=1e-10)
            step = torch.where(gd > 0, grads[name] / torch.where(gd > 0, gd, 1.0), 0.0)
            torch.testing.assert_close(net.get_parameter(name).detach(), before[name] - 0.1 * step, rtol=1e-12, atol=1e-15)
        assert torch.all(net[0].weight[masks[0] == 0] == 0) and torch.all(net[2].weight[masks[1] == 0] == 0)


def clipped_phi(W1, b1, t, W2, b2, W3, b3):
    """Φ of Linear -> min(ReLU, t) -> Linear -> ReLU -> Linear, with the clipped unit as its three neurons
    (docs/math.md §1): A = ReLU(W1 x + b1), B = ReLU(A − t), C = A − B; a path through x or b1 reaches C
    through A (+1) and through A then B (−1), the bias −t of B through B (−1)."""
    V = W3[:, :, None] * W2[None]  # out k <- hidden m <- clipped h
    into_c = torch.cat([W1, -W1, b1[:, None], -b1[:, None], t[:, None]], dim=1)  # every path segment ending at C_h
    return torch.cat([(V[:, :, :, None] * into_c[None, None]).reshape(-1), (W3 * b2[None]).reshape(-1), b3])


def test_follows_a_clipped_relu_made_per_channel_by_pathcond():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU6(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    with torch.no_grad():
        net[0].weight.mul_(torch.tensor([5.0, 0.2, 3.0, 0.1])[:, None])
    cm = pathir.compile(net, input_shape=(3,))
    opt = PathSGD(net.parameters(), compiled=cm, lr=0.01)
    opt.refresh()
    cm.pathcond()
    assert isinstance(net[1], pathir.nn.ClippedReLU) and len(set(net[1].threshold.flatten().tolist())) == 4
    opt.refresh()
    tensors = (net[0].weight, net[0].bias, net[2].weight, net[2].bias, net[4].weight, net[4].bias)
    g = brute_force_g(lambda W1, b1, W2, b2, W3, b3: clipped_phi(W1, b1, net[1].threshold.flatten(), W2, b2, W3, b3),
                      tensors)
    for name, gd in zip(("0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"), g):
        np.testing.assert_allclose(opt.diag_g()[name].numpy(), gd.numpy(), rtol=1e-10)


# ------------------------------------------------------------ tied weights


class TiedInSeries(nn.Module):
    """x -> a -> ReLU -> c -> ReLU -> b with c.weight the Parameter a.weight (or ``self.a`` called twice)."""

    def __init__(self, call_twice: bool = False):
        super().__init__()
        self.call_twice = call_twice
        self.a, self.b = nn.Linear(2, 2, bias=False), nn.Linear(2, 1, bias=False)
        if not call_twice:
            self.c = nn.Linear(2, 2, bias=False)
            self.c.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.relu((self.a if self.call_twice else self.c)(torch.relu(self.a(x)))))


@pytest.mark.parametrize("call_twice", [False, True], ids=["tied-attribute", "called-twice"])
def test_a_parameter_read_twice_along_one_path_is_refused(call_twice):
    torch.manual_seed(0)
    net = TiedInSeries(call_twice).double()
    cm = pathir.compile(net, input_shape=(2,))
    with pytest.raises(PathirError, match=r"parameter 'a\.weight' is read at two places one path crosses in turn"):
        PathSGD(net.parameters(), compiled=cm)
    # without it, b's diag G is the definition's: Φ_(j,h,k) = B[k] A[k,h] A[h,j], the tied A a repeated factor
    opt = PathSGD([net.b.weight], compiled=cm)
    opt.refresh()
    A, B = net.a.weight.detach(), net.b.weight.detach()
    (g,) = brute_force_g(lambda B: torch.stack([B[0, k] * A[k, h] * A[h, j] for j, h, k in np.ndindex(2, 2, 2)]), (B,))
    np.testing.assert_allclose(opt.diag_g()["b.weight"].numpy(), g.numpy(), rtol=1e-12)


class TiedInParallel(nn.Module):
    """Two branches x -> a -> ReLU -> b and x -> c -> ReLU -> d summed, c's weight and bias a's Parameters
    (or ``self.a`` called on both): no path crosses both uses."""

    def __init__(self, call_twice: bool = False):
        super().__init__()
        self.call_twice = call_twice
        self.a, self.b, self.d = nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(4, 2)
        if not call_twice:
            self.c = nn.Linear(3, 4)
            self.c.weight, self.c.bias = self.a.weight, self.a.bias

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) + self.d(torch.relu((self.a if self.call_twice else self.c)(x)))


@pytest.mark.parametrize("call_twice", [False, True], ids=["tied-attribute", "called-twice"])
def test_a_parameter_used_on_parallel_branches_sums_its_uses_exactly(call_twice):
    torch.manual_seed(0)
    net = TiedInParallel(call_twice).double()
    opt = PathSGD(net.parameters(), compiled=pathir.compile(net, input_shape=(3,)))
    opt.refresh()
    tensors = (net.a.weight, net.a.bias, net.b.weight, net.b.bias, net.d.weight, net.d.bias)
    g = brute_force_g(lambda W, c, B, bb, D, db: torch.cat([mlp2_phi(W, c, B, bb), mlp2_phi(W, c, D, db)]), tensors)
    assert opt.diag_g().keys() == {"a.weight", "a.bias", "b.weight", "b.bias", "d.weight", "d.bias"}
    for name, gd in zip(("a.weight", "a.bias", "b.weight", "b.bias", "d.weight", "d.bias"), g):
        np.testing.assert_allclose(opt.diag_g()[name].numpy(), gd.numpy(), rtol=1e-12)
