"""The PathCond objective (docs/math.md §7) on arrays, and the result its solvers return.

With g = diag G (n,) and the unit incidence matrix B (n x H),

    F(z) = n log Σ_i g_i e^{(Bz)_i} - Σ_i (Bz)_i,        ∇F(z) = n Bᵀp - Bᵀ1,  p = g e^{Bz} / S

F is convex and constant along {d : Bd ∈ span(1)}. Rescaling by z multiplies
θ_i by e^{-(Bz)_i/2} and g_i by e^{(Bz)_i}. Everything is computed from log g,
so g may span the whole float64 range.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import scipy.sparse as sp

from pathir.analyses.unit_rows import CompactRows, row_shifts
from pathir.pairs.log_space import as_g, log0, logsumexp

__all__ = [
    "objective", "gradient", "rescaled_log_g", "log_spread", "log_spreads", "spread_ends", "PathCondResult",
    "log_positive_root", "as_g", "log0", "logsumexp",
]


def rescaled_log_g(g, B, z) -> np.ndarray:
    """log(g ⊙ e^{Bz}), -inf where g_i = 0."""
    B = sp.csr_array(B)
    return log0(as_g(g, B.shape[0])) + B @ np.asarray(z, dtype=np.float64)


def objective(g, B, z) -> float:
    """F(z) = n log Σ_i g_i e^{(Bz)_i} - Σ_i (Bz)_i.

    >>> import numpy as np, scipy.sparse as sp
    >>> B = sp.csr_array(np.array([[-1.], [1.]]))   # one unit: one weight in, one out
    >>> g = np.array([1.0, 4.0])
    >>> print(f"{objective(g, B, [0.0]):.6f} {2 * np.log(5.0):.6f}")
    3.218876 3.218876
    >>> print(f"{objective(g, B, [-np.log(2)]):.6f} {2 * np.log(4.0):.6f}")   # balanced: the minimum
    2.772589 2.772589
    """
    B = sp.csr_array(B)
    bz = B @ np.asarray(z, dtype=np.float64)
    return B.shape[0] * logsumexp(log0(as_g(g, B.shape[0])) + bz) - float(bz.sum())


def gradient(g, B, z) -> np.ndarray:
    """∇F(z) = n Bᵀp - Bᵀ1 with p_i = g_i e^{(Bz)_i} / Σ_j g_j e^{(Bz)_j}.

    >>> import numpy as np, scipy.sparse as sp
    >>> B = sp.csr_array(np.array([[-1.], [1.]]))
    >>> np.allclose(gradient([1.0, 4.0], B, [-np.log(2)]), 0)
    True
    """
    B = sp.csr_array(B)
    ell = log0(as_g(g, B.shape[0])) + B @ np.asarray(z, dtype=np.float64)
    p = np.exp(ell - logsumexp(ell))
    return B.shape[0] * (B.T @ p) - B.T @ np.ones(B.shape[0])


def log_spread(log_g: np.ndarray) -> float:
    """max(log g) - min(log g) over the entries with g > 0 (natural log)."""
    low = float(log_g.min(initial=math.inf))
    if low == -math.inf:
        log_g = log_g[np.isfinite(log_g)]
        low = float(log_g.min(initial=math.inf))
    return float(log_g.max() - low) if log_g.size else 0.0


def log_positive_root(A, log_r, alpha, gamma):
    """log y for the positive root y of  alpha y² + A r y - gamma = 0  (alpha, gamma > 0), given log r.

    Written so that nothing overflows or cancels: for A >= 0 the root is
    2 gamma / (A r + sqrt(A² r² + 4 alpha gamma)), for A < 0 it is
    (|A| r + sqrt(A² r² + 4 alpha gamma)) / (2 alpha). Works on scalars and arrays.
    """
    A = np.asarray(A, dtype=np.float64)
    q = 4.0 * np.asarray(alpha, dtype=np.float64) * np.asarray(gamma, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_t = np.where(A == 0, -np.inf, np.log(np.abs(A)) + log_r)
    capped = np.minimum(log_t, 300.0)
    t = np.exp(capped)
    big = log_t > 300.0
    # beyond e^300, sqrt(t² + q) = t sqrt(1 + q/t²) keeps t² from overflowing
    log_sum = np.where(big, log_t + np.log1p(np.sqrt(1.0 + q * np.exp(-2.0 * np.maximum(log_t, 300.0)))),
                       np.log(t + np.sqrt(t * t + q)))
    return np.where(A >= 0, np.log(2.0 * gamma) - log_sum, log_sum - np.log(2.0 * alpha))


@dataclass(frozen=True)
class PathCondResult:
    """What a PathCond solver returns.

    ``z`` (H,) are the log-scales (θ_i ← θ_i e^{-(Bz)_i/2}); degenerate units
    keep z = 0. ``history[k]`` is F after sweep k (``history[0]`` = F(0)) and
    ``times[k]`` the seconds elapsed then. ``grad_max`` is max |∂F/∂z_h| and
    ``grad_rel`` the largest relative imbalance |∂F/∂z_h| / (n|B|ᵀp + |Bᵀ1|)_h,
    over the non-degenerate units. ``log_spread_initial`` / ``log_spread_final``
    (the log-spread of g and of g ⊙ e^{Bz}) are computed from ``g`` and ``B``
    on first access: a report, not part of the solve.
    """

    z: np.ndarray
    f_initial: float
    f_final: float
    sweeps: int
    converged: bool
    degenerate: np.ndarray
    seconds: float
    history: np.ndarray
    times: np.ndarray
    grad_max: float
    grad_rel: float
    method: str
    extra: dict = field(default_factory=dict)
    g: np.ndarray | None = field(default=None, repr=False, compare=False)
    B: sp.csr_array | None = field(default=None, repr=False, compare=False)
    key: np.ndarray | None = field(default=None, repr=False, compare=False)  # B's row keys, where B was not given

    @cached_property
    def bz_log_spreads(self) -> tuple[float, float]:
        if self.g is None or (self.B is None and self.key is None):
            return math.nan, math.nan
        if self.B is None:
            return _key_spreads(self.g, self.key, self.z)
        return bz_log_spreads(self.g, self.B, self.z)

    @property
    def log_spread_initial(self) -> float:
        return self.bz_log_spreads[0]

    @property
    def log_spread_final(self) -> float:
        return self.bz_log_spreads[1]

    @property
    def max_abs_z(self) -> float:
        return float(np.max(np.abs(self.z))) if self.z.size else 0.0

    def to_dict(self) -> dict:
        """The PathCond report of docs/math.md §7, JSON-ready."""
        return {
            "method": self.method, "f_initial": self.f_initial, "f_final": self.f_final,
            "sweeps": self.sweeps, "converged": self.converged, "max_abs_z": self.max_abs_z,
            "log_spread_initial": self.log_spread_initial, "log_spread_final": self.log_spread_final,
            "grad_max": self.grad_max, "grad_rel": self.grad_rel, "seconds": self.seconds,
            "degenerate": [int(h) for h in self.degenerate],
        }


def row_state(g: np.ndarray, B: sp.csr_array, A: np.ndarray, z: np.ndarray):
    """(F(0), F(z), ∇F(z), its scale n|B|ᵀp + |A|) from the rows of (g, B); ``A`` = -Bᵀ1."""
    n = g.size
    log_g = log0(g)
    ell = log_g + B @ z
    top = float(ell.max())
    e = np.exp(ell - top)
    total = float(e.sum())
    p = e / total
    return (n * logsumexp(log_g), n * (top + math.log(total)) + float(A @ z),
            n * (B.T @ p) + A, n * (abs(B).T @ p) + np.abs(A))


def spread_ends(g: np.ndarray, up, down=0.0) -> tuple[float, float, float, float] | None:
    """(min, max) of log g and of log g + up − down, over the entries g > 0 (None if there are none).

    ``up`` and ``down`` broadcast against g (compact per-parameter ends, or a whole B z): the
    exponentials run on them, not on every entry, unless the range forces logs.
    """
    up, down = np.asarray(up, dtype=np.float64), np.asarray(down, dtype=np.float64)
    if not g.min(initial=math.inf) > 0:
        keep = g > 0
        if not keep.any():
            return None
        g, up, down = g[keep], np.broadcast_to(up - down, keep.shape)[keep], np.zeros(())
    if g.size == 0:
        return None
    high_up, low_down = float(up.max()), float(down.min())
    top = high_up - low_down  # >= every up - down, so g e^{up - down - top} <= g cannot overflow
    moved = g * np.exp(up - high_up)
    moved *= np.exp(low_down - down)  # in place: one temporary of g's size
    if float(moved.min()) > 1e-290:
        low, high = math.log(float(moved.min())), math.log(float(moved.max()))
    else:  # beyond float64's normal range: logs
        moved = np.log(g) + ((up - down) - top)
        low, high = float(moved.min()), float(moved.max())
    return math.log(float(g.min())), math.log(float(g.max())), low + top, high + top


def log_spreads(ends) -> tuple[float, float]:
    """(log_spread of g, of g ⊙ e^{Bz}) from the `spread_ends` of the segments of g (None ones skipped)."""
    found = np.array([e for e in ends if e is not None]).reshape(-1, 4)
    if not found.size:
        return 0.0, 0.0
    return float(found[:, 1].max() - found[:, 0].min()), float(found[:, 3].max() - found[:, 2].min())


def bz_log_spreads(g: np.ndarray, B: sp.csr_array, z: np.ndarray) -> tuple[float, float]:
    """log_spread of g and of g e^{Bz}, with B z from B."""
    return log_spreads([spread_ends(g, B @ z)])


def _key_spreads(g: np.ndarray, key: np.ndarray, z: np.ndarray) -> tuple[float, float]:
    """`bz_log_spreads` with B z read from the row keys, a chunk of rows at a time (B never built)."""

    shifts = key.shifts(z) if isinstance(key, CompactRows) else row_shifts(key, z)
    return log_spreads(spread_ends(g[start:start + bz.size], bz) for start, bz in shifts)


def finish(g: np.ndarray, B: sp.csr_array | None, z: np.ndarray, state, *, method: str, sweeps: int,
           converged: bool, degenerate: np.ndarray, start: float, history: list, times: list,
           extra=None, key: np.ndarray | None = None, bound: float = math.inf) -> PathCondResult:
    """Assemble a result from ``state`` = (F(0), F(z), ∇F(z), gradient scale) (`row_state`, or a
    solver's own); the log-spreads of g are left to the result's first access (from B, or from
    the row ``key`` where the solver had no B). With a finite ``bound`` on |z_h|, the gradient reported is
    the projected one: a unit held at the bound by a gradient pushing outward counts as balanced."""
    f0, f1, grad, scale = state
    if bound < math.inf:
        grad = np.where(((z <= -bound) & (grad > 0)) | ((z >= bound) & (grad < 0)), 0.0, grad)
    live = np.ones(z.size, dtype=bool)
    live[degenerate] = False
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(scale > 0, np.abs(grad) / scale, 0.0)
    history = list(history)
    if history:
        history[0], history[-1] = f0, f1
    return PathCondResult(
        z=z, f_initial=f0, f_final=f1, sweeps=sweeps, converged=converged,
        degenerate=np.asarray(degenerate, dtype=np.int64), seconds=time.perf_counter() - start,
        history=np.asarray(history, dtype=np.float64), times=np.asarray(times, dtype=np.float64),
        grad_max=float(np.max(np.abs(grad[live]), initial=0.0)), grad_rel=float(np.max(rel[live], initial=0.0)),
        method=method, extra=dict(extra or {}), g=g, B=B, key=key if B is None else None,
    )
