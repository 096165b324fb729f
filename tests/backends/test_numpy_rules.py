"""The numpy backend's window rules against torch's functional ops as the definition.

Conv (groups, stride, dilation, asymmetric padding through F.pad), max-pool
(k = 1 of a k-max-pool node), average pool (a Pool whose multiplier is
1/divisor per output position) and adaptive average pool (a SpatialMatrix),
over random geometries; adjoints and weight-gradients against autograd.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pathir.backends.numpy import NumpyBackend
from pathir.ir import Conv, Edge, Node, NodeKind, Param, Pool, SpatialMatrix

NB = NumpyBackend()
CONV = {1: F.conv1d, 2: F.conv2d}
MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d}
AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d}


def rel_err(ref, got) -> float:
    ref, got = np.asarray(ref), np.asarray(got)
    assert ref.shape == got.shape, (ref.shape, got.shape)
    scale = max(float(np.abs(ref).max(initial=0.0)), 1e-300)
    return float(np.abs(ref - got).max(initial=0.0)) / scale


def torch_pad(pads):
    return [p for a_b in reversed(pads) for p in a_b]


@st.composite
def conv_cases(draw):
    n = draw(st.sampled_from([1, 2]))
    groups = draw(st.integers(1, 3))
    c_in, c_out = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(n))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(n))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(n))
    padding = tuple((draw(st.integers(0, 2)), draw(st.integers(0, 2))) for _ in range(n))
    spatial = tuple(
        max(1, d * (k - 1) + 1 - a - b) + draw(st.integers(0, 4))
        for k, d, (a, b) in zip(kernel, dilation, padding)
    )
    seed = draw(st.integers(0, 2**32 - 1))
    return n, groups, (c_out, c_in // groups, *kernel), stride, dilation, padding, (c_in, *spatial), seed


@settings(max_examples=60)
@given(conv_cases())
def test_conv_matches_torch_conv(case):
    n, groups, w_shape, stride, dilation, padding, in_shape, seed = case
    rng = np.random.default_rng(seed)
    W = rng.normal(size=w_shape)
    x = rng.normal(size=(2, *in_shape))
    m = Conv(Param("w", W), stride, padding, dilation, groups)

    xt = torch.tensor(x, requires_grad=True)
    Wt = torch.tensor(W, requires_grad=True)
    yt = CONV[n](F.pad(xt, torch_pad(padding)), Wt, None, stride, 0, dilation, groups)
    y = NB.apply(m, x, in_shape)
    assert y.shape == tuple(yt.shape) == (2, *m.out_shape(in_shape))
    assert rel_err(yt.detach().numpy(), y) < 1e-12

    g = rng.normal(size=y.shape)
    gx, gW = torch.autograd.grad(yt, (xt, Wt), torch.tensor(g))
    assert rel_err(gx.numpy(), NB.adjoint(m, g, in_shape)) < 1e-12
    assert rel_err(gW.numpy(), NB.weight_grad(m, x, g, in_shape)) < 1e-12


@st.composite
def torch_pool_cases(draw, dilated: bool):
    """Geometries torch's pools accept: symmetric padding of at most half the kernel."""
    n = draw(st.sampled_from([1, 2]))
    kernel = tuple(draw(st.integers(1, 4)) for _ in range(n))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(n))
    dilation = tuple(draw(st.integers(1, 2)) if dilated else 1 for _ in range(n))
    pad = tuple(draw(st.integers(0, k // 2)) for k in kernel)
    spatial = tuple(
        max(1, d * (k - 1) + 1 - 2 * p) + draw(st.integers(0, 5)) for k, d, p in zip(kernel, dilation, pad)
    )
    ceil_mode = draw(st.booleans())
    seed = draw(st.integers(0, 2**32 - 1))
    return n, kernel, stride, dilation, pad, (draw(st.integers(1, 3)), *spatial), ceil_mode, seed


@settings(max_examples=60)
@given(torch_pool_cases(dilated=True))
def test_max_pool_matches_torch_max_pool(case):
    n, kernel, stride, dilation, pad, in_shape, ceil_mode, seed = case
    # torch rejects an effective window larger than the padded input
    assume(all(L + 2 * p >= d * (k - 1) + 1 for L, p, d, k in zip(in_shape[1:], pad, dilation, kernel)))
    x = np.random.default_rng(seed).normal(size=(2, *in_shape))
    window = Pool(kernel, stride, tuple((p, p) for p in pad), dilation, ceil_mode)
    out_shape = window.out_shape(in_shape)
    node = Node("mp", NodeKind.MAXPOOL, out_shape, (Edge("x", window),), k=1)

    ref = MAX_POOL[n](torch.tensor(x), kernel, stride, pad, dilation, ceil_mode).numpy()
    got = NB.kth_max_pool(node, x, in_shape)
    assert got.shape == ref.shape == (2, *out_shape)
    np.testing.assert_array_equal(got, ref)


def avg_multiplier(n, kernel, stride, pad, ceil_mode, count_include_pad, spatial):
    """1/divisor per output position, read off torch itself: avg_pool(ones) / sum_pool(ones)."""
    ones = torch.ones((1, 1, *spatial), dtype=torch.float64)
    if n == 1:  # avg_pool1d has no divisor_override: take the 2-d pool over a (1, L) image
        avg = F.avg_pool1d(ones, kernel, stride, pad, ceil_mode, count_include_pad)
        total = F.avg_pool2d(ones.unsqueeze(2), (1, *kernel), (1, *stride), (0, *pad), ceil_mode, True, 1).squeeze(2)
    else:
        avg = F.avg_pool2d(ones, kernel, stride, pad, ceil_mode, count_include_pad)
        total = F.avg_pool2d(ones, kernel, stride, pad, ceil_mode, True, 1)
    return (avg / total)[0, 0].numpy()


@settings(max_examples=60)
@given(torch_pool_cases(dilated=False), st.booleans())
def test_avg_pool_matches_torch_avg_pool(case, count_include_pad):
    n, kernel, stride, _, pad, in_shape, ceil_mode, seed = case
    rng = np.random.default_rng(seed)
    mult = avg_multiplier(n, kernel, stride, pad, ceil_mode, count_include_pad, in_shape[1:])
    m = Pool(kernel, stride, tuple((p, p) for p in pad), (1,) * n, ceil_mode, mult)
    x = rng.normal(size=(2, *in_shape))

    xt = torch.tensor(x, requires_grad=True)
    yt = AVG_POOL[n](xt, kernel, stride, pad, ceil_mode, count_include_pad)
    y = NB.apply(m, x, in_shape)
    assert y.shape == tuple(yt.shape) == (2, *m.out_shape(in_shape))
    assert rel_err(yt.detach().numpy(), y) < 1e-12

    g = rng.normal(size=y.shape)
    (gx,) = torch.autograd.grad(yt, xt, torch.tensor(g))
    assert rel_err(gx.numpy(), NB.adjoint(m, g, in_shape)) < 1e-12


def adaptive_matrix(in_spatial, out_spatial) -> np.ndarray:
    """Adaptive average pooling as a matrix: along each axis output i averages
    input [floor(i L / o), ceil((i + 1) L / o)); axes combine by Kronecker product."""
    mat = np.ones((1, 1))
    for L, o in zip(in_spatial, out_spatial):
        axis = np.zeros((o, L))
        for i in range(o):
            lo, hi = (i * L) // o, -(-((i + 1) * L) // o)
            axis[i, lo:hi] = 1.0 / (hi - lo)
        mat = np.kron(mat, axis)
    return mat


@settings(max_examples=40)
@given(
    st.lists(st.integers(1, 9), min_size=1, max_size=2),
    st.data(),
    st.integers(1, 3),
    st.integers(0, 2**32 - 1),
)
def test_adaptive_avg_pool_matches_spatial_matrix(in_spatial, data, channels, seed):
    out_spatial = tuple(data.draw(st.integers(1, 2 * L)) for L in in_spatial)
    rng = np.random.default_rng(seed)
    m = SpatialMatrix(adaptive_matrix(in_spatial, out_spatial), out_spatial)
    in_shape = (channels, *in_spatial)
    x = rng.normal(size=(2, *in_shape))

    pool = F.adaptive_avg_pool1d if len(in_spatial) == 1 else F.adaptive_avg_pool2d
    xt = torch.tensor(x, requires_grad=True)
    yt = pool(xt, out_spatial)
    assert rel_err(yt.detach().numpy(), NB.apply(m, x, in_shape)) < 1e-12

    g = rng.normal(size=tuple(yt.shape))
    (gx,) = torch.autograd.grad(yt, xt, torch.tensor(g))
    assert rel_err(gx.numpy(), NB.adjoint(m, g, in_shape)) < 1e-12


@pytest.mark.parametrize("k", [2, 3])
def test_kth_max_pool_is_kth_largest_of_each_window(k):
    """k > 1 against a per-window sort of torch's unfold (2-d, padded windows hold -inf)."""
    rng = np.random.default_rng(k)
    x = rng.normal(size=(2, 3, 7, 6))
    window = Pool((3, 2), (2, 1), ((1, 1), (0, 0)), (1, 1))
    out = window.out_shape((3, 7, 6))
    node = Node("mp", NodeKind.MAXPOOL, out, (Edge("x", window),), k=k)
    padded = F.pad(torch.tensor(x), (0, 0, 1, 1), value=-math.inf)
    cols = F.unfold(padded.reshape(6, 1, 9, 6), (3, 2), stride=(2, 1))  # (6, 6 entries, positions)
    ref = cols.sort(dim=1, descending=True).values[:, k - 1].reshape(2, *out)
    np.testing.assert_array_equal(NB.kth_max_pool(node, x, (3, 7, 6)), ref.numpy())
