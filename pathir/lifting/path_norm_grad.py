"""The gradient of the path-norm ‖Φ(θ)‖_q with respect to the graph's params, exact in log scale.

With S = Σ_p |Φ_p(θ)|^q and G_i = ∂S/∂u_i, u = |θ|^q (the param grad of the path-norm
network, docs/math.md §3, summed over the uses of a shared param):

    ∂‖Φ‖_q/∂θ_i = sign(θ_i) · |θ_i|^{q−1} · G_i · S^{1/q − 1}

G comes from the log-scaled walks (``param_grads``: one log-scale per param, per channel or per
entry) and S from the same forward walk. Each entry is assembled as a mantissa times a power of two
of its own: G_i, |θ_i| = f·2^e and S^{1/q−1} keep their exponents apart (|θ_i|^{q−1} = f^{q−1}·2^{e(q−1)})
until the one rounding to float64 (``np.ldexp``), so no product under- or overflows on the way,
whatever the representative of θ (a unit rescaled by 1e150 at q = 3, q = 100): an entry is its
derivative to float64 rounding (relative error about ε·|log of its scales|, as the norm's own),
subnormal or 0 only where the derivative itself is below 2.2e-308, and a derivative beyond float64
raises PathNormOverflow. q ≥ 1: for q < 1 the derivative is infinite at a zero weight on a path, for
q = ∞ the norm is a max (not differentiable where two paths tie). At θ_i = 0 the value is 0 (for
q = 1 the subgradient torch gives |x| at 0); where S = 0 every derivative is 0 (the norm's minimum).
"""

from __future__ import annotations

import math

import numpy as np

from pathir.backends import get_backend
from pathir.errors import ArgumentError, PathirError, PathNormOverflow
from pathir.ir import Graph
from pathir.lifting.param_grads import param_grads
from pathir.lifting.path_norm import check_q

__all__ = ["path_norm_and_grads", "check_differentiable_q"]

_LOG_MAX = math.log(np.finfo(np.float64).max)
_LN2 = math.log(2.0)
_TINY = np.finfo(np.float64).tiny
#: entries per block of the one-scale assembly (`_in_one_scale`): its temporaries stay this size
_BLOCK = 1 << 18


#: the largest q whose derivatives are given: an entry's exponent (q − 1)·log|θ_i| + log G_i − (1 − 1/q)·log S is
#: a float64 sum of terms of size q·|log θ|, so its relative error is about ε·q·|log θ| (2e-10·|log θ| here; at
#: q = 1e16 it is wrong by orders of magnitude). Past it ‖Φ‖_q is the largest path's |Φ_p| to within
#: (#paths)^{1/q} (1.00007 for 10^30 paths): not a different norm to train with.
MAX_Q = 1e6


def check_differentiable_q(q) -> float:
    """``q`` as a float if the path-norm's derivatives are given for it (1 ≤ q ≤ ``MAX_Q``), else ArgumentError."""
    q = check_q(q, "path_norm(differentiable=True)")
    if not 1.0 <= q < math.inf:
        raise ArgumentError(f"path_norm(differentiable=True) needs 1 <= q < inf, got q={q!r}: for q < 1 the "
                            "derivative is infinite at a zero weight on a path; for q = inf the norm is a max over "
                            "paths, not differentiable where two paths tie")
    if q > MAX_Q:
        raise ArgumentError(f"path_norm(differentiable=True) needs q <= {MAX_Q:g}, got q={q!r}: its derivatives are "
                            "exponents of size q·|log θ| summed in float64, whose relative error ε·q·|log θ| is no "
                            f"longer small; at q = {MAX_Q:g} the norm already equals the largest path's |Φ_p| to within "
                            "(number of paths)^(1/q)")
    return q


def path_norm_and_grads(graph: Graph, q: float, backend) -> tuple[float, list[np.ndarray]]:
    """(‖Φ(θ)‖_q, [∂‖Φ‖_q/∂θ per param of ``graph.params()``, in its shape]), 1 ≤ q < ∞, from one
    forward and one backward walk (``backend``: a backend or its name). Raises PathNormOverflow where
    the norm or a derivative exceeds float64."""
    q = check_differentiable_q(q)
    backend = get_backend(backend)
    totals: dict = {}
    parts = param_grads(graph, backend, q, totals=totals)
    log_s = totals["log_path_sum"]
    if log_s / q > _LOG_MAX:
        raise PathNormOverflow(f"the l{q:g} path-norm is about 10^{log_s / q / math.log(10):.1f}, beyond float64")
    params = graph.params()
    if log_s == -math.inf:  # every path is 0: the minimum of the norm
        return 0.0, [np.zeros(p.shape) for p in params]
    log_outer = (1.0 / q - 1.0) * log_s  # S^{1/q − 1} = e^{log_outer}
    grads = []
    for p in params:
        uses = parts.pop(id(p))
        d = _in_one_scale(p, uses, log_outer, q, backend)
        if d is None:
            mant, log2 = _binary(p, uses, backend)
            d = _entries(p, mant, log2 + log_outer / _LN2, q)
        grads.append(d)
    return math.exp(log_s / q), grads


def _in_one_scale(p, uses: list, log_outer: float, q: float, backend) -> np.ndarray | None:
    """The derivative by ``p`` with one scale for the whole param, the usual case and the fast one:
    sign(θ) · m · (|θ|/M)^{q−1} · e^{L + log_outer + (q−1) log M}, m = G/max G, M = max |θ|. None where
    that is not exact (several uses, per-channel scales, or an entry of m · (|θ|/M)^{q−1} below float64's
    normal range, as on a rescaled unit): `_binary` and `_entries` answer then, entry by entry. Computed
    ``_BLOCK`` entries at a time into the result: no temporary of the param's size."""
    live = [u for u in uses if u is not None]
    if len(live) != 1 or np.ndim(live[0][1]):
        return np.zeros(p.shape) if not live else None
    grad, log_scale = live[0]
    m = np.asarray(backend.to_numpy(grad), dtype=np.float64).reshape(-1)
    theta = np.asarray(p.value, dtype=np.float64).reshape(-1)
    peak_m = float(m.max(initial=0.0))
    top = max(float(theta.max(initial=0.0)), -float(theta.min(initial=0.0)))
    if not (math.isfinite(peak_m) and math.isfinite(top) and float(m.min(initial=0.0)) >= 0.0
            and math.isfinite(log_scale)):
        return None  # `_binary` names what is not finite
    if peak_m == 0.0 or top == 0.0:
        return np.zeros(p.shape)
    a = np.empty(theta.size)
    on = kept = 0
    for i in range(0, theta.size, _BLOCK):
        t, g, out = theta[i:i + _BLOCK], m[i:i + _BLOCK], a[i:i + _BLOCK]
        on += int(np.count_nonzero((g > 0) & (t != 0)))
        if q == 1.0:  # |θ|^0: 1, and 0 at θ = 0 (where sign(θ) is 0 anyway)
            np.not_equal(t, 0, out=out, casting="unsafe")
        else:
            np.abs(t, out=out)
            out /= top
            if q != 2.0:
                np.power(out, q - 1.0, out=out)
        out *= g / peak_m  # both factors at most 1: a product that went subnormal on the way stays so, and is seen
        kept += int(np.count_nonzero(out >= _TINY))
    if kept != on:  # an entry lost (0 or subnormal) before the scales meet
        return None
    shift = float(log_scale) + log_outer + math.log(peak_m) + (q - 1.0) * math.log(top)
    peak = float(a.max())
    if shift + math.log(peak) > _LOG_MAX:
        raise PathNormOverflow(f"the derivative of the l{q:g} path-norm by param '{p.name}' reaches about "
                               f"10^{(shift + math.log(peak)) / math.log(10):.1f}, beyond float64")
    scale = math.exp(shift + math.log(peak))
    for i in range(0, theta.size, _BLOCK):
        out = a[i:i + _BLOCK]
        out *= 1.0 / peak  # in [2.2e-308, 1]: the one scale is applied last
        out *= scale
        out *= np.sign(theta[i:i + _BLOCK])
    return a.reshape(p.shape)


def _binary(p, uses: list, backend) -> tuple[np.ndarray, np.ndarray]:
    """G of ``p`` summed over its ``uses`` ((array, natural log-scale) or None, from ``param_grads``)
    as (mantissa, log2-exponent) per entry: G = mantissa · 2^exponent, mantissa in [0.5, 1) or 0
    (exponent 0 there), so no entry of one use is lost next to a larger one of another."""
    shape = p.shape
    terms = []
    for use in uses:
        if use is None:
            continue
        grad, log_scale = use
        m = np.asarray(backend.to_numpy(grad), dtype=np.float64).reshape(shape)
        logs = np.broadcast_to(np.asarray(log_scale, dtype=np.float64), shape)
        if not (np.isfinite(m).all() and (m >= 0).all() and (logs < np.inf).all()):  # NaN fails too
            raise PathirError(f"the path-norm's gradient by param '{p.name}' is not finite (NaN or inf weights?)")
        f, e = np.frexp(np.where(logs > -np.inf, m, 0.0))  # a log-scale of -inf: no path reaches the entry
        terms.append((f, np.where(f > 0, e + logs / _LN2, -np.inf)))
    if not terms:
        return np.zeros(shape), np.zeros(shape)
    top = np.max([x for _, x in terms], axis=0)
    live = top > -np.inf
    top = np.where(live, top, 0.0)
    total = np.zeros(shape)
    for f, x in terms:  # each term at most 1 · 2^0 against the entry's largest: no overflow, sum exact to rounding
        with np.errstate(under="ignore"):
            total += np.where(f > 0, f * np.exp2(np.where(f > 0, x - top, 0.0)), 0.0)
    f, e = np.frexp(total)
    return f, np.where(live, top + e, 0.0)


def _entries(p, mant: np.ndarray, log2: np.ndarray, q: float) -> np.ndarray:
    """sign(θ) · |θ|^{q−1} · mant · 2^{log2} per entry, mant in [0.5, 1) or 0: |θ| = f·2^e is raised
    as f^{q−1} (≥ 2^{−512}) and 2^{e(q−1)}, the exponents summed and applied once by ``np.ldexp``, so an
    entry is rounded to float64 once and flushes to 0 only where it is itself below float64's range."""
    theta = np.asarray(p.value, dtype=np.float64)
    if not np.isfinite(theta).all():
        raise PathirError(f"the path-norm's gradient by param '{p.name}' is not finite (NaN or inf weights?)")
    on = (mant > 0) & (theta != 0)
    if not on.any():
        return np.zeros(p.shape)
    f, e = np.frexp(np.abs(np.where(on, theta, 1.0)))
    k = q - 1.0
    if k <= 512.0:  # f ≥ 0.5: f^k ≥ 2^-512, a normal float
        power, extra = np.power(f, k), 0.0
    else:
        bits = k * np.log2(f)
        extra = np.floor(bits)
        power = np.exp2(bits - extra)
    mant = np.where(on, mant * power, 0.0)  # ≥ 2^-514, < 1 where on
    exponent = np.where(on, log2 + e * k + extra, 0.0)  # an entry off is 0 whatever its walk's exponent
    peak = float(np.max(np.where(on, exponent + np.log2(np.where(on, mant, 1.0)), -np.inf)))
    if peak >= 1024.0:
        raise PathNormOverflow(f"the derivative of the l{q:g} path-norm by param '{p.name}' reaches about "
                               f"10^{peak * math.log10(2):.1f}, beyond float64")
    whole = np.floor(exponent)
    d = mant * np.exp2(exponent - whole)  # in [2^-514, 2)
    d = np.ldexp(d, np.clip(whole, -2200, 1100).astype(np.int32))
    if not np.isfinite(d).all():  # rounded up to inf from just below 2^1024
        raise PathNormOverflow(f"the derivative of the l{q:g} path-norm by param '{p.name}' is beyond float64")
    d *= np.sign(theta)
    d[~on] = 0.0
    return d
