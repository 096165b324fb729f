"""ONNX rules for the ops that only move elements (Reshape, Flatten, Transpose, Concat, Slice,
Gather, Pad with zeros, Split, DepthToSpace, ...): run on element ids by onnx's reference evaluator
and composed with the pending selection maps of their inputs (as the torch frontend does); Concat
along the channels stays at channel granularity; sequences of activations (SplitToSequence,
SequenceAt)."""

from __future__ import annotations

import numpy as np

from pathir.frontends.core.values import Value
from pathir.frontends.onnx.evaluate import run_on_ids
from pathir.frontends.onnx.layers import attrs

__all__ = ["Sequence", "concat", "pad", "index", "split_to_sequence", "sequence_at"]


class Sequence(list):
    """An ONNX sequence of activations (SplitToSequence), read by SequenceAt."""


def concat(low, node, ins):
    """Along the channels at channel granularity when it can, else on element ids."""
    if all(isinstance(v, Value) for v in ins):
        rank = len(ins[0].shape) + 1
        if attrs(node)["axis"] % rank == 1:
            out = low.cat_channels(list(ins))
            if out is not None:
                return [out]
    return index(low, node, ins)


def pad(low, node, ins):
    a = attrs(node)
    if a.get("mode", "constant") == "constant":
        value = ins[2] if len(ins) > 2 and ins[2] is not None else a.get("value", 0.0)
        if np.any(np.asarray(value) != 0):
            low.unsupported("padding with a non-zero constant adds a fixed value (a bias per position)")
        ins = list(ins[:2]) + [np.zeros((), dtype=np.int64)] + list(ins[3:]) if len(ins) > 2 else ins
    return index(low, node, ins)


def index(low, node, ins):
    """Run an index-moving op on element ids and compose the result with
    the pending selection maps of its inputs (as the torch frontend does)."""
    acts = {k: v.shape for k, v in enumerate(ins) if isinstance(v, Value)}
    try:
        decoded = run_on_ids(low.proto, node, ins, acts, low.batch)
    except ValueError as err:
        low.unsupported(str(err))
    except Exception as err:
        low.fail(f"could not run it on element ids: {type(err).__name__}: {err}")
    prepared = {k: low.selectable(ins[k]) for k in acts}
    outs = []
    for d in decoded:
        if d is None:
            outs.append(None)
        elif isinstance(d, list):
            outs.append(Sequence(_selected(low, prepared, x) for x in d))
        else:
            outs.append(_selected(low, prepared, d))
    return outs


def _selected(low, prepared: dict, decoded) -> Value:
    out_shape, per_input = decoded
    if not out_shape:
        low.unsupported("the result has no per-sample axis")
    return low.compose_selection(((v, per_input[k]) for k, v in prepared.items()), out_shape)


def split_to_sequence(low, node, ins):
    return index(low, node, ins)


def sequence_at(low, node, ins):
    seq, pos = ins[0], low.const(node, 1, "position")
    if not isinstance(seq, Sequence):
        low.unsupported("expected a sequence of activations")
    return [seq[int(np.asarray(pos).reshape(-1)[0])]]
