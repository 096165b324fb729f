"""Fixed-coefficient linear maps on the lowering core's Values: padding, resampling and fixed
(buffer) filters, shared by the torch rules and ONNX's Pad and Resize.

Invariants kept:

- padding (every mode) moves elements without computing:
  they become pending selection maps (``Gather``, or a more specific one),
  composed with the selections already pending, exactly as ``index_op`` does;
  zero padding positions read nothing (index -1: no edge);
- a fixed (buffer) convolution kernel is one ``FixedConv`` edge (constant edges, never
  rescaled), or, when it is one separable kernel shared by every channel of a depthwise
  convolution, a ``Resample``; a fixed (buffer) matrix of a linear layer or a matmul is a
  1x1 ``FixedConv`` over the features;
- resampling (interpolate in every mode) and separable fixed filters become one
  ``Resample`` edge whose per-axis matrices are read off *torch's own op* on
  one-hot inputs along that axis, so the coefficients are torch's, bit for bit;
- a non-zero pad value is refused: it is a fixed bias no parameter carries; but -inf padding
  (TF-"same" max-pooling) is held apart (``NegInfPadded``) for the max-pool that reads it, whose own
  padding it then is.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from pathir.frontends.core.pointwise_linear import over_rows
from pathir.frontends.core.values import NegInfPadded, ParamTensor, Value, f64
from pathir.ir import FixedConv, Resample, SourceRef

__all__ = ["pad", "neg_inf_pad", "max_pool_padded", "interpolate", "adaptive_avg_pool", "fixed_conv", "fixed_linear", "fixed_left_matmul", "axis_matrices", "resampled"]

_PAD_MODES = {"constant", "reflect", "replicate", "circular"}
_INTERP_MODES = {"nearest", "nearest-exact", "linear", "bilinear", "trilinear", "bicubic", "area"}


def _spatial_rank(low, v: Value) -> int:
    n = len(v.shape) - 1
    if n < 1:
        low.unsupported(f"a spatial op on a tensor of shape {list(v.shape)} (no spatial axis)")
    return n


# ------------------------------------------------------------------ padding


def pad(low, v: Value, pads, mode: str = "constant", value=None) -> Value:
    """F.pad: a selection (element moves, zeros read nothing)."""
    v = low.value(v)
    if mode not in _PAD_MODES:
        low.unsupported(f"padding mode '{mode}'")
    if mode == "constant" and isinstance(value, (int, float)) and value == -math.inf:
        return neg_inf_pad(low, v, [int(p) for p in pads])
    if mode == "constant" and value not in (None, 0, 0.0):
        low.unsupported(f"padding with the constant {value}: a fixed non-zero bias no parameter carries")
    pads = [int(p) for p in pads]
    batch_pads = pads[2 * len(v.shape):]  # (pairs from the last axis backwards: these reach the batch axis)
    if any(batch_pads):
        low.unsupported(f"F.pad(pad={pads}) pads or crops the batch axis ({batch_pads}): it changes the number of "
                        "samples or moves features between them, which no per-sample network computes")
    # (the ids carry a batch axis of 1: F.pad sees the rank the model's tensor has, and raises where torch would,
    # e.g. on more pairs than axes, or a reflect pad of 2 axes on a 2-d tensor)
    ids = torch.arange(1, math.prod(v.shape) + 1, dtype=torch.float64).reshape(1, *v.shape)
    try:
        out = F.pad(ids, pads, mode=mode) if mode != "constant" else F.pad(ids, pads, value=0.0)
    except (RuntimeError, NotImplementedError, ValueError) as err:
        low.unsupported(f"F.pad(mode='{mode}', pad={pads}) on shape {list(v.shape)}: {err}")
    index = out.reshape(-1).numpy().astype(np.int64) - 1
    return low.compose_selection([(low.selectable(v), index)], tuple(out.shape[1:]))


def neg_inf_pad(low, v: Value, pads: list[int]) -> NegInfPadded:
    """F.pad(v, pads, value=-inf) (``pads``: (before, after) pairs from the last axis back, torch's order), held
    for the max-pool that reads it. Only the spatial axes, by non-negative amounts."""
    n = _spatial_rank(low, v)
    pairs = [(pads[2 * i], pads[2 * i + 1]) for i in range(len(pads) // 2)]  # last axis first
    if any(a < 0 or b < 0 for a, b in pairs):
        low.unsupported(f"padding with -inf by negative amounts {pads} (a crop)")
    if any(a or b for a, b in pairs[n:]):
        low.unsupported(f"padding the channel or batch axis with -inf ({pads}): only a max-pool's spatial padding "
                        "is -inf")
    spatial = [(0, 0)] * n
    for i, pair in enumerate(pairs[:n]):
        spatial[n - 1 - i] = pair
    return NegInfPadded(v, tuple(spatial))


def max_pool_padded(low, v: NegInfPadded, kernel, stride, padding, dilation, ceil_mode):
    """A max-pool of an activation padded with -inf: one max-pool whose padding is the -inf padding plus its
    own (neither is ever selected); its output length checked against torch's on the padded shape."""
    base = low.value(v.value)
    n = len(base.shape) - 1
    src, pool = low._window(base, kernel, stride, padding, dilation, ceil_mode)
    merged = v.pool(pool)
    dummy = torch.zeros(1, 1, *base.shape[1:], dtype=torch.float64)
    flat = [x for lo, hi in reversed(v.pads) for x in (lo, hi)]
    try:
        ref = getattr(F, f"max_pool{n}d")(F.pad(dummy, flat, value=-math.inf), pool.kernel, pool.stride,
                                          tuple(p[0] for p in pool.padding), pool.dilation, pool.ceil_mode)
    except (RuntimeError, ValueError) as err:
        low.unsupported(f"a max-pool of an activation padded with -inf that torch cannot run here ({err})")
    if tuple(ref.shape[2:]) != tuple(merged.out_shape(low.b.shape(src))[1:]):
        low.unsupported(f"a max-pool ({pool.describe()}) of an activation padded with -inf {list(v.pads)}: its "
                        f"output length {list(ref.shape[2:])} is not that of one max-pool with both paddings")
    return low.max_pool_of(src, merged)


# ------------------------------------------------------------- resampling


def _per_axis(value, n: int, what: str, low) -> list | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            low.unsupported(f"{what} {list(value)} for {n} spatial axes")
        return list(value)
    return [value] * n


def axis_matrices(low, in_spatial, call, other: int = 2, tolerance: float = 0.0) -> tuple[np.ndarray, ...]:
    """Matrix of each axis d: ``call(basis, d)`` (d = None: every axis) on L_d one-hot signals along
    axis d, constant along the other axes (length ``other``: torch's antialiased
    kernels misread a length-1 axis), read back as (out_len, L_d). The op must
    leave them constant (it acts axis by axis), else it is refused; ``tolerance``: to within that much
    of the largest coefficient (a call that resamples the other axes too, in float32)."""
    n = len(in_spatial)
    mats = []
    for d, L in enumerate(in_spatial):
        shape = [1] * n
        shape[d] = L
        full = [other] * n
        full[d] = L
        basis = torch.eye(L, dtype=torch.float64).reshape(L, 1, *shape).expand(L, 1, *full).contiguous()
        try:
            out = call(basis, d)
        except (RuntimeError, NotImplementedError, ValueError) as err:
            low.unsupported(f"could not read the coefficients of axis {d}: {err}")
        first = out[(slice(None), slice(None)) + tuple(slice(None) if e == d else slice(0, 1) for e in range(n))]
        if tolerance == 0.0 or not out.numel():
            separable = torch.equal(out, first.expand_as(out))
        else:
            separable = bool(torch.isfinite(out).all()) and float((out - first.expand_as(out)).abs().max()) <= \
                tolerance * max(1.0, float(out.abs().max()))
        if not separable:
            low.unsupported(f"axis {d}: the op does not act axis by axis (not separable)")
        mats.append(first.reshape(L, -1).T.numpy().copy())
    return tuple(mats)


def adaptive_avg_pool(low, v: Value, out) -> Value:
    """Adaptive average pooling with uneven windows: per axis, torch's own window means."""
    n = len(out)

    def call(basis, d):
        return getattr(F, f"adaptive_avg_pool{n}d")(basis, tuple(o if e == d else 2 for e, o in enumerate(out)))

    return resampled(low, v, axis_matrices(low, v.shape[1:], call), "adaptive_avg")


def resampled(low, v: Value, mats, label: str) -> Value:
    m = Resample(mats, label)
    src = low.materialize(v)
    return Value([(src, m)], m.out_shape(low.b.shape(src)), None, low.label)


def interpolate(low, v: Value, size=None, scale_factor=None, mode="nearest", align_corners=None,
                recompute_scale_factor=None, antialias=False) -> Value:
    """F.interpolate / nn.Upsample: a Resample whose matrices are torch's own per axis."""
    v = low.value(v)
    n = _spatial_rank(low, v)
    if mode not in _INTERP_MODES:
        low.unsupported(f"interpolation mode '{mode}'")
    sizes = _per_axis(size, n, "size", low)
    scales = _per_axis(scale_factor, n, "scale_factor", low)
    if (sizes is None) == (scales is None):
        low.unsupported("interpolate needs exactly one of size and scale_factor")

    def call(basis, d):
        kw = dict(mode=mode, align_corners=align_corners, antialias=antialias)
        if sizes is not None:
            kw["size"] = tuple(int(sizes[e]) if d in (e, None) else 2 for e in range(n))
        else:
            kw["scale_factor"] = tuple(float(scales[e]) if d in (e, None) else 1.0 for e in range(n))
            kw["recompute_scale_factor"] = recompute_scale_factor
        if mode in ("nearest", "nearest-exact", "area"):
            kw.pop("align_corners")
            kw.pop("antialias")
        return F.interpolate(basis, **kw)

    if mode == "area":  # = adaptive average pooling to the output size (as torch.export writes it)
        with torch.no_grad():
            out = call(torch.zeros(1, 1, *v.shape[1:], dtype=torch.float64).expand(2, 1, *v.shape[1:]), None)
        return low.adaptive_avg_pool(v, tuple(out.shape[2:]))
    mats = axis_matrices(low, v.shape[1:], call)
    if all(a.shape[0] == a.shape[1] and np.array_equal(a, np.eye(a.shape[0])) for a in mats):
        return v
    return resampled(low, v, mats, mode.replace("-", "_"))


# ------------------------------------------------------------ fixed filters


def _separable(K: np.ndarray) -> list[np.ndarray] | None:
    """Per-axis vectors f_d with K = f_1 ⊗ ... ⊗ f_n, or None (rank above 1)."""
    if not np.any(K):
        return None
    m = np.unravel_index(np.argmax(np.abs(K)), K.shape)
    factors = []
    for d in range(K.ndim):
        sl = tuple(slice(None) if e == d else m[e] for e in range(K.ndim))
        f = K[sl].astype(np.float64)
        factors.append(f if d == 0 else f / K[m])
    outer = factors[0]
    for f in factors[1:]:
        outer = np.multiply.outer(outer, f)
    return factors if np.allclose(outer, K, rtol=1e-12, atol=1e-15 * np.abs(K).max()) else None


def fixed_conv(low, v: Value, weight: ParamTensor, bias, stride, padding, dilation, groups) -> Value:
    """A convolution with a fixed (buffer) kernel: one separable kernel shared by every channel of a
    depthwise convolution (anti-aliasing blur) is a Resample of per-axis 1-d convolutions; any
    other kernel (per-channel depthwise filters, dense filter banks, fixed random features) is a
    ``FixedConv`` edge holding the kernel: constant edges, never rescaled. A learnable bias (one entry
    per output channel) is the bias of its neurons; any other bias is refused."""
    v = low.value(v)
    W = f64(weight.tensor)
    if bias is not None and not (isinstance(bias, ParamTensor) and isinstance(bias.tensor, torch.nn.Parameter)
                                 and tuple(bias.tensor.shape) == (W.shape[0],)):
        low.unsupported("a convolution with a fixed kernel and a bias that is not a learnable parameter of one entry "
                        "per output channel: a fixed bias no parameter carries")
    out = _fixed_kernel(low, v, weight, W, stride, padding, dilation, groups)
    if bias is None:
        return out
    if out.bias is not None:
        out = Value.of_node(low.materialize(out), out.shape)
    b = low.widened(bias, (SourceRef(bias.name),), view=lambda x: x.reshape(-1))
    return Value(list(out.terms), out.shape, b, low.label)


def fixed_linear(low, v: Value, weight: ParamTensor, bias, transposed: bool = False) -> Value:
    """``F.linear(v, W, b)`` (``v @ W`` with ``transposed``) whose matrix W is a fixed (buffer)
    tensor: a 1x1 ``FixedConv`` over the last axis, the features (constant edges, never rescaled:
    the buffer stays as it is). A learnable bias per output feature is its neurons' bias."""
    v = low.value(v)
    t = weight.tensor.detach()
    if t.dim() != 2 or t.shape[0 if transposed else 1] != v.shape[-1] or len(v.shape) > 4:
        low.unsupported(f"the fixed (buffer) matrix '{weight.name}' of shape {list(t.shape)} on an activation of "
                        f"shape {list(v.shape)}")
    W = t.T if transposed else t
    n = max(len(v.shape) - 1, 1)  # a flat (F,) input is read as (F, 1)
    if len(v.shape) == 1:
        first = low.index_op(lambda x: x.unsqueeze(-1), [v])[0][0]
    else:
        first = low.index_op(lambda x: x.movedim(-1, 1), [v])[0][0]  # (F, *S)
    kernel = ParamTensor(weight.name, W.reshape(*W.shape, *([1] * n)), "buffer")
    out = fixed_conv(low, first, kernel, bias, 1, 0, 1, 1)
    if len(v.shape) == 1:
        return low.index_op(lambda x: x.squeeze(-1), [out])[0][0]
    return low.index_op(lambda x: x.movedim(1, -1), [out])[0][0]


def fixed_left_matmul(low, weight: ParamTensor, v: Value) -> Value:
    """``A @ v`` with A an (M, N) fixed (buffer) matrix and v of at least two axes per sample, N its second-to-last:
    ``fixed_linear`` on v with its last two axes swapped, swapped back (constant edges, never rescaled)."""
    v = low.value(v)
    t = weight.tensor
    if t.dim() != 2 or len(v.shape) < 2 or t.shape[1] != v.shape[-2]:
        low.unsupported(f"the fixed (buffer) matrix '{weight.name}' of shape {list(t.shape)} times an activation of "
                        f"shape {list(v.shape)}: A @ x needs A of shape (M, N) and x of shape (..., N, F) per sample")
    return over_rows(low, v, lambda swapped: fixed_linear(low, swapped, weight, None))


def _fixed_kernel(low, v: Value, weight: ParamTensor, W: np.ndarray, stride, padding, dilation, groups) -> Value:
    C, n, g = v.shape[0], W.ndim - 2, int(groups)
    if n != len(v.shape) - 1 or C != W.shape[1] * g or W.shape[0] % g:
        low.unsupported(f"the fixed (buffer) kernel '{weight.name}' of shape {list(W.shape)} (groups={g}) on an "
                        f"input of shape {list(v.shape)}")
    if not np.all(np.isfinite(W)):
        low.unsupported(f"the fixed (buffer) kernel '{weight.name}' has non-finite entries")
    st, dil = _ints(stride, n), _ints(dilation, n)
    pads = _conv_pads(low, padding, W.shape[2:], st, dil)
    factors = _separable(W[0, 0]) if g == C == W.shape[0] and W.shape[1] == 1 and np.all(W == W[:1]) else None
    if factors is None:
        m = FixedConv(W, st, pads, dil, g, "fixed_conv")
        src = low.materialize(v)
        return Value([(src, m)], m.out_shape(low.b.shape(src)), None, low.label)

    def call(basis, d):
        k = torch.as_tensor(factors[d], dtype=torch.float64).reshape(1, 1, -1)
        flat = basis.reshape(basis.shape[0], 1, -1)
        out = F.conv1d(F.pad(flat, pads[d]), k, None, st[d], 0, dil[d])
        return out.reshape(basis.shape[0], 1, *([1] * d + [-1] + [1] * (n - d - 1)))

    return resampled(low, v, axis_matrices(low, v.shape[1:], call, other=1), "fixed_filter")


def _conv_pads(low, padding, kernel, stride, dilation) -> tuple[tuple[int, int], ...]:
    """(before, after) per spatial axis of a convolution's ``padding`` (ints, 'valid' or 'same')."""
    n = len(kernel)
    if padding == "valid":
        return ((0, 0),) * n
    if padding == "same":
        if any(s != 1 for s in stride):
            low.unsupported("padding='same' with a stride (torch refuses it too)")
        total = [d * (k - 1) for k, d in zip(kernel, dilation)]
        return tuple((t // 2, t - t // 2) for t in total)
    if isinstance(padding, str):
        low.unsupported(f"padding '{padding}' with a fixed kernel")
    return tuple((p, p) for p in _ints(padding, n))


def _ints(x, n: int) -> tuple[int, ...]:
    if isinstance(x, (list, tuple)):
        return tuple(int(e) for e in x) if len(x) == n else tuple(int(x[0]) for _ in range(n))
    return tuple(int(x) for _ in range(n))
