"""Running single ONNX nodes with onnx's reference evaluator.

Two uses while lowering:

- constant folding: a node that reads no activation (the Shape / Gather /
  Unsqueeze / Concat arithmetic exporters leave in front of a Reshape, weight
  transforms, Constant nodes) is evaluated to a numpy array;
- index-moving ops (Reshape, Flatten, Transpose, Slice, Split, Concat, ...) are
  run on tensors of *element ids*: element e of sample b of activation input k
  holds 1 + offset_k + b * numel_k + e, zero stands for "no element" (zero
  padding). The output says which input element lands where, and whether the
  op keeps every sample to itself (the batch axis first, samples not mixed). An
  output that does not is kept as its id tensor until a later index op puts the
  batch first again (dynamo's Transpose -> ScatterND -> Transpose), or refused
  where anything else reads it.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["run_node", "run_on_ids", "IdTensor"]


def _value_info(name: str, value: np.ndarray):
    from onnx import helper

    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), None)


def outer_names(node) -> list[str]:
    """The names a node's subgraphs (If / Loop / Scan bodies, nested) read from the enclosing
    scope: inputs of their nodes that no node, input or initializer of the subgraph provides."""
    from onnx import AttributeProto

    found: list[str] = []

    def visit(graph, bound):
        bound = bound | {i.name for i in graph.input} | {t.name for t in graph.initializer}
        for n in graph.node:
            for x in n.input:
                if x and x not in bound and x not in found:
                    found.append(x)
            for sub in _subgraphs(n, AttributeProto):
                visit(sub, bound)
            bound = bound | set(n.output)

    for sub in _subgraphs(node, AttributeProto):
        visit(sub, set())
    return found


def _subgraphs(node, AttributeProto):
    for a in node.attribute:
        if a.type == AttributeProto.GRAPH:
            yield a.g
        elif a.type == AttributeProto.GRAPHS:
            yield from a.graphs


def run_node(proto, node, inputs: list, outer: dict | None = None) -> list[np.ndarray]:
    """Evaluate ``node`` (of model ``proto``, for its opsets and functions) on
    numpy ``inputs`` (None for an absent optional input); ``outer`` holds the values its
    subgraphs read from the enclosing scope (see :func:`outer_names`). Returns its outputs."""
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    feeds, infos = {}, []
    for name, value in [*zip(node.input, inputs), *(outer or {}).items()]:
        if not name or name in feeds:
            continue
        value = np.asarray(value)
        feeds[name] = value
        infos.append(_value_info(name, value))
    outputs = [helper.make_tensor_value_info(o, 0, None) for o in node.output if o]
    graph = helper.make_graph([node], "node", infos, outputs)
    model = helper.make_model(graph, opset_imports=list(proto.opset_import), functions=list(proto.functions))
    model.ir_version = proto.ir_version
    try:
        result = ReferenceEvaluator(model).run(None, feeds)
    except Exception:  # an op or version the reference evaluator lacks (DequantizeLinear-13): onnxruntime's
        result = _onnxruntime_run(model, feeds)
        if result is None:
            raise
    out, it = [], iter(result)
    for o in node.output:
        r = next(it) if o else None
        out.append([np.asarray(x) for x in r] if isinstance(r, list) else None if r is None else np.asarray(r))
    return out


def _onnxruntime_run(model, feeds: dict) -> list | None:
    """The one-node ``model`` run by onnxruntime on ``feeds`` (None where it is missing or cannot)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    import onnx

    model = onnx.ModelProto.FromString(model.SerializeToString())
    for out in model.graph.output:  # onnxruntime takes an output without a type, not one of type 0
        out.ClearField("type")
    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, feeds)
    except Exception:
        return None


def run_on_ids(proto, node, inputs: list, blocks: dict[int, tuple], batch: int):
    """Run an index-moving ``node`` on element ids.

    ``inputs``: the node's inputs, constants as arrays; ``blocks``: {input position: ``(per-sample
    shape, None)`` for an activation (fresh ids), or ``(sizes, ids)`` for the id tensor of a displaced
    one (:class:`IdTensor`: ids over its own activations, whose per-sample sizes are ``sizes``)}. The
    activations are laid end to end in input order. Returns one result per output: ``(per-sample out
    shape, {activation j: index})``, index[t] being the element of activation j at output element t or -1; an
    :class:`IdTensor` where the output does not have the batch axis first with every sample to itself
    (a Transpose that moves it, undone by a later op); a list of them for a sequence output; None for
    an absent one. Raises ValueError if the op computes new values."""
    sizes: list[int] = []
    feeds = list(inputs)
    for k in sorted(blocks):
        shape_or_sizes, ids = blocks[k]
        start = int(batch * sum(sizes))
        if ids is None:
            n = math.prod(shape_or_sizes)
            feeds[k] = (np.arange(batch * n, dtype=np.int64) + 1 + start).reshape(batch, *shape_or_sizes)
            sizes.append(n)
        else:
            feeds[k] = np.where(ids > 0, ids + start, 0)
            sizes.extend(shape_or_sizes)
    result = run_node(proto, node, feeds)
    offsets = np.cumsum([0] + [batch * n for n in sizes])
    decode = lambda r: _decode(r, batch, offsets, sizes)
    return [None if r is None else [decode(x) for x in r] if isinstance(r, list) else decode(r) for r in result]


def _tiled(r, batch, offsets, sizes) -> bool:
    """Whether axis 0 of the ids ``r`` is the batch axis repeated: row i holds elements of sample i mod batch only."""
    if r.ndim == 0 or r.shape[0] <= batch or r.shape[0] % batch:
        return False
    flat = r.reshape(r.shape[0], -1)
    g = np.where(flat > 0, flat - 1, 0)
    which = np.searchsorted(offsets, g, side="right") - 1
    sample = (g - offsets[which]) // np.asarray(sizes)[which]
    return bool(np.all((flat <= 0) | (sample == (np.arange(r.shape[0]) % batch)[:, None])))


class IdTensor:
    """Element ids (over activations of per-sample ``sizes``, laid end to end) of an output whose batch
    axis is not first with every sample to itself; ``why`` says what the op did."""

    def __init__(self, ids: np.ndarray, sizes: list[int], why: str):
        self.ids, self.sizes, self.why = ids, list(sizes), why


def _decode(r, batch, offsets, sizes):
    """(per-sample shape, {activation j: index}) of one output tensor of ids, or an IdTensor where its
    batch axis is not first with every sample to itself."""
    r = np.asarray(r)
    total = int(offsets[-1])
    if r.dtype != np.int64:
        raise ValueError("the op computes new values instead of moving elements")
    flat = r.reshape(-1)
    if np.any((flat < 0) | (flat > total)):
        raise ValueError("the op computes new values instead of moving elements")
    if r.ndim == 0 or r.shape[0] != batch:
        why = (f"the op repeats the batch axis {r.shape[0] // batch} times" if _tiled(r, batch, offsets, sizes)
               else "the op does not keep the batch axis first")
        return IdTensor(r, sizes, why)
    flat = r.reshape(batch, -1)
    present = flat > 0
    g = np.where(present, flat - 1, 0)
    which = np.searchsorted(offsets, g, side="right") - 1
    local = g - offsets[which]
    per = np.asarray(sizes)[which]
    sample, elem = local // per, local % per
    same = np.all(present == present[:1]) and np.all(np.where(present, which == which[:1], True)) \
        and np.all(np.where(present, elem == elem[:1], True))
    own = np.all(np.where(present, sample == np.arange(batch)[:, None], True))
    if not (same and own):
        return IdTensor(r, sizes, "the op mixes the samples of a batch")
    index = {j: np.where(present[0] & (which[0] == j), elem[0], -1) for j in range(len(sizes))}
    return tuple(int(s) for s in r.shape[1:]), index
