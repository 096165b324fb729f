"""Branches that run only in train mode (aux classifiers): found, then lowered as extra outputs or
refused at write-back.

pathir analyses the eval-mode function. A module whose parameters the eval graph
never reads but which the *train-mode* forward calls (torchvision googlenet /
inception_v3 with ``aux_logits=True``) reads hidden channels that a rescaling
changes; its own weights are not rescaled, so its train-mode output would change.
:func:`train_only_modules` finds such modules: those whose output the train-mode
forward uses and the eval-mode forward does not (two extra fx traces, run only when
some parameterized module is unreached by the eval graph; torch.export's functionalized
graphs where fx cannot trace; if neither can, every unreached module counts). A module called for nothing in either mode,
or used in eval mode at no channel the graph keeps, is not one of them. The torch writer refuses a
rescaling naming them; masks (pruning) are not refused: pruning changes the
function anyway.

A model compiled in train mode is lowered instead in its *heads* forward
(:func:`head_modes`): every module in eval mode (batch-norms on running statistics,
dropout the identity) except the ancestors of the train-only modules, which keep
``training = True`` so that their forward calls the heads and returns them: every
head is an output of the graph, and a rescaling keeps each one.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from pathir.frontends.torch.capture_checks import trace
from pathir.frontends.torch.inputs import model_dtype_device
from pathir.ir import Graph

__all__ = ["runs_heads", "train_only_modules", "head_modes"]


def _reached_paths(graph: Graph) -> set[str]:
    return {ref.name.rpartition(".")[0] for p in graph.params() for ref in p.sources}


def _param_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Modules holding parameters themselves (a parametrization's tensors count for its module)."""
    out = {}
    for path, m in model.named_modules():
        if path.split(".")[-1] in ("parametrizations",) or ".parametrizations." in f".{path}.":
            continue
        if any(True for _ in m.parameters(recurse=False)) or hasattr(m, "parametrizations"):
            out[path] = m
    return out


def _collapse(paths: list[str], unreached: set[str], holders: set[str]) -> list[str]:
    """Each path replaced by its highest ancestor all of whose parameter holders are unreached."""
    out = set()
    for path in paths:
        parts = path.split(".")
        best = path
        for i in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:i])
            under = [h for h in holders if h == prefix or h.startswith(prefix + ".")]
            if under and all(h in unreached for h in under):
                best = prefix
            else:
                break
        out.add(best)
    return sorted(out)


def train_only_modules(model: nn.Module, graph: Graph, shapes=None) -> list[str]:
    """Paths of the modules (collapsed to their highest such ancestor) whose output the train-mode
    forward uses but the eval graph does not read (a module whose output no mode uses is dead code).
    ``shapes``: the input shapes, for torch.export where torch.fx cannot trace the forward."""
    holders = _param_modules(model)
    reached = _reached_paths(graph)
    unreached = {p for p in holders if p not in reached}
    if not unreached:
        return []
    called = _called_in_train_mode(model, unreached, shapes)
    return _collapse(sorted(called), unreached, set(holders))


def head_modes(train_only: list[str]) -> list[str]:
    """The module paths kept in train mode in the heads forward: every strict ancestor of a
    train-only module ("" the model itself), the modules whose forward decides to call it."""
    out = {""}
    for path in train_only:
        parts = path.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return sorted(out)


def _live(graph, roots=None) -> set:
    """The nodes of an fx graph whose values reach its output, or ``roots`` (a module called for nothing,
    dead code in either mode, reads nothing a rescaling could change the meaning of)."""
    live, stack = set(), [n for n in graph.nodes if n.op == "output"] if roots is None else list(roots)
    while stack:
        node = stack.pop()
        if node not in live:
            live.add(node)
            stack.extend(node.all_input_nodes)
    return live


def _called_in_train_mode(model: nn.Module, unreached: set[str], shapes=None) -> set[str]:
    """The unreached modules whose output the train-mode forward uses and the eval-mode forward does not
    (a module the eval forward uses too is one the eval graph reads, or reads no channel of)."""
    live = {mode: _live_modules(model, mode, shapes) for mode in (True, False)}
    if live[True] is None:
        return unreached  # cannot tell: every unreached module may run in train mode
    train_only = live[True] - (live[False] or set())
    return {p for p in unreached if p in train_only or any(t.startswith(p + ".") for t in train_only)
            or any(p.startswith(t + ".") for t in train_only)}


def runs_heads(model: nn.Module, train_only: list[str], shapes=None) -> bool | None:
    """Whether the forward as the model's flags stand (each module's own, mixed or not) uses any of the
    ``train_only`` modules' outputs; None where no trace can tell."""
    live = _live_modules(model, None, shapes)
    if live is None:
        return None
    return any(p in live or any(t.startswith(p + ".") for t in live) for p in train_only)


def _live_modules(model: nn.Module, training: bool | None, shapes=None) -> set[str] | None:
    """The module paths whose output the forward in that mode uses (None: every module's flag as it is): by an
    fx trace, or where fx cannot trace it (a write through a view, ``c[:, 1] = 0``) and ``shapes`` is given, by
    torch.export's functionalized graph; None if neither can."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        if training is not None:
            model.train(training)
        try:  # (the forward's arguments after its inputs traced as their defaults, as the model runs)
            graph = trace(model, None if shapes is None else _n_inputs(shapes))
        except Exception:
            return None if shapes is None else _live_exported(model, shapes)
        return {str(n.target) for n in _live(graph) if n.op in ("call_module", "get_attr")}
    except Exception:
        return None
    finally:
        for m, flag in flags:
            m.training = flag


def _n_inputs(shapes) -> int:
    """How many inputs ``shapes`` gives (one shape, or a list of them)."""
    return 1 if shapes and not isinstance(shapes[0], (tuple, list)) else len(shapes)


def _live_exported(model: nn.Module, shapes) -> set[str]:
    """The module paths (every one on a node's module stack) of the nodes of torch.export's functionalized
    graph whose values reach a user output (buffer updates of a train-mode batch-norm are not uses)."""
    dtype, device = model_dtype_device(model)
    examples = tuple(torch.zeros((2, *s), dtype=dtype, device=device) for s in shapes)
    program = torch.export.export(model, examples).run_decompositions({})
    users = set(program.graph_signature.user_outputs)
    (out,) = [n for n in program.graph.nodes if n.op == "output"]
    live = _live(program.graph, [n for n in out.all_input_nodes if n.name in users])
    return {path for n in live for path, _ in (n.meta.get("nn_module_stack") or {}).values() if path}
