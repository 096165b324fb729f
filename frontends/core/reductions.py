"""Reductions, elementwise max and constant masks on the lowering core's Values (docs/math.md §1),
shared by the torch and ONNX rules:

- ``sum`` / ``mean`` over any non-batch axes: a fixed linear map, every reduced element one edge
  of weight 1 (sum) or 1/R (mean, R elements per output); ``max`` over them: a max-pool neuron
  (k = 1). The reduced axes are moved last and flattened to one axis of length R (index ops, no new
  neuron), pooled with one window of R, and reshaped to the op's output shape (keepdim or not).
  A reduction over the batch axis is refused;
- the elementwise max of activations: a max-pool neuron (k = 1) over them, stacked on a new last
  axis (fixed selection edges into an identity node);
- ``where(mask, a, b)`` with a constant bool mask, each branch an activation or 0: a fixed factor
  0 / 1 per element on each branch.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pathir.frontends.core.fixed_factors import fixed_scale
from pathir.frontends.core.values import ParamTensor, Value, f64, zero_constant
from pathir.ir import Pool

__all__ = ["reduce", "all_spatial", "elementwise_max", "reduce_stacking_axis", "where"]


def reduce(low, x, dims, keepdim: bool, kind: str) -> Value:
    """``kind`` ∈ {sum, mean, max} of the activation ``x`` over the axes ``dims`` (with the batch axis
    counted, as torch does): sum / mean a fixed edge per element, max a max-pool neuron."""
    v = low.value(x)
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


def all_spatial(v: Value, dims) -> bool:
    """dims (the batch axis counted) are exactly every spatial axis of v: a global pool."""
    nd = len(v.shape) + 1
    if dims is None:
        return False
    return sorted({int(d) % nd for d in ((dims,) if isinstance(dims, int) else dims)}) == list(range(2, nd))


def elementwise_max(low, values) -> Value:
    """Elementwise max of activations: a max-pool neuron over them (stacked on a new last axis)."""
    values = [low.value(v) for v in values]
    if len({v.shape for v in values}) != 1:
        low.unsupported("elementwise max of activations of different shapes (broadcasting)")
    if not tuple(values[0].shape):  # one number per sample each: as (1,), their max there, back to ()
        columns = [low.index_op(lambda t: t.unsqueeze(-1), [v])[0][0] for v in values]
        return low.index_op(lambda t: t.squeeze(-1), [elementwise_max(low, columns)])[0][0]
    k = len(values)
    stacked = low.index_op(lambda *ts: torch.stack(ts, dim=-1), values)[0][0]
    n = len(stacked.shape) - 1
    window = (1,) * (n - 1) + (k,)
    pool = Pool(window, window, ((0, 0),) * n, (1,) * n, False)
    src = low.materialize(stacked)
    name = low.b.maxpool(low.label, src, pool, origin=getattr(low, "where", ""))
    pooled = Value.of_node(name, low.b.shape(name))
    return low.index_op(lambda t: t.squeeze(-1), [pooled])[0][0]


def reduce_stacking_axis(low, values: list, axes: list[int], kind: str) -> Value:
    """``kind`` ∈ {sum, mean, max} over ``axes`` (sorted, with 0 and without 1) of activations of one shape stacked
    on axis 0, the batch on axis 1 (``torch.stack(values, dim=0)``): their sum, their sum times 1/k (a fixed factor)
    or their elementwise max (a max-pool neuron), then reduced over the sample axes among ``axes``."""
    if kind == "max":
        out = values[0] if len(values) == 1 else elementwise_max(low, values)
    else:
        out = values[0]
        for v in values[1:]:
            out = low.add(out, v)
        if kind == "mean" and len(values) > 1:
            out = fixed_scale(low, out, 1.0 / len(values))
    rest = [a - 1 for a in axes if a != 0]  # the sample's axes, counted with the batch first again
    return reduce(low, out, rest, False, kind) if rest else out


def _const_mask(mask):
    m = mask.tensor if isinstance(mask, ParamTensor) else mask
    if isinstance(m, np.ndarray):
        m = torch.from_numpy(np.array(m))  # (a copy: an ONNX initializer's array is read-only)
    return m if isinstance(m, torch.Tensor) and m.dtype == torch.bool else None


def where(low, cond, a, b):
    """``where(cond, a, b)`` with a constant bool ``cond``: a·[cond] + b·[¬cond], each branch an
    activation (a fixed 0 / 1 factor per element) or the constant 0 (no edge)."""
    if isinstance(cond, Value):
        low.unsupported("selects by a mask computed from an activation (a comparison): not a fixed map")
    m = _const_mask(cond)
    if m is None:
        low.unsupported("selects by a mask that is not a constant bool tensor (a buffer or a constant)")
    keep = f64(m)
    terms = []
    for branch, factor in ((a, keep), (b, 1.0 - keep)):
        if isinstance(branch, Value):
            if np.any(factor):
                terms.append(fixed_scale(low, branch, factor))
        elif not zero_constant(branch):
            low.unsupported("selects a non-zero constant where the mask says so: a fixed non-zero bias breaks the "
                            "rescaling symmetry")
    if not terms:
        low.unsupported("the mask selects no element of any activation")
    out = terms[0]
    for t in terms[1:]:
        out = low.add(out, t)
    return out
