"""Convolutions with a fixed (buffer) kernel that is not one separable kernel shared by every channel:
per-channel depthwise filters, dense filter banks (Sobel, Gabor, fixed random features). Each is one
``FixedConv`` edge: the forward equals the model's own float64 forward, path-norms and counts equal
the model run as its path-norm network (the kernel k as |k|^q, k ≠ 0 in the count), and a PathCond
write-back keeps the function and never touches the kernel."""

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from capture_reference import Untraceable, assert_definition, assert_forward, eval_forward
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pathir
from pathir.errors import UnsupportedOperation
from pathir.ir import MapKind

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_MODULE = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


class FixedBank(nn.Module):
    """a (learned) -> ReLU -> the fixed kernel k (a buffer) -> ReLU -> o (learned). With ``q`` set
    (the reference), k is |k|^q (q = 0: k ≠ 0): the constant as the path-norm network sees it."""

    q = None

    def __init__(self, kernel, dims, c_in, groups=1, stride=1, padding=0, dilation=1):
        super().__init__()
        kernel = torch.as_tensor(kernel, dtype=torch.float64)
        self.a = _MODULE[dims](2, c_in, 1)
        self.register_buffer("k", kernel)
        self.o = _MODULE[dims](kernel.shape[0], 2, 1)
        self.dims, self.geometry = dims, dict(groups=groups, stride=stride, padding=padding, dilation=dilation)

    def kernel(self):
        if self.q is None:
            return self.k
        return (self.k != 0).double() if self.q == 0 else self.k.abs() ** self.q

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.o(torch.relu(_CONV[self.dims](h, self.kernel(), **self.geometry)))


def _sobel_bank():
    sx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]])
    return torch.stack([sx, sx.T, sx + sx.T]).reshape(3, 1, 3, 3).repeat(1, 3, 1, 1)  # dense: 3 -> 3


def _gabor_depthwise():
    y, x = torch.meshgrid(torch.linspace(-1, 1, 5), torch.linspace(-1, 1, 5), indexing="ij")
    envelope = torch.exp(-(x**2 + y**2) / 0.5)
    return torch.stack([envelope * torch.cos(4 * (x * np.cos(t) + y * np.sin(t))) for t in (0.0, 0.8, 1.6)])[:, None]


CASES = {  # name: (kernel, dims, c_in, geometry, input shape)
    "sobel_dense": (_sobel_bank(), 2, 3, {}, (2, 7, 7)),
    "gabor_depthwise": (_gabor_depthwise(), 2, 3, dict(groups=3, padding=2), (2, 6, 6)),
    "random_features": (torch.randn(5, 3, 3, generator=torch.Generator().manual_seed(3)), 1, 3,
                        dict(stride=2, dilation=2, padding="valid"), (2, 11)),
    "same_even_kernel": (torch.randn(4, 2, 2, 4, generator=torch.Generator().manual_seed(4)), 2, 4,
                         dict(groups=2, padding="same", dilation=(1, 2)), (2, 5, 6)),
    "depthwise_3d": (torch.randn(2, 1, 2, 2, 2, generator=torch.Generator().manual_seed(5)), 3, 2,
                     dict(groups=2, padding=1), (2, 3, 3, 3)),
}


def _model(name):
    kernel, dims, c_in, geometry, shape = CASES[name]
    torch.manual_seed(0)
    return FixedBank(kernel, dims, c_in, **geometry).double().eval(), shape


@pytest.mark.parametrize("name", list(CASES))
def test_fixed_filter_banks_equal_the_definition(name):
    model, shape = _model(name)
    cm = assert_forward(model, shape, tol=1e-12)
    assert_definition(cm, model, shape)
    assert [e.map.kind for n in cm.graph.nodes for e in n.edges].count(MapKind.FIXED_CONV) == 1
    assert {p.source_name for p in cm.graph.params()} <= {n for n, _ in model.named_parameters()}  # no buffer


@pytest.mark.parametrize("name", ["sobel_dense", "gabor_depthwise", "same_even_kernel"])
def test_the_export_path_gives_the_same_numbers(name):
    model, shape = _model(name)
    wrapped = Untraceable(model)
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(wrapped)
    cm = assert_forward(wrapped, shape, tol=1e-12)
    assert_definition(cm, model, shape)


@pytest.mark.parametrize("name", list(CASES))
def test_pathcond_keeps_the_function_and_never_touches_the_kernel(name):
    model, shape = _model(name)
    cm = pathir.compile(model, input_shape=shape)
    kernel = model.k.clone()
    x = torch.randn(3, *shape, dtype=torch.float64)
    before = eval_forward(model, x)
    norm = cm.path_norm(2)
    cm.pathcond()
    assert torch.equal(model.k, kernel)
    assert torch.allclose(eval_forward(model, x), before, rtol=1e-10, atol=1e-12)
    assert pathir.compile(model, input_shape=shape).path_norm(2) <= norm * (1 + 1e-9)


@st.composite
def _banks(draw):
    dims = draw(st.integers(1, 2))
    groups = draw(st.integers(1, 3))
    c_in = groups * draw(st.integers(1, 2))
    c_out = groups * draw(st.integers(1, 2))
    ks = [draw(st.integers(1, 3)) for _ in range(dims)]
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(c_out, c_in // groups, *ks, generator=g, dtype=torch.float64)
    k *= torch.rand(k.shape, generator=g, dtype=torch.float64) < draw(st.sampled_from([0.4, 0.8, 1.0]))
    geometry = dict(groups=groups, stride=draw(st.integers(1, 2)), dilation=draw(st.integers(1, 2)),
                    padding=draw(st.integers(0, 1)))
    shape = (2, *(draw(st.integers(2 * max(ks) + 1, 7)) for _ in range(dims)))
    return FixedBank(k, dims, c_in, **geometry).double().eval(), shape


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_banks())
def test_random_fixed_kernels_equal_the_definition_and_pathcond_keeps_the_function(case):
    model, shape = case
    cm = assert_forward(model, shape, tol=1e-10)
    assert_definition(cm, model, shape)
    x = torch.randn(2, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    before, kernel = eval_forward(model, x), model.k.clone()
    cm.pathcond()
    assert torch.equal(model.k, kernel)
    assert torch.allclose(eval_forward(model, x), before, rtol=1e-9, atol=1e-11)


def test_the_shared_separable_kernel_stays_a_resample():
    blur = torch.tensor([1.0, 2.0, 1.0]) / 4
    model = FixedBank(torch.outer(blur, blur).expand(3, 1, 3, 3), 2, 3, groups=3, padding=1).double()
    cm = assert_forward(model, (2, 5, 5), tol=1e-12)
    kinds = [e.map.kind for n in cm.graph.nodes for e in n.edges]
    assert MapKind.RESAMPLE in kinds and MapKind.FIXED_CONV not in kinds


class _Refused(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.a, self.how = nn.Conv2d(2, 3, 1), how
        self.register_buffer("k", torch.randn(4, 3, 3, 3))
        self.register_buffer("b", torch.randn(4))
        if how == "nan":
            self.k[0, 0, 0, 0] = float("nan")

    def forward(self, x):
        h = torch.relu(self.a(x))
        return F.conv2d(h, self.k, self.b if self.how == "bias" else None)


@pytest.mark.parametrize("how,match", [("bias", "a fixed bias no parameter carries"), ("nan", "non-finite")])
def test_a_fixed_bias_or_a_non_finite_kernel_is_refused_and_the_model_untouched(how, match):
    model = _Refused(how)
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(UnsupportedOperation, match=match):
        pathir.compile(model, input_shape=(2, 5, 5), self_check=False)
    assert all(torch.equal(v, state[k]) or (v.isnan() == state[k].isnan()).all() for k, v in model.state_dict().items())


onnx_cases = pytest.importorskip("onnx_cases")


@pytest.mark.parametrize("name", ["sobel_dense", "gabor_depthwise"])
def test_onnx_export_reads_the_kernel_as_a_weight_with_the_same_numbers(name):
    """ONNX has no buffers: the kernel is an initializer, a free weight there (rescalable); forward
    and path-norms agree with the torch frontend's."""
    model, shape = _model(name)
    model = model.float()
    proto = onnx_cases.export(model, shape, "legacy-nofold")
    cm, ct = pathir.compile(proto), pathir.compile(model, input_shape=shape)
    x = np.random.default_rng(0).normal(size=(2, *shape)).astype(np.float32)
    assert onnx_cases.rel(cm.forward(x, backend="numpy"), onnx_cases.ort_run(proto, x)[0]) <= 1e-5
    for q in (1, 2):
        assert cm.path_norm(q) == pytest.approx(ct.path_norm(q), rel=1e-9)


def _module_with_buffer_kernel(bias_buffer=False):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1)).double()
    kernel = net[2].weight.detach().clone()
    del net[2].weight
    net[2].register_buffer("weight", kernel)
    if bias_buffer:
        b = net[2].bias.detach().clone()
        del net[2].bias
        net[2].register_buffer("bias", b)
    return net


def test_a_conv_module_whose_weight_is_a_buffer_is_a_fixed_filter_with_a_learnable_bias():
    net = _module_with_buffer_kernel()
    cm = assert_forward(net, (2, 7, 7), tol=1e-12)
    assert [e.map.kind for n in cm.graph.nodes for e in n.edges].count(MapKind.FIXED_CONV) == 1
    assert "2.bias" in {p.source_name for p in cm.graph.params()}
    kernel = net[2].weight.clone()
    x = torch.randn(3, 2, 7, 7, dtype=torch.float64)
    before = eval_forward(net, x)
    cm.commit_rescaling(np.linspace(-1.0, 1.0, len(cm.facts.units)))
    assert torch.equal(net[2].weight, kernel)
    assert torch.allclose(eval_forward(net, x), before, rtol=1e-10, atol=1e-12)


def test_a_conv_module_whose_weight_and_bias_are_buffers_is_refused():
    with pytest.raises(UnsupportedOperation, match="a fixed bias no parameter carries"):
        pathir.compile(_module_with_buffer_kernel(bias_buffer=True), input_shape=(2, 7, 7))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 2), st.integers(1, 2), st.integers(0, 2**31 - 1))
def test_the_map_ties_exactly_the_channels_its_non_zero_filters_join(groups, i_g, o_g, seed):
    """channel_ties = {(source, target): some edge of the convolution joins them}, read off torch's
    conv2d on one-hot inputs; out_shape is torch's; |c|^q keeps the zeros."""
    from pathir.ir import FixedConv

    rng = np.random.default_rng(seed)
    K = rng.normal(size=(groups * o_g, i_g, 2, 3)) * (rng.random((groups * o_g, i_g, 1, 1)) < 0.6)
    m = FixedConv(K, (1, 2), ((1, 0), (0, 1)), (2, 1), groups)
    in_shape = (groups * i_g, 5, 6)
    want = set()
    for c in range(in_shape[0]):
        x = torch.zeros(1, *in_shape, dtype=torch.float64)
        x[0, c] = 1.0
        y = F.conv2d(F.pad(x, (0, 1, 1, 0)), torch.as_tensor(K), stride=(1, 2), dilation=(2, 1), groups=groups)
        want |= {(c, int(o)) for o in torch.nonzero(y[0].abs().sum(dim=(1, 2))).flatten()}
        assert m.out_shape(in_shape) == tuple(y.shape[1:])
    assert {tuple(map(int, p)) for p in m.channel_ties(in_shape)} == want
    assert np.array_equal(m.with_weights(np.abs).kernel, np.abs(K))
    assert np.array_equal(m.with_weights(lambda c: c**0).kernel != 0, K != 0)
