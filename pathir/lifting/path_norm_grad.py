"""The gradient of the path-norm ‖Φ(θ)‖_q with respect to the graph's params, exact in log scale.

With S = Σ_p |Φ_p(θ)|^q and G_i = ∂S/∂u_i, u = |θ|^q (the param grad of the path-norm
network, docs/math.md §3, summed over the uses of a shared param):

    ∂‖Φ‖_q/∂θ_i = sign(θ_i) · |θ_i|^{q−1} · G_i · S^{1/q − 1}

G comes from the log-scaled walk's adjoint as m·e^L (``param_log_parts``, max m = 1 per param), and
S from the same forward walk; |θ_i|^{q−1} is taken relative to the param's largest entry, and the
scales meet in log space last: a derivative overflows only if it does not fit float64 (then
PathNormOverflow); entries below ~1e-308 of their param's largest derivative flush to 0. q ≥ 1: for q < 1 the
derivative is infinite at a zero weight on a path, for q = ∞ the norm is a max (not differentiable
where two paths tie). At θ_i = 0 with q = 1 the value is 0 (the subgradient torch gives |x| at 0);
where S = 0 every derivative is 0 (the norm's minimum).
"""

from __future__ import annotations

import math

import numpy as np

from pathir.backends import get_backend
from pathir.errors import ArgumentError, PathirError, PathNormOverflow
from pathir.ir import Graph
from pathir.lifting.param_grads import param_log_parts
from pathir.lifting.path_norm import check_q

__all__ = ["path_norm_and_grads", "check_differentiable_q"]

_LOG_MAX = math.log(np.finfo(np.float64).max)


def check_differentiable_q(q) -> float:
    """``q`` as a float if the path-norm is differentiable in θ for it (1 ≤ q < ∞), else ArgumentError."""
    q = check_q(q, "path_norm(differentiable=True)")
    if not 1.0 <= q < math.inf:
        raise ArgumentError(f"path_norm(differentiable=True) needs 1 <= q < inf, got q={q:g}: for q < 1 the "
                            "derivative is infinite at a zero weight on a path; for q = inf the norm is a max over "
                            "paths, not differentiable where two paths tie")
    return q


def path_norm_and_grads(graph: Graph, q: float, backend) -> tuple[float, list[np.ndarray]]:
    """(‖Φ(θ)‖_q, [∂‖Φ‖_q/∂θ per param of ``graph.params()``, in its shape]), 1 ≤ q < ∞, from one
    forward and one backward walk (``backend``: a backend or its name). Raises PathNormOverflow where the norm or a derivative exceeds float64."""
    q = check_differentiable_q(q)
    totals: dict = {}
    parts = param_log_parts(graph, get_backend(backend), q, what="the path-norm's gradient", totals=totals)
    log_s = totals["log_path_sum"]
    if log_s / q > _LOG_MAX:
        raise PathNormOverflow(f"the l{q:g} path-norm is about 10^{log_s / q / math.log(10):.1f}, beyond float64")
    params = graph.params()
    if log_s == -math.inf:  # every path is 0: the minimum of the norm
        return 0.0, [np.zeros(p.shape) for p in params]
    grads = []
    for p, (m, L) in zip(params, parts):
        if L == -math.inf:
            grads.append(np.zeros(p.shape))
            continue
        grads.append(_entries(p, m, L + (1.0 / q - 1.0) * log_s, q))
    return math.exp(log_s / q), grads


def _entries(p, m: np.ndarray, shift: float, q: float) -> np.ndarray:
    """sign(θ) · m · |θ|^{q−1} · e^{shift}, with |θ| taken relative to its largest entry M (so no
    power over- or underflows before the scales meet: e^{shift + (q−1) log M} is applied last)."""
    theta = p.value
    d = m if m.flags.writeable else m.copy()
    if q != 1.0:
        top = float(np.abs(theta).max(initial=0.0))
        if top == 0.0:
            return np.zeros(p.shape)
        a = np.abs(theta) / top
        if q != 2.0:
            np.power(a, q - 1.0, out=a)
        d *= a
        shift += (q - 1.0) * math.log(top)
    peak = float(d.max(initial=0.0))
    if not math.isfinite(peak):
        raise PathirError(f"the path-norm's gradient by param '{p.name}' is not finite (NaN or inf weights?)")
    if peak == 0.0:
        return np.zeros(p.shape)
    if shift + math.log(peak) > _LOG_MAX:
        raise PathNormOverflow(f"the derivative of the l{q:g} path-norm by param '{p.name}' reaches about "
                               f"10^{(shift + math.log(peak)) / math.log(10):.1f}, beyond float64")
    d *= 1.0 / peak
    d *= math.exp(shift + math.log(peak))
    d *= np.sign(theta)
    return d
