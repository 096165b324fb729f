"""A 2-d weight read transposed in the forward (``x @ W.t()``, ``W.T``, ``mT``, ``transpose``, ``permute``,
``torch.t``, ``addmm(b, x, W.t())``, ``F.linear(x, W.t())``) is the matrix of a dense layer, on both torch
paths: checked against the one-hidden-layer path-norm written out, the model's own forward and a
function-keeping write-back; read anywhere else it is refused naming the parameter, the model untouched."""

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pathir
from pathir.errors import UnsupportedOperation

SPELLINGS = {
    "x @ W.t() + b": lambda m, x: x @ m.W1.t() + m.b1,
    "x @ W.T + b": lambda m, x: x @ m.W1.T + m.b1,
    "matmul(x, W.mT)": lambda m, x: torch.matmul(x, m.W1.mT) + m.b1,
    "mm(x, W.transpose(0, 1))": lambda m, x: torch.mm(x, m.W1.transpose(0, 1)) + m.b1,
    "x @ W.permute(1, 0)": lambda m, x: x @ m.W1.permute(1, 0) + m.b1,
    "x @ torch.t(W)": lambda m, x: x @ torch.t(m.W1) + m.b1,
    "x @ W.swapaxes(-1, -2)": lambda m, x: x @ m.W1.swapaxes(-1, -2) + m.b1,
    "addmm(b, x, W.t())": lambda m, x: torch.addmm(m.b1, x, m.W1.t()),
    "linear(x, W.t().t(), b)": lambda m, x: F.linear(x, m.W1.t().t(), m.b1),
}


class Net(nn.Module):
    """x -> spell(W1 (5, 3) stored (out, in), b1) -> ReLU -> h @ W2.t() (W2 (2, 5)): both layers read transposed."""

    def __init__(self, spell, export=False, buffer=False):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.W1 = nn.Parameter(torch.randn(5, 3, generator=gen, dtype=torch.float64))
        self.b1 = nn.Parameter(torch.randn(5, generator=gen, dtype=torch.float64))
        W2 = torch.randn(2, 5, generator=gen, dtype=torch.float64)
        if buffer:
            self.register_buffer("W2", W2)
        else:
            self.W2 = nn.Parameter(W2)
        self.spell, self.export = spell, export

    def forward(self, x):
        if self.export and x.shape[1] != 3:  # Python control flow on a shape: fx cannot trace it, export reads it
            raise ValueError("three features")
        return torch.relu(self.spell(self, x)) @ self.W2.t()


def _l1_path_norm(net) -> float:
    W1, W2, b1 = (t.detach().abs().numpy() for t in (net.W1, net.W2, net.b1))
    return float((W2 @ W1).sum() + (W2 @ b1).sum())


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
@pytest.mark.parametrize("name", list(SPELLINGS))
def test_a_weight_read_transposed_is_a_dense_layer(name, export):
    net = Net(SPELLINGS[name], export)
    x = torch.randn(7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = net(x).detach().clone()
    cm = pathir.compile(net, input_shape=(3,))
    assert {p.name for p in cm.graph.params()} == {"W1", "b1", "W2"}
    np.testing.assert_allclose(cm.forward(x.numpy()), y.numpy(), rtol=1e-12, atol=1e-12)
    assert cm.path_norm(1) == pytest.approx(_l1_path_norm(net), rel=1e-12)
    opt = torch.optim.Adam(net.parameters())
    net(x).sum().backward()
    opt.step()
    y = net(x).detach().clone()
    report = cm.pathcond(optimizer=opt)
    assert report.written and report.max_abs_log_scale > 0  # W1 and W2 written in their stored layouts
    torch.testing.assert_close(net(x), y, rtol=1e-10, atol=1e-12)
    assert pathir.compile(net, input_shape=(3,)).path_norm(2) == pytest.approx(cm.path_norm(2), rel=1e-10)


def test_a_buffer_read_transposed_is_a_fixed_map():
    net = Net(SPELLINGS["x @ W.t() + b"], buffer=True)
    x = torch.randn(4, 3, dtype=torch.float64)
    cm = pathir.compile(net, input_shape=(3,))
    assert {p.name for p in cm.graph.params()} == {"W1", "b1"}
    np.testing.assert_allclose(cm.forward(x.numpy()), net(x).detach().numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
@pytest.mark.parametrize("spell, why", [
    (lambda m, x: x @ m.W1.t() + m.W2.t()[:, 0], "transposes the parameter 'W2'|computes with the model's tensor"),
    (lambda m, x: torch.addmm(m.W2.t()[:, :1].t(), x, m.W1.t()), "'W2'|computes with the model's tensor"),
    (lambda m, x: torch.relu(x @ m.W1.t()) @ m.W1 @ m.W1.t(), "'W1' is read in two ways"),
    (lambda m, x: (m.W3.t() @ x.t()).t(), "transposes the parameter 'W3'|op t"),
], ids=["indexed", "bias", "two layouts", "on the left"])
def test_a_weight_read_transposed_elsewhere_is_refused_naming_it(spell, why, export):
    class Wider(Net):
        def __init__(self):
            super().__init__(spell, export)
            self.W3 = nn.Parameter(torch.randn(3, 5, dtype=torch.float64))

    net = Wider()
    state = copy.deepcopy(net.state_dict())
    with pytest.raises(UnsupportedOperation, match=why):
        pathir.compile(net, input_shape=(3,))
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
def test_a_weight_read_transposed_on_tokens_is_a_pointwise_layer(export):
    """F.linear(x, W.t(), b) on a (B, T, in) activation, W stored (in, out): the layer at every token."""

    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            gen = torch.Generator().manual_seed(3)
            self.W = nn.Parameter(torch.randn(3, 5, generator=gen, dtype=torch.float64))
            self.b = nn.Parameter(torch.randn(5, generator=gen, dtype=torch.float64))
            self.V = nn.Parameter(torch.randn(2, 5, generator=gen, dtype=torch.float64))

        def forward(self, x):
            if export and x.shape[2] != 3:
                raise ValueError("three features")
            return F.linear(torch.relu(F.linear(x, self.W.t(), self.b)), self.V)

    net = Tokens()
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    y = net(x).detach().clone()
    cm = pathir.compile(net, input_shape=(2, 3))
    np.testing.assert_allclose(cm.forward(x.numpy()), y.numpy(), rtol=1e-12, atol=1e-12)
    W, b, V = (t.detach().abs().numpy() for t in (net.W, net.b, net.V))
    assert cm.path_norm(1) == pytest.approx(2 * float((V @ W.T).sum() + (V @ b).sum()), rel=1e-12)  # 2 tokens
    cm.pathcond()
    torch.testing.assert_close(net(x), y, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("spell, why", [
    (lambda m, x: x @ m.W.permute(0, 2, 1).sum(0), "permute"),
    (lambda m, x: x @ m.W.transpose(1, 2)[0], "transpose"),
])
def test_a_permutation_of_more_than_two_axes_is_refused(spell, why):
    class ThreeD(nn.Module):
        def __init__(self):
            super().__init__()
            self.W = nn.Parameter(torch.randn(2, 4, 3, dtype=torch.float64))

        def forward(self, x):
            return torch.relu(spell(self, x))

    with pytest.raises(UnsupportedOperation, match=why):
        pathir.compile(ThreeD(), input_shape=(3,))


def test_a_weight_computed_without_input_is_refused_even_when_it_was_drawn_from_seed_zero():
    """torch.export's path checks whether any parameter reaches an op's value by moving every parameter: a weight
    drawn as randn(seed 0) in float64 (as tests draw them) was once replaced by the very same values, so W.cos()
    read as a constant, a fixed map, and W left the graph's params unseen."""

    class Cosine(nn.Module):
        def __init__(self):
            super().__init__()
            self.W = nn.Parameter(torch.randn(5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64))

        def forward(self, x):
            if x.shape[1] != 3:  # export's path
                raise ValueError("three features")
            return torch.relu(F.linear(x, self.W.cos()))

    with pytest.raises(UnsupportedOperation, match="'W'"):
        pathir.compile(Cosine(), input_shape=(3,))


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
@pytest.mark.parametrize("spell", [
    lambda m, x: x @ m.W1.transpose(dim0=0, dim1=1) + m.b1,
    lambda m, x: x @ torch.transpose(m.W1, dim0=1, dim1=0) + m.b1,
    lambda m, x: x @ m.W1.permute(dims=(1, 0)) + m.b1,
    lambda m, x: x @ torch.swapaxes(m.W1, axis0=0, axis1=1) + m.b1,
    lambda m, x: x @ m.W1.t() + m.b1.t(),  # t() of a vector is the vector
    lambda m, x: F.linear(x, m.W1.permute(0, 1).transpose(1, 1), m.b1.T),  # transposes that move nothing
], ids=["transpose keywords", "torch.transpose keywords", "permute dims=", "swapaxes keywords", "t of a vector",
        "identities"])
def test_every_spelling_of_a_transpose_reads_the_weight_alike(spell, export):
    net = Net(spell, export)
    x = torch.randn(3, 3, dtype=torch.float64)
    cm = pathir.compile(net, input_shape=(3,))
    np.testing.assert_allclose(cm.forward(x.numpy()), net(x).detach().numpy(), rtol=1e-12, atol=1e-12)
    assert cm.path_norm(1) == pytest.approx(_l1_path_norm(net), rel=1e-12)


@pytest.mark.parametrize("spell", [lambda m, x: x @ m.W1.t().contiguous() + m.b1,
                                   lambda m, x: x @ (2 * m.W1.T) + m.b1,
                                   lambda m, x: x @ m.W1.t()[:, :5] + m.b1])
def test_a_transposed_weight_read_by_another_op_is_refused_naming_it_on_fx(spell):
    with pytest.raises(UnsupportedOperation, match="transposes the parameter 'W1' in the forward and then"):
        pathir.compile(Net(spell), input_shape=(3,))


@pytest.mark.parametrize("spell", [lambda m, x: x @ torch.minimum(m.W1, torch.full_like(m.W1, -10.0)).t(),
                                   lambda m, x: x @ torch.where(m.W1 > -10.0, m.W1, 0.0).t()],
                         ids=["minimum", "threshold"])
def test_a_step_function_of_a_weight_is_no_constant_on_the_export_path(spell):
    """torch.export's check that no parameter reaches an op moved every entry one way only: a threshold every entry
    of W1 lies above read as a constant (a fixed map), and W1 left the graph."""
    net = Net(lambda m, x: spell(m, x) + m.b1, export=True)
    with pytest.raises(UnsupportedOperation, match="'W1'"):
        pathir.compile(net, input_shape=(3,))


class _ActivationTransposed(nn.Module):
    """(B, 5, 4) tokens -> Linear(4, 3) -> ReLU -> .mT / .mH (B, 3, 5) -> Linear(5, 2)."""

    def __init__(self, attr):
        super().__init__()
        torch.manual_seed(0)
        self.attr, self.a, self.b = attr, nn.Linear(4, 3), nn.Linear(5, 2)

    def forward(self, x):
        return self.b(getattr(torch.relu(self.a(x)), self.attr))


@pytest.mark.parametrize("attr", ["mT", "mH"])
def test_an_activation_read_through_mT_is_an_element_move(attr):
    """``h.mT`` (``h.mH`` of a real tensor) swaps an activation's last two axes: fx refused the attribute read
    ("reads attribute 'mT' of an activation") where ``h.transpose(-2, -1)`` compiled."""
    from capture_reference import assert_definition, assert_forward

    model = _ActivationTransposed(attr).double().eval()
    cm = assert_forward(model, (5, 4))
    assert_definition(cm, model, (5, 4))


@pytest.mark.parametrize("attr", ["T", "H", "mT"])
def test_an_activation_transposed_across_its_batch_axis_is_refused(attr):
    class Out(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 3)

        def forward(self, x):
            return getattr(torch.relu(self.a(x)), attr)

    with pytest.raises(UnsupportedOperation, match="moves the batch axis"):
        pathir.compile(Out().double(), input_shape=(4,))
