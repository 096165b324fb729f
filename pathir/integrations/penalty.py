"""``pathir.PathNormPenalty``: the path-norm ‖Φ(θ)‖_q of a model as a loss term (Neyshabur et al. 2015).

``penalty()`` is ``cm.path_norm(q, differentiable=True)`` of the model compiled once: a float64
scalar whose autograd gradient with respect to the model's parameters is exactly d‖Φ‖_q/dθ (batch-norms
folded as pathir compiles them), read from the live model at every call, so that
``loss = ce + lam * penalty()`` works across optimizer steps without compiling again (docs/training.md).
"""

from __future__ import annotations

import torch

from pathir.api import compile as compile_model
from pathir.errors import ArgumentError
from pathir.lifting.path_norm_grad import check_differentiable_q

__all__ = ["PathNormPenalty"]


class PathNormPenalty(torch.nn.Module):
    """The l_q path-norm of ``model`` as a differentiable term: ``penalty()`` -> float64 scalar.

    Parameters
    ----------
    model : the torch nn.Module to penalise (compiled here, once; or give ``compiled``)
    q : 1 <= q < inf (the path-norm is not differentiable for q < 1 at a zero weight, nor for q = inf)
    input_shape, example_input, backend : as for ``pathir.compile``
    compiled : a ``pathir.compile(model)`` to reuse instead of compiling

    The model is not a submodule of the penalty: ``penalty.parameters()`` is empty, and the
    optimizer holds the model's parameters as usual.

    >>> import torch, pathir
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1)).double()
    >>> with torch.no_grad():
    ...     _ = net[0].weight.copy_(torch.tensor([[1.0, -2.0], [3.0, 0.5]])); _ = net[0].bias.fill_(1.0)
    ...     _ = net[2].weight.copy_(torch.tensor([[2.0, -1.0]])); _ = net[2].bias.fill_(0.0)
    >>> penalty = pathir.PathNormPenalty(net, q=1, input_shape=(2,))
    >>> p = penalty()      # Σ_paths |Φ_p|: 2·(1 + 2 + 1) + 1·(3 + 0.5 + 1) + 0
    >>> round(p.item(), 12)
    12.5
    >>> p.backward()
    >>> net[2].weight.grad  # d/dv_j of Σ |v_j| (Σ_i |W_ji| + |b_j|) = sign(v_j) · (Σ_i |W_ji| + |b_j|)
    tensor([[ 4.0000, -4.5000]], dtype=torch.float64)
    """

    def __init__(self, model: torch.nn.Module, q: float = 1.0, input_shape=None, example_input=None,
                 backend=None, compiled=None):
        super().__init__()
        self.q = check_differentiable_q(q)
        if not isinstance(model, torch.nn.Module):
            raise ArgumentError(f"PathNormPenalty needs a torch nn.Module, got {type(model).__name__}")
        if compiled is None:
            compiled = compile_model(model, input_shape=input_shape, example_input=example_input, backend=backend)
        elif getattr(compiled, "model", None) is not model:
            raise ArgumentError("PathNormPenalty: `compiled` was not compiled from `model`")
        self.compiled = compiled  # a plain attribute: the model's parameters stay out of this module's

    def forward(self) -> torch.Tensor:
        """‖Φ(θ)‖_q of the model as it is now, differentiable with respect to its parameters."""
        return self.compiled.path_norm(self.q, differentiable=True)

    def extra_repr(self) -> str:
        return f"q={self.q:g}, model={self.compiled.name}"
