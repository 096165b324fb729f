"""After a rescaling is written into a torch model: the model computes what it computed before,
checked on one seeded probe batch.

The write rules keep the function for every read of a tensor the IR knows of. A read it does not
know of would change it silently: a kept batch-norm's running variance also used as a constant
factor, a clip threshold buffer also multiplied in, running statistics shared by a folded and a kept
batch-norm. Two forwards of the model on the same probe, before the write and after it, find any
such change the probe reaches; the write is then refused (``commit_rescaling``'s transaction puts
the model back).

The "before" forward is often one the model has already run: compile's self-check, or the "after"
of the last write. Such outputs are kept as a :class:`Reference` with the model's `model_stamp`;
a write whose model still has that stamp reads them instead of running the model again. A stamp
cannot see every change (an edit through ``.data``, a Python attribute), so a check that fails
against a reference raises :class:`StaleReference`, and ``commit_rescaling`` writes again against a
fresh forward: a reference can save a forward, never decide a refusal.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pathir.errors import PathirError, StaleReference
from pathir.frontends.torch.inputs import eval_forward, model_dtype_device, output_tensors
from pathir.frontends.torch.live import tensor_versions

__all__ = ["Probe", "Reference", "model_stamp"]

#: the largest output change a write may make, relative to max |output|: ten times the compile
#: self-check's tolerance per dtype (the rescaled model rounds its products differently)
KEPT = {torch.float64: 1e-8, torch.float32: 1e-3, torch.float16: 1e-1, torch.bfloat16: 3e-1}
BATCH = 1


def model_stamp(model, train_paths=()) -> tuple:
    """What a forward of ``model`` depends on that is cheap to read: every module's identity and mode, and
    every parameter's and buffer's ``live.tensor_versions`` (an edit through ``.data`` bumps no version:
    module docstring)."""
    return tensor_versions(model), tuple((id(m), m.training) for m in model.modules()), tuple(train_paths)


@dataclass(frozen=True)
class Reference:
    """The model's outputs (float64 arrays) on ``inputs`` (model-dtype tensors, ``BATCH`` samples), read
    when the model had ``stamp``."""

    stamp: tuple
    inputs: tuple
    outputs: tuple

    @classmethod
    def of_batch(cls, model, train_paths, inputs, outputs) -> "Reference | None":
        """The first ``BATCH`` samples of a forward already run (compile's self-check), or None where an
        input or output has no such batch axis."""
        if not all(t.dim() and t.shape[0] > BATCH for t in inputs) or not all(
                a.ndim and a.shape[0] == inputs[0].shape[0] for a in outputs):
            return None
        return cls(model_stamp(model, train_paths), tuple(t[:BATCH] for t in inputs),
                   tuple(np.ascontiguousarray(a[:BATCH]) for a in outputs))


class Probe:
    """The model's outputs on a seeded random batch (``BATCH`` samples per graph input), taken at
    construction, or read from ``reference`` where the model still has its stamp: :meth:`check` runs the
    model again and refuses a changed function."""

    def __init__(self, model, graph, train_paths=(), reference: Reference | None = None):
        self.model, self.train_paths = model, tuple(train_paths)
        dtype, device = model_dtype_device(model)
        self.dtype, self.tolerance = dtype, KEPT.get(dtype, 1e-3)
        self.recorded = reference is not None and reference.stamp == model_stamp(model, self.train_paths)
        self.after: Reference | None = None  # after a passing check: the written model's outputs
        if self.recorded:
            self.inputs, self.before = list(reference.inputs), list(reference.outputs)
            return
        gen = torch.Generator().manual_seed(0)
        self.inputs = [torch.randn(BATCH, *graph.node(name).shape, generator=gen, dtype=torch.float64)
                       .to(dtype=dtype, device=device) for name in graph.inputs]
        self.before = self._outputs()

    def _outputs(self) -> list[np.ndarray]:
        try:
            with eval_forward(self.model, self.train_paths), torch.no_grad():
                out = self.model(*[x.clone() for x in self.inputs])
        except Exception as err:  # the model cannot run as it is now (a layer cast to another dtype since compile)
            first = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
            raise PathirError(f"write-back refused: the model's own forward fails ({type(err).__name__}: {first}), so "
                              "the written function cannot be checked; make the model run (one dtype and device "
                              "throughout) and compile it again. The model is untouched") from None
        return [t.detach().to("cpu", torch.float64).numpy() for t in output_tensors(out)]

    def check(self) -> None:
        """PathirError where an output moved by more than the tolerance, relative to its max |value|
        (outputs not finite before the write are not compared); StaleReference instead where "before"
        was a recorded reference (the write is then checked again against a fresh forward)."""
        after = self._outputs()
        try:
            self._compare(after)
        except PathirError as err:
            if self.recorded:
                raise StaleReference(f"checked against a recorded forward: {err}") from err
            raise
        self.after = Reference(model_stamp(self.model, self.train_paths), tuple(self.inputs), tuple(after))

    def _compare(self, after) -> None:
        if len(after) != len(self.before):
            raise PathirError(f"write-back refused: the model returns {len(after)} outputs, {len(self.before)} before")
        for k, (a, b) in enumerate(zip(self.before, after)):
            if a.shape != b.shape:
                raise PathirError(f"write-back refused: output {k} of the model changed shape under the write")
            if not np.isfinite(a).all() or not a.size:
                continue
            if not np.isfinite(b).all():
                raise PathirError(
                    f"write-back refused: the rescaled model does not fit {self.dtype}: its output {k} is no longer "
                    "finite on a random probe (a weight or an activation leaves the dtype's range). Bound the rescaling "
                    "(max_log_scale=..., or None for the largest this dtype holds); the model is untouched")
            moved = float(np.abs(b - a).max() / max(float(np.abs(a).max()), 1e-30))
            if not moved <= self.tolerance:
                raise PathirError(
                    f"write-back refused: the written model's output {k} moved by {moved:.3g} (relative to its max; "
                    f"at most {self.tolerance:g} is rounding) on a random probe. A tensor the rescaling changes is "
                    "also read where pathir's graph does not see it (a running statistic or a threshold buffer used as "
                    "a constant elsewhere, one shared by two batch-norms); the model is untouched")
