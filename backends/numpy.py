"""The numpy backend: the living definition of every map's arithmetic.

One table of rules keyed by ``MapKind``; each rule is (apply, adjoint,
weight_grad) on batched arrays ``(B, *shape)``:

    apply(map, x, in_shape)            -> y,  y = M x
    adjoint(map, g, in_shape)          -> M^T g  (shape (B, *in_shape))
    weight_grad(map, x, g, in_shape)   -> sum over the batch of d<g, M x>/dW (weight's shape)

No torch import: this backend runs where only numpy is installed.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from pathir.ir import MapKind, Node

from .base import Backend, RuleTable

__all__ = ["NumpyBackend", "pad_axes", "window_slices", "window_stack", "grouped", "conv_parts", "bcast"]


# ------------------------------------------------------------ window helpers


def pad_axes(x: np.ndarray, pads, value=0.0) -> np.ndarray:
    return np.pad(x, [(0, 0), (0, 0), *pads], constant_values=value)


def window_slices(offset, dilation, stride, out):
    """Slices of a padded input that line up kernel offset ``offset`` with every output position."""
    return tuple(
        slice(o * d, o * d + (n - 1) * s + 1, s) for o, d, s, n in zip(offset, dilation, stride, out)
    )


def _pool_pads(m, in_shape):
    extra = m.extra_right_padding(in_shape)
    return [(p[0], p[1] + e) for p, e in zip(m.padding, extra)]


def window_stack(x, m, in_shape, fill):
    """(B, C, *out, K): the K window entries of every output position; padding holds ``fill``."""
    out = m.out_shape(in_shape)[1:]
    xp = pad_axes(x, _pool_pads(m, in_shape), fill)
    views = [
        xp[(slice(None), slice(None)) + window_slices(off, m.dilation, m.stride, out)]
        for off in itertools.product(*(range(k) for k in m.kernel))
    ]
    return np.stack(views, axis=-1)


# ------------------------------------------------------------------ rules


def _identity_apply(m, x, s):
    return x


def _identity_adjoint(m, g, s):
    return g


def _reshape_apply(m, x, s):
    return x.reshape(x.shape[0], *m.shape)


def _reshape_adjoint(m, g, s):
    return g.reshape(g.shape[0], *s)


def _channel_apply(m, x, s):
    idx = np.asarray(m.index)
    padded = np.concatenate([x, np.zeros_like(x[:, :1])], axis=1)
    return padded[:, np.where(idx >= 0, idx, x.shape[1])]


def _channel_adjoint(m, g, s):
    idx = np.asarray(m.index)
    out = np.zeros((g.shape[0], *s), dtype=g.dtype)
    keep = idx >= 0
    np.add.at(out, (slice(None), idx[keep]), g[:, keep])
    return out


def _pool_apply(m, x, s):
    y = window_stack(x, m, s, 0.0).sum(axis=-1)
    return y if m.mult is None else y * m.mult


def _pool_adjoint(m, g, s):
    if m.mult is not None:
        g = g * m.mult
    out_sp = g.shape[2:]
    pads = _pool_pads(m, s)
    gx = np.zeros((g.shape[0], s[0], *(L + a + b for L, (a, b) in zip(s[1:], pads))), dtype=g.dtype)
    for off in itertools.product(*(range(k) for k in m.kernel)):
        gx[(slice(None), slice(None)) + window_slices(off, m.dilation, m.stride, out_sp)] += g
    crop = tuple(slice(a, a + L) for L, (a, _) in zip(s[1:], pads))
    return gx[(slice(None), slice(None)) + crop]


def _spatial_apply(m, x, s):
    B, C = x.shape[:2]
    y = np.einsum("bcq,pq->bcp", x.reshape(B, C, -1), m.matrix)
    return y.reshape(B, C, *m.out_spatial)


def _spatial_adjoint(m, g, s):
    B, C = g.shape[:2]
    return np.einsum("bcp,pq->bcq", g.reshape(B, C, -1), m.matrix).reshape(B, *s)


def _per_axis(x, mats):
    """Apply matrix mats[d] along spatial axis d of x (B, C, *spatial): the separable product."""
    for d, a in enumerate(mats):
        x = np.moveaxis(np.tensordot(x, a, axes=([2 + d], [1])), -1, 2 + d)
    return x


def _resample_apply(m, x, s):
    return _per_axis(x, m.matrices)


def _resample_adjoint(m, g, s):
    return _per_axis(g, [a.T for a in m.matrices])


def _gather_apply(m, x, s):
    flat = x.reshape(x.shape[0], -1)
    padded = np.concatenate([flat, np.zeros_like(flat[:, :1])], axis=1)
    return padded[:, np.where(m.index >= 0, m.index, flat.shape[1])].reshape(x.shape[0], *m.shape)


def _gather_adjoint(m, g, s):
    out = np.zeros((g.shape[0], math.prod(s)), dtype=g.dtype)
    keep = m.index >= 0
    np.add.at(out, (slice(None), m.index[keep]), g.reshape(g.shape[0], -1)[:, keep])
    return out.reshape(g.shape[0], *s)


def _dense_apply(m, x, s):
    return x.reshape(x.shape[0], -1) @ m.W.value.T


def _dense_adjoint(m, g, s):
    return (g @ m.W.value).reshape(g.shape[0], *s)


def _dense_wgrad(m, x, g, s):
    return g.T @ x.reshape(x.shape[0], -1)


def grouped(a, groups):
    """(B, C, *sp) -> (B, groups, C // groups, *sp)."""
    return a.reshape(a.shape[0], groups, a.shape[1] // groups, *a.shape[2:])


def conv_parts(m, s):
    W = m.W.value
    O, I_g, *k = W.shape
    out = m.out_shape(s)[1:]
    Wg = W.reshape(m.groups, O // m.groups, I_g, *k)
    return Wg, k, out


def _conv_apply(m, x, s):
    Wg, k, out = conv_parts(m, s)
    xp = grouped(pad_axes(x, m.padding), m.groups)
    y = 0.0
    for off in itertools.product(*(range(kk) for kk in k)):
        win = xp[(slice(None),) * 3 + window_slices(off, m.dilation, m.stride, out)]
        y = y + np.einsum("bgi...,goi->bgo...", win, Wg[(Ellipsis,) + off])
    return y.reshape(x.shape[0], -1, *out)


def _conv_adjoint(m, g, s):
    Wg, k, out = conv_parts(m, s)
    padded = [L + a + b for L, (a, b) in zip(s[1:], m.padding)]
    gx = np.zeros((g.shape[0], m.groups, s[0] // m.groups, *padded), dtype=g.dtype)
    gg = grouped(g, m.groups)
    for off in itertools.product(*(range(kk) for kk in k)):
        gx[(slice(None),) * 3 + window_slices(off, m.dilation, m.stride, out)] += np.einsum(
            "bgo...,goi->bgi...", gg, Wg[(Ellipsis,) + off]
        )
    crop = tuple(slice(a, a + L) for L, (a, _) in zip(s[1:], m.padding))
    return gx.reshape(g.shape[0], s[0], *padded)[(slice(None), slice(None)) + crop]


def _conv_wgrad(m, x, g, s):
    Wg, k, out = conv_parts(m, s)
    xp = grouped(pad_axes(x, m.padding), m.groups)
    gg = grouped(g, m.groups)
    gW = np.zeros_like(Wg)
    for off in itertools.product(*(range(kk) for kk in k)):
        win = xp[(slice(None),) * 3 + window_slices(off, m.dilation, m.stride, out)]
        B, G = gg.shape[:2]
        gW[(Ellipsis,) + off] = np.einsum("bgop,bgip->goi", gg.reshape(B, G, gg.shape[2], -1), win.reshape(B, G, win.shape[2], -1))
    return gW.reshape(m.W.shape)


def bcast(v, ndim):
    return v.reshape(1, -1, *([1] * (ndim - 2)))


def _scale_apply(m, x, s):
    return x * bcast(m.W.value, x.ndim)


def _scale_adjoint(m, g, s):
    return g * bcast(m.W.value, g.ndim)


def _scale_wgrad(m, x, g, s):
    return (x * g).reshape(x.shape[0], x.shape[1], -1).sum(axis=(0, 2))


RULES: RuleTable = {
    MapKind.IDENTITY: (_identity_apply, _identity_adjoint, None),
    MapKind.RESHAPE: (_reshape_apply, _reshape_adjoint, None),
    MapKind.CHANNEL_MAP: (_channel_apply, _channel_adjoint, None),
    MapKind.POOL: (_pool_apply, _pool_adjoint, None),
    MapKind.SPATIAL_MATRIX: (_spatial_apply, _spatial_adjoint, None),
    MapKind.RESAMPLE: (_resample_apply, _resample_adjoint, None),
    MapKind.GATHER: (_gather_apply, _gather_adjoint, None),
    MapKind.FIXED_CONV: (_conv_apply, _conv_adjoint, None),
    MapKind.DENSE: (_dense_apply, _dense_adjoint, _dense_wgrad),
    MapKind.CONV: (_conv_apply, _conv_adjoint, _conv_wgrad),
    MapKind.SCALE: (_scale_apply, _scale_adjoint, _scale_wgrad),
}


class NumpyBackend(Backend):
    """Reference backend on float64 numpy arrays."""

    name = "numpy"
    rules = RULES

    def asarray(self, value):
        return np.asarray(value, dtype=np.float64)

    def to_numpy(self, x):
        return np.asarray(x)

    def ones(self, shape):
        return np.ones(shape, dtype=np.float64)

    def zeros(self, shape):
        return np.zeros(shape, dtype=np.float64)

    def bias(self, node: Node, ndim: int):
        return bcast(node.bias.value, ndim)

    def relu(self, x):
        return np.maximum(x, 0.0)

    def kth_max_pool(self, node: Node, x, in_shape):
        stack = window_stack(x, node.edges[0].map, in_shape, -np.inf)
        return -np.sort(-stack, axis=-1)[..., node.k - 1]

    def amax(self, x) -> float:
        return float(np.max(np.abs(x))) if x.size else 0.0

    def total(self, x) -> float:
        return float(np.sum(x))

    def channel_sum(self, g):
        return g.reshape(g.shape[0], g.shape[1], -1).sum(axis=(0, 2))

    # ---------------------------------------------- activation patterns at data
    def pool_choice(self, node: Node, x, in_shape, kth=None):
        stack = window_stack(x, node.edges[0].map, in_shape, -np.inf)
        kth = -np.sort(-stack, axis=-1)[..., node.k - 1: node.k]
        return np.argmax(stack == kth, axis=-1)  # the first offset attaining it

    def select_apply(self, node: Node, choice, x, in_shape):
        stack = window_stack(x, node.edges[0].map, in_shape, 0.0)
        shape = np.broadcast_shapes(stack.shape[:-1], choice.shape)
        stack = np.broadcast_to(stack, (*shape, stack.shape[-1]))
        return np.take_along_axis(stack, np.broadcast_to(choice, shape)[..., None], axis=-1)[..., 0]

    def select_adjoint(self, node: Node, choice, g, in_shape):
        m = node.edges[0].map
        g = np.broadcast_to(g, np.broadcast_shapes(g.shape, choice.shape))
        pads = _pool_pads(m, in_shape)
        gx = np.zeros((g.shape[0], in_shape[0], *(L + a + b for L, (a, b) in zip(in_shape[1:], pads))))
        offsets = itertools.product(*(range(k) for k in m.kernel))
        for i, off in enumerate(offsets):
            gx[(slice(None), slice(None)) + window_slices(off, m.dilation, m.stride, g.shape[2:])] += np.where(choice == i, g, 0.0)
        crop = tuple(slice(a, a + L) for L, (a, _) in zip(in_shape[1:], pads))
        return gx[(slice(None), slice(None)) + crop]

    def row_amax(self, x):
        return np.abs(x.reshape(x.shape[0], -1)).max(axis=1, initial=0.0)

    def row_total(self, x):
        return x.reshape(x.shape[0], -1).sum(axis=1)
