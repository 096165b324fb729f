"""Rules for ops that only move, copy or drop elements (view, reshape, flatten, permute, cat, chunk,
slicing, flips, rolls, ...), and for shape queries.

An index op is lowered by running it on element ids (:func:`..core.values.run_index_op`, which
refuses any op that mixes the samples of a batch); its index arguments must be constants. ``cat``
along the channels stays at channel granularity when it can. ``x.size()``, ``x.dim()``, ``x.shape``
and ``x.ndim`` are read off the activation's shape. ``torch.zeros_like(h)`` and ``h.new_zeros(...)`` are
constant blocks of zeros, which a ``cat`` beside activations reads as no element.
"""

from __future__ import annotations

import math

import torch

from pathir.frontends.core.values import (
    ABSENT,
    BATCH,
    BatchStacked,
    ParamTensor,
    Value,
    described,
    leaves,
    substitute,
    zero_constant,
)
from pathir.frontends.torch.batch_size import ALT_BATCHES, batch_size, marked_result
from pathir.frontends.torch.batch_stack import batch_stack, read_stacked
from pathir.frontends.torch.inputs import model_dtype_device
from pathir.frontends.torch.transposes import TRANSPOSE_ATTRIBUTES, transposed

__all__ = ["zeros_like", "new_zeros", "moves", "roll", "method_moves", "cat", "getattr_", "size", "numel", "dim", "unflatten", "unflatten_module",
           "flatten_module", "stack", "channel_shuffle_module", "index_with", "scatter", "index_put", "fill", "zero", "copy"]


def _index(low, fn, args, kwargs):
    if any(isinstance(a, BatchStacked) for a in leaves(args, kwargs)):  # (only where the rule reads a stack)
        return read_stacked(low, fn, args, kwargs)
    if any(isinstance(a, ParamTensor) and a.tensor.is_floating_point() for a in leaves(args, kwargs)):
        low.unsupported("moves a model parameter or buffer into the activations (a constant input to a "
                        "neuron, not a weight on an edge)")
    tensors = [a for a in leaves(args, kwargs) if isinstance(a, Value)]
    outs, many = low.index_op(lambda *ids: fn(*substitute(args, ids), **substitute(kwargs, ids)), tensors)
    return tuple(outs) if many else outs[0]


def scatter(fn, view):
    """``slice_scatter`` / ``select_scatter`` (``fn``): ``input`` with its view ``view(input, *args)``
    replaced by ``src``, as torch.export's functionalization writes ``x[:, :2].relu_()`` or
    ``x[:, 1] = 0``. An activation ``src``: element moves from both; a constant zero (:func:`fill`):
    those elements read nothing (no edge); any other constant is a fixed value no parameter carries."""
    def rule(low, input, src, *args):
        if isinstance(src, Value):
            return _index(low, fn, (input, src, *args), {})
        v = low.value(input)
        zero = src.tensor if isinstance(src, ParamTensor) else src
        if not (isinstance(zero, (torch.Tensor, int, float)) and not torch.as_tensor(zero).any()):
            low.unsupported("writes a constant other than 0 into an activation: a fixed value no parameter carries")
        ids = torch.arange(math.prod(v.shape), dtype=torch.int64).reshape(1, *v.shape)
        out = fn(ids, torch.full(view(ids, *args).shape, -1, dtype=torch.int64), *args)
        return low.compose_selection([(low.selectable(v), out.reshape(-1).numpy())], tuple(v.shape))
    rule.__name__ = f"scatter({getattr(fn, '__name__', fn)})"
    return rule


_INDEX_PUT = torch.ops.aten.index_put.default  # takes None for an axis not indexed, as export writes it


def index_put(low, input, indices, values, accumulate=False):
    """``aten.index_put(_)``, as torch.export writes ``x[:, [0, 2]] = src`` (constant list, tensor or
    mask indices): the indexed elements read ``src`` (an activation: element moves from both) or
    nothing (the constant 0: no edge, the channels zeroed). An activation index (data-dependent), an
    index on the batch axis, ``accumulate=True`` (a sum into the elements) or a constant other than 0
    is refused."""
    if any(isinstance(i, Value) for i in (indices or [])):
        low.unsupported("indexes by an activation: a data-dependent selection, not a fixed map")
    if accumulate:
        low.unsupported("index_put with accumulate=True adds into the indexed elements (x[idx] += src) instead of "
                        "writing them: write x[idx] = x[idx] + src")
    indices = substitute(indices, [])  # an index lifted to a constant by torch.export: its tensor
    if isinstance(values, Value) and not isinstance(input, Value):
        low.unsupported("writes an activation into a tensor made in the forward (z = torch.zeros_like(x) or "
                        "x.new_zeros(...), then z[..., idx] = x), which is not an activation: build the result from "
                        "the activation instead (torch.cat with zeros, F.pad, or indexing x[..., idx] to reorder it)")
    if isinstance(values, Value):
        return low.index_op(lambda t, src: _INDEX_PUT(t, indices, src), [input, values])[0][0]
    v = low.value(input)
    zero = values.tensor if isinstance(values, ParamTensor) else values
    if not (isinstance(zero, (torch.Tensor, int, float)) and not torch.as_tensor(zero).any()):
        low.unsupported("writes a constant other than 0 into an activation: a fixed value no parameter carries")
    n = math.prod(v.shape)
    ids = torch.arange(2 * n, dtype=torch.int64).reshape(2, *v.shape)  # two samples: is the write per sample?
    try:
        out = _INDEX_PUT(ids, indices, torch.tensor(-1, dtype=torch.int64)).reshape(2, -1)
    except (IndexError, RuntimeError) as err:
        low.unsupported(f"index_put with indices that do not fit the activation ({err})")
    if not torch.equal(out[1], torch.where(out[0] < 0, out[0], out[0] + n)):
        low.unsupported("index_put on the batch axis: writes some samples of a batch and not others")
    return low.compose_selection([(low.selectable(v), out[0].numpy())], tuple(v.shape))


def fill(low, input, value):
    """``aten.fill`` of an activation with 0 (functionalized ``x[:, 1] = 0``): the constant 0 that
    :func:`scatter` writes; any other value is refused."""
    low.value(input)
    c = value.tensor if isinstance(value, ParamTensor) else value
    if torch.as_tensor(c).any():
        low.unsupported(f"fills an activation with the constant {torch.as_tensor(c).tolist()}: a fixed value no "
                        "parameter carries")
    return torch.zeros((1, *input.shape))


def zero(low, input):
    """``aten.zero`` (functionalized ``x[:, 0].zero_()``): :func:`fill` with 0."""
    return fill(low, input, 0)


def copy(low, input, src, non_blocking=False):
    """``aten.copy`` (functionalized ``x[:, :2] = y``): ``src``'s values in ``input``'s shape (an
    activation broadcast by element moves, or the constant 0 of :func:`fill`)."""
    if not isinstance(src, Value):
        return fill(low, input, src)
    shape = tuple(low.value(input).shape)
    if tuple(src.shape) == shape:
        return src
    return _index(low, lambda t: t.expand(t.shape[0], *shape), (src,), {})


def stack(fn):
    """The rule of ``torch.stack`` (``fn``: the function or ATen op): activations of one shape stacked along dim 0
    (the batch axis) are kept as a :class:`BatchStacked` (:mod:`.batch_stack`); any other stack moves elements."""
    def rule(low, tensors, dim=0, **kwargs):
        stacked = None if kwargs else batch_stack(low, tensors, dim)
        return stacked if stacked is not None else _index(low, fn, (tensors, dim), kwargs)
    rule.__name__ = f"stack({getattr(fn, '__name__', fn)})"
    return rule


def moves(fn):
    """The rule of the index op ``fn`` (a torch function or an ATen op)."""
    def rule(low, *args, **kwargs):
        return _index(low, fn, args, kwargs)
    rule.__name__ = f"moves({getattr(fn, '__name__', fn)})"
    return rule


def roll(fn):
    """The rule of ``torch.roll`` (``fn``: the function, ATen op or method): refused where it rolls the batch axis
    (``dims`` None rolls the flattened tensor, batch included). A roll by a multiple of the batch size is the
    identity at that size, so the element-id run at the trace's batch could not see it."""
    def rule(low, input, shifts, dims=None):
        v = low.value(input) if isinstance(input, Value) else None
        ndim = None if v is None else len(v.shape) + 1
        rolled = None if dims is None else ([dims] if isinstance(dims, int) else list(dims))
        if ndim is not None and (rolled is None or any(int(d) % ndim == 0 for d in rolled)):
            low.unsupported("rolls the batch axis (axis 0, or the flattened tensor where dims is not given): it mixes "
                            "the samples of a batch")
        return _index(low, fn, (input, shifts) if dims is None else (input, shifts, dims), {})
    rule.__name__ = f"roll({getattr(fn, '__name__', fn)})"
    return rule


def method_moves(name: str):
    """The rule of the tensor method ``name`` that moves elements."""
    def rule(low, *args, **kwargs):
        return _index(low, lambda self, *a, **k: getattr(self, name)(*a, **k), args, kwargs)
    rule.__name__ = f"method_moves({name})"
    return rule


def cat(low, tensors, dim=0, *, axis=None, out=None):
    """Concatenation; along the channels at channel granularity when every input is a channel-level
    selection, else on element ids."""
    if out is not None:
        low.unsupported("cat with out=")
    dim = dim if axis is None else axis
    rank = next((len(t.shape) + 1 for t in tensors if isinstance(t, Value)), None)
    if rank is not None and dim in (1, -rank) and all(isinstance(t, Value) for t in tensors):
        v = low.cat_channels(list(tensors))
        if v is not None:
            return v
    if any(isinstance(t, Value) for t in tensors):  # a block of zeros beside activations: no element there
        for t in tensors:
            if not isinstance(t, Value) and not _zeros(t):
                low.unsupported(f"concatenates {described(t)} with activations: a constant that is not a block of "
                                "float zeros is a fixed value per position (a bias no rescaling can follow)")
        tensors = [_absent(low, t) if _zeros(t) else t for t in tensors]
    return _index(low, torch.cat, (tensors, dim), {})


def zeros_like(low, input, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None,
               requires_grad=False):
    """``torch.zeros_like(h)``: a constant block of zeros of h's shape, batch included (as ``torch.zeros(x.shape[0],
    ...)`` makes it), which a ``cat`` beside activations reads as no element."""
    return torch.zeros(tuple(input.size()), dtype=dtype or model_dtype_device(low.model)[0])


def new_zeros(low, input, *sizes, size=None, dtype=None, layout=None, device=None, pin_memory=None,
              requires_grad=False):
    """``h.new_zeros(size)`` (or ``size=``): as :func:`zeros_like`, of the size given."""
    if size is not None:
        sizes = (size,)
    shape = tuple(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)) else tuple(sizes)
    return torch.zeros(shape, dtype=dtype or model_dtype_device(low.model)[0])

def _zeros(t) -> bool:
    """A constant all-zero float tensor made in the forward or held as a buffer (not a parameter, whose
    value training moves)."""
    tensor = t.tensor if isinstance(t, ParamTensor) else t
    return isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.dim() > 0 and zero_constant(t)


def _absent(low, t) -> torch.Tensor:
    """The id tensor of a block of zeros: ``ABSENT`` (no element) everywhere, batch first as the activations' ids."""
    shape = tuple((t.tensor if isinstance(t, ParamTensor) else t).shape)
    if shape[0] != BATCH:
        low.unsupported(f"concatenates a constant block of batch size {shape[0]} to activations of batch {BATCH}: "
                        "it fixes the batch size, and pathir's graph is per sample (make it with x.shape[0])")
    return torch.full(shape, ABSENT, dtype=torch.int64)


def getattr_(low, obj, attr):
    if isinstance(obj, ParamTensor) and attr in TRANSPOSE_ATTRIBUTES:
        return transposed(low, obj, attr)
    if isinstance(obj, Value):
        if attr == "shape":
            return _size(obj)
        if attr == "ndim":
            return len(obj.shape) + 1
        if attr in ("dtype", "device") and hasattr(low, "model"):  # the model's (one dtype and device throughout:
            return model_dtype_device(low.model)[0 if attr == "dtype" else 1]  # the self-check refuses another)
        if attr in TRANSPOSE_ATTRIBUTES:  # an element move (on ids: one that moves the batch axis is refused)
            return _index(low, lambda t: getattr(t, attr), (obj,), {})
        low.unsupported(f"reads attribute '{attr}' of an activation", "getattr")
    return getattr(obj, attr)


def _size(v) -> torch.Size:
    """An activation's size, its batch axis marked as the batch size (`batch_size`); any other's as it is."""
    return torch.Size((batch_size(BATCH), *v.shape)) if isinstance(v, Value) else v.size()


def size(low, input, dim=None):
    s = _size(input)
    return s if dim is None else s[dim]


def numel(low, input):
    """``h.numel()``: the batch's elements, a number computed from the batch size (`batch_size`)."""
    per_sample = math.prod(input.shape) if isinstance(input, Value) else None
    if per_sample is None:
        return input.numel()
    return marked_result(low, BATCH * per_sample, tuple(b * per_sample for b in ALT_BATCHES))


def dim(low, input):
    return len(input.shape) + 1


def unflatten(low, input, dim, sizes):
    return low.index_op(lambda t: torch.unflatten(t, dim, sizes), [input])[0][0]


def unflatten_module(low, mod, input):
    return low.index_op(lambda t: t.unflatten(mod.dim, mod.unflattened_size), [input])[0][0]


def channel_shuffle_module(low, mod, input):
    """``nn.ChannelShuffle``: a channel permutation (a ChannelMap, ties nothing)."""
    return low.index_op(lambda t: torch.nn.functional.channel_shuffle(t, mod.groups), [input])[0][0]


def flatten_module(low, mod, input):
    return low.index_op(lambda t: torch.flatten(t, mod.start_dim, mod.end_dim), [input])[0][0]


def index_with(fn):
    """The rule of ATen's ``index`` / ``_unsafe_index`` with constant indices (decomposed padding,
    nearest upsampling): a selection."""
    def rule(low, input, indices):
        if any(isinstance(i, Value) for i in (indices or [])):
            low.unsupported("indexes by an activation: a data-dependent selection, not a fixed map")
        indices = substitute(indices, [])  # an index lifted to a constant by torch.export: its tensor
        return low.index_op(lambda t: fn(t, indices), [input])[0][0]
    return rule
