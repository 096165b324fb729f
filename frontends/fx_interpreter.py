"""The fx interpreter: the lowering core's walk over a torch.fx graph.

Both torch entry points run it: :mod:`.torch_fx` on a symbolic trace and
:mod:`.torch_export` (a subclass) on the exported ATen graph. Each fx node
becomes a pending Value (:mod:`.values`) or an op of the lowering core
(:mod:`.lowering`); shape arithmetic is evaluated on concrete sizes; any other
op that touches an activation raises ``UnsupportedOperation`` naming the node,
its op, the module path it came from and why.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from pathir.errors import PathirError
from pathir.frontends import conv_transpose, fixed_dispatch
from pathir.frontends.capture_checks import alias_plan, apply_inplace, check_modes, effect_fx, refuse_inplace
from pathir.frontends.lower_extra import NOT_MINE, lower_function, lower_method, lower_module
from pathir.frontends.lowering import Lowering
from pathir.frontends.values import ParamTensor, Value

__all__ = ["FxInterpreter", "why", "bind", "values_in", "substitute"]

# ---------------------------------------------------------------- why not

_WHY = {
    "ReLU6": "clips at 6: not positively homogeneous",
    "Hardtanh": "clips: not positively homogeneous",
    "Hardswish": "not positively homogeneous (a smooth gate)",
    "Hardsigmoid": "not positively homogeneous",
    "Sigmoid": "not positively homogeneous",
    "Tanh": "not positively homogeneous",
    "GELU": "not positively homogeneous",
    "SiLU": "not positively homogeneous",
    "ELU": "not positively homogeneous",
    "LeakyReLU": "its negative slope is allowed in theory but not by pathir's neuron types",
    "Softmax": "softmax inside the graph is not positively homogeneous",
    "LogSoftmax": "log-softmax is not positively homogeneous",
    "LayerNorm": "normalizes by input-dependent statistics",
    "GroupNorm": "normalizes by input-dependent statistics",
    "LocalResponseNorm": "normalizes by input-dependent statistics",
    "MultiheadAttention": "attention multiplies activations together",
    "mul": "a multiplicative gate between two activations (or a constant factor)",
    "sigmoid": "not positively homogeneous",
    "hardsigmoid": "not positively homogeneous",
    "layer_norm": "normalizes by input-dependent statistics",
    "relu6": "clips at 6: not positively homogeneous",
    "hardtanh": "clips at fixed thresholds: not positively homogeneous (hardtanh(0, inf) is a ReLU and is lowered)",
    "abs": "positively homogeneous, but |x| is not one of pathir's neurons (identity, ReLU, max-pool)",
    "pow": "a power of an activation: not positively homogeneous",
    "sort": "orders by value: not a fixed map",
    "topk": "selects by value: not a fixed map",
    "cumsum": "a cumulative sum is a fixed linear map pathir does not lower (write it as a Linear with fixed weights)",
    "softplus": "not positively homogeneous",
    "normalize": "divides by the activation's own norm: not positively homogeneous",
    "einsum": "einsum is not lowered: write a contraction with a weight as a Linear layer or x @ W",
    **{op: ("makes a new tensor of an activation's shape: a constant (or random) input inside the network, not a "
            "ReLU DAG edge (to pad with zeros, use F.pad; a constant zero channel is a zero-padded layer)")
       for op in ("zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like", "randint_like",
                  "new_zeros", "new_ones", "new_full", "new_empty", "new_tensor")},
    **{op: "casts an activation to another dtype inside the forward: the IR computes in the model's dtype"
       for op in ("to", "type", "float", "double", "half", "bfloat16")},
    **{op: "compares an activation: a data-dependent mask, not a fixed linear map" for op in (
        "gt", "lt", "ge", "le", "eq", "ne", "greater", "less", "greater_equal", "less_equal", "__gt__", "__lt__",
        "__ge__", "__le__", "__eq__", "__ne__")},
}


def why(op: str) -> str:
    return _WHY.get(op, "outside the ReLU DAG model (identity, ReLU and max-pool neurons with linear edges)")


# ---------------------------------------------------------------- fx


_RELU = {F.relu, torch.relu, torch.relu_, F.relu_}
_ADD = {operator.add, operator.iadd, torch.add}
#: ops that only move, copy or drop elements: lowered by running them on element ids (values.run_index_op,
#: which refuses any that mixes the samples of a batch); an index argument must be a constant
_INDEX_FUNCS = {torch.flatten, torch.reshape, torch.transpose, torch.permute, torch.chunk, torch.split,
                torch.squeeze, torch.unsqueeze, operator.getitem, torch.cat, torch.concat, torch.stack, torch.hstack,
                torch.flip, torch.fliplr, torch.flipud, torch.roll, torch.rot90, torch.tile, torch.movedim,
                torch.moveaxis, torch.swapaxes, torch.swapdims, torch.unbind, torch.select, torch.narrow,
                torch.index_select, torch.repeat_interleave, torch.tensor_split}
_INDEX_METHODS = {"view", "reshape", "flatten", "contiguous", "transpose", "permute", "chunk", "split",
                  "squeeze", "unsqueeze", "clone", "view_as", "reshape_as", "narrow", "flip", "fliplr", "flipud",
                  "roll", "rot90", "repeat", "expand", "expand_as", "repeat_interleave", "tile", "movedim", "moveaxis",
                  "swapaxes", "swapdims", "unbind", "select", "index_select", "unfold", "tensor_split",
                  "split_with_sizes"}
_PASS_FUNCS = {F.dropout, F.dropout1d, F.dropout2d, F.alpha_dropout, F.feature_alpha_dropout}


class FxInterpreter:
    effect = staticmethod(effect_fx)  # what a node does to storage (capture_checks)

    def _is_state(self, node) -> bool:
        return node.op == "get_attr"

    def __init__(self, model: nn.Module, gm: torch.fx.GraphModule, name: str):
        self.model, self.gm = model, gm
        self.low = Lowering(name)
        self.env: dict[torch.fx.Node, object] = {}

    def run(self, shapes):
        """Lower the traced program; ``shapes``: one per-sample shape per tensor input."""
        shapes = [tuple(shapes)] if shapes and not isinstance(shapes[0], (tuple, list)) else [tuple(s) for s in shapes]
        self._inputs = 0
        check_modes(self.gm.graph)
        rebind = alias_plan(self.gm.graph, self.model, self.effect, self._is_state)
        for node in self.gm.graph.nodes:
            self.low.fx_name = node.name
            self.low.label = str(node.target) if node.op == "call_module" else node.name
            self.low.where = _module_path(node)
            self.low.op = _op_name(node, self.model)
            if node.op == "output":
                if self._inputs != len(shapes):
                    low_input_count(self.low, self._inputs, len(shapes))
                return self._output(node)
            refuse_inplace(rebind, node, self.env)  # a write some later reader sees through a view
            value = self._eval(node, shapes)
            apply_inplace(rebind, node, self.env, value)  # an in-place op: later readers read its result
            self.env[node] = value
            if isinstance(value, Value) and value.node is None and _data_readers(node) > 1:
                self.low.materialize(value)  # one node for every reader, not a copy per reader
        raise PathirError("the traced program has no output")

    def _args(self, node):
        return torch.fx.node.map_arg((node.args, node.kwargs), lambda n: self.env[n])

    def _eval(self, node, shapes):
        low = self.low
        if node.op == "placeholder":
            return self._input(node, shapes)
        if node.op == "get_attr":
            obj = _get(self.model, node.target)
            if isinstance(obj, torch.Tensor):
                low.direct_reads.add(node.target)  # it may become a fixed constant (torch_reread)
                return ParamTensor(node.target, obj)
            return obj
        args, kwargs = self._args(node)
        if node.op == "call_module":
            return self._module(_get(self.model, node.target), node.target, args, kwargs)
        if node.op == "call_function":
            return self._function(node.target, args, kwargs)
        if node.op == "call_method":
            return self._method(node.target, args, kwargs)
        low.unsupported(f"fx op {node.op}")

    def _input(self, node, shapes):
        """The next tensor input (its shape from ``shapes``), or the default of an optional argument."""
        if self._inputs >= len(shapes):
            if node.args:
                return node.args[0]  # forward(self, x, mask=None): the default
            low_input_count(self.low, self._inputs + 1, len(shapes))
        shape = shapes[self._inputs]
        self._inputs += 1
        return Value.of_node(self.low.b.input(node.name, shape, origin="input"), shape)

    def _output(self, node):
        out = node.args[0]
        if isinstance(out, dict):  # {"out": ..., "aux": ...}: every value an output, in order
            out = list(out.values())
        values = out if isinstance(out, (tuple, list)) else [out]
        names = []
        for v in values:
            v = self.env[v] if isinstance(v, torch.fx.Node) else v
            if not isinstance(v, Value):
                self.low.unsupported(f"the model returns {type(v).__name__}, expected tensors", "output")
            node_name = self.low.materialize(v, v.origin or "output")
            if node_name in self.low.b._nodes and self.low.b._nodes[node_name].kind.value == "input":
                self.low.unsupported("the model returns its input unchanged", "output")
            names.append(node_name)
        return self.low.b.build(outputs=names, prune_dead=True)

    # ------------------------------------------------------------ modules
    def _module(self, mod: nn.Module, path: str, args, kwargs):
        low, x = self.low, args[0] if args else None
        p = lambda attr: None if getattr(mod, attr, None) is None else ParamTensor(f"{path}.{attr}", getattr(mod, attr))
        if isinstance(mod, nn.Linear):
            return low.linear(x, p("weight"), p("bias"))
        if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            if mod.padding_mode != "zeros":
                return fixed_dispatch.conv_with_mode(low, mod, x, p("weight"), p("bias"))
            return low.conv(x, p("weight"), p("bias"), mod.stride, mod.padding, mod.dilation, mod.groups)
        if isinstance(mod, conv_transpose.MODULES):
            return conv_transpose.module(low, mod, path, args, kwargs)
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            return low.batch_norm(x, path, p("weight"), p("bias"), p("running_mean"), p("running_var"), mod.eps)
        if isinstance(mod, nn.ReLU):
            return low.relu(x)
        if isinstance(mod, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)):
            if mod.return_indices:
                low.unsupported("max-pool returning indices")
            return low.max_pool(x, mod.kernel_size, mod.stride, mod.padding, mod.dilation, mod.ceil_mode)
        if isinstance(mod, (nn.AvgPool1d, nn.AvgPool2d)):
            return low.avg_pool(x, mod.kernel_size, mod.stride, mod.padding, mod.ceil_mode, mod.count_include_pad,
                                getattr(mod, "divisor_override", None))
        if isinstance(mod, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d)):
            return low.adaptive_avg_pool(x, mod.output_size)
        if isinstance(mod, nn.Flatten):
            return low.index_op(lambda t: torch.flatten(t, mod.start_dim, mod.end_dim), [x])[0][0]
        if isinstance(mod, (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.AlphaDropout, nn.Identity)):
            return x
        out = fixed_dispatch.module(low, mod, x)
        if out is NOT_MINE:
            out = lower_module(low, mod, args)
        if out is not NOT_MINE:
            return out
        name = type(mod).__name__
        low.unsupported(why(name), name)

    # ------------------------------------------------------------ functions
    def _function(self, fn, args, kwargs):
        low = self.low
        tensors = values_in(args, kwargs)
        if not tensors:
            if fn is getattr and isinstance(args[0], ParamTensor) and args[1] in ("T", "mT", "H", "mH"):
                low.unsupported(_transposed_param(args[0]))
            if any(isinstance(a, ParamTensor) for a in list(args) + list(kwargs.values())):
                low.unsupported("computes with a model parameter outside linear/conv/batch-norm layers")
            return fn(*args, **kwargs)  # shape arithmetic on concrete sizes
        if fn is operator.getitem and isinstance(args[0], tuple) and isinstance(args[1], int):
            return args[0][args[1]]  # an op's tuple of results (chunk, max(dim), max-pool with indices)
        out = fixed_dispatch.function(low, self.model, fn, args, kwargs)
        if out is NOT_MINE:
            out = conv_transpose.function(low, self.model, fn, args, kwargs)
        if out is NOT_MINE:
            out = lower_function(low, fn, args, kwargs)
        if out is not NOT_MINE:
            return out
        if fn in _RELU:
            return low.relu(args[0])
        if fn in _ADD:
            return low.add(args[0], args[1], kwargs.get("alpha", 1))
        if fn in _PASS_FUNCS:
            return args[0]
        if fn is F.linear:
            return low.linear(*bind(args, kwargs, ["input", "weight", "bias"], {"bias": None}))
        if fn in (F.conv1d, F.conv2d, F.conv3d):
            a = bind(args, kwargs, ["input", "weight", "bias", "stride", "padding", "dilation", "groups"],
                      {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1})
            return low.conv(*a)
        if fn is F.batch_norm:
            x, mean, var, w, b, training, _, eps = bind(
                args, kwargs, ["input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"],
                {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5})
            return low.batch_norm(x, "", w, b, mean, var, eps)
        if fn in (F.max_pool1d, F.max_pool2d, F.max_pool3d, torch.max_pool1d, torch.max_pool2d):
            a = bind(args, kwargs, ["input", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"],
                      {"stride": None, "padding": 0, "dilation": 1, "ceil_mode": False, "return_indices": False})
            if a[6]:
                low.unsupported("max-pool returning indices")
            return low.max_pool(*a[:6])
        if fn in (F.avg_pool1d, F.avg_pool2d, torch.avg_pool1d):
            a = bind(args, kwargs, ["input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override"],
                      {"stride": None, "padding": 0, "ceil_mode": False, "count_include_pad": True, "divisor_override": None})
            return low.avg_pool(*a)
        if fn in (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, torch.adaptive_avg_pool1d):
            return low.adaptive_avg_pool(*bind(args, kwargs, ["input", "output_size"], {}))
        if fn is torch.mean:
            x, dim, keepdim = bind(args, kwargs, ["input", "dim", "keepdim"], {"dim": None, "keepdim": False})
            return low.mean(x, dim if dim is not None else list(range(len(x.shape) + 1)), keepdim)
        if fn is getattr:
            return _attr(args[0], args[1], low)
        if fn in (torch.cat, torch.concat):
            tensors_arg, dim = bind(args, kwargs, ["tensors", "dim"], {"dim": 0})
            if dim in (1, -len(tensors_arg[0].shape) - 1) and all(isinstance(t, Value) for t in tensors_arg):
                out = low.cat_channels(list(tensors_arg))
                if out is not None:
                    return out
        if fn in _INDEX_FUNCS:
            return self._index(lambda *ids: fn(*substitute(args, ids), **substitute(kwargs, ids)), tensors, args, kwargs)
        op = getattr(fn, "__name__", str(fn))
        low.unsupported(why(op), op)

    def _method(self, name, args, kwargs):
        low = self.low
        self_ = args[0]
        if not isinstance(self_, Value):
            if isinstance(self_, ParamTensor):
                out = lower_method(low, name, args, kwargs) if values_in(args, kwargs) else NOT_MINE
                if out is not NOT_MINE:  # self.buf * x: fx calls the buffer's method
                    return out
                if name in ("t", "transpose", "permute", "swapaxes", "swapdims"):
                    low.unsupported(_transposed_param(self_))
                low.unsupported("computes with a model parameter outside linear/conv/batch-norm layers")
            return getattr(self_, name)(*args[1:], **kwargs)
        out = fixed_dispatch.method(low, name, args, kwargs)
        if out is NOT_MINE:
            out = lower_method(low, name, args, kwargs)
        if out is not NOT_MINE:
            return out
        if name == "size":
            size = self_.size()
            return size if not args[1:] and "dim" not in kwargs else size[(args[1:] or [kwargs["dim"]])[0]]
        if name == "dim":
            return len(self_.shape) + 1
        if name in ("relu", "relu_"):
            return low.relu(self_)
        if name in ("add", "add_", "__add__", "__iadd__"):
            return low.add(self_, args[1], kwargs.get("alpha", 1))
        if name == "mean":
            x, dim, keepdim = bind(args, kwargs, ["input", "dim", "keepdim"], {"dim": None, "keepdim": False})
            return low.mean(x, dim if dim is not None else list(range(len(x.shape) + 1)), keepdim)
        if name in ("contiguous", "clone", "detach") and len(args) == 1:
            return self_
        if name in _INDEX_METHODS:
            tensors = values_in(args, kwargs)
            return self._index(lambda *ids: getattr(substitute(args, ids)[0], name)(*substitute(args, ids)[1:], **substitute(kwargs, ids)), tensors, args, kwargs)
        low.unsupported(why(name), name)

    def _index(self, fn, tensors, args=(), kwargs=None):
        if any(isinstance(a, ParamTensor) and a.tensor.is_floating_point() for a in _leaves(args, kwargs or {})):
            self.low.unsupported("moves a model parameter or buffer into the activations (a constant input to a "
                                 "neuron, not a weight on an edge)")
        outs, many = self.low.index_op(fn, tensors)
        return tuple(outs) if many else outs[0]


def low_input_count(low, takes: int, given: int):
    low.unsupported(f"the model takes {takes} tensor input(s), input_shape gives {given} shape(s): pass "
                    "input_shape=[(...), (...)], one shape per input (without the batch axis)", "placeholder")


def _data_readers(node) -> int:
    """How many fx nodes read the values of ``node`` (shape queries do not)."""
    shape_only = {("call_method", "size"), ("call_method", "dim"), ("call_function", getattr)}
    return sum((u.op, u.target) not in shape_only for u in node.users)


def _leaves(args, kwargs) -> list:
    """The leaves of args and kwargs, depth first in order (through lists, tuples and dicts): the
    order :func:`substitute` replaces Values in."""
    found: list = []

    def visit(a):
        if isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
        elif isinstance(a, dict):
            for x in a.values():
                visit(x)
        else:
            found.append(a)

    visit(args)
    visit(kwargs)
    return found


def values_in(args, kwargs) -> list[Value]:
    return [a for a in _leaves(args, kwargs) if isinstance(a, Value)]


def _transposed_param(p: ParamTensor) -> str:
    return (f"transposes the parameter '{p.name}' in the forward (a weight read in another layout): write "
            f"x @ W.T as F.linear(x, W) (W of shape (out, in)), or keep W of shape (in, out) and write x @ W")


def substitute(obj, ids):
    """Replace the Values in ``obj`` (in _values_in order) by ``ids``, and an integer or bool
    buffer / constant (an index argument) by its tensor."""
    it = iter(ids)

    def sub(a):
        if isinstance(a, Value):
            return next(it)
        if isinstance(a, ParamTensor) and not (a.tensor.is_floating_point() or a.tensor.is_complex()):
            return a.tensor
        if isinstance(a, tuple):
            return tuple(sub(x) for x in a)
        if isinstance(a, list):
            return [sub(x) for x in a]
        if isinstance(a, dict):
            return {k: sub(v) for k, v in a.items()}
        return a

    return sub(obj)


def bind(args, kwargs, names, defaults):
    out = list(args) + [None] * (len(names) - len(args))
    for i, n in enumerate(names):
        if i >= len(args):
            out[i] = kwargs.get(n, defaults.get(n))
    return out[: len(names)]


def _attr(v, attr, low):
    if isinstance(v, Value):
        if attr == "shape":
            return v.size()
        if attr == "ndim":
            return len(v.shape) + 1
        low.unsupported(f"reads attribute '{attr}' of an activation", "getattr")
    return getattr(v, attr)


def _get(model, target: str):
    obj = model
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _module_path(node) -> str:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") if hasattr(node, "meta") else None
    if stack:
        path = list(stack.values())[-1]
        return path[0] if isinstance(path, tuple) else str(path)
    return ""


def _op_name(node, model) -> str:
    if node.op == "call_module":
        return type(_get(model, node.target)).__name__
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return str(node.target) if node.op in ("call_method", "get_attr") else node.op
