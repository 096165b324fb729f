"""A hypothesis strategy that writes random ONNX graphs with ``onnx.helper`` (no exporter), drawn
from the ops the ONNX frontend's table claims: Conv (groups, strides, pads, dilations, auto_pad;
weights shared by two Convs or written by Constant nodes), ConvTranspose, BatchNormalization, Relu /
LeakyRelu(0) / Clip(min=0) / Max(x, 0), MaxPool / AveragePool (ceil_mode, count_include_pad), the
global pools, Add / Sub / Max of two branches, Mul / Div by a scalar, per-channel, per-position or
per-element constant, Neg, Where (a constant mask), ReduceSum / Mean / Max, Concat, Split (split
input or num_outputs), Slice, Transpose, Gather, Tile, DepthToSpace, SpaceToDepth, ScatterND / ScatterElements
(channels written in place), Pad (constant,
reflect, edge), Resize (nearest; scales, or sizes with axes), Reshape (channel shuffle), Squeeze /
Unsqueeze, Identity, Dropout, a Gemm (transA / transB, alpha, beta) or MatMul + Add head, one or two
outputs; opsets 13 to 18; float32, or float64 where onnxruntime has double kernels (no Conv, pools
but MaxPool, Resize). Now and then one op the frontend must refuse ends the body.

Each graph comes with its *path-norm network*, written from the definition (docs/math.md §3) and not
from pathir: every weight, bias and constant factor c replaced by |c|^q (Gemm's alpha / beta folded
into its tensors first, a batch-norm by its per-channel scale and shift), every ReLU by the
identity, a max-pool by its window sum (a depthwise ones Conv whose padding reaches the ceil_mode
windows), an average pool by its window sum times (1/divisor)^q, a subtraction or a Max by an
addition. onnxruntime runs it (float32) on an all-ones input; its outputs sum to Σ_p |Φ_p|^q
(q = 0: the number of paths)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

#: onnxruntime's CPU kernels that take float64 (checked against onnxruntime 1.32): a float64 graph
#: draws only these, so onnxruntime computes it in double and the forward is compared to 1e-10
DOUBLE_OPS = {"Relu", "LeakyRelu", "Clip", "MaxPool", "BatchNormalization", "Add", "Sub", "Max", "Mul", "Div",
              "Concat", "Split", "Slice", "Transpose", "Pad", "Reshape", "Squeeze", "Unsqueeze", "Identity",
              "Dropout", "Flatten", "Gemm", "MatMul", "ReduceSum", "Sigmoid", "Tanh", "Softplus", "Gather", "Neg",
              "Where"}

#: kinds of body statements; each says which ops it writes (a float64 graph draws only DOUBLE_OPS ones)
KINDS = {"conv": {"Conv"}, "reuse": {"Conv"}, "conv_bn": {"Conv", "BatchNormalization"}, "conv_t": {"ConvTranspose"},
         "relu": {"Relu"}, "bn": {"BatchNormalization"}, "maxpool": {"MaxPool"}, "avgpool": {"AveragePool"},
         "gpool": {"GlobalAveragePool"}, "branch": {"Add"}, "const": {"Mul"}, "concat": {"Concat"},
         "split": {"Split"}, "slice": {"Slice"}, "transpose": {"Transpose"}, "pad": {"Pad"}, "resize": {"Resize"},
         "shuffle": {"Reshape"}, "unsqueeze": {"Unsqueeze"}, "identity": {"Identity"}, "move": {"Gather"},
         "reduce": {"ReduceSum"}, "neg": {"Neg"}, "where": {"Where"}}

#: kinds that compute (not only move elements)
COMPUTING = {"conv", "reuse", "conv_bn", "conv_t", "relu", "bn", "maxpool", "avgpool", "gpool", "branch", "const", "reduce",
             "neg", "where"}

#: ops the frontend must refuse: name -> a word the refusal must hold
REFUSED = ("Sigmoid", "MulActs", "ClipAbove0", "Softplus", "CumSum")


def window_out(L: int, k: int, s: int, p0: int, p1: int, d: int = 1, ceil: bool = False) -> int:
    """Output length of a window op; ceil_mode drops a last window starting in the right padding
    (onnxruntime's and PyTorch's rule)."""
    eff = (k - 1) * d + 1
    if ceil:
        n = -(-(L + p0 + p1 - eff) // s) + 1
        return n - 1 if (n - 1) * s >= L + p0 else n
    return (L + p0 + p1 - eff) // s + 1


@dataclass(repr=False)
class OnnxProgram:
    """A generated graph: its nodes and initializers, and its path-norm network's."""

    opset: int
    dtype: int  # TensorProto.FLOAT or DOUBLE
    input_shape: tuple
    nodes: list = field(default_factory=list)
    inits: dict = field(default_factory=dict)  # name -> numpy array (floats in the graph's dtype)
    ref_nodes: list = field(default_factory=list)
    ref_inits: dict = field(default_factory=dict)  # name -> (array, powered: bool)
    outputs: list = field(default_factory=list)  # (name, per-sample shape)
    has_bn: bool = False
    constants: set = field(default_factory=set)  # tensors a Constant node writes (in the path-norm network: initializers)
    refused: tuple | None = None  # (node name, op type) of the op the frontend must refuse

    @property
    def np_dtype(self):
        return np.float64 if self.dtype == TensorProto.DOUBLE else np.float32

    def _model(self, nodes, inits, dtype, name) -> onnx.ModelProto:
        g = helper.make_graph(
            nodes, name, [helper.make_tensor_value_info("x", dtype, ["N", *self.input_shape])],
            [helper.make_tensor_value_info(o, dtype, ["N", *s]) for o, s in self.outputs],
            [numpy_helper.from_array(a, n) for n, a in inits.items()])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)], ir_version=8)

    def model(self) -> onnx.ModelProto:
        inits = {n: a for n, a in self.inits.items() if n not in self.constants}
        return self._model(self.nodes, inits, self.dtype, "fuzzed")

    def reference(self, q: float) -> onnx.ModelProto:
        """The path-norm network (float32): every powered constant c becomes |c|^q."""
        inits = {}
        for n, (a, powered) in self.ref_inits.items():
            a = np.abs(a.astype(np.float64)) ** q if powered else a
            inits[n] = a.astype(np.float32) if a.dtype.kind == "f" else a
        return self._model(self.ref_nodes, inits, TensorProto.FLOAT, "path_norm_network")

    def path_sum(self, q: float) -> float:
        """Σ_p |Φ_p|^q (q = 0: the path count), by onnxruntime on the path-norm network."""
        outs = run(self.reference(q), np.ones((1, *self.input_shape), np.float32))
        return float(sum(o.astype(np.float64).sum() for o in outs))

    def __repr__(self) -> str:
        return f"OnnxProgram(opset={self.opset}, refused={self.refused}):\n{self.describe()}"

    def _repr_pretty_(self, printer, cycle):  # hypothesis prints a falsifying example with this
        printer.text(repr(self))

    def describe(self) -> str:
        """The graph as text, for failure messages."""
        return onnx.printer.to_text(self.model().graph)


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # shape inference over-reports ceil_mode pools: onnxruntime warns
    # the graph as written, no fusions (onnxruntime 1.32's Relu + Clip fusion fails on a float64 Clip)
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    return session(model).run(None, {"x": x})


class _Writer:
    """Appends nodes to a program and its path-norm network side by side."""

    def __init__(self, prog: OnnxProgram, rng: np.random.Generator):
        self.prog, self.rng, self.n = prog, rng, 0

    def name(self, prefix="v") -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def init(self, arr, ref: bool = True, powered: bool | None = None, prefix="c", cast: bool = True,
             constant: bool = False) -> str:
        """A user initializer (floats in the graph's dtype unless ``cast`` is False; written by a Constant
        node if ``constant``), also in the path-norm network unless ``ref`` is False; floats are powered
        there, integers kept."""
        name = self.name(prefix)
        arr = np.asarray(arr)
        if arr.dtype.kind == "f" and cast:
            arr = arr.astype(self.prog.np_dtype)
        self.prog.inits[name] = arr
        if constant:
            self.prog.constants.add(name)
            self.prog.nodes.append(helper.make_node("Constant", [], [name], name=self.name("constant"),
                                                    value=numpy_helper.from_array(arr)))
        if ref:
            self.prog.ref_inits[name] = (arr, arr.dtype.kind == "f" if powered is None else powered)
        return name

    def ref_init(self, arr, powered: bool = True) -> str:
        name = self.name("r")
        arr = np.asarray(arr)
        self.prog.ref_inits[name] = (arr.astype(np.float64) if arr.dtype.kind == "f" else arr, powered)
        return name

    def ints(self, values) -> str:
        return self.init(np.asarray(values, dtype=np.int64), prefix="i")

    def add(self, op, ins, outs, ref="same", **attrs):
        """A user node; ``ref``: "same" (the same node in the path-norm network), None (nothing), or
        a list of nodes."""
        node = helper.make_node(op, ins, outs, name=self.name(op.lower()), **attrs)
        self.prog.nodes.append(node)
        if ref == "same":
            self.prog.ref_nodes.append(node)
        elif ref:
            self.prog.ref_nodes.extend(ref)
        return node

    def weights(self, *shape, positive=False):
        w = self.rng.normal(size=shape) * (1.0 / np.sqrt(max(1, np.prod(shape[1:]))))
        return np.abs(w) + 0.1 if positive else w

    def window_sum(self, src, out, C, k, s, pads, dil, out_len):
        """The path-norm network's window sum: a depthwise Conv with a ones kernel whose right padding
        reaches every window the pool computes (ceil_mode)."""
        (p0, p1), (q0, q1) = pads
        H, W = out_len[0]
        extra = [max(0, (H - 1) * s[0] + (k[0] - 1) * dil[0] + 1 - (out_len[1][0] + p0 + p1)),
                 max(0, (W - 1) * s[1] + (k[1] - 1) * dil[1] + 1 - (out_len[1][1] + q0 + q1))]
        ones = self.ref_init(np.ones((C, 1, *k)))
        return helper.make_node("Conv", [src, ones], [out], group=C, kernel_shape=list(k), strides=list(s),
                                dilations=list(dil), pads=[p0, q0, p1 + extra[0], q1 + extra[1]])


def _divisors(c: int) -> list[int]:
    return [g for g in range(1, c + 1) if c % g == 0]


@st.composite
def onnx_programs(draw, min_statements: int = 1, max_statements: int = 6, refuse: float = 0.1) -> OnnxProgram:
    double = draw(st.sampled_from([False, True, False]))  # float32 graphs reach Conv, the pools, Resize
    opset = draw(st.integers(13, 18))
    C0, S0 = draw(st.integers(1, 4)), draw(st.integers(4, 8))
    prog = OnnxProgram(opset, TensorProto.DOUBLE if double else TensorProto.FLOAT, (C0, S0, S0))
    w = _Writer(prog, np.random.default_rng(draw(st.integers(0, 2**16))))
    values = [("x", (C0, S0, S0))]
    kinds = [k for k, ops in KINDS.items() if not double or ops <= DOUBLE_OPS]
    relus: set[str] = set()  # ReLU outputs
    convs: list = []  # (weight names, in channels, attributes, kernel, strides, dilations, pads, out channels)
    computed: set[str] = set()  # values no pure element move of the input (pathir refuses outputs equal to the input)

    def same_shape(shape):
        return [v for v in values if v[1] == shape]

    for _ in range(draw(st.integers(min_statements, max_statements))):
        src, (C, H, W) = draw(st.sampled_from(values))
        kind = draw(st.sampled_from(kinds))
        out = w.name()
        shape = None
        if kind in ("conv", "conv_bn"):
            g = draw(st.sampled_from(_divisors(C)))
            C2 = g * draw(st.integers(1, max(1, 6 // g)))
            k = (draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2, 3])))
            s = (draw(st.sampled_from([1, 1, 2])),) * 2
            dil = (draw(st.sampled_from([1, 1, 2])),) * 2
            auto = draw(st.sampled_from(["NOTSET", "NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"]))
            if auto == "NOTSET":
                pads = [draw(st.integers(0, k[i] - 1)) for i in (0, 1, 0, 1)]
            else:
                pads = [0, 0, 0, 0]
            ins = (H, W)
            if auto.startswith("SAME"):
                dil = (1, 1)  # onnxruntime's SAME padding with dilations differs between versions
                outs = tuple(-(-L // s[0]) for L in ins)
            else:
                outs = tuple(window_out(L, kk, s[0], pads[i], pads[i + 2], dil[0]) for i, (L, kk) in enumerate(zip(ins, k)))
            if min(outs) < 1:
                values.append((src, (C, H, W)))
                continue
            bias = kind == "conv" and draw(st.booleans())
            constant = draw(st.sampled_from([False, False, True]))  # weights from Constant nodes
            wt = w.init(w.weights(C2, C // g, *k), prefix="W", constant=constant)
            ins_ = [src, wt] + ([w.init(w.rng.normal(size=C2), prefix="B", constant=constant)] if bias else [])
            attrs = dict(kernel_shape=list(k), strides=list(s), dilations=list(dil), group=g)
            attrs.update(auto_pad=auto) if auto != "NOTSET" else attrs.update(pads=pads)
            if auto != "NOTSET" and draw(st.booleans()):
                attrs.pop("kernel_shape")  # read off the weight
            conv_out = out if kind == "conv" else w.name()
            w.add("Conv", ins_, [conv_out], **attrs)
            shape = (C2, *outs)
            if auto == "NOTSET":
                convs.append((ins_[1:], C, attrs, k, s, dil, pads, C2))
            if kind == "conv_bn":  # the exporters' pattern: a bias-free conv, its batch-norm
                _batch_norm(w, prog, conv_out, out, C2)
        elif kind == "reuse" and any(c[1] == C for c in convs):  # a Conv's weights read by a second Conv
            params, _, attrs, k, s, dil, pads, C2 = draw(st.sampled_from([c for c in convs if c[1] == C]))
            outs = tuple(window_out(L, k[i], s[0], pads[i], pads[i + 2], dil[0]) for i, L in enumerate((H, W)))
            if min(outs) < 1:
                values.append((src, (C, H, W)))
                continue
            w.add("Conv", [src, *params], [out], **attrs)
            shape = (C2, *outs)
        elif kind == "conv_t":
            g = draw(st.sampled_from(_divisors(C)))
            C2 = g * draw(st.integers(1, max(1, 4 // g)))
            k, s = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2]))
            p = [draw(st.integers(0, k - 1)) for _ in range(4)]
            op_ = [draw(st.integers(0, s - 1)) for _ in range(2)]
            outs = tuple((L - 1) * s - p[i] - p[i + 2] + k + op_[i] for i, L in enumerate((H, W)))
            if min(outs) < 1 or max(outs) > 16:
                values.append((src, (C, H, W)))
                continue
            ins_ = [src, w.init(w.weights(C, C2 // g, k, k), prefix="W")]
            if draw(st.booleans()):
                ins_.append(w.init(w.rng.normal(size=C2), prefix="B"))
            w.add("ConvTranspose", ins_, [out], kernel_shape=[k, k], strides=[s, s], pads=p, output_padding=op_, group=g)
            shape = (C2, *outs)
        elif kind == "relu":
            # onnxruntime's LeakyRelu takes float64 from opset 16
            spelling = draw(st.sampled_from(["Relu", "Clip", "Max0"] + (["LeakyRelu"] if opset >= 16 or not double else [])))
            ref = [helper.make_node("Identity", [src], [out])]
            relus.add(out)
            if spelling == "Relu":
                w.add("Relu", [src], [out], ref)
            elif spelling == "Max0":  # Max(x, 0), the zero a scalar or one per channel, on either side
                zero = w.init(np.zeros(draw(st.sampled_from([(), (1,), (C, 1, 1)]))), ref=False)
                w.add("Max", [src, zero] if draw(st.booleans()) else [zero, src], [out], ref)
            elif spelling == "LeakyRelu":
                w.add("LeakyRelu", [src], [out], ref, alpha=0.0)
            else:
                w.add("Clip", [src, w.init(np.array(0.0), ref=False)], [out], ref)
            shape = (C, H, W)
        elif kind == "bn":
            # only on a ReLU's output: after a biased identity node (another batch-norm, a biased conv) the
            # fold merges the two biases into one and the path-norm is the folded network's
            if src not in relus:
                relu = w.name()
                w.add("Relu", [src], [relu], [helper.make_node("Identity", [src], [relu])])
                src = relu
            _batch_norm(w, prog, src, out, C)
            shape = (C, H, W)
        elif kind in ("maxpool", "avgpool"):
            k = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
            s = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
            dil = (draw(st.sampled_from([1, 1, 2])),) * 2 if kind == "maxpool" else (1, 1)
            pads = [draw(st.integers(0, k[i % 2] - 1)) for i in range(4)]
            ceil = draw(st.booleans())
            if ceil and any(window_out(L, k[i], s[i], pads[i], pads[i + 2], dil[i], True) !=
                            -(-(L + pads[i] + pads[i + 2] - (k[i] - 1) * dil[i] - 1) // s[i]) + 1
                            for i, L in enumerate((H, W))):
                # ONNX shape inference counts a last window starting in the right padding, onnxruntime
                # drops it; onnxruntime refuses to load such a graph where the sizes meet (and so does pathir)
                ceil = False
            if any((k[i] - 1) * dil[i] + 1 > L + pads[i] + pads[i + 2] for i, L in enumerate((H, W))):
                values.append((src, (C, H, W)))
                continue
            outs = tuple(window_out(L, k[i], s[i], pads[i], pads[i + 2], dil[i], ceil) for i, L in enumerate((H, W)))
            ws = w.name("ws")
            summed = w.window_sum(src, ws if kind == "avgpool" else out, C, k, s,
                                  ((pads[0], pads[2]), (pads[1], pads[3])), dil, (outs, (H, W)))
            attrs = dict(kernel_shape=list(k), strides=list(s), pads=pads, ceil_mode=int(ceil))
            if kind == "maxpool":
                if dil != (1, 1):
                    attrs["dilations"] = list(dil)
                w.add("MaxPool", [src], [out], [summed], **attrs)
            else:
                attrs["count_include_pad"] = draw(st.integers(0, 1))
                factor = _average_factor(attrs, (C, H, W), prog.np_dtype)  # 1/divisor per position, onnxruntime's
                w.add("AveragePool", [src], [out], [summed, helper.make_node("Mul", [ws, w.ref_init(factor)], [out])], **attrs)
            shape = (C, *outs)
        elif kind == "gpool":
            op = draw(st.sampled_from(["GlobalAveragePool", "GlobalMaxPool"]))
            axes, total = w.ref_init(np.array([2, 3], dtype=np.int64), powered=False), w.name("sum")
            if op == "GlobalMaxPool":
                ref = [helper.make_node("ReduceSum", [src, axes], [out], keepdims=1)]
            else:
                ref = [helper.make_node("ReduceSum", [src, axes], [total], keepdims=1),
                       helper.make_node("Mul", [total, w.ref_init(np.array(1.0 / (H * W)))], [out])]
            w.add(op, [src], [out], ref)
            shape = (C, 1, 1)
        elif kind == "branch":
            other = draw(st.sampled_from(same_shape((C, H, W))))[0]
            op = draw(st.sampled_from(["Add", "Add", "Sub", "Max"]))
            w.add(op, [src, other], [out], [helper.make_node("Add", [src, other], [out])])
            shape = (C, H, W)
        elif kind == "const":
            size = draw(st.sampled_from([(), (C, 1, 1), (1, H, W), (C, H, W), (W,)]))  # scalar, channel, position, element
            c = w.rng.uniform(0.5, 2.0, size=size) * w.rng.choice([-1.0, 1.0], size=size)
            op = draw(st.sampled_from(["Mul", "Div"]))
            name = w.init(c, ref=False)
            factor = prog.inits[name].astype(np.float64)
            ref_c = w.ref_init(factor if op == "Mul" else 1.0 / factor)
            ins_ = [src, name] if draw(st.booleans()) or op == "Div" else [name, src]
            w.add(op, ins_, [out], [helper.make_node("Mul", [src, ref_c], [out])])
            shape = (C, H, W)
        elif kind == "concat":
            axis = draw(st.sampled_from([1, 2]))
            if axis == 1:
                other, (C2, _, _) = draw(st.sampled_from([v for v in values if v[1][1:] == (H, W)]))
                shape = (C + C2, H, W)
            else:
                other, (_, H2, _) = draw(st.sampled_from([v for v in values if v[1][0] == C and v[1][2] == W]))
                shape = (C, H + H2, W)
            w.add("Concat", [src, other], [out], axis=axis)
        elif kind == "split" and C >= 2:
            second = w.name()
            # opset 18 needs the split input or num_outputs; before, no split input means equal parts
            how = draw(st.sampled_from(["input", "num_outputs"] if opset >= 18 else ["input", "equal"]))
            if how == "equal" and C % 2:
                how = "input"
            if how == "input":
                a = draw(st.integers(1, C - 1))
                w.add("Split", [src, w.ints([a, C - a])], [out, second], axis=1)
                parts = (a, C - a)
            elif how == "equal":
                w.add("Split", [src], [out, second], axis=1)
                parts = (C // 2, C // 2)
            else:
                w.add("Split", [src], [out, second], axis=1, num_outputs=2)
                parts = (-(-C // 2), C - -(-C // 2))
            values.append((out, (parts[0], H, W)))
            if src in computed:
                computed.add(out)
            shape, out = (parts[1], H, W), second
        elif kind == "slice":
            axis = draw(st.sampled_from([1, 2, 3]))
            L = (C, H, W)[axis - 1]
            step = draw(st.sampled_from([1, 1, 2, -1]))
            start, end = draw(st.integers(-L, L)), draw(st.integers(-L - 1, L + 1))
            n_out = len(range(L)[slice(start, end, step)])
            if n_out == 0:
                values.append((src, (C, H, W)))
                continue
            neg_axis = draw(st.booleans())
            w.add("Slice", [src, w.ints([start]), w.ints([end]), w.ints([axis - 4 if neg_axis else axis]), w.ints([step])], [out])
            shape = tuple(n_out if i == axis - 1 else d for i, d in enumerate((C, H, W)))
        elif kind == "transpose":
            perm = draw(st.sampled_from([[0, 1, 3, 2], [0, 2, 1, 3], [0, 3, 2, 1], [0, 2, 3, 1]]))
            w.add("Transpose", [src], [out], perm=perm)
            shape = tuple((C, H, W)[p - 1] for p in perm[1:])
        elif kind == "pad":
            mode = draw(st.sampled_from(["constant", "constant", "reflect", "edge"]))
            top = [draw(st.integers(0, 2)) for _ in range(4)]  # h0, w0, h1, w1
            if mode == "reflect":
                top = [min(t, (H, W)[i % 2] - 1) for i, t in enumerate(top)]
            axes = opset >= 18 and draw(st.booleans())  # opset 18: pads of the named axes only
            pads = [top[0], top[1], top[2], top[3]] if axes else [0, 0, top[0], top[1], 0, 0, top[2], top[3]]
            ins_ = [src, w.ints(pads)]
            if mode == "constant" and draw(st.booleans()):
                ins_.append(w.init(np.array(0.0), powered=False))
            if axes:
                ins_ += [""] * (3 - len(ins_)) + [w.ints(draw(st.sampled_from([[2, 3], [-2, -1], [2, -1]])))]
            w.add("Pad", ins_, [out], mode=mode)
            shape = (C, H + top[0] + top[2], W + top[1] + top[3])
        elif kind == "resize" and H <= 8:
            ctm = draw(st.sampled_from(["half_pixel", "asymmetric", "align_corners"]))
            nearest = draw(st.sampled_from(["round_prefer_floor", "floor", "ceil"]))
            factor = draw(st.sampled_from([2, 3]))
            attrs = dict(mode="nearest", coordinate_transformation_mode=ctm, nearest_mode=nearest)
            if opset >= 18 and draw(st.booleans()):  # sizes of the spatial axes only (the batch is symbolic)
                ins_ = [src, "", "", w.ints([factor * H, factor * W])]
                attrs["axes"] = [2, 3]
            else:
                ins_ = [src, "", w.init(np.array([1, 1, factor, factor], np.float32), powered=False, cast=False)]
            w.add("Resize", ins_, [out], **attrs)
            shape = (C, factor * H, factor * W)
        elif kind == "shuffle" and C % 2 == 0 and C >= 2:
            a, b = w.name(), w.name()
            w.add("Reshape", [src, w.ints([0, 2, C // 2, H, W])], [a])
            w.add("Transpose", [a], [b], perm=[0, 2, 1, 3, 4])
            w.add("Reshape", [b, w.ints([-1, C, H, W])], [out])
            shape = (C, H, W)
        elif kind == "move":
            how = draw(st.sampled_from(["Gather", "Tile", "DepthToSpace", "SpaceToDepth", "ScatterND",
                                        "ScatterElements"]))
            if how == "Gather":  # channels picked (repeated, dropped, counted from the end)
                idx = [draw(st.integers(-C, C - 1)) for _ in range(draw(st.integers(1, 4)))]
                w.add("Gather", [src, w.ints(idx)], [out], axis=1)
                shape = (len(idx), H, W)
            elif how == "Tile" and H * W <= 36:
                reps = [1, draw(st.integers(1, 2)), draw(st.integers(1, 2)), 1]
                w.add("Tile", [src, w.ints(reps)], [out])
                shape = (C * reps[1], H * reps[2], W)
            elif how == "DepthToSpace" and C % 4 == 0:
                w.add("DepthToSpace", [src], [out], blocksize=2, mode=draw(st.sampled_from(["DCR", "CRD"])))
                shape = (C // 4, 2 * H, 2 * W)
            elif how == "SpaceToDepth" and H % 2 == 0 and W % 2 == 0:
                w.add("SpaceToDepth", [src], [out], blocksize=2)
                shape = (4 * C, H // 2, W // 2)
            elif how in ("ScatterND", "ScatterElements") and C >= 2:
                _scatter(draw, w, prog, how, src, out, C)
                shape = (C, H, W)
            else:
                w.add("Identity", [src], [out])
                shape = (C, H, W)
        elif kind == "reduce":  # over some non-batch axes, kept as size 1
            op = draw(st.sampled_from(["ReduceSum", "ReduceMean", "ReduceMax"]))
            axes = sorted(draw(st.sets(st.sampled_from([1, 2, 3]), min_size=1)))
            n = int(np.prod([(C, H, W)[a - 1] for a in axes]))
            as_input = op == "ReduceSum" or opset >= 18
            ref_axes = w.ref_init(np.array(axes, np.int64), powered=False)
            total = w.name("sum")
            ref = [helper.make_node("ReduceSum", [src, ref_axes], [total if op == "ReduceMean" else out], keepdims=1)]
            if op == "ReduceMean":
                ref.append(helper.make_node("Mul", [total, w.ref_init(np.array(1.0 / n))], [out]))
            if as_input:
                w.add(op, [src, w.init(np.array(axes, np.int64), ref=False)], [out], ref, keepdims=1)
            else:
                w.add(op, [src], [out], ref, axes=axes, keepdims=1)
            shape = tuple(1 if i + 1 in axes else d for i, d in enumerate((C, H, W)))
        elif kind == "neg":
            w.add("Neg", [src], [out], [helper.make_node("Identity", [src], [out])])
            shape = (C, H, W)
        elif kind == "where":  # a constant mask choosing between two branches, or a branch and 0
            other = draw(st.sampled_from(same_shape((C, H, W)) + [("zero", None)]))[0]
            if other == "zero":
                other = w.init(np.array(0.0), powered=False)
            mask = w.init(w.rng.random((C, H, W)) < 0.5)
            w.add("Where", [mask, src, other], [out])
            shape = (C, H, W)
        elif kind == "unsqueeze":
            axis, mid = draw(st.sampled_from([1, 2, 4, -1])), w.name()
            w.add("Unsqueeze", [src, w.ints([axis])], [mid])
            w.add("Squeeze", [mid, w.ints([axis])], [out])
            shape = (C, H, W)
        else:
            kind = "identity"  # (also where the drawn kind did not fit: a pure move of src)
            op = draw(st.sampled_from(["Identity", "Dropout"]))
            w.add(op, [src], [out])
            shape = (C, H, W)
        values.append((out, shape))
        if kind in COMPUTING or src in computed:
            computed.add(out)

    last, (C, H, W) = values[-1]
    if draw(st.sampled_from([False] * round(100 * (1 - refuse)) + [True] * round(100 * refuse))):
        last = _refused(w, prog, draw(st.sampled_from(REFUSED)), last)
    _head(draw, w, prog, last, C * H * W)
    candidates = [v for v in values if v[0] in computed]
    if candidates and draw(st.booleans()):
        second, shape = draw(st.sampled_from(candidates))
        if second not in [o for o, _ in prog.outputs]:
            prog.outputs.append((second, shape))
    return prog


def _scatter(draw, w: _Writer, prog: OnnxProgram, how: str, src: str, out: str, C: int) -> None:
    """Channels written in place, as the exporters write ``x[:, dst] = x[:, from]`` or ``= 0``: ScatterND
    on the channels moved first (the dynamo exporter's Transpose -> ScatterND -> Transpose), or
    ScatterElements along the channels with per-element indices; the written values are other channels
    of ``src`` or zeros of their shape (ConstantOfShape of their Shape)."""
    zero = draw(st.booleans())  # zeros into every channel would leave an all-zero activation (refused when read)
    dst = draw(st.lists(st.integers(0, C - 1), min_size=1, max_size=C - 1 if zero else C, unique=True))
    picked = [draw(st.integers(0, C - 1)) for _ in dst]
    dtype = helper.np_dtype_to_tensor_dtype(np.dtype(prog.np_dtype))
    moved, values, written = w.name(), w.name(), w.name()

    def zeros_like(name):
        shp, z = w.name(), w.name()
        w.add("Shape", [name], [shp])
        ref = helper.make_node("ConstantOfShape", [shp], [z])  # the path-norm network is float32: its default
        w.add("ConstantOfShape", [shp], [z], ref=[ref], value=helper.make_tensor("zero", dtype, [1], [0.0]))
        return z

    if how == "ScatterND":
        w.add("Transpose", [src], [moved], perm=[1, 0, 2, 3])
        w.add("Gather", [moved, w.ints(picked)], [values], axis=0)
        upd = zeros_like(values) if zero else values
        w.add("ScatterND", [moved, w.ints([[d] for d in dst]), upd], [written])
        w.add("Transpose", [written], [out], perm=[1, 0, 2, 3])
        return
    w.add("Gather", [src, w.ints(picked)], [values], axis=1)
    shp, idx = w.name(), w.name()
    w.add("Shape", [values], [shp])
    w.add("Expand", [w.ints(np.asarray(dst).reshape(1, -1, 1, 1)), shp], [idx])
    w.add("ScatterElements", [src, idx, zeros_like(values) if zero else values], [out], axis=1)


def _batch_norm(w: _Writer, prog: OnnxProgram, src: str, out: str, C: int):
    gamma = w.rng.uniform(0.5, 2.0, C) * w.rng.choice([-1.0, 1.0], C)
    beta, mean, var = w.rng.normal(size=C), w.rng.normal(size=C), w.rng.uniform(0.5, 1.5, C)
    names = [w.init(t, ref=False, prefix="bn") for t in (gamma, beta, mean, var)]
    eps = 1e-5
    g, b, m, v = (prog.inits[n].astype(np.float64) for n in names)
    scale = g / np.sqrt(v + eps)
    shift = b - m * scale
    mid = w.name("bn")
    ref = [helper.make_node("Mul", [src, w.ref_init(scale.reshape(C, 1, 1))], [mid]),
           helper.make_node("Add", [mid, w.ref_init(shift.reshape(C, 1, 1))], [out])]
    w.add("BatchNormalization", [src, *names], [out], ref, epsilon=eps)
    prog.has_bn = True


def _average_factor(attrs: dict, shape: tuple, dtype) -> np.ndarray:
    """1/divisor at each output position of an AveragePool, as onnxruntime divides: its output on an
    all-ones input over the number of input positions in each window."""
    C, H, W = shape
    g = helper.make_graph([helper.make_node("AveragePool", ["x"], ["y"], **attrs)], "avg",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, H, W])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    ones = run(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), np.ones((1, 1, H, W), np.float32))[0][0, 0]
    k, s, p = attrs["kernel_shape"], attrs["strides"], attrs["pads"]
    counts = np.zeros(ones.shape)
    for i in range(ones.shape[0]):
        for j in range(ones.shape[1]):
            r0, c0 = i * s[0] - p[0], j * s[1] - p[1]
            counts[i, j] = (min(r0 + k[0], H) - max(r0, 0)) * (min(c0 + k[1], W) - max(c0, 0))
    return (ones.astype(np.float64) / counts).reshape(1, *ones.shape)


def _refused(w: _Writer, prog: OnnxProgram, what: str, src: str) -> str:
    out = w.name()
    if what == "MulActs":
        node = w.add("Mul", [src, src], [out], None)
    elif what == "ClipAbove0":
        node = w.add("Clip", [src, w.init(np.array(0.1), ref=False)], [out], None)
    else:
        extra = [w.ints(np.array(1))] if what == "CumSum" else []  # CumSum takes its axis as an input
        node = w.add(what, [src, *extra], [out], None)
    prog.refused = (node.name, node.op_type)
    return out


def _head(draw, w: _Writer, prog: OnnxProgram, src: str, features: int):
    """Flatten, then a Gemm (transB, alpha, beta, a vector or scalar C) or a MatMul + Add; now and then
    a hidden ReLU layer before it, written as a Gemm with the activation as B (the batch on axis 1,
    read back by the next Gemm with transA=1)."""
    flat = w.name("flat")
    w.add("Flatten", [src], [flat], axis=1)
    n_layers = draw(st.integers(1, 2))
    axis1 = False  # the activation is (features, N)
    for layer in range(n_layers):
        n_out = draw(st.integers(1, 4))
        out = "y" if layer == n_layers - 1 else w.name("h")
        if axis1 or draw(st.booleans()):
            alpha, beta = draw(st.sampled_from([1.0, 0.5, -2.0])), draw(st.sampled_from([1.0, 0.25]))
            wt = w.weights(n_out, features)
            as_b = not axis1 and layer < n_layers - 1 and draw(st.sampled_from([False, False, True]))
            trans_b = as_b or draw(st.booleans())
            c = w.rng.normal(size=((n_out, 1) if as_b else n_out) if draw(st.booleans()) else ())
            w_name = w.init(wt if trans_b or as_b else wt.T, ref=False, prefix="G")
            c_name = w.init(c, ref=False, prefix="C")
            # alpha and beta folded into the tensors in the path-norm network
            ref_w = w.ref_init(alpha * prog.inits[w_name].astype(np.float64))
            ref_c = w.ref_init(beta * np.broadcast_to(prog.inits[c_name].astype(np.float64), (n_out, 1) if as_b else (n_out,)))
            ins, ref_ins = ([w_name, flat], [ref_w, flat]) if as_b else ([flat, w_name], [flat, ref_w])
            w.add("Gemm", [*ins, c_name], [out],
                  [helper.make_node("Gemm", [*ref_ins, ref_c], [out], transA=int(axis1), transB=int(trans_b))],
                  transA=int(axis1), transB=int(trans_b), alpha=alpha, beta=beta)
            axis1 = as_b
        else:
            mm = w.name("mm")
            w.add("MatMul", [flat, w.init(w.weights(n_out, features).T, prefix="M")], [mm])
            w.add("Add", [mm, w.init(w.rng.normal(size=n_out), prefix="b")], [out])
        if layer < n_layers - 1:
            flat = w.name("h")
            w.add("Relu", [out], [flat], [helper.make_node("Identity", [out], [flat])])
            features = n_out
    prog.outputs.insert(0, ("y", (n_out,)))
