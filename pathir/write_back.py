"""Committing a rescaling z to a Compiled's model and graph, all or nothing.

A rescaling θ ← θ ⊙ exp(-Bz/2) (MATH.md §5) reaches the user's model through
the frontend writer as per-channel log-scales (:func:`pathir.rescale.log_scales`);
then ``cm.graph`` becomes the rescaled graph, so that every later computation
(``cm.diag_g()``, ``cm.path_norm()``, ...) sees the new model.

Guarantees, on top of the writer's own (all tensors computed before any is
assigned, in float64, cast back to each tensor's dtype and device):

- refused before anything is written: a torch model in train mode whose
  rescaling would have to move the running statistics of a batch-norm that
  could not be folded into a preceding layer (exact in eval mode only);
- a torch model is snapshotted before the write and restored if the writer
  fails, or if a written tensor lost an entry to the dtype's range (a finite
  entry became inf/nan, or a nonzero one became 0: float16 overflow or
  underflow), so on any error the model is untouched.
"""

from __future__ import annotations

import contextlib

import numpy as np

from .errors import PathirError
from .ir import Role
from .rescale import log_scales, rescale_graph

__all__ = ["commit_rescaling", "rescaled_graph"]


def rescaled_graph(cm, z):
    """``cm.graph`` rescaled by z, with the cached B (no model touched)."""
    return rescale_graph(cm.graph, cm.units, z, incidence=cm.incidence())


def commit_rescaling(cm, z) -> None:
    """Rescale ``cm``'s model (through ``cm.frontend``) and graph by z, all or nothing.

    A Compiled made from a bare Graph has only its graph rescaled.
    """
    graph = cm.graph
    new_graph = rescaled_graph(cm, z)
    if cm.frontend is not None:
        scales = log_scales(graph, cm.units, z)
        _refuse_train_mode_statistics(cm.model, graph, scales)
        with _transaction(cm.model):
            cm.frontend.rescale(graph, scales)
    cm._adopt_rescaled(new_graph)


# ------------------------------------------------------------------ train mode


def _moved_statistics(graph, scales) -> list[str]:
    """Running-statistics tensors (IN_STATS) whose batch-norm input the rescaling scales."""
    out = []
    for v in graph.nodes:
        for e in v.edges:
            p = e.map.weight
            if p is None or not np.any(np.abs(scales[e.source]) > 0):
                continue
            out += [r.name for r in p.sources if r.role is Role.IN_STATS]
    return out


def _refuse_train_mode_statistics(model, graph, scales) -> None:
    if not hasattr(model, "get_submodule"):
        return
    for name in _moved_statistics(graph, scales):
        module = model.get_submodule(name.rpartition(".")[0])
        if module.training:
            raise PathirError(
                f"the model is in train mode and the rescaling scales the input of the batch-norm "
                f"'{name.rpartition('.')[0]}', which is not folded into a preceding layer: its batch "
                "statistics would not follow exactly (eps does not scale). Call model.eval() first"
            )


# ------------------------------------------------------------------ the torch transaction


@contextlib.contextmanager
def _transaction(model):
    """Snapshot a torch model's tensors; restore them if the block fails or broke a value."""
    if not hasattr(model, "named_modules"):
        yield
        return
    import torch

    saved = []  # (module, kind, name, full name, tensor, its copy) or the pruned attribute object
    for prefix, module in model.named_modules():
        for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
            for name, t in table.items():
                if t is not None:
                    saved.append((module, kind, name, f"{prefix}.{name}".lstrip("."), t, t.detach().clone()))
        for name in _pruned_attributes(module):
            saved.append((module, "attr", name, f"{prefix}.{name}".lstrip("."), getattr(module, name), None))
    try:
        yield
        _check_values(saved)
    except BaseException:
        with torch.no_grad():
            for module, kind, name, _, t, copy in saved:
                if kind == "attr":
                    setattr(module, name, t)
                else:
                    t.copy_(copy)
        raise


def _pruned_attributes(module) -> list[str]:
    from torch.nn.utils.prune import BasePruningMethod

    return [h._tensor_name for h in module._forward_pre_hooks.values() if isinstance(h, BasePruningMethod)]


def _check_values(saved) -> None:
    """A written tensor must keep every finite entry finite and every nonzero entry nonzero."""
    for _, _, _, full, t, old in saved:
        if old is None or not t.is_floating_point():
            continue
        new = t.detach()
        broke = (~new.isfinite() & old.isfinite()) | ((new == 0) & (old != 0))
        if bool(broke.any()):
            raise PathirError(
                f"the rescaled tensor '{full}' does not fit {t.dtype}: "
                f"{int(broke.sum())} entries overflow or underflow (convert the model with .float() "
                "first); the model is unchanged"
            )
