"""What an ENorm solver returns (``pathir.enorm.solver``, ``pathir.enorm.newton``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pathir.pairs.log_space import as_g

__all__ = ["ENormResult", "masses", "at_bound"]


@dataclass(frozen=True)
class ENormResult:
    """What an ENorm solver returns: ``z`` (H,), E(0) and E(z), ``history[k]`` = E after sweep k,
    ``imbalance`` = max over the non-degenerate units of |log(O_h / I_h)| at z (0 at the unbounded
    fixed point), ``step`` = the largest exact update of a unit clamped to the box (the stopping rule:
    converged iff ``step`` ≤ tol), ``at_bound`` the units with |z_h| = max_log_scale."""

    z: np.ndarray
    e_initial: float
    e_final: float
    sweeps: int
    converged: bool
    degenerate: np.ndarray
    seconds: float
    history: np.ndarray
    imbalance: float
    method: str
    at_bound: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    step: float = math.nan


def masses(w, c, n) -> np.ndarray:
    """c ⊙ w as float64 (w alone where c is None)."""
    w = as_g(w, n)
    if c is None:
        return w
    return w * as_g(c, n)


def at_bound(z: np.ndarray, bound: float | None) -> np.ndarray:
    """The units with |z_h| at ``bound`` (none when unbounded)."""
    if bound is None:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.abs(z) >= bound * (1.0 - 1e-12))
