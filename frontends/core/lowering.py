"""The lowering core: what each supported op does to pending Values, for every frontend.

``Lowering`` holds the GraphBuilder and the Param cache; its methods are the
ops (linear, conv, batch_norm, relu, clipped_relu, max_pool, avg_pool, adaptive_avg_pool,
mean, add, index ops): the public API every rule of the torch and ONNX op tables
calls (docs/architecture.md lists it). Rules bind their op's arguments and call
these; nothing here reads a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from pathir.backends.numpy import NumpyBackend  # counts the in-input entries of each window
from pathir.errors import UnsupportedOperation
from pathir.frontends.core.clipped import clipped_relu
from pathir.frontends.core.fixed_maps import adaptive_avg_pool, max_pool_padded
from pathir.frontends.core.pointwise_linear import linear_last_axis
from pathir.frontends.core.values import (
    BATCH,
    SELECTION,
    NegInfPadded,
    ParamTensor,
    Value,
    described,
    f64,
    f64_into,
    run_index_op,
    selection_index,
    selection_map,
    zero_constant,
)
from pathir.ir import (
    ChannelMap,
    Conv,
    Dense,
    GraphBuilder,
    Identity,
    MapKind,
    NodeKind,
    Param,
    Pool,
    Role,
    Scale,
    SourceRef,
)
from pathir.ir.builder import unique_name
from pathir.ir.verify import smallest_window
from pathir.support.array_pool import ArrayPool

__all__ = ["Lowering", "Recipe"]


@dataclass(frozen=True)
class Recipe:
    """A param's value as ``make(*tensors)`` of the model tensors named ``inputs``: called again on
    the model's current tensors, it gives bit for bit what a fresh lowering would."""

    inputs: tuple[str, ...]
    make: Callable[..., np.ndarray]


def _tuple(x, n: int) -> tuple[int, ...]:
    if isinstance(x, (list, tuple)):
        if len(x) == 1 and n > 1:
            return tuple(int(x[0]) for _ in range(n))
        return tuple(int(v) for v in x)
    return tuple(int(x) for _ in range(n))


def _pairs(padding, n: int):
    return tuple((p, p) for p in _tuple(padding, n))


class Lowering:
    """Builds the Graph while the interpreter walks the traced program."""

    def __init__(self, name: str):
        self.b = GraphBuilder(name)
        self._params: dict[str, Param] = {}
        self.recipes: dict[str, Recipe] = {}  # param name -> how to make it again (frontends/torch/reread.py)
        self.arrays = ArrayPool()  # widened params' memory, reused by re-reads once they die
        self.read: dict = {}  # tensor name -> the tensor a recipe read
        self.direct_reads: set[str] = set()  # tensors the traced program read by attribute
        self.where = ""  # module path / op of the fx node being lowered, for errors
        self.op = ""
        self.fx_name = ""
        self.label = ""  # what new nodes are named after: the module path, else the fx node name

    # ------------------------------------------------------------ helpers
    def unsupported(self, why: str, op: str | None = None):
        raise UnsupportedOperation(self.fx_name, op or self.op, self.where, why)

    def param(self, name: str, value: np.ndarray, refs: tuple[SourceRef, ...], how: str = "") -> Param:
        """One Param object per name, so a module called twice shares its weights; a tensor
        read in two roles or layouts (a conv weight reused by a transposed convolution) is refused."""
        if name not in self._params:
            self._params[name] = Param.adopt(name, value, refs, how)
        elif self._params[name].sources != tuple(refs):
            self.unsupported(f"the tensor '{name}' is read in two ways ({self._params[name].how or 'as it is'}; "
                             f"{how or 'as it is'}): one tensor shared by two kinds of layers is not lowered; read "
                             "it the same way at every use (the same layer, the same layout)")
        return self._params[name]

    def made(self, name: str, make, tensors: tuple[ParamTensor, ...], refs: tuple[SourceRef, ...],
             how: str = "") -> Param:
        """``self.param`` of the value ``make(*tensors)``, the recipe kept so that the value can be
        re-read from the model's current tensors without lowering again (frontends/torch/reread.py)."""
        if name in self._params:
            return self.param(name, self._params[name].value, refs, how)
        p = self.param(name, make(*(t.tensor for t in tensors)), refs, how)
        self.recipes[name] = Recipe(tuple(t.name for t in tensors), make)
        self.read.update((t.name, t.tensor) for t in tensors)
        return p

    def widened(self, pt: ParamTensor, refs: tuple[SourceRef, ...], how: str = "", view=lambda t: t) -> Param:
        """The param ``f64(view(tensor))``: a layout of one tensor widened into an array of
        ``self.arrays``, whose memory a later re-read reuses once the param is gone."""
        arrays = self.arrays  # not self: a recipe outlives the lowering, which holds every param

        def make(x):
            v = view(x)
            out = arrays.empty(tuple(v.shape))
            f64_into(out, v)
            return out

        return self.made(pt.name, make, (pt,), refs, how)

    def direct(self, pt: ParamTensor) -> Param:
        return self.widened(pt, (SourceRef(pt.name),))

    def materialize(self, v: Value, hint: str | None = None) -> str:
        """The node holding v: v's own node, or a new identity node with v's terms.

        v becomes that node in place, so every later use reads the one node
        (a value used twice must not become two copies of the same neurons)."""
        if v.node is not None:
            return v.node
        if not v.terms and v.bias is None:
            self.unsupported("every element of this activation is 0 (written with zeros through a view): the graph "
                             "holds no constant activation, and a later op would read it")
        name = self.b.identity(hint or v.origin or "node", v.terms, v.bias, origin=self.where, shape=v.shape)
        v.terms, v.bias = [(name, Identity())], None
        return name

    def _source(self, v: Value, flat_ok: bool = False) -> str:
        """A single node to feed a map; a Dense map also reads a flattened node directly."""
        if flat_ok and len(v.terms) == 1 and v.bias is None:
            src, m = v.terms[0]
            if m.kind in (MapKind.IDENTITY, MapKind.RESHAPE) and len(v.shape) == 1:
                return src
        return self.materialize(v)

    def apply(self, v: Value, m, bias: Param | None, flat_ok: bool = False) -> Value:
        """The pending value ``m(v) + bias``, v read from one node (a Dense map may read a flattened node)."""
        src = self._source(v, flat_ok)
        shape = m.out_shape(self.b.shape(src))
        return Value([(src, m)], shape, bias, self.label)

    def value(self, v) -> Value:
        """``v`` itself when it is an activation; any other argument is refused."""
        if not isinstance(v, Value):
            self.unsupported(f"expected an activation tensor here, got {described(v)}")
        return v

    # ------------------------------------------------------------ affine ops
    def linear(self, v: Value, weight: ParamTensor, bias: ParamTensor | None) -> Value:
        """``F.linear(v, weight, bias)``, ``weight`` read as stored or transposed (``F.linear(x, W.t())``: W stored
        (in, out)); on v of more axes, at every position of its last axis (a pointwise convolution)."""
        v = self.value(v)
        if isinstance(weight, ParamTensor) and weight.tensor.dim() != 2:
            self.unsupported(f"a linear layer whose weight has shape {list(weight.tensor.shape)}: only an (out, in) "
                             "matrix is lowered (F.linear(x, w) with a 1-d w drops the feature axis; write x @ w[:, None])")
        if len(v.shape) != 1:
            return linear_last_axis(self, v, weight, bias)
        W = self._dense(weight, stored_as_in_out=weight.transposed)
        b = self.direct(bias) if bias is not None else None
        if W.shape[1] != v.shape[0]:
            self.unsupported(f"weight {list(W.shape)} does not fit {v.shape[0]} input features")
        return self.apply(v, Dense(W), b, flat_ok=True)

    def conv(self, v: Value, weight: ParamTensor, bias, stride, padding, dilation, groups) -> Value:
        v = self.value(v)
        n = weight.tensor.dim() - 2
        if len(v.shape) != n + 1:
            self.unsupported(f"{n}-d convolution on a tensor of shape {list(v.shape)}")
        k = tuple(weight.tensor.shape[2:])
        stride, dilation = _tuple(stride, n), _tuple(dilation, n)
        if isinstance(padding, str):
            if padding == "valid":
                pads = ((0, 0),) * n
            elif padding == "same":
                total = [d * (kk - 1) for d, kk in zip(dilation, k)]
                pads = tuple((t // 2, t - t // 2) for t in total)
            else:
                self.unsupported(f"padding '{padding}'")
        else:
            pads = _pairs(padding, n)
        W = self.direct(weight)
        b = self.direct(bias) if bias is not None else None
        return self.apply(v, Conv(W, stride, pads, dilation, int(groups)), b)

    def batch_norm(self, v: Value, prefix: str, weight, bias, mean: ParamTensor, var: ParamTensor, eps: float) -> Value:
        """Inference batch-norm: a Scale edge (gamma/sigma) and a bias (beta - mean*gamma/sigma)."""
        v = self.value(v)
        if mean is None or var is None:
            self.unsupported("batch-norm without running statistics uses batch statistics: input-dependent")
        if weight is None or bias is None:
            self.unsupported("batch-norm without affine parameters (affine=False) is not lowered: a rescaling through it "
                             "is written into its γ and β (its eps does not scale with the running statistics); use "
                             "affine=True, whose γ = 1, β = 0 keep the function")
        out = (SourceRef(weight.name, Role.OUT_SCALE), SourceRef(bias.name, Role.OUT_SCALE))
        stats = (SourceRef(mean.name, Role.IN_STATS), SourceRef(var.name, Role.IN_STATS))

        def scale(gamma, var_):  # (var + eps = 0 gives inf: refused by name by the graph's finite check, no raw warning)
            with np.errstate(divide="ignore", invalid="ignore"):
                return f64(gamma) / np.sqrt(f64(var_) + eps)

        def shift(beta, mu, gamma, var_):
            with np.errstate(divide="ignore", invalid="ignore"):
                return f64(beta) - f64(mu) * f64(gamma) / np.sqrt(f64(var_) + eps)

        s = self.made(weight.name, scale, (weight, var), (SourceRef(weight.name),) + out + stats,
                      f"{weight.name} / sqrt({var.name} + {eps:g})")
        c = self.made(bias.name, shift, (bias, mean, weight, var), (SourceRef(bias.name),) + out,
                      f"{bias.name} - {mean.name} * {weight.name} / sqrt({var.name} + {eps:g})")
        if v.shape[0] != s.shape[0]:
            self.unsupported(f"batch-norm over {s.shape[0]} channels applied to shape {list(v.shape)}")
        return self.apply(v, Scale(s), c)

    # ------------------------------------------------------------ nonlinear ops
    def relu(self, v: Value, name: str | None = None) -> Value:
        """ReLU(v), its node named ``name`` (default: the op's label)."""
        v = self.value(v)
        if v.node is not None and self.b.kind(v.node) is NodeKind.RELU:
            return v  # relu(relu(x)) = relu(x)
        name = self.label if name is None else name
        moved = None if v.node is not None else _permuted(v, self.b)
        if moved is not None:  # relu(P x) = P relu(x): the neurons in the layout of x, whose channels are x's
            src, m = moved
            if self.b.kind(src) is NodeKind.RELU:
                return v  # relu(P relu(x)) = P relu(x)
            made = self.b.relu(name, [(src, Identity())], None, origin=self.where, shape=self.b.shape(src))
            return Value([(made, m)], v.shape, None, made)
        made = self.b.relu(name, v.terms, v.bias, origin=self.where, shape=v.shape)
        return Value.of_node(made, v.shape)

    def permutation_of(self, v: Value) -> tuple | None:
        """(node, gather map) where ``v`` is a permutation of that node's elements and nothing else, else None."""
        return _permuted(self.value(v), self.b)

    def is_permutation(self, v: Value) -> bool:
        """Whether ``v`` is a permutation of one node's elements and nothing else (a transpose, a permute)."""
        return _permuted(self.value(v), self.b) is not None

    def is_relu_output(self, v: Value) -> bool:
        """Whether ``v`` is a ReLU's output (≥ 0 everywhere): a ReLU node, or a permutation of one (what
        :meth:`relu` makes of a ReLU of a transposed activation)."""
        v = self.value(v)
        if v.node is not None:
            return self.b.kind(v.node) is NodeKind.RELU
        moved = _permuted(v, self.b)
        return moved is not None and self.b.kind(moved[0]) is NodeKind.RELU

    def clipped_relu(self, v: Value, threshold: Param, layout=None) -> Value:
        """min(max(v, 0), t), the param ``threshold`` holding −t per channel (of ``layout``, a ClipLayout):
        ReLU(v) − ReLU(ReLU(v) − t) (:mod:`pathir.frontends.core.clipped`)."""
        return clipped_relu(self, v, threshold, layout)

    def param_of(self, name: str) -> Param | None:
        """The param called ``name`` made so far, or None."""
        return self._params.get(name)

    def unique_param_name(self, name: str) -> str:
        """``name``, or ``name_1``, ``name_2``... if a param has it already."""
        return unique_name(name, self._params)

    def _window(self, v: Value, kernel, stride, padding, dilation, ceil_mode) -> tuple[str, Pool]:
        n = len(v.shape) - 1
        if n < 1:
            self.unsupported(f"pooling on a tensor of shape {list(v.shape)}")
        kernel = _tuple(kernel, n)
        stride = _tuple(stride if stride not in (None, [], ()) else kernel, n)
        pool = Pool(kernel, stride, _pairs(padding, n), _tuple(dilation, n), bool(ceil_mode))
        return self.materialize(v), pool

    def max_pool(self, v: Value, kernel, stride=None, padding=0, dilation=1, ceil_mode=False) -> Value:
        if isinstance(v, NegInfPadded):  # TF-"same" pooling: the -inf padding is the pool's own
            return max_pool_padded(self, v, kernel, stride, padding, dilation, ceil_mode)
        src, pool = self._window(self.value(v), kernel, stride, padding, dilation, ceil_mode)
        return self.max_pool_of(src, pool)

    def max_pool_of(self, src: str, pool: Pool) -> Value:
        """The max-pool ``pool`` of node ``src``; a window holding only padding (-inf out) is refused."""
        in_shape = self.b.shape(src)
        if smallest_window(pool, in_shape) == 0 and 0 not in pool.out_shape(in_shape):
            self.unsupported(f"a max-pool window over {list(in_shape[1:])} holds only padding ({pool.describe()}): "
                             "its output is -inf, no neuron")
        name = self.b.maxpool(self.label, src, pool, origin=self.where)
        return Value.of_node(name, self.b.shape(name))

    def avg_pool(self, v: Value, kernel, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                 divisor_override=None) -> Value:
        v = self.value(v)
        src, pool = self._window(v, kernel, stride, padding, 1, ceil_mode)
        in_shape = self.b.shape(src)
        n = len(in_shape) - 1
        ones = torch.ones((1, 1, *in_shape[1:]), dtype=torch.float64)
        avg = getattr(F, f"avg_pool{n}d")
        kw = dict(kernel_size=pool.kernel, stride=pool.stride, padding=tuple(p[0] for p in pool.padding),
                  ceil_mode=pool.ceil_mode, count_include_pad=count_include_pad)
        if n >= 2:
            kw["divisor_override"] = divisor_override
        elif divisor_override is not None:
            self.unsupported("divisor_override on a 1-d average pool")
        mean = avg(ones, **kw)[0, 0].numpy()

        count = NumpyBackend().apply(pool, np.ones((1, 1, *in_shape[1:])), (1, *in_shape[1:]))[0, 0]
        mult = np.where(count > 0, mean / np.maximum(count, 1), 0.0)
        pool = Pool(pool.kernel, pool.stride, pool.padding, pool.dilation, pool.ceil_mode, mult)
        return Value([(src, pool)], pool.out_shape(in_shape), None, self.label)

    def adaptive_avg_pool(self, v: Value, output_size) -> Value:
        v = self.value(v)
        n = len(v.shape) - 1
        out = tuple(v.shape[1 + i] if o is None else int(o) for i, o in enumerate(_tuple_none(output_size, n)))
        if out == tuple(v.shape[1:]):
            return v  # each window is one position: the identity
        src = self.materialize(v)
        in_shape = self.b.shape(src)
        if all(L % o == 0 for L, o in zip(in_shape[1:], out)):
            k = tuple(L // o for L, o in zip(in_shape[1:], out))
            pool = Pool(k, k, ((0, 0),) * n, (1,) * n, False, np.full(out, 1.0 / math.prod(k)))
            return Value([(src, pool)], pool.out_shape(in_shape), None, self.label)
        return adaptive_avg_pool(self, Value.of_node(src, in_shape), out)  # separable: one matrix per axis

    def mean(self, v: Value, dims, keepdim=False) -> Value:
        """Mean over every spatial axis (global average pooling)."""
        v = self.value(v)
        nd = len(v.shape) + 1
        dims = sorted({d % nd for d in ((dims,) if isinstance(dims, int) else dims)})
        if dims != list(range(2, nd)):
            self.unsupported(f"mean over axes {dims} of a {nd}-d tensor: only the mean over all spatial axes is linear per channel")
        pooled = self.adaptive_avg_pool(v, (1,) * (nd - 2))
        if keepdim:
            return pooled
        return self.index_op(lambda t: t.reshape(t.shape[0], -1), [pooled])[0][0]

    def add(self, a, b, alpha=1) -> Value:
        if isinstance(a, ParamTensor) and isinstance(b, Value):
            a, b = b, a
        if isinstance(a, Value) and isinstance(b, ParamTensor) and alpha == 1:
            return self.add_bias(a, b)
        if not isinstance(a, Value) or not isinstance(b, Value):
            v, c = (a, b) if isinstance(a, Value) else (b, a)
            if isinstance(v, Value) and adds_nothing(c, v):  # h + torch.zeros_like(h): h
                return v
            self.unsupported("adding a constant: a fixed non-zero bias breaks the rescaling symmetry")
        if alpha != 1:
            self.unsupported("add with alpha != 1 (a fixed weight other than 1)")
        if a.shape != b.shape:
            self.unsupported(f"add of shapes {list(a.shape)} and {list(b.shape)}: broadcasting is not supported")
        if a.bias is not None and b.bias is not None:
            b = Value.of_node(self.materialize(b), b.shape)
        return Value(a.terms + b.terms, a.shape, a.bias if a.bias is not None else b.bias, self.label)

    def add_bias(self, v: Value, bias: ParamTensor) -> Value:
        """v + bias, a learnable tensor with one entry per channel (shape (C,) on a flat value,
        (C, 1, ..) or (1, C, 1, ..) on a feature map): the bias of v's neurons; or with one entry per feature of
        the last axis of v of two or more axes (shape (O,), (1, O), ..: ``x @ W + b`` on tokens), the bias of v's
        neurons with that axis moved first. A value that already carries a bias becomes a node first (a node has
        one bias)."""
        v = self.value(v)
        t = bias.tensor
        nd = len(v.shape) + 1  # with the batch axis
        dims = [1] * (nd - t.dim()) + list(t.shape)
        learnable = isinstance(t, torch.nn.Parameter)
        if t.is_floating_point() and adds_nothing(bias, v):
            return v  # + a constant block of zeros (a layer without bias applied to an RNN's zero state): nothing
        along_last = (learnable and nd >= 3 and t.dim() <= nd and dims[-1] == v.shape[-1]
                      and all(d == 1 for d in dims[:-1]) and not (dims[-1] == 1 and v.shape[0] == 1))
        if along_last:  # x @ W + b on tokens
            return self.bias_on_last_axis(
                v, lambda first: self.widened(bias, (SourceRef(bias.name),), view=lambda x: x.reshape(-1)))
        if not learnable or not (len(dims) == nd and dims[0] == 1 and dims[1] == v.shape[0]
                                            and all(d == 1 for d in dims[2:])):
            what = (f"the parameter '{bias.name}' of shape {list(t.shape)}" if learnable
                    else f"'{bias.name}', a tensor that is not a learnable parameter (a buffer or a constant),")
            self.unsupported(f"adds {what} to an activation of shape {list(v.shape)}: only a learnable bias with one "
                             "entry per channel is a bias of the ReLU DAG model (a fixed or shared one breaks the "
                             "rescaling symmetry)")
        if v.bias is not None:
            v = Value.of_node(self.materialize(v), v.shape)
        b = self.widened(bias, (SourceRef(bias.name),), view=lambda x: x.reshape(-1))
        return Value(list(v.terms), v.shape, b, self.label)

    def bias_on_last_axis(self, v: Value, make_bias) -> Value:
        """v plus a bias with one entry per feature of its last axis: the bias of v's neurons with that axis moved
        first (index moves, no neuron), moved back after; ``make_bias(first)`` gives the Param for ``first``, v
        with the axis moved first (a selection, no bias of its own)."""
        first = self.index_op(lambda x: x.movedim(-1, 1), [v])[0][0]
        moved = Value(list(first.terms), first.shape, make_bias(first), self.label)
        return self.index_op(lambda x: x.movedim(1, -1), [moved])[0][0]

    def matmul_param(self, v: Value, weight: ParamTensor) -> Value:
        """x @ W with W a (in, out) parameter (or ``x @ W.t()``, W stored (out, in)): a dense layer whose matrix is
        the product's right factor transposed; on x of more axes (tokens), that layer at every position."""
        v = self.value(v)
        t = weight.read()
        if t.dim() == 2 and len(v.shape) > 1 and t.shape[0] == v.shape[-1]:  # on tokens: the layer at every position
            return linear_last_axis(self, v, ParamTensor(weight.name, weight.tensor, weight.kind, not weight.transposed),
                                    None)
        if t.dim() != 2 or len(v.shape) != 1 or t.shape[0] != v.shape[0]:
            self.unsupported(f"matmul of an activation of shape {list(v.shape)} by the parameter '{weight.name}' "
                             f"{'read transposed, ' if weight.transposed else ''}of shape {list(t.shape)}: only an "
                             "activation times an (in, out) matrix over its last axis is a dense layer (at every "
                             "position of the other axes)")
        W = self._dense(weight, stored_as_in_out=not weight.transposed)
        return self.apply(v, Dense(W), None, flat_ok=True)

    def _dense(self, weight: ParamTensor, stored_as_in_out: bool) -> Param:
        """A dense layer's (out, in) matrix from ``weight``: the stored tensor itself, or (``stored_as_in_out``) its
        transpose, the write-back told so (SourceRef ``transposed``)."""
        if not stored_as_in_out:
            return self.direct(weight)
        return self.widened(weight, (SourceRef(weight.name, transposed=True),), "transposed (stored (in, out))",
                            view=lambda x: x.T)

    # ------------------------------------------------------------ index ops
    def cat_channels(self, values: list[Value]) -> Value | None:
        """torch.cat along the channel axis at channel granularity (no per-element ids);
        None when some input is not a channel-level selection (use index_op)."""
        values = [self.selectable(self.value(v)) for v in values]
        spatial = {v.shape[1:] for v in values}
        if len(spatial) != 1 or any(len(v.shape) < 2 for v in values):
            return None
        total = sum(v.shape[0] for v in values)
        terms, offset = [], 0
        for v in values:
            for src, m in v.terms:
                if m.kind is MapKind.IDENTITY:
                    inner = np.arange(v.shape[0])
                elif m.kind is MapKind.CHANNEL_MAP:
                    inner = np.asarray(m.index)
                else:
                    return None
                index = np.full(total, -1)
                index[offset:offset + v.shape[0]] = inner
                terms.append((src, ChannelMap(tuple(int(i) for i in index))))
            offset += v.shape[0]
        return Value(terms, (total, *values[0].shape[1:]), None, self.label)

    # ------------------------------------------------------------ index ops
    def index_op(self, fn, inputs: list[Value]) -> tuple[list[Value], bool]:
        """Run an index-moving op ``fn(*tensors)`` on the element ids of ``inputs``;
        returns its output Values and whether the op returns a sequence."""
        inputs = [self.value(v) for v in inputs]
        try:
            decoded, many = run_index_op(fn, [v.shape for v in inputs])
        except ValueError as err:
            self.unsupported(str(err))
        prepared = [self.selectable(v) for v in inputs]
        outs = [self.compose_selection(zip(prepared, per_input), out_shape) for out_shape, per_input in decoded]
        return outs, many

    def compose_selection(self, inputs, out_shape) -> Value:
        """The Value of shape ``out_shape`` whose element t is element idx[t] of v
        (-1: none), for each (v, idx) of ``inputs``; each v is a selectable Value,
        whose selection maps are composed with idx (no new node)."""
        terms = []
        for v, idx in inputs:
            for src, m in v.terms:
                src_idx = selection_index(m, self.b.shape(src))
                composed = np.where(idx >= 0, src_idx[np.maximum(idx, 0)], -1)
                new = selection_map(composed, self.b.shape(src), out_shape)
                if new is not None:
                    terms.append((src, new))
        return Value(terms, out_shape, None, self.label)  # no term: every element written with 0

    def selectable(self, v: Value) -> Value:
        """v as a sum of selection maps without bias (a new node if it is anything else)."""
        if v.bias is None and all(m.kind in SELECTION for _, m in v.terms):
            return v
        return Value.of_node(self.materialize(v), v.shape)


def adds_nothing(c, v: Value) -> bool:
    """Whether the constant ``c`` (not a parameter) is 0 everywhere and broadcasts to ``v``'s shape, batch
    included, without growing it: ``v + c`` is ``v``."""
    if not zero_constant(c):
        return False
    t = c.tensor if isinstance(c, ParamTensor) else c
    if not hasattr(t, "shape"):
        return True  # a number
    full = (BATCH, *v.shape)
    try:
        return tuple(torch.broadcast_shapes(tuple(t.shape), full)) == full
    except RuntimeError:
        return False


def _tuple_none(x, n):
    if isinstance(x, (list, tuple)):
        return tuple(x) if len(x) == n else tuple(x[0] for _ in range(n))
    return tuple(x for _ in range(n))


def _permuted(v: Value, b) -> tuple | None:
    """(node, map) where ``v`` is a permutation of one node's elements (a transpose, a permute: a gather reading
    each element once) and nothing else, else None. A ReLU of it is the permutation of the node's ReLU, whose
    channels are the node's (a token-wise layer's features, not its tokens: one rescaling unit per feature)."""
    if len(v.terms) != 1 or v.bias is not None:
        return None
    src, m = v.terms[0]
    if m.kind is not MapKind.GATHER or m.index.size != math.prod(b.shape(src)) or np.any(m.index < 0):
        return None
    seen = np.zeros(m.index.size, dtype=bool)
    seen[m.index] = True
    return (src, m) if seen.all() else None
