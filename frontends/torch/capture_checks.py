"""Faithful capture: what torch.fx / torch.export graphs do not show, checked.

A traced graph is a dataflow graph; eager PyTorch is not: an in-place op
writes storage that other tensors (aliases, views, bases) share, hooks run
around a module's forward, and a functional call may fix its mode in the code.
This module checks a traced graph against these, before it is lowered:

- :func:`alias_plan` finds every in-place op. When the mutated tensor is
  read later through the same storage as a *whole* tensor (the tensor itself,
  ``g = h`` bindings, in-place outputs, ``detach``), the plan *rebinds* those
  readers to the op's result (eager semantics). When a later reader sees the
  mutation through a *view* (a slice, a reshape, the base of a mutated view),
  the op is refused: the IR would read the value before the mutation.
- :func:`check_modes` refuses functional calls whose mode is fixed in the code:
  ``F.dropout(x, p, training=True)`` (random), ``F.batch_norm(..., training=True)``
  (batch statistics: input-dependent).
- :func:`check_hooks` refuses global forward (pre-)hooks; a module's forward hooks and
  pre-hooks are traced where the module is called (:class:`InplaceTracer`), like the forward;
  a pre-hook whose effect is already in the tensors the module reads (pruning, legacy
  weight/spectral norm) is not run again, and must be up to date.
- :func:`state_kept` refuses a forward that writes the model's own parameters or buffers from
  Python (``self.count += 1``, ``self.buf = ...``): tracing runs that code on the real tensors,
  and the traced graph does not show it. The tensors are put back before the refusal.
- :class:`InplaceTracer` is the fx tracer the torch frontend uses: unlike the
  default one it records ``h += y`` as ``operator.iadd`` (the default traces it
  as ``h = h + y``, hiding the mutation of ``h``'s storage), and it runs a called
  module's forward pre-hooks and hooks on the symbolic values around the module
  (the default skips them). Hooks on the model itself leave the fx path: torch.export
  runs them.

Invariant: after these checks pass and the plan is applied, every value the
interpreter reads is the value eager PyTorch reads at that point of the program.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from collections import deque

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from pathir.errors import UnsupportedOperation
from pathir.frontends.core.values import Value
from pathir.frontends.torch.transposes import TRANSPOSE_ATTRIBUTES
from pathir.nn import ClippedReLU

__all__ = ["InplaceTracer", "WriteThroughView", "state_kept", "alias_plan", "refuse_inplace", "apply_inplace", "check_modes", "check_hooks", "fresh_hook_tensors",
           "effect_fx", "effect_export"]

# ---------------------------------------------------------------- tracing with augmented assignment

_IOPS = {
    "__iadd__": operator.iadd, "__isub__": operator.isub, "__imul__": operator.imul,
    "__itruediv__": operator.itruediv, "__ifloordiv__": operator.ifloordiv, "__ipow__": operator.ipow,
    "__iand__": operator.iand, "__ior__": operator.ior, "__ixor__": operator.ixor,
    "__imod__": operator.imod, "__ilshift__": operator.ilshift, "__irshift__": operator.irshift,
    "__imatmul__": operator.imatmul,
}


class _InplaceProxy(torch.fx.Proxy):
    """A Proxy that records augmented assignment as the in-place operator."""


def _make_iop(fn):
    def iop(self, other):
        return self.tracer.create_proxy("call_function", fn, (self, other), {})

    return iop


for _name, _fn in _IOPS.items():
    setattr(_InplaceProxy, _name, _make_iop(_fn))


def _has_hooks(m: nn.Module) -> bool:
    return bool(m._forward_pre_hooks or m._forward_hooks or m._backward_hooks or m._backward_pre_hooks)


class InplaceTracer(torch.fx.Tracer):
    """The default fx tracer, except that ``a += b`` becomes ``operator.iadd(a, b)``,
    ``pathir.nn.ClippedReLU`` is a leaf like a torch.nn module (its op table row lowers it), and an
    ``nn.DataParallel`` inside the model is traced through to its module."""

    def proxy(self, node):
        return _InplaceProxy(node, self)

    def _registered(self, m) -> bool:
        """Whether ``m`` is a submodule of the model being traced (fx names it by its path)."""
        try:
            self.path_of_module(m)
        except NameError:
            return False
        return True

    #: {id(module): {name: tensor}} of every parameter and buffer as the model holds them before the trace
    held: dict = {}

    def _swapped(self, m) -> str | None:
        """The first parameter or buffer of ``m`` that is not the tensor ``m`` held before the trace (a
        ``functional_call`` runs the module with other tensors put in their place), or None."""
        before = self.held.get(id(m))
        if before is None:
            return None
        now = {**m._parameters, **m._buffers}
        for name, t in before.items():
            if now.get(name) is not t:
                return name
        return None

    def is_leaf_module(self, m, module_qualified_name):
        if isinstance(m, nn.DataParallel):  # a wrapper: traced through to the module it holds, as at the root
            return False
        return isinstance(m, ClippedReLU) or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m, forward, args, kwargs):
        """The module's call as eager PyTorch runs it: its pre-hooks on the inputs, the module, its
        forward hooks on the output, each hook traced like the forward. A hook that cannot be
        traced is refused, naming the module. A module outside the model's module tree (held in a
        plain list or dict, or made inside forward) is traced through where it holds no tensor and no
        hook (its ops are the function), and refused otherwise (its tensors are not the model's)."""
        inner = getattr(m, "_orig_mod", None)
        if isinstance(inner, nn.Module) and type(m).__name__ == "OptimizedModule":  # torch.compile(submodule):
            return self.call_module(inner, inner.forward, args, kwargs)  # its module, which dynamo compiled
        if not self._registered(m):
            if next(m.parameters(), None) is not None or next(m.buffers(), None) is not None or _has_hooks(m):
                raise torch.fx.proxy.TraceError(  # (torch.export reads its tensors as constants: analysed, not written)
                    f"the forward calls a {type(m).__name__} that is not a registered submodule of the model (held in "
                    "a plain list, dict or closure, or made inside forward), and it holds tensors or hooks, which are "
                    "not the model's: register it (nn.ModuleList, nn.ModuleDict or an attribute)")
            return forward(*args, **kwargs)
        swapped = self._swapped(m)
        if swapped is not None:
            raise torch.fx.proxy.TraceError(
                f"the forward calls '{self.path_of_module(m)}' with its '{swapped}' swapped for another tensor "
                "(torch.func.functional_call, torch.nn.utils.stateless): torch.fx would read the module's own")
        pre = [(k, h) for k, h in m._forward_pre_hooks.items() if _harmless_hook(m, h) is None]
        if not pre and not m._forward_hooks:
            return super().call_module(m, forward, args, kwargs)
        where = self.path_of_module(m)
        for k, hook in pre:
            with_kwargs = k in m._forward_pre_hooks_with_kwargs
            r = _run_hook(hook, where, "pre-hook", (m, args, kwargs) if with_kwargs else (m, args))
            if r is not None and with_kwargs:
                args, kwargs = r
            elif r is not None:
                args = r if isinstance(r, tuple) else (r,)
        out = super().call_module(m, forward, args, kwargs)
        for k, hook in m._forward_hooks.items():
            with_kwargs = k in m._forward_hooks_with_kwargs
            r = _run_hook(hook, where, "hook", (m, args, kwargs, out) if with_kwargs else (m, args, out))
            if r is not None:
                out = r
        return out


def _run_hook(hook, where: str, kind: str, args):
    try:
        return hook(*args)
    except UnsupportedOperation:
        raise
    except Exception as err:
        raise UnsupportedOperation("hook", _hook_name(hook), where,
                                   f"a forward {kind} that cannot be traced ({type(err).__name__}: {err}); "
                                   "write it with traceable tensor ops or remove it") from err


def trace(model: nn.Module, n_inputs: int | None = None) -> torch.fx.Graph:
    """The fx graph of ``model`` (its ``get_attr`` targets resolve on ``model``: no GraphModule is built,
    which would generate and compile its Python code); a model with forward hooks or pre-hooks of its
    own (not of its submodules) is left to torch.export, which runs them (fx traces ``forward`` only)."""
    if model._forward_hooks or any(_harmless_hook(model, h) is None for h in model._forward_pre_hooks.values()):
        raise torch.fx.proxy.TraceError("the model has forward hooks of its own: torch.fx traces forward only")
    inner, prefix = root_wrapped(model)
    if inner is not model:  # torch.compile(model), nn.DataParallel(model): the module it runs, named as in model
        graph = trace(inner, n_inputs)
        for node in graph.nodes:
            if node.op in ("call_module", "get_attr"):
                node.target = prefix + node.target
        return graph
    if _takes_var_keywords(model):
        raise torch.fx.proxy.TraceError("the forward takes **kwargs: torch.fx would trace them as one more input")
    tracer = InplaceTracer()
    tracer.held = {id(m): {**m._parameters, **m._buffers} for m in model.modules()}
    replaced = instance_forward(model, tracer)
    if replaced is not None:
        raise torch.fx.proxy.TraceError(f"the forward of {replaced} is set on the instance: torch.fx traces "
                                        "the class's forward there")
    with _NoDraws():
        return tracer.trace(model, concrete_args=_defaults(model, n_inputs))


class _NoDraws(TorchDispatchMode):
    """Refuses an op drawing from torch's random generator while fx traces: one on concrete tensors only
    (``torch.randn(4, 4)`` in forward, no proxy in its arguments), which fx runs once and keeps as a constant,
    where the model draws again at every call."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if draws(func):
            name = str(func).replace("aten::", "")
            raise UnsupportedOperation(name, name, "", _DRAWS + ". fx ran it once while tracing and would keep "
                                       "that one draw as a constant")
        return func(*args, **(kwargs or {}))


def root_wrapped(model: nn.Module) -> tuple[nn.Module, str]:
    """(the module a wrapper at the root runs, its path in ``model`` with a trailing dot): through
    ``torch.compile`` (``_orig_mod``, the module dynamo compiles, computing its function) and
    ``nn.DataParallel`` (``module``, run on each device's slice of the batch); (model, "") otherwise."""
    inner = getattr(model, "_orig_mod", None)
    if type(model).__name__ == "OptimizedModule" and isinstance(inner, nn.Module):
        return inner, "_orig_mod."
    if isinstance(model, nn.DataParallel) and type(model).forward is nn.DataParallel.forward:  # (a subclass's own
        return model.module, "module."  # forward is traced as any model's)
    return model, ""


def instance_forward(model: nn.Module, tracer: "InplaceTracer") -> str | None:
    """The model, or its first submodule fx keeps as a leaf, whose ``forward`` is set on the instance
    (``m.forward = functools.partial(...)``, a lambda): fx traces ``type(model).forward`` at the root and
    lowers a leaf by its class, so either would be read as the class's forward (torch.export calls the
    instance's). A torch.compile wrapper's own forward excepted (its module is traced). None if none."""
    for path, m in model.named_modules():
        if "forward" in m.__dict__ and type(m).__name__ != "OptimizedModule" and (
                not path or tracer.is_leaf_module(m, path)):
            return f"'{path}' ({type(m).__name__})" if path else f"the model ({type(m).__name__})"
    return None


def _takes_var_keywords(model: nn.Module) -> bool:
    """Whether the model's forward takes ``**kwargs`` (then left to torch.export, which calls it without them)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _defaults(model: nn.Module, n_inputs: int | None) -> dict | None:
    """{name: default} of the forward's arguments after its first ``n_inputs`` (those pathir feeds): traced
    as their defaults, as the model runs without them (fx would make each a Proxy, and ``if mask is None``
    would take the branch eager never does); None where unknown."""
    if n_inputs is None:
        return None
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params[:n_inputs + 1]):
        return None  # forward(self, *xs): every input is one of xs
    named = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    given = {p.name for p in named[:n_inputs] if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD}
    out = {p.name: p.default for p in named if p.name not in given and p.default is not inspect.Parameter.empty}
    return out or None


# ---------------------------------------------------------------- what a node does to storage

_VIEW_METHODS = {"view", "reshape", "flatten", "transpose", "permute", "chunk", "split", "squeeze", "unsqueeze",
                 "view_as", "reshape_as", "narrow", "expand", "expand_as", "t", "select", "unbind", "movedim",
                 "swapaxes", "swapdims", "moveaxis", "split_with_sizes", "unflatten", "as_strided", "diagonal", "unfold",
                 "tensor_split", "mT", "T",
                 # may return the tensor itself or a copy: a write through them is refused, never rebound
                 "contiguous", "type_as", "to", "cpu", "cuda", "float", "double", "half", "bfloat16", "type"}
_WHOLE_METHODS = {"detach", "requires_grad_"}
_VIEW_FUNCS = {torch.flatten, torch.reshape, torch.transpose, torch.permute, torch.chunk, torch.split, torch.squeeze,
               torch.unsqueeze, torch.narrow, torch.t, torch.select, torch.unbind, torch.movedim, torch.swapaxes,
               torch.tensor_split, torch.unflatten, torch.diagonal, torch.moveaxis, torch.swapdims, operator.getitem}
_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout}
_WHOLE_FUNCS = {torch.detach} | _DROPOUTS
_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _signature(fn):
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _bound(fn, args, kwargs) -> dict:
    """The call's arguments by name ({} when fn has no Python signature)."""
    sig = _signature(fn)
    if sig is None:
        return {}
    try:
        b = sig.bind(*args, **kwargs)
    except TypeError:
        return {}
    b.apply_defaults()
    return dict(b.arguments)


def _get(model, target: str):
    obj = model
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def effect_fx(node, model):
    """What ``node`` of an fx symbolic trace does to the storage of its first
    argument: ("mutate", arg), ("whole", arg) (same storage, same elements),
    ("view", arg) (shares part of, or reindexes, the storage), or None."""
    if not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    arg = node.args[0]
    if node.op == "call_method":
        name = str(node.target)
        if name in _VIEW_METHODS:
            return "view", arg
        if name in _WHOLE_METHODS:
            return "whole", arg
        if name.endswith("_") and not name.startswith("_"):
            return "mutate", arg
        return None
    if node.op == "call_function":
        fn = node.target
        if fn is getattr:  # h.mT, h.T, h.mH, h.H: views of h (a write through one writes h)
            return ("view", arg) if len(node.args) > 1 and node.args[1] in TRANSPOSE_ATTRIBUTES else None
        if fn in _IOPS.values() or fn is operator.setitem:
            return "mutate", arg
        if fn in _VIEW_FUNCS:
            return "view", arg
        if fn in _WHOLE_FUNCS:
            return "whole", arg
        name = getattr(fn, "__name__", "")
        if name.endswith("_") and not name.startswith("_"):
            return "mutate", arg
        if node.kwargs.get("inplace") is True or _bound(fn, node.args, node.kwargs).get("inplace") is True:
            return "mutate", arg
        return None
    if node.op == "call_module":
        mod = _get(model, str(node.target))
        if isinstance(mod, _DROPOUT_MODULES) or isinstance(mod, nn.Identity):
            return "whole", arg  # the identity in eval mode (inplace dropout writes nothing)
        if isinstance(mod, (nn.Flatten, nn.Unflatten)):
            return "view", arg
        if getattr(mod, "inplace", False) is True:
            return "mutate", arg
    return None


def effect_export(node, model):
    """:func:`effect_fx` for an exported ATen graph, read from the op schemas."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    fn = node.target
    if fn is operator.getitem:
        return "view", node.args[0]
    schema = getattr(fn, "_schema", None)
    if schema is None or not schema.arguments:
        return None
    info = schema.arguments[0].alias_info
    if info is not None and info.is_write:
        return "mutate", node.args[0]
    if info is not None and any(r.alias_info is not None for r in schema.returns):
        name = schema.name.split("::")[-1]
        return ("whole" if name in ("alias", "detach") else "view"), node.args[0]
    return None


# ---------------------------------------------------------------- the alias plan

_SHAPE_ONLY = {("call_method", "size"), ("call_method", "dim")}
#: the attributes of an activation that describe it without reading its values (``h.mT``, ``h.T`` read them)
_SHAPE_ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "layout", "requires_grad"})


def _reads_data(user) -> bool:
    if user.op == "call_function" and user.target is getattr:
        return len(user.args) < 2 or user.args[1] not in _SHAPE_ATTRIBUTES
    return (user.op, user.target) not in _SHAPE_ONLY


def _where(node) -> str:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1]
        return path[0] if isinstance(path, tuple) else str(path)
    return ""


def _op(node) -> str:
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return str(node.target)


def _refuse(node, why: str):
    raise UnsupportedOperation(node.name, _op(node), _where(node), why)


def _component(start, edges, before: int, pos, kinds) -> set:
    """Nodes defined before position ``before`` joined to ``start`` by alias edges of ``kinds``."""
    seen, todo = {start}, deque([start])
    while todo:
        n = todo.popleft()
        for other, kind in edges.get(n, ()):
            if kind in kinds and other not in seen and pos[other] < before:
                seen.add(other)
                todo.append(other)
    return seen


def alias_plan(graph: torch.fx.Graph, model, effect, is_state=lambda node: False) -> dict:
    """{in-place node: [earlier nodes whose later readers must read its result]}.

    ``effect(node, model)`` classifies nodes (:func:`effect_fx`, :func:`effect_export`);
    ``is_state(node)`` says whether a node is a model parameter or buffer.
    Raises UnsupportedOperation for an in-place op whose effect a later reader
    sees through a view (or on a parameter/buffer)."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    edges: dict = {}
    mutations = []
    for n in nodes:
        eff = effect(n, model)
        if eff is None:
            continue
        kind, src = eff
        kind = "whole" if kind == "mutate" else kind  # an in-place op returns its input
        edges.setdefault(n, []).append((src, kind))
        edges.setdefault(src, []).append((n, kind))
        if eff[0] == "mutate":
            mutations.append((n, src))
    plan = {}
    for n, m in mutations:
        overlap = _reads_what_it_writes(n, m, edges, pos)
        if overlap is not None:
            plan[n] = (m, overlap)  # raised only if the written value is an activation (see refuse_inplace)
            continue
        try:
            plan[n] = (m, _rebind_for(n, m, edges, pos, is_state))
        except UnsupportedOperation as err:
            if any(is_state(a) or a.op == "get_attr" for a in _component(m, edges, pos[n], pos, {"whole", "view"})):
                raise
            plan[n] = (m, err)  # raised only if the mutated value is an activation (see apply_inplace)
    return plan


def _on_activation(plan: dict, node, env: dict):
    """The plan's action for ``node`` if it writes an activation (a Value), else None:
    an augmented assignment on a Python number (``n += 1`` on a size) mutates nothing."""
    action = plan.get(node)
    if action is None or not isinstance(env.get(action[0]), Value):
        return None
    return action[1]


class ReadsWhatItWrites(UnsupportedOperation):
    """An in-place op whose value is a view of the storage it writes, at other positions
    (``h[:, 1:] = h[:, :-1]``): eager PyTorch's result depends on the order its copy runs in (it
    smears h[:, 0] along the row), which neither the traced graph nor torch.export's functionalized
    one (both read the old values) reproduces. The fx path raises it for any other view of the base
    written (it cannot tell which elements a view holds); the model then goes to torch.export, whose
    eager run (:mod:`.eager_writes`) raises it only where the memory really overlaps."""


def _reads_what_it_writes(n, m, edges, pos) -> ReadsWhatItWrites | None:
    group = _component(m, edges, pos[n], pos, {"whole", "view"})
    same = _component(m, edges, pos[n], pos, {"whole"})
    for a in _nodes_in((n.args[1:], n.kwargs)):
        if a in group and a not in same:
            return ReadsWhatItWrites(
                n.name, _op(n), _where(n),
                f"its value '{a.name}' is a view of the memory '{m.name}' it writes, at other positions: eager "
                "PyTorch's result then depends on the order its copy runs in (write from a copy: .clone() the value)")
    return None


def _nodes_in(args) -> list:
    out = []
    torch.fx.node.map_arg(args, lambda a: out.append(a) or a)
    return out


class WriteThroughView(UnsupportedOperation):
    """An in-place op writes an activation that a later reader sees through a view (or as the base
    of the written view): the traced graph would read the value before the write. The torch
    frontend then lowers torch.export's functionalized graph, which has eager semantics."""


def refuse_inplace(plan: dict, node, env: dict) -> None:
    """Before ``node`` is evaluated: raise the plan's refusal (a :class:`WriteThroughView`) if it
    writes an activation through a view."""
    todo = _on_activation(plan, node, env)
    if isinstance(todo, ReadsWhatItWrites):
        raise todo
    if isinstance(todo, UnsupportedOperation):
        raise WriteThroughView(todo.node, todo.op, todo.where, todo.why) from None


def apply_inplace(plan: dict, node, env: dict, value) -> None:
    """After ``node`` was evaluated to ``value``: rebind the later readers of the activation it wrote."""
    todo = _on_activation(plan, node, env)
    for alias in todo if isinstance(todo, list) else ():
        env[alias] = value


def _rebind_for(n, m, edges, pos, is_state) -> list:
    at = pos[n]
    group = _component(m, edges, at, pos, {"whole", "view"})
    same = _component(m, edges, at, pos, {"whole"})
    if any(is_state(a) or a.op == "get_attr" for a in group):
        _refuse(n, "an in-place op on a model parameter or buffer changes the model while it runs")
    rebind = []
    for a in sorted(group, key=pos.get):
        later = [u for u in a.users if pos[u] > at and _reads_data(u)]
        if not later:
            continue
        if a not in same:
            rel = "a view of" if _is_view_of(a, m, edges, pos) else "the base (or another view) of"
            _refuse(n, f"in-place op on '{m.name}' writes storage that '{a.name}', {rel} it, shares; "
                       f"'{later[0].name}' reads '{a.name}' afterwards, and a traced graph would read the value "
                       f"before the write (write out-of-place, e.g. y = x.relu(), or clone the view)")
        rebind.append(a)
    return rebind


def _is_view_of(a, m, edges, pos) -> bool:
    """Whether ``a`` derives from ``m`` (rather than ``m`` from ``a``)."""
    node = a
    seen = set()
    while node not in seen:
        seen.add(node)
        src = [o for o, _ in edges.get(node, ()) if pos[o] < pos[node]]
        if not src:
            return False
        node = src[0]
        if node is m:
            return True
    return False


# ---------------------------------------------------------------- state written by the forward


@contextlib.contextmanager
def state_kept(model: nn.Module):
    """Runs the body (a trace of ``model``) and raises UnsupportedOperation if it wrote a
    parameter or buffer of the model in place or replaced one; buffers are restored first
    (parameters are only compared: a forward that writes them in place is refused, and its
    values cannot be put back without a copy of every weight)."""
    params = {n: (t, t._version) for n, t in model.named_parameters(remove_duplicate=False)}
    buffers = {n: (t, t._version) for n, t in model.named_buffers(remove_duplicate=False)}
    saved = {n: t.detach().clone() for n, (t, _) in buffers.items()}
    try:
        yield
    finally:
        now_p = dict(model.named_parameters(remove_duplicate=False))
        now_b = dict(model.named_buffers(remove_duplicate=False))
        moved = [n for n, (t, v) in params.items() if now_p.get(n) is not t or t._version != v]
        moved += [n for n, (t, v) in buffers.items() if now_b.get(n) is not t or t._version != v]
        if moved:
            for n, (t, _) in buffers.items():
                mod_path, _, attr = n.rpartition(".")
                owner = model.get_submodule(mod_path)
                if owner._buffers.get(attr) is not t:
                    owner._buffers[attr] = t
                with torch.no_grad():
                    t.copy_(saved[n])
            refuse_state_writes(model, moved)


def refuse_state_writes(model: nn.Module, written: list[str]) -> None:
    """UnsupportedOperation naming the model's tensors the forward writes while it runs (``written``)."""
    raise UnsupportedOperation(
        "forward", type(model).__name__, "",
        f"the forward writes the model's own {', '.join(repr(n) for n in written[:5])} while it runs (e.g. "
        "`self.count += 1`): the traced graph does not show it and every call would change the model "
        "(buffers put back as they were; keep state updates out of forward, or under `if self.training`)")


# ---------------------------------------------------------------- modes fixed in the code

_RANDOM = "is random: dropout with training=True fixed in the code (pass training=self.training)"
_BATCH_STATS = ("normalizes with batch statistics: batch_norm with training=True fixed in the code is "
                "input-dependent (pass training=self.training, or use running statistics)")
_NO_STATS = ("normalizes with batch statistics: a batch-norm without running statistics "
             "(track_running_stats=False) is input-dependent")
_STANDARDIZED = ("standardizes a parameter, not an activation (weight standardization: batch_norm with training=True "
                 "of a weight, as timm's StdConv2d / ScaledStdConv2d do): the layer's weight is then each output "
                 "channel's weights scaled to mean 0 and variance 1, a function of the parameter that is no rescaling "
                 "of its units; pathir does not lower it. Bake the standardized weights into a plain convolution "
                 "(conv.weight = the standardized weight, the standardization removed) to analyse the model")


#: torch's functions and tensor methods that draw from its random generator (ATen's carry a tag)
_RANDOM_FUNCTIONS = frozenset({torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like,
                               torch.randint_like, torch.randperm, torch.bernoulli, torch.normal, torch.multinomial,
                               torch.poisson})
_RANDOM_METHODS = frozenset({"normal_", "uniform_", "bernoulli_", "bernoulli", "random_", "exponential_",
                             "geometric_", "log_normal_", "cauchy_", "multinomial"})
_DRAWS = ("is random: it draws from a random generator, which pathir does not lower (with torch's global one the "
          "model computes another function at every call); make the tensor once, outside forward, and register it "
          "as a buffer")
#: the arguments of an ATen op whose seeded randomness is a dropout it may switch off (an RNN's, attention's): such
#: an op is read by its own rule, which refuses it for what it computes
_DROPOUT_ARGUMENTS = frozenset({"dropout", "dropout_p", "train", "training"})


def draws(op) -> bool:
    """Whether the ATen ``op`` draws from a random generator whatever its arguments (tagged seeded, no dropout)."""
    schema = getattr(op, "_schema", None)
    return (torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()) and schema is not None
            and not any(a.name in _DROPOUT_ARGUMENTS for a in schema.arguments))


def _fixed_mode(node, is_state=None) -> str | None:
    """The reason a call with a mode fixed in the code is refused, or None; ``is_state(placeholder)``: whether a
    placeholder is the model's own tensor (torch.export lifts them), not an input."""
    if node.op == "call_method":
        return _DRAWS if node.target in _RANDOM_METHODS else None
    if node.op != "call_function":
        return None
    fn, args, kwargs = node.target, node.args, node.kwargs
    aten = torch.ops.aten
    if fn in _DROPOUTS:
        a = _bound(fn, args, kwargs)
        return _RANDOM if a.get("training") is True and a.get("p", 0.5) != 0 else None
    if fn in (torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout,
              aten.dropout.default, aten.alpha_dropout.default, aten.feature_dropout.default,
              aten.feature_alpha_dropout.default):
        p = args[1] if len(args) > 1 else kwargs.get("p")
        train = args[2] if len(args) > 2 else kwargs.get("train")
        return _RANDOM if train is True and p != 0 else None
    if fn in (aten.native_dropout.default, aten.bernoulli.p, aten.bernoulli.default, aten.rand_like.default):
        return "is random"
    if fn is F.batch_norm:
        a = _bound(fn, args, kwargs)
        return _batch_stats(a.get("running_mean"), a.get("training"), a.get("input"), is_state)
    if fn in (torch.batch_norm, aten.batch_norm.default):
        training = args[5] if len(args) > 5 else kwargs.get("training")
        return _batch_stats(args[3] if len(args) > 3 else kwargs.get("running_mean"), training,
                            args[0] if args else kwargs.get("input"), is_state)
    if fn in (F.instance_norm, torch.instance_norm):
        return "normalizes with per-sample statistics: input-dependent"
    if fn in _RANDOM_FUNCTIONS or draws(fn):
        return _DRAWS
    return None


def _batch_stats(running_mean, training, input=None, is_state=None) -> str | None:
    """Why a batch-norm call normalizes with batch statistics (none kept, or training fixed), or None; its
    ``input`` (an fx node) read from the model's attributes only, no input upstream: it standardizes a weight."""
    if training is not True:
        return None
    if isinstance(input, torch.fx.Node) and not _reads_input(input, is_state):
        return _STANDARDIZED
    return _NO_STATS if running_mean is None else _BATCH_STATS


def _reads_input(node: torch.fx.Node, is_state=None) -> bool:
    """Whether ``node`` depends on a placeholder that is a model input (``is_state``: which placeholders are the
    model's own tensors, lifted by torch.export)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n.op == "placeholder" and not (is_state is not None and is_state(n)):
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return False


def check_modes(graph: torch.fx.Graph, is_state=None) -> None:
    """Refuse functional calls whose mode is fixed in the code (random, or batch statistics); ``is_state``: as
    for :func:`_fixed_mode`."""
    for node in graph.nodes:
        why = _fixed_mode(node, is_state)
        if why:
            _refuse(node, why)


# ---------------------------------------------------------------- hooks


def _harmless_hook(module, hook) -> str | None:
    """The tensor name a hook keeps up to date (prune, legacy weight/spectral norm), or None."""
    from torch.nn.utils.prune import BasePruningMethod
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    if isinstance(hook, BasePruningMethod):
        return hook._tensor_name
    if isinstance(hook, (WeightNorm, SpectralNorm)):
        return hook.name
    return None


def _hook_value(module, hook):
    from torch.nn.utils.prune import BasePruningMethod
    from torch.nn.utils.spectral_norm import SpectralNorm

    with torch.no_grad():
        if isinstance(hook, BasePruningMethod):
            return hook.apply_mask(module)
        if isinstance(hook, SpectralNorm):
            return hook.compute_weight(module, do_power_iteration=False)
        return hook.compute_weight(module)


def _hook_name(hook) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


def check_hooks(model: nn.Module) -> list:
    """Refuse the global forward (pre-)hooks (``register_module_forward_(pre_)hook``): they run
    around every module call. A module's own hooks are traced (:class:`InplaceTracer`; torch.export
    runs them too). Pruning and the legacy weight_norm / spectral_norm pre-hooks are not run again:
    the tensor they compute is what the module reads. Returns the attributes that lag behind their
    hook (for :func:`fresh_hook_tensors`)."""
    from torch.nn.modules import module as M

    for kind, hooks in (("global forward pre-hook", M._global_forward_pre_hooks),
                        ("global forward hook", M._global_forward_hooks)):
        for hook in hooks.values():
            raise UnsupportedOperation("hook", _hook_name(hook), type(model).__name__,
                                       f"a {kind} changes what modules compute and is not traced; remove it")
    stale = []
    for path, mod in model.named_modules():
        where = path or type(model).__name__
        for hook in mod._forward_pre_hooks.values():
            name = _harmless_hook(mod, hook)
            if name is None:
                continue  # traced where the module is called
            lag = _stale(mod, hook, name, where)
            if lag is not None:
                stale.append(lag)
    return stale


def _stale(mod, hook, name: str, where: str):
    """(module, attribute, the value its hook computes now) when the attribute the module reads
    lags behind it (the tensors changed since the last forward, e.g. an optimizer step), else None."""
    current = getattr(mod, name, None)
    expected = _hook_value(mod, hook)
    if not isinstance(current, torch.Tensor) or current.shape != expected.shape:
        raise UnsupportedOperation("hook", type(hook).__name__, where, f"'{name}' is not the tensor its hook computes")
    if current is expected or torch.equal(current.detach(), expected.detach()):
        return None
    return mod, name, expected.detach()


@contextlib.contextmanager
def fresh_hook_tensors(stale):
    """While lowering, a module reads what its pruning / weight-norm hook would compute at the next
    forward (as eager PyTorch does), not a value left from before the last parameter update;
    the model's own attributes are put back afterwards."""
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in stale]
    try:
        for mod, name, value in stale:
            setattr(mod, name, value)
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)
