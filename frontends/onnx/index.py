"""ONNX rules for the ops that only move elements (Reshape, Flatten, Transpose, Concat, Slice,
Gather, GatherElements, Pad with zeros, Split, DepthToSpace, ...): run on element ids by onnx's
reference evaluator and composed with the pending selection maps of their inputs (as the torch
frontend does); Concat along the channels stays at channel granularity; sequences of activations
(SplitToSequence, SequenceAt)."""

from __future__ import annotations

import numpy as np

from pathir.errors import UnsupportedOperation
from pathir.frontends.core.reductions import reduce_stacking_axis
from pathir.frontends.core.values import NegInfPadded, Value, zero_constant
from pathir.frontends.onnx.batch_size import depends_on_batch
from pathir.frontends.onnx.evaluate import IdTensor, _decode, run_on_ids
from pathir.frontends.onnx.layers import attrs

__all__ = ["Sequence", "Displaced", "concat", "pad", "index", "moved", "gather_elements", "scatter", "split_to_sequence",
           "sequence_at", "reduce_displaced", "READS_DISPLACED"]


class Sequence(list):
    """An ONNX sequence of activations (SplitToSequence), read by SequenceAt."""


class Displaced:
    """An intermediate tensor whose batch axis an index op moved (the dynamo exporter writes ``x[:, k] = src``
    as Transpose -> ScatterND -> Transpose): its element ids over the activations ``base`` (selectable
    Values, laid end to end), kept until a later index op puts the batch axis first again. Anything else
    that reads it refuses it, naming the op that moved the batch axis."""

    def __init__(self, ids: IdTensor, base: list, low):
        self.ids, self.base = ids, base
        self.where = (low.fx_name, low.op, low.at)

    def refuse(self, reader: str):
        name, op, at = self.where
        raise UnsupportedOperation(name, op, at, f"{self.ids.why}, and {reader} reads the result before an index op "
                                                 "puts the batch axis first again")


def concat(low, node, ins):
    """Along the channels at channel granularity when it can, else on element ids; a block of constant zeros
    beside an activation is no element there (as Pad's zeros), any other constant a fixed value: refused."""
    if any(isinstance(v, (Value, Displaced)) for v in ins):
        for v in ins:
            if isinstance(v, np.ndarray) and not zero_constant(v):
                low.unsupported("concatenates a constant that is not 0 with an activation: a fixed value per position "
                                "(a bias no rescaling can follow)")
            if isinstance(v, np.ndarray) and not low.batch_fixed and not depends_on_batch(v):
                low.unsupported(f"concatenates a block of zeros of fixed shape {list(v.shape)} with activations of a "
                                "symbolic batch size: the model runs at that one batch size; make the block from the "
                                "input's shape (Shape, then ConstantOfShape or Expand)")
        ins = [np.zeros(v.shape, dtype=np.int64) if isinstance(v, np.ndarray) else v for v in ins]
    if all(isinstance(v, Value) for v in ins):
        rank = len(ins[0].shape) + 1
        if attrs(node)["axis"] % rank == 1:
            out = low.cat_channels(list(ins))
            if out is not None:
                return [out]
    return index(low, node, ins)


def pad(low, node, ins):
    a = attrs(node)
    pads = a.get("pads") if len(ins) < 2 or ins[1] is None else ins[1]
    if pads is not None and isinstance(pads, np.ndarray | list | tuple) and np.any(np.asarray(pads) < 0):
        low.unsupported(f"negative pads {np.asarray(pads).ravel().tolist()} (a crop) are not lowered from ONNX; "
                        "crop with a Slice (in torch: x[..., a:-b] rather than F.pad with negative sizes)")
    if a.get("mode", "constant") == "constant":
        value = ins[2] if len(ins) > 2 and ins[2] is not None else a.get("value", 0.0)
        if np.size(value) == 1 and float(np.asarray(value).ravel()[0]) == -np.inf and isinstance(ins[0], Value):
            return [_neg_inf_padded(low, ins[0], pads, ins[3] if len(ins) > 3 else None)]
        if np.any(np.asarray(value) != 0):
            low.unsupported("padding with a non-zero constant adds a fixed value (a bias per position)")
        ins = list(ins[:2]) + [np.zeros((), dtype=np.int64)] + list(ins[3:]) if len(ins) > 2 else ins
    return index(low, node, ins)


def _neg_inf_padded(low, v: Value, pads, axes) -> NegInfPadded:
    """Pad(v, pads, -inf) over the spatial axes only (TF-"same" max-pooling), held for the MaxPool that reads it."""
    rank = len(v.shape) + 1
    p = np.asarray(pads, dtype=np.int64).ravel()
    axes = list(range(rank)) if axes is None else [int(x) % rank for x in np.asarray(axes).ravel()]
    if p.size != 2 * len(axes):
        low.fail(f"pads {p.tolist()} for {len(axes)} axes")
    full = np.zeros(2 * rank, dtype=np.int64)
    for i, ax in enumerate(axes):
        full[ax], full[ax + rank] = p[i], p[i + len(axes)]
    if np.any(full[[0, 1, rank, rank + 1]]) or np.any(full < 0):
        low.unsupported(f"pads {p.tolist()} with -inf: only the spatial axes, by non-negative amounts, pad a "
                        "max-pool's input with -inf")
    return NegInfPadded(v, tuple((int(full[a]), int(full[a + rank])) for a in range(2, rank)))


def scatter(low, node, ins):
    """ScatterND / ScatterElements with constant indices (the exporters' in-place writes, ``x[:, k] = src``
    and ``x[:, :k] = 0``): the written elements read ``updates`` (an activation: element moves from both
    inputs) or nothing (the constant 0: those elements zeroed, no term). A reduction (``x[idx] += src``),
    an activation index or a constant other than 0 is refused; a write into some samples of a batch only
    is refused by the element-id run."""
    reduction = attrs(node).get("reduction", "none")
    if reduction != "none":
        low.unsupported(f"reduction='{reduction}' combines the written elements with the ones there (x[idx] "
                        f"{'+' if reduction == 'add' else '*' if reduction == 'mul' else reduction}= src) instead of "
                        "writing them: not an element move")
    if not isinstance(ins[1], np.ndarray):
        low.unsupported("its indices depend on the input: a data-dependent selection, not a fixed map")
    ins = list(ins)
    for k, what in ((0, "data"), (2, "updates")):
        if isinstance(ins[k], np.ndarray):
            if np.any(ins[k] != 0):
                low.unsupported(f"its {what} is a constant other than 0: a fixed value in the activation that no "
                                "parameter carries")
            ins[k] = np.zeros(ins[k].shape, dtype=np.int64)  # element id 0: no element
    if not any(isinstance(v, (Value, Displaced)) for v in ins):
        low.unsupported("it writes constants into a constant: no activation")
    return index(low, node, ins)


def gather_elements(low, node, ins):
    """GatherElements with constant indices (``torch.gather`` by an index buffer): an element move, run on
    element ids; indices that depend on the input, or shorter than the data on an axis it does not gather
    along (which ONNX allows: a prefix of that axis), are refused."""
    data, idx = ins[0], ins[1]
    constant_operands(low, node, ins)
    if isinstance(data, Value) and idx.ndim == len(data.shape) + 1:
        full, axis = (low.batch, *data.shape), attrs(node).get("axis", 0) % idx.ndim
        short = [d for d in range(idx.ndim) if d != axis and idx.shape[d] != full[d]]
        if short:
            d = short[0]
            what = "the batch axis" if d == 0 else "not gathered along"
            low.unsupported(f"its indices have {idx.shape[d]} entries on axis {d} ({what}) where the data has "
                            f"{full[d]}: only a prefix of that axis would be kept, which pathir does not lower "
                            "(expand the indices to the data's shape, e.g. idx.expand(x.shape[0], ...))")
    return index(low, node, ins)


def constant_operands(low, node, ins) -> None:
    """Refuse an element move whose operands after the data (indices, shape, starts, repeats) are
    computed from the model's input: the selection would depend on the data, not be a fixed map."""
    for k, v in enumerate(ins[1:], start=1):
        if isinstance(v, (Value, Displaced)):
            what = node.input[k] if k < len(node.input) else f"input {k}"
            low.unsupported(f"its operand {what!r} (input {k}: indices, shape or bounds) depends on the model's "
                            "input: a data-dependent selection, not a fixed map (make it a constant or an initializer)")


def moved(low, node, ins):
    """An element move (``INDEX_OPS``: Reshape, Gather, Slice, ...) whose operands after the data are constants."""
    constant_operands(low, node, ins)
    if node.op_type == "Squeeze" and not low.batch_fixed and not _squeeze_axes(node):
        low.unsupported("a Squeeze without axes removes every axis of size 1, at a batch of 1 the batch axis too, so "
                        "its output depends on the batch size (the batch is dynamic in this file): give the axes")
    if node.op_type == "Reshape" and not low.batch_fixed and isinstance(ins[0], (Value, Displaced)) and len(ins) > 1 \
            and not depends_on_batch(ins[1]):
        shape = np.asarray(ins[1]).reshape(-1).tolist()
        if shape and int(shape[0]) > 0:
            low.unsupported(f"its shape {shape} fixes the batch axis at {int(shape[0])} while the model's batch is "
                            "dynamic: the output's batch does not follow the input's (make its first entry 0 or -1, "
                            "or the file's batch fixed)")
    if node.op_type == "Unsqueeze" and any(a.name == "axes" for a in node.attribute):
        node = _sorted_unsqueeze(low, node, ins[0])
    return index(low, node, ins)


def _sorted_unsqueeze(low, node, v):
    """An Unsqueeze (opsets 1-11: ``axes`` an attribute) with its axes in increasing order of the output's rank: the
    specification places each by the output's rank whatever their order, where onnx's reference evaluator inserts
    them one after another in the order given ([3, 1] of a 4-d tensor put the new axis at 4, not 3)."""
    from onnx import helper

    axes = list(attrs(node)["axes"])
    rank = (len(v.shape) + 1 if isinstance(v, Value) else v.ids.ids.ndim if isinstance(v, Displaced) else np.ndim(v)) \
        + len(axes)
    ordered = sorted(int(a) % rank for a in axes)
    if len(set(ordered)) < len(ordered):  # ([2, -3] of a rank-3 input: one axis twice, which onnxruntime refuses)
        low.unsupported(f"its axes {axes} name one axis of its rank-{rank} output twice")
    if ordered == axes:
        return node
    kept = {k: x for k, x in attrs(node).items() if k != "axes"}
    return helper.make_node("Unsqueeze", list(node.input), list(node.output), name=node.name, axes=ordered, **kept)


def _squeeze_axes(node) -> bool:
    """Whether a Squeeze names its axes (an ``axes`` attribute up to opset 11, a second input from 13)."""
    return any(a.name == "axes" for a in node.attribute) or (len(node.input) > 1 and bool(node.input[1]))


def index(low, node, ins):
    """Run an index-moving op on element ids and compose the result with
    the pending selection maps of its inputs (as the torch frontend does)."""
    blocks, base = {}, []
    for k, v in enumerate(ins):
        if isinstance(v, Value):
            v = low.selectable(v)
            blocks[k] = (v.shape, None)
            base.append(v)
        elif isinstance(v, Displaced):
            blocks[k] = (v.ids.sizes, v.ids.ids)
            base.extend(v.base)
    try:
        decoded = run_on_ids(low.proto, node, ins, blocks, low.batch)
    except ValueError as err:
        low.unsupported(str(err))
    except Exception as err:
        low.fail(f"could not run it on element ids: {type(err).__name__}: {err}")
    outs = []
    for d in decoded:
        if d is None:
            outs.append(None)
        elif isinstance(d, list):
            outs.append(Sequence(_selected(low, base, x) for x in d))
        else:
            outs.append(_selected(low, base, d))
    first = next((v.where for v in ins if isinstance(v, Displaced)), None)
    for out in outs:  # still displaced: the op that first moved the batch axis is the one to name
        if first is not None and isinstance(out, Displaced):
            out.where = first
    return outs


def _selected(low, base: list, decoded):
    if isinstance(decoded, IdTensor):
        return Displaced(decoded, base, low)
    out_shape, per_input = decoded
    if not out_shape:
        low.unsupported("the result has no per-sample axis")
    return low.compose_selection(((v, per_input[j]) for j, v in enumerate(base)), out_shape)


def reduce_displaced(low, d: Displaced, axes: list[int], keep: bool, kind: str):
    """``kind`` ∈ {sum, mean, max} over ``axes`` of a displaced tensor whose axis 0 stacks activations with the
    batch on axis 1 (``torch.stack(xs, dim=0)``: Unsqueeze on axis 0, then Concat): each slice along axis 0 is an
    activation (its element ids with the batch first, every sample to itself); their sum, mean (1/k, a fixed
    factor) or elementwise max, reduced over the sample axes given too. None where the tensor is not so stacked,
    or the axes do not take axis 0 and leave the batch (the caller refuses)."""
    ids = d.ids.ids
    rank = ids.ndim
    axes = sorted({a % rank for a in axes})
    if keep or rank < 3 or 0 not in axes or 1 in axes or ids.shape[1] != low.batch:
        return None
    offsets = np.cumsum([0] + [low.batch * n for n in d.ids.sizes])
    slices = [_decode(ids[i], low.batch, offsets, d.ids.sizes) for i in range(ids.shape[0])]
    if any(isinstance(s, IdTensor) for s in slices):
        return None
    return reduce_stacking_axis(low, [_selected(low, d.base, s) for s in slices], axes, kind)


def split_to_sequence(low, node, ins):
    return index(low, node, ins)


def sequence_at(low, node, ins):
    seq, pos = ins[0], low.const(node, 1, "position")
    if not isinstance(seq, Sequence):
        low.unsupported("expected a sequence of activations")
    return [seq[int(np.asarray(pos).reshape(-1)[0])]]


#: the rules that read a Displaced tensor (every other rule refuses it)
READS_DISPLACED = frozenset({index, moved, gather_elements, scatter, pad, concat, split_to_sequence})
