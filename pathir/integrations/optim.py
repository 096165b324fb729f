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
``weight_orig``; its mask is a constant factor.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from pathir.errors import ArgumentError, PathirError, PathNormOverflow
from pathir.ir import Graph, Param, Role
from pathir.lifting.diag_g import diag_g_log_parts

__all__ = ["PathSGD"]

_LOG_MAX = math.log(np.finfo(np.float64).max)


class _Leaf:
    """A model tensor by source name: the parameter to step (or None for a
    buffer), the tensor to read (float64), a constant mask (pruned) or None."""

    def __init__(self, model: torch.nn.Module, name: str):
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        self.name, self.mask = name, None
        if name in params:
            self.param_name = name
        elif name + "_orig" in params and name + "_mask" in buffers:
            self.param_name, self.mask = name + "_orig", name + "_mask"
        elif name in buffers:
            self.param_name = None
        else:
            raise PathirError(f"PathSGD: source tensor '{name}' is neither a parameter nor a buffer of the model")

    def read(self, model: torch.nn.Module) -> torch.Tensor:
        t = model.get_parameter(self.param_name) if self.param_name else model.get_buffer(self.name)
        t = t.detach().to(torch.float64)
        return t * model.get_buffer(self.mask).to(torch.float64) if self.mask else t


class _Recipe:
    """One graph param as a torch function of model tensors: ``fn({name: tensor})``,
    each entry of the result depending on at most one entry of each tensor."""

    def __init__(self, param: Param, leaves: list[str], fn: Callable):
        self.param, self.leaves, self.fn = param, leaves, fn


def _value_ref(p: Param):
    refs = [r for r in p.sources if r.role is Role.VALUE]
    if len(refs) != 1:
        raise PathirError(f"PathSGD: param '{p.name}' has {len(refs)} VALUE source tensors, expected one")
    return refs[0]


def _batchnorm(model, p: Param):
    """(module path, module) of the batch-norm behind a param's OUT_SCALE refs."""
    paths = {r.name.rpartition(".")[0] for r in p.sources if r.role is Role.OUT_SCALE}
    if len(paths) != 1:
        raise PathirError(f"PathSGD: param '{p.name}' is scaled by {sorted(paths)}, expected one batch-norm")
    path = paths.pop()
    bn = model.get_submodule(path)
    if getattr(bn, "running_var", None) is None or getattr(bn, "running_mean", None) is None:
        raise PathirError(f"PathSGD: '{path}' has no running statistics")
    return path, bn


def _threshold(p: Param, model: torch.nn.Module) -> _Recipe:
    """A clipped ReLU's threshold param (−t per channel): read from its buffer, else a constant (a number
    in an nn.ReLU6 / nn.Hardtanh or a call); not a parameter, so PathSGD never steps it."""
    name = next(r.name for r in p.sources if r.role is Role.CLIP_THRESHOLD)
    if name in dict(model.named_buffers()):
        return _Recipe(p, [name], lambda t, name=name, s=p.shape: -torch.broadcast_to(t[name].reshape(-1), s))
    return _Recipe(p, [], lambda t, v=torch.as_tensor(p.value): v.clone())


def _is_threshold(p: Param) -> bool:
    return any(r.role is Role.CLIP_THRESHOLD for r in p.sources)


def _recipes(graph: Graph, model: torch.nn.Module) -> list[_Recipe]:
    biases = {id(n.bias): n for n in graph.nodes if n.bias is not None}
    value_names = {_value_ref(p).name for p in graph.params() if not _is_threshold(p)}
    out = []
    for p in graph.params():
        if _is_threshold(p):
            out.append(_threshold(p, model))
            continue
        ref = _value_ref(p)
        roles = {r.role for r in p.sources}
        shape = p.shape
        if roles == {Role.VALUE}:
            out.append(_Recipe(p, [ref.name], lambda t, ref=ref, s=shape: ref.from_source(t[ref.name]).reshape(s)))
            continue
        path, bn = _batchnorm(model, p)
        g_name, b_name, m_name, v_name = (f"{path}.{a}" for a in ("weight", "bias", "running_mean", "running_var"))
        eps = float(bn.eps)

        def c_of(t, g_name=g_name, v_name=v_name, eps=eps):
            return t[g_name] / torch.sqrt(t[v_name] + eps)

        if Role.IN_STATS in roles:  # an unfolded batch-norm scale: c itself
            out.append(_Recipe(p, [g_name, v_name], lambda t, c_of=c_of, s=shape: c_of(t).reshape(s)))
        elif id(p) in biases:  # β − μc (+ c · the biases of the layers folded into it)
            convs = []
            for e in biases[id(p)].edges:
                w = e.map.weight
                if w is None or not any(r.role is Role.OUT_SCALE and r.name.startswith(path + ".") for r in w.sources):
                    continue
                owner = _value_ref(w).name.rpartition(".")[0]
                name = f"{owner}.bias" if owner else "bias"
                bias = getattr(model.get_submodule(owner), "bias", None)
                if isinstance(bias, torch.Tensor) and name not in value_names:
                    convs.append(name)

            def fn(t, c_of=c_of, b_name=b_name, m_name=m_name, convs=tuple(convs), s=shape):
                c = c_of(t)
                extra = sum((t[n] for n in convs), torch.zeros_like(c))
                return (t[b_name] - t[m_name] * c + c * extra).reshape(s)

            out.append(_Recipe(p, [b_name, g_name, m_name, v_name, *convs], fn))
        else:  # a weight folded with the batch-norm after it: W · c per output channel
            def fn(t, ref=ref, c_of=c_of, s=shape):
                w = ref.from_source(t[ref.name]).reshape(s)
                return w * c_of(t).reshape(-1, *([1] * (len(s) - 1)))

            out.append(_Recipe(p, [ref.name, g_name, v_name], fn))
    return out


class _Coordinates:
    """The compiled graph as a function of the model's tensors, and diag G pulled back to them."""

    def __init__(self, graph: Graph, model: torch.nn.Module):
        self.graph, self.model = graph, model
        self.recipes = _recipes(graph, model)
        names = {n for r in self.recipes for n in r.leaves}
        self.leaves = {n: _Leaf(model, n) for n in sorted(names)}
        tensors = self.read()
        for r in self.recipes:  # the recipes must rebuild the compiled graph
            value = r.fn(tensors).numpy()
            scale = max(float(np.abs(r.param.value).max(initial=0)), 1e-300)
            if value.shape != r.param.shape or np.abs(value - r.param.value).max(initial=0) > 1e-6 * scale:
                raise PathirError(
                    f"PathSGD cannot rebuild param '{r.param.name}' ({r.param.how or r.param.name}) "
                    "from the model's tensors: was the model changed after compiling?"
                )

    def read(self) -> dict[str, torch.Tensor]:
        return {n: leaf.read(self.model).cpu() for n, leaf in self.leaves.items()}

    def current_graph(self, tensors) -> Graph:
        values = {id(r.param): r.fn(tensors).numpy() for r in self.recipes}
        return self.graph.map_params(lambda p: Param.adopt(p.name, values[id(p)].copy(), p.sources, p.how))

    def pull_back(self, tensors, g: list[np.ndarray]) -> dict[str, torch.Tensor]:
        """{model parameter name: Σ over graph params j of (∂θ_j/∂θ_model)² g_j}."""
        out: dict[str, torch.Tensor] = {}
        for r, gj in zip(self.recipes, g):
            gj = torch.as_tensor(gj, dtype=torch.float64)
            for name in r.leaves:
                leaf = self.leaves[name]
                if leaf.param_name is None:
                    continue
                x = tensors[name]

                def f(v, name=name, r=r):
                    return r.fn({**tensors, name: v})

                _, slope = torch.func.jvp(f, (x,), (torch.ones_like(x),))  # ∂θ_j/∂x, one x entry per j
                _, vjp = torch.func.vjp(f, x)
                (contrib,) = vjp(gj * slope)
                if leaf.mask:
                    contrib = contrib * self.model.get_buffer(leaf.mask).to(torch.float64).cpu()
                out[leaf.param_name] = out[leaf.param_name] + contrib if leaf.param_name in out else contrib
        return out


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
        self._coords = _Coordinates(compiled.graph, model)
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
