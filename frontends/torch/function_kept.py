"""After a rescaling is written into a torch model: the model computes what it computed before,
checked on one seeded probe batch.

The write rules keep the function for every read of a tensor the IR knows of. A read it does not
know of would change it silently: a kept batch-norm's running variance also used as a constant
factor, a clip threshold buffer also multiplied in, running statistics shared by a folded and a kept
batch-norm. Two forwards of the model on the same probe, before the write and after it, find any
such change the probe reaches; the write is then refused (``commit_rescaling``'s transaction puts
the model back).
"""

from __future__ import annotations

import numpy as np
import torch

from pathir.errors import PathirError
from pathir.frontends.torch.inputs import eval_forward, model_dtype_device, output_tensors

__all__ = ["Probe"]

#: the largest output change a write may make, relative to max |output|: ten times the compile
#: self-check's tolerance per dtype (the rescaled model rounds its products differently)
KEPT = {torch.float64: 1e-8, torch.float32: 1e-3, torch.float16: 1e-1, torch.bfloat16: 3e-1}
BATCH = 1


class Probe:
    """The model's outputs on a seeded random batch (``BATCH`` samples per graph input), taken at
    construction: :meth:`check` runs the model again and refuses a changed function."""

    def __init__(self, model, graph, train_paths=()):
        self.model, self.train_paths = model, tuple(train_paths)
        dtype, device = model_dtype_device(model)
        self.dtype, self.tolerance = dtype, KEPT.get(dtype, 1e-3)
        gen = torch.Generator().manual_seed(0)
        self.inputs = [torch.randn(BATCH, *graph.node(name).shape, generator=gen, dtype=torch.float64)
                       .to(dtype=dtype, device=device) for name in graph.inputs]
        self.before = self._outputs()

    def _outputs(self) -> list[np.ndarray]:
        with eval_forward(self.model, self.train_paths), torch.no_grad():
            out = self.model(*[x.clone() for x in self.inputs])
        return [t.detach().to("cpu", torch.float64).numpy() for t in output_tensors(out)]

    def check(self) -> None:
        """PathirError where an output moved by more than the tolerance, relative to its max |value|
        (outputs not finite before the write are not compared)."""
        after = self._outputs()
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
