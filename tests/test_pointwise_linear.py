"""``nn.Linear`` on the last axis of a (…, F) activation (a per-token MLP, a channels-last 1×1
layer), against the definition on both torch capture paths: the model's own forward, path-norms
and counts of the model run on |θ|^q, diag G against autograd on the path-norm network, write-back
into the (O, F) weight in its own layout, a live Compiled after an SGD step."""

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
from capture_reference import Untraceable, assert_definition, assert_forward, eval_forward, linearized, path_norm_q

import pathir


class TokenMLP(nn.Module):
    """Tokens (T, F) through a per-token MLP, a skip, then a head on the flattened tokens."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.head = nn.Linear(4, 6), nn.Linear(6, 4), nn.Linear(3 * 4, 2)

    def forward(self, x):
        h = x + self.down(torch.relu(self.up(x)))
        return self.head(torch.relu(h).flatten(1))


class ChannelsLast(nn.Module):
    """A conv, its output moved channels-last, a Linear across the channels at every pixel."""

    def __init__(self):
        super().__init__()
        self.conv, self.mix, self.head = nn.Conv2d(2, 3, 3), nn.Linear(3, 5, bias=False), nn.Linear(5 * 2 * 2, 2)

    def forward(self, x):
        h = torch.relu(self.conv(x)).permute(0, 2, 3, 1)  # (H, W, C)
        return self.head(torch.relu(self.mix(h)).flatten(1))


CASES = {"token_mlp": (TokenMLP, (3, 4)), "channels_last": (ChannelsLast, (2, 4, 4))}


def _model(name):
    torch.manual_seed(0)
    cls, shape = CASES[name]
    return cls().double().eval(), shape


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
@pytest.mark.parametrize("name", list(CASES))
def test_forward_path_norms_and_counts_equal_the_definition(name, export):
    model, shape = _model(name)
    assert_definition(assert_forward(Untraceable(model) if export else model, shape, tol=1e-12), model, shape)


@pytest.mark.parametrize("name", list(CASES))
def test_diag_g_is_in_the_weights_own_layout_and_equals_autograd(name):
    """g_i = Σ_{p ∋ i} Π_{other factors} θ² = ∂/∂u_i of the q = 2 path-norm network at u = θ²."""
    model, shape = _model(name)
    got = pathir.compile(model, input_shape=shape).diag_g()
    net = copy.deepcopy(model)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(p**2)
    with linearized():
        out = net(torch.ones(1, *shape, dtype=torch.float64)).sum()
    grads = torch.autograd.grad(out, list(net.parameters()))
    for (n, p), g in zip(net.named_parameters(), grads):
        assert got[n].shape == tuple(p.shape)
        np.testing.assert_allclose(got[n], g.numpy(), rtol=1e-10, atol=1e-300, err_msg=n)


@pytest.mark.parametrize("name", list(CASES))
def test_pathcond_writes_into_the_linear_weight_and_keeps_the_function(name):
    model, shape = _model(name)
    x = torch.randn(5, *shape, dtype=torch.float64)
    before = eval_forward(model, x)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    cm = pathir.compile(model, input_shape=shape)
    cm.pathcond()
    assert torch.allclose(eval_forward(model, x), before, rtol=1e-10, atol=1e-12)
    assert any(not torch.equal(p, weights[n]) for n, p in model.named_parameters())


def test_a_live_compiled_follows_an_sgd_step():
    model, shape = _model("token_mlp")
    cm = pathir.compile(model, input_shape=shape)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, *shape, dtype=torch.float64)).square().sum().backward()
    opt.step()
    assert cm.path_norm(1) == pytest.approx(path_norm_q(model, [shape], 1.0), rel=1e-10)


class TokenMatmul(torch.nn.Module):
    """relu(x @ W + b) @ V.t() + c on (B, 2, 4) tokens: W stored (in, out), V (out, in), c of shape (1, 1, 3)."""

    def __init__(self, export=False, bias_shape=(6,)):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.W = torch.nn.Parameter(torch.randn(4, 6, generator=gen, dtype=torch.float64))
        self.b = torch.nn.Parameter(torch.randn(*bias_shape, generator=gen, dtype=torch.float64))
        self.V = torch.nn.Parameter(torch.randn(3, 6, generator=gen, dtype=torch.float64))
        self.c = torch.nn.Parameter(torch.randn(1, 1, 3, generator=gen, dtype=torch.float64))
        self.export = export

    def forward(self, x):
        if self.export and x.shape[-1] != 4:  # Python control flow on a shape: fx cannot trace it
            raise ValueError("four features")
        return torch.relu(x @ self.W + self.b) @ self.V.t() + self.c


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
def test_a_product_by_a_weight_on_tokens_is_the_layer_at_every_position(export):
    net = TokenMatmul(export)
    x = torch.randn(5, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = net(x).detach().clone()
    cm = pathir.compile(net, input_shape=(2, 4))
    np.testing.assert_allclose(cm.forward(x.numpy()), y.numpy(), rtol=1e-12, atol=1e-12)
    W, b, V, c = (t.detach().abs().numpy() for t in (net.W, net.b, net.V, net.c))
    assert cm.path_norm(1) == pytest.approx(2 * float((V @ W.T).sum() + (V @ b).sum() + c.sum()), rel=1e-12)
    cm.pathcond()
    torch.testing.assert_close(net(x), y, rtol=1e-10, atol=1e-12)


def test_a_bias_that_varies_over_the_tokens_is_refused():
    with pytest.raises(pathir.errors.UnsupportedOperation, match="'b' of shape \\[2, 6\\]"):
        pathir.compile(TokenMatmul(bias_shape=(2, 6)), input_shape=(2, 4))


def test_one_output_feature_on_tokens_takes_its_bias():
    """x @ W + b with W (4, 1) and b (1,): one feature, its bias once per token."""

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            gen = torch.Generator().manual_seed(2)
            self.W = torch.nn.Parameter(torch.randn(4, 1, generator=gen, dtype=torch.float64))
            self.b = torch.nn.Parameter(torch.randn(1, generator=gen, dtype=torch.float64))

        def forward(self, x):
            return torch.relu(x @ self.W + self.b)

    net = One()
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    cm = pathir.compile(net, input_shape=(2, 4))
    np.testing.assert_allclose(cm.forward(x.numpy()), net(x).detach().numpy(), rtol=1e-12, atol=1e-12)
    W, b = net.W.detach().abs().numpy(), net.b.detach().abs().numpy()
    assert cm.path_norm(1) == pytest.approx(2 * float(W.sum() + b.sum()), rel=1e-12)
