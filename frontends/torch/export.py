"""torch.export fallback of the torch frontend: interpret the exported ATen graph.

Used when torch.fx symbolic tracing fails (e.g. Python control flow on shapes), or when a traced
graph writes an activation in place through a view a later op reads (``c[:, :2].relu_()``,
``c[:, 1] = 0``): then torch.export's functionalized graph (``slice_scatter``, ``select_scatter``)
is lowered, which has eager semantics.
ATen ops are rows of the same op table as the fx path (:mod:`.table`); parameters and
buffers arrive as lifted placeholders named by their FQN.
"""

from __future__ import annotations

import re

import torch
from torch.export.graph_signature import OutputKind

from pathir.errors import UnsupportedOperation
from pathir.frontends.core.values import ParamTensor, leaves, values_in
from pathir.frontends.torch.capture_checks import WriteThroughView, effect_export, refuse_state_writes
from pathir.frontends.torch.eager_writes import check_eager_writes
from pathir.frontends.torch.inputs import model_dtype_device
from pathir.frontends.torch.interpreter import FxInterpreter, _get, refuse_params
from pathir.frontends.torch.table import rule_for
from pathir.frontends.torch.transposes import is_transpose, transposed

__all__ = ["FX_FAILED", "lower_exported"]


#: why torch.fx may fail, in a refusal of the torch.export path; the caller puts fx's own error in its place
FX_FAILED = "(a hook on the root module, a write through a view, data-dependent Python)"


def lower_exported(model, shapes, name, clips: dict | None = None, made: list | None = None):
    """Export with example inputs in the model's own dtype and device (batch 2) and interpret;
    constants torch.export lifts to inputs are constants, never tensor inputs. ``clips`` receives the
    clipped ReLUs' threshold sites (frontends/torch/clipped.py)."""
    shapes = [tuple(shapes)] if shapes and not isinstance(shapes[0], (tuple, list)) else list(shapes)
    dtype, device = model_dtype_device(model)
    examples = tuple(torch.zeros((2, *s), dtype=dtype, device=device) for s in shapes)
    program = torch.export.export(model, examples)
    batch_sized = check_eager_writes(model, examples)  # (writes the exported graph hides; its batch-size literals)
    guard = batch_guard(model, examples)  # (a branch on the batch size the eager probes may not reach)
    if made is not None:
        made.append(program)  # (what fails after this is pathir's reading of the graph, not the export)
    lowered = _lowered(model, program, shapes, name, clips)  # (a refusal of an op names more: raised first)
    if batch_sized is not None:
        raise batch_sized
    if guard is not None:
        raise UnsupportedOperation(
            "output", "batch size", f"{type(model).__name__}.forward",
            f"the forward branches on its batch size: torch.export, asked for any batch size, finds that what it "
            f"traced at batch 2 holds only where {guard}, and pathir's graph is per sample (it would compute the "
            "traced branch at every batch size). Take the batch size out of the forward's control flow")
    return lowered


def batch_guard(model, examples: tuple) -> str | None:
    """The guard on the batch size (axis 0 of every input, one size) that torch.export's trace at the examples'
    batch holds under, where it excludes some batch size of 2 or more (a branch on ``x.shape[0] > 6``); None
    where the trace holds at every batch size, or at every one but 1 (``squeeze``: the forward then fails at
    batch 1, which the eager probe leaves alone), where torch made the batch size a constant (``len(x)`` and
    ``int(x.size(0))`` in a reshape do, with no branch: the eager probes at other batch sizes judge those), or
    where a dynamic export fails for another reason."""
    from torch.export import Dim

    for low in (1, 2):
        batch = Dim("batch", min=low)
        try:
            torch.export.export(model, examples, dynamic_shapes=tuple({0: batch} for _ in examples))
            return None
        except Exception as err:  # noqa: BLE001 - only a violated constraint on the batch size is read
            text = str(err)
            if "Constraints violated" not in text or "specialized it to be a constant" in text:
                return None
    lines = [line.strip() for line in text.splitlines()]
    guard = next((line.split("satisfy the generated guard", 1)[1].strip() for line in lines
                  if "satisfy the generated guard" in line), "a condition on the batch size holds")
    return re.sub(r"L\['[^']*'\]\.size\(\)\[0\]", "batch", guard)


def _lowered(model, program, shapes, name, clips):
    """The exported program interpreted, or its functionalized form where the program's in-place ops need it."""
    try:
        return _interpret(model, program, shapes, name, clips)
    except UnsupportedOperation as err:
        # an in-place write through a view, or an in-place op the table has only functionally (a write
        # into a tensor nothing reads again): the functionalized graph, which has eager semantics
        if not isinstance(err, WriteThroughView) and not _in_place(err.op):
            raise
        functional = program.run_decompositions({})
        try:
            return _interpret(model, functional, shapes, name, clips)
        except UnsupportedOperation as again:
            if not isinstance(err, WriteThroughView):
                if again.op.split(".")[0] == err.op.split(".")[0].rstrip("_"):  # the op itself refused: named in its
                    # user's words (the in-place op), for the functional form's reason (the in-place one's is the
                    # table's generic miss: an ATen in-place op the table lowers only functionally)
                    named = UnsupportedOperation(err.node, err.op, err.where, again.why)
                    for note in getattr(again, "__notes__", ()):
                        named.add_note(note)
                    raise named from None
                raise again from None
            raise UnsupportedOperation(err.node, err.op, err.where, f"{err.why}; torch.export's functionalized "
                                       f"graph was refused too: {again}") from again


def _in_place(op: str) -> bool:
    """Whether an ATen op name (``fill_.Tensor``) is an in-place overload."""
    return op.split(".")[0].endswith("_") and not op.startswith("_")


def _interpret(model, program, shapes, name, clips):
    sig = program.graph_signature
    written = [*getattr(sig, "buffers_to_mutate", {}).values(), *getattr(sig, "parameters_to_mutate", {}).values()]
    if written:  # (export runs the forward on fake tensors: the model's own stay as they were, unseen by state_kept)
        refuse_state_writes(model, sorted(set(written)))
    tensors = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False)),
               **dict(program.constants)}
    constants = getattr(sig, "inputs_to_lifted_tensor_constants", {})
    lifted = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **constants}
    interpreter = _ExportInterpreter(model, program.graph_module.graph, name, lifted, tensors, set(constants))
    kinds = [spec.kind for spec in sig.output_specs]
    interpreter.user_outputs = [k for k, kind in enumerate(kinds) if kind is OutputKind.USER_OUTPUT]
    graph = interpreter.run(shapes)
    if clips is not None:
        clips.update(interpreter.low.clips)
    return graph


class _ExportInterpreter(FxInterpreter):
    effect = staticmethod(effect_export)

    def _is_state(self, node) -> bool:
        return node.op == "placeholder" and node.name in self.lifted

    def __init__(self, model, graph, name, lifted, tensors, constants=frozenset()):
        super().__init__(model, graph, name)
        self.lifted, self.tensors, self.constants_lifted = lifted, tensors, constants
        self.user_outputs = None  # positions of the forward's own results among the graph's outputs
        self.constants = 0  # tensor constants made so far (their names: _tensor_constant0, 1, ...)

    def _returned(self, node):
        """The forward's own results: an exported graph returns the tensors it writes in place first (an
        input the forward wrote: its new value), which are not the model's outputs."""
        out = node.args[0]
        if self.user_outputs is not None and isinstance(out, (tuple, list)) and len(self.user_outputs) < len(out):
            picked = tuple(out[k] for k in self.user_outputs)
            return picked[0] if len(picked) == 1 else picked
        return out

    def _eval(self, node, shape):
        if node.op == "placeholder" and node.name in self.lifted:
            fqn, t = self.lifted[node.name], self.tensors[self.lifted[node.name]]
            held = None
            if node.name in self.constants_lifted:  # the tensor the model holds: by name, or in a plain container
                held = _held(self.model, fqn)
                held = held if isinstance(held, torch.Tensor) else _in_containers(self.model, t)
            if isinstance(held, torch.Tensor):  # a plain tensor attribute: fixed, as the fx path reads it, unless
                # autograd traces it back to a parameter (a view attribute `s.Wt = s.W.t()`, a parameter of a module
                # kept in a plain list: it stays a parameter, and a write-back names it). A constant found nowhere
                # stays a parameter too
                self.low.direct_reads.add(fqn)
                learnable = self.low.is_parameter(ParamTensor(fqn, t)) or held.requires_grad
                return ParamTensor(fqn, t, "parameter" if learnable else "buffer")
            return ParamTensor(fqn, t)
        if node.op == "get_attr" and isinstance(node.target, str) and node.target.startswith(("submod_", "true_graph_",
                                                                                              "false_graph_")):
            self.low.unsupported(
                "torch.export wrapped part of the forward in a subgraph of its own (a torch.no_grad() or "
                "torch.autocast block, torch.cond), which pathir does not read: remove the block (grad mode "
                "changes no value), or let torch.fx trace the model", "subgraph")
        return super()._eval(node, shape)

    def _constant(self, value):
        """A float tensor computed from no activation (torch.eye(4) * 0.5, a buffer's view) as fx records it: a
        tensor constant by a name of its own, which a layer may read as its weight; anything else as it is."""
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            self.constants += 1
            return ParamTensor(f"_tensor_constant{self.constants - 1}", value, "buffer")  # fixed: no parameter's
        return value

    def _function(self, fn, args, kwargs):
        if fn is torch.ops.aten._assert_tensor_metadata.default:
            return None  # an export-time check of a tensor's dtype and shape: no value
        if isinstance(fn, torch._ops.OpOverload) and not values_in(args, kwargs):
            params = [a for a in leaves(args, kwargs) if isinstance(a, ParamTensor)]
            if not params:
                # index arithmetic of decomposed ops (arange, clamp, ...), or a tensor made in forward: a constant
                return self._constant(fn(*args, **kwargs))
            if not any(_learnable(p) or p.tensor.is_complex() for p in params):
                # a buffer (indices, a mask, a fixed factor) moved by an op of its own: a constant, no weight, as
                # torch.fx records it (fx folds a buffer's own ops into one tensor constant)
                return self._constant(fn(*torch.utils._pytree.tree_map(_unwrap, args),
                                         **torch.utils._pytree.tree_map(_unwrap, kwargs)))
            if isinstance(args[0], ParamTensor) and is_transpose(fn):  # x @ W.t(): read by the product's rule
                return transposed(self.low, args[0], fn.__name__, *args[1:], **kwargs)
            tensors = [a for a in leaves(args, kwargs) if isinstance(a, (ParamTensor, torch.Tensor))]
            if rule_for(fn) is None or len(tensors) > 1:  # (a parameter times a mask buffer: pruning's weight)
                unreached = _unreached(fn, args, kwargs)
                if unreached is not None:  # no parameter reaches the result (a layer applied to zeros): a constant
                    return self._constant(unreached)
                named = ", ".join(f"'{p.name}'" for p in params if isinstance(p.tensor, torch.nn.Parameter))
                self.low.unsupported(
                    f"computes a tensor from the parameter(s) {named} without any input ({fn.__name__}: a layer "
                    "applied to a constant made in the forward, such as an RNN's zero initial state through a layer "
                    "with a bias (start from the first step instead), a table of weights indexed in the forward, or a "
                    "parametrization: weight_norm, spectral_norm, pruning's weight_orig * weight_mask); a weight "
                    "pathir reads is a tensor a layer holds, and parametrizations "
                    f"are read only on the torch.fx path, which could not trace this model {FX_FAILED}, so it was "
                    "read from torch.export's graph", fn.__name__)
            try:
                return self._call(fn, fn.__name__, args, kwargs)  # a lifted constant's copy, or refused by its rule
            except UnsupportedOperation:
                if any(isinstance(p.tensor, torch.nn.Parameter) for p in params):
                    refuse_params(self.low, fn.__name__, args, kwargs)  # named as the fx path names it (2 * self.w)
                raise
        return super()._function(fn, args, kwargs)


def _unwrap(a):
    return a.read() if isinstance(a, ParamTensor) else a


def _unreached(fn, args, kwargs):
    """``fn``'s value on args that hold parameters, where no parameter reaches it: the same, bit for bit, with
    every parameter moved up, moved down, and replaced by random values (a polynomial in them that is not constant
    differs there with probability 1; a step function of them, on one side at least), as ``linear(zeros, W)``;
    else None."""
    def value(swap):
        def leaf(a):
            if isinstance(a, ParamTensor):  # (copies: an in-place op would write the model's own tensor)
                t = a.read().detach()
                return swap(t) if isinstance(a.tensor, torch.nn.Parameter) else t.clone()
            return a.clone() if isinstance(a, torch.Tensor) else a
        return fn(*torch.utils._pytree.tree_map(leaf, args), **torch.utils._pytree.tree_map(leaf, kwargs))

    def moved(t, sign):  # every entry moved one way by 1024 (1 + |its value|) or more: never by 0, nor lost to
        # rounding, and past any threshold within a thousand times the weights' own scale
        step = 1024 * (1 + t.abs().double()) * (1 + torch.rand(t.shape, generator=gen, dtype=torch.float64))
        return t + (sign * step).to(t.dtype)

    gen = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            here = value(lambda t: t.clone())
            # up, down (a threshold every entry lies on one side of), and random values (a polynomial); random values
            # alone could be the parameter's own (a model initialised from the same seed, as tests do)
            theres = [value(lambda t: moved(t, 1.0)), value(lambda t: moved(t, -1.0)),
                      value(lambda t: torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype))]
    except Exception:  # noqa: BLE001 - whatever the op raises on such arguments: not a constant we can read
        return None
    same = isinstance(here, torch.Tensor) and all(isinstance(x, torch.Tensor) and torch.equal(here, x) for x in theres)
    return here if same else None


def _held(model, fqn: str):
    """The object ``model`` holds at the dotted name ``fqn`` (``interpreter._get``), or None where it holds none."""
    try:
        return _get(model, fqn)
    except AttributeError:
        return None


def _learnable(p: ParamTensor) -> bool:
    """Whether ``p`` is a learnable tensor: a parameter, or a plain attribute read as one (it requires grad)."""
    return isinstance(p.tensor, torch.nn.Parameter) or (p.kind == "parameter" and p.tensor.requires_grad)


_REGISTERED = frozenset({"_parameters", "_buffers", "_modules"})


def _in_containers(model, t: torch.Tensor):
    """The tensor over ``t``'s memory (same shape and strides) that a module of ``model`` holds in a plain list, tuple
    or dict attribute (directly, or as a parameter or buffer of a module held there), or None."""
    def same(x):
        return (isinstance(x, torch.Tensor) and x.data_ptr() == t.data_ptr() and x.shape == t.shape
                and x.stride() == t.stride())

    for module in model.modules():
        for key, value in vars(module).items():
            if key in _REGISTERED:  # (registered tensors are lifted as parameters and buffers, by name)
                continue
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
            for item in items:
                tensors = [*item.parameters(), *item.buffers()] if isinstance(item, torch.nn.Module) else [item]
                found = next((x for x in tensors if same(x)), None)
                if found is not None:
                    return found
    return None
