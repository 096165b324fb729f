"""``torch.stack(xs, dim=0)`` of activations, read back along dim 0: ``torch.stack(outs).sum(0)``, ``.mean(0)``,
``.amax(0)`` / ``.max(0)``, ``stacked[i]``, ``.unbind(0)``, as ensembles and multi-branch heads write them.

The stack moves the batch axis to axis 1, which pathir's graph keeps first, per sample. It is kept as a
:class:`~..core.values.BatchStacked` of the activations themselves: a sum over dim 0 is their sum, a mean
that sum times 1/k (a fixed edge), a max their elementwise max (a max-pool neuron), an index or an unbind
along dim 0 the activations it picks. Each gives activations with the batch first again; the rules that
read a stack so are marked ``reads_batch_stacked``, and every other op that reads one is refused
(``interpreter.invoke``), as the stack itself was before.
"""

from __future__ import annotations

import math

import torch

from pathir.frontends.core.reductions import reduce_stacking_axis
from pathir.frontends.core.values import BATCH, BatchStacked, Value, described, leaves

__all__ = ["batch_stack", "read_stacked", "reduce_stacked", "reads_batch_stacked"]


def reads_batch_stacked(rule):
    """Mark ``rule`` as one that reads a :class:`BatchStacked` (its own code dispatches on it)."""
    rule.reads_batch_stacked = True
    return rule


def batch_stack(low, tensors, dim: int = 0):
    """A :class:`BatchStacked` where ``tensors`` are activations of one shape stacked along dim 0 (the batch axis);
    None where the stack is another (the caller moves elements as for any index op)."""
    if not isinstance(tensors, (list, tuple)) or not tensors or not all(isinstance(t, Value) for t in tensors):
        return None
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1 or int(dim) % (len(next(iter(shapes))) + 2) != 0:
        return None
    return BatchStacked(tuple(tensors))


def reduce_stacked(low, stacked: BatchStacked, dims, keepdim: bool, kind: str) -> Value:
    """``kind`` ∈ {sum, mean, max} of ``stacked`` over ``dims`` (with dim 0, the stacking axis: the activations'
    sum, mean or elementwise max; then over the other axes given, as for any activation)."""
    nd = len(stacked.shape) + 2  # the stacking axis, the batch, the sample's axes
    given = [dims] if isinstance(dims, int) else list(dims) if dims is not None else []
    axes = sorted({int(d) % nd for d in given})
    if 0 not in axes or 1 in axes or keepdim:
        low.unsupported(f"{kind} over {given or 'every axis'}{' with keepdim' if keepdim else ''} of "
                        f"{described(stacked)}")
    return reduce_stacking_axis(low, list(stacked.values), axes, kind)


def read_stacked(low, fn, args, kwargs):
    """An index op ``fn`` (getitem, select, unbind, narrow...) on a :class:`BatchStacked` that picks whole stacked
    activations along dim 0: run on element ids (stacked activation i's ids offset by i·n), each output must be one
    activation, unchanged, or a stack of them; anything else is refused."""
    stacked = next(a for a in leaves(args, kwargs) if isinstance(a, BatchStacked))
    if sum(isinstance(a, BatchStacked) for a in leaves(args, kwargs)) != 1 or any(
            isinstance(a, Value) for a in leaves(args, kwargs)):
        low.unsupported(f"an op reading {described(stacked)} with other activations")
    shape, k = stacked.shape, len(stacked.values)
    n = BATCH * math.prod(shape)
    ids = torch.arange(k * n, dtype=torch.int64).reshape(k, BATCH, *shape)
    try:
        result = fn(*[ids if a is stacked else a for a in args], **kwargs)
    except (RuntimeError, IndexError, TypeError, ValueError) as err:
        low.unsupported(f"{err} (reading {described(stacked)})")
    many = isinstance(result, (tuple, list))
    outs = [_picked(low, r, stacked, n) for r in (result if many else [result])]
    return tuple(outs) if many else outs[0]


def _picked(low, r, stacked: BatchStacked, n: int):
    """The activation (or stack of activations) whose element ids ``r`` holds, each whole and unchanged."""
    shape = stacked.shape
    base = torch.arange(n, dtype=torch.int64).reshape(BATCH, *shape)
    if isinstance(r, torch.Tensor) and tuple(r.shape) == (BATCH, *shape):
        i = int(r.reshape(-1)[0]) // n
        if 0 <= i < len(stacked.values) and torch.equal(r, base + i * n):
            return stacked.values[i]
    if isinstance(r, torch.Tensor) and r.dim() == len(shape) + 2 and tuple(r.shape[1:]) == (BATCH, *shape):
        if not r.shape[0]:
            low.unsupported(f"an empty slice along dim 0 of {described(stacked)}: no activation (its sum is the "
                            "constant 0, no neuron of the graph)")
        picked = [_picked(low, part, stacked, n) for part in r]
        return BatchStacked(tuple(picked))
    low.unsupported(f"an index op that does not pick whole activations along dim 0 of {described(stacked)}")
