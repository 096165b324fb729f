"""Fixed matrices an activation meets in a matmul: a buffer on the left (A @ h, a graph's adjacency), a tensor made
in forward from no parameter (a buffer's transpose, torch.eye(4) * 0.5) on the right. Each is a fixed map (constant
edges, never rescaled), checked against the model's own forward and the path-norm network built here."""

import functools

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pathir

A = torch.tensor([[0.5, 0.5, 0.0], [0.0, -0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64)


class Adjacency(nn.Module):
    """Message passing over 3 nodes: h' = A @ (h W) with A a fixed buffer (or its transpose made in forward)."""

    def __init__(self, form):
        super().__init__()
        self.register_buffer("A", A.clone())
        self.l1, self.out, self.form = nn.Linear(3, 4), nn.Linear(4, 2), form

    def forward(self, x):
        h = self.l1(x)
        if self.form == "left":
            h = self.A @ h
        elif self.form == "transposed in forward":
            h = (h.transpose(1, 2) @ self.A.T.contiguous()).transpose(1, 2)
        elif self.form == "eye of x's dtype":  # fx records the call (it reads a proxy's dtype): made at run time
            h = F.linear(h, torch.eye(4, dtype=x.dtype) * 0.5)
        elif self.form == "matmul by eye of x's dtype":
            h = torch.matmul(h, 0.5 * torch.eye(4, dtype=x.dtype, device=x.device))
        else:  # a constant made in forward, read as a linear layer's weight
            h = F.linear(h, torch.eye(4, dtype=torch.float64) * 0.5)
        return self.out(torch.relu(h))


def _l1_path_norm(net):
    """Σ_p |Φ_p| of the model: its |θ| network (fixed A as |A|) on the all-ones input, every output summed."""
    with torch.no_grad():
        x = torch.ones(1, 3, 3, dtype=torch.float64)
        h = x @ net.l1.weight.abs().T + net.l1.bias.abs()
        if net.form in ("left", "transposed in forward"):
            h = net.A.abs() @ h
        else:
            h = h * 0.5
        return float((h @ net.out.weight.abs().T + net.out.bias.abs()).sum())


@pytest.mark.parametrize("path", ["fx", "export"])
@pytest.mark.parametrize("form", ["left", "transposed in forward", "eye in forward", "eye of x's dtype",
                                  "matmul by eye of x's dtype"])
def test_a_fixed_matrix_met_in_forward_is_a_fixed_map(form, path):
    """A @ h was refused as 'outside the ReLU DAG model'; a buffer's transpose made in forward was read as a
    learnable 'parameter _tensor_constant0', rescaled by PathCond, whose write then failed ('not found in the model');
    torch.eye(4, dtype=x.dtype) (made as fx runs, not while it traces) crashed F.linear and was refused by @."""
    torch.manual_seed(0)
    net = Adjacency(form).double()
    if path == "export":  # an instance forward is read through torch.export
        net.forward = functools.partial(Adjacency.forward, net)
    x = torch.randn(5, 3, 3, dtype=torch.float64)
    y = net(x).detach()
    cm = pathir.compile(net, input_shape=(3, 3))
    np.testing.assert_allclose(cm.forward(x.numpy(), backend="numpy"), y.numpy(), rtol=1e-12, atol=1e-12)
    assert cm.path_norm(1) == pytest.approx(_l1_path_norm(net), rel=1e-12)
    assert {p.name for p in cm.graph.params()} == {"l1.weight", "l1.bias", "out.weight", "out.bias"}
    cm.pathcond()
    torch.testing.assert_close(net(x), y, rtol=1e-10, atol=1e-12)
    assert torch.equal(net.A, A)


class _LearnableRead(nn.Module):
    """A learnable weight read around fx's proxies: as fx's tensor constant of its transpose, or as a view attribute."""

    def __init__(self, form):
        super().__init__()
        self.a, self.form = nn.Linear(3, 4), form
        self.W = nn.Parameter(torch.randn(2, 4))
        if form == "view attribute":
            self.Wt = self.W.t()

    def forward(self, x):
        h = torch.relu(self.a(x))
        return h @ (self._parameters["W"].t() if self.form == "constant" else self.Wt)


@pytest.mark.parametrize("form", ["constant", "view attribute"])
def test_a_learnable_weight_read_as_a_constant_stays_a_parameter(form):
    """Fixed constants are tensors autograd traces back to no parameter: W.t() read around fx's proxies requires
    grad, so it is a parameter of the graph (4 units, W's 8 diag G entries), not a fixed map (0 units)."""
    torch.manual_seed(0)
    cm = pathir.compile(_LearnableRead(form), input_shape=(3,))  # float32: a view attribute would not follow .double()
    assert len(cm.units) == 4
    assert sum(np.size(v) for v in cm.diag_g().values()) == 12 + 4 + 8


class _LeftParam(nn.Module):
    """A learnable matrix on the left of an activation: W @ h mixes h's second-to-last axis (4 rows) at each of its
    5 columns, a dense layer at every position; as W, W.t() (stored transposed), torch.matmul, plus a bias."""

    def __init__(self, form):
        super().__init__()
        self.a, self.out, self.form = nn.Linear(5, 5), nn.Linear(5, 2), form
        self.W = nn.Parameter(torch.randn(4, 3) if form == "transposed" else torch.randn(3, 4))
        self.b = nn.Parameter(torch.randn(3, 1))

    def forward(self, x):
        h = torch.relu(self.a(x))
        y = {"left": lambda: self.W @ h, "transposed": lambda: self.W.t() @ h, "matmul": lambda: torch.matmul(self.W, h),
             "plus bias": lambda: self.W @ h + self.b}[self.form]()
        return self.out(torch.relu(y))

    def matrix(self):
        return self.W.t() if self.form == "transposed" else self.W


def _left_l1_path_norm(net, shape):
    """Σ_p |Φ_p|: the |θ| network on the all-ones input (ReLUs as identities), every output summed."""
    with torch.no_grad():
        h = torch.ones(1, *shape, dtype=torch.float64) @ net.a.weight.abs().T + net.a.bias.abs()
        y = net.matrix().abs() @ h + (net.b.abs() if net.form == "plus bias" else 0.0)
        return float((y @ net.out.weight.abs().T + net.out.bias.abs()).sum())


@pytest.mark.parametrize("path", ["fx", "export"])
@pytest.mark.parametrize("form", ["left", "transposed", "matmul", "plus bias"])
@pytest.mark.parametrize("shape", [(4, 5), (2, 4, 5)], ids=["3-d", "4-d"])
def test_a_learnable_matrix_on_the_left_is_a_dense_layer_at_every_position(form, path, shape):
    """W @ h with W a parameter was refused as 'outside the ReLU DAG model'; it is the dense layer (h^T W^T)^T: exact
    forward and path-norm, PathCond keeps the function and rescales W in place (W.t() @ h: W stored transposed)."""
    torch.manual_seed(0)
    net = _LeftParam(form).double()
    if path == "export":
        net.forward = functools.partial(_LeftParam.forward, net)
    x = torch.randn(5, *shape, dtype=torch.float64)
    y = net(x).detach()
    if form == "plus bias" and len(shape) == 3:  # b[j] over rows j, read across the channels of axis 0: refused
        with pytest.raises(pathir.errors.UnsupportedOperation, match="parameter 'b' of shape"):
            pathir.compile(net, input_shape=shape)
        return
    cm = pathir.compile(net, input_shape=shape)
    np.testing.assert_allclose(cm.forward(x.numpy(), backend="numpy"), y.numpy(), rtol=1e-12, atol=1e-12)
    assert cm.path_norm(1) == pytest.approx(_left_l1_path_norm(net, shape), rel=1e-12)
    W = net.W.detach().clone()
    cm.pathcond()
    torch.testing.assert_close(net(x), y, rtol=1e-10, atol=1e-12)
    assert not torch.equal(net.W, W)  # rescaled



class _PlainAttribute(nn.Module):
    """A plain tensor attribute (no parameter, no buffer) as a fixed matrix: A @ h on the left, or h @ A."""

    def __init__(self, side):
        super().__init__()
        self.a, self.out, self.side = nn.Linear(5, 5), nn.Linear(5, 2), side
        self.A = torch.randn(3, 4, dtype=torch.float64) if side == "left" else torch.randn(5, 5, dtype=torch.float64)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.out(torch.relu(self.A @ h if self.side == "left" else h @ self.A))


@pytest.mark.parametrize("path", ["fx", "export"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_plain_tensor_attribute_is_fixed_on_both_capture_paths(side, path):
    """torch.export lifts a plain tensor attribute as a constant, which was read as a learnable 'A' (diag G gave it
    entries, PathCond wrote into it, the differentiable path-norm refused it); fx reads it as fixed. Fixed on both."""
    torch.manual_seed(0)
    net = _PlainAttribute(side).double()
    if path == "export":
        net.forward = functools.partial(_PlainAttribute.forward, net)
    A = net.A.clone()
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    y = net(x).detach()
    cm = pathir.compile(net, input_shape=(4, 5))
    assert {p.name for p in cm.graph.params()} == {"a.weight", "a.bias", "out.weight", "out.bias"}
    with torch.no_grad():
        h = torch.ones(1, 4, 5, dtype=torch.float64) @ net.a.weight.abs().T + net.a.bias.abs()
        h = net.A.abs() @ h if side == "left" else h @ net.A.abs()
        own = float((h @ net.out.weight.abs().T + net.out.bias.abs()).sum())
    assert cm.path_norm(1) == pytest.approx(own, rel=1e-12)
    cm.path_norm(2, differentiable=True).backward()
    cm.pathcond()
    torch.testing.assert_close(net(x), y, rtol=1e-10, atol=1e-12)
    assert torch.equal(net.A, A)


def test_a_learnable_left_matrix_read_in_two_layouts_or_on_5d_is_refused_by_name():
    """W @ h1 beside h2 @ W: one tensor in two layouts, named in both (the message gave 'W ...' twice); W @ x on a
    5-d activation per sample names W @ x and the user's shape (it named a linear layer on the swapped shape)."""

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.W = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return torch.relu(self.W @ x) + torch.relu(x @ self.W)

    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.W = nn.Parameter(torch.randn(3, 4))

        def forward(self, x):
            return torch.relu(self.W @ torch.relu(x))

    with pytest.raises(pathir.errors.UnsupportedOperation, match="W as a pointwise convolution kernel; Wᵀ as"):
        pathir.compile(Two().double(), input_shape=(4, 4))
    with pytest.raises(pathir.errors.UnsupportedOperation, match=r"W @ x .*shape \[2, 2, 2, 4, 5\]|shape \[2, 2, 2, 4, 5\].*W @ x"):
        pathir.compile(Deep().double(), input_shape=(2, 2, 2, 4, 5))


class _HeldAside(nn.Module):
    """h @ M with M a plain attribute that requires grad (read as M or M.t()), or a tensor kept in a plain list."""

    def __init__(self, form):
        super().__init__()
        self.a, self.out, self.form = nn.Linear(4, 4), nn.Linear(4, 2), form
        self.A = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
        self.mats = [torch.randn(4, 4, dtype=torch.float64)]

    def forward(self, x):
        h = torch.relu(self.a(x))
        M = {"A": lambda: self.A, "A.t()": lambda: self.A.t(), "list": lambda: self.mats[0]}[self.form]()
        return self.out(torch.relu(h @ M))


@pytest.mark.parametrize("path", ["fx", "export"])
@pytest.mark.parametrize("form", ["A", "A.t()", "list"])
def test_a_plain_attribute_is_read_alike_on_both_capture_paths_however_it_is_spelled(form, path):
    """On torch.export a grad-requiring attribute read as A.t() was folded into a fixed constant (PathCond left it,
    and the differentiable path-norm gave it no gradient, silently), and a tensor kept in a plain list was a learnable
    'lifted_tensor_0' that every write-back refused. Learnable where it requires grad, fixed otherwise, on both."""
    torch.manual_seed(0)
    net = _HeldAside(form).double()
    if path == "export":
        net.forward = functools.partial(_HeldAside.forward, net)
    cm = pathir.compile(net, input_shape=(4,))
    learnable = {p.name for p in cm.graph.params()} - {"a.weight", "a.bias", "out.weight", "out.bias"}
    if form == "list":
        assert learnable == set()
        cm.path_norm(2, differentiable=True).backward()
        cm.pathcond()
    else:
        assert learnable == {"A"}
        with pytest.raises(pathir.PathirError, match="register it as an nn.Parameter"):
            cm.path_norm(2, differentiable=True)
