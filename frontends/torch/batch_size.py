"""Numbers a traced torch forward reads off its batch axis.

pathir's graph is per sample, and the fx interpreter runs at one batch size (``values.BATCH``). A number
the forward reads from an activation's batch axis (``x.size(0)``, ``x.shape[0]``) and then computes with
(``h / x.size(0)``, ``h * torch.tensor(n)``, ``torch.ones(n, 4).sum()``) would be frozen at that batch
size, and the graph wrong at every other. So the interpreter hands such a number out marked
(:class:`BatchNumber`), with its values at the batch sizes ``ALT_BATCHES``: a number equal to the batch size
at every one is *plain*. A plain number may shape a tensor's batch axis, and only that: the first size of a
view, reshape, expand or zeros/empty block (``output_size=`` of a transposed convolution), or the stop of a
slice of the batch axis. Arithmetic on numbers keeps the mark; any other use is refused, naming the node.
(The export path traces at a fixed batch, where the number is a literal;
:func:`pathir.frontends.torch.eager_writes.check_eager_writes` compares its eager forward at batches 1 and 5
with the one at 2 instead.)

Invariant: every number the interpreter computes from the batch size is marked unless it is the same at every
batch size in ``ALT_BATCHES`` (up to a million), and no marked number reaches a value of the graph.
"""

from __future__ import annotations

import operator

import torch

from pathir.frontends.core.values import BATCH, leaves

__all__ = ["BatchNumber", "ALT_BATCHES", "alternative", "batch_size", "check_batch_numbers", "marked_result"]


class BatchNumber:
    """A number computed from the batch size of the trace (``values.BATCH``); ``alts``: its values at the batch
    sizes ``ALT_BATCHES``. The batch size itself (*plain*) is the one equal to the batch size at every one."""

    alts: tuple = ()

    @property
    def plain(self) -> bool:
        return self == BATCH and self.alts == ALT_BATCHES


class BatchInt(BatchNumber, int):
    pass


class BatchFloat(BatchNumber, float):
    pass


#: the other batch sizes every marked number is also computed at: a number that is the batch size at all of them
#: is taken for the batch size (n + 0, but not max(n, 2) nor 1 + n // 4), and one that is the same at all of them
#: for a constant (x.numel() // x.size(0), n // n; a number that changes only past a million samples is taken
#: for one too)
ALT_BATCHES = (1, 3, 4, 5, 7, 8, 16, 64, 1000, 10**6)


def batch_size(n: int) -> BatchInt:
    """The batch size of the trace (``n``, ``BATCH``), marked."""
    out = BatchInt(n)
    out.alts = ALT_BATCHES
    return out


def alternative(args, kwargs, k: int):
    """args and kwargs with every marked number replaced by its value at batch ``ALT_BATCHES[k]`` (through lists,
    tuples, torch.Size, dicts and slices, each kept of its type)."""

    def at(a):
        if isinstance(a, BatchNumber):
            return a.alts[k]
        if isinstance(a, slice):
            return slice(at(a.start), at(a.stop), at(a.step))
        if isinstance(a, dict):
            return {key: at(v) for key, v in a.items()}
        if isinstance(a, torch.Size):
            return torch.Size([at(v) for v in a])
        if isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):
            return type(a)(at(v) for v in a)
        return a

    return at(args), at(kwargs)


def _refuse_made(low):
    low.unsupported(  # torch.full((n, 4), 1.0), h.new_ones(n, 4), torch.arange(n): from the batch size
        "makes a constant from the batch size (a block of the batch's shape other than zeros, an arange): a "
        "constant input inside the network, whose values pathir's per-sample graph would hold at the batch size "
        f"it traces at ({BATCH}); only zeros of the batch's shape are lowered (torch.zeros(x.size(0), 4), "
        "h.new_zeros(...))")


def marked_result(low, value, alts: tuple):
    """``value``, a number computed from marked ones, marked with ``alts`` (its values at ``ALT_BATCHES``), a bool
    as the int it is ((n > 3) + 1); as it is where it is the same at every batch size tried (x.numel() // x.size(0)).
    A tensor made from them is refused."""
    if isinstance(value, torch.Tensor):
        _refuse_made(low)
    if not isinstance(value, (int, float)) or all(a == value for a in alts):
        return value
    out = BatchFloat(value) if isinstance(value, float) else BatchInt(int(value))
    out.alts = tuple(alts)
    return out


aten = torch.ops.aten

#: calls that read a shape whose first size may be the batch size: the argument the shape starts at
#: (torch.zeros(n, 4): 0; h.view(n, -1): 1), for torch functions, method names and ATen ops
_SHAPES = {
    "view": 1, "reshape": 1, "expand": 1, "new_zeros": 1, "new_empty": 1,
    torch.reshape: 1, torch.zeros: 0, torch.empty: 0,
    aten.view.default: 1, aten.reshape.default: 1, aten._unsafe_view.default: 1, aten.expand.default: 1,
    aten.new_zeros.default: 1, aten.new_empty.default: 1, aten.zeros.default: 0, aten.empty.memory_format: 0,
}


def _leaves(args, kwargs) -> list:
    """The leaves of args and kwargs, through lists, tuples, dicts and slices (h[:n])."""
    out = []
    for a in leaves(args, kwargs):
        out.extend((a.start, a.stop, a.step) if isinstance(a, slice) else (a,))
    return out


def _first_size(args, at: int):
    """The first size of a shape given from ``args[at]`` on, as one sequence or as separate numbers."""
    if len(args) <= at:
        return None
    first = args[at]
    if isinstance(first, (tuple, list)):
        return first[0] if first else None
    return first


def _batch_slice(index) -> object:
    """The stop of the slice of the batch axis in an index (``h[:n]``, ``h[:n, 1]``), where it starts at 0 with
    step 1."""
    first = index[0] if isinstance(index, tuple) and index else index
    if isinstance(first, slice) and first.start in (None, 0) and first.step in (None, 1):
        return first.stop
    return None


#: functions, methods and ATen ops that make a tensor of a shape they are given
_CREATORS = {"full", "ones", "arange", "tensor", "as_tensor", "new_full", "new_ones", "new_tensor", "linspace", "eye",
             "empty_strided", "scalar_tensor"}


def _creates(target) -> bool:
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return name.split(".")[0] in _CREATORS


def _slots(target, args, kwargs) -> list:
    """What ``target(*args, **kwargs)`` holds where the batch size may be: the first size of its shape (the
    functions of ``_SHAPES``, positional or ``size=`` / ``shape=``; ``output_size=h.shape`` of a transposed
    convolution), the stop of a slice of the batch axis (getitem)."""
    slots = []
    if target is operator.getitem and len(args) == 2:
        slots.append(_batch_slice(args[1]))
    elif target in _SHAPES:
        slots.append(_first_size(args, _SHAPES[target]))
    for key in ("size", "shape", "output_size"):  # torch.zeros(size=(n, 4)), torch.reshape(h, shape=(n, -1))
        size = kwargs.get(key)
        if isinstance(size, (tuple, list)) and size and (key == "output_size" or target in _SHAPES):
            slots.append(size[0])
    return slots


def _values(a: BatchNumber) -> str:
    """``a`` at the trace's batch size and at the first other one where it differs."""
    k = next((k for k, v in enumerate(a.alts) if v != a), 0)
    return f"{a:g} at batch {BATCH}, {a.alts[k]:g} at batch {ALT_BATCHES[k]}"


def check_batch_numbers(low, target, args, kwargs) -> bool:
    """Refuse a call that reads a number computed from the batch size other than as a tensor's batch axis;
    True where ``target`` computes on numbers alone (its result, a number, is then to be marked)."""
    if target in (operator.getitem, getattr) and args and isinstance(args[0], tuple) and len(args) == 2 \
            and not isinstance(args[1], BatchNumber):
        return False  # x.shape[0], x.shape[1:]: picking sizes out of a shape
    found = _leaves(args, kwargs)
    marked = [a for a in found if isinstance(a, BatchNumber)]
    if not marked:
        return False
    if _creates(target):
        _refuse_made(low)
    held = [a for a in _slots(target, args, kwargs) if isinstance(a, BatchNumber)]
    if all(a.plain for a in marked) and len(held) == len(marked):  # each one in a slot of its own
        return False
    if all(isinstance(a, (int, float)) or a is None for a in found):
        return True  # numbers alone: n / 2, n * c, x.shape.numel() (bools are ints)
    shown = next((a for a in marked if not a.plain), marked[0])
    what = "the batch size" if shown.plain else f"a number computed from the batch size ({_values(shown)})"
    low.unsupported(
        f"computes with {what}, read from an activation's batch axis (x.size(0), x.shape[0]): pathir's graph is "
        f"per sample, and it would hold the number fixed at the batch size it traces at ({BATCH}), wrong at every "
        "other. Use the batch size only as a shape's batch axis (x.view(x.size(0), -1), x.new_zeros(x.size(0), 4)), "
        "or take it out of the forward")
