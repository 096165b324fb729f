"""The differentiable path-norm (``cm.path_norm(q, differentiable=True)``, ``pathir.PathNormPenalty``)
against definitions: path enumeration with autograd and finite differences on random DAGs, and on
torch models an independent forward of the path-norm network (docs/math.md §3: every weight and
bias, batch-norms folded, replaced by |w|^q, ReLUs removed, a max-pool the sum of its window, input
ones, outputs summed) differentiated by autograd; a training step against its closed form."""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from enumerated import path_factors
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import pathir
from pathir.errors import ArgumentError, PathirError
from pathir.lifting.path_norm_grad import path_norm_and_grads
from pathir.neurons.paths import enumerate_path_norm
from pathir.testing import relu_dags

QS = [1.0, 1.5, 2.0, 3.0]


# ----------------------------------------------------------------------------- random DAGs


def enumerated_norm(theta: torch.Tensor, factors, q: float) -> torch.Tensor:
    """(Σ_p |const_p|^q Π_{i ∈ p} |θ_i|^q)^{1/q}: the definition, differentiable in θ."""
    total = theta.new_zeros(())
    for const, free in factors:
        term = theta.new_tensor(abs(const) ** q)
        for i, _ in free:
            term = term * theta[i].abs() ** q
        total = total + term
    return total ** (1.0 / q)


def _flat(graph):
    return np.concatenate([p.value.reshape(-1) for p in graph.params()]) if graph.params() else np.zeros(0)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@settings(max_examples=60, deadline=None)
@given(graph=relu_dags(), q=st.sampled_from(QS))
def test_gradient_equals_autograd_through_enumerated_paths(backend, graph, q):
    factors, _ = path_factors(graph)
    theta = torch.tensor(_flat(graph), dtype=torch.float64, requires_grad=True)
    ref = enumerated_norm(theta, factors, q)
    value, grads = path_norm_and_grads(graph, q, pathir.backends.get_backend(backend))
    assert value == pytest.approx(float(ref), rel=1e-10, abs=1e-300)
    if float(ref) == 0.0 or not ref.requires_grad:  # the norm's minimum, or no params
        assert all(not g.any() for g in grads)
        return
    (expected,) = torch.autograd.grad(ref, theta)
    got = np.concatenate([g.reshape(-1) for g in grads]) if grads else np.zeros(0)
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-9, atol=1e-12 * float(expected.abs().max()))


@settings(max_examples=25, deadline=None)
@given(graph=relu_dags(max_depth=3), q=st.sampled_from(QS), seed=st.integers(0, 2**16))
def test_gradient_equals_finite_differences_of_enumeration(graph, q, seed):
    params = graph.params()
    sizes = [p.size for p in params]
    if not sum(sizes):
        return
    _, grads = path_norm_and_grads(graph, q, "numpy")
    flat_grad = np.concatenate([g.reshape(-1) for g in grads])
    rng = np.random.default_rng(seed)
    theta = _flat(graph)
    for k in rng.choice(theta.size, size=min(4, theta.size), replace=False):
        if abs(theta[k]) < 1e-2:  # |θ|^q is not smooth at 0
            continue
        h = 1e-6 * abs(theta[k])

        def norm_at(delta):
            t = theta.copy()
            t[k] += delta
            it = iter(np.split(t, np.cumsum(sizes)[:-1]))
            return enumerate_path_norm(graph.map_params(lambda p: p.with_value(next(it).reshape(p.shape))), q)

        fd = (norm_at(h) - norm_at(-h)) / (2 * h)
        assert flat_grad[k] == pytest.approx(fd, rel=1e-5, abs=1e-7 * max(1.0, np.abs(flat_grad).max()))


# ----------------------------------------------------------------------------- torch models


def _folded(conv_weight, conv_bias, bn):
    """W·γ/σ and (b − μ)·γ/σ + β: the inference batch-norm folded into the layer before it."""
    s = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    b = conv_bias if conv_bias is not None else torch.zeros_like(bn.bias)
    return conv_weight * s.reshape(-1, *([1] * (conv_weight.dim() - 1))), (b - bn.running_mean) * s + bn.bias


def _randomise_bn(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.5)
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                m.weight.copy_(torch.randn(m.num_features, generator=gen))
                m.bias.copy_(torch.randn(m.num_features, generator=gen))
    return model


class SmallCNN(nn.Module):
    """BN on the input (not foldable: an identity-neuron layer), conv+BN (folded), a residual add,
    an average pool, a max-pool and a linear head."""

    def __init__(self):
        super().__init__()
        self.bn0 = nn.BatchNorm2d(2)
        self.conv1 = nn.Conv2d(2, 3, 3, padding=1, bias=True)
        self.bn1 = nn.BatchNorm2d(3)
        self.conv2 = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 3 * 3, 4)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(self.bn0(x))))
        h = F.relu(self.bn2(self.conv2(h)) + h)
        h = F.max_pool2d(F.avg_pool2d(h, 2), 2, padding=1)
        return self.fc(h.flatten(1))


def small_cnn_reference(m: SmallCNN, q: float) -> torch.Tensor:
    """‖Φ‖_q of SmallCNN by its path-norm network, autograd-differentiable in m's parameters."""
    p = lambda t: t.abs() ** q  # noqa: E731
    s0 = m.bn0.weight / torch.sqrt(m.bn0.running_var + m.bn0.eps)
    c0 = m.bn0.bias - m.bn0.running_mean * s0
    h = torch.ones(1, 2, 8, 8, dtype=torch.float64)
    h = p(s0).reshape(1, -1, 1, 1) * h + p(c0).reshape(1, -1, 1, 1)
    w1, b1 = _folded(m.conv1.weight, m.conv1.bias, m.bn1)
    h = F.conv2d(h, p(w1), p(b1), padding=1)
    w2, b2 = _folded(m.conv2.weight, None, m.bn2)
    h = F.conv2d(h, p(w2), p(b2), padding=1) + h
    h = F.avg_pool2d(h, 2) * 4 * 0.25**q  # each input of the window by the fixed weight 1/4
    h = F.avg_pool2d(h, 2, padding=1, count_include_pad=True) * 4  # max-pool: the sum of its window
    out = F.linear(h.flatten(1), p(m.fc.weight), p(m.fc.bias))
    return out.sum() ** (1.0 / q)


def mlp_bn():
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def mlp_bn_reference(m, q: float) -> torch.Tensor:
    p = lambda t: t.abs() ** q  # noqa: E731
    w, b = _folded(m[0].weight, m[0].bias, m[1])
    h = p(w) @ torch.ones(4, dtype=torch.float64) + p(b)
    h = p(m[3].weight) @ h + p(m[3].bias)
    return (p(m[5].weight) @ h + p(m[5].bias)).sum() ** (1.0 / q)


def _grads(model, scalar):
    model.zero_grad()
    scalar.backward()
    return {n: t.grad.detach().clone() for n, t in model.named_parameters()}


def _assert_grads_close(got, expected, rtol=1e-10):
    assert got.keys() == expected.keys()
    for name in expected:
        scale = float(expected[name].abs().max())
        assert float((got[name] - expected[name]).abs().max()) <= rtol * max(scale, 1e-300), name


@pytest.mark.parametrize("q", QS)
@pytest.mark.parametrize("build, reference, shape", [(mlp_bn, mlp_bn_reference, (4,)),
                                                      (SmallCNN, small_cnn_reference, (2, 8, 8))])
def test_gradient_in_model_coordinates_equals_autograd_through_the_path_norm_network(q, build, reference, shape):
    torch.manual_seed(1)
    model = _randomise_bn(build().double()).eval()
    cm = pathir.compile(model, input_shape=shape)
    penalty = cm.path_norm(q, differentiable=True)
    assert penalty.dtype == torch.float64 and penalty.dim() == 0
    got = _grads(model, penalty)
    ref = reference(model, q)
    assert float(penalty) == pytest.approx(float(ref), rel=1e-12)
    _assert_grads_close(got, _grads(model, ref))
    assert got["bn1.weight" if build is SmallCNN else "1.weight"].abs().max() > 0  # γ gets its share


def test_gradient_equals_finite_differences_in_model_coordinates():
    torch.manual_seed(2)
    model = _randomise_bn(SmallCNN().double()).eval()
    cm = pathir.compile(model, input_shape=(2, 8, 8))
    got = _grads(model, cm.path_norm(2, differentiable=True))
    gen = torch.Generator().manual_seed(0)
    for name, t in model.named_parameters():
        for k in torch.randint(0, t.numel(), (2,), generator=gen).tolist():
            h = 1e-6 * max(abs(float(t.view(-1)[k])), 1e-2)
            values = []
            for delta in (h, -h):
                with torch.no_grad():
                    t.view(-1)[k] += delta
                values.append(cm.path_norm(2))  # the Compiled follows the edit
                with torch.no_grad():
                    t.view(-1)[k] -= delta
            fd = (values[0] - values[1]) / (2 * h)
            assert float(got[name].view(-1)[k]) == pytest.approx(fd, rel=1e-5, abs=1e-8), (name, k)


def resnet18_reference(m, q: float, size: int) -> torch.Tensor:
    """‖Φ‖_q of a torchvision resnet18 by its path-norm network (written for BasicBlock resnets)."""
    p = lambda t: t.abs() ** q  # noqa: E731

    def conv_bn(conv, bn, h):
        w, b = _folded(conv.weight, conv.bias, bn)
        return F.conv2d(h, p(w), p(b), stride=conv.stride, padding=conv.padding)

    h = conv_bn(m.conv1, m.bn1, torch.ones(1, 3, size, size, dtype=torch.float64))
    h = F.avg_pool2d(h, 3, 2, 1, count_include_pad=True) * 9  # max-pool: the sum of its window
    for layer in (m.layer1, m.layer2, m.layer3, m.layer4):
        for block in layer:
            out = conv_bn(block.conv2, block.bn2, conv_bn(block.conv1, block.bn1, h))
            h = out + (conv_bn(block.downsample[0], block.downsample[1], h) if block.downsample is not None else h)
    hw = h.shape[2] * h.shape[3]
    h = h.sum((2, 3)) * (1.0 / hw) ** q
    return F.linear(h, p(m.fc.weight), p(m.fc.bias)).sum() ** (1.0 / q)


def test_resnet18_gradient_equals_autograd_through_its_path_norm_network():
    from pathir.app import zoo

    model = zoo.build("resnet18").double()
    penalty = pathir.PathNormPenalty(model, q=2, input_shape=(3, 32, 32))
    got = _grads(model, penalty())
    ref = resnet18_reference(model, 2.0, 32)
    assert float(penalty()) == pytest.approx(float(ref), rel=1e-10)
    _assert_grads_close(got, _grads(model, ref), rtol=1e-9)


# ----------------------------------------------------------------------------- training


def two_layer(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)).double()


def closed_form_grads(net, q: float) -> dict:
    """d‖Φ‖_q of f(x) = v·relu(Wx + b) + c, S = Σ_j |v_j|^q (Σ_i |W_ji|^q + |b_j|^q) + |c|^q, by hand."""
    W, b, v, c = (t.detach() for t in (net[0].weight, net[0].bias, net[2].weight[0], net[2].bias))
    a = W.abs() ** q
    inner = a.sum(1) + b.abs() ** q
    S = float((v.abs() ** q * inner).sum() + c.abs() ** q)
    outer = S ** (1.0 / q - 1.0)  # d S^{1/q} = S^{1/q - 1} / q · dS, dS/dθ = q |θ|^{q-1} sign θ · (...)
    return {
        "0.weight": outer * (v.abs() ** q)[:, None] * W.abs() ** (q - 1) * W.sign(),
        "0.bias": outer * v.abs() ** q * b.abs() ** (q - 1) * b.sign(),
        "2.weight": (outer * inner * v.abs() ** (q - 1) * v.sign())[None, :],
        "2.bias": outer * c.abs() ** (q - 1) * c.sign(),
    }


@pytest.mark.parametrize("q", [1.0, 2.0])
def test_a_training_step_equals_its_closed_form_on_a_two_layer_net(q):
    net = two_layer()
    penalty = pathir.PathNormPenalty(net, q=q, input_shape=(3,))
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    lr, lam = 0.1, 0.5
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for _ in range(3):
        before = {n: t.detach().clone() for n, t in net.named_parameters()}
        data_grads = _grads(net, F.mse_loss(net(x), y))
        pen = closed_form_grads(net, q)
        opt.zero_grad()
        (F.mse_loss(net(x), y) + lam * penalty()).backward()
        opt.step()
        for n, t in net.named_parameters():
            expected = before[n] - lr * (data_grads[n] + lam * pen[n])
            torch.testing.assert_close(t.detach(), expected, rtol=1e-12, atol=1e-14)


def test_follows_the_live_model_across_optimizer_steps_without_compiling_again(monkeypatch):
    from pathir.frontends.torch.interpreter import FxInterpreter

    torch.manual_seed(3)
    model = _randomise_bn(mlp_bn().double()).eval()
    penalty = pathir.PathNormPenalty(model, q=2, input_shape=(4,))
    lowerings, run = [], FxInterpreter.run
    monkeypatch.setattr(FxInterpreter, "run", lambda self, *a, **k: lowerings.append(1) or run(self, *a, **k))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    values = []
    for _ in range(4):
        opt.zero_grad()
        p = penalty()
        got = _grads(model, p)
        ref = mlp_bn_reference(model, 2.0)
        assert float(p) == pytest.approx(float(ref), rel=1e-12)
        _assert_grads_close(got, _grads(model, ref))
        values.append(float(p))
        opt.zero_grad()
        (F.mse_loss(model(x), y) + 0.1 * penalty()).backward()
        opt.step()
    assert len(set(values)) == len(values)  # the model moved, and the penalty with it
    assert not lowerings  # values re-read, never traced again


def test_a_float32_model_gets_the_exact_gradient_in_float32():
    import copy

    net = two_layer().float()
    penalty = pathir.PathNormPenalty(net, q=2, input_shape=(3,))
    loss = net(torch.randn(4, 3)).pow(2).mean() + penalty()
    assert loss.dtype == torch.float64
    got = _grads(net, penalty())
    expected = closed_form_grads(copy.deepcopy(net).double(), 2.0)  # the float32 values, in float64
    for n, g in got.items():
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, expected[n].float(), rtol=0, atol=0)  # the float64 gradient, rounded once


def test_a_float32_model_trains_with_the_penalty():
    net = two_layer().float()
    penalty = pathir.PathNormPenalty(net, q=1, input_shape=(3,))
    before = float(penalty())
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for _ in range(20):
        opt.zero_grad()
        penalty().backward()
        assert all(t.grad.dtype == torch.float32 for t in net.parameters())
        opt.step()
    assert float(penalty()) < before


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("q, reason", [
    (0.5, "needs 1 <= q < inf, got q=0.5: for q < 1 the derivative is infinite"),
    (math.inf, "needs 1 <= q < inf, got q=inf"),
    (0, "q must be > 0 .*, got 0"),
    (-1, "q must be > 0 .*, got -1"),
    (1e7, "needs q <= 1e\\+06, got q=10000000.0"),
    (1e16, "needs q <= 1e\\+06, got q=1e\\+16"),
])
def test_a_q_where_the_norm_is_not_differentiable_is_refused(q, reason):
    cm = pathir.compile(two_layer(), input_shape=(3,))
    with pytest.raises(ArgumentError, match=reason):
        cm.path_norm(q, differentiable=True)
    with pytest.raises(ArgumentError, match=reason):
        pathir.PathNormPenalty(two_layer(), q=q, input_shape=(3,))


def test_log10_with_differentiable_is_refused():
    cm = pathir.compile(two_layer(), input_shape=(3,))
    with pytest.raises(ArgumentError, match="log10"):
        cm.path_norm(2, log10=True, differentiable=True)


def test_a_compiled_graph_or_snapshot_is_refused():
    cm = pathir.compile(two_layer(), input_shape=(3,))
    with pytest.raises(PathirError, match="torch nn.Module"):
        pathir.compile(cm.graph).path_norm(2, differentiable=True)
    with pytest.raises(PathirError, match="torch nn.Module"):
        cm.rescaled(np.zeros(4)).path_norm(2, differentiable=True)  # the two-layer net's 4 hidden units


def test_penalty_holds_no_parameters_of_its_own():
    net = two_layer()
    penalty = pathir.PathNormPenalty(net, q=2, input_shape=(3,))
    assert list(penalty.parameters()) == []
    with pytest.raises(ArgumentError, match="not compiled from"):
        pathir.PathNormPenalty(two_layer(1), q=2, compiled=penalty.compiled)


def test_train_mode_steps_move_the_running_statistics_and_the_penalty_follows():
    torch.manual_seed(4)
    model = _randomise_bn(mlp_bn().double()).train()  # forwards move running stats and num_batches_tracked
    penalty = pathir.PathNormPenalty(model, q=1.5, input_shape=(4,))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    for _ in range(3):
        opt.zero_grad()
        (F.mse_loss(model(x), y) + 0.1 * penalty()).backward()
        opt.step()
        got = _grads(model, penalty())
        ref = mlp_bn_reference(model, 1.5)  # the inference network: the running statistics as they are now
        assert float(penalty()) == pytest.approx(float(ref), rel=1e-12)
        _assert_grads_close(got, _grads(model, ref))


# ----------------------------------------------------------------------------- any representative


def mlp_reference(net, q: float) -> torch.Tensor:
    """‖Φ‖_q of a Sequential of Linear and ReLU layers by its path-norm network: every weight and bias
    replaced by |w|^q, the ReLUs removed, run on the ones vector, the outputs summed."""
    layers = [m for m in net if isinstance(m, nn.Linear)]
    h = torch.ones(layers[0].in_features, dtype=torch.float64)
    for m in layers:
        h = (m.weight.abs() ** q) @ h + (0.0 if m.bias is None else m.bias.abs() ** q)
    return h.sum() ** (1.0 / q)


def mlp_3442(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).double()


def unit_factors(net, log10_scales) -> dict:
    """{param name: s} of the rescaling that multiplies hidden unit h's incoming weights and bias by
    λ_h = 10^{log10_scales[h]} and divides its outgoing weights by λ_h (units of layer 1, then layer 2)."""
    lam = torch.tensor([10.0**z for z in log10_scales], dtype=torch.float64)
    l1, l2 = lam[:4], lam[4:]
    return {"0.weight": l1[:, None].expand(4, 3), "0.bias": l1, "2.weight": l2[:, None] / l1[None, :], "2.bias": l2,
            "4.weight": (1.0 / l2)[None, :].expand(2, 4), "4.bias": torch.ones(2, dtype=torch.float64)}


def _assert_entries_close(got, expected, rtol=1e-9, tiny=1e-300):
    """Every entry to ``rtol`` of itself (not of its param's largest), below ``tiny`` absolutely."""
    for name in expected:
        off = (got[name] - expected[name]).abs()
        assert bool((off <= rtol * expected[name].abs() + tiny).all()), (name, got[name], expected[name])


@settings(max_examples=40, deadline=None)
@given(q=st.sampled_from([1.0, 1.5, 2.0, 3.0, 4.0, 7.5, 20.0, 100.0]),
       log10_scales=st.lists(st.floats(-150, 150), min_size=8, max_size=8), seed=st.integers(0, 7))
@example(q=3.0, log10_scales=[155.0] + [0.0] * 7, seed=0)
@example(q=4.0, log10_scales=[110.0] + [0.0] * 7, seed=0)
@example(q=100.0, log10_scales=[3.0] + [0.0] * 7, seed=0)
@example(q=100.0, log10_scales=[4.0, 0.0, 0.0, 0.0, -4.0, 0.0, 0.0, 0.0], seed=0)
@example(q=100.0, log10_scales=[0.0] * 8, seed=6)  # entries 1e-247 of their param's largest, each exact
def test_gradient_on_a_rescaled_network_is_the_covariant_transform_of_the_unscaled_one(q, log10_scales, seed):
    """Φ is invariant under θ ↦ s ⊙ θ (the unit rescalings), so ∇‖Φ‖_q(s ⊙ θ) = ∇‖Φ‖_q(θ) / s: compared
    with autograd of the path-norm network of the unscaled net, entry by entry, on representatives whose
    |θ|^q leaves float64 by far (1e150^100)."""
    net = mlp_3442(seed)
    ref, expected = _rescaled(net, q, log10_scales)
    penalty = pathir.compile(net, input_shape=(3,)).path_norm(q, differentiable=True)
    assert float(penalty) == pytest.approx(float(ref), rel=1e-10)
    _assert_entries_close(_grads(net, penalty), expected)


def _rescaled(net, q, log10_scales):
    """(the path-norm network's value at θ, ∇ at θ / s per param), ``net`` rescaled in place to s ⊙ θ."""
    ref = mlp_reference(net, q)
    expected_at_theta = _grads(net, ref)
    s = unit_factors(net, log10_scales)
    with torch.no_grad():
        for name, t in net.named_parameters():
            t.mul_(s[name])
    return ref, {n: g / s[n] for n, g in expected_at_theta.items()}


@pytest.mark.parametrize("q, log10_scales", [(3.0, [-150.0] + [0.0] * 7), (3.0, [150.0] + [0.0] * 7),
                                             (100.0, [3.0] + [0.0] * 7), (20.0, [0.0] * 8)])
def test_a_zero_weight_gets_a_zero_derivative_on_any_representative(q, log10_scales):
    """A zero entry (pruned) has derivative 0 (q > 1); its neighbours' fit float64: the zero entry's
    exponent (that of a weight 1, scaled by the walk) reached inf and refused the whole param."""
    net = mlp_3442(0)
    with torch.no_grad():
        net[0].weight[0, 0] = 0.0
        net[2].bias[1] = 0.0
    _, expected = _rescaled(net, q, log10_scales)
    got = _grads(net, pathir.compile(net, input_shape=(3,)).path_norm(q, differentiable=True))
    assert float(got["0.weight"][0, 0]) == 0.0 and float(got["2.bias"][1]) == 0.0
    _assert_entries_close(got, expected)


def test_a_zero_bias_at_a_large_q_is_not_an_overflow():
    net = mlp_3442(0)
    with torch.no_grad():
        net[2].bias[1] = 0.0
    got = _grads(net, pathir.compile(net, input_shape=(3,)).path_norm(1e4, differentiable=True))
    assert float(got["2.bias"][1]) == 0.0 and all(bool(torch.isfinite(g).all()) for g in got.values())


def chain(weights):
    """1 → 2 → 1 → 1 without biases: x ↦ u·relu(v·relu(w x)), ``weights`` = (w (2,), v (2,), u)."""
    net = nn.Sequential(nn.Linear(1, 2, bias=False), nn.ReLU(), nn.Linear(2, 1, bias=False), nn.ReLU(),
                        nn.Linear(1, 1, bias=False)).double()
    with torch.no_grad():
        for layer, w in zip((net[0], net[2], net[4]), weights):
            layer.weight.copy_(torch.tensor(w, dtype=torch.float64).reshape(layer.weight.shape))
    return net


@pytest.mark.parametrize("q", [1.0, 3.0])
def test_a_derivative_beyond_float64_is_refused_not_returned_as_zero_or_inf(q):
    # paths w_0 v_0 u = 1e50 and w_1 v_1 u = 1e60: ∂‖Φ‖/∂w_1 ≈ |v_1 u| (the second path dominates) = 1e310
    net = chain(([1.0, 1e-250], [1e-10, 1e250], 1e60))
    cm = pathir.compile(net, input_shape=(1,))
    with pytest.raises(PathirError, match="'0.weight'.*beyond float64"):
        cm.path_norm(q, differentiable=True)
    with torch.no_grad():  # 1e-10 of it fits: every entry exact, the small ones too
        net[4].weight.mul_(1e-10)
    got = _grads(net, cm.path_norm(q, differentiable=True))
    # the same function on a representative whose |θ|^q fits float64: the second hidden unit × 1e250, the
    # third × 1e-40; θ = θ_twin ⊙ r there, so ∇ = ∇_twin / r
    twin = chain(([1.0, 1.0], [1e-50, 1e-40], 1e90))
    expected = _grads(twin, mlp_reference(twin, q))
    ratio = {n: t.detach() / dict(twin.named_parameters())[n].detach() for n, t in net.named_parameters()}
    _assert_entries_close(got, {n: g / ratio[n] for n, g in expected.items()})


@pytest.mark.parametrize("dtype, w2", [(torch.float32, 1e38), (torch.float16, 6e4), (torch.bfloat16, 1e38)])
def test_a_derivative_beyond_the_models_dtype_is_refused_not_stored_as_inf(dtype, w2):
    """‖Φ‖₁ = Σ_k |w₁ w2_k| with ten w2_k: ∂/∂w₁ = 10·w2 fits float64 but not the model's dtype, whose .grad
    autograd would set to inf (review); a derivative that fits is stored rounded once."""
    net = nn.Sequential(nn.Linear(1, 1, bias=False), nn.ReLU(), nn.Linear(1, 10, bias=False)).to(dtype)
    with torch.no_grad():
        net[0].weight.fill_(1e-3 if dtype == torch.float16 else 1e-30)
        net[2].weight.fill_(w2)
    value = pathir.PathNormPenalty(net, q=1, input_shape=(1,))()
    with pytest.raises(PathirError, match=r"'0.weight'.*beyond " + str(dtype).replace("torch.", "")):
        value.backward()
    with torch.no_grad():
        net[2].weight.fill_(w2 / 100)
    net.zero_grad()
    pathir.PathNormPenalty(net, q=1, input_shape=(1,))().backward()
    exact = 10 * float(net[2].weight[0, 0].double())
    assert float(net[0].weight.grad) == pytest.approx(exact, rel=torch.finfo(dtype).eps)  # (10·w2 may be a tie)


# ----------------------------------------------------------------------------- second derivatives


def test_a_second_derivative_is_refused_not_silently_missing_the_penalty_term():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    penalty = pathir.PathNormPenalty(net, q=2, input_shape=(3,))
    x = torch.randn(8, 3, dtype=torch.float64)
    loss = net(x).pow(2).mean() + penalty()
    with pytest.raises(PathirError, match="first derivative only.*create_graph"):
        torch.autograd.grad(loss, list(net.parameters()), create_graph=True)
    loss = net(x).pow(2).mean() + penalty()  # a first derivative still is one
    got = dict(zip([n for n, _ in net.named_parameters()], torch.autograd.grad(loss, list(net.parameters()))))
    data = _grads(net, net(x).pow(2).mean())
    pen = _grads(net, mlp_reference(net, 2.0))
    for name in got:
        torch.testing.assert_close(got[name], data[name] + pen[name], rtol=1e-12, atol=1e-15)


# ----------------------------------------------------------------------------- the model restructured


def _weight(layer):
    """The weight a (possibly torch-pruned) layer computes with: weight_orig · weight_mask."""
    if hasattr(layer, "weight_orig"):
        return layer.weight_orig * layer.weight_mask
    return layer.weight


def clipped_reference(net, q: float) -> torch.Tensor:
    """‖Φ‖_q of Linear → clipped ReLU (threshold t per channel) → Linear by its path-norm network
    (docs/math.md: A = relu(x), B = relu(A − t), output A − B: the hidden channel is 2A + |t|^q)."""
    t = net[1].threshold if hasattr(net[1], "threshold") else torch.full((4,), 6.0, dtype=torch.float64)
    a = (_weight(net[0]).abs() ** q) @ torch.ones(3, dtype=torch.float64) + net[0].bias.abs() ** q
    h = 2 * a + t.detach().to(torch.float64).abs() ** q
    return ((_weight(net[2]).abs() ** q) @ h + net[2].bias.abs() ** q).sum() ** (1.0 / q)


def pruned_reference(net, q: float) -> torch.Tensor:
    a = (_weight(net[0]).abs() ** q) @ torch.ones(3, dtype=torch.float64) + net[0].bias.abs() ** q
    return ((_weight(net[2]).abs() ** q) @ a + net[2].bias.abs() ** q).sum() ** (1.0 / q)


def _check_against(net, penalty, reference, q=2.0):
    assert float(penalty) == pytest.approx(float(reference(net, q)), rel=1e-12)
    _assert_grads_close(_grads(net, penalty), _grads(net, reference(net, q)))


def _two_layer_net(activation):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), activation, nn.Linear(4, 2)).double()


def test_the_gradient_follows_pathirs_own_pruning():
    net = _two_layer_net(nn.ReLU())
    cm = pathir.compile(net, input_shape=(3,))
    _check_against(net, cm.path_norm(2, differentiable=True), pruned_reference)
    cm.prune(0.5)
    assert hasattr(net[0], "weight_orig") or hasattr(net[2], "weight_orig")
    _check_against(net, cm.path_norm(2, differentiable=True), pruned_reference)  # to weight_orig, through the mask


def test_the_gradient_follows_torch_pruning():
    net = _two_layer_net(nn.ReLU())
    penalty = pathir.PathNormPenalty(net, q=2, input_shape=(3,))
    _check_against(net, penalty(), pruned_reference)
    torch.nn.utils.prune.l1_unstructured(net[2], "weight", amount=0.5)
    _check_against(net, penalty(), pruned_reference)
    torch.nn.utils.prune.remove(net[2], "weight")  # back to a plain weight, its zeros kept
    _check_against(net, penalty(), pruned_reference)


def test_the_gradient_follows_a_relu6_replaced_by_pathcond():
    net = _two_layer_net(nn.ReLU6())
    penalty = pathir.PathNormPenalty(net, q=2, input_shape=(3,))
    _check_against(net, penalty(), clipped_reference)
    penalty.compiled.pathcond()
    assert type(net[1]).__name__ == "ClippedReLU"
    _check_against(net, penalty(), clipped_reference)
    assert float(penalty()) == pytest.approx(penalty.compiled.path_norm(2), rel=1e-12)


# ----------------------------------------------------------------------------- tied weights


class Tied(nn.Module):
    """Two layers sharing one weight Parameter (``b.weight is a.weight``)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.c(F.relu(self.b(F.relu(self.a(x)))))


def tied_reference(m, q: float) -> torch.Tensor:
    p = lambda t: t.abs() ** q  # noqa: E731
    h = p(m.a.weight) @ torch.ones(3, dtype=torch.float64) + p(m.a.bias)
    h = p(m.b.weight) @ h + p(m.b.bias)
    return (p(m.c.weight) @ h + p(m.c.bias)).sum() ** (1.0 / q)


@pytest.mark.parametrize("q", [1.0, 2.0, 3.0])
def test_a_tied_weight_gets_the_sum_over_its_uses(q):
    torch.manual_seed(0)
    model = Tied().double()
    penalty = pathir.compile(model, input_shape=(3,)).path_norm(q, differentiable=True)
    assert [n for n, _ in model.named_parameters()] == ["a.weight", "a.bias", "b.bias", "c.weight", "c.bias"]
    _check_against(model, penalty, tied_reference, q)


def test_a_refused_q_is_printed_as_given():
    cm = pathir.compile(two_layer(), input_shape=(3,))
    with pytest.raises(ArgumentError, match=r"got q=0\.999999999999:"):
        cm.path_norm(1 - 1e-12, differentiable=True)


# ----------------------------------------------------------------------------- parametrizations and autograd contexts


@pytest.mark.parametrize("wrap", [nn.utils.parametrizations.weight_norm, nn.utils.parametrizations.orthogonal])
def test_a_parametrized_weight_gets_its_gradient_through_the_parametrization(wrap):
    net = mlp_3442()
    wrap(net[2])
    penalty = pathir.PathNormPenalty(net, q=2.0, input_shape=(3,))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for _ in range(2):  # the second call follows the step taken on the parametrization's originals
        _assert_grads_close(_grads(net, penalty()), _grads(net, mlp_reference(net, 2.0)))
        assert any("original" in n for n, t in net.named_parameters() if t.grad is not None and t.grad.abs().max() > 0)
        opt.step()


def test_a_train_mode_spectral_norm_is_read_as_captured_without_its_power_step():
    """spectral_norm in train mode takes a power-iteration step, writing _u and _v, at every read of the
    weight: the penalty read it so, which moved the model's buffers and then refused the call as an edit
    pathir could not see. Read in eval mode (as pathir captures the model), the buffers stay and the value and
    gradient are the eval-mode weight's."""
    net = mlp_3442()
    nn.utils.parametrizations.spectral_norm(net[2])
    net.train()
    before = {n: b.clone() for n, b in net.named_buffers()}
    penalty = pathir.PathNormPenalty(net, q=2.0, input_shape=(3,))
    got = _grads(net, penalty())
    assert all(torch.equal(b, before[n]) for n, b in net.named_buffers())
    net.eval()  # the reference reads the same weight: no power step in eval mode
    want = _grads(net, mlp_reference(net, 2.0))
    assert all(torch.equal(b, before[n]) for n, b in net.named_buffers())
    _assert_grads_close(got, want)
    assert net[2].parametrizations.weight[0].training is False and net[0].training is False
    net.train()
    assert net[2].parametrizations.weight[0].training is True


def test_a_weight_a_forward_pre_hook_sets_is_refused_naming_the_parametrization_to_use():
    net = mlp_3442()
    nn.utils.weight_norm(net[0])  # the legacy form: `weight` is an attribute set before each forward
    with pytest.raises(PathirError, match="parametrizations.weight_norm"):
        pathir.PathNormPenalty(net, q=2.0, input_shape=(3,))()


def test_the_penalty_inside_a_torch_compiled_loss_gives_the_eager_gradient():
    net, x = mlp_3442(), torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    penalty = pathir.PathNormPenalty(net, q=2.0, input_shape=(3,))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)

    def loss(x):
        return net(x).square().mean() + 0.1 * penalty()

    compiled = torch.compile(loss, backend="aot_eager")
    for _ in range(3):  # after a step the penalty re-reads the model: run by Python, not traced
        want = _grads(net, loss(x))
        _assert_grads_close(_grads(net, compiled(x)), want)
        opt.step()


def test_the_penalty_inside_a_torch_func_transform_is_refused():
    net = mlp_3442()
    penalty = pathir.PathNormPenalty(net, q=2.0, input_shape=(3,))
    params = {k: p.detach() for k, p in net.named_parameters()}
    with pytest.raises(PathirError, match="torch.func"):
        torch.func.grad(lambda ps: torch.func.functional_call(net, ps, (torch.ones(1, 3, dtype=torch.float64),)).sum()
                        + penalty())(params)


def test_a_backward_after_a_step_is_refused_as_torch_refuses_it():
    net = mlp_3442()
    penalty = pathir.PathNormPenalty(net, q=2.0, input_shape=(3,))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    value = penalty()
    net(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    opt.step()  # the weights move between the penalty's forward and its backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        value.backward()


def test_a_train_mode_forward_after_the_penalty_leaves_its_gradient_at_the_statistics_it_read():
    """penalty(), then a train-mode forward (the running statistics move in place, bumping no version), then the
    backward: the gradient is the one at the statistics the value was computed from. A float64 model's
    statistics were read by reference, and its γ's gradient came out 16 % off (review)."""
    torch.manual_seed(4)
    model = _randomise_bn(mlp_bn().double()).train()
    penalty = pathir.PathNormPenalty(model, q=2.0, input_shape=(4,))
    old = copy.deepcopy(model)
    value = penalty()
    model(torch.randn(16, 4, dtype=torch.float64) * 5 + 3)  # moves running_mean and running_var in place
    assert not torch.equal(model[1].running_mean, old[1].running_mean)
    got = _grads(model, value)
    _assert_grads_close(got, _grads(old, mlp_bn_reference(old, 2.0)))


def test_a_fused_step_between_the_penalty_and_its_backward_is_refused():
    """A fused optimizer bumps no version counter, so torch's inplace check does not see its step: pathir counts
    it and refuses the backward, as torch refuses a plain step's."""
    torch.manual_seed(4)
    model = _randomise_bn(mlp_bn().double()).eval()
    penalty = pathir.PathNormPenalty(model, q=2.0, input_shape=(4,))
    opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    model(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    value = penalty()
    opt.step()
    with pytest.raises(PathirError, match="fused optimizer step"):
        value.backward()
    value = penalty()  # computed again after the step: its gradient is the new point's
    _assert_grads_close(_grads(model, value), _grads(model, mlp_bn_reference(model, 2.0)))


def test_an_edit_through_data_is_refused_pointing_at_refresh():
    net = mlp_3442()
    penalty = pathir.PathNormPenalty(net, q=2.0, input_shape=(3,))
    penalty()
    net[0].weight.data.mul_(1.5)  # bumps no version counter: invisible to the live tracking
    with pytest.raises(PathirError, match=r"\.data.*refresh"):
        penalty()
    penalty.compiled.refresh()
    torch.testing.assert_close(penalty(), mlp_reference(net, 2.0), rtol=1e-12, atol=0)


def test_an_edit_through_data_between_the_penalty_and_its_backward_is_refused():
    """The backward reads the parameters again (it holds no float64 copy of them): an edit through .data between
    the forward and the backward, which torch's version counter does not see, is refused, not differentiated at
    the edited point."""
    torch.manual_seed(4)
    model = _randomise_bn(mlp_bn().double()).eval()
    penalty = pathir.PathNormPenalty(model, q=2.0, input_shape=(4,))
    value = penalty()
    model[3].weight.data.mul_(1.5)
    with pytest.raises(PathirError, match=r"'3\.weight'.*\.data"):
        value.backward()
    penalty.compiled.refresh()  # the edit made known (docs/live.md)
    value = penalty()
    model[0].weight.data = model[0].weight.data.clone()  # the same values in other memory: also an edit
    with pytest.raises(PathirError, match=r"'0\.weight'"):
        value.backward()


def test_a_retained_graph_backward_twice_gives_the_gradient_twice():
    torch.manual_seed(4)
    model = _randomise_bn(mlp_bn().double()).eval()
    penalty = pathir.PathNormPenalty(model, q=3.0, input_shape=(4,))
    value = penalty()
    model.zero_grad()
    (2.0 * value).backward(retain_graph=True)
    value.backward()
    got = {n: t.grad.detach().clone() for n, t in model.named_parameters()}
    expected = _grads(model, 3.0 * mlp_bn_reference(model, 3.0))
    _assert_grads_close(got, expected)


def test_frozen_parameters_get_no_gradient_and_the_others_theirs():
    """A frozen layer (requires_grad False) and a frozen batch-norm γ: the others' gradients are the path-norm
    network's; the frozen ones stay without .grad."""
    torch.manual_seed(5)
    model = _randomise_bn(SmallCNN().double()).eval()
    model.conv2.requires_grad_(False)
    model.bn1.weight.requires_grad_(False)
    penalty = pathir.PathNormPenalty(model, q=2.0, input_shape=(2, 8, 8))
    model.zero_grad(set_to_none=True)
    penalty().backward()
    got = {n: t.grad.detach().clone() for n, t in model.named_parameters() if t.grad is not None}
    assert "conv2.weight" not in got and "bn1.weight" not in got
    model.zero_grad(set_to_none=True)
    small_cnn_reference(model, 2.0).backward()
    expected = {n: t.grad.detach().clone() for n, t in model.named_parameters() if t.grad is not None}
    _assert_grads_close(got, expected)


def test_a_model_with_every_parameter_frozen_gets_a_constant():
    model = _randomise_bn(mlp_bn().double()).eval().requires_grad_(False)
    value = pathir.PathNormPenalty(model, q=2.0, input_shape=(4,))()
    assert not value.requires_grad
    torch.testing.assert_close(value, mlp_bn_reference(model, 2.0), rtol=1e-12, atol=0)


def test_a_gradient_zeroed_in_place_leaves_the_retained_backward_its_own():
    """The .grad a backward gives a float64 parameter is its own tensor: zeroing it in place (zero_grad with
    set_to_none=False, clipping) leaves what a second backward of the retained graph pulls back untouched."""
    net = mlp_3442()
    penalty = pathir.PathNormPenalty(net, q=1.0, input_shape=(3,))
    value = penalty()
    net.zero_grad(set_to_none=True)
    value.backward(retain_graph=True)
    first = {n: t.grad.detach().clone() for n, t in net.named_parameters()}
    net.zero_grad(set_to_none=False)
    value.backward()
    _assert_grads_close({n: t.grad for n, t in net.named_parameters()}, first)


class Layouts(nn.Module):
    """Params the graph lays out anew from their tensors: a grouped transposed convolution's kernel, a weight
    stored (in, out) and read through .t(), a linear on the last axis of tokens (a pointwise kernel)."""

    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2)
        self.tokens = nn.Linear(7, 5)
        self.w = nn.Parameter(torch.randn(6 * 5 * 5, 3))
        self.b = nn.Parameter(torch.randn(3))

    def forward(self, x, act=F.relu, p=lambda t: t):
        h = act(F.conv_transpose2d(x, p(self.up.weight), p(self.up.bias), stride=2, groups=2))  # (B, 6, 7, 7)
        h = act(F.linear(h, p(self.tokens.weight), p(self.tokens.bias)))  # (B, 6, 7, 5)
        h = h[:, :, :5, :].flatten(1)
        return F.linear(h, p(self.w).t(), p(self.b))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_params_laid_out_anew_get_their_gradient_in_their_tensors_layout(dtype):
    """The path-norm network (every weight and bias |·|^q, ReLUs removed, input ones) run by the model's own
    forward and differentiated by autograd, against the penalty's gradient."""
    torch.manual_seed(6)
    model = Layouts().to(dtype)
    penalty = pathir.PathNormPenalty(model, q=2.0, input_shape=(4, 3, 3))
    got = _grads(model, penalty())
    ones = torch.ones(1, 4, 3, 3, dtype=torch.float64)
    twin = copy.deepcopy(model).double()
    reference = twin(ones, act=lambda t: t, p=lambda t: t.abs() ** 2.0).sum() ** 0.5
    expected = _grads(twin, reference)
    _assert_grads_close({n: g.double() for n, g in got.items()}, expected,
                        rtol=1e-10 if dtype == torch.float64 else 1e-6)


class BiasBeforeBN(nn.Module):
    """A bias held as a Parameter of its own, added to a bias-free layer's output before a batch-norm: the fold
    adds it, scaled, into the batch-norm's bias."""

    def __init__(self, b):
        super().__init__()
        self.lin, self.b, self.bn, self.out = nn.Linear(3, 4, bias=False), nn.Parameter(b), nn.BatchNorm1d(4), nn.Linear(4, 2)

    def forward(self, x):
        return self.out(F.relu(self.bn(self.lin(x) + self.b)))


def bias_before_bn_reference(m, q):
    p = lambda t: t.abs() ** q  # noqa: E731
    c = m.bn.weight / torch.sqrt(m.bn.running_var + m.bn.eps)
    h = F.linear(torch.ones(1, 3, dtype=torch.float64), p(m.lin.weight * c[:, None]),
                 p((m.b - m.bn.running_mean) * c + m.bn.bias))
    return F.linear(h, p(m.out.weight), p(m.out.bias)).sum() ** (1 / q)


@pytest.mark.parametrize("b", [torch.zeros(4), torch.tensor([0.3, -1.2, 0.7, 2.0])])
def test_a_bias_parameter_added_before_a_folded_batch_norm_gets_its_gradient(b):
    """Found by review: the fold adds `b` into the batch-norm's bias, and the recipe guessed the layer's own
    `lin.bias` (none) instead: b got no gradient while it was 0, and a nonzero one was refused as an edit
    through .data."""
    torch.manual_seed(2)
    model = _randomise_bn(BiasBeforeBN(b.clone())).double().eval()
    penalty = pathir.PathNormPenalty(model, q=2.0, input_shape=(3,))
    _assert_grads_close(_grads(model, penalty()), _grads(model, bias_before_bn_reference(model, 2.0)))
    with torch.no_grad():
        model.b.add_(0.5)  # a step moves it
    _assert_grads_close(_grads(model, penalty()), _grads(model, bias_before_bn_reference(model, 2.0)))


def test_two_batch_norms_folded_into_one_layer_are_refused_naming_the_chain():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))
    model = _randomise_bn(model.double()).eval()
    with pytest.raises(PathirError, match="several batch-norms folded"):
        pathir.PathNormPenalty(model, q=2.0, input_shape=(3,))()


def test_a_parametrized_model_backward_twice_through_a_retained_graph():
    """Found by review: the parametrization's read kept from the forward was freed by the first backward."""
    torch.manual_seed(3)
    net = mlp_3442()
    torch.nn.utils.parametrizations.weight_norm(net[0])
    penalty = pathir.PathNormPenalty(net, q=2.0, input_shape=(3,))
    value = penalty()
    net.zero_grad(set_to_none=True)
    value.backward(retain_graph=True)
    once = {n: t.grad.detach().clone() for n, t in net.named_parameters()}
    value.backward()
    _assert_grads_close({n: t.grad for n, t in net.named_parameters()}, {n: 2 * g for n, g in once.items()})


def test_what_the_backward_reads_again_cannot_move_unseen_between_forward_and_backward():
    """Found by review: a frozen tensor edited in place, a swap of two entries through .data (the sum kept), a
    parametrization's parameter edited through .data: each refused, never a gradient of a mixed point."""
    torch.manual_seed(4)
    model = _randomise_bn(mlp_bn().double()).eval()
    model[1].weight.requires_grad_(False)
    penalty = pathir.PathNormPenalty(model, q=2.0, input_shape=(4,))
    value = penalty()
    with torch.no_grad():
        model[1].weight.mul_(3.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        value.backward()
    penalty.compiled.refresh()
    value = penalty()
    w = model[3].weight.data
    w[0, 0], w[0, 1] = w[0, 1].clone(), w[0, 0].clone()
    with pytest.raises(PathirError, match=r"'3\.weight' was changed"):
        value.backward()
    net = mlp_3442()
    torch.nn.utils.parametrizations.weight_norm(net[0])
    value = pathir.PathNormPenalty(net, q=2.0, input_shape=(3,))()
    net[0].parametrizations.weight.original1.data.mul_(-2.0)
    with pytest.raises(PathirError, match=r"'0\.weight \(1\)' was changed"):
        value.backward()


def test_a_mask_pruned_further_between_forward_and_backward_leaves_the_forwards_gradient():
    """Found by review: the backward multiplied by the mask read then; torch's own autograd keeps the forward's."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    torch.nn.utils.prune.l1_unstructured(net[0], "weight", amount=2)
    orig = net[0].weight_orig
    reference = mlp_reference_pruned(net, 2.0)
    value = pathir.PathNormPenalty(net, q=2.0, input_shape=(3,))()
    torch.nn.utils.prune.l1_unstructured(net[0], "weight", amount=4)
    (expected,) = torch.autograd.grad(reference, [orig])
    value.backward()
    torch.testing.assert_close(orig.grad, expected, rtol=1e-12, atol=1e-15)


def mlp_reference_pruned(net, q):
    p = lambda t: t.abs() ** q  # noqa: E731
    h = F.linear(torch.ones(1, 3, dtype=torch.float64), p(net[0].weight), p(net[0].bias))
    return F.linear(h, p(net[2].weight), p(net[2].bias)).sum() ** (1 / q)


def test_a_pruned_bias_folded_into_a_batch_norm_gets_its_gradient_through_its_mask():
    """The fold's record names the layer's bias `0.bias`, which torch's pruning holds as `0.bias_orig` and a mask:
    it is read as any pruned tensor is (found in this session's own re-read: a check of the record refused it)."""
    torch.manual_seed(0)
    model = _randomise_bn(mlp_bn().double()).eval()
    torch.nn.utils.prune.l1_unstructured(model[0], "bias", amount=2)
    got = _grads(model, pathir.PathNormPenalty(model, q=2.0, input_shape=(4,))())
    _assert_grads_close(got, _grads(model, mlp_bn_reference(model, 2.0)))


class ConvBiasBeforeBN(nn.Module):
    """A bias-free convolution, a bias Parameter held (1, C, 1, 1) added to its output, then a batch-norm."""

    def __init__(self):
        super().__init__()
        self.c, self.b = nn.Conv2d(2, 3, 3, bias=False), nn.Parameter(torch.randn(1, 3, 1, 1))
        self.bn, self.o = nn.BatchNorm2d(3), nn.Linear(3, 1)

    def forward(self, x):
        return self.o(F.relu(self.bn(self.c(x) + self.b)).mean((2, 3)))


def test_a_bias_parameter_of_shape_1_c_1_1_before_a_folded_batch_norm_gets_its_gradient():
    """Found by a hostile re-run: the folded-in bias entered the recipe in its own (1, C, 1, 1) shape, and the
    backward failed with a raw reshape error."""
    torch.manual_seed(0)
    m = _randomise_bn(ConvBiasBeforeBN().double()).eval()
    got = _grads(m, pathir.PathNormPenalty(m, q=2.0, input_shape=(2, 5, 5))())
    p = lambda t: t.abs() ** 2  # noqa: E731
    w, b = _folded(m.c.weight, m.b.reshape(-1), m.bn)
    h = F.conv2d(torch.ones(1, 2, 5, 5, dtype=torch.float64), p(w), p(b)).sum((2, 3)) * (1 / 9) ** 2  # the mean
    reference = F.linear(h, p(m.o.weight), p(m.o.bias)).sum() ** 0.5
    _assert_grads_close(got, _grads(m, reference))
