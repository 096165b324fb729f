"""Log-space helpers of the rescaling solvers: a validated vector of non-negative weights
(diag G, masses), log with log 0 = -inf, and a log-sum-exp that never overflows."""

from __future__ import annotations

import math

import numpy as np

from pathir.errors import ArgumentError

__all__ = ["as_g", "log0", "logsumexp"]


def as_g(g, n: int | None = None) -> np.ndarray:
    g = np.asarray(g, dtype=np.float64)
    if g.ndim != 1:
        raise ArgumentError(f"g must be a vector, got shape {g.shape}")
    if n is not None and g.size != n:
        raise ArgumentError(f"g has {g.size} entries but B has {n} rows")
    if g.size and not (g.min() >= 0 and g.max() < math.inf):  # NaN fails both
        raise ArgumentError("g must be finite and non-negative")
    return g


def log0(x: np.ndarray) -> np.ndarray:
    """log x with log 0 = -inf and no warning."""
    with np.errstate(divide="ignore"):
        return np.log(x)


def logsumexp(v: np.ndarray) -> float:
    top = float(np.max(v))
    if top == -math.inf:
        return -math.inf
    return top + math.log(float(np.sum(np.exp(v - top))))
