"""Reductions and ReLU spellings inside the ReLU DAG model (docs/math.md §1), on the lowering
core's Values:

- ``sum`` / ``mean`` over any non-batch axes: a fixed linear map, every reduced element one edge
  of weight 1 (sum) or 1/R (mean, R elements per output); the mean over all spatial axes stays the
  core's global average pool;
- ``amax`` / ``max(dim).values`` over non-batch axes, ``F.adaptive_max_pool{1,2}d`` /
  ``nn.AdaptiveMaxPool{1,2}d`` whose output size divides the input: max-pool neurons (k = 1);
- ``F.hardtanh(x, 0, inf)`` / ``nn.Hardtanh(0, inf)``: a ReLU;
- ``x.masked_fill(mask, 0)`` and ``torch.where(mask, a, b)`` with a constant bool mask (a buffer or
  a constant), each branch an activation or 0: a fixed factor 0 / 1 per element on each branch.

A reduction is lowered by moving the reduced axes last, flattening them to one axis of length R
(index ops, no new neuron), and pooling that axis with one window of R; the result is reshaped to
torch's output shape (keepdim or not). A reduction over the batch axis is refused.
"""

from __future__ import annotations

import collections
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from pathir.frontends.fixed_factors import fixed_scale
from pathir.frontends.values import NOT_MINE, ParamTensor, Value
from pathir.ir import Pool

__all__ = ["reduce", "lower_function", "lower_method", "lower_module"]

MaxResult = collections.namedtuple("MaxResult", ["values", "indices"])  # torch.return_types.max, indices unusable


def reduce(low, x, dims, keepdim: bool, kind: str) -> Value:
    """``kind`` ∈ {sum, mean, max} of the activation ``x`` over the axes ``dims`` (with the batch axis
    counted, as torch does): sum / mean a fixed edge per element, max a max-pool neuron."""
    v = low._value(x)
    nd = len(v.shape) + 1
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        low.unsupported(f"{kind} over every axis, the batch axis included: it mixes the samples of a batch")
    red = sorted({int(d) % nd for d in ((dims,) if isinstance(dims, int) else dims)})
    if 0 in red:
        low.unsupported(f"{kind} over the batch axis: it mixes the samples of a batch")
    keep = [a for a in range(1, nd) if a not in red]
    R = math.prod(v.shape[a - 1] for a in red)
    K = math.prod(v.shape[a - 1] for a in keep)
    out_shape = tuple(1 if a in red else v.shape[a - 1] for a in range(1, nd)) if keepdim else \
        tuple(v.shape[a - 1] for a in keep)
    if not out_shape:
        low.unsupported(f"{kind} over every axis of a sample gives one number per sample (shape [batch]); "
                        "keep an axis (keepdim=True) or end the network on a (batch, n) tensor")
    perm = [0, *keep, *red]
    rows = low.index_op(lambda t: t.permute(perm).reshape(t.shape[0], K, R), [v])[0][0]
    src = low.materialize(rows)
    if kind == "max":
        name = low.b.maxpool(low.label, src, Pool((R,), (R,), ((0, 0),), (1,), False), origin=getattr(low, "where", ""))
        pooled = Value.of_node(name, low.b.shape(name))
    else:
        pool = Pool((R,), (R,), ((0, 0),), (1,), False, np.full((1,), 1.0 if kind == "sum" else 1.0 / R))
        pooled = Value([(src, pool)], pool.out_shape(low.b.shape(src)), None, low.label)
    return low.index_op(lambda t: t.reshape(t.shape[0], *out_shape), [pooled])[0][0]


def _dims_keep(args, kwargs):
    """(dims, keepdim) of a reduction call; numpy's spellings ``axis`` / ``keepdims`` too."""
    dims = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis"))
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", kwargs.get("keepdims", False))
    return dims, bool(keepdim)


def all_spatial(v: Value, dims) -> bool:
    """dims (the batch axis counted) are exactly every spatial axis of v: a global pool."""
    nd = len(v.shape) + 1
    if dims is None:
        return False
    return sorted({int(d) % nd for d in ((dims,) if isinstance(dims, int) else dims)}) == list(range(2, nd))


def _reduction(low, kind, args, kwargs):
    x = args[0]
    if not isinstance(x, Value):
        return NOT_MINE
    dims, keepdim = _dims_keep(args, kwargs)
    if kwargs.get("dtype") is not None:
        low.unsupported(f"{kind} with a dtype argument (a cast)")
    if kind == "mean" and all_spatial(x, dims):
        return NOT_MINE  # the core's global average pool
    if kind == "max":
        if dims is not None and not isinstance(dims, int):
            return NOT_MINE
        return MaxResult(reduce(low, x, dims, keepdim, "max"), None)
    return reduce(low, x, dims, keepdim, kind)


def _adaptive_max_pool(low, x, output_size, return_indices=False):
    v = low._value(x)
    n = len(v.shape) - 1
    sizes = output_size if isinstance(output_size, (tuple, list)) else (output_size,) * n
    out = tuple(v.shape[1 + i] if o is None else int(o) for i, o in enumerate(sizes))
    if return_indices:
        low.unsupported("adaptive max-pool with return_indices: the indices are not a fixed map")
    if not all(L % o == 0 for L, o in zip(v.shape[1:], out)):
        low.unsupported(f"adaptive max-pool from {list(v.shape[1:])} to {list(out)}: the windows overlap and "
                        "differ in size (only an output size dividing the input is lowered, a plain max-pool)")
    k = tuple(L // o for L, o in zip(v.shape[1:], out))
    return low.max_pool(v, k, k, 0, 1, False)


def _is_relu_hardtanh(lo, hi) -> bool:
    return lo == 0 and hi == math.inf


def _const_mask(mask):
    m = mask.tensor if isinstance(mask, ParamTensor) else mask
    if isinstance(m, np.ndarray):
        m = torch.from_numpy(m)
    return m if isinstance(m, torch.Tensor) and m.dtype == torch.bool else None


def _is_zero_const(c) -> bool:
    t = c.tensor if isinstance(c, ParamTensor) else c
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        return t == 0
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(t)
    return isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and bool((t == 0).all())


def where(low, cond, a, b):
    """``where(cond, a, b)`` with a constant bool ``cond``: a·[cond] + b·[¬cond], each branch an
    activation (a fixed 0 / 1 factor per element) or the constant 0 (no edge)."""
    if isinstance(cond, Value):
        low.unsupported("selects by a mask computed from an activation (a comparison): not a fixed map")
    m = _const_mask(cond)
    if m is None:
        return NOT_MINE
    keep = m.detach().to("cpu", torch.float64).numpy()
    terms = []
    for branch, factor in ((a, keep), (b, 1.0 - keep)):
        if isinstance(branch, Value):
            if np.any(factor):
                terms.append(fixed_scale(low, branch, factor))
        elif not _is_zero_const(branch):
            low.unsupported("selects a non-zero constant where the mask says so: a fixed non-zero bias breaks the "
                            "rescaling symmetry")
    if not terms:
        low.unsupported("the mask selects no element of any activation")
    out = terms[0]
    for t in terms[1:]:
        out = low.add(out, t)
    return out


def _masked_fill(low, x, mask, value):
    """x.masked_fill(mask, value) = where(mask, value, x)."""
    return where(low, mask, value, x) if isinstance(x, Value) else NOT_MINE


_FUNCS = {torch.sum: "sum", torch.mean: "mean", torch.amax: "max", torch.max: "max"}


def lower_function(low, fn, args, kwargs):
    """A call_function of this module's ops, or NOT_MINE."""
    if fn in _FUNCS and args and isinstance(args[0], Value) and not (len(args) > 1 and isinstance(args[1], Value)):
        return _reduction(low, _FUNCS[fn], args, kwargs) if fn is not torch.amax else \
            reduce(low, args[0], *_dims_keep(args, kwargs), "max")
    if fn in (F.adaptive_max_pool1d, F.adaptive_max_pool2d):
        rest = list(args[1:]) + [kwargs.get("output_size")] * (len(args) < 2)
        return _adaptive_max_pool(low, args[0], rest[0], (list(args[2:]) + [kwargs.get("return_indices", False)])[0])
    if fn in (F.hardtanh, torch.nn.functional.hardtanh_):
        lo = args[1] if len(args) > 1 else kwargs.get("min_val", -1.0)
        hi = args[2] if len(args) > 2 else kwargs.get("max_val", 1.0)
        return low.relu(args[0]) if _is_relu_hardtanh(lo, hi) else NOT_MINE
    if fn is torch.masked_fill:
        return _masked_fill(low, *args[:3], **kwargs)
    if fn is torch.where and len(args) + len(kwargs) == 3:
        return where(low, *args[:3], **kwargs)
    return NOT_MINE


_METHODS = {"sum": "sum", "mean": "mean", "amax": "max", "max": "max"}


def lower_method(low, name, args, kwargs):
    """A call_method of this module's ops, or NOT_MINE."""
    if name in _METHODS and not (len(args) > 1 and isinstance(args[1], Value)):
        if name == "amax":
            return reduce(low, args[0], *_dims_keep(args, kwargs), "max")
        return _reduction(low, _METHODS[name], args, kwargs)
    if name in ("masked_fill", "masked_fill_"):
        return _masked_fill(low, *args[:3], **kwargs)
    if name == "where":  # x.where(cond, y) = where(cond, x, y)
        return where(low, args[1], args[0], args[2] if len(args) > 2 else kwargs.get("other"))
    return NOT_MINE


def lower_module(low, mod, args):
    """A call_module of this module's layers, or NOT_MINE."""
    if isinstance(mod, (nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d)):
        return _adaptive_max_pool(low, args[0], mod.output_size, mod.return_indices)
    if isinstance(mod, nn.Hardtanh) and not isinstance(mod, nn.ReLU6) and _is_relu_hardtanh(mod.min_val, mod.max_val):
        return low.relu(args[0])
    return NOT_MINE
