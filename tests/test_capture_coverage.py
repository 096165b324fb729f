"""Constructs inside the ReLU DAG model, each against the definition: the model's own float64
forward and the path-norm computed without pathir (capture_reference.path_norm_q)."""

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from capture_reference import Untraceable, assert_definition, assert_forward, eval_forward, path_norm_q

import pathir
from pathir.errors import UnsupportedOperation
from pathir.ir import MapKind, NodeKind


class _Fixed(nn.Module):
    """Models with constants written in the code: ``self.c(v)`` is v, or |v|^q in the reference."""

    q = None

    def c(self, v):
        return v if self.q is None else abs(v) ** self.q


class Sub(_Fixed):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.o = nn.Linear(3, 4), nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        h, g = torch.relu(self.a(x)), torch.relu(self.b(x))
        return self.o(torch.relu(h - g if self.q is None else h + g))


class ScalarMulDiv(_Fixed):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.o = nn.Conv2d(2, 3, 3), nn.Conv2d(3, 3, 1), nn.Linear(3 * 4 * 4, 2)

    def forward(self, x):
        h = torch.relu(self.a(x)) * self.c(0.5)
        h = self.c(3.0) * torch.relu(self.b(h))
        if self.q is None:
            h = h / 4
        else:
            h = h * 0.25 ** self.q
        return self.o(h.flatten(1)) * self.c(-2.0)


class Maximum(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.o = nn.Conv2d(2, 3, 3), nn.Conv2d(2, 3, 3, padding=0), nn.Linear(3 * 4 * 4, 2)

    def forward(self, x):
        h = torch.maximum(torch.relu(self.a(x)), self.b(x))
        return self.o(torch.max(h, self.b(x)).flatten(1))


class LayerScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.o = nn.Conv2d(2, 3, 3), nn.Linear(3 * 4 * 4, 4)
        self.gamma = nn.Parameter(torch.rand(3, 1, 1) + 0.5)
        self.beta = nn.Parameter(torch.randn(4))
        self.f = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.relu(self.a(x)) * self.gamma  # a Scale edge out of a ReLU: stays a Scale edge
        return self.f(torch.relu(self.beta * self.o(h.flatten(1))))


class ReluSpellings(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.ModuleList(nn.Linear(4, 4) for _ in range(6))
        self.leaky = nn.LeakyReLU(0.0)
        self.o = nn.Linear(4, 2)

    def forward(self, x):
        h = self.leaky(self.l[0](x))
        h = self.l[1](h).clamp(min=0)
        h = torch.clamp_min(self.l[2](h), 0)
        h = F.threshold(self.l[3](h), 0.0, 0.0)
        h = F.leaky_relu(self.l[4](h), 0.0)
        h = torch.clamp(self.l[5](h), min=0.0)
        return self.o(h)


class Unflatten(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.u = nn.Linear(4, 2 * 3 * 3), nn.Unflatten(1, (2, 3, 3))
        self.conv, self.o = nn.Conv2d(2, 3, 2), nn.Linear(3 * 2 * 2, 2)

    def forward(self, x):
        h = torch.relu(self.conv(self.u(torch.relu(self.a(x)))))
        return self.o(h.flatten(1))


class ZeroPaddedShortcut(nn.Module):
    """PyramidNet's residual block: the shortcut widened by a block of zeros concatenated on the channels
    (``torch.cat((x, torch.zeros(n, c, h, w)), 1)``); was refused as "moves a model parameter or buffer"."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.o = nn.Conv2d(2, 5, 3, padding=1), nn.Conv2d(5, 5, 3, padding=1), nn.Linear(5 * 36, 3)

    def forward(self, x):
        body = self.b(torch.relu(self.a(x)))
        pad = torch.zeros(x.shape[0], 3, x.shape[2], x.shape[3], dtype=x.dtype, device=x.device)
        return self.o(torch.relu(body + torch.cat((x, pad), 1)).flatten(1))


CASES = {"sub": (Sub, (3,)), "scalar": (ScalarMulDiv, (2, 6, 6)), "max": (Maximum, (2, 6, 6)),
         "layer_scale": (LayerScale, (2, 6, 6)), "relu_spellings": (ReluSpellings, (4,)),
         "unflatten": (Unflatten, (4,)), "zero_padded_shortcut": (ZeroPaddedShortcut, (2, 6, 6))}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_path_norm_against_the_definition(case):
    cls, shape = CASES[case]
    torch.manual_seed(0)
    model = cls().double()
    cm = assert_forward(model, shape, batch=5)
    for q in (1.0, 2.0):
        assert cm.path_norm(q) ** q == pytest.approx(path_norm_q(model, [shape], q), rel=1e-10)


def test_fixed_scalar_is_a_fixed_edge_not_rescaled():
    torch.manual_seed(0)
    model = ScalarMulDiv().double()
    cm = pathir.compile(model, input_shape=(2, 6, 6))
    assert {p.name for p in cm.graph.params()} == {n for n, _ in model.named_parameters()}
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    before = eval_forward(model, x)
    _random_rescale(cm)
    assert torch.allclose(eval_forward(model, x), before, rtol=1e-10, atol=1e-12)


def test_max_is_a_max_pool_neuron():
    torch.manual_seed(0)
    cm = pathir.compile(Maximum().double(), input_shape=(2, 6, 6))
    assert sum(n.kind is NodeKind.MAXPOOL for n in cm.graph.nodes) == 2


def test_layer_scale_is_a_scale_edge_and_is_rescaled():
    torch.manual_seed(0)
    model = LayerScale().double()
    cm = pathir.compile(model, input_shape=(2, 6, 6))
    assert any(e.map.kind is MapKind.SCALE and e.map.W.name == "gamma" for n in cm.graph.nodes for e in n.edges)
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    before = eval_forward(model, x)
    gamma = model.gamma.detach().clone()
    _random_rescale(cm)
    assert not torch.equal(model.gamma, gamma)
    assert torch.allclose(eval_forward(model, x), before, rtol=1e-10, atol=1e-12)


def _random_rescale(cm):
    from pathir.rescaling.apply import log_scales

    z = np.random.default_rng(0).normal(size=len(cm.units))
    cm.writer.rescale(cm.graph, log_scales(cm.graph, cm.units, z))


class SharedConvTwoBNs(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn1, self.bn2 = nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.BatchNorm2d(3)
        self.o = nn.Linear(3 * 4 * 4, 2)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv(x))) + torch.relu(self.bn2(self.conv(x)))
        return self.o(h.flatten(1))


def test_one_conv_twice_each_with_its_own_batch_norm():
    from torch_models import randomize_bn

    torch.manual_seed(0)
    model = randomize_bn(SharedConvTwoBNs().double()).eval()
    cm = assert_forward(model, (2, 6, 6))
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    before = eval_forward(model, x)
    cm.pathcond()
    assert torch.allclose(eval_forward(model, x), before, rtol=1e-10, atol=1e-12)


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        return self.a(x) * torch.relu(self.b(x))


class ScalarParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.s = nn.Linear(3, 3), nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return torch.relu(self.a(x)) * self.s


class DivByActivation(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        return self.a(x) / torch.relu(self.b(x))


@pytest.mark.parametrize("cls,match", [(Gate, "gate"), (ScalarParam, "one learnable factor per channel"),
                                       (DivByActivation, "division by an activation")])
def test_still_refused(cls, match):
    with pytest.raises(UnsupportedOperation, match=match):
        pathir.compile(cls(), input_shape=(3,))


def test_leaky_relu_with_a_slope_still_refused():
    model = nn.Sequential(nn.Linear(3, 3), nn.LeakyReLU(0.1), nn.Linear(3, 1))
    with pytest.raises(UnsupportedOperation, match="other than 0, a ReLU, or 1, the identity"):
        pathir.compile(model, input_shape=(3,))


class _LeakyOne(nn.Module):
    """leaky_relu with slope 1 (x·1 = x for every float) spelt three ways, between ReLU layers."""

    def __init__(self):
        super().__init__()
        self.l = nn.ModuleList([nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)])
        self.leaky = nn.LeakyReLU(1.0)

    def forward(self, x):
        h = self.leaky(self.l[0](x))
        h = F.leaky_relu(self.l[1](h), 1)
        h = torch.relu(F.leaky_relu_(self.l[2](h), 1.0))
        return self.l[3](h)


@pytest.mark.parametrize("wrap", [lambda m: m, Untraceable], ids=["fx", "export"])
def test_leaky_relu_with_slope_one_is_the_identity(wrap):
    """Refused before as a slope pathir has no neuron for; it is the identity, exact on both paths."""
    torch.manual_seed(0)
    model = wrap(_LeakyOne()).double().eval()
    cm = assert_forward(model, (3,))
    assert_definition(cm, model, (3,))
    assert sum(n.kind is NodeKind.RELU for n in cm.graph.nodes) == 1  # the relu's layer: none for a slope of 1


@pytest.mark.parametrize("wrap", [lambda m: m, Untraceable], ids=["fx", "export"])
def test_batch_norm_without_running_statistics_refused_by_that_reason(wrap):
    """track_running_stats=False: the batch-norm always uses batch statistics; both paths say so (the
    export path, where it is an ATen batch_norm with training=True, named a training flag fixed in the code)."""
    model = wrap(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False), nn.ReLU())).eval()
    with pytest.raises(UnsupportedOperation, match="without running statistics"):
        pathir.compile(model, input_shape=(3, 6, 6))


class _StdConv(nn.Conv2d):
    """Weight standardization as timm's StdConv2d writes it: batch_norm of the weight, training=True."""

    def forward(self, x):
        w = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True, momentum=0.0,
                         eps=1e-6).reshape_as(self.weight)
        return F.conv2d(x, w, self.bias)


@pytest.mark.parametrize("wrap", [lambda m: m, Untraceable], ids=["fx", "export"])
def test_weight_standardization_refused_as_such(wrap):
    """A batch_norm of a weight (no input upstream) is refused as weight standardization, not as a batch-norm
    without running statistics (timm review: that sent users looking for a track_running_stats flag)."""
    model = wrap(nn.Sequential(_StdConv(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1))).double().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedOperation, match="standardizes a parameter") as err:
        pathir.compile(model, input_shape=(3, 8, 8))
    assert "running statistics" not in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_zero_padded_shortcut_is_rescaled_keeping_the_function():
    torch.manual_seed(0)
    model = ZeroPaddedShortcut().double()
    x = torch.randn(4, 2, 6, 6, dtype=torch.float64)
    before = eval_forward(model, x)
    pathir.compile(model, input_shape=(2, 6, 6)).pathcond()
    assert torch.allclose(eval_forward(model, x), before, rtol=1e-10, atol=1e-12)


def test_a_block_of_zeros_of_a_fixed_batch_size_is_refused_by_that_reason():
    """torch.zeros(2, ...) beside activations: right at the trace's batch of 2 only."""
    from pathir.errors import SelfCheckFailed

    class FixedBatch(ZeroPaddedShortcut):
        def forward(self, x):
            pad = torch.zeros(2, 3, 6, 6, dtype=torch.float64)
            return self.o(torch.relu(torch.cat((x, pad), 1)).flatten(1))

    with pytest.raises(SelfCheckFailed, match="batch"):
        pathir.compile(FixedBatch().double(), input_shape=(2, 6, 6))


@pytest.mark.parametrize("make", [lambda n: torch.full((n, 3, 6, 6), -1, dtype=torch.long),
                                  lambda n: torch.ones(n, 3, 6, 6, dtype=torch.float64)], ids=["int_minus_one", "ones"])
def test_a_constant_other_than_float_zeros_concatenated_to_activations_is_refused(make):
    """An int -1 block read as "no element" (the id of a zero block) was a silent wrong answer once the layer after
    it weighed those positions (the review caught it in the first version of zero blocks)."""
    class Const(ZeroPaddedShortcut):
        def forward(self, x):
            body = self.b(torch.relu(self.a(x)))
            return self.o(torch.relu(body + torch.cat((x, make(x.shape[0])), 1)).flatten(1))

    with pytest.raises(UnsupportedOperation, match="constant"):
        pathir.compile(Const().double(), input_shape=(2, 6, 6))


def test_a_fractalnet_join_by_a_stack_on_dim_0_is_the_mean_of_its_columns():
    """FractalNet joins its columns with torch.stack(cols, dim=0).mean(0): once refused (the batch moves to axis 1),
    now the columns' mean, equal to the model's forward and to the same model written a / 2 + b / 2."""
    class Joined(nn.Module):
        def __init__(self, stacked=True):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.c = nn.Linear(4, 5), nn.Linear(4, 5), nn.Linear(5, 2)
            self.stacked = stacked

        def forward(self, x):
            if self.stacked:
                return self.c(torch.relu(torch.stack([self.a(x), self.b(x)], dim=0).mean(dim=0)))
            return self.c(torch.relu(self.a(x) * 0.5 + self.b(x) * 0.5))

    net, written = Joined().double(), Joined(stacked=False).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    cm = pathir.compile(net, input_shape=(4,))
    np.testing.assert_allclose(cm.forward(x.numpy()), net(x).detach().numpy(), rtol=1e-12, atol=1e-12)
    assert cm.path_norm(1) == pytest.approx(pathir.compile(written, input_shape=(4,)).path_norm(1), rel=1e-12)


class SamePool(nn.Module):
    """TF-"same" max-pooling as timm's MaxPool2dSame writes it: -inf padding, then the pool (``relu`` off: the
    padding must stay unselected below values that may be negative)."""

    def __init__(self, k=3, s=2, pads=(0, 1, 0, 1), relu=True, ceil=False, size=8):
        super().__init__()
        self.k, self.s, self.pads, self.relu, self.ceil = k, s, pads, relu, ceil
        self.c = nn.Conv2d(2, 3, 3)
        with torch.no_grad():
            n = self._features(torch.zeros(1, 2, size, size)).numel()
        self.o = nn.Linear(n, 2)

    def _features(self, x):
        h = self.c(x)
        h = torch.relu(h) if self.relu else h
        return F.max_pool2d(F.pad(h, self.pads, value=float("-inf")), self.k, self.s, ceil_mode=self.ceil)

    def forward(self, x):
        return self.o(torch.relu(self._features(x)).flatten(1))


@pytest.mark.parametrize("kw", [{}, {"relu": False, "pads": (1, 1, 0, 1), "ceil": True}, {"k": 5, "s": 1, "pads": (2, 2, 2, 2)},
                                {"k": 2, "s": 2, "pads": (0, 1, 0, 1), "size": 7}], ids=["same", "no_relu_ceil", "k5", "k2"])
def test_minus_inf_padding_before_a_max_pool_is_the_pools_padding(kw):
    """timm's NASNet / PNASNet pool so; was refused as "padding with the constant -inf: a fixed non-zero bias"."""
    torch.manual_seed(0)
    model = SamePool(**kw).double()
    shape = (2, kw.get("size", 8), kw.get("size", 8))
    cm = assert_forward(model, shape, batch=5)
    if not model.ceil:  # the definition: the |θ|^q network on ones, the max-pool a sum over its in-bounds window
        for q in (1, 2):
            h = F.conv2d(torch.ones(1, *shape, dtype=torch.float64), model.c.weight.abs() ** q, model.c.bias.abs() ** q)
            h = F.avg_pool2d(F.pad(h, model.pads), model.k, model.s, divisor_override=1)
            want = float((h.flatten(1) @ (model.o.weight.abs() ** q).T + model.o.bias.abs() ** q).sum())
            assert cm.path_norm(q) ** q == pytest.approx(want, rel=1e-12)
    x = torch.randn(4, *shape, dtype=torch.float64)
    before = eval_forward(model, x)
    cm.pathcond()
    assert torch.allclose(eval_forward(model, x), before, rtol=1e-10, atol=1e-12)


def test_minus_inf_padding_read_by_anything_but_a_max_pool_is_refused():
    class AvgAfter(SamePool):
        def _features(self, x):
            return F.avg_pool2d(F.pad(torch.relu(self.c(x)), self.pads, value=float("-inf")), 2)

    with pytest.raises(UnsupportedOperation, match="padded with -inf"):
        pathir.compile(AvgAfter().double(), input_shape=(2, 8, 8))


class UnrolledRNN(nn.Module):
    """A ReLU RNN written as a loop from a zero state, h = relu(W x_t + U h) (``bias``: U's)."""

    def __init__(self, bias=False, steps=4):
        super().__init__()
        self.steps, self.W, self.U, self.out = steps, nn.Linear(3, 4), nn.Linear(4, 4, bias=bias), nn.Linear(4, 2)

    def forward(self, x):
        h = torch.zeros(x.shape[0], 4, dtype=x.dtype, device=x.device)
        for t in range(self.steps):
            h = torch.relu(self.W(x[:, t]) + self.U(h))
        return self.out(h)


def test_an_unrolled_relu_rnn_from_a_zero_state_is_exact_and_rescaled():
    """U(zeros) was refused as "a parametrization" (it is 0, whatever U: a constant), and zeros + x as a fixed bias."""
    torch.manual_seed(0)
    model = UnrolledRNN().double()
    cm = assert_forward(model, (4, 3), batch=5)
    for q in (1.0, 2.0):
        assert cm.path_norm(q) ** q == pytest.approx(path_norm_q(model, [(4, 3)], q), rel=1e-12)
    x = torch.randn(3, 4, 3, dtype=torch.float64)
    before = eval_forward(model, x)
    cm.pathcond()
    assert torch.allclose(eval_forward(model, x), before, rtol=1e-10, atol=1e-12)


def test_a_layer_with_a_bias_applied_to_a_zero_state_is_refused_saying_what_to_write():
    with pytest.raises(UnsupportedOperation, match="zero initial state"):
        pathir.compile(UnrolledRNN(bias=True).double(), input_shape=(4, 3))


def test_an_nn_rnn_is_refused_saying_how_to_unroll_it():
    class Rnn(nn.Module):
        def __init__(self):
            super().__init__()
            self.r, self.o = nn.RNN(3, 4, nonlinearity="relu", batch_first=True), nn.Linear(4, 2)

        def forward(self, x):
            return self.o(self.r(x)[0][:, -1])

    with pytest.raises(UnsupportedOperation, match="unrolled"):
        pathir.compile(Rnn().double(), input_shape=(4, 3))


def test_zeros_first_in_a_widened_shortcut_read_as_zeros_last():
    """torch.cat((zeros, x), 1): export's constant came first and cat read its rank off it (a raw AttributeError)."""
    class ZerosFirst(ZeroPaddedShortcut):
        def forward(self, x):
            body = self.b(torch.relu(self.a(x)))
            pad = torch.zeros(x.shape[0], 3, x.shape[2], x.shape[3], dtype=x.dtype)
            return self.o(torch.relu(body + torch.cat((pad, x), 1)).flatten(1))

    torch.manual_seed(0)
    model = ZerosFirst().double()
    cm = assert_forward(model, (2, 6, 6), batch=5)
    for q in (1.0, 2.0):
        assert cm.path_norm(q) ** q == pytest.approx(path_norm_q(model, [(2, 6, 6)], q), rel=1e-10)


def _adaptive_windows(L, o):
    """torch's adaptive windows over L positions into o (written out here, not pathir's)."""
    return [(i * L // o, -(-(i + 1) * L // o)) for i in range(o)]


@pytest.mark.parametrize("size,out", [(4, (8, 8)), (3, (6, 1)), (4, (8, 2)), (2, (6, 1)), (6, (3, 3))])
@pytest.mark.parametrize("wrap", [lambda m: m, Untraceable], ids=["fx", "export"])
def test_adaptive_max_pool_upsampling_is_nearest_element_moves(size, out, wrap):
    """An output size that is a multiple of the input (every window one position: nearest upsampling), alone or
    beside an axis whose output size divides it: the model's forward, and ‖Φ‖₁ written out (ones in, each
    pooled position counting its window's positions)."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU(), nn.AdaptiveMaxPool2d(out), nn.Flatten(),
                          nn.Linear(4 * out[0] * out[1], 2)).double()
    model = wrap(inner)
    cm = assert_forward(model, (3, size, size))
    with torch.no_grad():
        conv, lin = inner[0], inner[4]
        per_position = conv.weight.abs().sum((1, 2, 3)) + conv.bias.abs()
        counts = torch.tensor([[(e0 - s0) * (e1 - s1) for s1, e1 in _adaptive_windows(size, out[1])]
                               for s0, e0 in _adaptive_windows(size, out[0])], dtype=torch.float64)
        feature = (per_position[:, None, None] * counts).reshape(-1)
        expected = float((lin.weight.abs() @ feature).sum() + lin.bias.abs().sum())
    assert cm.path_norm(1) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("size,out,match", [(3, 8, "windows hold 1 or 2 positions"), (4, 6, "hold 1 or 2"),
                                            (6, 4, "windows of 2 positions overlap, not one stride apart")])
def test_adaptive_max_pool_with_uneven_windows_refused_by_that_reason(size, out, match):
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU(), nn.AdaptiveMaxPool2d(out))
    with pytest.raises(UnsupportedOperation, match=match):
        pathir.compile(model, input_shape=(3, size, size))


class _BoolMasked(nn.Module):
    """Features picked by a constant bool mask: torch.export records its output size as data-dependent (an
    unbacked symbol, read back by ``aten.sym_size.int`` and checked by runtime assertions)."""

    def __init__(self):
        super().__init__()
        self.f, self.g = nn.Linear(4, 6), nn.Linear(4, 2)
        self.register_buffer("keep", torch.tensor([True, False, True, True, False, True]))

    def forward(self, x):
        h = torch.relu(self.f(x))
        return self.g(h[:, self.keep])


@pytest.mark.parametrize("wrap", [lambda m: m, Untraceable], ids=["fx", "export"])
def test_bool_mask_indexing_lowers_on_both_paths(wrap):
    """On export it was refused at the sym_size node ('outside the ReLU DAG'); the size is the static one."""
    torch.manual_seed(0)
    inner = _BoolMasked().double()
    model = wrap(inner)
    cm = assert_forward(model, (4,))
    with torch.no_grad():
        kept = (inner.f.weight.abs().sum(1) + inner.f.bias.abs())[inner.keep]
        expected = float((inner.g.weight.abs() @ kept).sum() + inner.g.bias.abs().sum())
    assert cm.path_norm(1) == pytest.approx(expected, rel=1e-12)


#: name -> (the pool, which path-norm the reference network computes: "all" q for max-pools (window sums), q = 1
#: for average pools (their fixed 1/k stays 1/k, right for q = 1 only), none for the adaptive max-pools it keeps)
_UNBATCHED_POOLS = {
    "max_pool2d": (lambda h: F.max_pool2d(h, 2), "all"), "MaxPool2d": (nn.MaxPool2d(2, 1), "all"),
    "avg_pool2d": (lambda h: F.avg_pool2d(h, 2), 1.0), "AvgPool2d": (nn.AvgPool2d((2, 3)), 1.0),
    "adaptive_avg_pool2d": (lambda h: F.adaptive_avg_pool2d(h, (2, 3)), 1.0),
    "adaptive_max_pool2d": (lambda h: F.adaptive_max_pool2d(h, 2), None),
    "AdaptiveMaxPool2d upsampling": (nn.AdaptiveMaxPool2d((8, 12)), None),
    "max_pool2d with indices": (lambda h: F.max_pool2d(h, 2, return_indices=True)[0], None),
}


class _PoolOfConv1d(nn.Module):
    def __init__(self, pool):
        super().__init__()
        self.c, self.pool, self.head = nn.Conv1d(2, 4, 1), pool, nn.LazyLinear(3)

    def forward(self, x):
        return self.head(self.pool(torch.relu(self.c(x))).flatten(1))


@pytest.mark.parametrize("name", list(_UNBATCHED_POOLS))
@pytest.mark.parametrize("wrap", [lambda m: m, Untraceable], ids=["fx", "export"])
def test_a_2d_pool_of_a_batched_1d_activation_pools_each_samples_channels_too(name, wrap):
    """torch reads a (batch, C, L) tensor given to a 2-d pool as one unbatched image whose channels are the
    batch: each sample's C and L are pooled together. pathir pooled L alone (a wrong function, only the
    self-check's shape test stood in its way; with self_check=False it was silent)."""
    torch.manual_seed(0)
    pool, reference = _UNBATCHED_POOLS[name]
    inner = _PoolOfConv1d(pool)
    inner(torch.randn(1, 2, 6))  # the lazy head's width
    model = wrap(inner.double())
    cm = assert_forward(model, (2, 6), self_check=False)
    if reference == "all":
        assert_definition(cm, model, (2, 6))
    elif reference is not None:
        assert cm.path_norm(reference) == pytest.approx(path_norm_q(model, [(2, 6)], reference), rel=1e-12)


class _EmptyMasked(nn.Module):
    def __init__(self):
        super().__init__()
        self.f, self.g = nn.Linear(4, 6), nn.Linear(6, 2)
        self.register_buffer("none", torch.zeros(6, dtype=torch.bool))

    def forward(self, x):
        h = torch.relu(self.f(x))
        return self.g(torch.cat([h[:, self.none], h], 1))


@pytest.mark.parametrize("wrap", [lambda m: m, Untraceable], ids=["fx", "export"])
def test_an_all_false_mask_selects_nothing_on_both_paths(wrap):
    """The empty selection concatenated beside h is h: on export its sym_size read counted as a second reader
    and the empty value was refused as 'every element is 0'."""
    torch.manual_seed(0)
    model = wrap(_EmptyMasked().double())
    cm = assert_forward(model, (4,))
    assert_definition(cm, model, (4,))


class _Call(nn.Module):
    """Linear(4, 6), ReLU, then ``op`` (a module or a function of the activation)."""

    def __init__(self, op):
        super().__init__()
        self.f, self.op = nn.Linear(4, 6), op

    def forward(self, x):
        return self.op(torch.relu(self.f(x)))


@pytest.mark.parametrize("wrap", [lambda m: m, Untraceable], ids=["fx", "export"])
def test_feature_alpha_dropout_fixed_in_training_is_refused_on_both_paths(wrap):
    """On export it was lowered as the identity (aten.feature_alpha_dropout was missing from the random ops):
    a random model compiled silently, 0.97 away from it."""
    with pytest.raises(UnsupportedOperation, match="is random"):
        pathir.compile(wrap(_Call(lambda h: F.feature_alpha_dropout(h, 0.5, training=True))), input_shape=(4,))


_DRAWS = {
    "randn of x's dtype": lambda h: h @ torch.randn(6, 6, dtype=h.dtype),
    "rand factor": lambda h: h * torch.rand(6, dtype=h.dtype),
    "normal_ in place": lambda h: h @ torch.zeros(6, 6, dtype=h.dtype).normal_(),
    "bernoulli mask": lambda h: h * torch.bernoulli(torch.full((6,), 0.5, dtype=h.dtype)),
    "randperm channels": lambda h: h[:, torch.randperm(6)],
    "randn made while fx traces": lambda h: h @ torch.randn(6, 6).to(torch.float64),
    "dropout of a constant in training": lambda h: h @ F.dropout(torch.ones(6, 6), 0.5, True).to(torch.float64),
}


@pytest.mark.parametrize("wrap", [lambda m: m, Untraceable], ids=["fx", "export"])
@pytest.mark.parametrize("draw", list(_DRAWS))
def test_a_tensor_drawn_from_the_random_generator_is_refused_on_both_paths(draw, wrap):
    """Each compiled with self_check=False as one fixed draw (the self-check alone caught the model moving):
    fx kept a draw made on constants as a traced constant, or lowered the one it made as a fixed tensor."""
    model = wrap(_Call(_DRAWS[draw])).double()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedOperation, match="is random"):
        pathir.compile(model, input_shape=(4,), self_check=False)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


class _Recurrent(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.f, self.layer = nn.Linear(4, 6), layer

    def forward(self, x):
        h = torch.relu(self.f(x)).unsqueeze(1)
        return (self.layer(h, h, h) if isinstance(self.layer, nn.MultiheadAttention) else self.layer(h))[0]


@pytest.mark.parametrize("layer", [lambda: nn.RNN(6, 6, nonlinearity="relu", batch_first=True),
                                   lambda: nn.LSTM(6, 6, batch_first=True),
                                   lambda: nn.MultiheadAttention(6, 2, batch_first=True)], ids=["rnn", "lstm", "attention"])
def test_an_eval_layer_whose_only_randomness_is_its_dropout_is_not_called_random(layer):
    """ATen tags rnn_relu, lstm, scaled_dot_product_attention as seeded (their dropout argument): in eval they were
    refused on the export path as drawing from the random generator, not for what they compute."""
    model = Untraceable(_Recurrent(layer().eval())).double()
    with pytest.raises(UnsupportedOperation) as info:
        pathir.compile(model, input_shape=(4,), self_check=False)
    assert "random" not in str(info.value)


@pytest.mark.parametrize("wrap", [lambda m: m, Untraceable], ids=["fx", "export"])
@pytest.mark.parametrize("made", [lambda x: torch.full((6,), 2.0, dtype=x.dtype), lambda x: torch.full((6,), 2.0).double()],
                         ids=["as fx runs", "while fx traces"])
def test_a_non_zero_bias_made_in_the_forward_is_refused_at_compile(made, wrap):
    """Compiled, its every rescaling then failed at write-back: 'source tensor ... not found in the model'."""
    class MadeBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.f, self.g = nn.Linear(4, 6), nn.Linear(6, 2)

        def forward(self, x):
            return self.g(torch.relu(F.linear(x, self.f.weight, made(x))))

    with pytest.raises(UnsupportedOperation, match="fixed non-zero bias no parameter carries"):
        pathir.compile(wrap(MadeBias()).double(), input_shape=(4,), self_check=False)


@pytest.mark.parametrize("wrap", [lambda m: m, Untraceable], ids=["fx", "export"])
def test_a_zero_bias_made_in_the_forward_is_no_bias(wrap):
    class ZeroBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.f, self.g = nn.Linear(4, 6), nn.Linear(6, 2)

        def forward(self, x):
            return self.g(torch.relu(F.linear(x, self.f.weight, torch.zeros(6, dtype=x.dtype))))

    model = wrap(ZeroBias()).double()
    cm = assert_forward(model, (4,))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    cm.pathcond()
    x = torch.randn(8, 4, dtype=torch.float64)
    model.load_state_dict(state)
    y = model(x)
    pathir.compile(model, input_shape=(4,)).pathcond()
    torch.testing.assert_close(model(x), y, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("wrap", [lambda m: m, Untraceable], ids=["fx", "export"])
def test_dropout3d_and_feature_alpha_dropout_in_eval_are_the_identity(wrap):
    for op, shape in ((nn.Dropout3d(0.3), (2, 3, 1, 1)), (nn.FeatureAlphaDropout(0.3), (4,))):
        model = wrap(nn.Sequential(nn.Conv3d(2, 3, 1) if len(shape) == 4 else nn.Linear(4, 6), nn.ReLU(), op)).double()
        assert_forward(model, shape)


@pytest.mark.parametrize("wrap", [lambda m: m, Untraceable], ids=["fx", "export"])
def test_a_linear_layer_with_a_1d_weight_is_refused_by_name(wrap):
    """F.linear(h, w) with w of shape (6,): an IndexError inside the lowering before."""
    model = wrap(_Call(lambda h, w=nn.Parameter(torch.randn(6)): F.linear(h, w)))
    with pytest.raises(UnsupportedOperation, match=r"a linear layer whose weight has shape \[6\]"):
        pathir.compile(model, input_shape=(4,))


@pytest.mark.parametrize("op", [lambda h: F.max_pool2d(h.view(-1, 1, 1, 2, 3), 1),
                                lambda h: F.adaptive_avg_pool2d(h, 2),
                                lambda h: F.avg_pool1d(h.view(-1, 1, 2, 3), 1),
                                lambda h: F.pad(h, (1, 1, 0, 0, 0, 0)), lambda h: F.pad(h, (1, 2, 0, 0), mode="reflect")],
                         ids=["max_pool2d of 5-d", "adaptive_avg_pool2d of 2-d", "avg_pool1d of 4-d", "pad of 3 pairs",
                              "reflect pad of 2 axes of 2-d"])
def test_pools_and_pads_of_a_rank_torch_refuses_are_refused(op):
    """torch raises on these; with self_check=False pathir lowered them to a function the model never computes."""
    with pytest.raises(pathir.PathirError):
        pathir.compile(_Call(op), input_shape=(4,), self_check=False)


def test_dropout1d_of_a_2d_activation_on_export_names_the_unsqueeze_torch_adds():
    """torch's own code reads a (batch, features) tensor given to nn.Dropout1d as one unbatched sample and adds an
    unsqueeze(0), which torch.export records; the refusal said only 'a transpose of axis 0, a cat along dim 0'."""
    model = Untraceable(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Dropout1d(0.2))).eval()
    with pytest.raises(UnsupportedOperation, match=r"an unsqueeze\(0\): torch's own code adds one .*nn.Dropout1d"):
        pathir.compile(model, input_shape=(4,))


class _ZeroPaddedShortcut(nn.Module):
    """PyramidNet's widened shortcut, its zeros spelt as users spell them."""

    def __init__(self, spelling):
        super().__init__()
        self.conv, self.spelling = nn.Conv2d(4, 6, 3, padding=1), spelling

    def forward(self, x):
        out = self.conv(x)
        b, _, h, w = out.shape
        zeros = {"zeros": lambda: torch.zeros(b, 2, h, w, dtype=x.dtype), "new_zeros": lambda: x.new_zeros(b, 2, h, w),
                 "zeros_like": lambda: torch.zeros_like(out[:, :2]),
                 "type_as": lambda: torch.zeros(b, 2, h, w).type_as(x)}[self.spelling]()
        return F.relu(out + torch.cat([x, zeros], 1)).type_as(x)


@pytest.mark.parametrize("spelling", ["zeros", "new_zeros", "zeros_like", "type_as"])
@pytest.mark.parametrize("wrap", [lambda m: m, Untraceable], ids=["fx", "export"])
def test_a_zero_padded_shortcut_compiles_however_its_zeros_are_made(spelling, wrap):
    """x.new_zeros, torch.zeros_like and type_as were refused (found by a review), where torch.zeros compiled."""
    torch.manual_seed(0)
    model = wrap(_ZeroPaddedShortcut(spelling)).double()
    cm = assert_forward(model, (4, 5, 5))
    assert_definition(cm, model, (4, 5, 5))


class _PaddedPoolOfConv1d(nn.Module):
    """TF-"same" padding (-inf) then a 2-d max-pool of a (batch, C, L) activation: torch pools each sample's C and
    L together."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv1d(2, 3, 3), nn.Linear(8, 2)

    def forward(self, x):
        h = F.max_pool2d(F.pad(F.relu(self.conv(x)), (1, 1), value=-math.inf), 3, 1)
        return self.head(h.flatten(1))


@pytest.mark.parametrize("wrap", [lambda m: m, Untraceable], ids=["fx", "export"])
def test_a_minus_inf_padded_2d_max_pool_of_a_1d_activation_pools_the_channels_too(wrap):
    """The unbatched reading skipped the -inf padded form: L alone was pooled on fx (wrong with self_check=False),
    and export failed inside pathir (found by a review of the session's new code)."""
    torch.manual_seed(0)
    inner = _PaddedPoolOfConv1d().double()
    cm = assert_forward(wrap(inner), (2, 10), self_check=False)
    for q in (0.5, 1.0, 2.0):  # written out: each output position sums its 3 × 3 window of |conv|^q maps (no -inf)
        with torch.no_grad():
            h = F.conv1d(torch.ones(1, 2, 10, dtype=torch.float64), inner.conv.weight.abs() ** q,
                         inner.conv.bias.abs() ** q)[0]
            pooled = torch.stack([h[:, max(i - 1, 0):i + 2].sum() for i in range(8)])
            expected = float((inner.head.weight.abs() ** q @ pooled).sum() + (inner.head.bias.abs() ** q).sum())
        assert cm.path_norm(q) ** q == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("wrap", [lambda m: m, Untraceable], ids=["fx", "export"])
def test_adding_or_subtracting_zeros_of_the_same_shape_is_nothing(wrap):
    """h + torch.zeros_like(h) and h - h.new_zeros(h.shape) were refused as 'a fixed non-zero bias'."""
    model = wrap(_Call(lambda h: h + torch.zeros_like(h) - h.new_zeros(h.shape))).double()
    cm = assert_forward(model, (4,))
    assert_definition(cm, model, (4,))


def _write_then_mT(v):
    v[:, :1].relu_()
    return v.mT.contiguous().mT


def _mT_then_write(v):
    t = v.mT
    v[:, :1].relu_()
    return t.mT.contiguous()


def _write_through_mT(v):
    v.mT[:, :, :1].relu_()
    return v


def _scale_through_saved_mT(v):
    t = v.mT
    t.mul_(2.0)
    return v


class _InPlaceAndTranspose(nn.Module):
    def __init__(self, moves):
        super().__init__()
        self.conv, self.head, self.moves = nn.Conv2d(3, 2, 1), nn.Linear(8, 3), moves

    def forward(self, x):
        v = self.conv(x) * 1.0  # a fresh activation, partly negative: the in-place ReLUs change it
        return self.head(F.adaptive_avg_pool2d(self.moves(v), 2).flatten(1))


@pytest.mark.parametrize("moves", [_write_then_mT, _mT_then_write, _write_through_mT, _scale_through_saved_mT])
@pytest.mark.parametrize("wrap", [lambda m: m, Untraceable], ids=["fx", "export"])
def test_in_place_writes_and_mT_views_are_read_in_their_order(moves, wrap):
    """On fx, h.mT was taken for a shape query (no read of h's values, no view of it): a later h.mT read h before an
    in-place write through a slice, and a write through h.mT never reached h; with self_check=False the function was
    wrong (found by the long fuzz)."""
    torch.manual_seed(0)
    model = wrap(_InPlaceAndTranspose(moves)).double()
    cm = assert_forward(model, (3, 4, 4), self_check=False)
    # (q = 1: the reference keeps the pool's 1/4 and the factor 2 as they are, right for q = 1 only)
    assert cm.path_norm(1) == pytest.approx(path_norm_q(model, [(3, 4, 4)], 1.0), rel=1e-12)
