"""The gradient of the path-norm ‖Φ(θ)‖_q with respect to the graph's params, exact in log scale.

With S = Σ_p |Φ_p(θ)|^q and G_i = ∂S/∂u_i, u = |θ|^q (the param grad of the path-norm
network, docs/math.md §3, summed over the uses of a shared param):

    ∂‖Φ‖_q/∂θ_i = sign(θ_i) · |θ_i|^{q−1} · G_i · S^{1/q − 1}

G comes from the log-scaled walk's adjoint as m·e^L (``param_log_parts``), and S from the same
forward walk, so every factor is combined in log space, entry by entry: an entry overflows only if
the derivative itself does not fit float64 (then PathNormOverflow). q ≥ 1: for q < 1 the
derivative is infinite at a zero weight on a path, for q = ∞ the norm is a max (not differentiable
where two paths tie). At θ_i = 0 with q = 1 the value is 0 (the subgradient torch gives |x| at 0);
where S = 0 every derivative is 0 (the norm's minimum).
"""

from __future__ import annotations

import math

import numpy as np

from pathir.errors import ArgumentError, PathNormOverflow
from pathir.ir import Graph
from pathir.lifting.path_norm import check_q
from pathir.lifting.walk import param_log_parts

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
    forward and one backward walk. Raises PathNormOverflow where the norm or a derivative exceeds float64."""
    q = check_differentiable_q(q)
    totals: dict = {}
    parts = param_log_parts(graph, backend, q, what="the path-norm's gradient", totals=totals)
    log_s = totals["log_path_sum"]
    if log_s / q > _LOG_MAX:
        raise PathNormOverflow(f"the l{q:g} path-norm is about 10^{log_s / q / math.log(10):.1f}, beyond float64")
    params = graph.params()
    if log_s == -math.inf:  # every path is 0: the minimum of the norm
        return 0.0, [np.zeros(p.shape) for p in params]
    grads = []
    for p, (m, L) in zip(params, parts):
        theta = p.value
        if L == -math.inf:
            grads.append(np.zeros(p.shape))
            continue
        with np.errstate(divide="ignore"):
            logs = np.log(m)
            if q != 1.0:
                logs += (q - 1.0) * np.log(np.abs(theta))
        shift = L + (1.0 / q - 1.0) * log_s
        top = float(logs.max(initial=-math.inf)) + shift
        if top > _LOG_MAX:
            raise PathNormOverflow(f"the derivative of the l{q:g} path-norm by param '{p.name}' reaches about "
                                   f"10^{top / math.log(10):.1f}, beyond float64")
        logs += shift
        grads.append(np.sign(theta) * np.exp(logs, out=logs))
    return math.exp(log_s / q), grads
