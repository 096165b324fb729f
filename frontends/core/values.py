"""Values of the torch frontend's interpreter.

An activation tensor is a ``Value``: a *pending* sum of terms ``map(node)`` plus
at most one bias, not yet given a node of its own. Linear ops (conv, linear,
batch-norm, pooling, add, cat, reshapes) extend or compose pending sums;
non-linear ops (ReLU, max-pool) and ops that need one source materialize them
into nodes. A value that is exactly one node is a single ``Identity`` term
without bias.

Index-moving ops (view, reshape, flatten, permute, transpose, chunk, split,
slicing, cat) are lowered by *running them* on tensors of element ids: each
input element gets a distinct integer, the op moves them, and the result says
which input element lands where. Composed with the selection maps already
pending (Identity, Reshape, ChannelMap, Gather), they stay pending, and are
simplified back to the most specific map.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pathir.ir import ChannelMap, Gather, Identity, Map, MapKind, Param, Pool, Reshape

__all__ = ["described", "Value", "ParamTensor", "reads_transposed", "BatchStacked", "MaxIndices", "f64", "SELECTION", "selection_index", "selection_map", "run_index_op", "BATCH",
           "leaves", "values_in", "substitute", "zero_constant"]

#: batch size of the element-id tensors (2 catches ops that mix samples)
BATCH = 2
#: the element id of "no element" in an index op's run (a block of zeros concatenated beside activations): a value no
#: id takes and no constant the op could carry into its output holds by chance (any other constant is refused)
ABSENT = np.iinfo(np.int64).min

SELECTION = frozenset({MapKind.IDENTITY, MapKind.RESHAPE, MapKind.CHANNEL_MAP, MapKind.GATHER})

@dataclass
class Value:
    """A pending sum: pre-activation = sum of map(node output) + bias."""

    terms: list[tuple[str, Map]]
    shape: tuple[int, ...]
    bias: Param | None = None
    origin: str = ""  # the op that made it: names the node if it is materialized

    @staticmethod
    def of_node(name: str, shape) -> "Value":
        return Value([(name, Identity())], tuple(shape), None, name)

    @property
    def node(self) -> str | None:
        """The node this value is exactly, or None if it is a pending sum."""
        if len(self.terms) == 1 and self.bias is None and self.terms[0][1].kind is MapKind.IDENTITY:
            return self.terms[0][0]
        return None

    def size(self) -> torch.Size:
        return torch.Size((BATCH, *self.shape))


@dataclass
class ParamTensor:
    """A model parameter or buffer met as a value (module attribute, get_attr, export input). ``transposed``:
    the forward reads the 2-d tensor transposed (``W.t()``, ``W.T``); ``tensor`` is still the stored one, and
    only the rules marked :func:`reads_transposed` accept it (``invoke`` refuses it anywhere else)."""

    name: str
    tensor: torch.Tensor
    kind: str = "parameter"  # or "buffer"
    transposed: bool = False

    def read(self) -> torch.Tensor:
        """The tensor as the forward reads it (the stored one, transposed where ``transposed``)."""
        return self.tensor.t() if self.transposed else self.tensor


def reads_transposed(rule):
    """Mark ``rule`` as one that lowers a :class:`ParamTensor` read transposed (x @ W.t(), F.linear(x, W.t()))."""
    rule.reads_transposed = True
    return rule


@dataclass(frozen=True)
class MaxIndices:
    """The indices a max or a max-pool returns beside its values (``op``): which element is largest depends on
    the input, so they are no fixed map. Unread they are no part of the graph; an op that reads them is refused."""

    op: str


@dataclass(frozen=True)
class NegInfPadded:
    """An activation padded with -inf along its spatial axes (``pads``: (before, after) per spatial axis), as
    TF-"same" max-pooling writes it (timm's ``MaxPool2dSame``: ``F.pad(x, ..., value=-inf)`` then a max-pool). Only
    a max-pool reading it directly may: there the padding is the pool's own, never selected; anything else that
    reads it is refused (-inf would enter the computation)."""

    value: Value
    pads: tuple[tuple[int, int], ...]

    def pool(self, pool):
        """The max-pool ``pool`` (over the padded tensor) as one max-pool of ``value``: its padding and this one's
        added (neither is ever selected)."""
        padding = tuple((a + lo, b + hi) for (a, b), (lo, hi) in zip(pool.padding, self.pads))
        return Pool(pool.kernel, pool.stride, padding, pool.dilation, pool.ceil_mode)


@dataclass(frozen=True)
class BatchStacked:
    """``torch.stack(values, dim=0)`` of activations of one shape: the batch axis moved to axis 1, which pathir's
    graph keeps first. Only the rules marked ``reads_batch_stacked`` read it (a sum, mean or max over dim 0, an
    index or unbind along it: each gives activations with the batch first again); every other op is refused."""

    values: tuple

    @property
    def shape(self) -> tuple:
        """The per-sample shape of each stacked activation."""
        return tuple(self.values[0].shape)


def zero_constant(c) -> bool:
    """Whether ``c`` is a constant (a number, an array, a tensor made in the forward or a buffer; never an
    ``nn.Parameter``, whose value training moves) whose every entry is 0."""
    t = c.tensor if isinstance(c, ParamTensor) else c
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        return t == 0
    if isinstance(t, np.ndarray):
        return bool((t == 0).all())
    return isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and not bool(t.any())


def described(v) -> str:
    """What a non-activation argument is, in the words of an error message."""
    if isinstance(v, BatchStacked):
        return (f"torch.stack(..., dim=0) of {len(v.values)} activations, which moves the batch axis to axis 1: only a "
                "sum, mean or max over dim 0, or an index or unbind along it, reads it (pathir's graph keeps the "
                "batch first); else stack (or concatenate) along dim=1 and reduce over dim 1")
    if isinstance(v, NegInfPadded):
        return ("an activation padded with -inf, which only a max-pool reading it directly ignores (its padding); "
                "pad with zeros, or pool right after the padding")
    if isinstance(v, ParamTensor):
        learnable = v.kind == "parameter" and getattr(v.tensor, "requires_grad", False)
        return f"the {'learnable parameter' if learnable else v.kind} '{v.name}'"
    if isinstance(v, torch.Tensor):
        return f"a constant tensor of shape {list(v.shape)}"
    return f"the constant {v!r}" if isinstance(v, (int, float, bool)) or v is None else f"a {type(v).__name__}"


def f64(t: torch.Tensor) -> np.ndarray:
    """A fresh float64 copy (never a view of the model's storage)."""
    t = t.detach().resolve_neg()  # (a lazily negated view: numpy reads its storage, not its values)
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64):
        return np.array(t.numpy(), dtype=np.float64)  # the same exact widening, one thread (no pool wake-ups)
    return t.to("cpu", torch.float64, copy=True).numpy()


#: tensors of this many entries or more are widened by torch's threaded copy, smaller ones by numpy's
_PARALLEL_COPY = 1 << 16


def f64_into(out: np.ndarray, t: torch.Tensor) -> None:
    """``out[...] = f64(t)``: the same exact widening, written into an array of t's shape."""
    t = t.detach().resolve_neg()
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64):
        if t.numel() >= _PARALLEL_COPY and out.flags.c_contiguous:  # torch's copy runs on its threads (fresh pages fault in parallel)
            torch.from_numpy(out).copy_(t)
        else:
            np.copyto(out, t.numpy())
    else:
        np.copyto(out, t.to("cpu", torch.float64).numpy())


def _numel(shape) -> int:
    return int(math.prod(shape))


def selection_index(m: Map, in_shape) -> np.ndarray:
    """For a selection map: out.flat[t] = in.flat[index[t]] (-1: zero)."""
    n = _numel(in_shape)
    if m.kind in (MapKind.IDENTITY, MapKind.RESHAPE):
        return np.arange(n)
    if m.kind is MapKind.GATHER:
        return np.asarray(m.index)
    if m.kind is MapKind.CHANNEL_MAP:
        per = _numel(in_shape[1:])
        idx = np.asarray(m.index)
        base = np.where(idx >= 0, idx * per, -1)
        out = base[:, None] + np.arange(per)[None, :]
        return np.where(base[:, None] >= 0, out, -1).reshape(-1)
    raise TypeError(f"{m.kind.value} is not a selection map")


def selection_map(index: np.ndarray, in_shape, out_shape) -> Map | None:
    """The most specific selection map with this index; None if it selects nothing."""
    index = np.asarray(index, dtype=np.int64)
    in_shape, out_shape = tuple(in_shape), tuple(out_shape)
    if not np.any(index >= 0):
        return None
    if index.size == _numel(in_shape) and np.array_equal(index, np.arange(index.size)):
        return Identity() if in_shape == out_shape else Reshape(out_shape)
    if len(in_shape) == len(out_shape) and in_shape[1:] == out_shape[1:]:
        per = _numel(in_shape[1:])
        blocks = index.reshape(out_shape[0], per)
        first = blocks[:, :1]
        expect = np.where(first >= 0, first + np.arange(per)[None, :], -1)
        if np.array_equal(blocks, expect) and np.all((first < 0) | (first % per == 0)):
            ch = np.where(first[:, 0] >= 0, first[:, 0] // per, -1)
            return ChannelMap(tuple(int(c) for c in ch))
    return Gather(index, out_shape)


def run_index_op(fn, shapes: list[tuple[int, ...]]):
    """Run an index-moving op on element-id tensors.

    ``fn(*id_tensors)`` must return a tensor or a tuple/list of tensors.
    Returns, for each output tensor, (out shape without batch, [index per input]),
    where index[t] is the element of that input at output position t, or -1.
    Raises ValueError if the op mixes samples of the batch or computes values.
    """
    if not shapes:  # only the model's tensors in (a float buffer moved by an op of its own on the export path)
        raise ValueError("it reads no activation, only the model's tensors: a constant pathir does not compute "
                         "inside the graph here; compute it once outside forward (register the result as a buffer)")
    sizes = [_numel(s) for s in shapes]
    offsets = np.cumsum([0] + [BATCH * n for n in sizes])
    ids = [
        (torch.arange(BATCH * n, dtype=torch.int64) + int(off)).reshape(BATCH, *s)
        for n, off, s in zip(sizes, offsets, shapes)
    ]
    result = fn(*ids)
    many = isinstance(result, (tuple, list))
    outs = list(result) if many else [result]
    sizes_arr = np.asarray(sizes)
    decoded = []
    for r in outs:
        if not isinstance(r, torch.Tensor) or r.dtype != torch.int64 or r.dim() == 0:
            raise ValueError("the op does not keep the batch axis first")
        if r.shape[0] != BATCH:
            raise ValueError(_off_the_front(r, offsets, sizes_arr, "the op does not keep the batch axis first"))
        flat = r.reshape(BATCH, -1).numpy()
        absent = flat == ABSENT  # no element (a block of zeros the op placed beside the activations)
        which = np.where(absent, -1, np.searchsorted(offsets, flat, side="right") - 1)
        at = np.maximum(which, 0)
        local = np.where(absent, 0, flat - offsets[at])
        batch, elem = local // sizes_arr[at], local % sizes_arr[at]
        same = np.all(which[0] == which[1]) and np.all(np.where(absent[0], True, elem[0] == elem[1]))
        if not (np.all(absent | (batch == np.arange(BATCH)[:, None])) and same):
            raise ValueError(_off_the_front(r, offsets, sizes_arr, "the op mixes the samples of a batch"))
        per_input = [np.where(which[0] == i, elem[0], -1) for i in range(len(shapes))]
        decoded.append((tuple(r.shape[1:]), per_input))
    return decoded, many


def _off_the_front(r: torch.Tensor, offsets: np.ndarray, sizes: np.ndarray, otherwise: str) -> str:
    """Why an index op's output is refused: the batch moved to another axis (stack or cat along dim 0, a transpose
    of axis 0), even where a later op would move it back; else ``otherwise``."""
    moved = _batch_axis(r.numpy(), offsets, sizes)
    if not moved:
        return otherwise
    return (f"the op moves the batch axis to axis {moved} (a transpose of axis 0, a cat along dim 0, an "
            "unsqueeze(0): torch's own code adds one where a layer reads a tensor of fewer axes than it expects as one "
            "unbatched sample, e.g. nn.Dropout1d of a (batch, features) tensor), and pathir's graph keeps it first, per "
            "sample, even where a later op would move it back; stack (or concatenate) along dim=1 instead, then reduce "
            "over dim 1 (torch.stack(xs, dim=0) of activations of one shape is read back by a sum, mean or max over "
            "dim 0)")


def _batch_axis(r: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> int | None:
    """The axis of the id tensor ``r`` along which the sample varies, every element an id of one activation and
    the sample constant along every other axis; None where there is no such axis."""
    if r.ndim < 2 or np.any((r < 0) | (r >= offsets[-1])):
        return None
    which = np.searchsorted(offsets, r, side="right") - 1
    sample = (r - offsets[which]) // sizes[which]
    for k in range(r.ndim):
        if r.shape[k] == BATCH and np.all(sample == np.arange(BATCH).reshape([-1 if a == k else 1 for a in range(r.ndim)])):
            return k
    return None


def leaves(args, kwargs) -> list:
    """The leaves of args and kwargs, depth first in order (through lists, tuples and dicts): the
    order :func:`substitute` replaces Values in."""
    found: list = []

    def visit(a):
        if isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
        elif isinstance(a, dict):
            for x in a.values():
                visit(x)
        else:
            found.append(a)

    visit(args)
    visit(kwargs)
    return found


def values_in(args, kwargs) -> list:
    """The activations among the leaves of args and kwargs, in :func:`leaves` order (an activation padded
    with -inf, :class:`NegInfPadded`, included: a call reading it is lowered, not run)."""
    return [a for a in leaves(args, kwargs) if isinstance(a, (Value, NegInfPadded, BatchStacked))]


def substitute(obj, ids):
    """Replace the Values in ``obj`` (in :func:`leaves` order) by ``ids``, and an integer or bool
    buffer / constant (an index argument) by its tensor."""
    it = iter(ids)

    def sub(a):
        if isinstance(a, Value):
            return next(it)
        if isinstance(a, ParamTensor) and not (a.tensor.is_floating_point() or a.tensor.is_complex()):
            return a.tensor
        if isinstance(a, tuple):
            return tuple(sub(x) for x in a)
        if isinstance(a, list):
            return [sub(x) for x in a]
        if isinstance(a, dict):
            return {k: sub(v) for k, v in a.items()}
        return a

    return sub(obj)
