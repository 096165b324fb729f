"""A constant factor on an activation, c · v, as fixed-weight edges (never rescaled): a number, or
a constant tensor with one factor per channel, position or element (a factor 0 is no edge)."""

from __future__ import annotations

import numpy as np

from pathir.frontends.core.values import Value
from pathir.ir import Pool, SpatialMatrix

__all__ = ["fixed_scale"]


def fixed_scale(low, v: Value, c) -> Value:
    """c · v with c a constant: a fixed-weight edge. c is a number, or a constant tensor that
    broadcasts to v's per-sample shape without changing it (one factor per channel, per position
    or per element; a leading batch axis of length 1 allowed): a 1-window Pool whose multiplier
    holds the factors (a factor 0 is no edge)."""
    v = low.value(v)
    if not tuple(v.shape):  # one number per sample (``h[:, 0]``): as (1,), scaled there, back to ()
        column = low.index_op(lambda t: t.unsqueeze(-1), [v])[0][0]
        scaled = fixed_scale(low, column, np.reshape(c, (1,)) if np.ndim(c) else c)
        return low.index_op(lambda t: t.squeeze(-1), [scaled])[0][0]
    if np.ndim(c):
        return _fixed_tensor_scale(low, v, np.asarray(c, dtype=np.float64))
    c = float(c)
    if c == 1.0:
        return v
    if c == 0.0 or not np.isfinite(c):
        low.unsupported(f"multiplies an activation by the constant {c}: a zero or non-finite edge")
    src = low.materialize(v)
    shape = low.b.shape(src)
    spatial = tuple(shape[1:])
    if spatial:
        n = len(spatial)
        m = Pool((1,) * n, (1,) * n, ((0, 0),) * n, (1,) * n, False, np.full(spatial, c))
    else:
        m = SpatialMatrix(np.array([[c]]), ())
    return Value([(src, m)], m.out_shape(shape), None, low.label)


def _fixed_tensor_scale(low, v: Value, c: np.ndarray) -> Value:
    shape = tuple(v.shape)
    if c.ndim > len(shape) + 1:
        low.unsupported(f"multiplies an activation of rank {len(shape) + 1} (batch included) by a constant of shape "
                        f"{list(c.shape)}: broadcasting adds {c.ndim - len(shape) - 1} leading axes, so the batch axis "
                        "is no longer first")
    if c.ndim == len(shape) + 1 and c.shape[0] == 1:
        c = c.reshape(c.shape[1:])  # the batch axis, length 1
    try:
        full = np.broadcast_to(c, shape) if c.ndim <= len(shape) else None
    except ValueError:
        full = None
    if full is None:
        low.unsupported(f"multiplies an activation of per-sample shape {list(shape)} by a constant of shape "
                        f"{list(c.shape)}: it does not broadcast to one factor per element of the activation (it "
                        "changes the shape or varies over the batch)")
    if not np.all(np.isfinite(full)):
        low.unsupported("multiplies an activation by a constant with non-finite entries")
    if np.all(full == full.reshape(-1)[0]):
        return fixed_scale(low, v, float(full.reshape(-1)[0]))
    if len(shape) == 1:  # a flat (C,) tensor: as (C, 1), a 1-window Pool, back to (C,)
        column = low.index_op(lambda t: t.unsqueeze(-1), [v])[0][0]
        scaled = fixed_scale(low, column, full.reshape(-1, 1))
        return low.index_op(lambda t: t.squeeze(-1), [scaled])[0][0]
    n = len(shape) - 1
    per_channel = not np.all(full == full[:1])
    mult = np.array(full if per_channel else full[0], dtype=np.float64)
    src = low.materialize(v)
    m = Pool((1,) * n, (1,) * n, ((0, 0),) * n, (1,) * n, False, mult)
    return Value([(src, m)], m.out_shape(low.b.shape(src)), None, low.label)
