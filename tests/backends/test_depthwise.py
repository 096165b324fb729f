"""The depthwise convolution rules (backends/depthwise.py: shifted slices, every channel at once)
against torch's own convolution, its input-gradient and its weight-gradient, on random shapes:
1-d to 3-d, strides, dilations, uneven paddings and several outputs per input channel."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
F = torch.nn.functional

from pathir.backends import depthwise  # noqa: E402

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@st.composite
def cases(draw):
    n = draw(st.integers(1, 3))
    C, m, N = draw(st.integers(1, 5)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
    kernel = [draw(st.integers(1, 4)) for _ in range(n)]
    stride = [draw(st.integers(1, 3)) for _ in range(n)]
    dilation = [draw(st.integers(1, 2)) for _ in range(n)]
    pads = [(draw(st.integers(0, 2)), draw(st.integers(0, 2))) for _ in range(n)]
    spatial = [draw(st.integers(max(1, d * (k - 1) + 1 - a - b), 9)) for k, d, (a, b) in zip(kernel, dilation, pads)]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(N, C, *spatial, generator=gen, dtype=torch.float64)
    W = torch.randn(C * m, 1, *kernel, generator=gen, dtype=torch.float64)
    return x, W, tuple(stride), pads, tuple(dilation)


def _torch_conv(x, W, stride, pads, dilation):
    flat = [p for a_b in reversed(pads) for p in a_b]
    return _CONV[x.ndim - 2](F.pad(x, flat), W, None, stride, 0, dilation, x.shape[1])


@settings(max_examples=120, deadline=None)
@given(cases())
def test_depthwise_rules_are_torchs_convolution_and_its_gradients(case):
    x, W, stride, pads, dilation = case
    assert depthwise.is_depthwise(x.shape[1], W.shape, x.shape[1], x) == (x.shape[1] > 1)
    x.requires_grad_(True)
    W.requires_grad_(True)
    want = _torch_conv(x, W, stride, pads, dilation)
    got = depthwise.conv(x.detach(), W.detach(), stride, pads, dilation)
    torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12)
    g = torch.randn_like(want)
    gx, gW = torch.autograd.grad(want, (x, W), g)
    torch.testing.assert_close(depthwise.conv_input(tuple(x.shape), W.detach(), g, stride, pads, dilation), gx,
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(depthwise.conv_weight(x.detach(), tuple(W.shape), g, stride, pads, dilation), gW,
                               rtol=1e-12, atol=1e-12)


def test_only_float64_cpu_depthwise_convolutions_take_the_path():
    x64 = torch.zeros(1, dtype=torch.float64)
    assert depthwise.is_depthwise(8, (8, 1, 3, 3), 8, x64)
    assert not depthwise.is_depthwise(8, (8, 1, 3, 3), 8, x64.float())   # mkldnn handles float32
    assert not depthwise.is_depthwise(8, (8, 2, 3, 3), 4, x64)           # two inputs per group
    assert not depthwise.is_depthwise(8, (8, 8, 3, 3), 1, x64)           # an ordinary convolution
