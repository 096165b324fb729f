"""How far a rescaling may go before write-back leaves the model's dtype.

With |z_h| <= M for every unit, a parameter is multiplied by
e^{-(z_l - z_e)/2} ∈ [e^{-M}, e^{M}] (docs/math.md §5), and a
running variance of an unfolded batch-norm by at most e^{2M}. So if every
nonzero |θ| of the graph lies in [m, m'] and the dtype's normal range is
[tiny, big], no written entry overflows or becomes subnormal (or 0) when

    2M <= min(log big - log m', log m - log tiny) - margin,

the margin (log 2^10, or a tenth of the dtype's range if that is less: float16)
covering the source tensors a graph param is folded from (a batch-norm's γ and
1/σ, whose product the graph holds). Entries already subnormal in the dtype do
not count (they hold no normal value to lose); an M of 0 means no rescaling fits. This M is
`default_max_log_scale`; float64 models get the same rule with float64's
range (a bound near 350, which no sane rescaling reaches).
"""

from __future__ import annotations

import math
import weakref

import numpy as np

from pathir.errors import ArgumentError

__all__ = ["default_max_log_scale", "dtype_range", "magnitude_range", "float64_safe", "SAFETY_MARGIN"]

#: headroom, in nats, kept between the rescaled magnitudes and the dtype's limits
SAFETY_MARGIN = 10 * math.log(2.0)

_RANGES = {  # (log of the largest finite, log of the smallest normal)
    "float64": (math.log(np.finfo(np.float64).max), math.log(np.finfo(np.float64).tiny)),
    "float32": (math.log(np.finfo(np.float32).max), math.log(np.finfo(np.float32).tiny)),
    "float16": (math.log(np.finfo(np.float16).max), math.log(np.finfo(np.float16).tiny)),
    "bfloat16": (math.log(3.3895313892515355e38), math.log(1.1754943508222875e-38)),
}


def dtype_range(dtype) -> tuple[float, float]:
    """(log max finite, log min normal) of a float dtype: a torch or numpy dtype, or its name."""
    name = str(dtype).rsplit(".", 1)[-1]
    if name not in _RANGES:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            pass
    if name not in _RANGES:
        raise ArgumentError(f"no float range known for dtype {dtype!r} (known: {sorted(_RANGES)})")
    return _RANGES[name]


def default_max_log_scale(graph, dtype, *, variance_ratio: float | None = None) -> float:
    """The largest M such that every rescaling with max_h |z_h| <= M writes ``graph``'s parameters
    back in ``dtype`` finite and normal (module docstring).

    ``variance_ratio``: min (var + eps) / eps over the channels of the batch-norms whose running
    statistics write-back rescales (those that could not be folded): var ← λ²(var + eps) − eps, and the
    batch-norm adds eps back, an error of about (1 + eps / (λ²(var + eps))) ulps of var + eps. The default
    keeps it at full precision (that ratio at most 1e-3: λ²(var + eps) >= 1e3 eps), so M is also capped at
    ½ log(variance_ratio / 1e3) (less a margin of log 2); 0 where var + eps is below about 4e3 eps (an eps
    of 1e-3 and a running variance below 4), and then the caller warns. A larger ``max_log_scale`` is written
    while the error stays within 1e3 ulps (λ²(var + eps) >= 1e-3 eps; ``check_variance`` refuses beyond). A
    scalar bound, so it is conservative: it caps every unit, not only those feeding such a batch-norm.

    >>> import torch, pathir
    >>> _ = torch.manual_seed(0)
    >>> cm = pathir.compile(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)),
    ...                     input_shape=(4,))
    >>> 25 < default_max_log_scale(cm.graph, torch.float32) < 45
    True
    >>> default_max_log_scale(cm.graph, "float64") > 300
    True
    """
    log_big, log_tiny = dtype_range(dtype)
    low, high, _ = magnitude_range(graph, math.exp(log_tiny))
    if high == -math.inf:  # nothing nonzero: any rescaling writes zeros as zeros
        low = high = 1.0
    margin = min(SAFETY_MARGIN, 0.1 * (log_big - log_tiny))
    room = min(log_big - math.log(high), math.log(low) - log_tiny) - margin
    bound = max(room / 2.0, 0.0)
    if variance_ratio is not None and variance_ratio < math.inf:
        bound = min(bound, max(0.5 * (math.log(max(variance_ratio, 1.0)) - math.log(1e3)) - math.log(2.0), 0.0))
    return bound


_CHUNK = 1 << 16
#: graph -> {threshold: (low, high, finite)}: a graph's params never change, so each range is read once
_RANGES_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def magnitude_range(graph, tiny: float) -> tuple[float, float, bool]:
    """(min, max) of |θ| over the finite entries >= ``tiny`` of ``graph``'s params ((inf, -inf) if none),
    and whether every entry is finite. The pass that reads it also reads the range over the entries > 0
    (``tiny=0``: what a commit's float64 range check needs, `float64_safe`); both are kept per graph."""
    seen = _RANGES_SEEN.setdefault(graph, {})
    if tiny not in seen:
        low, low_any, high, finite = math.inf, math.inf, -math.inf, True
        for p in graph.params():
            lo, lo_any, hi, fin = _magnitude_range(np.asarray(p.value), tiny)
            low, low_any, high, finite = min(low, lo), min(low_any, lo_any), max(high, hi), finite and fin
        # (the largest finite |θ| is the largest >= any threshold wherever one entry reaches it)
        seen[tiny], seen[0.0] = ((low, high if low < math.inf else -math.inf, finite),
                                 (low_any, high if low_any < math.inf else -math.inf, finite))
    return seen[tiny]


def float64_safe(graph, z) -> bool:
    """True where no param entry of ``graph`` times a factor in [e^{-M}, e^M] (M = max |z_h|: every factor a
    rescaling by z applies) can leave float64's normal range or stop being finite: the entries > 0 span
    [low, high] and e^{±M} keeps them SAFETY_MARGIN inside it. False says nothing (check entry by entry)."""
    low, high, finite = magnitude_range(graph, 0.0)
    if not finite:
        return False
    if low == math.inf:  # every entry 0: stays 0
        return True
    log_big, log_tiny = _RANGES["float64"]
    M = float(np.max(np.abs(z), initial=0.0))
    return math.log(high) + M <= log_big - SAFETY_MARGIN and math.log(low) - M >= log_tiny + SAFETY_MARGIN


def _magnitude_range(value: np.ndarray, tiny: float) -> tuple[float, float, float, bool]:
    """(min of |value| over its finite entries >= ``tiny``, min over those > 0, max over the finite ones,
    all finite) ((inf, inf, -inf) for the extremes where there are none), a cache-sized chunk at a time:
    one |x| per chunk, and the masks only for a chunk holding a zero, a subnormal, inf or nan."""
    flat = value.reshape(-1)
    low, low_any, high, finite = math.inf, math.inf, -math.inf, True
    buf = np.empty(min(_CHUNK, flat.size), dtype=np.result_type(flat.dtype, np.float32))
    for i in range(0, flat.size, _CHUNK):
        part = flat[i:i + _CHUNK]
        mag = np.abs(part, out=buf[:part.size])
        lo, hi = float(mag.min()), float(mag.max())
        lo_any = lo
        if not (lo >= tiny and lo > 0 and hi < math.inf):  # zeros, subnormals, inf or nan here: mask them out
            fin = np.isfinite(mag)
            finite = finite and bool(fin.all())
            keep = (mag >= tiny) & fin
            lo = float(np.min(mag, where=keep, initial=math.inf))
            lo_any = float(np.min(mag, where=(mag > 0) & fin, initial=math.inf))
            hi = float(np.max(mag, where=fin, initial=-math.inf))
        low, low_any, high = min(low, lo), min(low_any, lo_any), max(high, hi)
    return low, low_any, high, finite
