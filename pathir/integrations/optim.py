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
model's tensors is ``pathir.frontends.torch.coordinates``; it is resolved again
from the Compiled (which follows the model, docs/live.md) whenever the model's
layout moves: pruning after construction, a ``pathcond`` that made a clipped
ReLU per-channel (its threshold then read from its buffer), a Parameter tied
or replaced.

Tied parameters. A Parameter read at several places (tied between modules, a
module called twice) gets the sum over its uses, g_i = Σ_uses Σ_{p ∋ use}
(Φ_p/θ_i)², which is diag(Jᵀ G J) exactly when no path crosses two of its
uses. Where one can (uses in series), an entry may be a repeated factor of Φ_p
and diag(Jᵀ G J) has cross terms between the uses (a path crossing θ_i twice
contributes (2Φ_p/θ_i)², not 2(Φ_p/θ_i)²): PathSGD refuses such a parameter.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from pathir.errors import ArgumentError, PathirError, PathNormOverflow
from pathir.frontends.torch.coordinates import Coordinates
from pathir.lifting.diag_g import diag_g_log_parts
from pathir.lifting.param_grads import check_common_scale

__all__ = ["PathSGD"]

_LOG_MAX = math.log(np.finfo(np.float64).max)
_TINY = float(np.finfo(np.float64).tiny)


def _check_group(group: dict) -> None:
    """ArgumentError unless the group's lr is a finite number >= 0 and its momentum in [0, 1)."""
    lr, momentum = group.get("lr"), group.get("momentum")
    if isinstance(lr, bool) or not isinstance(lr, (int, float, np.integer, np.floating)) or not 0 <= lr < math.inf:
        raise ArgumentError(f"PathSGD: a param group's lr must be a finite number >= 0, got {lr!r}")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float, np.integer, np.floating)) \
            or not 0.0 <= momentum < 1.0:
        raise ArgumentError(f"PathSGD: a param group's momentum must be in [0, 1), got {momentum!r}")


def _names_of(model: torch.nn.Module) -> dict[int, tuple[str, ...]]:
    """{id(parameter): every name it is reachable by, first as ``named_parameters()`` gives it}:
    a parameter tied between modules has one name per module holding it."""
    out: dict[int, tuple[str, ...]] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        out[id(t)] = out.get(id(t), ()) + (name,)
    return out


def _identity(model: torch.nn.Module) -> tuple:
    """Which Parameter each parameter name holds: moves when one is replaced, tied or untied."""
    return tuple((name, id(t)) for name, t in model.named_parameters(remove_duplicate=False))


def _sites(coords: Coordinates) -> dict[int, set]:
    """{id(model parameter): {(tail, head)}}: every place the graph reads the parameter, an edge
    tail → head for a weight, (None, head) for a bias (where its paths start)."""
    reads: dict[int, set] = {}
    for r in coords.recipes:
        for name in r.leaves:
            leaf = coords.leaves[name]
            if leaf.param_name:
                reads.setdefault(id(r.param), set()).add(id(coords.model.get_parameter(leaf.param_name)))
    sites: dict[int, set] = {}
    for node in coords.graph.nodes:
        for tail, p in [(e.source, e.map.weight) for e in node.edges] + [(None, node.bias)]:
            for t in reads.get(id(p), ()) if p is not None else ():
                sites.setdefault(t, set()).add((tail, node.name))
    return sites


def _reaches(graph, a: str, b: str, memo: dict) -> bool:
    """Whether node ``b`` is ``a`` or one of its descendants (``memo``: {node: its descendants})."""
    if a not in memo:
        seen, todo = set(), [a]
        while todo:
            for node, _ in graph.consumers.get(todo.pop(), ()):
                if node.name not in seen:
                    seen.add(node.name)
                    todo.append(node.name)
        memo[a] = seen
    return a == b or b in memo[a]


def _refuse_uses_in_series(coords: Coordinates, names: dict, stepped: list) -> None:
    """PathirError naming a parameter of ``stepped`` that one path can read twice: a use whose head
    reaches another's tail (a weight tied across depth, a layer called twice in series). There the
    same entry can be a repeated factor of Φ_p, and diag(Jᵀ G J) has cross terms between the uses
    (∂Φ_p/∂θ_i = 2Φ_p/θ_i for a path crossing θ_i twice) that summing diag G over the uses omits.
    Uses in parallel (entering one node, or on branches no path crosses in turn) share no path."""
    sites, memo = _sites(coords), {}
    for p in stepped:
        uses = sorted(sites.get(id(p), ()), key=str)
        for (_, head), (tail, later) in itertools.permutations(uses, 2):
            if tail is not None and _reaches(coords.graph, head, tail, memo):
                raise PathirError(
                    f"PathSGD: parameter '{names[id(p)][0]}' is read at two places one path crosses in turn "
                    f"(into node '{head}', then into node '{later}'): a weight tied across depth or a layer called "
                    "twice in series. Its diag G in the model's coordinates then has cross terms between the uses, "
                    "which PathSGD does not compute: untie it (one Parameter per use), or step it with another "
                    "optimizer (leave it out of PathSGD's params)"
                )


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
        self._resolve(compiled.graph, "the compiled model")
        self._steps = 0

    def add_param_group(self, param_group: dict) -> None:
        """torch's, then the group's own lr and momentum checked as the defaults are (a group's lr may be 0)."""
        super().add_param_group(param_group)
        _check_group(self.param_groups[-1])

    def state_dict(self) -> dict:
        """torch's, with the step count that decides when diag G is recomputed (every k steps): a resumed
        run recomputes it at the steps the uninterrupted run does."""
        out = super().state_dict()
        out["pathsgd_steps"] = self._steps
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, then the step count, and diag G and the momentum buffers as saved: torch casts a state
        tensor to its parameter's dtype (float32), which would round the float64 state."""
        state_dict = dict(state_dict)
        steps = int(state_dict.pop("pathsgd_steps", 0))
        kept = {i: {k: v for k, v in s.items() if k in ("g", "momentum_buffer") and torch.is_tensor(v)}
                for i, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        saved = [i for group in state_dict["param_groups"] for i in group["params"]]
        for i, p in zip(saved, (p for group in self.param_groups for p in group["params"])):
            for key, value in kept.get(i, {}).items():
                self.state[p][key] = value.to(device=p.device, dtype=torch.float64, copy=True)
        self._steps = steps

    def _resolve(self, graph, what: str) -> None:
        """Resolve diag G's coordinates against the model as it is now: ``_coords`` rebuilds ``graph``
        from the model's tensors, ``_names[id(p)]`` is every name of each stepped parameter (a tied one
        has several), ``_resolved_at`` the ``_snapshot`` both were resolved against. PathirError naming
        a parameter that is not ``what``'s, takes no part in ``graph``, or is read twice along one path."""
        model = self.compiled.model
        coords = Coordinates(graph, model)
        names = _names_of(model)
        reached = {leaf.param_name for leaf in coords.leaves.values() if leaf.param_name}
        stepped = [p for group in self.param_groups for p in group["params"]]
        for p in stepped:
            if id(p) not in names:
                raise PathirError(f"PathSGD: a parameter given is not a parameter of {what}")
            if reached.isdisjoint(names[id(p)]):
                raise PathirError(f"PathSGD: parameter '{names[id(p)][0]}' takes no part in the compiled graph (no diag G)")
        _refuse_uses_in_series(coords, names, stepped)
        self._coords, self._names, self._resolved_at = coords, names, self._snapshot()

    def _snapshot(self) -> tuple:
        """Which Parameter each name of the model holds, and the parameters stepped."""
        return _identity(self.compiled.model), tuple(id(p) for group in self.param_groups for p in group["params"])

    def _stale(self) -> bool:
        """Whether the model or the params moved away from what ``_resolve`` resolved: the model's layout
        (pruning's reparametrization, a module replaced by a write-back), which Parameter a name holds,
        a param group added."""
        return not self._coords.fits() or self._snapshot() != self._resolved_at

    @torch.no_grad()
    def refresh(self) -> None:
        """Recompute diag G from the model's current parameters (``step`` does it every k steps, and
        whenever the model's layout changed: its coordinates are then resolved again)."""

        if self._stale():
            self._resolve(self.compiled.graph, "the model")  # the Compiled follows the model (docs/live.md)
        tensors = self._coords.read()
        graph = self._coords.current_graph(tensors)
        parts = diag_g_log_parts(graph, self.compiled.get_backend(self.backend))
        check_common_scale(graph, parts, "PathSGD's diag G")  # read at one scale: nothing may flush to 0
        top = max((L for _, L in parts), default=-math.inf)
        if top > _LOG_MAX:
            raise PathNormOverflow(f"diag G reaches about 10^{top / math.log(10):.1f}, beyond float64")
        scaled = [m * math.exp(L - top) if L > -math.inf else np.zeros(m.shape) for m, L in parts]
        with torch.enable_grad():
            g = self._coords.pull_back(tensors, scaled)
        new = {}  # every parameter's g, checked before any is stored
        for group in self.param_groups:
            for p in group["params"]:
                scaled_gp = sum(g[n] for n in self._names[id(p)] if n in g)  # a tied parameter: the sum over its uses
                gp = scaled_gp * math.exp(top) if top > -math.inf else scaled_gp * 0
                if bool(((scaled_gp > 0) & (gp < _TINY)).any()):  # below float64's normal range: a step ÷ 0
                    low = top + math.log(float(scaled_gp[scaled_gp > 0].min()))
                    raise PathNormOverflow(
                        f"diag G of '{self._names[id(p)][0]}' is about 10^{low / math.log(10):.1f}, below float64's "
                        "smallest normal number: Path-SGD's step ∂L/∂θ ÷ g is not computed there. Rescale the network "
                        "first (cm.pathcond() or cm.normalize() balance its layers)")
                new[p] = gp.reshape(p.shape).to(p.device)
        for p, gp in new.items():
            self.state[p]["g"] = gp

    def diag_g(self) -> dict[str, torch.Tensor]:
        """{model parameter name: the diag G in use} (float64, the parameter's shape)."""
        return {self._names[id(p)][0]: self.state[p]["g"] for g in self.param_groups for p in g["params"] if "g" in self.state[p]}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._steps % self.k == 0 or self._stale() or any("g" not in self.state[p] for g in self.param_groups for p in g["params"]):
            self.refresh()
        for group in self.param_groups:
            _check_group(group)  # (a scheduler or the user may have set them)
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
