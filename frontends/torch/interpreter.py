"""The fx interpreter: the lowering core's walk over a torch.fx graph.

Both torch entry points run it: :mod:`.lower` on a symbolic trace and :mod:`.export` (a subclass)
on the exported ATen graph. Each fx node becomes a pending Value (:mod:`..core.values`) through
the rule its target has in the op table (:mod:`.table`); shape arithmetic is evaluated on
concrete sizes; any other op that touches an activation raises ``UnsupportedOperation`` naming
the node, its op, the module path it came from and why (:mod:`.why`).
"""

from __future__ import annotations

import inspect
import math
import operator
from dataclasses import replace

import torch
import torch.fx
import torch.nn as nn
from torch.nn.utils import parametrize

from pathir.errors import PathirError
from pathir.frontends.core.lowering import Lowering
from pathir.frontends.core.values import BatchStacked, MaxIndices, NegInfPadded, ParamTensor, Value, described, leaves, values_in
from pathir.frontends.torch.batch_size import ALT_BATCHES, alternative, check_batch_numbers, marked_result
from pathir.frontends.torch.capture_checks import alias_plan, apply_inplace, check_modes, effect_fx, refuse_inplace
from pathir.frontends.torch.shared_memory import registered_names
from pathir.frontends.torch.table import rule_for
from pathir.frontends.torch.transposes import TRANSPOSE_ATTRIBUTES, TRANSPOSE_METHODS, is_transpose, transposed, transposed_param
from pathir.frontends.torch.why import why
from pathir.ir import NodeKind, verify

__all__ = ["FxInterpreter", "TorchLowering", "invoke"]


class TorchLowering(Lowering):
    """The lowering core with the model at hand: rules ask it which tensors are buffers."""

    def __init__(self, name: str, model: nn.Module):
        super().__init__(name)
        self.model = model
        self._buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
        self._parameters = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        # a tensor registered under several names (one Parameter held by two modules) -> its first name: one
        # param of the graph, so that its uses tie (a weight shared by layers in series pins their channels)
        self._first_name = {ident: names[0] for ident, names in registered_names(model).items()}
        self.clips: dict = {}  # threshold param name -> ClipSite, what holds it in the model (frontends/torch/clipped.py)

    def widened(self, pt: ParamTensor, refs, how: str = "", view=lambda t: t):
        """The core's widened param, named by the tensor's first registered name where it has several."""
        first = self._first_name.get(id(pt.tensor), pt.name)
        if first != pt.name:
            refs = tuple(replace(r, name=first) if r.name == pt.name else r for r in refs)
            pt = ParamTensor(first, pt.tensor, pt.kind)
        return super().widened(pt, refs, how, view)

    def is_buffer(self, t) -> bool:
        """Whether ``t`` is a registered buffer of the model (a fixed tensor, never a parameter)."""
        if not isinstance(t, ParamTensor):
            return False
        return t.kind == "buffer" or (t.name in self._buffers and t.name not in self._parameters)

    def is_registered(self, t) -> bool:
        """Whether ``t`` is one of the model's own parameters or buffers (a tensor a write-back can reach), not a
        tensor made in the forward."""
        return isinstance(t, ParamTensor) and (t.name in self._buffers or self.is_parameter(t))

    def is_parameter(self, t) -> bool:
        """Whether ``t`` is a parameter of the model (or the original of a parametrized one)."""
        return isinstance(t, ParamTensor) and (t.name in self._parameters or t.name + "_orig" in self._parameters)


def refuse_params(low, op: str, args, kwargs) -> None:
    """Refuse ``op`` computing with a model parameter outside the layers that read one (naming a weight read
    transposed, and what to write instead)."""
    params = [a for a in leaves(args, kwargs) if isinstance(a, ParamTensor)]
    turned = next((p for p in params if p.transposed), None)
    if turned is not None:
        low.unsupported(transposed_param(turned, op))
    if params:
        named = ", ".join(dict.fromkeys(f"'{p.name}'" for p in params))
        low.unsupported(f"computes with the model's tensor {named} outside linear/conv/batch-norm layers: a tensor "
                        "computed from it in the forward (2 * self.W, a slice of it, an expanded class token) is no "
                        "layer's weight, and no write-back reaches the tensor the model computes with")


#: the arguments that are not activations yet, which only a rule marked for them reads: (is it one, the marker,
#: why any other rule refuses it)
_GATES = (
    (lambda a: isinstance(a, NegInfPadded), "reads_neg_inf_padding", lambda a, rule: f"reads {described(a)}"),
    (lambda a: isinstance(a, BatchStacked), "reads_batch_stacked", lambda a, rule: f"reads {described(a)}"),
    (lambda a: isinstance(a, ParamTensor) and a.transposed, "reads_transposed",
     lambda a, rule: transposed_param(a, getattr(rule, "__name__", ""))),
)


def invoke(low, rule, args, kwargs):
    """``rule(low, *args, **kwargs)``; arguments its parameter list does not bind are refused, and so is an
    argument that is not an activation yet (an activation padded with -inf, a stack on dim 0, a weight read
    transposed: :data:`_GATES`) where the rule is not marked as one that reads it."""
    try:
        inspect.signature(rule).bind(low, *args, **kwargs)
    except TypeError as err:
        low.unsupported(f"arguments pathir does not lower: {err}")
    found = leaves(args, kwargs)
    for kind, marker, refusal in _GATES:
        hit = next((a for a in found if kind(a)), None)
        if hit is not None and not getattr(rule, marker, False):
            low.unsupported(refusal(hit, rule))
    return rule(low, *args, **kwargs)


class FxInterpreter:
    effect = staticmethod(effect_fx)  # what a node does to storage (capture_checks)

    def _is_state(self, node) -> bool:
        return node.op == "get_attr"

    def __init__(self, model: nn.Module, graph: torch.fx.Graph, name: str):
        self.model, self.graph = model, graph
        self.low = TorchLowering(name, model)
        self.env: dict[torch.fx.Node, object] = {}

    def run(self, shapes):
        """Lower the traced program; ``shapes``: one per-sample shape per tensor input."""
        shapes = [tuple(shapes)] if shapes and not isinstance(shapes[0], (tuple, list)) else [tuple(s) for s in shapes]
        self._inputs = 0
        check_modes(self.graph, self._is_state)
        rebind = alias_plan(self.graph, self.model, self.effect, self._is_state)
        for node in self.graph.nodes:
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
            if isinstance(value, Value) and value.node is None and _data_readers(node) > 1 \
                    and not self.low.is_permutation(value):  # (a permutation holds no neurons: each reader reads
                self.low.materialize(value)  # its node's) one node for every reader, not a copy per reader
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
                low.direct_reads.add(node.target)  # it may become a fixed constant (frontends/torch/reread.py)
                # no parameter of the model and nothing autograd traces back to one: a buffer, a plain tensor
                # attribute, or fx's tensor constant made in forward from none (torch.eye(4) * 0.5, a buffer's
                # transpose), is a fixed tensor; one that requires grad (a learnable parameter's view or product:
                # `s._parameters['W'].t()`, an attribute `s.Wt = s.W.t()`) stays a parameter
                learnable = low.is_parameter(ParamTensor(node.target, obj)) or obj.requires_grad
                turned = _transpose_of_named(self.model, node.target, obj)
                if turned is not None and (low.is_parameter(ParamTensor(*turned)) or turned[1].requires_grad):
                    # `W.t()` made eagerly around fx's proxies (a pruned W is a plain attribute, so its .t() is no
                    # proxy; made under no_grad it requires none): W itself, read transposed
                    return ParamTensor(turned[0], turned[1], "parameter", transposed=True)
                if learnable and node.target.startswith("_tensor_constant"):  # made from a learnable tensor around
                    _refuse_learnable_constant(low, self.model, node.target, obj)  # the trace: no tensor of the model
                return ParamTensor(node.target, obj, "parameter" if learnable else "buffer")
            return obj
        args, kwargs = self._args(node)
        _refuse_read_indices(low, node, args, kwargs)
        numbers = check_batch_numbers(low, node.target, args, kwargs)  # n / 2 of n = x.size(0): marked too
        if node.op == "call_module":
            return self._module(_get(self.model, node.target), node.target, args, kwargs)
        if node.op not in ("call_function", "call_method"):
            low.unsupported(f"fx op {node.op}")
        call = self._function if node.op == "call_function" else self._method
        value = _made_here(node, call(node.target, args, kwargs), args, kwargs)
        if not numbers:
            return value

        def at(k):  # the number at batch ALT_BATCHES[k] (nan where it has none there: 1 / (n - 1) at 1)
            try:
                return call(node.target, *alternative(args, kwargs, k))
            except Exception:  # noqa: BLE001 - any failure of plain arithmetic
                return math.nan

        return marked_result(low, value, tuple(at(k) for k in range(len(ALT_BATCHES))))

    def _input(self, node, shapes):
        """The next tensor input (its shape from ``shapes``), or the default of an optional argument; for
        ``forward(self, *xs)`` (fx's one placeholder ``*xs``) the tuple of every input left."""
        if str(node.target).startswith("*") and not str(node.target).startswith("**"):
            return tuple(self._next_input(f"{node.name}_{i}", shapes) for i in range(len(shapes) - self._inputs))
        if self._inputs >= len(shapes):
            if node.args:
                return node.args[0]  # forward(self, x, mask=None): the default
            low_input_count(self.low, self._inputs + 1, len(shapes))
        return self._next_input(node.name, shapes)

    def _next_input(self, name: str, shapes):
        """A graph input named ``name`` of the next shape in ``shapes``."""
        shape = shapes[self._inputs]
        self._inputs += 1
        return Value.of_node(self.low.b.input(name, shape, origin="input"), shape)

    def _returned(self, node):
        """What the forward returns: the output node's argument."""
        return node.args[0]

    def _flat(self, out) -> list:
        """The tensors a forward returns, in order, through tuples, lists, dicts and namedtuples nested in one
        another (as torch.export flattens them): ``({"o": a}, [b, c])`` is a, b, c."""
        out = self.env[out] if isinstance(out, torch.fx.Node) else out  # (a namedtuple built in the forward)
        if isinstance(out, dict):
            return [v for x in out.values() for v in self._flat(x)]
        if isinstance(out, (tuple, list)):
            return [v for x in out for v in self._flat(x)]
        return [out]

    def _output(self, node):
        names = []
        for v in self._flat(self._returned(node)):
            if isinstance(v, MaxIndices):
                self.low.unsupported(f"the model returns the indices of a {v.op}: data-dependent, no fixed map", "output")
            if isinstance(v, ParamTensor):
                self.low.unsupported(f"the model returns a tensor no input reaches ('{v.name}': a parameter, a buffer or "
                                     "a constant made in the forward, such as torch.zeros): pathir's graph holds the "
                                     "functions of the input; return it beside the model instead", "output")
            if not isinstance(v, Value):
                what = described(v) if isinstance(v, NegInfPadded) else f"{type(v).__name__}, expected tensors"
                self.low.unsupported(f"the model returns {what}", "output")
            node_name = self.low.materialize(v, v.origin or "output")
            if self.low.b.kind(node_name) is NodeKind.INPUT:
                self.low.unsupported("the model returns its input unchanged", "output")
            names.append(node_name)
        graph = self.low.b.build(outputs=names, check=False, prune_dead=True)
        used = {e.source for n in graph.nodes for e in n.edges}
        unused = [n.name for n in graph.nodes if n.kind is NodeKind.INPUT and n.name not in used]
        if unused:
            self.low.fx_name, self.low.where = unused[0], "forward's arguments"
            self.low.unsupported(f"the forward's input(s) {', '.join(map(repr, unused))} reach no output (unused, or "
                                 "read only for a shape): pathir analyses the paths from every input; wrap the model "
                                 "in a module whose forward takes only the inputs it uses", "placeholder")
        return verify(graph)

    # ------------------------------------------------------------ calls
    def _module(self, mod: nn.Module, path: str, args, kwargs):
        if _quantizing(mod):
            self.low.unsupported(f"{type(mod).__module__}.{type(mod).__name__} quantizes in its forward (fake-quantized "
                                 "or quantized weights or outputs, quantization-aware training): the weights it "
                                 "computes with are not its parameters, and rounding is not positively homogeneous. "
                                 "Analyse the float model (before torch.ao's prepare or convert)", type(mod).__name__)
        if isinstance(mod, parametrize.ParametrizationList) and not args and not kwargs:
            # `self.W` of a parametrized attribute read in the forward (fx calls its ParametrizationList): the tensor
            # it computes, under the attribute's own name, written back through the parametrization (weight_norm)
            owner, _, _ = path.rpartition(".parametrizations.") if ".parametrizations." in path else ("", "", "")
            attr = path.rpartition(".")[2]
            learnable = next(mod.parameters(), None) is not None  # (a parametrized buffer stays fixed)
            return ParamTensor(f"{owner}.{attr}" if owner else attr, mod(), "parameter" if learnable else "buffer")
        rule = rule_for(type(mod))
        if rule is None:
            name = type(mod).__name__
            self.low.unsupported(why(name), name)
        return invoke(self.low, rule, (mod, *args), kwargs)

    def _function(self, fn, args, kwargs):
        low = self.low
        if not values_in(args, kwargs):
            if fn is getattr and isinstance(args[0], ParamTensor) and args[1] in TRANSPOSE_ATTRIBUTES:
                return transposed(low, args[0], args[1])
            if args and isinstance(args[0], ParamTensor) and is_transpose(fn):
                return transposed(low, args[0], getattr(fn, "__name__", str(fn)), *args[1:], **kwargs)
            args, kwargs = _read_made_here(args, kwargs)
            refuse_params(low, getattr(fn, "__name__", str(fn)), args, kwargs)
            return fn(*args, **kwargs)  # shape arithmetic on concrete sizes, constants made in the forward
        if isinstance(fn, type) and issubclass(fn, tuple) and hasattr(fn, "_fields"):
            return fn(*args, **kwargs)  # a namedtuple of results (GoogLeNetOutputs): read by the output
        if fn is operator.getitem and isinstance(args[0], tuple) and isinstance(args[1], int):
            return args[0][args[1]]  # an op's tuple of results (chunk, max(dim), max-pool with indices)
        return self._call(fn, getattr(fn, "__name__", str(fn)), args, kwargs)

    def _method(self, name, args, kwargs):
        self_ = args[0]
        if isinstance(self_, (BatchStacked, NegInfPadded)):  # read by the method's rule, or refused there
            return self._call(name, name, args, kwargs)
        if not isinstance(self_, Value):
            if isinstance(self_, MadeHere) and not values_in(args, kwargs):
                args, kwargs = _read_made_here(args, kwargs)
                self_ = args[0]
            if isinstance(self_, ParamTensor):
                if values_in(args, kwargs) and rule_for(name) is not None:  # self.buf * x: fx calls the buffer's method
                    return self._call(name, name, args, kwargs)
                if name in TRANSPOSE_METHODS:
                    return transposed(self.low, self_, name, *args[1:], **kwargs)
                refuse_params(self.low, name, args, kwargs)
            return getattr(self_, name)(*args[1:], **kwargs)
        return self._call(name, name, args, kwargs)

    def _call(self, target, name: str, args, kwargs):
        """The rule of ``target`` on the node's arguments, or a refusal naming ``name``."""
        rule = rule_for(target)
        if rule is None:
            self.low.unsupported(why(name.split(".")[0]), name)
        return invoke(self.low, rule, args, kwargs)


def _refuse_read_indices(low, node, args, kwargs) -> None:
    """Refuse an op that reads the indices of a max or max-pool (taking one result of an op's tuple is no read)."""
    if node.op == "call_function" and node.target in (operator.getitem, getattr) and isinstance(args[0], tuple):
        return
    read = next((a for a in leaves(args, kwargs) if isinstance(a, MaxIndices)), None)
    if read is not None:
        low.unsupported(f"reads the indices the {read.op} returns: which element is largest depends on the "
                        "input, no fixed map (only its values are lowered)")


class MadeHere(ParamTensor):
    """A float tensor the forward made from constants alone (``torch.eye(4, dtype=x.dtype)``: fx records the call,
    as it reads x's dtype), read as fx's own tensor constant (``torch.eye(4)``, made while tracing) is: a fixed
    matrix, kernel or factor. Unlike a buffer it may be computed with (``0.5 * torch.eye(4, dtype=x.dtype)``):
    nothing a write-back or a live re-read could change reaches it."""


def _made_here(node, value, args, kwargs):
    """``value``, as a :class:`MadeHere` named after the node where it is such a tensor."""
    if (isinstance(value, torch.Tensor) and value.is_floating_point() and not value.requires_grad
            and not isinstance(value, nn.Parameter) and not values_in(args, kwargs)):
        return MadeHere(f"{node.name} (made in the forward)", value, "buffer")
    return value


def _read_made_here(args, kwargs):
    """args and kwargs with every :class:`MadeHere` replaced by its tensor (torch's pytree walk, as the export
    interpreter unwraps its constants)."""
    return torch.utils._pytree.tree_map(lambda a: a.read() if isinstance(a, MadeHere) else a, (args, kwargs))


def low_input_count(low, takes: int, given: int):
    low.unsupported(f"the model takes {takes} tensor input(s), input_shape gives {given} shape(s): pass "
                    "input_shape=[(...), (...)], one shape per input (without the batch axis)", "placeholder")


def _data_readers(node) -> int:
    """How many fx nodes read the values of ``node`` (shape queries do not)."""
    shape_only = {("call_method", "size"), ("call_method", "dim"), ("call_function", getattr),
                  ("call_function", torch.ops.aten.sym_size.int)}  # (torch.export's size read)
    return sum((u.op, u.target) not in shape_only for u in node.users)


def _refuse_learnable_constant(low, model, target: str, t: torch.Tensor) -> None:
    """Refuse fx's tensor constant ``t``, made from a learnable tensor outside the traced program (a slice, a copy, a
    product of a pruned or parametrized weight): the graph would hold a param that is no tensor of the model, which no
    write-back reaches and which every new trace names anew."""
    if getattr(parametrize, "_cache_enabled", 0):
        low.unsupported(f"reads the tensor fx recorded as the constant '{target}' inside "
                        "torch.nn.utils.parametrize.cached(), where a parametrized weight read by attribute is the "
                        "cache's tensor, not traced: compile outside the context")
    base = _named(model, t._base) if t._base is not None else None
    names = [base] if base else _autograd_sources(model, t)
    source = f"from {', '.join(repr(n) for n in names)} " if names else ""
    low.unsupported(f"reads a tensor computed {source}outside the traced program (fx recorded it as the constant "
                    f"'{target}': a slice, copy or product of a weight that is a plain attribute, such as a pruned "
                    "weight's W.t()[:, 1:] or W.T.contiguous()); pathir reads such a weight itself or its transpose "
                    "(W, W.t(), W.T) in a product: slice the activation instead, or hold the part as its own "
                    "nn.Parameter")


def _autograd_sources(model, t: torch.Tensor, limit: int = 256) -> list[str]:
    """The names of the model's parameters autograd traces ``t`` back to (its graph's leaves, a few hundred nodes at
    most), in the model's order."""
    leaves, todo, seen = set(), [t.grad_fn], 0
    while todo and seen < limit:
        fn = todo.pop()
        seen += 1
        if fn is None:
            continue
        if hasattr(fn, "variable"):
            leaves.add(id(fn.variable))
        todo.extend(next_fn for next_fn, _ in fn.next_functions)
    return [n for n, p in model.named_parameters() if id(p) in leaves]


def _named(model, base: torch.Tensor) -> str | None:
    """The name under which ``model`` holds ``base`` (a parameter, or a plain tensor attribute), or None."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        for k, v in (*module._parameters.items(), *vars(module).items()):
            if v is base:
                return f"{prefix}.{k}" if prefix else k
    return None


def _transpose_of_named(model, target: str, t: torch.Tensor):
    """(name, tensor) of the model's own 2-d tensor (a parameter, or a plain attribute such as a pruned weight) of which
    fx's tensor constant ``t`` is the transpose, a view of its memory; None for any other constant."""
    base = t._base
    if not target.startswith("_tensor_constant") or t.dim() != 2 or base is None or base.dim() != 2:
        return None
    if (t.shape != base.shape[::-1] or t.stride() != base.stride()[::-1] or t.storage_offset() != base.storage_offset()
            or t.data_ptr() != base.data_ptr()):
        return None
    name = _named(model, base)
    return None if name is None else (name, base)


def _get(model, target: str):
    obj = model
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _quantizing(mod: nn.Module) -> bool:
    """Whether ``mod`` quantizes in its forward: a torch.ao (or torch.nn) qat / quantized module, which takes the
    rule of the float layer it subclasses (nn.Linear's for qat.Linear) but computes with fake-quantized weights, or
    any module holding a weight fake-quant or an activation observer."""
    where = type(mod).__module__
    return (any(f".{part}" in where for part in ("qat", "quantized")) and where.startswith(("torch.ao.nn", "torch.nn"))
            or hasattr(mod, "weight_fake_quant") or hasattr(mod, "activation_post_process"))


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
