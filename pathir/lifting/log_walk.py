"""Path walks in log space, neuron by neuron: exact for any q, on any representative of θ.

Every neuron's path sum is kept as its natural logarithm (numpy float64, -inf for
0) and every edge is crossed in the log semiring: a sum Σ c·x becomes
``logsumexp(log|c|·q + log x)`` over the neuron's antecedents, a max-plus
``max(...)`` for q = inf. Nothing is ever raised to q outside a logarithm, and
no two neurons share a scale, so nothing underflows or overflows: the result is
the definition of docs/math.md §3 up to rounding in the logs (absolute error
~1e-16·|log value| per step). It is the last resort of the certified walks
(:mod:`pathir.lifting.walk`, :mod:`pathir.lifting.scaled`) and the walk of q = inf:
log max_p |Φ_p| is the longest path in log|θ| (a max-pool read as the sum of its
window, as in every path sum).

Cost: one reduction per neuron-level edge, on numpy (a convolution visits its
taps one by one), so it is slow on large networks; the fast walks only fall back
here where they cannot certify their result.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from pathir.backends.numpy import NumpyBackend, pad_axes, window_slices, window_stack
from pathir.errors import PathirError
from pathir.ir import Graph, MapKind, NodeKind

__all__ = ["log_forward", "log_backward", "log_grand_total", "coefficient_logs"]

_NEG = -np.inf


def _lse(a: np.ndarray, axis: int) -> np.ndarray:
    """log Σ exp(a) along ``axis`` (-inf where every term is -inf, or there is none)."""
    top = np.max(a, axis=axis, keepdims=True, initial=_NEG)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = safe + np.log(np.sum(np.exp(a - safe), axis=axis, keepdims=True))
    return np.squeeze(np.where(np.isneginf(top), _NEG, out), axis=axis)


#: entries of a convolution's temporary (one tap, a block of channels): 128 MB of float64
_TEMP = 1 << 24


def _chunk(per_channel: int) -> int:
    """Channels per block so that a block's temporary holds at most _TEMP entries."""
    return max(1, _TEMP // max(1, per_channel))


def _reducer(q):
    """(reduce along an axis, combine two arrays) of the semiring of q: log-sum-exp, or max for q = inf."""
    if q == math.inf:
        return (lambda a, axis: np.max(a, axis=axis, initial=_NEG)), np.maximum
    return _lse, np.logaddexp


def coefficient_logs(c: np.ndarray, q, free: bool) -> np.ndarray:
    """q·log|c| per entry (-inf where c = 0); q = 0: 0 (a fixed zero stays -inf, a free one counts);
    q = inf: log|c|."""
    c = np.asarray(c, dtype=np.float64)
    if q == 0:
        return np.zeros(c.shape) if free else np.where(c != 0, 0.0, _NEG)
    with np.errstate(divide="ignore"):
        logs = np.log(np.abs(c))
    return logs if q == math.inf else q * logs


def _pool_pads(m, in_shape):
    extra = m.extra_right_padding(tuple(in_shape))
    return [(p[0], p[1] + e) for p, e in zip(m.padding, extra)]


def _apply(m, L: np.ndarray, in_shape, q, red, comb) -> np.ndarray:
    """The log of (map applied to exp(L)), L of the source's shape; the target's shape out."""
    in_shape = tuple(in_shape)
    k = m.kind
    if k is MapKind.IDENTITY:
        return L
    if k is MapKind.RESHAPE:
        return L.reshape(m.shape)
    if k is MapKind.CHANNEL_MAP:
        idx = np.asarray(m.index)
        padded = np.concatenate([L, np.full((1, *L.shape[1:]), _NEG)])
        return padded[np.where(idx >= 0, idx, L.shape[0])]
    if k is MapKind.GATHER:
        flat = np.append(L.reshape(-1), _NEG)
        return flat[np.where(m.index >= 0, m.index, flat.size - 1)].reshape(m.shape)
    if k is MapKind.POOL:
        y = red(window_stack(L[None], m, in_shape, _NEG)[0], -1)
        return y if m.mult is None else y + coefficient_logs(m.mult, q, False)
    if k is MapKind.SPATIAL_MATRIX:
        C = L.shape[0]
        y = red(L.reshape(C, 1, -1) + coefficient_logs(m.matrix, q, False)[None], -1)
        return y.reshape(C, *m.out_spatial)
    if k is MapKind.RESAMPLE:
        for d, a in enumerate(m.matrices):
            moved = np.moveaxis(L, 1 + d, -1)[..., None, :]  # (..., 1, in_d)
            L = np.moveaxis(red(moved + coefficient_logs(a, q, False), -1), -1, 1 + d)
        return L
    if k is MapKind.DENSE:
        return red(L.reshape(1, -1) + coefficient_logs(m.W.value, q, True), -1)
    if k is MapKind.SCALE:
        return L + coefficient_logs(m.W.value, q, True).reshape(-1, *([1] * (L.ndim - 1)))
    if k in (MapKind.CONV, MapKind.FIXED_CONV):
        W = coefficient_logs(m.W.value, q, k is MapKind.CONV)
        O, I_g, *kernel = W.shape
        G = m.groups
        out = m.out_shape(in_shape)[1:]
        Wg = W.reshape(G, O // G, I_g, *kernel)
        xp = pad_axes(L[None], m.padding, _NEG)[0]
        xp = xp.reshape(G, I_g, *xp.shape[1:])
        y = np.full((G, O // G, *out), _NEG)
        step = _chunk(G * I_g * math.prod(out))
        for off in itertools.product(*(range(n) for n in kernel)):
            win = xp[(slice(None), slice(None)) + window_slices(off, m.dilation, m.stride, out)]  # (G, I_g, *out)
            w = Wg[(Ellipsis,) + off].reshape(G, O // G, I_g, *([1] * len(out)))
            for o in range(0, O // G, step):  # output channels a block at a time: a bounded temporary
                y[:, o:o + step] = comb(y[:, o:o + step], red(w[:, o:o + step] + win[:, None], 2))
        return y.reshape(O, *out)
    raise NotImplementedError(f"log walk: no rule for {k.value}")


def _adjoint(m, G_: np.ndarray, in_shape, q) -> np.ndarray:
    """The log of (the map's adjoint applied to exp(G_)): the source's shape out (log-sum-exp)."""
    in_shape = tuple(in_shape)
    k = m.kind
    if k is MapKind.IDENTITY:
        return G_
    if k is MapKind.RESHAPE:
        return G_.reshape(in_shape)
    if k in (MapKind.CHANNEL_MAP, MapKind.GATHER):
        out = np.full(in_shape if k is MapKind.CHANNEL_MAP else (math.prod(in_shape),), _NEG)
        idx = np.asarray(m.index).reshape(-1)
        keep = idx >= 0
        src = G_ if k is MapKind.CHANNEL_MAP else G_.reshape(-1)
        np.logaddexp.at(out, idx[keep], src[keep])
        return out.reshape(in_shape)
    if k is MapKind.POOL:
        g = G_ if m.mult is None else G_ + coefficient_logs(m.mult, q, False)
        pads = _pool_pads(m, in_shape)
        gx = np.full((in_shape[0], *(L + a + b for L, (a, b) in zip(in_shape[1:], pads))), _NEG)
        for off in itertools.product(*(range(n) for n in m.kernel)):
            sl = (slice(None),) + window_slices(off, m.dilation, m.stride, G_.shape[1:])
            gx[sl] = np.logaddexp(gx[sl], g)
        return gx[(slice(None),) + tuple(slice(a, a + L) for L, (a, _) in zip(in_shape[1:], pads))]
    if k is MapKind.SPATIAL_MATRIX:
        C = G_.shape[0]
        gx = _lse(G_.reshape(C, -1, 1) + coefficient_logs(m.matrix, q, False)[None], 1)
        return gx.reshape(in_shape)
    if k is MapKind.RESAMPLE:
        g = G_
        for d, a in enumerate(m.matrices):
            moved = np.moveaxis(g, 1 + d, -1)[..., :, None]  # (..., out_d, 1)
            g = np.moveaxis(_lse(moved + coefficient_logs(a, q, False), -2), -1, 1 + d)
        return g
    if k is MapKind.DENSE:
        return _lse(G_.reshape(-1, 1) + coefficient_logs(m.W.value, q, True), 0).reshape(in_shape)
    if k is MapKind.SCALE:
        return G_ + coefficient_logs(m.W.value, q, True).reshape(-1, *([1] * (G_.ndim - 1)))
    if k in (MapKind.CONV, MapKind.FIXED_CONV):
        W = coefficient_logs(m.W.value, q, k is MapKind.CONV)
        O, I_g, *kernel = W.shape
        G = m.groups
        out = G_.shape[1:]
        Wg = W.reshape(G, O // G, I_g, *kernel)
        gg = G_.reshape(G, O // G, *out)
        padded = [L + a + b for L, (a, b) in zip(in_shape[1:], m.padding)]
        gx = np.full((G, I_g, *padded), _NEG)
        step = _chunk(G * (O // G) * math.prod(out))
        for off in itertools.product(*(range(n) for n in kernel)):
            w = Wg[(Ellipsis,) + off].reshape(G, O // G, I_g, *([1] * len(out)))
            win = window_slices(off, m.dilation, m.stride, out)
            for i in range(0, I_g, step):  # source channels a block at a time
                sl = (slice(None), slice(i, i + step)) + win
                gx[sl] = np.logaddexp(gx[sl], _lse(w[:, :, i:i + step] + gg[:, :, None], 1))
        crop = tuple(slice(a, a + L) for L, (a, _) in zip(in_shape[1:], m.padding))
        return gx.reshape(in_shape[0], *padded)[(slice(None),) + crop]
    raise NotImplementedError(f"log walk: no rule for {k.value}")


def _weight_logs(m, LF: np.ndarray, LG: np.ndarray, in_shape) -> np.ndarray:
    """Per weight entry, log Σ over its edges of F(source)·G(target) (the weight-gradient)."""
    k = m.kind
    if k is MapKind.DENSE:
        return LG.reshape(-1, 1) + LF.reshape(1, -1)
    if k is MapKind.SCALE:
        C = LF.shape[0]
        return _lse((LF + LG).reshape(C, -1), 1)
    O, I_g, *kernel = m.W.shape
    G = m.groups
    out = LG.shape[1:]
    xp = pad_axes(LF[None], m.padding, _NEG)[0]
    xp = xp.reshape(G, I_g, *xp.shape[1:])
    gg = LG.reshape(G, O // G, 1, -1)
    res = np.full((G, O // G, I_g, *kernel), _NEG)
    step = _chunk(G * I_g * math.prod(out))
    for off in itertools.product(*(range(n) for n in kernel)):
        win = xp[(slice(None), slice(None)) + window_slices(off, m.dilation, m.stride, out)].reshape(G, 1, I_g, -1)
        for o in range(0, O // G, step):
            res[(slice(None), slice(o, o + step), slice(None)) + off] = _lse(gg[:, o:o + step] + win, -1)
    return res.reshape(m.W.shape)


def log_forward(graph: Graph, q, pattern=None, sample: int = 0, backend=None) -> dict:
    """{node: log of its path sum, an array of the node's shape}: the path-norm network of
    docs/math.md §3 (weights |w|^q, all-ones input; q = 0 counts every edge and existing bias,
    q = inf takes the max over paths instead of the sum) walked in log space.

    Without ``pattern`` ReLUs and max-pools are linearised (a max-pool sums its window); with it,
    sample ``sample`` of the pattern is frozen (``backend``: the pattern's, to read its arrays)."""
    red, comb = _reducer(q)
    acts: dict[str, np.ndarray] = {}
    with np.errstate(invalid="ignore", over="ignore"):
        for node in graph.nodes:
            if node.kind is NodeKind.INPUT:
                acts[node.name] = np.zeros(node.shape)
                continue
            total = np.full(node.shape, _NEG)
            for e in node.edges:
                src = graph.node(e.source).shape
                if pattern is not None and node.kind is NodeKind.MAXPOOL:
                    choice = np.asarray(backend.to_numpy(pattern.choice[node.name]))[sample:sample + 1]
                    term = NumpyBackend().select_apply(node, choice, acts[e.source][None], src)[0]
                else:
                    term = _apply(e.map, acts[e.source], src, q, red, comb)
                total = comb(total, term)
            if node.bias is not None:
                b = coefficient_logs(node.bias.value, q, True)
                total = comb(total, b.reshape(-1, *([1] * (len(node.shape) - 1))))
            if pattern is not None and node.kind is NodeKind.RELU:
                mask = np.asarray(backend.to_numpy(pattern.relu[node.name]))[sample]
                total = np.where(mask, total, _NEG)
            if np.any(np.isnan(total)) or np.any(np.isposinf(total)):
                raise PathirError(f"non-finite value in a path computation at node '{node.name}' (NaN or inf weights?)")
            acts[node.name] = total
    return acts


def log_backward(graph: Graph, q, acts: dict) -> dict:
    """Per param of ``graph``: {id(param): [(ones, logs) per use]}, the weight-gradients of the
    path-norm network (weights |w|^q) as exact per-entry logs (value = 1·e^logs), with the
    forward walk ``acts`` (:func:`log_forward` of ``graph`` or of a graph of its structure)."""
    pending = {n.name: np.full(n.shape, _NEG) for n in graph.nodes}
    for o in graph.outputs:
        pending[o] = np.zeros(graph.node(o).shape)
    parts: dict[int, list] = {}
    with np.errstate(invalid="ignore", over="ignore"):
        for node in reversed(graph.nodes):
            g = pending.pop(node.name)
            if node.kind is NodeKind.INPUT:
                continue
            for e in node.edges:
                src = graph.node(e.source).shape
                pending[e.source] = np.logaddexp(pending[e.source], _adjoint(e.map, g, src, q))
                if e.map.weight is not None:
                    logs = _weight_logs(e.map, acts[e.source], g, src)
                    parts.setdefault(id(e.map.weight), []).append((np.ones(logs.shape), logs))
            if node.bias is not None:
                logs = _lse(g.reshape(g.shape[0], -1), 1)
                parts.setdefault(id(node.bias), []).append((np.ones(logs.shape), logs))
    return parts


def log_grand_total(acts: dict, names, q=1.0) -> float:
    """log of the sum (max for q = inf) of every entry of the named nodes (-inf if zero)."""
    red, _ = _reducer(q)
    values = [acts[n].reshape(-1) for n in names]
    if not values:
        return -math.inf
    return float(red(np.concatenate(values), 0)) if sum(v.size for v in values) else -math.inf
