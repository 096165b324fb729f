"""A float computed by pathir made a torch scalar whose gradient autograd carries to the model.

pathir computes a quantity f of the graph's params θ_graph and its exact gradient ∂f/∂θ_graph
(for the path-norm: ``pathir.lifting.path_norm_grad``, in log scale). ``attach`` returns f as a
torch scalar whose backward gives ∂f/∂θ_graph to the graph params computed with autograd from the
model's live tensors (``Coordinates.values``): autograd then chains it through the batch-norm
folding and the dtype casts to the model's own parameters, so their ``.grad`` is exactly
∂f/∂θ_model = (∂θ_graph/∂θ_model)ᵀ ∂f/∂θ_graph. A first derivative only: a second backward
through it is refused by torch (``once_differentiable``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.autograd.function import once_differentiable

__all__ = ["attach"]


class _GivenGradient(torch.autograd.Function):
    """``forward(value, grads, *params) = value``; backward: ``grad_output · grads[j]`` to ``params[j]``."""

    @staticmethod
    def forward(ctx, value, grads, *params):
        ctx.grads = grads
        return value.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        return (None, None, *(grad_output.to(g.device) * g for g in ctx.grads))


def attach(value: float, params: list[torch.Tensor], grads: list[np.ndarray]) -> torch.Tensor:
    """``value`` as a float64 scalar whose gradient with respect to ``params[j]`` is ``grads[j]``
    (same shape); params that need no gradient are left out of the autograd graph."""
    live = [(p, g) for p, g in zip(params, grads) if p.requires_grad]
    device = params[0].device if params else torch.device("cpu")
    out = torch.tensor(value, dtype=torch.float64, device=device)
    if not live:
        return out
    ts = tuple(torch.from_numpy(np.ascontiguousarray(g)).to(p.device) for p, g in live)
    return _GivenGradient.apply(out, ts, *(p for p, _ in live))
