"""ENorm and the canonical representative on a compiled model (docs/math.md §8).

ENorm (Stock et al. 2019) minimises the ℓ_p norm of the rescaled parameters,

    E_p(z) = Σ_i c_i |θ_i|^p e^{-p (Bz)_i / 2}        (θ ← θ ⊙ e^{-Bz/2}),

which is the array solver's criterion Σ c_i w_i e^{-(Bz')_i} with w = |θ|^p and
z' = p z / 2 (``pathir.enorm.solver``); p = 2 is docs/math.md's w = θ². E_p is
convex and every sweep lowers it. Normalisation gives each unit's incoming
weights and bias unit ℓ_p norm (``pathir.passes.normalize``). Both rescale
the model in place through write-back (``pathir.rescaling.commit``), function
preserved; units with an empty side (dead neurons) keep z = 0 and are listed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from pathir.analyses.incidence import ParamLayout, compact_rows
from pathir.enorm.newton import solve_enorm_newton
from pathir.enorm.normalize import check_p, normalize_log_scales
from pathir.enorm.solver import solve_enorm
from pathir.errors import ArgumentError, ArgumentKeyError, PathirError
from pathir.pairs.param_pairs import pairs_from_params
from pathir.support.progress import Phases, chain_callbacks, warn_not_converged

__all__ = ["ENormReport", "NormalizeReport", "enorm", "normalize_units", "PHASES"]

#: the phases of the progress bars of :func:`enorm` and :func:`normalize_units`
PHASES = ("units", "solve", "write")


def _table(rows) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _names(names) -> str:
    shown = ", ".join(names[:4])
    more = f", ... ({len(names) - 4} more)" if len(names) > 4 else ""
    return f"{len(names)}" + (f": {shown}{more}" if shown else "")


@dataclass(frozen=True, eq=False)
class ENormReport:
    """What ``cm.enorm()`` did: the criterion E_p before and after (``history[k]``
    after sweep k), the largest remaining log-imbalance |log(O_h / I_h)| of a
    unit (0 at the fixed point), max |z|, degenerate units by name, time.
    With ``max_log_scale`` L set: the units whose |z_h| ends at L (``units_at_bound``,
    by name; the unconstrained optimum was cut there) and ``step``, the largest exact
    update of a unit clamped to the box (the stopping rule: converged iff ≤ tol)."""

    model: str
    p: float
    solver: str
    units: int
    params: int
    criterion_before: float
    criterion_after: float
    sweeps: int
    converged: bool
    imbalance: float
    max_abs_log_scale: float
    degenerate_units: Sequence[str]  # a UnitNames: named when first read
    seconds: float
    written: bool
    history: tuple[float, ...] = ()
    z: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    max_log_scale: float | None = None
    units_at_bound: Sequence[str] = ()  # a UnitNames: named when first read
    step: float = float("nan")

    def to_dict(self, z: bool = False) -> dict:
        out = {k: getattr(self, k) for k in (
            "model", "p", "solver", "units", "params", "criterion_before", "criterion_after", "sweeps",
            "converged", "imbalance", "max_abs_log_scale", "seconds", "written", "max_log_scale", "step")}
        out["degenerate_units"] = list(self.degenerate_units)
        out["units_at_bound"] = list(self.units_at_bound)
        out["history"] = list(self.history)
        if z:
            out["z"] = self.z.tolist()
        return out

    def __str__(self) -> str:
        return _table([
            ("model", f"{self.model}  (ENorm, p = {self.p:g}, {self.solver} solver)"),
            ("units / parameters", f"{self.units:,} / {self.params:,}"),
            (f"Σ c |θ|^{self.p:g}", f"{self.criterion_before:.10g} -> {self.criterion_after:.10g}"),
            ("sweeps", f"{self.sweeps} ({'converged' if self.converged else 'NOT converged'})"),
            ("max unit imbalance", f"{self.imbalance:.2e}"),
            ("max |z|", f"{self.max_abs_log_scale:.4g}" + (
                "" if self.max_log_scale is None else f" (bound {self.max_log_scale:.4g})")),
        ] + ([] if self.max_log_scale is None else [
            ("units at the bound", _names(self.units_at_bound) + (
                " (the unbounded optimum was cut there)" if self.units_at_bound else "")),
        ]) + [
            ("degenerate units", _names(self.degenerate_units)),
            ("model rescaled", "yes" if self.written else "no (report only)"),
            ("time", f"{self.seconds:.2f} s"),
        ])


@dataclass(frozen=True, eq=False)
class NormalizeReport:
    """What ``cm.normalize()`` did: units normalised, cycles of units solved jointly,
    degenerate (dead) units left alone, max |z|, time."""

    model: str
    p: float
    units: int
    cycles: int
    max_abs_log_scale: float
    degenerate_units: Sequence[str]  # a UnitNames: named when first read
    seconds: float
    written: bool
    z: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)

    def to_dict(self, z: bool = False) -> dict:
        keys = ("model", "p", "units", "cycles", "max_abs_log_scale", "seconds", "written")
        out = {k: getattr(self, k) for k in keys}
        out["degenerate_units"] = list(self.degenerate_units)
        if z:
            out["z"] = self.z.tolist()
        return out

    def __str__(self) -> str:
        return _table([
            ("model", f"{self.model}  (normalised, l{self.p:g})"),
            ("units", f"{self.units:,} ({self.cycles} cycles of units solved jointly)"),
            ("max |z|", f"{self.max_abs_log_scale:.4g}"),
            ("degenerate units", _names(self.degenerate_units)),
            ("model rescaled", "yes" if self.written else "no (report only)"),
            ("time", f"{self.seconds:.2f} s"),
        ])


def _costs(costs, layout) -> np.ndarray | None:
    """None, an (n,) array in θ order, or {param or source name: scalar or array of its shape}; every entry
    finite and ≥ 0 (ArgumentError naming the costs otherwise)."""
    if costs is None:
        return None
    if not isinstance(costs, dict):
        c = np.asarray(costs, dtype=np.float64)
        if c.shape != (len(layout),):
            raise ArgumentError(f"costs must have one entry per parameter, shape ({len(layout)},); got {c.shape}")
        return _checked_costs(c)
    c = np.ones(len(layout))
    names = {p.name: p for p in layout.params}
    names.update({p.source_name: p for p in layout.params if p.source_name not in names})
    for key, value in costs.items():
        if key not in names:
            raise ArgumentKeyError(f"costs name '{key}', which is no parameter of the graph")
        p = names[key]
        c[layout.slice(p)] = np.broadcast_to(np.asarray(value, dtype=np.float64), p.shape).ravel()
    return _checked_costs(c)


def _checked_costs(c: np.ndarray) -> np.ndarray:
    if not np.all(np.isfinite(c) & (c >= 0)):
        raise ArgumentError(f"costs must be finite and non-negative, got {c[~(np.isfinite(c) & (c >= 0))][:3].tolist()}")
    return c


def _powers(layout, p: float) -> np.ndarray:
    """|θ|^p, flat in ``layout`` order, filled param by param (no flat θ beside it); refused
    (PathirError) where an entry is not finite."""
    w = np.empty(len(layout))
    for param, start in zip(layout.params, layout.offsets.tolist()):
        part = w[start:start + param.size].reshape(param.shape)
        np.abs(param.value, out=part)
        part **= p  # as `abs(θ) ** p` computes it (p = 2: a square)
        if not np.all(np.isfinite(part)):
            raise PathirError(f"|θ|^{p:g} is not finite (huge or non-finite weights in '{param.name}'): "
                              "ENorm cannot be computed")
    return w


def _check_underflow(units, degenerate, p: float, c=None, layout=None) -> None:
    """PathirError where a unit the solver took for degenerate (no mass on one side) has a nonzero weight of
    nonzero cost (``c`` in ``layout``'s θ order; None: all ones) on both: its |θ|^p underflowed float64 (a layer
    at 1e-170, p = 2), and it would be left alone unbalanced. A side whose costs are all 0 is degenerate as meant."""
    H = len(units)
    has_in, has_out = np.zeros(H + 1, dtype=bool), np.zeros(H + 1, dtype=bool)
    for prm, (enter, leave) in zip(units.params, compact_rows(units)):
        nonzero = np.asarray(prm.value) != 0
        if c is not None:
            nonzero = nonzero & (c[layout.slice(prm)].reshape(nonzero.shape) != 0)
        for ends, seen in ((enter, has_in), (leave, has_out)):
            ends = ends.reshape((1,) * (nonzero.ndim - ends.ndim) + ends.shape)
            seen[np.broadcast_to(ends, nonzero.shape)[nonzero]] = True
    live = [h for h in np.asarray(degenerate).tolist() if has_in[h] and has_out[h]]
    if live:
        raise PathirError(f"ENorm: |θ|^{p:g} underflows float64 for all the weights on one side of {len(live)} units "
                          f"(the first: {units.names_of(live[:1])[0]}), which would be taken for dead units and left "
                          "alone; use a smaller p (p=1 keeps |θ| itself), or rescale the model into range first. "
                          "Nothing was changed")


def enorm(facts, p: float = 2.0, max_sweeps: int = 1000, tol: float = 1e-10, costs=None, solver: str = "newton",
          commit=None, name: str = "", max_log_scale: float | None = None, callback=None,
          progress: bool | None = None) -> ENormReport:
    """ENorm: minimise E_p(z) = Σ c_i |θ_i|^p e^{-p(Bz)_i/2} over the rescalings of ``facts.graph``.

    Parameters
    ----------
    facts : GraphFacts of the graph (``pathir.analyses.facts``)
    p : the norm's exponent (> 0); p = 2 is Stock et al.'s default.
    max_sweeps, tol : passed to ``pathir.enorm.solver.solve_enorm``; stopping at ``max_sweeps``
        before the stopping rule holds warns (``pathir.NotConvergedWarning``).
    costs : per-parameter weights c (Stock et al. weigh layers by depth): None
        (all ones), an (n,) array in θ order, or {param name: scalar or array}.
    solver : "newton" (projected Newton-CG, the default), or the reference "block" / "coordinate".
    max_log_scale : None (unbounded) or L ≥ 0: every unit's log-scale z_h (in the model's
        θ ← θ e^{-(Bz)_i/2} convention) stays within [-L, L]; the report names the units at L.
    callback : called as ``callback(sweep, E_p)`` after each sweep (Newton: iteration).
    commit : called with the minimiser z (``Compiled.commit_rescaling``); None: only report.
    name : the model's name, for the report.
    progress : a bar on stderr over the phases units, solve, write (``pathir.support.progress``; None: only
        when stderr is a terminal). Not converging within ``max_sweeps`` warns.

    Examples
    --------
    >>> import torch, pathir
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> x = torch.randn(5, 3)
    >>> before = net(x)
    >>> report = pathir.compile(net, input_shape=(3,)).enorm()
    >>> report.criterion_after < report.criterion_before
    True
    >>> bool(torch.allclose(net(x), before, atol=1e-6))
    True
    """

    check_p(p)
    start = time.perf_counter()
    bar = Phases(PHASES if commit is not None else PHASES[:-1], desc=f"ENorm {name}".strip(), progress=progress,
                 value_name=f"Σ|θ|^{p:g}")
    bar.phase("units")
    units = facts.units
    if solver == "newton" and "incidence" not in facts.built():
        # Newton reads B through the units' compact row ends only: building B would be wasted work

        B, layout = None, ParamLayout(tuple(units.params))
    else:
        B, layout = facts.incidence
    c = _costs(costs, layout)
    # Newton reads the masses only grouped by unit pair: summed param by param (no flat θ, no row keys)
    pairs = pairs_from_params(units, p, c) if solver == "newton" else None
    bar.phase("solve")
    # the solver's z' = p z / 2: its box is |z'| ≤ p L / 2
    bound = None if max_log_scale is None else 0.5 * p * float(max_log_scale)
    if pairs is not None:
        result = solve_enorm_newton(None, None, max_sweeps=max_sweeps, tol=tol, max_log_scale=bound,
                                    callback=chain_callbacks(callback, bar.callback), pairs=pairs)
        del pairs  # (a key and a mass per unit pair: two copies of θ on a dense model, freed before the write)
    else:
        w = _powers(layout, p)
        # without B, the rows as the units' compact ends (no int64 key per row)
        rows = facts.row_ends if B is None else facts.row_keys
        result = solve_enorm(w, B, c, method=solver, max_sweeps=max_sweeps, tol=tol, row_key=rows,
                             max_log_scale=bound, callback=chain_callbacks(callback, bar.callback))
        del w  # one copy of θ: freed before the write-back
    if len(result.degenerate):
        _check_underflow(units, result.degenerate, p, c, layout)
    del c
    z = 2.0 * result.z / p
    if max_log_scale is not None:
        z = np.clip(z, -max_log_scale, max_log_scale)  # rounding of 2 (p L / 2) / p
    if commit is not None:
        bar.phase("write")
        commit(z)
    bar.close()
    if not result.converged:
        warn_not_converged(f"ENorm ({solver})", name, result.sweeps,
                           hint=f"largest remaining unit step {result.step:.2e} > tol {tol:g}; raise max_sweeps")
    return ENormReport(
        model=name, p=float(p), solver=solver, units=len(units), params=len(layout),
        criterion_before=result.e_initial, criterion_after=result.e_final, sweeps=result.sweeps,
        converged=result.converged, imbalance=result.imbalance,
        max_abs_log_scale=float(np.abs(z).max(initial=0.0)),
        degenerate_units=units.names_of(result.degenerate),
        seconds=time.perf_counter() - start, written=commit is not None,
        history=tuple(float(e) for e in result.history), z=z,
        max_log_scale=None if max_log_scale is None else float(max_log_scale),
        units_at_bound=units.names_of(result.at_bound), step=result.step,
    )


def normalize_units(facts, p: float = 2.0, commit=None, name: str = "", progress: bool | None = None) -> NormalizeReport:
    """The rescaling to the canonical representative of ``facts.graph``'s orbit: every
    unit's incoming weights and bias get unit ℓ_p norm (``pathir.passes.normalize``);
    ``commit(z)`` applies it (``Compiled.commit_rescaling``), None only reports.

    Raises PathirError (model untouched) where a cycle of units admits no
    normalisation (a residual stream whose blocks carry too much ℓ_p mass).

    >>> import torch, pathir
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> report = pathir.compile(net, input_shape=(3,)).normalize(p=2)
    >>> [round(v, 6) for v in torch.cat([net[0].weight, net[0].bias[:, None]], 1).norm(dim=1).tolist()]
    [1.0, 1.0, 1.0, 1.0]
    """

    start = time.perf_counter()
    bar = Phases(PHASES if commit is not None else PHASES[:-1], desc=f"normalize {name}".strip(), progress=progress)
    bar.phase("units")
    units = facts.units
    bar.phase("solve")
    result = normalize_log_scales(facts.graph, units, p)
    if commit is not None:
        bar.phase("write")
        commit(result.z)
    bar.close()
    return NormalizeReport(
        model=name, p=float(p), units=len(units), cycles=result.cycles,
        max_abs_log_scale=float(np.abs(result.z).max(initial=0.0)),
        degenerate_units=units.names_of(result.degenerate),
        seconds=time.perf_counter() - start, written=commit is not None, z=result.z,
    )
