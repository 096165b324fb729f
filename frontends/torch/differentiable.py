"""A float computed by pathir made a torch scalar whose gradient autograd carries to the model.

pathir computes a quantity f of the graph's params θ_graph and its exact gradient ∂f/∂θ_graph
(for the path-norm: ``pathir.lifting.path_norm_grad``, in log scale). ``attach`` returns f as a
torch scalar whose backward gives ∂f/∂θ_graph to the graph params computed with autograd from the
model's live tensors (``Coordinates.values``): autograd then chains it through the batch-norm
folding and the dtype casts to the model's own parameters, so their ``.grad`` is exactly
∂f/∂θ_model = (∂θ_graph/∂θ_model)ᵀ ∂f/∂θ_graph. A first derivative only: a backward that builds a
graph of the gradient (``create_graph=True``, for a second derivative) is refused with a PathirError,
since the gradient given here would carry no second-order term.
"""

from __future__ import annotations

import numpy as np
import torch

from pathir.errors import PathirError

__all__ = ["attach"]


class _GivenGradient(torch.autograd.Function):
    """``forward(value, grads, *params) = value``; backward: ``grad_output · grads[j]`` to ``params[j]``."""

    @staticmethod
    def forward(ctx, value, grads, *params):
        ctx.grads = grads
        return value.clone()

    @staticmethod
    def backward(ctx, grad_output):
        """The given gradients, constants: refused where autograd records the backward (``create_graph=True``),
        which would differentiate them as if f had no second derivative."""
        if torch.is_grad_enabled():  # autograd runs a backward with grad mode on only under create_graph=True
            raise PathirError("the differentiable path-norm gives a first derivative only: a backward with "
                              "create_graph=True (a second derivative, a gradient penalty) would silently drop its "
                              "second-order term; take the path-norm's term out of the loss you differentiate twice")
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
