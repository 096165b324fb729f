"""Committing a rescaling z to a source model, all or nothing.

A rescaling θ ← θ ⊙ exp(-Bz/2) (docs/math.md §5) reaches the user's model through
the frontend writer as per-channel log-scales (:func:`pathir.rescaling.apply.log_scales`);
``Compiled.commit_rescaling`` then makes the rescaled graph current, so that every
later computation (``cm.diag_g()``, ``cm.path_norm()``, ...) sees the new model.

Guarantees, on top of the writer's own (all tensors computed before any is
assigned, in float64, cast back to each tensor's dtype and device):

- refused before anything is written: a torch model in train mode whose
  rescaling would have to move the running statistics of a batch-norm that
  could not be folded into a preceding layer (exact in eval mode only);
- refused before anything is written: a rescaled graph param that leaves the
  float64 range (a finite entry becomes inf, a nonzero one 0);
- where a write reaches a buffer or replaces a module, the torch writer runs the model on a
  seeded probe before and after it and fails if the function moved
  (``pathir.frontends.torch.function_kept``);
- a torch model is snapshotted before the write and restored if the writer
  fails, or if a written tensor lost an entry to its dtype's range (float16
  or bfloat16 overflow or underflow), so on any error the model is untouched
  (its tensors, and its submodules: a clipped ReLU module the writer replaced
  by a ``pathir.nn.ClippedReLU`` is put back).
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

from pathir.errors import PathirError, StaleReference
from pathir.ir import Graph, Role
from pathir.rescaling.apply import check_rescaling, log_scales, rescale_graph
from pathir.rescaling.bounds import float64_safe
from pathir.rescaling.optimizer_state import check_private, check_transportable, plan_grads, plan_transport
from pathir.rescaling.shared_sources import check_batch_norm_uses
from pathir.support.threads import one_torch_thread

__all__ = ["commit_rescaling", "rescaled_graph", "with_bias_shifts", "check_writable", "check_optimizer", "pruned_attributes"]


def rescaled_graph(graph: Graph, units, z, kept=None) -> Graph:
    """``graph`` rescaled by z (no model touched; overflow is checked by :func:`commit_rescaling`,
    through ``kept``: see :func:`pathir.rescaling.apply.rescale_graph`)."""
    with np.errstate(over="ignore", under="ignore"):
        return rescale_graph(graph, units, z, kept)


def check_writable(graph: Graph, writer) -> None:
    """Refuse early (before a solver runs) a write-back the writer would refuse anyway:
    train-mode-only modules, spectral-normalized or otherwise parametrized weights."""
    if writer is not None:
        check_batch_norm_uses(graph)
    check = getattr(writer, "check_rescalable", None)
    if check is not None:
        check(graph)


def commit_rescaling(graph: Graph, units, z, model=None, writer=None, optimizer=None, bias_shifts=None,
                     rescaled: bool = True) -> Graph | None:
    """Write the rescaling z of ``graph`` into ``model`` through ``writer``, all or nothing,
    and return the rescaled graph (the caller makes it current); ``rescaled=False`` (a writer is
    needed): the same checks and write, and None (the caller re-reads the model as written).

    ``bias_shifts`` ({bias param name: array added to it after the rescaling}, bias absorption):
    written in the same transaction by ``writer.shift_biases``; a writer without it is refused first.

    With no writer (a graph compiled from a bare Graph) only the graph is rescaled.
    With ``optimizer`` (a torch model's), its per-parameter state moves with the rescaling
    (``pathir.rescaling.optimizer_state``): planned before the model is written, written
    after it, and on any failure model and optimizer are both restored.
    """
    if optimizer is not None:
        check_optimizer(writer, optimizer)
    if bias_shifts and writer is not None and not hasattr(writer, "shift_biases"):
        raise PathirError(f"bias absorption writes new biases, which {type(writer).__name__} cannot write; "
                          "nothing was changed")
    if rescaled or writer is None:  # each block range-checked while in cache
        new_graph = rescaled_graph(graph, units, z, _kept_in_range)
    else:  # the same products and check, a block at a time into one buffer: no graph kept
        new_graph = None
        if not float64_safe(graph, z):  # (else the graph's magnitude range, read for the bound, settles it)
            with np.errstate(over="ignore", under="ignore"):
                check_rescaling(graph, units, z, _kept_in_range)
    if writer is not None:
        scales = log_scales(graph, units, z)
        _refuse_train_mode_statistics(model, graph, scales)
        grads = hasattr(model, "parameters") and any(p.grad is not None for p in model.parameters())
        factors = writer.param_factors(graph, scales) if (optimizer is not None or grads) and hasattr(
            writer, "param_factors") else None
        names = {id(p): n for n, p in model.named_parameters()} if factors is not None else None
        transport = None if optimizer is None else plan_transport(optimizer, factors, names)
        if grads and factors is not None:
            transport = plan_grads(factors, transport, names)  # the .grad of the last backward moves too
        if transport is not None:
            check_private(transport, optimizer, model)
        state = writer.snapshot() if hasattr(writer, "snapshot") else None  # a writer that swaps whole models
        try:
            try:
                _write(model, writer, graph, scales, z, bias_shifts, transport)
            except StaleReference:  # its function check read a recorded forward: put back, written again, checked afresh
                if state is not None:
                    writer.restore(state)
                _write(model, writer, graph, scales, z, bias_shifts, transport)
        except BaseException:
            if state is not None:
                writer.restore(state)
            raise
    return None if new_graph is None else with_bias_shifts(new_graph, bias_shifts)


def _write(model, writer, graph, scales, z, bias_shifts, transport) -> None:
    """One transaction: the rescaling, its checks, the bias shifts and the optimizer's state; on any error
    the model (and the optimizer's state) as before."""
    try:
        with _transaction(model, float(np.max(np.abs(z), initial=0.0)), written_after_check=bool(bias_shifts)) \
                as check_values:
            writer.rescale(graph, scales)
            check_values()  # the dtype's range first: its refusal names the tensor and the bound
            check_written = getattr(writer, "check_written", None)
            if check_written is not None:  # then the function, before a bias absorption changes it on purpose
                check_written()
            if bias_shifts:
                writer.shift_biases(graph, bias_shifts)  # (names and sources: the same in both)
            if transport is not None:
                transport.write()
    except BaseException:
        if transport is not None:
            transport.undo()
        raise


def with_bias_shifts(graph: Graph, bias_shifts) -> Graph:
    """``graph`` with ``bias_shifts[name]`` added to each bias param so named (None: ``graph`` itself)."""
    if not bias_shifts:
        return graph
    return graph.map_params(lambda p: p.with_value(p.value + bias_shifts[p.name]) if p.name in bias_shifts else p)


def _kept_in_range(old: np.ndarray, new: np.ndarray, chunk: int = 1 << 18) -> bool:
    """Every entry of ``new`` finite and as many nonzero as in ``old`` (no entry over- or underflowed),
    a cache-sized chunk at a time (no temporary of the param's size)."""
    old, new = old.reshape(-1), new.reshape(-1)
    for i in range(0, new.size, chunk):
        part = new[i:i + chunk]
        if not np.isfinite(part).all() or np.count_nonzero(part) != np.count_nonzero(old[i:i + chunk]):
            return False
    return True


def check_optimizer(writer, optimizer) -> None:
    """Refuse early an ``optimizer=`` whose state cannot move with a rescaling of this model."""
    if not hasattr(writer, "param_factors"):
        what = "a bare Graph" if writer is None else f"a model written by {type(writer).__name__}"
        raise PathirError(f"optimizer= needs a torch model; this Compiled holds {what}. Nothing was changed")
    check_transportable(optimizer)
    model = getattr(writer, "model", None)
    if model is not None and hasattr(model, "parameters"):
        own = {id(p) for p in model.parameters() if p.requires_grad}  # (a frozen model: no optimizer steps it)
        held = [p for group in getattr(optimizer, "param_groups", ()) for p in group.get("params", ())]
        if own and held and not any(id(p) in own for p in held):
            raise PathirError(f"optimizer= is a {type(optimizer).__name__} that holds none of this model's parameters "
                              "(an optimizer of another model, or of a copy of it): its state cannot move with this "
                              "model's rescaling, and the optimizer stepping this model would keep its state in the "
                              "old coordinates. Pass the optimizer that steps this model; nothing was changed")


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
def _transaction(model, max_abs_z: float, written_after_check: bool = True):
    """Snapshot a torch model's tensors; restore them if the block fails or broke a value. Yields the
    range check, for the block to run early; it runs again at the end unless the block ran it and
    ``written_after_check`` is False (nothing wrote the model after it)."""
    if not hasattr(model, "named_modules"):
        yield lambda: None
        return
    import torch

    saved = []  # (module, kind, name, full name, tensor, its copy) or the pruned attribute object
    children = [(module, dict(module._modules)) for module in model.modules()]  # submodules a writer may replace
    for prefix, module in model.named_modules():
        for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
            for name, t in table.items():
                if t is not None:
                    saved.append((module, kind, name, f"{prefix}.{name}".lstrip("."), t, t.detach().clone()))
        for name in pruned_attributes(module):
            saved.append((module, "attr", name, f"{prefix}.{name}".lstrip("."), getattr(module, name), None))
    checked = []

    def check():
        _check_values(saved, max_abs_z)
        checked.append(True)

    try:
        yield check
        if written_after_check or not checked:
            _check_values(saved, max_abs_z)
    except BaseException:
        for module, kids in children:
            for name, child in kids.items():
                if module._modules.get(name) is not child:
                    setattr(module, name, child)
        with torch.no_grad():
            for module, kind, name, _, t, copy in saved:
                if kind == "attr":
                    setattr(module, name, t)
                elif not any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):  # (an expanded tensor:
                    t.copy_(copy)  # one memory location per many entries, which no writer writes, refused)
        raise


def pruned_attributes(module) -> list[str]:
    """The attributes of ``module`` that torch.nn.utils.prune reparametrized (one pruning hook each, a
    PruningContainer included: the tensor then lives in ``<attr>_orig``)."""
    from torch.nn.utils.prune import BasePruningMethod

    return [h._tensor_name for h in module._forward_pre_hooks.values() if isinstance(h, BasePruningMethod)]


def _check_values(saved, max_abs_z: float) -> None:
    """A written tensor must keep every finite entry finite, every nonzero entry nonzero and every
    normal entry normal (not subnormal).

    Checked: float16, bfloat16 and float32 tensors, however small the rescaling (a float32 weight of 1e-44, a
    subnormal, underflows at e^-13); float64 values are the computation's own."""
    import torch

    for _, _, _, full, t, old in saved:
        if old is None or not t.is_floating_point() or t.dtype == torch.float64:
            continue
        new, tiny = t.detach(), torch.finfo(t.dtype).tiny
        # a large tensor block by block, each in cache: only a block that holds a zero, a subnormal or a non-finite
        # entry is read again entry by entry (vgg11_bn's first fc weight, 12 exact zeros in 10^8: 3.1 s -> under 0.1)
        if new.numel() > _CHECK_BLOCK and new.is_contiguous() and old.is_contiguous():
            with one_torch_thread():
                broke = sum(_broken(a, b, tiny)
                            for a, b in zip(new.view(-1).split(_CHECK_BLOCK), old.view(-1).split(_CHECK_BLOCK)))
        else:
            broke = _broken(new, old, tiny)
        if broke:
            raise PathirError(
                f"the rescaled tensor '{full}' does not fit {t.dtype}: {broke} entries would overflow, "
                f"or fall below its smallest normal number, under a rescaling with max |z| = {max_abs_z:.4g} "
                f"(entries move by up to e^{max_abs_z:.3g}). Bound the rescaling with a smaller max_log_scale= "
                "(cm.pathcond, enorm, equalize). The default, None, is the largest bound this dtype holds for the "
                "graph's own parameters (pathir.rescaling.bounds.default_max_log_scale); a tensor the graph reads "
                "only through a fold (a weight under a batch-norm's γ/σ) can sit closer to the dtype's limits and "
                "need a smaller one; the model is unchanged"
            )


#: entries per block of :func:`_check_values` (a few MB: the block's temporaries stay in cache)
_CHECK_BLOCK = 1 << 18
#: tensors up to this size are checked in numpy (a batch-norm's 24 channels: a torch op's dispatch costs more than
#: its work), where numpy holds the dtype
_SMALL = 1 << 12


def _broken(new, old, tiny: float) -> int:
    """How many entries of ``new`` broke against ``old`` (same shape): finite become non-finite, normal become
    subnormal or zero, nonzero become zero. A block whose every entry is normal and finite (NaN fails both)
    is decided by one min/max."""
    if not new.numel():
        return 0
    import torch

    if (new.numel() <= _SMALL and new.device.type == "cpu" and new.dtype in (torch.float32, torch.float16)
            and not new.is_neg() and not old.is_neg()):  # a small tensor in numpy: per-op dispatch costs more than the work
        a, b = np.abs(new.numpy()), np.abs(old.numpy())
        if a.min() >= tiny and a.max() < math.inf:
            return 0
        return int(np.count_nonzero((~np.isfinite(a) & np.isfinite(b)) | ((a < tiny) & (b >= tiny)) | ((a == 0) & (b != 0))))
    low, high = new.abs().aminmax()
    if bool(low >= tiny) and bool(high < math.inf):
        return 0
    broke = (~new.isfinite() & old.isfinite()) | ((new.abs() < tiny) & (old.abs() >= tiny)) | ((new == 0) & (old != 0))
    return int(broke.sum())
