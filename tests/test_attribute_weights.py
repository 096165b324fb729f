"""A weight the forward reads by attribute rather than inside a layer: a pruned weight (torch's pruning makes it a
plain attribute, W_orig * W_mask) read transposed, and a parametrized one (weight_norm) read as `self.W`. Each is the
model's own tensor under its own name, checked against the model's forward, the |θ| path-norm network built here,
autograd through it, and the write-backs."""

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.nn.utils import parametrizations, prune

import pathir

N, F, M = 4, 5, 3


class _Matrix(nn.Module):
    """x (N, F) -> relu(U @ relu(a(x))) -> relu(W-product) -> Linear(F, 2); the W product is W @ h, W.t() @ h (W stored
    (N, M)) or (hᵀ @ W.t())ᵀ. U makes h differ from row to row (else weight_norm's direction gets no gradient)."""

    def __init__(self, form):
        super().__init__()
        self.form, self.a, self.out = form, nn.Linear(F, F), nn.Linear(F, 2)
        self.U = nn.Parameter(torch.randn(N, N))
        self.W = nn.Parameter(torch.randn(N, M) if form == "W.t() @ h" else torch.randn(M, N))

    def matrix(self):
        return self.W.t() if self.form == "W.t() @ h" else self.W

    def forward(self, x):
        h = torch.relu(self.U @ torch.relu(self.a(x)))
        if self.form == "W @ h":
            y = self.W @ h
        elif self.form == "W.t() @ h":
            y = self.W.t() @ h
        else:
            y = (h.transpose(-1, -2) @ self.W.t()).transpose(-1, -2)
        return self.out(torch.relu(y))


def _path_norm(net, q):
    """(Σ_p |Φ_p|^q)^(1/q) by the |θ|^q network on the all-ones input, differentiable through the model's tensors."""
    A = lambda t: t.abs() ** q  # noqa: E731
    h = A(net.U) @ (torch.ones(1, N, F, dtype=torch.float64) @ A(net.a.weight).T + A(net.a.bias))
    return (((A(net.matrix()) @ h) @ A(net.out.weight).T + A(net.out.bias)).sum()) ** (1 / q)


def _check(net):
    x = torch.randn(3, N, F, dtype=torch.float64)
    y = net(x).detach()
    cm = pathir.compile(net, input_shape=(N, F))
    assert "W" in {p.name.rpartition(".")[2] for p in cm.graph.params()}
    for q in (1, 2):
        assert cm.path_norm(q) == pytest.approx(float(_path_norm(net, q)), rel=1e-12)
    cm.path_norm(2, differentiable=True).backward()
    got = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad()
    _path_norm(net, 2).backward()
    top = max(float(p.grad.abs().max()) for p in net.parameters())
    for n, p in net.named_parameters():
        assert float((got[n] - p.grad).abs().max()) <= 1e-13 * top, n
    cm.pathcond()
    torch.testing.assert_close(net(x), y, rtol=1e-10, atol=1e-12)
    return cm


@pytest.mark.parametrize("form", ["W @ h", "W.t() @ h", "(h^T @ W.t())^T"])
def test_a_pruned_weight_read_transposed_keeps_its_name(form):
    """torch's pruning makes W a plain attribute, so fx computes W.t() eagerly and records it as '_tensor_constant0':
    a learnable param no write-back found ('source tensor _tensor_constant0 not found') and a re-read no longer
    lowering to the same graph. It is W, read transposed."""
    torch.manual_seed(0)
    net = _Matrix(form).double()
    prune.random_unstructured(net, "W", amount=0.3)
    cm = _check(net)
    with torch.no_grad():
        net.W_orig.mul_(1.5)  # a training step: the same Compiled follows it
        net(torch.zeros(1, N, F, dtype=torch.float64))  # (pruning's hook sets the attribute W at the next forward)
    assert cm.path_norm(1) == pytest.approx(float(_path_norm(net, 1)), rel=1e-12)
    cm.prune(0.2)
    assert int((net.W_mask == 0).sum()) > int(0.3 * N * M) - 1


@pytest.mark.parametrize("form", ["W @ h", "W.t() @ h", "(h^T @ W.t())^T"])
@pytest.mark.parametrize("dim", [0, 1])
def test_a_weight_normed_attribute_read_in_the_forward_is_its_weight(form, dim):
    """`self.W` under parametrizations.weight_norm, read by attribute: fx calls its ParametrizationList, which was
    refused as 'outside the ReLU DAG model'. It is the weight the parametrization computes, under W's own name,
    written back through g and v (the function kept), its path-norm gradient reaching g and v by autograd."""
    torch.manual_seed(0)
    net = _Matrix(form).double()
    parametrizations.weight_norm(net, "W", dim=dim)
    _check(net)
    g = net.parametrizations.W.original0
    assert np.isfinite(g.detach().numpy()).all()


class _ChannelBias(nn.Module):
    """A bias Parameter held (C, 1, 1) and added to a convolution's output, and one held (M, 1) after W @ h."""

    def __init__(self):
        super().__init__()
        self.conv, self.b = nn.Conv2d(2, 3, 3, bias=False), nn.Parameter(torch.randn(3, 1, 1))
        self.W, self.c = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(4, 1))

    def forward(self, x):
        h = torch.relu(self.conv(x) + self.b).flatten(2)  # (3, 16)
        return torch.relu(self.W @ h + self.c)


def test_diag_g_and_scores_come_in_the_shape_the_model_holds_each_tensor():
    """A bias held (C, 1, 1) or (M, 1) is a param of C entries in the graph: diag G and the path-magnitude scores came
    back (C,), beside a model tensor of another shape (docs: in its shape)."""
    torch.manual_seed(0)
    net = _ChannelBias().double()
    cm = pathir.compile(net, input_shape=(2, 6, 6))
    shapes = {n: tuple(p.shape) for n, p in net.named_parameters()}
    for arrays in (cm.diag_g(), cm.path_magnitude_scores()):
        assert {n: a.shape for n, a in arrays.items()} == shapes


class _ParametrizedBuffer(nn.Module):
    """A fixed mixing matrix held as a buffer under a parametrization, read by attribute: h @ self.B."""

    def __init__(self):
        super().__init__()
        self.a, self.out = nn.Linear(4, 4), nn.Linear(4, 2)
        self.register_buffer("B", torch.randn(4, 4))

    def forward(self, x):
        return self.out(torch.relu(torch.relu(self.a(x)) @ self.B))


class _Twice(nn.Module):
    def forward(self, X):
        return 2 * X


@pytest.mark.parametrize("parametrization", ["custom", "weight_norm"])
def test_a_parametrized_buffer_read_by_attribute_stays_fixed(parametrization):
    """The ParametrizationList branch read every parametrized attribute as learnable: a buffer's got diag G entries and
    PathCond wrote into it (weight_norm) or refused it (a custom parametrization). It is fixed, as the buffer is."""
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    net = _ParametrizedBuffer().double()
    if parametrization == "custom":
        parametrize.register_parametrization(net, "B", _Twice())
    else:
        parametrizations.weight_norm(net, "B")
    buffers = {k: v.clone() for k, v in net.named_buffers()}
    x = torch.randn(3, 4, dtype=torch.float64)
    y = net(x).detach()
    cm = pathir.compile(net, input_shape=(4,))
    assert {p.name for p in cm.graph.params()} == {"a.weight", "a.bias", "out.weight", "out.bias"}
    cm.pathcond()
    torch.testing.assert_close(net(x), y, rtol=1e-10, atol=1e-12)
    assert all(torch.equal(v, buffers[k]) for k, v in net.named_buffers())


@pytest.mark.parametrize("warm", [False, True], ids=["cold cache", "warm cache"])
def test_compile_inside_parametrize_cached_leaves_the_cache_alone(warm):
    """Inside torch.nn.utils.parametrize.cached() the trace left fx's proxy in the cache (the user's next forward in
    the block returned a proxy), or, with the cache warm, read the cached weight as a param named '_tensor_constant0'.
    Cold: compiled, the cache as it was; warm: refused, saying so."""
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    net = _Matrix("W @ h").double()
    parametrizations.weight_norm(net, "W")
    x = torch.randn(2, N, F, dtype=torch.float64)
    y = net(x).detach()
    with parametrize.cached():
        if warm:
            net(x)
            with pytest.raises(pathir.PathirError, match="inside torch.nn.utils.parametrize.cached"):
                pathir.compile(net, input_shape=(N, F))
        else:
            cm = pathir.compile(net, input_shape=(N, F))
            assert cm.path_norm(1) == pytest.approx(float(_path_norm(net, 1)), rel=1e-12)
        torch.testing.assert_close(net(x), y)


@pytest.mark.parametrize("spell", [lambda W: W.t()[:, 1:], lambda W: W.T.contiguous()], ids=["slice", "copy"])
def test_a_slice_or_copy_of_a_pruned_weight_is_refused_naming_it(spell):
    """fx records W.t()[:, 1:] of a pruned W (a plain attribute) as '_tensor_constant0': it was a learnable param no
    write-back found, under that name, and every later query raised 'no longer lowers to the same graph'. Refused,
    naming W, the model untouched."""

    class Sliced(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.W = nn.Linear(4, 4), nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return torch.relu(torch.relu(self.a(x))[:, :spell(self.W).shape[0]] @ spell(self.W))

    torch.manual_seed(0)
    net = Sliced().double()
    prune.random_unstructured(net, "W", amount=0.25)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(pathir.errors.UnsupportedOperation, match="computed from 'W(_orig)?' outside the traced program"):
        pathir.compile(net, input_shape=(4,))
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())
