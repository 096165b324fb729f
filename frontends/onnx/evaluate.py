"""Running single ONNX nodes with onnx's reference evaluator.

Two uses while lowering:

- constant folding: a node that reads no activation (the Shape / Gather /
  Unsqueeze / Concat arithmetic exporters leave in front of a Reshape, weight
  transforms, Constant nodes) is evaluated to a numpy array;
- index-moving ops (Reshape, Flatten, Transpose, Slice, Split, Concat, ...) are
  run on tensors of *element ids*: element e of sample b of activation input k
  holds 1 + offset_k + b * numel_k + e, zero stands for "no element" (zero
  padding). The output says which input element lands where, and whether the
  op keeps every sample to itself (the batch axis first, samples not mixed).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["run_node", "run_on_ids"]


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
    result = ReferenceEvaluator(model).run(None, feeds)
    out, it = [], iter(result)
    for o in node.output:
        r = next(it) if o else None
        out.append([np.asarray(x) for x in r] if isinstance(r, list) else None if r is None else np.asarray(r))
    return out


def run_on_ids(proto, node, inputs: list, act_shapes: dict[int, tuple[int, ...]], batch: int):
    """Run an index-moving ``node`` on element ids.

    ``inputs``: the node's inputs, constants as arrays; ``act_shapes``: {input
    position: per-sample shape} of the activation inputs. Returns one
    (per-sample out shape, {input position: index}) per output (a list of them
    for a sequence output, None for an absent one), index[t] being the element
    of that input at output element t, or -1. Raises ValueError if
    the op moves the batch axis, mixes samples or computes new values."""
    positions = sorted(act_shapes)
    sizes = [math.prod(act_shapes[k]) for k in positions]
    offsets = np.cumsum([0] + [batch * n for n in sizes])
    feeds = list(inputs)
    for k, n, off in zip(positions, sizes, offsets):
        feeds[k] = (np.arange(batch * n, dtype=np.int64) + 1 + int(off)).reshape(batch, *act_shapes[k])
    result = run_node(proto, node, feeds)
    total = int(offsets[-1])
    decode = lambda r: _decode(r, batch, offsets, sizes, total, positions)
    return [None if r is None else [decode(x) for x in r] if isinstance(r, list) else decode(r) for r in result]


def _decode(r, batch, offsets, sizes, total, positions):
    """(per-sample shape, {input position: index}) of one output tensor of ids."""
    r = np.asarray(r)
    if r.dtype != np.int64 or r.ndim == 0 or r.shape[0] != batch:
        raise ValueError("the op does not keep the batch axis first")
    flat = r.reshape(batch, -1)
    if np.any((flat < 0) | (flat > total)):
        raise ValueError("the op computes new values instead of moving elements")
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
        raise ValueError("the op mixes the samples of a batch")
    index = {k: np.where(present[0] & (which[0] == i), elem[0], -1) for i, k in enumerate(positions)}
    return tuple(int(s) for s in r.shape[1:]), index
