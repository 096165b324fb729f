"""ONNX rules for arithmetic inside the ReLU DAG model: Sub and Neg (a fixed −1 edge), Mul / Div by a
constant (a scalar, or one factor per channel, position or element: a fixed edge), Max of activations
(a max-pool neuron over its operands), LeakyRelu(alpha=0; alpha=1 is the identity) and Clip(min=0, no max or its type's largest
finite value) as ReLU, Clip(min=0, max=t) and Min(Relu(x), t) with t a constant per channel as clipped ReLUs
(:mod:`..core.clipped`), ReduceSum / ReduceMean / ReduceMax over any non-batch axes (fixed edges, or a max-pool neuron), Where
with a constant mask. The semantics are the lowering core's (:mod:`..core.fixed_factors`,
:mod:`..core.reductions`), shared with the torch rules, so both frontends build the same graph."""

from __future__ import annotations

import numpy as np

from pathir.frontends.core.clipped import ClipLayout, clip_layout, threshold_vector
from pathir.frontends.core.fixed_factors import fixed_scale
from pathir.frontends.core.reductions import all_spatial, elementwise_max, reduce, where
from pathir.frontends.core.values import Value
from pathir.frontends.onnx.elementwise import add_activations, add_constant
from pathir.frontends.onnx.index import Displaced, reduce_displaced
from pathir.frontends.onnx.layers import attrs
from pathir.frontends.onnx.load import float_info, numpy_dtype
from pathir.frontends.onnx.writer import Binding
from pathir.ir import Role, SourceRef

__all__ = ["sub", "neg", "mul", "div", "max_", "min_", "leaky_relu", "thresholded_relu", "clip", "where_", "reduce_sum", "reduce_mean",
           "reduce_max"]


def _scalar(c) -> float | None:
    numeric = isinstance(c, np.ndarray) and (np.issubdtype(c.dtype, np.floating) or np.issubdtype(c.dtype, np.integer))
    if numeric and c.size == 1:
        return float(c.reshape(-1)[0])
    return None


def _constant(c) -> np.ndarray | None:
    numeric = isinstance(c, np.ndarray) and (np.issubdtype(c.dtype, np.floating) or np.issubdtype(c.dtype, np.integer))
    return c.astype(np.float64) if numeric else None


def sub(low, node, ins):
    """a − b of two activations (a fixed −1 edge), or with one a constant per channel: x − c a bias −c, c − x a
    fixed −1 edge then the bias c."""
    a, b = ins
    if isinstance(a, Value) and not isinstance(b, Value):
        return [add_constant(low, node, a, 0, sign=-1.0)]
    if isinstance(b, Value) and not isinstance(a, Value):
        return [add_constant(low, node, fixed_scale(low, b, -1.0), 1)]
    if not (isinstance(a, Value) and isinstance(b, Value)):
        low.unsupported("subtracts two constants")
    if a.shape != b.shape:
        low.unsupported(f"subtracts activations of shapes {list(a.shape)} and {list(b.shape)}: "
                         "broadcasting is not lowered")
    return [low.add(a, fixed_scale(low, b, -1.0))]


def neg(low, node, ins):
    return [fixed_scale(low, low.act(node, 0), -1.0)]


def mul(low, node, ins):
    """An activation times a constant c (one scalar, or an initializer / constant of one factor per
    channel, position or element): a fixed edge of weight c (as torch's ``x * c``, ``x * low.buf``).
    ONNX does not tell a learnable tensor from a constant: the factor is fixed, never rescaled."""
    a, b = ins
    k = 0 if isinstance(a, Value) else 1
    if isinstance(ins[1 - k], Value):
        low.unsupported("a product of two activations (a gate) is not positively homogeneous of degree 1")
    _rank_kept(low, ins[k], ins[1 - k])
    c = _scalar(ins[1 - k])
    if c is None:
        c = _constant(ins[1 - k])
    if c is None:
        low.unsupported("a product with a constant that is not numeric")
    return [fixed_scale(low, ins[k], c)]


def _rank_kept(low, v, c) -> None:
    """Refuse a constant of higher rank than the activation (batch included): broadcasting adds leading
    axes, so the batch axis would no longer be first (onnxruntime's output gains them)."""
    rank = len(v.shape) + 1
    if np.ndim(c) > rank:
        low.unsupported(f"a constant of shape {list(np.shape(c))} with an activation of rank {rank} (batch included): "
                        f"broadcasting adds {np.ndim(c) - rank} leading axes, so the batch axis is no longer first")


def div(low, node, ins):
    a, b = ins
    if isinstance(b, Value):
        low.unsupported("division by an activation is not positively homogeneous")
    if isinstance(a, Value):
        _rank_kept(low, a, b)
    c = _scalar(b)
    if c is None:
        c = _constant(b)
        if c is not None and np.any(c == 0):
            c = None
    if c is None or np.ndim(c) == 0 and c == 0:
        low.unsupported("division by a constant that is not numeric and non-zero everywhere")
    return [fixed_scale(low, a, 1.0 / np.asarray(c, dtype=np.float64) if np.ndim(c) else 1.0 / c)]


def max_(low, node, ins):
    """The max of activations (a max-pool node over them); with zero constants, Max(x, 0) = ReLU(x)."""
    acts = [v for v in ins if isinstance(v, Value)]
    zeros = [np.asarray(v) for v in ins if not isinstance(v, Value)]
    if any(z.size and np.any(z != 0) for z in zeros):
        low.unsupported("a max with a non-zero constant: clipping at a fixed non-zero level is not positively homogeneous")
    full = (1, *acts[0].shape)
    if any(z.ndim > len(full) or np.broadcast_shapes(z.shape, full) != full for z in zeros):
        low.unsupported("a max with a zero constant that broadcasts the activation to a larger shape")
    out = acts[0] if len(acts) == 1 else elementwise_max(low, acts)
    return [low.relu(out) if zeros else out]


def leaky_relu(low, node, ins):
    """alpha 0: a ReLU; alpha 1: the identity (x·1 is x in every float); any other slope is refused."""
    alpha = attrs(node).get("alpha", 0.01)
    if alpha == 1:
        return [low.act(node, 0)]
    if alpha != 0:
        low.unsupported("LeakyRelu with a slope other than 0 or 1: pathir's neurons are identity, ReLU and max-pool only")
    return [low.relu(low.act(node, 0))]


def thresholded_relu(low, node, ins):
    """alpha 0: a ReLU (x where x > 0, else 0); any other threshold is refused."""
    alpha = attrs(node).get("alpha", 1.0)
    if alpha != 0:
        low.unsupported(f"not positively homogeneous: ThresholdedRelu(x) is x where x > alpha and 0 elsewhere, a cut "
                        f"at alpha = {alpha:g} that does not scale with x (f(λx) ≠ λ·f(x) for λ > 0), so rescaling a "
                        "neuron would change the function (at alpha = 0 it is a ReLU)")
    return [low.relu(low.act(node, 0))]


def clip(low, node, ins):
    a = attrs(node)
    lo = ins[1] if len(ins) > 1 and ins[1] is not None else a.get("min")
    hi = ins[2] if len(ins) > 2 and ins[2] is not None else a.get("max")
    if isinstance(lo, Value) or isinstance(hi, Value):
        low.unsupported("Clip at a bound computed from the input: not positively homogeneous")
    lo_s = None if lo is None else _scalar(np.asarray(lo, dtype=np.float64))
    hi_s = None if hi is None else _scalar(np.asarray(hi, dtype=np.float64))
    info = float_info(numpy_dtype(low.types.get(node.input[0], 1)))
    if hi_s is not None and info is not None and hi_s >= float(info.max):
        hi_s = None  # max = the largest finite value of its type (opset 6-10's default, FLT_MAX): no finite x passes it
    if (lo_s is None or lo_s == -np.inf) and (hi_s is None or hi_s == np.inf):  # no bound: the identity
        low.same_axis(node)
        return [low.act(node, 0)]
    if lo_s == 0.0 and (hi_s is None or hi_s == np.inf):
        return [low.relu(low.act(node, 0))]
    if lo_s == 0.0 and hi_s is not None:
        return [_clip_node(low, node, hi_s)]
    low.unsupported("clips below at a bound other than 0 (or only above): not positively homogeneous; Clip(min=0) "
                    "is a ReLU and Clip(min=0, max=t) a clipped ReLU, ReLU(x) - ReLU(ReLU(x) - t)")


def _clip_node(low, node, t: float) -> Value:
    """Clip(x, 0, t): a clipped ReLU whose threshold param is bound to the Clip node itself (``<node>.threshold``);
    a write-back that moves its channels rewrites the node as Relu then Min with a per-channel constant."""
    v = low.act(node, 0)
    layout = clip_layout(low, v)
    c = layout.channels
    what = f"Clip '{low.label}'"
    vec = threshold_vector(low, t, c, what)
    ref = low.claim(f"{low.label}.threshold")
    dtype = numpy_dtype(low.types.get(node.input[0], 1))
    tensor = node.input[2] if len(node.input) > 2 else ""
    shape = _threshold_shape(layout, len(v.shape))
    low.bindings[ref] = Binding(tensor, [(node.output[0], 2)], np.asarray(t, dtype=dtype), "clip", shape)
    # channels along no single axis (a permutation that mixes them): no Min constant holds them, the Clip holds them
    source = SourceRef(ref, Role.CLIP_THRESHOLD, fixed=shape is None)
    p = low.param(ref, vec, (source,), f"-{t:g}, the threshold of {what}")
    return low.clipped_relu(v, p, layout)


def _threshold_shape(layout, ndim: int) -> tuple | None:
    """The shape (1, 1, ..., C, ..., 1) of a Min constant of one threshold per channel of ``layout`` (a
    ClipLayout) against an activation of ``ndim`` per-sample axes, batch first; None where no axis holds them."""
    if layout.axis is None:
        return None
    return (1, *(layout.channels if j == layout.axis else 1 for j in range(ndim)))


def min_(low, node, ins):
    """Min(Relu(x), t) with t a constant of one value per channel: a clipped ReLU, its threshold bound to
    the constant (as Relu then Min is what a write-back of a rescaled Clip(min=0, max=t) writes)."""
    acts = [k for k, v in enumerate(ins) if isinstance(v, Value)]
    if len(ins) != 2 or len(acts) != 1:
        low.unsupported("an elementwise min is lowered only as Min(Relu(x), t) with t a constant per channel "
                        "(a clipped ReLU)")
    k = acts[0]
    v, c = ins[k], ins[1 - k]
    if not low.is_relu_output(v) or _constant(c) is None:
        low.unsupported("an elementwise min is lowered only as Min(Relu(x), t) with t a constant per channel "
                        "(a clipped ReLU)")
    clip = clip_layout(low, v)
    found = _permuted_thresholds(low, c, v, clip) if clip.permuted else None
    if found is None:  # v's own layout (a permutation's threshold per token: exact, its features tied by it)
        clip = ClipLayout.own(v.shape)
        found = low.channel_vector(c, v, 0, what="clip threshold")
    vec, layout = found
    neg = threshold_vector(low, vec, clip.channels, f"Min '{low.label}'")
    ref, _ = low.param_ref(node, 1 - k, ("clip_min", layout, vec))
    source = SourceRef(ref, Role.CLIP_THRESHOLD, fixed=layout is None)  # (None: no constant of its shape holds them)
    p = low.param(ref, neg, (source,), f"-{node.input[1 - k]}, per channel")
    low.bind(ref, node, 1 - k, "clip_min", layout)
    return [low.clipped_relu(v, p, clip)]


def _permuted_thresholds(low, c, v, clip) -> tuple | None:
    """(one threshold per channel of ``clip``, a permuted ClipLayout, the shape a rescaled vector of them is
    written in, or None where the constant cannot hold one value per channel: channels along no single axis) of
    the Min constant ``c`` against the activation ``v``; None where the constant varies within a channel."""
    t = np.asarray(_constant(c), dtype=np.float64)
    full = (1, *v.shape)
    if not np.all(np.isfinite(t)):
        low.unsupported(f"a Min constant of shape {list(t.shape)} with a non-finite entry: no threshold is a number there")
    try:
        ok = t.ndim <= len(full) and np.broadcast_shapes(t.shape, full) == full
    except ValueError:
        ok = False
    if not ok:
        low.unsupported(f"a Min constant of shape {list(t.shape)} does not broadcast to the activation {list(v.shape)}")
    per = clip.per_channel(np.broadcast_to(t, full)[0])
    if per is None:
        return None
    return per, (_threshold_shape(clip, len(v.shape)) if clip.holds(t.shape, len(v.shape)) else None)


def _reduce(low, node, kind, x):
    a = attrs(node)
    axes = a.get("axes")
    if axes is None and len(node.input) > 1 and node.input[1]:
        axes = low.const(node, 1, "axes").reshape(-1).tolist()
    keep = bool(a.get("keepdims", 1))
    if isinstance(x, Displaced):  # torch.stack(xs, dim=0) reduced over dim 0
        out = reduce_displaced(low, x, [int(a) for a in axes or ()], keep, kind)
        if out is None:
            x.refuse(f"'{low.label}' ({node.op_type} over axes {list(axes or [])}, keepdims={int(keep)}: only a "
                     "reduction over the stacking axis 0 without keepdims reads it)")
        return [out]
    v = low.act(node, 0)
    if not axes:
        if a.get("noop_with_empty_axes", 0):
            return [v]
        low.unsupported(f"a {kind} over every axis, the batch included")
    axes = [int(x) for x in axes]
    if kind == "mean" and all_spatial(v, axes):
        return [low.mean(v, axes, keep)]  # the global average pool
    return [reduce(low, v, axes, keep, kind)]


def where_(low, node, ins):
    cond, a, b = ins
    return [where(low, cond, a, b)]


def reduce_sum(low, node, ins):
    return _reduce(low, node, "sum", ins[0])


def reduce_mean(low, node, ins):
    return _reduce(low, node, "mean", ins[0])


def reduce_max(low, node, ins):
    return _reduce(low, node, "max", ins[0])


for _rule in (reduce_sum, reduce_mean, reduce_max):
    _rule.reads_displaced = True  # torch.stack(xs, dim=0) reduced over dim 0 (reduce_displaced)


def sum_(low, node, ins):
    """Sum (variadic) of activations of one shape and batch axis: their sum; Mean: that times 1/n (a fixed
    factor). A constant among them would be a fixed bias no parameter carries (Add takes one as a bias)."""
    if not all(isinstance(v, Value) for v in ins):
        low.unsupported(f"a {node.op_type} with a constant operand: a fixed bias no parameter carries "
                        "(write it as an Add with a bias initializer)")
    total = add_activations(low, node, ins)
    return [fixed_scale(low, total, 1.0 / len(ins)) if node.op_type == "Mean" and len(ins) > 1 else total]
