"""Path-metrics (docs/math.md §3): brackets of d(θ, θ') = ‖Φ(θ) − Φ(θ')‖₁, and the
output bound of Gonon et al. 2025 (Thm 4.1).

Two models of one architecture, θ (``a``) and θ' (``b``):

- lower = | ‖Φ(θ)‖₁ − ‖Φ(θ')‖₁ |                          (two path-norm passes);
- upper = Σ_{edges u→v} |θ_e − θ'_e| F_{|θ'|}(u) B_{|θ|}(v) + Σ_{biased v} |b_v − b'_v| B_{|θ|}(v)

with F_{|θ'|}(u) the sum over paths ending at u of |Φ_p(θ')| (``path_forward``
on the path-norm network of θ') and B_{|θ|}(v) the sum over paths from v to an
output of Π|θ| (``path_backward`` on that of θ). The edge sum of one map is its
weight-gradient with input F and output gradient B, contracted with |W − W'|:
``path_backward(view(θ), acts=path_forward(view(θ')))`` gives exactly these
sums as its param grads. Fixed edges are equal in θ and θ' and add nothing;
max-pools are summed (``maxpool_to_sum``) as in every path sum.

Telescoping Φ_p(θ) − Φ_p(θ') along p gives one term per factor of p; the upper
bracket is the triangle inequality on them. When θ_i θ'_i ≥ 0 for all i and
|θ'| ≤ |θ| coordinatewise (or |θ| ≤ |θ'|), e.g. pruning, every term of a path
has one sign, so the triangle inequality is an equality and upper = d = lower.
Then ``exact`` is true and both brackets hold the telescoped sum, which has no
cancellation (the difference of two path-norms loses digits when they are close).

Both brackets are invariant under a rescaling applied to θ and θ' jointly.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, fields

import numpy as np

from pathir.backends import get_backend
from pathir.errors import ArgumentError, ArgumentTypeError, PathirError
from pathir.ir import Graph, MapKind, Param
from pathir.lifting.param_grads import param_grads
from pathir.lifting.path_norm import log_path_sum
from pathir.lifting.pattern import as_input_dict
from pathir.lifting.scaled import FLOOR, NORMAL
from pathir.support.progress import Phases

__all__ = ["PathMetric", "path_metric", "pruned_path_metric", "walk_rounding", "output_bound", "check_same_architecture", "graph_of", "backend_of", "param_pairs",
           "sign_relations"]

_LOG_MAX = math.log(np.finfo(np.float64).max)
_LN10 = math.log(10)
_TINY = float(np.finfo(np.float64).tiny)


@dataclass(frozen=True)
class PathMetric:
    """Brackets of the ℓ1 path-metric d(θ, θ') = ‖Φ(θ) − Φ(θ')‖₁.

    Attributes
    ----------
    lower, upper : float
        lower ≤ d ≤ upper (``math.inf`` where a value exceeds float64, and an upper bracket below
        float64's normal range read as the next float up, never 0 unless d = 0: read the log10 fields).
    exact : bool
        True when lower = d provably (same signs and |θ'| ≤ |θ| or |θ| ≤ |θ'|
        coordinatewise, e.g. pruning); then upper = lower = d.
    same_signs : bool
        θ_i θ'_i ≥ 0 for every parameter: the output bound applies.
    log10_lower, log10_upper : float
        log10 of the brackets (-inf for 0).
    norm_a, norm_b : float
        ‖Φ(θ)‖₁ and ‖Φ(θ')‖₁ (``math.inf`` beyond float64).
    """

    lower: float
    upper: float
    exact: bool
    same_signs: bool
    log10_lower: float
    log10_upper: float
    norm_a: float
    norm_b: float
    #: the digest of the two graphs it was computed on (:func:`pair_digest`): ``output_bound(metric=)`` checks it
    pair: bytes = field(default=b"", repr=False, compare=False)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "pair"}

    def __str__(self) -> str:
        tag = "exact" if self.exact else "bracket"
        return f"path-metric {_fmt(self.log10_lower)} <= d <= {_fmt(self.log10_upper)} ({tag})"


#: the relative rounding allowed each path-norm walk (a sum of positive terms over the paths, a few dozen
#: float64 operations deep): a lower bracket is the norms' difference less this much of their sum, or
#: :func:`walk_rounding`'s bound where the graph is deeper or wider than that covers
ROUNDING = 1e-12

_EPS = np.finfo(np.float64).eps


def _terms(m) -> int:
    """The most products one output entry of map ``m`` sums (its fan-in): a weight's or kernel's input
    columns, a window's size, a fixed matrix's row; 1 for the maps that move entries."""
    kind = m.kind
    if kind in (MapKind.DENSE, MapKind.CONV, MapKind.FIXED_CONV):
        w = m.kernel if kind is MapKind.FIXED_CONV else m.weight.value
        return int(np.prod(w.shape[1:], dtype=np.int64))
    if kind is MapKind.POOL:
        return int(np.prod(m.kernel, dtype=np.int64))
    if kind is MapKind.SPATIAL_MATRIX:
        return int((np.asarray(m.matrix) != 0).sum(axis=1).max(initial=1))
    if kind is MapKind.RESAMPLE:
        return int(np.prod([max(1, int((np.asarray(a) != 0).sum(axis=1).max(initial=1))) for a in m.matrices]))
    return 1


def walk_rounding(graph: Graph, log_norm: float = 0.0) -> float:
    """A bound on the relative rounding of a certified path-norm walk of ``graph`` whose log-norm is about
    ``log_norm``: every term is non-negative, so a node's sum of k products is within (k + 2)·ε of its own inputs'
    values, and the errors add along the worst chain of nodes (the longest by fan-in); the final sum over the
    output entries adds their count, and each renormalisation's log-scale, added up to the norm's log, its
    magnitude times ε per node. At least :data:`ROUNDING` (the constant before this bound)."""
    chain: dict[str, float] = {}
    depth: dict[str, int] = {}
    for node in graph.nodes:
        if not node.edges:
            chain[node.name], depth[node.name] = 0.0, 0
            continue
        fan = sum(_terms(e.map) for e in node.edges) + (node.bias is not None)
        chain[node.name] = max(chain[e.source] for e in node.edges) + fan + 2
        depth[node.name] = max(depth[e.source] for e in node.edges) + 1
    worst = max((chain[o] + math.prod(graph.node(o).shape) for o in graph.outputs), default=0.0)
    steps = max((depth[o] for o in graph.outputs), default=0)
    magnitude = abs(log_norm) if math.isfinite(log_norm) else 0.0  # (a norm of 0 or beyond float64: no scale read)
    return max(ROUNDING, 2 * _EPS * (worst + steps * (magnitude + 1.0) + 16))


def pair_digest(ga: Graph, gb: Graph) -> bytes:
    """A digest of two graphs' structures and every param's float64 values: equal only for the same pair of
    models with the same weights (a metric computed on one pair is no bound for another)."""
    h = hashlib.blake2b(digest_size=16)
    for g in (ga, gb):
        for v in g.nodes:
            h.update(repr((v.name, v.kind.name, tuple(v.shape), v.k, v.bias.name if v.bias else None)).encode())
            for e in v.edges:  # every field of the map: a fixed factor's or kernel's values, a conv's geometry
                h.update(e.source.encode())
                _digest_fields(h, e.map)
        for p in g.params():
            h.update(f"{p.name}{p.value.shape}".encode())
            h.update(np.ascontiguousarray(p.value, dtype=np.float64).tobytes())
    return h.digest()


def _digest_fields(h, m) -> None:
    """Feed ``h`` a map's kind and fields: arrays by their bytes, params by name (their values go in apart)."""
    h.update(m.kind.name.encode())
    for f in fields(m):
        value = getattr(m, f.name)
        items = value if isinstance(value, tuple) and any(isinstance(x, np.ndarray) for x in value) else (value,)
        for x in items:
            if isinstance(x, Param):
                h.update(f"{f.name}:param:{x.name}".encode())
            elif isinstance(x, np.ndarray):
                h.update(f"{f.name}:{x.dtype}{x.shape}".encode())
                h.update(np.ascontiguousarray(x).tobytes())
            else:
                h.update(f"{f.name}:{x!r}".encode())


def _fmt(log10_value: float) -> str:
    if log10_value == -math.inf:
        return "0"
    if abs(log10_value) < 300:
        return f"{10**log10_value:.6g}"
    e = math.floor(log10_value)
    return f"{10 ** (log10_value - e):.6g}e{e:+d}"


def _exp(log_value: float) -> float:
    return math.exp(log_value) if log_value <= _LOG_MAX else math.inf


def _exp_up(log_value: float) -> float:
    """:func:`_exp` rounded up where it leaves float64's normal range below (0 or a subnormal, which rounds
    either way): the next float up, so an upper bracket never reads below what it bounds (e^-760 is 0 in
    float64: it would claim d = 0). A log of -inf is an exact 0."""
    value = _exp(log_value)
    return math.nextafter(value, math.inf) if math.isfinite(log_value) and value < _TINY else value


def _exp_down(log_value: float) -> float:
    """:func:`_exp` rounded down where it lands on a subnormal (which rounds either way): the next float down, so
    a lower bracket never reads above what it bounds."""
    value = _exp(log_value)
    return math.nextafter(value, 0.0) if 0.0 < value < _TINY else value


def exp_bracket(logs, up: bool) -> np.ndarray:
    """:func:`_exp_up` (``up``) or :func:`_exp_down` of every entry of ``logs``, as an array."""
    logs = np.asarray(logs, dtype=np.float64)
    with np.errstate(over="ignore"):
        value = np.exp(logs)
    if up:
        return np.where(np.isfinite(logs) & (value < _TINY), np.nextafter(value, math.inf), value)
    return np.where((value > 0) & (value < _TINY), np.nextafter(value, 0.0), value)


def logsumexp(logs) -> float:
    logs = [v for v in logs if v > -math.inf]
    if not logs:
        return -math.inf
    top = max(logs)
    return top + math.log(math.fsum(math.exp(v - top) for v in logs))




def graph_of(obj) -> Graph:
    """The Graph of ``obj``: a Graph, or anything holding one as ``.graph`` (a Compiled)."""
    graph = obj if isinstance(obj, Graph) else getattr(obj, "graph", None)
    if isinstance(graph, Graph):
        return graph
    raise ArgumentTypeError(f"a and b must each be a pathir.Compiled or a Graph, got {type(obj).__name__}")


def backend_of(a, backend):
    """``a``'s own backend choice where it has one (a Compiled), else ``backend`` by name."""
    if hasattr(a, "get_backend"):
        return a.get_backend(backend)

    return get_backend(backend)


# ------------------------------------------------------------ architecture


def _same_value(x, y) -> bool:
    if isinstance(x, Param) or isinstance(y, Param):
        return isinstance(x, Param) and isinstance(y, Param) and x.name == y.name and x.shape == y.shape
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return x is None and y is None or (x is not None and y is not None and np.array_equal(x, y))
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):  # a Resample's per-axis matrices
        return len(x) == len(y) and all(_same_value(a, b) for a, b in zip(x, y))
    return bool(x == y)


def _structure_difference(ga: Graph, gb: Graph) -> str | None:
    if ga.outputs != gb.outputs:
        return f"outputs {list(ga.outputs)} vs {list(gb.outputs)}"
    if len(ga.nodes) != len(gb.nodes):
        return f"{len(ga.nodes)} nodes vs {len(gb.nodes)}"
    for i, (na, nb) in enumerate(zip(ga.nodes, gb.nodes)):
        where = f"node {i} '{na.name}'"
        if (na.name, na.kind, na.shape, na.k) != (nb.name, nb.kind, nb.shape, nb.k):
            return f"{where}: {na.kind.value}{list(na.shape)} vs '{nb.name}': {nb.kind.value}{list(nb.shape)}"
        if (na.bias is None) != (nb.bias is None) or (na.bias is not None and not _same_value(na.bias, nb.bias)):
            return f"{where}: bias {getattr(na.bias, 'name', None)} vs {getattr(nb.bias, 'name', None)}"
        if len(na.edges) != len(nb.edges):
            return f"{where}: {len(na.edges)} incoming edges vs {len(nb.edges)}"
        for ea, eb in zip(na.edges, nb.edges):
            if ea.source != eb.source or type(ea.map) is not type(eb.map):
                return f"{where}: edge {ea.map.describe()}({ea.source}) vs {eb.map.describe()}({eb.source})"
            for f in fields(ea.map):
                if not _same_value(getattr(ea.map, f.name), getattr(eb.map, f.name)):
                    return f"{where}: edge from '{ea.source}' differs in {f.name} ({ea.map.describe()} vs {eb.map.describe()})"
    return None


def check_same_architecture(a, b) -> None:
    """Raise PathirError unless ``a`` and ``b`` (Compiled or Graph) have the same
    structure: node names, kinds, shapes, edges, map geometry, fixed weights,
    param names and shapes. Only free parameter values may differ."""
    ga, gb = graph_of(a), graph_of(b)
    why = _structure_difference(ga, gb)
    if why is not None:
        raise PathirError(f"the two models do not have the same architecture: {why}")


# ------------------------------------------------------------ the brackets


def param_pairs(ga: Graph, gb: Graph):
    """(param of a, param of b) for every free param, in ``ga.params()`` order."""
    out, seen = [], set()
    for na, nb in zip(ga.nodes, gb.nodes):
        for pa, pb in zip(na.params(), nb.params()):
            if id(pa) not in seen:
                seen.add(id(pa))
                out.append((pa, pb))
    return out


#: entries per block of the elementwise scans below: their temporaries stay a few MB
#: instead of a copy of the largest param (VGG's first classifier layer: 0.8 GB in float64)
_BLOCK = 1 << 18


def _blocks(*arrays):
    """Aligned flat blocks of arrays of one size (views of C-contiguous arrays)."""
    flat = [np.ravel(a) for a in arrays]
    for i in range(0, flat[0].size, _BLOCK):
        yield tuple(f[i:i + _BLOCK] for f in flat)


def sign_relations(pairs) -> tuple[bool, bool]:
    """(same signs, |θ'| ≤ |θ| everywhere or |θ| ≤ |θ'| everywhere)."""
    same, below, above = True, True, True
    for pa, pb in pairs:
        for x, y in _blocks(pa.value, pb.value):
            ax, ay = np.abs(x), np.abs(y)
            same = same and not _flipped(x, y).any()
            below = below and bool(np.all(ay <= ax))
            above = above and bool(np.all(ax <= ay))
    return same, below or above


def _flipped(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Where θ_i θ'_i < 0, read off the sign bits (no x*y: it underflows)."""
    return (x != 0) & (y != 0) & (np.signbit(x) != np.signbit(y))


def first_sign_flip(ga: Graph, gb: Graph) -> str:
    """Where the two graphs' parameters first have opposite signs, in words: the param, its entry, both
    values, and the tensors it is made of (a folded batch-norm's bias is no tensor of the model's own)."""
    for pa, pb in param_pairs(ga, gb):
        x, y = np.asarray(pa.value, dtype=np.float64), np.asarray(pb.value, dtype=np.float64)
        flipped = np.flatnonzero(_flipped(x, y).reshape(-1))
        if flipped.size:
            k = int(flipped[0])
            made = sorted({r.name for r in pa.sources})
            folded = f", computed from {', '.join(made)} (batch-norm folded)" if len(made) > 1 else ""
            entry = tuple(int(i) for i in np.unravel_index(k, x.shape)) if x.ndim else ()
            return (f"param '{pa.name}'{folded}, entry {entry}: "
                    f"{x.reshape(-1)[k]:.6g} against {y.reshape(-1)[k]:.6g} ({flipped.size} entries flip)")
    return "none found"


def _small_products(a: np.ndarray, b: np.ndarray, grad: np.ndarray) -> bool:
    """Whether |a − b| ⊙ ``grad`` (a certified weight-gradient: entries 0 or at least FLOOR) could hold a nonzero
    product below NORMAL (underflowed, or a subnormal's few digits), read a block at a time."""
    low = min((float(np.min(d, where=d > 0, initial=np.inf)) for x, y in _blocks(a, b) for d in [np.abs(x - y)]),
              default=np.inf)
    return low < np.inf and FLOOR * low < NORMAL


def _log_upper(ga: Graph, gb: Graph, be) -> float:
    # F on |θ'| feeds the weight-gradients of the backward walk on |θ|
    parts = param_grads(ga, be, 1.0, forward_graph=gb)
    logs = []
    for pa, pb in param_pairs(ga, gb):
        uses = parts.pop(id(pa))  # each grad is dropped once read
        if not any(np.any(x != y) for x, y in _blocks(pa.value, pb.value)):
            continue
        while uses:
            part = uses.pop()
            if part is None:
                continue
            grad = np.asarray(be.to_numpy(part[0]), dtype=np.float64).reshape(pa.shape)
            if np.ndim(part[1]) or _small_products(pa.value, pb.value, grad):
                # the scaled walk's per-channel log-scales, or products of |θ − θ'| and the grad that could
                # underflow in the grad's units (a difference of 1e-130 times 1e-199): the sum in log space
                with np.errstate(divide="ignore"):
                    terms = np.log(np.abs(pa.value - pb.value)) + np.log(grad) + np.broadcast_to(part[1], pa.shape)
                if np.any(np.isnan(terms)) or np.any(np.isposinf(terms)):
                    raise PathirError(f"path-metric: non-finite contribution of param '{pa.name}'")
                terms = terms[terms > -np.inf]
                if terms.size:
                    top = float(terms.max())
                    logs.append(top + math.log(float(np.exp(terms - top).sum())))
                continue
            s = math.fsum(float(np.dot(np.abs(x - y), g)) for x, y, g in _blocks(pa.value, pb.value, grad))
            if not math.isfinite(s):
                raise PathirError(f"path-metric: non-finite contribution of param '{pa.name}'")
            if s > 0:
                logs.append(math.log(s) + float(part[1]))
            del grad, part
    return logsumexp(logs)


def path_metric(a, b, backend=None, progress: bool | None = None) -> PathMetric:
    """Brackets of the ℓ1 path-metric ‖Φ(θ) − Φ(θ')‖₁ between two models of one architecture.

    Parameters
    ----------
    a, b : Compiled or Graph
        θ and θ' (same structure, checked: :func:`check_same_architecture`).
    backend : "torch", "numpy" or a Backend (default: ``a``'s)
    progress : a bar on stderr over the phases compare, path-norms, bound (``pathir.support.progress``;
        None: only when stderr is a terminal)

    Returns
    -------
    PathMetric
        ``lower ≤ d ≤ upper``; ``exact`` when lower = d provably (then upper = d too).

    Examples
    --------
    >>> import numpy as np
    >>> from pathir.ir import GraphBuilder, Dense
    >>> def mlp(w1, w2):
    ...     b = GraphBuilder()
    ...     x = b.input("x", (2,))
    ...     h = b.relu("h", [(x, Dense(b.param("w1", w1)))])
    ...     return b.build(outputs=[b.identity("y", [(h, Dense(b.param("w2", w2)))])])
    >>> a = mlp([[1.0, 2.0]], [[3.0]])              # paths: 1*3, 2*3
    >>> pruned = mlp([[1.0, 0.0]], [[3.0]])         # the second path is cut
    >>> m = path_metric(a, pruned, "numpy")
    >>> m.lower, m.upper, m.exact                   # |6| exactly
    (6.0, 6.0, True)
    >>> m = path_metric(a, mlp([[-1.0, 2.0]], [[3.0]]), "numpy")
    >>> m.lower, m.upper, m.exact                   # norms equal; d = |3 - (-3)| = 6
    (0.0, 6.0, False)
    """

    bar = Phases(("compare", "path-norms", "bound"), desc="path-metric", progress=progress)
    bar.phase("compare")
    ga, gb = graph_of(a), graph_of(b)
    check_same_architecture(ga, gb)
    be = backend_of(a, backend)
    same, dominated = sign_relations(param_pairs(ga, gb))
    exact = same and dominated
    bar.phase("path-norms")
    la, lb = log_path_sum(ga, 1, be), log_path_sum(gb, 1, be)
    bar.phase("bound")
    log_up = _log_upper(ga, gb, be)
    bar.close()
    if exact:
        log_low = log_up
    else:
        top, low = max(la, lb), min(la, lb)
        # |A − B| of two norms each summed with relative rounding below r (walk_rounding): the true difference is at
        # least |A − B| − r·(A + B) (a model rescaled, Φ equal up to rounding, read d ≥ 2e-16 where d = 2e-17)
        r = walk_rounding(ga, top) if top > -math.inf else ROUNDING  # (one architecture: one chain for both)
        gap = -math.expm1(low - top) - r * (1.0 + math.exp(low - top)) if top > -math.inf else 0.0
        log_low = top + math.log(gap) if gap > 0 else -math.inf
        log_low = min(log_low, log_up)  # rounding must not invert the bracket
    return PathMetric(
        lower=_exp_down(log_low),
        upper=_exp_up(log_up),
        exact=exact,
        same_signs=same,
        log10_lower=log_low / _LN10,
        log10_upper=log_up / _LN10,
        norm_a=_exp(la),
        norm_b=_exp(lb),
        pair=pair_digest(ga, gb),
    )


def pruned_path_metric(ga: Graph, gb: Graph, backend, min_gap: float = 1e-3, log_norm_a: float | None = None,
                       log_bound: float | None = None, digest: bool = True) -> PathMetric:
    """:func:`path_metric` of θ (``ga``) and θ' = θ ⊙ mask (``gb``: entries of θ set to 0, pruning), cheaper.

    A path through a pruned entry has Φ_p(θ') = 0 and every other path keeps its value, so
    d = ‖Φ(θ)‖₁ − ‖Φ(θ')‖₁ exactly: from the two path-norm passes where they differ by at least
    ``min_gap`` of ‖Φ(θ)‖₁, computed as ‖Φ(θ)‖₁ (1 − e^{log‖Φ(θ')‖ − log‖Φ(θ)‖}) without cancellation in the
    exponential, the bracket d ± r·(‖Φ(θ)‖₁ + ‖Φ(θ')‖₁) (r each walk's rounding, :func:`walk_rounding`;
    ``exact`` False), else
    from the telescoped walk of :func:`path_metric` (no cancellation; ``exact`` True). The caller guarantees
    the masking (it is not checked here).

    ``log_norm_a``: log ‖Φ(θ)‖₁ if already known (the path-magnitude scores' walk computes it).
    ``log_bound``: log of an upper bound on d (Σ S_i over the pruned entries); where it is at most
    ``min_gap`` ‖Φ(θ)‖₁ the norms are known to be that close without walking θ': d then comes from
    the telescoped walk and ‖Φ(θ')‖₁ = ‖Φ(θ)‖₁ − d (d ≤ min_gap of it: no digit lost).
    ``digest``: compute the pair's digest (:func:`pair_digest`, a pass over both graphs' params), which
    ``output_bound(metric=)`` needs; a caller that only reads the brackets skips it.
    """

    la = log_path_sum(ga, 1, backend) if log_norm_a is None else float(log_norm_a)
    usable = la > -math.inf and min_gap < 1
    if usable and min_gap > 0 and log_bound is not None and log_bound <= la + math.log(min_gap):
        log_d = _log_upper(ga, gb, backend)
        lb = la + math.log1p(-min(1.0, math.exp(log_d - la))) if log_d > -math.inf else la
    else:
        lb = log_path_sum(gb, 1, backend)
        if usable and lb <= la + math.log1p(-min_gap):
            # the difference of two walks, each within r of its norm (walk_rounding): d ± r·(‖Φ(θ)‖₁ + ‖Φ(θ')‖₁), a
            # bracket (at norms near 1e300, L·ε of each log-scaled norm, magnified 1/min_gap by the subtraction, is
            # 1e-10 of d: taken as d, the pruned metric read 7e-11 under the truth)
            r = walk_rounding(ga, la)  # (θ' = θ ⊙ mask: the same chains)
            gap, rounding = -math.expm1(lb - la), r * (1.0 + math.exp(lb - la))
            log_low = la + math.log(gap - rounding) if gap > rounding else -math.inf
            log_d = la + math.log(gap + rounding)
            return PathMetric(lower=_exp_down(log_low), upper=_exp_up(log_d), exact=False, same_signs=True,
                              log10_lower=log_low / _LN10, log10_upper=log_d / _LN10, norm_a=_exp(la),
                              norm_b=_exp(lb), pair=pair_digest(ga, gb) if digest else b"")
        log_d = _log_upper(ga, gb, backend)
    return PathMetric(lower=_exp_down(log_d), upper=_exp_up(log_d), exact=True, same_signs=True,
                      log10_lower=log_d / _LN10, log10_upper=log_d / _LN10, norm_a=_exp(la), norm_b=_exp(lb),
                      pair=pair_digest(ga, gb) if digest else b"")


def _sup_norms(x, graph: Graph) -> np.ndarray:
    """max over every input coordinate of |x|, per sample: (B,); inputs read and checked as every walk at data
    reads them (:func:`pathir.lifting.pattern.as_input_dict`: names, shapes, one batch size, finite)."""
    out = None
    for v in as_input_dict(graph, x).values():
        v = np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v, dtype=np.float64)
        m = np.abs(v.reshape(v.shape[0], -1)).max(axis=1, initial=0.0)
        out = m if out is None else np.maximum(out, m)
    return out


def output_bound(a, b, x, backend=None, metric: PathMetric | None = None) -> np.ndarray:
    """max(‖x‖∞, 1) · upper: a bound on ‖R_θ(x) − R_θ'(x)‖₁ for each sample of ``x``.

    Gonon et al. 2025, Thm 4.1 (docs/math.md §3): valid whenever θ_i θ'_i ≥ 0 for
    every parameter; raises PathirError when the signs disagree somewhere.

    Parameters
    ----------
    a, b : Compiled or Graph of one architecture
    x : array or tensor (B, *input shape), or {input name: array}
    metric : a :class:`PathMetric` of (a, b) already computed (else computed here)

    Returns
    -------
    numpy array (B,), the bound per sample (summing over every output).

    Examples
    --------
    >>> import numpy as np
    >>> from pathir.ir import GraphBuilder, Dense
    >>> def mlp(w1):
    ...     b = GraphBuilder()
    ...     x = b.input("x", (2,))
    ...     h = b.relu("h", [(x, Dense(b.param("w1", w1)))])
    ...     return b.build(outputs=[b.identity("y", [(h, Dense(b.param("w2", [[3.0]])))])])
    >>> output_bound(mlp([[1.0, 2.0]]), mlp([[1.0, 0.0]]), np.array([[0.5, 0.5], [4.0, -1.0]]), "numpy")
    array([ 6., 24.])
    """
    ga = graph_of(a)
    if metric is None:
        metric = path_metric(a, b, backend)
    elif not isinstance(metric, PathMetric):
        raise ArgumentTypeError(f"metric= takes the PathMetric of (a, b) that pathir.path_metric returned, got "
                                f"{type(metric).__name__}")
    elif metric.pair != pair_digest(ga, graph_of(b)):
        raise ArgumentError("metric= is not the path-metric of these two models as they are now: it was computed "
                            "for another pair, or their weights changed since (a model pruned or trained again). "
                            "Compute it again with pathir.path_metric(a, b), or leave metric= out")
    if not metric.same_signs:
        raise PathirError(
            "output_bound needs θ_i θ'_i >= 0 for every parameter of the IR, where batch-norms are folded into "
            f"the layers before them (Gonon et al. 2025, Thm 4.1); the two models' signs differ at "
            f"{first_sign_flip(ga, graph_of(b))}"
        )
    scale = np.maximum(_sup_norms(x, ga), 1.0)
    if metric.upper >= _TINY or metric.log10_upper == -math.inf:  # (inf stays inf)
        return scale * metric.upper
    # an upper bracket below float64's normal range (read as its next float up): the product from the logs,
    # widened by 1e-12 for their rounding (a few ulps of |log| <= 1500: under 1e-12 relative)
    return np.array([_exp_up(math.log(s) + metric.log10_upper * _LN10) * (1.0 + 1e-12) for s in scale])
