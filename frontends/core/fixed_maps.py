"""Fixed-coefficient linear maps on the lowering core's Values: padding, resampling and fixed
(buffer) filters, shared by the torch rules and ONNX's Pad and Resize.

Invariants kept:

- padding (every mode) moves elements without computing:
  they become pending selection maps (``Gather``, or a more specific one),
  composed with the selections already pending, exactly as ``index_op`` does;
  zero padding positions read nothing (index -1: no edge);
- resampling (interpolate in every mode) and separable fixed filters become one
  ``Resample`` edge whose per-axis matrices are read off *torch's own op* on
  one-hot inputs along that axis, so the coefficients are torch's, bit for bit;
- a non-zero pad value is refused: it is a fixed bias no parameter carries.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from pathir.frontends.core.values import ParamTensor, Value
from pathir.ir import Resample

__all__ = ["pad", "interpolate", "adaptive_avg_pool", "fixed_conv", "axis_matrices", "resampled"]

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
    if mode == "constant" and value not in (None, 0, 0.0):
        low.unsupported(f"padding with the constant {value}: a fixed non-zero bias no parameter carries")
    pads = [int(p) for p in pads]
    ids = torch.arange(1, math.prod(v.shape) + 1, dtype=torch.float64).reshape(1, *v.shape)
    try:
        out = F.pad(ids, pads, mode=mode) if mode != "constant" else F.pad(ids, pads, value=0.0)
    except (RuntimeError, NotImplementedError, ValueError) as err:
        low.unsupported(f"F.pad(mode='{mode}', pad={pads}) on shape {list(v.shape)}: {err}")
    index = out.reshape(-1).numpy().astype(np.int64) - 1
    return low.compose_selection([(low.selectable(v), index)], tuple(out.shape[1:]))


# ------------------------------------------------------------- resampling


def _per_axis(value, n: int, what: str, low) -> list | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            low.unsupported(f"{what} {list(value)} for {n} spatial axes")
        return list(value)
    return [value] * n


def axis_matrices(low, in_spatial, call, other: int = 2) -> tuple[np.ndarray, ...]:
    """Matrix of each axis d: ``call(basis, d)`` (d = None: every axis) on L_d one-hot signals along
    axis d, constant along the other axes (length ``other``: torch's antialiased
    kernels misread a length-1 axis), read back as (out_len, L_d). The op must
    leave them constant (it acts axis by axis), else it is refused."""
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
        if not torch.equal(out, first.expand_as(out)):
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
    """A depthwise convolution with a fixed (buffer) kernel shared by every channel and
    separable (anti-aliasing blur filters): a Resample of per-axis 1-d convolutions."""
    v = low.value(v)
    if bias is not None:
        low.unsupported("a convolution with a fixed kernel and a bias: a fixed bias no parameter carries")
    W = weight.tensor.detach().to("cpu", torch.float64).numpy()
    C, n = v.shape[0], W.ndim - 2
    if not (int(groups) == C == W.shape[0] and W.shape[1] == 1 and np.all(W == W[:1])):
        low.unsupported(f"a convolution with the fixed (buffer) kernel '{weight.name}' that is not one "
                        "depthwise kernel shared by every channel: not lowered")
    factors = _separable(W[0, 0])
    if factors is None:
        low.unsupported(f"the fixed (buffer) kernel '{weight.name}' is not separable: not lowered")
    st, dil = _ints(stride, n), _ints(dilation, n)
    pads = _ints(padding, n) if not isinstance(padding, str) else None
    if pads is None:
        low.unsupported(f"padding '{padding}' with a fixed kernel")

    def call(basis, d):
        k = torch.as_tensor(factors[d], dtype=torch.float64).reshape(1, 1, -1)
        flat = basis.reshape(basis.shape[0], 1, -1)
        return F.conv1d(flat, k, None, st[d], pads[d], dil[d]).reshape(basis.shape[0], 1, *(
            [1] * d + [-1] + [1] * (n - d - 1)))

    return resampled(low, v, axis_matrices(low, v.shape[1:], call, other=1), "fixed_filter")


def _ints(x, n: int) -> tuple[int, ...]:
    if isinstance(x, (list, tuple)):
        return tuple(int(e) for e in x) if len(x) == n else tuple(int(x[0]) for _ in range(n))
    return tuple(int(x) for _ in range(n))
