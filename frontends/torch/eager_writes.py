"""What torch.export does not show of a forward's writes, seen by running it once, eagerly.

torch.export runs the forward on fake tensors and hands back a functional graph. Two kinds of write
leave no trace there:

- a submodule that replaces its own buffer (``self.calls = self.calls + 1``): the export drops the
  new value (an op nobody reads) and puts the module back as it was;
- an in-place op whose other operand is another view of the memory it writes, overlapping it
  (``h[:, :-1] += h[:, 1:]``, ``h[:, 1:] = h[:, :-1]``): the functional graph reads the old
  values, eager PyTorch reads whatever its copy order has written by then (and refuses it outright
  at some shapes).

:func:`check_eager_writes` runs the model once on a small random batch under :func:`state_kept`
(which refuses the first and puts buffers back) and a dispatch mode that refuses the second,
naming the ATen op and the module it ran in, as the fx path names them.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pathir.errors import PathirError, UnsupportedOperation
from pathir.frontends.torch.capture_checks import ReadsWhatItWrites, state_kept
from pathir.frontends.torch.inputs import TOLERANCE

__all__ = ["check_eager_writes", "overlaps_elsewhere"]


def _offsets(t: torch.Tensor) -> np.ndarray:
    """The storage offsets (in elements) of every element of ``t``, in no particular order."""
    out = np.full(1, t.storage_offset(), dtype=np.int64)
    for size, stride in zip(t.shape, t.stride()):
        out = (out[:, None] + np.arange(size, dtype=np.int64) * stride).ravel()
    return out


def overlaps_elsewhere(written: torch.Tensor, read: torch.Tensor) -> bool:
    """Whether ``read`` shares memory with ``written`` other than as the very same view (same offset, shape
    and strides: ``h.add_(h)`` reads each element where it writes it)."""
    if written.device != read.device or written.numel() == 0 or read.numel() == 0:
        return False
    if written.untyped_storage().data_ptr() != read.untyped_storage().data_ptr():
        return False
    if (written.storage_offset(), written.shape, written.stride(), written.dtype) == \
            (read.storage_offset(), read.shape, read.stride(), read.dtype):
        return False
    if written.element_size() != read.element_size():
        return True  # a view as another dtype: counted as overlapping
    return bool(np.intersect1d(_offsets(written), _offsets(read)).size)


class _WritesFromOverlap(TorchDispatchMode):
    """Refuses an ATen op that writes a tensor (its schema's mutable arguments) while reading another view
    overlapping it; ``where()`` names the module running."""

    def __init__(self, where):
        super().__init__()
        self.where = where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = getattr(func, "_schema", None)
        if schema is None:  # (a higher-order op: its body's ops come through one by one)
            return func(*args, **kwargs)
        written, read = [], []
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            tensors = [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.Tensor)]
            (written if arg.alias_info is not None and arg.alias_info.is_write else read).extend(tensors)
        for w in written:
            for r in read:
                if overlaps_elsewhere(w, r):
                    name = str(func).replace("aten::", "")
                    raise ReadsWhatItWrites(
                        name, name, self.where(),
                        "it reads a view of the memory it writes, at other positions (h[:, :-1] += h[:, 1:], "
                        "h[:, 1:] = h[:, :-1]): eager PyTorch's result then depends on the order its copy runs in, "
                        "and torch refuses it at some shapes (write from a copy: .clone() the value)")
        return func(*args, **kwargs)


@contextlib.contextmanager
def _module_stack(model: torch.nn.Module):
    """A list holding the path of the module whose forward runs (its innermost), kept by global hooks
    removed on exit."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
    stack: list[str] = []

    def enter(module, args):
        stack.append(paths.get(id(module), ""))

    def leave(module, args, out):
        if stack:
            stack.pop()

    handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


def check_eager_writes(model: torch.nn.Module, examples: tuple) -> UnsupportedOperation | None:
    """Run ``model(*examples)`` once (no grad) and refuse what torch.export's graph would hide: a parameter or
    buffer the forward writes or replaces (:func:`state_kept`, buffers put back), an in-place op reading an
    overlapping view of what it writes (:class:`ReadsWhatItWrites`). Any other failure of the run is left
    to the self-check, which runs the forward too and explains it. Returns the refusal of a forward whose
    output depends on its batch size (:func:`_per_sample`), for the caller to raise once the graph's own ops
    are lowered (a refusal of an op names more), or None."""
    inputs = tuple(torch.randn(e.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
                   .to(dtype=e.dtype, device=e.device) for e in examples)
    pristine = tuple(t.clone() for t in inputs)  # (a forward may scale its input in place: x /= 255)
    with state_kept(model), _module_stack(model) as stack, torch.no_grad():
        try:
            with _WritesFromOverlap(lambda: next((p for p in reversed(stack) if p), "")):
                outputs = model(*inputs)
        except PathirError:
            raise
        except Exception:  # noqa: BLE001 - the self-check runs the forward and names what fails
            return None
        return _per_sample(model, pristine, outputs)


#: the batch sizes the eager run is compared at, beside the export's (2): a forward that computes with its batch size
#: mostly differs at one of them (1 + n // 4, n > 3, 1 / n)
PROBE_BATCHES = (1, 5)


def _per_sample(model, inputs: tuple, outputs) -> UnsupportedOperation | None:
    """The refusal of a forward whose first sample's outputs at batch 1 or 5 are not those at the batch the export
    traced (beyond the dtype's rounding): it computes with its batch size (``h / len(x)``,
    ``torch.ones(n, 4).sum()``), which torch.export fixes to a literal in its graph. A forward that fails at a batch
    size is not compared there (the graph is the function it computes on the batches it runs on), as the
    self-check leaves it. None where none."""
    gen = torch.Generator().manual_seed(1)
    traced = inputs[0].shape[0]
    for n in PROBE_BATCHES:
        more = tuple(torch.cat([t, torch.randn((max(n - traced, 0), *t.shape[1:]), generator=gen, dtype=torch.float64)
                                .to(dtype=t.dtype, device=t.device)])[:n] for t in inputs)
        try:
            other = model(*more)
        except Exception:  # noqa: BLE001 - (torch.squeeze(h) then flatten(1): no batch of one)
            continue
        found = _first_sample_deviation(outputs, other, traced, n)
        if found is not None:
            k, deviation = found
            return UnsupportedOperation(
                f"output {k}", "batch size", f"{type(model).__name__}.forward",
                f"the model's output for one sample depends on the batch size: at batch {n}, the first sample's "
                f"output differs from the one at batch {traced} by {deviation:.3g} of max|output|. The forward "
                "computes with its batch size (h / len(x), h / x.size(0), torch.ones(x.shape[0], 4).sum()) or mixes "
                "samples, and torch.export fixes that number in its graph; pathir's graph is per sample. Use the "
                "batch size only as a shape's batch axis (x.view(x.size(0), -1)), or take it out of the forward")
    return None


def _first_sample_deviation(outputs, other, traced: int, n: int):
    """(output index, deviation relative to max|output|) of the first output whose first sample differs between
    ``outputs`` (at batch ``traced``) and ``other`` (at batch ``n``) beyond its dtype's rounding, or None."""
    batched, single = torch.utils._pytree.tree_leaves(outputs), torch.utils._pytree.tree_leaves(other)
    if len(batched) != len(single):
        return None
    for k, (b, a) in enumerate(zip(batched, single)):
        if not (isinstance(b, torch.Tensor) and isinstance(a, torch.Tensor) and b.is_floating_point()
                and a.is_floating_point() and b.dim() and b.shape[0] == traced):
            continue
        ref = b[:1].double().reshape(-1)
        got = (a[:1] if a.dim() and a.shape[0] == n and n > 1 else a).double().reshape(-1)  # (a squeezed batch of 1)
        if got.numel() != ref.numel() or not ref.numel():
            continue
        if not (torch.isfinite(ref).all() and torch.isfinite(got).all()):
            continue
        deviation = float((got - ref).abs().max()) / max(float(ref.abs().max()), 1e-30)
        if deviation > TOLERANCE.get(str(b.dtype).removeprefix("torch."), 1e-4):
            return k, deviation
    return None
