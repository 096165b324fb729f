"""Lowering ONNX nodes to the IR.

The walk follows the torch frontend's conventions (it subclasses the lowering
core's ``Lowering``, so both produce the same nodes, biases and params for the same
network); each node is lowered by its rule in the op table (:mod:`.table`): an activation is a pending sum of terms (``values.Value``)
until a ReLU, a max-pool or a map that needs one source materializes it into a
node; constants (initializers, Constant nodes, and everything computed from
them or from activation *shapes*) are numpy arrays, folded with onnx's reference
evaluator.

Params are named by the initializer (tensor) name their node reads; a tensor
read by several param slots is one shared Param when it is the same weight in
the same layout, otherwise each later use is named ``tensor@node``. Every use is
recorded as a ``Binding`` (tensor, (node, input index) slots, role) for write-back.

A 2-d activation may carry its batch on axis 1 (Gemm with the activation as B,
or transA=1 reading it back); only Gemm, MatMul, Relu, Add, Identity and
Dropout accept that layout.
"""

from __future__ import annotations

import math

import numpy as np

from pathir.errors import PathirError, UnsupportedOperation
from pathir.frontends.core.lowering import Lowering
from pathir.frontends.core.values import NegInfPadded, Value, described, zero_constant
from pathir.frontends.onnx.batch_size import SHAPE_OPERANDS, alternatives, batch_sized, depends_on_batch
from pathir.frontends.onnx.evaluate import outer_names, run_node
from pathir.frontends.onnx.index import READS_DISPLACED, Displaced, Sequence
from pathir.frontends.onnx.layers import f64
from pathir.frontends.onnx.table import RULES
from pathir.frontends.onnx.why import AXIS1_OK, DEFAULT_WHY, QUANTIZED, SECOND_OUTPUT, WHY
from pathir.frontends.onnx.writer import Binding
from pathir.ir import Identity, Param, SourceRef, verify

__all__ = ["OnnxLowering"]


class OnnxLowering(Lowering):
    """Walks the live nodes of one ONNX graph and builds the IR."""

    def __init__(self, src, shapes: dict[str, tuple[int, ...]], batch: int | None, types: dict[str, int]):
        super().__init__(src.name)
        self.src, self.proto, self.types = src, src.proto, types
        self.batch = batch or 2  # shape arithmetic of a symbolic batch is evaluated at 2
        self.batch_fixed = batch is not None  # the file's inputs declare a number, not a symbol, for the batch
        self.shapes = shapes
        self.env: dict[str, object] = {}
        self.needed: set[str] = set()  # the tensors a live node or a graph output reads (set by run)
        self.axis1: set[str] = set()  # tensors holding a 2-d activation with the batch on axis 1
        self.bindings: dict[str, Binding] = {}
        self._claimed: set[str] = set()
        self._uses: dict[str, list] = {}
        self.stored: set[str] = set()  # tensors holding data as stored (not computed by the graph)
        self.at = ""

    # ------------------------------------------------------------ errors
    def unsupported(self, why: str, op: str | None = None):
        raise UnsupportedOperation(self.fx_name, op or self.op, self.at, why)

    def fail(self, what: str):
        raise PathirError(f"node '{self.fx_name}' ({self.op}) of '{self.src.name}': {what}")

    # ------------------------------------------------------------ the walk
    def run(self):
        from onnx import numpy_helper

        g = self.proto.graph
        for t in g.initializer:
            try:
                self.env[t.name] = numpy_helper.to_array(t)
            except (ValueError, TypeError) as err:
                raise PathirError(f"initializer '{t.name}' of '{self.src.name}' is corrupt: {err}") from None
            self.stored.add(t.name)
        inputs = [vi.name for vi in g.input if vi.name in self.shapes]
        for name in inputs:
            node = self.b.input(name, self.shapes[name], origin="ONNX graph input")
            self.env[name] = Value.of_node(node, self.shapes[name])
        live, needed, readers = self._live()
        self.needed = needed
        for i, node in enumerate(g.node):
            if not live[i]:
                continue
            self.fx_name = self.label = node.name or node.output[0]
            self.op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
            self.at = f"ONNX node #{i} of '{self.src.name}'"
            self.where = f"{self.label} ({self.op})"
            for o in node.output[1:]:
                if o and o in needed and node.op_type in ("BatchNormalization", "MaxPool", "Dropout"):
                    self.unsupported(f"its output '{o}' is used ({SECOND_OUTPUT[node.op_type]})")
            outs = self._lower(node)
            for name, value in zip(node.output, outs):
                if name:
                    self.env[name] = value
                    if isinstance(value, Value) and value.node is None and readers.get(name, 0) > 1 \
                            and not self.is_permutation(value):  # (a permutation holds no neurons: each reader
                        self.materialize(value)  # reads its node's) one node for every reader, not a copy per reader
        return self._outputs(inputs)

    def _live(self):
        """(live flag per node, tensors live nodes need, {tensor: live nodes and
        graph outputs reading it as data}); Shape/Size read only the shape."""
        g = self.proto.graph
        needed = {o.name for o in g.output}
        readers = dict.fromkeys(needed, 1)
        live = [False] * len(g.node)
        for i in range(len(g.node) - 1, -1, -1):
            node = g.node[i]
            if any(o in needed for o in node.output):
                live[i] = True
                outer = outer_names(node)  # what its subgraphs (If, Loop) read from this scope
                needed.update(x for x in [*node.input, *outer] if x)
                data = node.input[:1] if node.op_type == "CastLike" else [] if node.op_type in ("Shape", "Size") else \
                    [*node.input, *outer]
                for x in set(data) - {""}:
                    readers[x] = readers.get(x, 0) + 1
        return live, needed, readers

    def _input(self, name: str):
        if not name:
            return None
        if name not in self.env:
            self.fail(f"reads '{name}', which no node, initializer or graph input provides")
        return self.env[name]

    def _lower(self, node) -> list:
        ins = [self._input(x) for x in node.input]
        padded = next((v for v in ins if isinstance(v, NegInfPadded)), None)
        if padded is not None and node.op_type != "MaxPool":  # -inf padding is only a max-pool's own
            self.unsupported(f"reads {described(padded)}")
        acts = [k for k, v in enumerate(ins) if isinstance(v, (Value, Sequence, Displaced, NegInfPadded))]
        if not acts:
            if node.op_type in QUANTIZED:  # folding a quantized weight would hide how onnxruntime runs it
                self.unsupported(WHY[node.op_type])
            if node.op_type == "Constant" and any(a.name == "sparse_value" for a in node.attribute):
                self.unsupported("a sparse constant (its sparse_value attribute), which pathir does not read: "
                                 "store it dense (the Constant's value attribute, or an initializer)")
            if node.op_type == "Constant" or (node.op_type == "Identity" and node.input[0] in self.stored):
                self.stored.add(node.output[0])  # stored data, or an alias the exporter made of it
            outer = {x: self._input(x) for x in outer_names(node)}
            if any(isinstance(v, (Value, Sequence, Displaced)) for v in outer.values()):
                self.unsupported("control flow whose body reads an activation: not a fixed map")
            try:
                outs = run_node(self.proto, node, ins, outer)
            except Exception as err:  # the reference evaluator raises many types
                self.fail(f"constant folding failed: {type(err).__name__}: {err}")
            if any(depends_on_batch(v) for v in ins):  # the same at the second batch size (`batch_size`)
                alts = alternatives(ins)
                try:
                    alts = None if alts is None else run_node(self.proto, node, alts, outer)
                except Exception:  # (shapes that only fit the walk's batch): every entry taken to depend on it
                    alts = None
                outs = [o if not isinstance(o, np.ndarray) else batch_sized(o, None if alts is None else alts[k])
                        for k, o in enumerate(outs)]
            return outs
        op = node.op_type if node.domain in ("", "ai.onnx") else None
        for k in acts:
            if node.input[k] in self.axis1 and op not in AXIS1_OK:
                self.unsupported(f"'{node.input[k]}' has its batch on axis 1; "
                                 "only Gemm, MatMul, Relu and Add read that layout")
        rule = RULES.get(op) if op else None
        kept = _plus_zeros(op, ins, self.batch_fixed)
        if kept is not None:  # x + a block of zeros made from the batch size (U(zeros) in an unrolled RNN): x
            return [kept]
        if op not in SHAPE_OPERANDS:
            for k, v in enumerate(ins):
                if depends_on_batch(v):
                    self.unsupported(
                        f"its operand '{node.input[k]}' is computed from the batch size (Shape or Size of an "
                        f"activation, {np.asarray(v).ravel()[:4].tolist()} at the batch of {self.batch} pathir walks): "
                        "pathir's graph is per sample and this number changes with the batch (export the model with "
                        "the number as a constant, or without the division by the batch size)")
        displaced = [v for v in ins if isinstance(v, Displaced)]
        if displaced and op in ("Shape", "Size"):  # the id tensor has the real shape (at the walk's batch)
            return run_node(self.proto, node, [v.ids.ids if isinstance(v, Displaced) else v for v in ins])
        if displaced and rule not in READS_DISPLACED and not getattr(rule, "reads_displaced", False):
            displaced[0].refuse(f"'{self.label}' ({self.op})")
        if rule is not None:
            outs = list(rule(self, node, ins))
            for k, v in enumerate(outs):
                if isinstance(v, Value) and math.prod(v.shape) == 0:
                    name = node.output[k] if k < len(node.output) else ""
                    if name in self.needed:
                        self.fail(f"its output '{name}' has the empty per-sample shape {list(v.shape)}, and the "
                                  "graph reads it (pathir's neurons and edges need at least one element)")
                    outs[k] = None  # no element and no reader (a Split's empty part): nothing to lower
            return outs
        why = WHY.get(op, DEFAULT_WHY)
        if op in ("Softmax", "LogSoftmax") and any(o.name in node.output for o in self.proto.graph.output):
            why += "; at the output, export the model without it: pathir analyses the logits"
        self.unsupported(why)

    def _outputs(self, inputs):
        names = []
        for o in self.proto.graph.output:
            v = self.env.get(o.name)
            if isinstance(v, Displaced):
                v.refuse(f"the graph output '{o.name}'")
            if isinstance(v, NegInfPadded):
                self.fx_name, self.op, self.at = o.name, "output", f"graph output of '{self.src.name}'"
                self.unsupported(f"the graph returns {described(v)}")
            if not isinstance(v, Value):
                raise PathirError(
                    f"output '{o.name}' of '{self.src.name}' does not depend on the input (a constant or a shape "
                    "computation): it is not reached by the ReLU DAG; remove it from the graph outputs"
                )
            self.fx_name, self.op, self.at = o.name, "output", f"graph output of '{self.src.name}'"
            node = self.materialize(v, v.origin or o.name)
            if node in inputs:
                self.unsupported("the model returns its input unchanged")
            if node in names:
                node = self.b.identity(o.name, [(node, Identity())], origin=f"{o.name} (copy of output '{node}')")
            names.append(node)
        graph = self.b.build(outputs=names, check=False, prune_dead=True)
        used = {e.source for n in graph.nodes for e in n.edges}
        unused = [n for n in inputs if n not in used]
        if unused:
            graph = graph.replace_nodes([n for n in graph.nodes if n.name not in unused])

        return verify(graph), names

    # ------------------------------------------------------------ values
    def act(self, node, k: int) -> Value:
        v = self._input(node.input[k]) if k < len(node.input) else None
        if not isinstance(v, Value):
            self.unsupported(f"input {k} is expected to be an activation")
        return v

    def const(self, node, k: int, what: str, required: bool = True):
        v = self._input(node.input[k]) if k < len(node.input) else None
        if v is None and not required:
            return None
        if not isinstance(v, np.ndarray):
            self.unsupported(f"its {what} (input {k}) depends on the input: expected a constant")
        return v

    def bias_const(self, node, k: int):
        """A bias input, or None when absent or a computed (neither stored nor an
        alias of a stored tensor) all-zero constant: exporters write a missing
        bias that way, torch has none there."""
        c = self.const(node, k, "bias", required=False)
        if c is not None and node.input[k] not in self.stored and not np.any(c):
            return None
        return c

    def param_ref(self, node, k: int, key) -> tuple[str, bool]:
        """(ref name, reused) of input k in a param role described by ``key``.

        A tensor met again with an equal key (same role, layout and resulting
        value) is the same Param, a tied weight; otherwise its first use is
        named by the tensor and later ones ``tensor@node``."""
        t = node.input[k]
        for seen_key, name in self._uses.get(t, []):
            if _same_key(seen_key, key):
                return name, True
        name = t
        if name in self._claimed:
            base, i = f"{t}@{self.label}", 1
            name = base
            while name in self._claimed:
                name, i = f"{base}_{i}", i + 1
        self._claimed.add(name)
        self._uses.setdefault(t, []).append((key, name))
        return name, False

    def claim(self, name: str) -> str:
        """A ref name for a param that no tensor names (a Clip's threshold): ``name``, or ``name_1``,
        ``name_2``... when a tensor or another ref has it."""
        taken = self._claimed | set(self.bindings) | {t.name for t in self.proto.graph.initializer}
        ref, i = name, 1
        while ref in taken:
            ref, i = f"{name}_{i}", i + 1
        self._claimed.add(ref)
        return ref

    def bind(self, ref: str, node, k: int, kind: str, layout=None, eps: float = 0.0) -> None:
        key = (node.output[0], k)
        b = self.bindings.get(ref)
        if b is None:
            value = np.asarray(self.env[node.input[k]])
            self.bindings[ref] = Binding(node.input[k], [key], value, kind, layout, eps)
        else:
            b.slots.append(key)

    def weight(self, node, k: int, value: np.ndarray, transposed: bool, how: str) -> Param:
        """The Param of a weight slot (one shared Param for a tensor reused alike)."""
        ref, _ = self.param_ref(node, k, ("weight", transposed, value))
        p = self.param(ref, value, (SourceRef(ref, transposed=transposed),), how)
        self.bind(ref, node, k, "weight")
        return p

    def bias(self, node, k: int, vector: np.ndarray, layout: tuple[int, ...], how: str = "", kind: str = "bias") -> Param:
        """The bias param of input k; ``kind`` ``neg_bias`` where the param is the tensor's negative (Sub)."""
        ref, _ = self.param_ref(node, k, (kind, layout, vector))
        p = self.param(ref, vector, (SourceRef(ref),), how)
        self.bind(ref, node, k, kind, layout)
        return p

    def channel_vector(self, c: np.ndarray, v: Value, axis: int, scale: float = 1.0, what: str = "bias"):
        """(per-channel vector, layout) of a constant added to activation ``v`` (``what`` it is: a bias, a
        clip threshold): it must broadcast to one value per channel."""
        c = f64(c)
        if not np.all(np.isfinite(c)):
            bad = c.reshape(-1)[~np.isfinite(c.reshape(-1))][0]
            self.unsupported(f"a constant of shape {list(c.shape)} with a non-finite entry ({bad}): no bias or "
                             "threshold is a number there")
        c = c * scale
        full = (1, *v.shape) if axis == 0 else (v.shape[0], 1)
        if axis == 0 and self.batch_fixed and self.batch > 1 and c.ndim == len(full) and c.shape[0] == self.batch:
            if not np.all(c == c[:1]):  # a file of fixed batch N may carry a bias expanded over it
                self.unsupported(f"the constant of shape {list(c.shape)} spans the file's fixed batch of {self.batch} "
                                 "with a different value per sample: pathir's graph is one sample's, and a bias is "
                                 "the same for every sample")
            c = c[:1]
        ch = 1 if axis == 0 else 0
        try:
            shape = np.broadcast_shapes(c.shape, full)
        except ValueError:
            self.unsupported(f"a constant of shape {list(c.shape)} does not broadcast to the activation {list(v.shape)}")
        if tuple(shape) != full:
            self.unsupported(f"adding a constant of shape {list(c.shape)} to an activation of per-sample shape "
                             f"{list(v.shape)} changes its shape")
        cb = np.moveaxis(np.broadcast_to(c, full), ch, 0).reshape(full[ch], -1)
        if not np.all(cb == cb[:, :1]):
            self.unsupported(f"the constant of shape {list(c.shape)} varies over positions: pathir's {what} is one number "
                             "per channel")
        right = len(full) - ch
        nd = max(c.ndim, right)
        layout = [1] * nd
        layout[nd - right] = full[ch]
        return cb[:, 0].copy(), tuple(layout)

    def same_axis(self, node):
        """The output of ``node`` keeps its first input's batch axis (axis 1 or 0)."""
        if node.input[0] in self.axis1:
            self.axis1.add(node.output[0])


def _same_key(a, b) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and x.shape == y.shape and np.array_equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _plus_zeros(op, ins, batch_fixed: bool):
    """The activation of ``x + z`` (Add, either order) or ``x - z`` (Sub) where z is a block of zeros at every
    batch size (made from the batch size, its value and its alternative both 0; or of the file's fixed batch) that
    does not widen x; else None."""
    if op not in ("Add", "Sub") or len(ins) != 2:
        return None
    for k in ((0, 1) if op == "Add" else (1,)):
        z, x = ins[k], ins[1 - k]
        if not (isinstance(x, Value) and isinstance(z, np.ndarray) and z.ndim == len(x.shape) + 1 and zero_constant(z)):
            continue
        zero_everywhere = z.alt is not None and not np.any(z.alt) if depends_on_batch(z) else batch_fixed
        if zero_everywhere and all(d in (1, n) for d, n in zip(z.shape[1:], x.shape)):
            return x
    return None
