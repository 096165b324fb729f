"""Lowering ONNX nodes to the IR.

The walk follows the torch frontend's conventions (it subclasses its
``Lowering``, so both produce the same nodes, biases and params for the same
network): an activation is a pending sum of terms (``torch_values.Value``)
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
from pathir.ir import Conv, Dense, Identity, Param, Pool, SourceRef, pool_output_size

from .onnx_eval import run_node, run_on_ids
from .onnx_writer import Binding
from .torch_ops import Lowering
from .torch_values import ParamTensor, Value, selection_index, selection_map

__all__ = ["OnnxLowering"]

_NOT_HOMOGENEOUS = "not positively homogeneous: f(λx) ≠ λ·f(x) for λ > 0, so rescaling a neuron would change the function"
_NORMALIZES = "normalizes by statistics of the activation itself (an input-dependent scale): not positively homogeneous"

#: why an op has no place in a ReLU DAG (MATH.md §1)
WHY = {
    **{op: _NOT_HOMOGENEOUS for op in (
        "Sigmoid", "Tanh", "Gelu", "FastGelu", "Elu", "Selu", "Celu", "Softplus", "Softsign", "Mish", "HardSigmoid",
        "HardSwish", "Swish", "Exp", "Log", "Sqrt", "Erf", "Sin", "Cos", "Reciprocal", "Sign", "Round", "Floor", "Ceil",
        "ThresholdedRelu", "Shrink",
    )},
    "Clip": "clips at fixed thresholds (ReLU6, hardtanh): rescaling the input moves where it saturates, so it is not positively homogeneous",
    "LeakyRelu": "positively homogeneous, but pathir's neurons are identity, ReLU and max-pool only",
    "PRelu": "positively homogeneous, but pathir's neurons are identity, ReLU and max-pool only",
    "Abs": "positively homogeneous, but pathir's neurons are identity, ReLU and max-pool only",
    "Softmax": "softmax inside the graph normalizes across features: not positively homogeneous",
    "LogSoftmax": "log-softmax normalizes across features: not positively homogeneous",
    "Hardmax": "not positively homogeneous",
    **{op: _NORMALIZES for op in (
        "LayerNormalization", "GroupNormalization", "InstanceNormalization", "LpNormalization", "LRN",
        "MeanVarianceNormalization", "RMSNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
    )},
    "Attention": "attention multiplies activations together (queries by keys, weights by values)",
    "MultiHeadAttention": "attention multiplies activations together (queries by keys, weights by values)",
    "Mul": "a product with an activation (a gate between activations, or a constant factor pathir does not lower)",
    "Div": "a division involving an activation",
    "Pow": "a power of an activation: not positively homogeneous",
    "Sub": "a difference: pathir lowers sums of activations (Add) and constant biases only",
    "Max": "an elementwise max of activations is not a ReLU DAG neuron",
    "Min": "an elementwise min of activations is not a ReLU DAG neuron",
    "Neg": "a fixed weight of -1 between activations is not lowered",
    "ConvTranspose": "transposed convolutions are not lowered yet",
    "LpPool": "an Lp pool is not positively homogeneous of degree 1 per window",
    "ReduceMax": "a max over an axis is not lowered (use MaxPool)",
    "ReduceSum": "only the mean over all spatial axes is lowered (ReduceMean)",
    "TopK": "selects by value: not a fixed map",
    "Resize": "resizing is not lowered",
    "Upsample": "upsampling is not lowered",
    "If": "control flow on activations is not lowered",
    "Loop": "control flow on activations is not lowered",
    "Scan": "control flow on activations is not lowered",
}

#: ops that move elements without computing: lowered by running them on element ids
INDEX_OPS = frozenset({
    "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Concat", "Split", "Slice", "Gather", "Expand",
    "Tile", "Pad", "DepthToSpace", "SpaceToDepth",
})


class Sequence(list):
    """An ONNX sequence of activations (SplitToSequence), read by SequenceAt."""


def _attrs(node) -> dict:
    from onnx import helper

    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


class OnnxLowering(Lowering):
    """Walks the live nodes of one ONNX graph and builds the IR."""

    def __init__(self, src, shapes: dict[str, tuple[int, ...]], batch: int | None, types: dict[str, int]):
        super().__init__(src.name)
        self.src, self.proto, self.types = src, src.proto, types
        self.batch = batch or 2  # shape arithmetic of a symbolic batch is evaluated at 2
        self.shapes = shapes
        self.env: dict[str, object] = {}
        self.axis1: set[str] = set()  # tensors holding a 2-d activation with the batch on axis 1
        self.bindings: dict[str, Binding] = {}
        self._claimed: set[str] = set()
        self._uses: dict[str, list] = {}
        self.at = ""
        self.node = None

    # ------------------------------------------------------------ errors
    def unsupported(self, why: str, op: str | None = None):
        raise UnsupportedOperation(self.fx_name, op or self.op, self.at, why)

    def fail(self, what: str):
        raise PathirError(f"node '{self.fx_name}' ({self.op}) of '{self.src.name}': {what}")

    # ------------------------------------------------------------ the walk
    def run(self):
        g = self.proto.graph
        from onnx import numpy_helper

        for t in g.initializer:
            self.env[t.name] = numpy_helper.to_array(t)
        self.initializers = {t.name for t in g.initializer}
        inputs = [vi.name for vi in g.input if vi.name in self.shapes]
        for name in inputs:
            self.env[name] = Value.of_node(self.b.input(name, self.shapes[name], origin="ONNX graph input"), self.shapes[name])
        live, needed = self._live()
        for i, node in enumerate(g.node):
            if not live[i]:
                continue
            self.node = node
            self.fx_name = self.label = node.name or node.output[0]
            self.op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
            self.at = f"ONNX node #{i} of '{self.src.name}'"
            self.where = f"{self.label} ({self.op})"
            for o in node.output[1:]:
                if o and o in needed and node.op_type in ("BatchNormalization", "MaxPool", "Dropout"):
                    self.unsupported(f"its output '{o}' is used ({_SECOND_OUTPUT[node.op_type]})")
            outs = self._lower(node)
            for name, value in zip(node.output, outs):
                if name:
                    self.env[name] = value
        return self._outputs(inputs)

    def _live(self):
        g = self.proto.graph
        needed = {o.name for o in g.output}
        live = [False] * len(g.node)
        for i in range(len(g.node) - 1, -1, -1):
            node = g.node[i]
            if any(o in needed for o in node.output):
                live[i] = True
                needed.update(x for x in node.input if x)
        return live, needed

    def _input(self, name: str):
        if not name:
            return None
        if name not in self.env:
            self.fail(f"reads '{name}', which no node, initializer or graph input provides")
        return self.env[name]

    def _lower(self, node) -> list:
        ins = [self._input(x) for x in node.input]
        acts = [k for k, v in enumerate(ins) if isinstance(v, (Value, Sequence))]
        if not acts:
            if node.op_type == "Identity" and node.input[0] in self.initializers:
                self.initializers.add(node.output[0])  # an alias the exporter made of a stored tensor
            try:
                return run_node(self.proto, node, ins)
            except Exception as err:  # the reference evaluator raises many types
                self.fail(f"constant folding failed: {type(err).__name__}: {err}")
        op = node.op_type if node.domain in ("", "ai.onnx") else None
        for k in acts:
            if node.input[k] in self.axis1 and op not in _AXIS1_OK:
                self.unsupported(f"'{node.input[k]}' has its batch on axis 1; only Gemm, MatMul, Relu and Add read that layout")
        handler = getattr(self, f"op_{op}", None) if op else None
        if handler is None and op in INDEX_OPS:
            handler = self.index
        if handler is not None:
            outs = handler(node, ins)
            for v in outs:
                if isinstance(v, Value) and math.prod(v.shape) == 0:
                    self.fail(f"its output has the empty per-sample shape {list(v.shape)}")
            return outs
        why = WHY.get(op, "outside the ops pathir lowers from ONNX (see docs/onnx.md): not known to keep the network a ReLU DAG")
        if op in ("Softmax", "LogSoftmax") and any(o.name in node.output for o in self.proto.graph.output):
            why += "; at the output, export the model without it: pathir analyses the logits"
        self.unsupported(why)

    def _outputs(self, inputs):
        names = []
        for o in self.proto.graph.output:
            v = self.env.get(o.name)
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
        from pathir.ir import verify

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

    def _bias_const(self, node, k: int):
        """A bias input, or None when absent or a computed (neither stored nor an
        alias of a stored tensor) all-zero constant: exporters write a missing
        bias that way, torch has none there."""
        c = self.const(node, k, "bias", required=False)
        if c is not None and node.input[k] not in self.initializers and not np.any(c):
            return None
        return c

    def _ref(self, node, k: int, key) -> tuple[str, bool]:
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

    def _bind(self, ref: str, node, k: int, kind: str, layout=None, eps: float = 0.0) -> None:
        key = (node.output[0], k)
        b = self.bindings.get(ref)
        if b is None:
            value = np.asarray(self.env[node.input[k]])
            self.bindings[ref] = Binding(node.input[k], [key], value, kind, layout, eps)
        else:
            b.slots.append(key)

    def weight(self, node, k: int, value: np.ndarray, transposed: bool, how: str) -> Param:
        """The Param of a weight slot (one shared Param for a tensor reused alike)."""
        ref, _ = self._ref(node, k, ("weight", transposed, value))
        p = self.param(ref, value, (SourceRef(ref, transposed=transposed),), how)
        self._bind(ref, node, k, "weight")
        return p

    def bias(self, node, k: int, vector: np.ndarray, layout: tuple[int, ...], how: str = "") -> Param:
        ref, _ = self._ref(node, k, ("bias", layout, vector))
        p = self.param(ref, vector, (SourceRef(ref),), how)
        self._bind(ref, node, k, "bias", layout)
        return p

    def channel_vector(self, c: np.ndarray, v: Value, axis: int, scale: float = 1.0):
        """(per-channel vector, layout) of a constant added to activation ``v``:
        it must broadcast to one value per channel."""
        c = _f64(c) * scale
        full = (1, *v.shape) if axis == 0 else (v.shape[0], 1)
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
            self.unsupported(f"the constant of shape {list(c.shape)} varies over positions: pathir's biases are per channel")
        right = len(full) - ch
        nd = max(c.ndim, right)
        layout = [1] * nd
        layout[nd - right] = full[ch]
        return cb[:, 0].copy(), tuple(layout)

    # ------------------------------------------------------------ elementwise
    def op_Relu(self, node, ins):
        out = self.relu(self.act(node, 0))
        self._same_axis(node)
        return [out]

    def op_Identity(self, node, ins):
        self._same_axis(node)
        return [ins[0]]

    def op_Dropout(self, node, ins):
        if len(ins) > 2 and ins[2] is not None:
            if not isinstance(ins[2], np.ndarray) or bool(np.asarray(ins[2]).reshape(-1)[0]):
                self.unsupported("dropout in training mode is random: pathir lowers inference semantics only")
        self._same_axis(node)
        return [ins[0], None]

    def op_Cast(self, node, ins):
        from onnx import TensorProto

        if _attrs(node).get("to") not in (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16):
            self.unsupported("a cast of an activation to a non-float type")
        self._same_axis(node)
        return [ins[0]]

    def op_CastLike(self, node, ins):
        if isinstance(ins[0], Value):
            self._same_axis(node)
            return [ins[0]]
        from .onnx_load import numpy_dtype

        return [np.asarray(ins[0]).astype(numpy_dtype(self.types.get(node.input[1], 1)))]

    def op_Shape(self, node, ins):
        v = ins[0]
        full = [self.batch, *v.shape] if node.input[0] not in self.axis1 else [v.shape[0], self.batch]
        a = _attrs(node)
        start, end = a.get("start", 0), a.get("end", None)
        return [np.asarray(full[start:end], dtype=np.int64)]

    def op_Size(self, node, ins):
        return [np.asarray(self.batch * math.prod(ins[0].shape), dtype=np.int64)]

    def _same_axis(self, node):
        if node.input[0] in self.axis1:
            self.axis1.add(node.output[0])

    def op_Add(self, node, ins):
        a, b = ins
        if isinstance(a, Value) and isinstance(b, Value):
            if (node.input[0] in self.axis1) != (node.input[1] in self.axis1):
                self.unsupported("adds two activations whose batch axes differ")
            if a.shape != b.shape:
                self.unsupported(f"adds activations of shapes {list(a.shape)} and {list(b.shape)}: broadcasting is not lowered")
            self._same_axis(node)
            return [self.add(a, b)]
        k = 0 if isinstance(a, Value) else 1
        v, c = ins[k], ins[1 - k]
        axis = 1 if node.input[k] in self.axis1 else 0
        if self._bias_const(node, 1 - k) is None:
            if axis:
                self.axis1.add(node.output[0])
            return [v]
        vec, layout = self.channel_vector(c, v, axis)
        if v.bias is not None:
            v = Value.of_node(self.materialize(v), v.shape)
        p = self.bias(node, 1 - k, vec, layout, f"{node.input[1 - k]} (added by {self.label})")
        if axis:
            self.axis1.add(node.output[0])
        return [Value(v.terms, v.shape, p, self.label)]

    # ------------------------------------------------------------ affine layers
    def op_Gemm(self, node, ins):
        a = _attrs(node)
        alpha, beta = float(a.get("alpha", 1.0)), float(a.get("beta", 1.0))
        tA, tB = bool(a.get("transA", 0)), bool(a.get("transB", 0))
        if isinstance(ins[0], Value) and isinstance(ins[1], Value):
            self.unsupported(WHY["Mul"].replace("a product with an activation", "multiplies two activations"))
        if isinstance(ins[0], Value):
            k, wk, axis_in = 0, 1, 1 if node.input[0] in self.axis1 else 0
            if axis_in != int(tA):
                self.unsupported(f"transA={int(tA)} contracts over the batch axis of '{node.input[0]}'")
            B = _f64(self.const(node, 1, "weight"))
            W = B if tB else B.T  # W = op(B)^T
            transposed, out_axis = not tB, 0
            how = f"{alpha:g} * " * (alpha != 1) + node.input[1] + ("" if tB else "^T")
        else:
            k, wk, axis_in = 1, 0, 1 if node.input[1] in self.axis1 else 0
            if axis_in == int(tB):
                self.unsupported(f"transB={int(tB)} contracts over the batch axis of '{node.input[1]}'")
            A = _f64(self.const(node, 0, "weight"))
            W = A.T if tA else A  # W = op(A)
            transposed, out_axis = tA, 1
            how = f"{alpha:g} * " * (alpha != 1) + node.input[0] + ("^T" if tA else "")
        v = self.act(node, k)
        Wp = self.weight(node, wk, alpha * W, transposed, how)
        bias = None
        C = self._bias_const(node, 2)
        if C is not None and beta != 0.0:
            out = Value(v.terms, (W.shape[0],), None)
            vec, layout = self.channel_vector(C, out, out_axis, beta)
            bias = self.bias(node, 2, vec, layout, f"{beta:g} * " * (beta != 1) + node.input[2])
        if out_axis:
            self.axis1.add(node.output[0])
        return [self._dense(v, Wp, bias)]

    def _dense(self, v: Value, Wp: Param, bias) -> Value:
        if math.prod(v.shape) != Wp.shape[1]:
            self.unsupported(f"weight {list(Wp.shape)} does not fit an activation of per-sample shape {list(v.shape)}")
        return self._apply(v, Dense(Wp), bias, flat_ok=True)

    def op_MatMul(self, node, ins):
        if isinstance(ins[0], Value) and isinstance(ins[1], Value):
            self.unsupported("multiplies two activations: not positively homogeneous of degree 1")
        if isinstance(ins[0], Value):
            v = ins[0]
            if node.input[0] in self.axis1 or len(v.shape) != 1:
                self.unsupported(f"MatMul of an activation of per-sample shape {list(v.shape)}: only (batch, features) @ W is lowered")
            B = _f64(self.const(node, 1, "weight"))
            if B.ndim != 2:
                self.unsupported(f"MatMul with a weight of rank {B.ndim}")
            return [self._dense(v, self.weight(node, 1, B.T, True, node.input[1] + "^T"), None)]
        v = ins[1]
        if node.input[1] not in self.axis1:
            self.unsupported("W @ activation contracts over the batch axis")
        A = _f64(self.const(node, 0, "weight"))
        if A.ndim != 2:
            self.unsupported(f"MatMul with a weight of rank {A.ndim}")
        self.axis1.add(node.output[0])
        return [self._dense(v, self.weight(node, 0, A, False, node.input[0]), None)]

    def op_Conv(self, node, ins):
        v = self.act(node, 0)
        W = _f64(self.const(node, 1, "weight"))
        n = W.ndim - 2
        if len(v.shape) != n + 1:
            self.unsupported(f"{n}-d convolution on an activation of per-sample shape {list(v.shape)}")
        a = _attrs(node)
        k = tuple(W.shape[2:])
        if tuple(a.get("kernel_shape", k)) != k:
            self.fail(f"kernel_shape {a['kernel_shape']} disagrees with the weight {list(W.shape)}")
        strides, dil = tuple(a.get("strides", (1,) * n)), tuple(a.get("dilations", (1,) * n))
        pads = self._pads(a, v.shape[1:], k, strides, dil)
        Wp = self.weight(node, 1, W, False, "")
        B = self._bias_const(node, 2)
        bias = self.bias(node, 2, _f64(B).reshape(-1), (W.shape[0],)) if B is not None else None
        return [self._apply(v, Conv(Wp, strides, pads, dil, int(a.get("group", 1))), bias)]

    def op_BatchNormalization(self, node, ins):
        import torch

        a = _attrs(node)
        if a.get("training_mode", 0):
            self.unsupported("batch-norm in training mode uses batch statistics: input-dependent")
        v = self.act(node, 0)
        eps = float(a.get("epsilon", 1e-5))
        group = ("bn", tuple(node.input[1:5]), eps)  # a batch-norm applied twice shares all four
        names = [self._ref(node, k, group)[0] for k in range(1, 5)]
        what = ("scale", "bias", "running mean", "running variance")
        tensors = [ParamTensor(n, torch.from_numpy(_f64(self.const(node, k, w)).reshape(-1).copy()))
                   for k, (n, w) in enumerate(zip(names, what), start=1)]
        out = self.batch_norm(v, "", *tensors, eps)
        C = v.shape[0]
        for k, (ref, kind) in enumerate(zip(names, ("bn_scale", "bn_bias", "bn_mean", "bn_var")), start=1):
            self._bind(ref, node, k, kind, (C,), eps)
        return [out]

    # ------------------------------------------------------------ pools
    def _pads(self, a, spatial, k, strides, dil):
        n = len(k)
        mode = a.get("auto_pad", "NOTSET") or "NOTSET"
        if mode == "NOTSET":
            p = list(a.get("pads", [0] * (2 * n)))
            return tuple((int(p[i]), int(p[i + n])) for i in range(n))
        if mode == "VALID":
            return ((0, 0),) * n
        if mode not in ("SAME_UPPER", "SAME_LOWER"):
            self.fail(f"unknown auto_pad '{mode}'")
        out = []
        for L, kk, s, d in zip(spatial, k, strides, dil):
            total = max(0, (-(-L // s) - 1) * s + (kk - 1) * d + 1 - L)
            small = total // 2
            out.append((small, total - small) if mode == "SAME_UPPER" else (total - small, small))
        return tuple(out)

    def _window(self, node, v: Value):
        n = len(v.shape) - 1
        if n < 1:
            self.unsupported(f"pooling on an activation of per-sample shape {list(v.shape)}")
        a = _attrs(node)
        k = tuple(int(x) for x in a["kernel_shape"])
        strides, dil = tuple(a.get("strides", (1,) * n)), tuple(a.get("dilations", (1,) * n))
        pads = self._pads(a, v.shape[1:], k, strides, dil)
        ceil = bool(a.get("ceil_mode", 0)) and a.get("auto_pad", "NOTSET") in ("NOTSET", "")
        return Pool(k, strides, pads, dil, ceil), a

    def op_MaxPool(self, node, ins):
        v = self.act(node, 0)
        pool, _ = self._window(node, v)
        src = self.materialize(v)
        name = self.b.maxpool(self.label, src, pool, origin=self.where)
        return [Value.of_node(name, self.b.shape(name)), None]

    def op_GlobalMaxPool(self, node, ins):
        v = self.act(node, 0)
        n = len(v.shape) - 1
        pool = Pool(tuple(v.shape[1:]), (1,) * n, ((0, 0),) * n, (1,) * n)
        name = self.b.maxpool(self.label, self.materialize(v), pool, origin=self.where)
        return [Value.of_node(name, self.b.shape(name))]

    def op_AveragePool(self, node, ins):
        """mult[p] = 1 / (number of window positions counted at p): inside the
        padded input with count_include_pad, inside the input without (ONNX Runtime)."""
        v = self.act(node, 0)
        pool, a = self._window(node, v)
        include = bool(a.get("count_include_pad", 0))
        counts = []
        for L, kk, s, (p0, p1), d in zip(v.shape[1:], pool.kernel, pool.stride, pool.padding, pool.dilation):
            out = pool_output_size(L, kk, s, (p0, p1), d, pool.ceil_mode)
            pos = np.arange(out)[:, None] * s - p0 + np.arange(kk)[None, :] * d
            lo, hi = (-p0, L + p1) if include else (0, L)
            counts.append(((pos >= lo) & (pos < hi)).sum(axis=1))
        count = counts[0]
        for c in counts[1:]:
            count = np.multiply.outer(count, c)
        mult = np.where(count > 0, 1.0 / np.maximum(count, 1), 0.0)
        pool = Pool(pool.kernel, pool.stride, pool.padding, pool.dilation, pool.ceil_mode, mult)
        src = self.materialize(v)
        return [Value([(src, pool)], pool.out_shape(self.b.shape(src)), None, self.label)]

    def op_GlobalAveragePool(self, node, ins):
        v = self.act(node, 0)
        return [self.adaptive_avg_pool(v, (1,) * (len(v.shape) - 1))]

    def op_ReduceMean(self, node, ins):
        v = self.act(node, 0)
        a = _attrs(node)
        axes = a.get("axes")
        if axes is None and len(node.input) > 1 and node.input[1]:
            axes = self.const(node, 1, "axes").reshape(-1).tolist()
        if not axes:
            if a.get("noop_with_empty_axes", 0):
                return [v]
            self.unsupported("a mean over every axis, the batch included")
        return [self.mean(v, [int(x) for x in axes], bool(a.get("keepdims", 1)))]

    # ------------------------------------------------------------ index ops
    def op_Concat(self, node, ins):
        """Along the channels at channel granularity when it can, else on element ids."""
        if all(isinstance(v, Value) for v in ins):
            rank = len(ins[0].shape) + 1
            if _attrs(node)["axis"] % rank == 1:
                out = self.cat_channels(list(ins))
                if out is not None:
                    return [out]
        return self.index(node, ins)

    def op_Pad(self, node, ins):
        a = _attrs(node)
        if a.get("mode", "constant") == "constant":
            value = ins[2] if len(ins) > 2 and ins[2] is not None else a.get("value", 0.0)
            if np.any(np.asarray(value) != 0):
                self.unsupported("padding with a non-zero constant adds a fixed value (a bias per position)")
            ins = list(ins[:2]) + [np.zeros((), dtype=np.int64)] + list(ins[3:]) if len(ins) > 2 else ins
        return self.index(node, ins)

    def index(self, node, ins):
        """Run an index-moving op on element ids and compose the result with
        the pending selection maps of its inputs (as the torch frontend does)."""
        acts = {k: v.shape for k, v in enumerate(ins) if isinstance(v, Value)}
        try:
            decoded = run_on_ids(self.proto, node, ins, acts, self.batch)
        except ValueError as err:
            self.unsupported(str(err))
        except Exception as err:
            self.fail(f"could not run it on element ids: {type(err).__name__}: {err}")
        prepared = {k: self._selectable(ins[k]) for k in acts}
        outs = []
        for d in decoded:
            if d is None:
                outs.append(None)
            elif isinstance(d, list):
                outs.append(Sequence(self._selected(prepared, x) for x in d))
            else:
                outs.append(self._selected(prepared, d))
        return outs

    def _selected(self, prepared: dict, decoded) -> Value:
        out_shape, per_input = decoded
        if not out_shape:
            self.unsupported("the result has no per-sample axis")
        terms = []
        for k, v in prepared.items():
            idx = per_input[k]
            for src, m in v.terms:
                src_idx = selection_index(m, self.b.shape(src))
                composed = np.where(idx >= 0, src_idx[np.maximum(idx, 0)], -1)
                new = selection_map(composed, self.b.shape(src), out_shape)
                if new is not None:
                    terms.append((src, new))
        if not terms:
            self.unsupported("the op selects no element of its input")
        return Value(terms, out_shape, None, self.label)

    def op_SplitToSequence(self, node, ins):
        return self.index(node, ins)

    def op_SequenceAt(self, node, ins):
        seq, pos = ins[0], self.const(node, 1, "position")
        if not isinstance(seq, Sequence):
            self.unsupported("expected a sequence of activations")
        return [seq[int(np.asarray(pos).reshape(-1)[0])]]


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


_SECOND_OUTPUT = {
    "BatchNormalization": "running statistics updated in training mode",
    "MaxPool": "max-pool indices",
    "Dropout": "a dropout mask",
}

_AXIS1_OK = frozenset({"Gemm", "MatMul", "Relu", "Add", "Identity", "Dropout", "Cast", "CastLike", "Shape", "Size"})
