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
from pathir.frontends.torch.live import fused_steps

__all__ = ["attach", "eagerly"]


class _GivenGradient(torch.autograd.Function):
    """``forward(value, grads, *params) = value``; backward: ``grad_output · grads[j]`` to ``params[j]``."""

    @staticmethod
    def forward(ctx, value, grads, watched, *params):
        ctx.grads = grads
        ctx.save_for_backward(*watched)  # the model's tensors: an in-place step before backward is refused by torch
        ctx.fused = fused_steps(watched)  # ... and a fused optimizer's step, which bumps no version, by pathir
        return value.clone()

    @staticmethod
    def backward(ctx, grad_output):
        """The given gradients, constants: refused where autograd records the backward (``create_graph=True``),
        which would differentiate them as if f had no second derivative."""
        if torch.is_grad_enabled():  # autograd runs a backward with grad mode on only under create_graph=True
            raise PathirError("the differentiable path-norm gives a first derivative only: a backward with "
                              "create_graph=True (a second derivative, a gradient penalty) would silently drop its "
                              "second-order term; take the path-norm's term out of the loss you differentiate twice")
        watched = ctx.saved_tensors  # torch's version check: the gradient is for the values the forward read
        if fused_steps(watched) != ctx.fused:
            raise PathirError("a parameter the differentiable path-norm read was modified in place by a fused "
                              "optimizer step (fused=True, which torch's inplace check does not see) between the "
                              "path-norm's forward and its backward: its gradient is for the values it read. Call "
                              "backward before optimizer.step(), or compute the path-norm again after it")
        return (None, None, None, *(grad_output.to(g.device) * g for g in ctx.grads))


def attach(value: float, params: list[torch.Tensor], grads: list[np.ndarray], watched=()) -> torch.Tensor:
    """``value`` as a float64 scalar whose gradient with respect to ``params[j]`` is ``grads[j]``
    (same shape); params that need no gradient are left out of the autograd graph. ``watched``: the
    model's tensors the value was read from; a backward after one of them was changed in place (an
    optimizer step between the forward and the backward) raises torch's own "modified by an inplace
    operation" error, as for any torch function of them, instead of giving the old point's gradient; a
    fused optimizer's step, which bumps no version, raises a PathirError."""
    live = [(p, g) for p, g in zip(params, grads) if p.requires_grad]
    device = params[0].device if params else torch.device("cpu")
    out = torch.tensor(value, dtype=torch.float64, device=device)
    if not live:
        return out
    ts = tuple(torch.from_numpy(np.ascontiguousarray(g)).to(p.device) for p, g in live)
    return _GivenGradient.apply(out, ts, tuple(watched), *(p for p, _ in live))


@torch.compiler.disable
def eagerly(fn, *args):
    """``fn(*args)`` run by Python itself, also when called from a function being compiled by torch.compile
    (a graph break: pathir reads the live model and numpy arrays, which no compiled graph can hold); and
    PathirError inside a torch.func transform (grad, vmap, jacrev), whose function arguments are not the
    model's own parameters that the path-norm reads."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        raise PathirError("the differentiable path-norm reads the model's own parameters, so it has no gradient "
                          "inside a torch.func transform (grad, vmap, jacrev with functional_call): compute it outside "
                          "and use loss.backward() or torch.autograd.grad")
    return fn(*args)
