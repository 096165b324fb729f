"""PathCond on a compiled model (docs/math.md §7): solve for z, rescale the model in place.

With g = diag G (docs/math.md §6) and the unit incidence matrix B (§5), PathCond
minimises the convex

    F(z) = n log Σ_i g_i e^{(Bz)_i} - Σ_i (Bz)_i

and rescales θ ← θ ⊙ e^{-Bz*/2}, after which diag G is g ⊙ e^{Bz*}. Φ, and
so the network's function, is unchanged. Steps: the units and B (cached on
the Compiled), g through ``diag_g_parts`` (normalised by its maximum, so F is
computed up to the constant n·log max g, added back in the report), the array
solver (``pathir.pathcond.solvers``), then write-back (``pathir.rescaling.commit``):
everything that can fail runs before the model is touched.

Degenerate units (g zero on the whole incoming or outgoing side: a dead or
pruned neuron) make F unbounded along their z_h; they keep z_h = 0 and are
listed by name in the report.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from pathir.analyses.incidence import compact_rows
from pathir.errors import ArgumentError, PathirError
from pathir.lifting.diag_g import diag_g_log_parts
from pathir.lifting.low_rank import factorable
from pathir.lifting.param_grads import at_common_scale, check_common_scale
from pathir.pairs.coarse import unit_groups
from pathir.pathcond.g_summary import summarize_factored
from pathir.pathcond.objective import log_spreads, spread_ends
from pathir.pathcond.solvers import METHODS, solve
from pathir.rescaling.bounds import default_max_log_scale
from pathir.support.progress import Phases, chain_callbacks, warn_not_converged

__all__ = ["PathCondReport", "pathcond", "PHASES"]

#: the phases of the progress bar of :func:`pathcond`
PHASES = ("units", "diag G", "solve", "write")


@dataclass(frozen=True, eq=False)
class PathCondReport:
    """What ``cm.pathcond()`` did.

    ``objective_before`` / ``objective_after`` are F(0) and F(z*) with the true
    diag G (not normalised). ``max_abs_log_scale`` = max_h |z_h|: a weight moves
    by at most e^{max|z|} (e^{max|z|/2} for one between a unit and a pinned
    neuron). ``log_spread_*`` = max log g − min log g over g > 0 (natural log).
    ``gradient_max`` = max_h |∂F/∂z_h| at z*, ``gradient_relative`` the same
    relative to the size of the terms it balances (both over non-degenerate
    units; at the bound, the projected gradient). ``history[k]`` is F after sweep k (``history[0]`` = F(0)).
    ``max_log_scale`` is the bound M on every |z_h| the solve ran under (``math.inf``: none);
    ``units_at_bound`` names the units that ended on it, in which case the unconstrained optimum
    was cut (``bound_cut``): run with ``max_log_scale=math.inf`` to get it.
    ``timings``: seconds per step (units, B, diag G, group: g grouped by unit pair with its summary,
    solve, write). ``z`` holds the log-scales, one per unit.

    F depends on the point it is measured from (F(z) − F(0) is what the solver
    lowers; a second run starts from F(0) of the rescaled model, which differs
    from F(z*) by Σ_i (Bz*)_i). ``divergence_*`` is the base-free figure:
    the log-det divergence n'·log(mean g) − Σ log g of the scaled diag G from
    the identity, over the n' entries g > 0 (0 iff all are equal; invariant
    under re-running).
    """

    model: str
    solver: str
    units: int
    params: int
    objective_before: float
    objective_after: float
    sweeps: int
    converged: bool
    max_abs_log_scale: float
    log_spread_before: float
    log_spread_after: float
    divergence_before: float
    divergence_after: float
    degenerate_units: Sequence[str]  # a UnitNames: named when first read
    gradient_max: float
    gradient_relative: float
    seconds: float
    written: bool
    history: tuple[float, ...] = ()
    timings: dict = field(default_factory=dict)
    max_log_scale: float = math.inf
    units_at_bound: Sequence[str] = ()  # a UnitNames: named when first read
    z: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)

    @property
    def bound_cut(self) -> bool:
        """Whether the bound on |z| held some unit back from the unconstrained optimum."""
        return bool(self.units_at_bound)

    def to_dict(self, z: bool = False) -> dict:
        """JSON-ready; ``z=True`` adds the log-scales."""
        out = {
            "model": self.model, "solver": self.solver, "units": self.units, "params": self.params,
            "objective_before": self.objective_before, "objective_after": self.objective_after,
            "sweeps": self.sweeps, "converged": self.converged, "max_abs_log_scale": self.max_abs_log_scale,
            "log_spread_before": self.log_spread_before, "log_spread_after": self.log_spread_after,
            "divergence_before": self.divergence_before, "divergence_after": self.divergence_after,
            "degenerate_units": list(self.degenerate_units), "gradient_max": self.gradient_max,
            "gradient_relative": self.gradient_relative, "seconds": self.seconds, "written": self.written,
            "history": list(self.history), "timings": dict(self.timings),
            "max_log_scale": self.max_log_scale if math.isfinite(self.max_log_scale) else None,
            "units_at_bound": list(self.units_at_bound), "bound_cut": self.bound_cut,
        }
        if z:
            out["z"] = self.z.tolist()
        return out

    def __str__(self) -> str:
        dead = _names(self.degenerate_units)
        steps = ", ".join(f"{k} {v:.2f}" for k, v in self.timings.items())
        rows = [
            ("model", f"{self.model}  ({self.solver} solver)"),
            ("units / parameters", f"{self.units:,} / {self.params:,}"),
            ("objective F", f"{self.objective_before:.10g} -> {self.objective_after:.10g}  "
                            f"(ΔF = {self.objective_after - self.objective_before:.4g})"),
            ("sweeps", f"{self.sweeps} ({'converged' if self.converged else 'NOT converged'})"),
            ("max |z|", f"{self.max_abs_log_scale:.4g}" + (f"  (bound {self.max_log_scale:.4g})"
                                                            if math.isfinite(self.max_log_scale) else "")),
            *([("at the bound", f"{len(self.units_at_bound)} units: {_names(self.units_at_bound)}; the unconstrained "
                                "optimum was cut (max_log_scale=math.inf gives it)")] if self.units_at_bound else []),
            ("spread of log diag G", f"{self.log_spread_before:.4g} -> {self.log_spread_after:.4g}  (max/min g: "
                                     f"{_ratio(self.log_spread_before)} -> {_ratio(self.log_spread_after)})"),
            ("log-det divergence", f"{self.divergence_before:.6g} -> {self.divergence_after:.6g}"),
            ("gradient at z*", f"max {self.gradient_max:.2e}, relative {self.gradient_relative:.2e}"),
            ("degenerate units", f"{len(self.degenerate_units)}" + (f": {dead}" if dead else "")),
            ("model rescaled", "yes" if self.written else "no (report only)"),
            ("time", f"{self.seconds:.2f} s" + (f"  ({steps})" if steps else "")),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _names(names) -> str:
    shown = ", ".join(names[:4])
    return shown + (f", ... ({len(names) - 4} more)" if len(names) > 4 else "")


def _ratio(log_spread: float) -> str:
    return f"{math.exp(log_spread):.3g}" if log_spread < 700 else f"1e{log_spread / math.log(10):.0f}"


def unit_log_spreads(units, g, z) -> tuple[float, float]:
    """log_spread of g and of g ⊙ e^{Bz} over the entries g > 0, param by param: (Bz)_i = z_l(i) − z_e(i)
    is taken from the units' compact row ends, so only the multiplies run over every entry."""

    zp = np.append(z, 0.0)
    offsets = np.cumsum([0] + [p.size for p in units.params])
    return log_spreads(spread_ends(g[offsets[k]:offsets[k + 1]].reshape(p.shape), zp[leave], zp[enter])
                       for k, (p, (enter, leave)) in enumerate(zip(units.params, compact_rows(units))))


def pathcond(facts, backend, solver: str = "newton", max_sweeps: int = 1000, tol: float = 1e-10,
             commit=None, name: str = "", max_log_scale: float | None = None, dtype="float64",
             callback=None, progress: bool | None = None) -> PathCondReport:
    """Minimise F (docs/math.md §7) over the rescalings of ``facts.graph``; ``commit(z)`` applies the minimiser.

    Parameters
    ----------
    facts : GraphFacts of the graph (``pathir.analyses.facts``: units, B, row keys or ends)
    backend : backend for diag G
    solver : "newton" (projected Newton-CG from a coarse start, the default), "block" (exact
        block updates, L-BFGS to finish) or "coordinate" (the published cyclic coordinate
        descent, for reference).
    max_sweeps, tol : passed to the solver; it stops when a sweep changes F by
        at most ``tol * max(1, |F|)`` or moves no z_h by more than ``tol``.
    commit : called with z* once it is found (``Compiled.commit_rescaling``); None
        leaves everything as it is (the report's ``written`` is False).
    name : the model's name, for the report.
    max_log_scale : bound M on every |z_h| (a parameter moves by at most e^{±M}); None: the
        largest that keeps write-back in ``dtype`` finite and normal
        (`pathir.rescaling.bounds.default_max_log_scale`); ``math.inf``: unconstrained.
    dtype : the narrowest float dtype of the model's tensors (for the default bound).
    callback : ``callback(step, F)`` after each solver sweep or iteration (F of the normalised g).
    progress : a bar on stderr over the phases units, diag G, solve, write (``pathir.support.progress``;
        None: only when stderr is a terminal). Not converging within ``max_sweeps`` warns.

    Returns
    -------
    PathCondReport

    Raises PathirError (the model untouched) where diag G vanishes everywhere,
    or where write-back is impossible (see ``pathir.rescaling.commit``).

    Examples
    --------
    >>> import numpy as np, torch, pathir
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> x = torch.randn(5, 3)
    >>> before = net(x)
    >>> cm = pathir.compile(net, input_shape=(3,))
    >>> report = cm.pathcond()
    >>> report.objective_after < report.objective_before, report.converged
    (True, True)
    >>> bool(torch.allclose(net(x), before, atol=1e-6))
    True
    """
    if solver not in METHODS:
        raise ArgumentError(f"solver={solver!r}: unknown PathCond solver; choose one of {sorted(METHODS)}")
    start = time.perf_counter()
    timings: dict[str, float] = {}
    bar = Phases(PHASES if commit is not None else PHASES[:-1], desc=f"PathCond {name}".strip(), progress=progress)
    bar.phase("units")

    def lap(step):
        timings[step] = time.perf_counter() - start - sum(timings.values())

    units = facts.units
    if max_log_scale is None:
        max_log_scale = default_max_log_scale(facts.graph, dtype)
    lap("units")
    # the newton and block solvers read B through the units' compact row ends only (no key per row);
    # the coordinate solver needs B itself
    rows = facts.row_ends
    B = facts.incidence[0] if solver == "coordinate" else None
    lap("B")
    bar.phase("diag G")
    # one array per param (no flat copy of g); Newton reads a large dense param's g = b aᵀ as its factors
    outer = factorable(facts.graph, rows.ends) if solver == "newton" else frozenset()
    g = diag_g_log_parts(facts.graph, backend, outer)
    check_common_scale(facts.graph, g, "PathCond's diag G")  # F reads g at one scale
    g, log_top = at_common_scale(g)
    lap("diag G")
    n = sum(part.size for part in g)
    if not math.isfinite(log_top):
        raise PathirError("diag G vanishes everywhere (no path of the network has only nonzero weights): "
                          "PathCond has nothing to balance")
    bar.phase("solve")
    # g grouped by unit pair, with what the report needs of it (pathir.pathcond.g_summary): g itself,
    # one float64 per parameter, is freed before the solver runs (the coordinate solver reads it)
    pairs, summary = summarize_factored(g, rows)
    lap("group")
    if solver == "coordinate":
        g = np.concatenate([part.reshape(-1) for part in g]) if g else np.zeros(0)  # it reads g flat
        result = solve(g, B, method=solver, max_sweeps=max_sweeps, tol=tol, row_key=facts.row_keys,
                       max_log_scale=max_log_scale, callback=chain_callbacks(callback, bar.callback))
    else:
        del g
        result = solve(None, None, method=solver, max_sweeps=max_sweeps, tol=tol, row_key=rows, pairs=pairs,
                       max_log_scale=max_log_scale, callback=chain_callbacks(callback, bar.callback),
                       groups=unit_groups(units))
    del pairs
    lap("solve")
    spreads = summary.spreads(result.z)  # first: a factored convolution's one pass serves both
    divergence = summary.divergences(result.f_initial, result.f_final, result.z, rows.balance)
    result = dataclasses.replace(result, g=None, B=None, key=None)
    g = summary = None  # freed before the write-back
    if commit is not None:
        bar.phase("write")
        commit(result.z)
        lap("write")
    bar.close()
    if not result.converged:
        warn_not_converged("PathCond", name, result.sweeps)
    shift = n * log_top  # F of the true g: F(g / max g) + n log max g
    return PathCondReport(
        model=name, solver=solver, units=len(units), params=n,
        objective_before=result.f_initial + shift, objective_after=result.f_final + shift,
        sweeps=result.sweeps, converged=result.converged, max_abs_log_scale=result.max_abs_z,
        log_spread_before=spreads[0], log_spread_after=spreads[1],
        divergence_before=divergence[0], divergence_after=divergence[1],
        degenerate_units=units.names_of(result.degenerate),
        gradient_max=result.grad_max, gradient_relative=result.grad_rel,
        seconds=time.perf_counter() - start, written=commit is not None,
        history=tuple(float(f) + shift for f in result.history), timings=timings, z=result.z,
        max_log_scale=float(max_log_scale), units_at_bound=_at_bound(units, result, max_log_scale),
    )


def _at_bound(units, result, bound: float) -> Sequence[str]:
    if not math.isfinite(bound):
        return ()
    live = np.ones(result.z.size, dtype=bool)
    live[result.degenerate] = False
    return units.names_of(np.flatnonzero(live & (np.abs(result.z) >= bound * (1 - 1e-12))))
