"""Rules for pooling, means, sums, maxima over axes, and constant masks.

Max-pools are max-pool neurons; average pools, adaptive average pools and the mean over every
spatial axis are fixed window maps; ``sum`` / ``mean`` / ``amax`` / ``max(dim)`` over other axes
go through :func:`..core.reductions.reduce`; an adaptive max-pool whose output size divides the
input is a plain max-pool, and one whose output size is a multiple of it nearest upsampling;
``where`` / ``masked_fill`` with a constant bool mask are fixed 0 / 1 factors
(:func:`..core.reductions.where`). A pool reads its activation as torch does, a batched tensor of one
spatial axis fewer as one unbatched sample (:func:`_per_sample`).
"""

from __future__ import annotations

import collections
import re

import torch

from pathir.frontends.core.reductions import all_spatial, reduce, where
from pathir.frontends.core.values import BatchStacked, MaxIndices, NegInfPadded, ParamTensor, Value
from pathir.frontends.torch.arithmetic import maximum
from pathir.frontends.torch.batch_stack import reads_batch_stacked, reduce_stacked
from pathir.frontends.torch.why import refuse

__all__ = ["max_pool", "max_pool_module", "max_pool_with_indices", "avg_pool", "avg_pool_module",
           "adaptive_avg_pool", "adaptive_avg_pool_module", "adaptive_max_pool", "adaptive_max_pool_module",
           "adaptive_max_pool_aten", "mean", "sum_", "amax", "max_", "where_", "where_method", "masked_fill"]

MaxResult = collections.namedtuple("MaxResult", ["values", "indices"])  # torch.return_types.max, indices unusable


def _pool_dims(low, mod=None) -> int | None:
    """The number of spatial axes the pool op reads (the d of max_pool2d, nn.AdaptiveAvgPool3d, ...): from the
    module's torch class (a subclass's own name says nothing), else the op's name; None where neither says."""
    names = [c.__name__ for c in type(mod).__mro__] if mod is not None else [str(low.op)]
    for name in names:
        found = re.search(r"pool(\d)d", name, re.IGNORECASE)
        if found:
            return int(found.group(1))
    return None


def _per_sample(low, input, d: int | None, pool):
    """``pool(value)`` on the activation ``input`` read as torch reads it: with d spatial axes after its
    channels; with d axes in all (one fewer: a (batch, C, L) tensor given to a 2-d pool), torch takes it as one
    unbatched image whose channels are the batch, so each sample's C and L are pooled together: lowered as a
    single channel added in front (element moves), pooled, and taken off again. ``pool`` may return (values,
    indices)."""
    padded = input if isinstance(input, NegInfPadded) else None  # (F.pad(h, ..., value=-inf) for a max-pool)
    v = low.value(padded.value if padded is not None else input) if isinstance(input, (Value, NegInfPadded)) else input
    if d is not None and isinstance(v, Value) and len(v.shape) not in (d, d + 1):
        low.unsupported(f"a {d}-d pool of a {len(v.shape) + 1}-d activation (batch included): torch takes "
                        f"{d + 1}-d or {d + 2}-d input only, and raises on this one")
    if d is None or not isinstance(v, Value) or len(v.shape) != d:
        return pool(input)
    one = low.index_op(lambda t: t.unsqueeze(1), [v])[0][0]
    # (padded: the new first spatial axis, the old channel axis, has no -inf padding: F.pad padded the last axes)
    out = pool(one if padded is None else NegInfPadded(one, ((0, 0), *padded.pads)))
    values, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
    values = low.index_op(lambda t: t.squeeze(1), [values])[0][0]
    return (values, *rest) if rest is not None else values


def max_pool(low, input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False,
             _d=None):
    """A max-pool; with ``return_indices``, (values, indices) whose indices no op may read (:class:`MaxIndices`)."""
    out = _per_sample(low, input, _pool_dims(low) if _d is None else _d,
                      lambda v: low.max_pool(v, kernel_size, stride, padding, dilation, ceil_mode))
    return (out, MaxIndices("max-pool")) if return_indices else out


def max_pool_module(low, mod, input):
    return max_pool(low, input, mod.kernel_size, mod.stride, mod.padding, mod.dilation, mod.ceil_mode,
                    mod.return_indices, _d=_pool_dims(low, mod))


def max_pool_with_indices(low, input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
                          return_indices=True):
    """ATen's (or torch.nn.functional's) max-pool with indices: the pooled values, and indices no op may read."""
    return max_pool(low, input, kernel_size, stride, padding, dilation, ceil_mode), MaxIndices("max-pool")


for _rule in (max_pool, max_pool_module, max_pool_with_indices):
    _rule.reads_neg_inf_padding = True  # TF-"same" pooling: F.pad(x, ..., value=-inf) then the pool


def avg_pool(low, input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
             divisor_override=None, _d=None):
    return _per_sample(low, input, _pool_dims(low) if _d is None else _d, lambda v: low.avg_pool(
        v, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override))


def avg_pool_module(low, mod, input):
    return avg_pool(low, input, mod.kernel_size, mod.stride, mod.padding, mod.ceil_mode, mod.count_include_pad,
                    getattr(mod, "divisor_override", None), _d=_pool_dims(low, mod))


def adaptive_avg_pool(low, input, output_size, _d=None):
    return _per_sample(low, input, _pool_dims(low) if _d is None else _d, lambda v: low.adaptive_avg_pool(v, output_size))


def adaptive_avg_pool_module(low, mod, input):
    return adaptive_avg_pool(low, input, mod.output_size, _d=_pool_dims(low, mod))


def _adaptive_windows(L: int, o: int) -> list[tuple[int, int]]:
    """torch's adaptive pooling windows over an axis of L positions into o: [⌊iL/o⌋, ⌈(i+1)L/o⌉)."""
    return [(i * L // o, -(-(i + 1) * L // o)) for i in range(o)]


def adaptive_max_pool(low, input, output_size, return_indices=False, _d=None):
    """An adaptive max-pool (of the activation as torch reads it: :func:`_per_sample`) whose windows along each
    axis all hold one number of positions: k where the output size divides the input (a plain max-pool), 1 where
    it is a multiple of it (nearest upsampling: element moves, no max). Windows of two sizes along one axis are
    refused."""
    out = _per_sample(low, input, _pool_dims(low) if _d is None else _d, lambda v: _adaptive_max(low, v, output_size))
    return (out, MaxIndices("adaptive max-pool")) if return_indices else out


def _adaptive_max(low, v, output_size):
    v = low.value(v)
    n = len(v.shape) - 1
    sizes = output_size if isinstance(output_size, (tuple, list)) else (output_size,) * n
    if len(sizes) != n:
        low.unsupported(f"adaptive max-pool to {list(sizes)} of an activation with {n} spatial axes {list(v.shape[1:])}")
    out = tuple(v.shape[1 + i] if o is None else int(o) for i, o in enumerate(sizes))
    kernel, picks = [], {}
    for axis, (L, o) in enumerate(zip(v.shape[1:], out)):
        windows = _adaptive_windows(L, o)
        held = sorted({e - s for s, e in windows})
        if len(held) == 1 and held != [1] and any(s != i * held[0] for i, (s, _) in enumerate(windows)):
            low.unsupported(f"adaptive max-pool from {list(v.shape[1:])} to {list(out)}: along spatial axis {axis} its "
                            f"windows of {held[0]} positions overlap, not one stride apart (only output sizes that "
                            "divide the input or are a multiple of it are lowered)")
        if len(held) > 1:
            low.unsupported(f"adaptive max-pool from {list(v.shape[1:])} to {list(out)}: along spatial axis {axis} its "
                            f"windows hold {' or '.join(map(str, held))} positions, a max-pool neuron's windows one "
                            "number (only output sizes that divide the input or are a multiple of it are lowered)")
        if held == [1] and o != L:
            picks[axis + 2] = torch.tensor([s for s, _ in windows])  # nearest upsampling: element moves
        kernel.append(held[0] if held else 1)
    for dim, index in picks.items():  # (the ids carry the batch axis first)
        v = low.index_op(lambda t, dim=dim, index=index: t.index_select(dim, index), [v])[0][0]
    k = tuple(1 if axis + 2 in picks else size for axis, size in enumerate(kernel))
    return v if all(size == 1 for size in k) else low.max_pool(v, k, k, 0, 1, False)


def adaptive_max_pool_with_indices(low, input, output_size, return_indices=True):
    """``F.adaptive_max_pool2d(..., return_indices=True)`` (traced as its ``_with_indices`` form): the values and
    indices no graph holds."""
    return adaptive_max_pool(low, input, output_size, return_indices=True)


def adaptive_max_pool_module(low, mod, input):
    return adaptive_max_pool(low, input, mod.output_size, mod.return_indices, _d=_pool_dims(low, mod))


def adaptive_max_pool_aten(low, input, output_size):
    return adaptive_max_pool(low, input, output_size, return_indices=True)


def _dims(dim, axis):
    return dim if dim is not None else axis


def mean(low, input, dim=None, keepdim=False, *, dtype=None, axis=None, keepdims=None):
    """The mean over every spatial axis is the global average pool; over other non-batch axes a
    fixed reduction."""
    dims, keep = _dims(dim, axis), bool(keepdim if keepdims is None else keepdims)
    if dtype is not None:
        low.unsupported("mean with a dtype argument (a cast)")
    if isinstance(input, BatchStacked):
        return reduce_stacked(low, input, dims, keep, "mean")
    v = low.value(input)
    if dims is None or all_spatial(v, dims):  # the global average pool (over every axis: refused there)
        return low.mean(v, dims if dims is not None else list(range(len(v.shape) + 1)), keep)
    return reduce(low, v, dims, keep, "mean")


def sum_(low, input, dim=None, keepdim=False, *, dtype=None, axis=None, keepdims=None):
    if dtype is not None:
        low.unsupported("sum with a dtype argument (a cast)")
    return _reduce(low, input, _dims(dim, axis), bool(keepdim if keepdims is None else keepdims), "sum")


def amax(low, input, dim=(), keepdim=False, *, axis=None, keepdims=None):
    return _reduce(low, input, _dims(dim, axis), bool(keepdim if keepdims is None else keepdims), "max")


def _reduce(low, input, dims, keep: bool, kind: str):
    """:func:`..core.reductions.reduce`, or over dim 0 of a stack of activations (:mod:`.batch_stack`)."""
    if isinstance(input, BatchStacked):
        return reduce_stacked(low, input, dims, keep, kind)
    return reduce(low, input, dims, keep, kind)


def max_(low, input, dim=None, keepdim=False, *, other=None, axis=None, keepdims=None):
    """``torch.max(a, b)`` of two activations (a max-pool neuron over them) or of one and a constant 0 (a ReLU), or
    ``max(x, dim)`` (values; the indices must stay unread)."""
    second = dim if other is None else other
    if isinstance(second, (Value, ParamTensor, torch.Tensor)):
        return maximum(low, input, second)
    dims = _dims(dim, axis)
    if dims is not None and not isinstance(dims, int):
        refuse(low)
    return MaxResult(_reduce(low, input, dims, bool(keepdim if keepdims is None else keepdims), "max"), MaxIndices("max"))


for _rule in (mean, sum_, amax, max_):
    reads_batch_stacked(_rule)  # torch.stack(outs).sum(0), .mean(0), .amax(0), .max(0)


def where_(low, condition, input, other):
    return where(low, condition, input, other)


def where_method(low, input, condition, other=None):
    """``x.where(cond, y)`` = ``where(cond, x, y)``."""
    return where(low, condition, input, other)


def masked_fill(low, input, mask, value):
    """``x.masked_fill(mask, value)`` = ``where(mask, value, x)``."""
    if not isinstance(input, Value):
        refuse(low)
    return where(low, mask, value, input)
