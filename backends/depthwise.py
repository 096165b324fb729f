"""Depthwise convolutions (one input channel per group) in float64 on the CPU, as shifted slices.

torch has no vectorised float64 CPU kernel for a grouped convolution: it runs one small
convolution per group, so a depthwise layer of 464 channels costs 464 calls forward and 928
backward (shufflenet_v2's walk for diag G made some 5000 of them). Here a depthwise layer is
k (the kernel's size) fused multiply-adds over the whole output, each reading the padded input
at one kernel offset (a strided view), for every channel at once:

    y[n, c·m + j, o] = Σ_a W[c·m + j, 0, a] · x_pad[n, c, o·stride + a·dilation]

with m output channels per input channel. The adjoint adds each offset's products into a strided
view of the padded gradient, and the weight-gradient reduces each offset's products. Every entry
is the same sum of the same products as torch's convolution (only their order may differ).

>>> import torch
>>> x, W = torch.randn(2, 3, 9, 9, dtype=torch.float64), torch.randn(6, 1, 3, 3, dtype=torch.float64)
>>> y = conv(x, W, (2, 2), ((1, 1), (1, 1)), (1, 1))
>>> bool(torch.allclose(y, torch.nn.functional.conv2d(x, W, None, 2, 1, 1, 3), rtol=1e-13, atol=1e-13))
True
"""

from __future__ import annotations

import itertools

import torch

from .numpy import window_slices

__all__ = ["conv", "conv_input", "conv_weight", "is_depthwise"]


def is_depthwise(x_channels: int, w_shape, groups: int, like: torch.Tensor) -> bool:
    """Whether a convolution of ``x_channels`` inputs by a weight of shape ``w_shape`` in ``groups`` groups,
    on tensors like ``like``, takes this path: one input channel per group, more than one group, 1-d to
    3-d, float64 on the CPU."""
    return groups > 1 and groups == x_channels and w_shape[1] == 1 and 3 <= len(w_shape) <= 5 \
        and like.dtype == torch.float64 and like.device.type == "cpu"


def _out(spatial, W, stride, pads, dilation) -> list[int]:
    return [(L + a + b - d * (k - 1) - 1) // s + 1
            for L, (a, b), k, s, d in zip(spatial, pads, W.shape[2:], stride, dilation)]


def _pad(x, pads):
    if all(a == 0 and b == 0 for a, b in pads):
        return x
    return torch.nn.functional.pad(x, [p for a_b in reversed(pads) for p in a_b])


def _offsets(kernel, dilation, stride, out):
    """(kernel offset, the slices of the padded input it reads) for every kernel offset."""
    for off in itertools.product(*(range(k) for k in kernel)):
        yield off, (slice(None), slice(None)) + window_slices(off, dilation, stride, out)


def _per_input(W, C: int):
    """W (C·m, 1, *k) as (1, C, m, 1…, *k): each input channel's m kernels."""
    m = W.shape[0] // C
    return W.reshape(1, C, m, *([1] * (W.ndim - 2)), *W.shape[2:]), m


def conv(x, W, stride, pads, dilation):
    """The depthwise convolution of x (N, C, *S) by W (C·m, 1, *k); ``pads``: (before, after) per axis."""
    N, C = x.shape[:2]
    out = _out(x.shape[2:], W, stride, pads, dilation)
    xp = _pad(x, pads)
    Wc, m = _per_input(W, C)
    y = x.new_zeros((N, C, m, *out))
    n = len(out)
    for off, x_at in _offsets(W.shape[2:], dilation, stride, out):
        y.addcmul_(xp[x_at].unsqueeze(2), Wc[(slice(None),) * (3 + n) + off])
    return y.reshape(N, C * m, *out)


def conv_input(shape, W, g, stride, pads, dilation):
    """The adjoint of :func:`conv` on g (N, C·m, *out): the gradient with respect to x of shape ``shape``."""
    N, C, *spatial = shape
    out = list(g.shape[2:])
    Wc, m = _per_input(W, C)
    gr = g.reshape(N, C, m, *out)
    gx = g.new_zeros((N, C, *(L + a + b for L, (a, b) in zip(spatial, pads))))
    n = len(out)
    for off, x_at in _offsets(W.shape[2:], dilation, stride, out):
        w = Wc[(slice(None),) * (3 + n) + off]
        if m == 1:
            gx[x_at].addcmul_(gr[:, :, 0], w[:, :, 0])
        else:
            gx[x_at] += (gr * w).sum(dim=2)
    return gx[(slice(None), slice(None)) + tuple(slice(a, a + L) for (a, _), L in zip(pads, spatial))]


def conv_weight(x, W_shape, g, stride, pads, dilation):
    """The weight-gradient of :func:`conv`: Σ over the batch and the output positions of input times
    output gradient, per kernel entry, of shape ``W_shape`` (C·m, 1, *k). Each offset's products are
    formed on the strided view of the padded input and summed (no contiguous copy of the view)."""
    N, C = x.shape[:2]
    out = list(g.shape[2:])
    m = W_shape[0] // C
    xp = _pad(x, pads)
    gr = g.reshape(N, C, m, *out)
    wg = g.new_empty((C, m, *W_shape[2:]))
    summed = (0, *range(3, 3 + len(out)))  # the batch and the output positions
    for off, x_at in _offsets(W_shape[2:], dilation, stride, out):
        wg[(slice(None), slice(None)) + off] = (xp[x_at].unsqueeze(2) * gr).sum(dim=summed)
    return wg.reshape(W_shape)
