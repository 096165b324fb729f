"""Path-SGD (Neyshabur et al. 2015; docs/math.md §10) as a ``torch.optim.Optimizer``.

    θ_i ← θ_i − lr · g_i(θ)^{-1} · ∂L/∂θ_i,        g = diag G (docs/math.md §6)

with g recomputed from the model's current parameters every ``k`` steps. If Φ
and the loss are invariant under a rescaling D (θ ↦ Dθ, D diagonal positive),
then g(Dθ) = D^{-2} g(θ) and ∇L(Dθ) = D^{-1} ∇L(θ), so the step from Dθ is D
times the step from θ: started from θ and Dθ the iterates stay
rescaling-equivalent, step after step (plain SGD's do not).

Model coordinates. The optimizer steps the torch model's own parameters; g is
diag G in *those* coordinates, g_model = diag(Jᵀ G J) with J = ∂θ_graph/∂θ_model
the Jacobian of the lowering:

- a graph param that is its source tensor (BN-free layers): g is diag G itself;
- a folded batch-norm (W' = W·c, b' = β − μc + c·b_conv, c = γ/√(var + eps),
  running statistics held constant): J couples W with γ and b' with β, γ and
  b_conv. A path enters each neuron through exactly one of its incoming terms
  (one weight entry or the bias), so the columns of one channel never meet on
  a path: the cross terms of Jᵀ G J vanish and g_model = (J∘J)ᵀ g exactly, e.g.
  g_W = c² g_W', g_γ = Σ_row (W/σ)² g_W' + ((b_conv − μ)/σ)² g_b', g_β = g_b'.

This is the curvature of the *inference* network (batch-norm with its running
statistics), the network pathir lowers; in train mode the batch statistics make
the function input-dependent, but rescalings still act on it the same way
(written onto γ and β), so the equivariance above still holds.
A pruned parameter (``torch.nn.utils.prune``) is stepped through its
``weight_orig``; its mask is a constant factor. The graph as a function of the
model's tensors is ``pathir.frontends.torch.coordinates``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pathir.errors import ArgumentError, PathirError, PathNormOverflow
from pathir.frontends.torch.coordinates import Coordinates
from pathir.lifting.diag_g import diag_g_log_parts

__all__ = ["PathSGD"]

_LOG_MAX = math.log(np.finfo(np.float64).max)


class PathSGD(torch.optim.Optimizer):
    """Path-SGD: SGD preconditioned by the inverse of diag G (docs/math.md §10).

    Parameters
    ----------
    params : iterable of parameters or param groups of ``compiled.model``
    compiled : pathir.Compiled
        The model compiled with ``pathir.compile``; every parameter given must
        take part in its graph.
    lr : float
        Learning rate.
    k : int
        Recompute diag G every ``k`` steps (from the parameters of that step).
    momentum : float
        Heavy-ball momentum on the preconditioned gradient (keeps the equivariance).
    backend : backend of the diag G computation (default: the Compiled's)

    Where g_i = 0 no path goes through the parameter, so its gradient is 0 too:
    it is left unchanged.

    Examples
    --------
    >>> import torch, pathir
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).double()
    >>> cm = pathir.compile(net, input_shape=(3,))
    >>> opt = pathir.integrations.optim.PathSGD(net.parameters(), compiled=cm, lr=0.05, k=5)
    >>> x, y = torch.randn(32, 3, dtype=torch.float64), torch.randn(32, 1, dtype=torch.float64)
    >>> def closure():
    ...     opt.zero_grad()
    ...     loss = ((net(x) - y) ** 2).mean()
    ...     loss.backward()
    ...     return loss
    >>> first = opt.step(closure).item()
    >>> for _ in range(20):
    ...     last = opt.step(closure).item()
    >>> last < first
    True
    """

    def __init__(self, params, compiled, lr: float = 0.01, k: int = 1, momentum: float = 0.0, backend=None):
        real = (int, float, np.integer, np.floating)
        if isinstance(lr, bool) or not isinstance(lr, real) or not lr > 0:
            raise ArgumentError(f"PathSGD needs lr > 0, got {lr!r}")
        if isinstance(k, bool) or not isinstance(k, real) or not np.isfinite(k) or int(k) != k or k < 1:
            raise ArgumentError(f"PathSGD needs an integer k >= 1, got {k!r}")
        if isinstance(momentum, bool) or not isinstance(momentum, real) or not 0.0 <= momentum < 1.0:
            raise ArgumentError(f"PathSGD needs 0 <= momentum < 1, got {momentum!r}")
        model = getattr(compiled, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise PathirError(
                "PathSGD needs a Compiled made from a torch nn.Module "
                f"(this one was compiled from {type(model).__name__ if model is not None else 'a Graph'})"
            )
        super().__init__(params, dict(lr=lr, momentum=momentum))
        self.compiled, self.k, self.backend = compiled, int(k), backend
        self._coords = Coordinates(compiled.graph, model)
        self._names = {id(t): n for n, t in model.named_parameters()}
        reached = {leaf.param_name for leaf in self._coords.leaves.values() if leaf.param_name}
        for group in self.param_groups:
            for p in group["params"]:
                name = self._names.get(id(p))
                if name is None:
                    raise PathirError("PathSGD: a parameter given is not a parameter of the compiled model")
                if name not in reached:
                    raise PathirError(f"PathSGD: parameter '{name}' takes no part in the compiled graph (no diag G)")
        self._steps = 0

    @torch.no_grad()
    def refresh(self) -> None:
        """Recompute diag G from the model's current parameters (``step`` does it every k steps)."""

        tensors = self._coords.read()
        graph = self._coords.current_graph(tensors)
        parts = diag_g_log_parts(graph, self.compiled.get_backend(self.backend))
        top = max((L for _, L in parts), default=-math.inf)
        if top > _LOG_MAX:
            raise PathNormOverflow(f"diag G reaches about 10^{top / math.log(10):.1f}, beyond float64")
        scaled = [m * math.exp(L - top) if L > -math.inf else np.zeros(m.shape) for m, L in parts]
        with torch.enable_grad():
            g = self._coords.pull_back(tensors, scaled)
        for group in self.param_groups:
            for p in group["params"]:
                gp = g[self._names[id(p)]] * math.exp(top) if top > -math.inf else g[self._names[id(p)]] * 0
                self.state[p]["g"] = gp.reshape(p.shape).to(p.device)

    def diag_g(self) -> dict[str, torch.Tensor]:
        """{model parameter name: the diag G in use} (float64, the parameter's shape)."""
        return {self._names[id(p)]: self.state[p]["g"] for g in self.param_groups for p in g["params"] if "g" in self.state[p]}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._steps % self.k == 0 or any("g" not in self.state[p] for g in self.param_groups for p in g["params"]):
            self.refresh()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = self.state[p]["g"]
                d = torch.where(g > 0, p.grad.to(torch.float64) / torch.where(g > 0, g, 1.0), 0.0)
                if momentum:
                    buf = self.state[p].get("momentum_buffer")
                    buf = d.clone() if buf is None else buf.mul_(momentum).add_(d)
                    self.state[p]["momentum_buffer"] = buf
                    d = buf
                p.add_(d.to(p.dtype), alpha=-lr)
        self._steps += 1
        return loss
