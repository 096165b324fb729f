"""normalize's forward substitution param by param, on feed-forward unit graphs (docs/math.md §8).

With u = e^{-y}, the canonical representative has u_h = Σ_{i ∈ in_h} |θ_i|^p u_src(i)
(u = 1 for no source unit): `pathir.passes.normalize`. When, in the order of the
params, each param's left units are final (no later param enters them), the
units need no graph: each param adds Σ |θ_i|^p u_l(i) to the units it enters. A
dense or convolution weight or a bias (`separable_layout`) does so as one
mat-vec per block of rows, A u with A its masses summed over its kernel axes
and over each run of equal left units, as a float64 forward pass of the model
would; any other param (a per-channel scale) entry by entry. That replaces the
unit pairs' keys, their sort and a level-by-level gather.

A row's sum is taken in the linear domain, with u scaled so that its largest
value is 1, wherever it is exact to rounding: every scaled u_j normal and the
row's sum at least 1e-280 (lost terms then weigh below 1e-30 of it) and finite;
any other row is summed in log space. The result is the same log u as the
general solver's up to rounding.
"""

from __future__ import annotations

import numpy as np

from pathir.analyses.incidence import compact_rows
from pathir.pairs.param_pairs import masses, row_blocks, separable_layout, unit_column_blocks

__all__ = ["feedforward_log_u"]

#: a linear row sum at least this large lost nothing to underflow that matters (module docstring)
_TINY = 1e-280
#: scaled u_j stay normal floats (with margin) when log u spans at most this many nats
_SPAN = 700.0


def feedforward_log_u(params, units, p: float):
    """(log u, degenerate units) of the module docstring for ``params`` (a graph's, in the order of
    ``units.params``, which may hold another graph's values), None where the params' order is not a
    feed-forward one for the units, a mass is not finite, or a sum of an entry-by-entry param lost
    terms to the float range (the caller then runs the general solver). Degenerate units (no nonzero
    incoming mass) get log u = 0."""

    H = len(units)
    ends = compact_rows(units)
    entered = [np.unique(np.asarray(e)[np.asarray(e) < H]) for e, _ in ends]
    pending = np.bincount(np.concatenate(entered), minlength=H + 1) if entered else np.zeros(H + 1, np.int64)
    log_in = np.full(H + 1, -np.inf)
    log_u = np.zeros(H + 1)  # u = 1 for "no unit" and, until they are final, for every unit
    for prm, (enter, leave), hit in zip(params, ends, entered):
        if hit.size == 0:
            continue
        left = np.asarray(leave)
        if np.any(pending[left[left < H]]):
            return None  # a left unit still has a param to come: not feed-forward in this order
        layout = separable_layout(prm.shape, enter, leave)
        if layout is None:
            sums = _entry_log_sums(prm.value, enter, leave, log_u, p, hit)
        else:
            e_rows, starts, cols = layout
            rows = np.flatnonzero(e_rows < H)
            sums = _row_log_sums(prm.value, starts, log_u[cols], p, e_rows < H)
            sums = None if sums is None else (e_rows[rows], sums[rows])
        if sums is None:
            return None
        np.logaddexp.at(log_in, *sums)
        pending[hit] -= 1
        final = hit[pending[hit] == 0]
        log_u[final] = np.where(np.isfinite(log_in[final]), log_in[final], 0.0)
    degenerate = np.flatnonzero(~np.isfinite(log_in[:H]))
    return log_u[:H], degenerate


def _entry_log_sums(value: np.ndarray, enter, leave, log_u: np.ndarray, p: float, hit: np.ndarray):
    """(units ``hit``, log Σ |θ_i|^p u_l(i) over the entries entering each) of any param, entry by entry
    in the linear domain; None where that could lose terms (module docstring) or a mass is not finite."""
    H = log_u.size - 1
    left = np.unique(np.asarray(leave))
    shift = float(log_u[left].max())
    if float(log_u[left].min()) < shift - _SPAN:
        return None
    u = np.exp(log_u - shift)
    total, count = np.zeros(H + 1), np.zeros(H + 1, np.int64)
    for _, v, e, l in row_blocks(value, enter, leave):
        w = masses(v, p)
        if not np.all(np.isfinite(w)):
            return None
        total += np.bincount(e, weights=w * u[l], minlength=H + 1)
        count += np.bincount(e, weights=w > 0, minlength=H + 1).astype(np.int64)
    total, count = total[hit], count[hit]
    if not np.all(((total >= _TINY) & np.isfinite(total)) | (count == 0)):
        return None
    with np.errstate(divide="ignore"):
        return hit, np.where(count > 0, shift + np.log(total), -np.inf)


def _row_log_sums(value: np.ndarray, starts: np.ndarray, log_u_cols: np.ndarray, p: float, wanted: np.ndarray):
    """log Σ_j A_rj e^{log_u_cols[j]} for every row r of a separable param (-inf for a row of zeros;
    rows not ``wanted`` may be left at -inf), a block of rows at a time; None if a mass is not finite."""
    out = np.full(value.shape[0], -np.inf)
    shift = float(log_u_cols.max())
    linear = float(log_u_cols.min()) >= shift - _SPAN
    u = np.exp(log_u_cols - shift)
    for rows, A in unit_column_blocks(value, starts, p, wanted=wanted):
        if not np.all(np.isfinite(A)):
            return None
        part = out[rows]
        if linear:
            total = A @ u
            good = (total >= _TINY) & np.isfinite(total)
            with np.errstate(divide="ignore"):
                part[good] = shift + np.log(total[good])
            redo = np.flatnonzero(~good)
        else:
            redo = np.arange(A.shape[0])
        if redo.size:
            part[redo] = _log_rows(A[redo], log_u_cols)
    return out


def _log_rows(A: np.ndarray, log_u: np.ndarray) -> np.ndarray:
    """log Σ_j A_rj e^{log_u[j]} per row, in log space (A ≥ 0; -inf for a row of zeros)."""
    from scipy.special import logsumexp

    with np.errstate(divide="ignore"):
        return logsumexp(np.log(A) + log_u[None, :], axis=1)
