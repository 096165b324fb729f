"""ONNX rules for the ops that pass an activation on or add to it: Relu, Identity, Dropout
(inference), Cast / CastLike (to a float type), Shape and Size (read off the activation's shape), Add
(of two activations, or of a constant bias per channel). Each rule is ``rule(low, node, inputs) ->
outputs`` on an :class:`~.lowering.OnnxLowering`."""

from __future__ import annotations

import math

import numpy as np

from pathir.frontends.core.values import Value
from pathir.frontends.onnx.batch_size import ALT_BATCH, batch_sized
from pathir.frontends.onnx.layers import attrs
from pathir.frontends.onnx.load import numpy_dtype

__all__ = ["relu", "identity", "dropout", "cast", "cast_like", "shape", "size", "add"]


def relu(low, node, ins):
    out = low.relu(low.act(node, 0))
    low.same_axis(node)
    return [out]


def identity(low, node, ins):
    low.same_axis(node)
    return [ins[0]]


def dropout(low, node, ins):
    if len(ins) > 2 and ins[2] is not None:
        if not isinstance(ins[2], np.ndarray) or bool(np.asarray(ins[2]).reshape(-1)[0]):
            low.unsupported("dropout in training mode is random: pathir lowers inference semantics only")
    low.same_axis(node)
    return [ins[0], None]


#: ONNX float types -> (mantissa bits, exponent bits): a cast from a to b is exact iff b has both at least
#: as wide (float16 and bfloat16 hold neither's values)
_FLOAT_BITS = {1: (23, 8), 11: (52, 11), 10: (10, 5), 16: (7, 8)}
_FLOAT_NAMES = {1: "float32", 11: "float64", 10: "float16", 16: "bfloat16"}


def cast(low, node, ins):
    """A cast of an activation is nothing where it is exact (to a float type as wide in mantissa and
    exponent as the activation's); a narrowing cast rounds every value, which pathir does not model."""
    _exact_cast(low, node, attrs(node).get("to"))
    low.same_axis(node)
    return [ins[0]]


def _exact_cast(low, node, to) -> None:
    """Refuse a cast below the model's precision (its first float input's type, the precision its outputs
    are compared in): it rounds every value. A cast back to it after a widening one is exact."""
    if to not in _FLOAT_BITS:
        low.unsupported("a cast of an activation to a non-float type")
    inputs = [low.types.get(i.name) for i in low.proto.graph.input]
    model = next((t for t in inputs if t in _FLOAT_BITS), None)
    if model is not None and any(t < m for t, m in zip(_FLOAT_BITS[to], _FLOAT_BITS[model])):
        low.unsupported(f"a cast of an activation to {_FLOAT_NAMES[to]} in a {_FLOAT_NAMES[model]} model rounds every "
                        "value (a narrowing cast, e.g. a half-precision round trip): not an exact linear map; export "
                        "the model in one precision")


def cast_like(low, node, ins):
    if isinstance(ins[0], Value):
        _exact_cast(low, node, low.types.get(node.input[1], 1))
        low.same_axis(node)
        return [ins[0]]

    return [np.asarray(ins[0]).astype(numpy_dtype(low.types.get(node.input[1], 1)))]


def shape(low, node, ins):
    """The activation's shape at the walk's batch size, marked with the one at another (`batch_size`)."""
    v = ins[0]
    a = attrs(node)
    start, end = a.get("start", 0), a.get("end", None)

    def at(batch):
        full = [batch, *v.shape] if node.input[0] not in low.axis1 else [v.shape[0], batch]
        return np.asarray(full[start:end], dtype=np.int64)

    return [batch_sized(at(low.batch), at(low.batch + ALT_BATCH))]


def size(low, node, ins):
    n = math.prod(ins[0].shape)
    return [batch_sized(np.asarray(low.batch * n, dtype=np.int64), np.asarray((low.batch + ALT_BATCH) * n, dtype=np.int64))]


def add_activations(low, node, ins) -> Value:
    """The sum of the activations ``ins`` (every input of ``node``): one shape and one batch axis, else refused."""
    if len({x in low.axis1 for x in node.input}) != 1:
        low.unsupported(f"adds {'two ' if len(ins) == 2 else ''}activations whose batch axes differ")
    if len({v.shape for v in ins}) != 1:
        low.unsupported(f"adds activations of shapes {' and '.join(str(list(v.shape)) for v in ins)}: "
                        "broadcasting is not lowered")
    low.same_axis(node)
    total = ins[0]
    for v in ins[1:]:
        total = low.add(total, v)
    return total


def add(low, node, ins):
    a, b = ins
    if isinstance(a, Value) and isinstance(b, Value):
        return [add_activations(low, node, ins)]
    k = 0 if isinstance(a, Value) else 1
    return [add_constant(low, node, ins[k], k)]


def add_constant(low, node, v: Value, k: int, sign: float = 1.0) -> Value:
    """v + sign · c, v the activation at the node's input k and c its other input, a constant that broadcasts to
    one value per channel: a bias param bound to c (kind ``neg_bias`` for sign −1: the param is −c, and a write-back
    writes c = −param). An all-zero computed constant adds nothing."""
    c = low.bias_const(node, 1 - k)
    axis = 1 if node.input[k] in low.axis1 else 0
    if axis:
        low.axis1.add(node.output[0])
    if c is None:
        return v
    if not axis and _along_last_axis(c, v):
        return _add_along_last_axis(low, node, v, k, c, sign)
    vec, layout = low.channel_vector(c, v, axis, scale=sign)
    if v.bias is not None:
        v = Value.of_node(low.materialize(v), v.shape)
    verb = "added" if sign > 0 else "subtracted"
    p = low.bias(node, 1 - k, vec, layout, f"{node.input[1 - k]} ({verb} by {low.label})",
                 kind="bias" if sign > 0 else "neg_bias")
    return Value(v.terms, v.shape, p, low.label)


def _along_last_axis(c, v: Value) -> bool:
    """Whether the constant ``c`` holds one value per entry of the last axis of ``v`` (per-sample shape (*S, F), S
    non-empty), the same at every other position: the bias of a MatMul on that axis (a per-token layer)."""
    shape = np.shape(c)
    return (len(v.shape) >= 2 and 1 <= len(shape) <= len(v.shape) + 1 and shape[-1] == v.shape[-1] > 1
            and all(d == 1 for d in shape[:-1]))


def _add_along_last_axis(low, node, v: Value, k: int, c, sign: float) -> Value:
    """v + sign · c, c one value per entry of v's last axis: the bias of the neurons of v with that axis moved
    first (an index op, no neuron), moved back after."""
    c = np.asarray(c, dtype=np.float64)
    if not np.all(np.isfinite(c)):  # (named by the stored shape, before the reshape below)
        bad = c.reshape(-1)[~np.isfinite(c.reshape(-1))][0]
        low.unsupported(f"a constant of shape {list(c.shape)} with a non-finite entry ({bad}): no bias or threshold "
                        "is a number there")
    verb = "added" if sign > 0 else "subtracted"

    def bias(first):
        vec, _ = low.channel_vector(np.reshape(c, (first.shape[0],) + (1,) * (len(first.shape) - 1)), first, 0,
                                    scale=sign)
        return low.bias(node, 1 - k, vec, tuple(c.shape), f"{node.input[1 - k]} ({verb} by {low.label})",
                        kind="bias" if sign > 0 else "neg_bias")

    return low.bias_on_last_axis(v, bias)
