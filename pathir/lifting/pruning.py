"""Path-magnitude pruning (docs/math.md §4, Gonon et al. 2025 Def. 5.1).

For every parameter i,

    S_i = |θ_i| · ∂/∂|θ_i| ‖Φ(|θ|)‖₁ = Σ_{p ∋ i} |Φ_p(θ)|

(a parameter read twice along one path, a weight tied across depth, counts
that path twice). One forward and one backward walk on the ℓ1 path-norm network
``path_view(maxpool_to_sum(graph), 1)`` give all of them: the param grads of
``path_backward`` are ∂‖Φ‖₁/∂|θ|. The walks keep values as m·e^L, so scores are
ranked by their logs and never overflow. (The torch backend walks the graph
itself with its ``power_view``, the same network done lazily on the device.)

S is invariant under rescaling (Φ is), |θ_i| is not: pruning by S selects the
same weights on every representative of a rescaling orbit. Setting the set P to
zero moves the path-lifting by exactly d = ‖Φ(θ)‖₁ − ‖Φ(θ ⊙ mask)‖₁ ≤ Σ_{i∈P} S_i,
and for every input ‖R_θ(x) − R_{θ⊙mask}(x)‖₁ ≤ max(‖x‖∞, 1) · d.

Candidates are the weights of dense and conv maps (biases with
``include_biases``; per-channel scales of unfolded batch-norms and the thresholds
of clipped ReLUs, which are no model parameters, never). A folded
batch-norm weight W' = W·γ/σ is pruned through its VALUE source W: W'_i = 0 iff
W_i = 0, and S_i is the same for both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from pathir.backends import get_backend
from pathir.errors import ArgumentError, PathirError
from pathir.ir import Graph, MapKind, Param, Role
from pathir.lifting.diag_g import arrays_by_source, source_layout
from pathir.lifting.param_grads import at_common_scale, param_log_parts
from pathir.lifting.path_metric import pruned_path_metric, walk_rounding
from pathir.pairs.unit_pairs import least_positive

__all__ = ["PruneReport", "score_log_parts", "path_magnitude_scores", "prune_masks", "prune_graph", "prune"]

_LOG_MAX = math.log(np.finfo(np.float64).max)
CRITERIA = ("path-magnitude", "magnitude")
SCOPES = ("global", "local")


def score_log_parts(graph: Graph, backend=None, totals: dict | None = None) -> list[tuple[np.ndarray, float]]:
    """For each param of ``graph.params()``: (m, L) with S = m·e^L, m ≥ 0 of the
    param's shape, max m = 1 (m = 0, L = -inf where S vanishes). ``totals``, when given, receives
    ``"log_path_sum"`` = log ‖Φ(θ)‖₁, the forward walk's total."""

    return param_log_parts(graph, get_backend(backend), 1.0, scale=lambda p: p.value,
                           what="path-magnitude score", totals=totals)


def path_magnitude_scores(graph: Graph, backend=None) -> dict[str, np.ndarray]:
    """S_i per source parameter: {``Param.source_name``: float64 array in the
    source tensor's layout (ONNX transposed initializers transposed back)}.

    Raises PathNormOverflow naming the param when a score exceeds float64, or a nonzero one falls below its range.

    >>> from pathir.ir import GraphBuilder, Dense
    >>> b = GraphBuilder()
    >>> x = b.input("x", (2,))
    >>> h = b.relu("h", [(x, Dense(b.param("w1", [[1.0, -2.0]])))], bias=b.param("b1", [0.5]))
    >>> y = b.identity("y", [(h, Dense(b.param("w2", [[3.0]])))])
    >>> s = path_magnitude_scores(b.build(outputs=[y]), "numpy")  # paths: 1*3, -2*3, 0.5*3
    >>> import numpy as np
    >>> {k: np.round(v, 12).tolist() for k, v in s.items()}
    {'w1': [[3.0, 6.0]], 'b1': [1.5], 'w2': [[10.5]]}
    """

    return arrays_by_source(graph.params(), score_log_parts(graph, backend), "path-magnitude score",
                            "pathir.lifting.pruning.score_log_parts (normalised, with its log-scale)", source_layout)


# ------------------------------------------------------------ selection


def _candidates(graph: Graph, include_biases: bool) -> list[Param]:
    """Params pruning may zero, in ``graph.params()`` order."""
    weights = {id(e.map.weight) for n in graph.nodes for e in n.edges if e.map.kind in (MapKind.DENSE, MapKind.CONV)}
    biases = {id(n.bias) for n in graph.nodes
              if n.bias is not None and all(r.role is not Role.CLIP_THRESHOLD for r in n.bias.sources)}
    keep = weights | (biases if include_biases else set())
    return [p for p in graph.params() if id(p) in keep]


@dataclass(eq=False)
class _Scores:
    """Per param (by id) an array ranking its entries as the criterion does: the scores over
    e^{log_scale} (``linear``), or their logs (-inf for a zero score)."""

    values: dict
    log_scale: float
    linear: bool
    log_norm: float | None = None  # log ‖Φ(θ)‖₁ from the path-magnitude walk (None for "magnitude")


#: a scaled score must stay above this (normal, with its 52 bits) for the linear domain to rank exactly
_LINEAR_FLOOR = 1e-290


def _log_scores(graph: Graph, criterion: str, backend) -> _Scores:
    """The criterion's scores, ranked in the linear domain where every positive score scaled by the
    largest param scale stays a normal float64 (one multiply per entry, and a sum for the bound);
    in log space otherwise (path-magnitudes spanning beyond ~650 nats)."""
    if criterion == "magnitude":
        return _Scores({id(p): np.abs(p.value) for p in graph.params()}, 0.0, True)

    totals: dict = {}
    params, parts = graph.params(), score_log_parts(graph, backend, totals)
    top = max((L for _, L in parts), default=-math.inf)
    if all(L == -math.inf or least_positive(m) * math.exp(L - top) > _LINEAR_FLOOR for m, L in parts):
        scaled, top = at_common_scale(parts)
        return _Scores({id(p): m for p, m in zip(params, scaled)}, top, True, totals["log_path_sum"])
    values = {}
    with np.errstate(divide="ignore"):
        for p, (m, L) in zip(params, parts):
            if not m.flags.writeable:
                m = m.copy()
            np.log(m, out=m)  # in place: the scores' mantissas become their logs
            m += L
            values[id(p)] = m
    return _Scores(values, 0.0, False, totals["log_path_sum"])


def _count(amount, n: int) -> int:
    """Entries to prune out of n: a fraction in [0, 1] (rounded, as torch's prune) or a count."""
    if isinstance(amount, (bool, np.bool_)):
        raise ArgumentError(f"amount must be a fraction in [0, 1] or a number of entries, got {amount!r}")
    if isinstance(amount, (str, bytes)):  # "5" would read as the fraction 5.0, not five entries
        raise ArgumentError(f"amount must be a number (0.5: a fraction of the entries, 5: five entries), got the "
                            f"string {amount!r}")
    if isinstance(amount, (int, np.integer)):
        if not 0 <= amount <= n:
            raise ArgumentError(f"amount={amount} entries, but there are {n} candidates")
        return int(amount)
    try:
        amount = float(amount)
    except (TypeError, ValueError):
        raise ArgumentError(f"amount must be a fraction in [0, 1] or a number of entries, got {amount!r}") from None
    if not 0.0 <= amount <= 1.0:
        raise ArgumentError(f"amount must be a fraction in [0, 1] or a number of entries, got {amount}")
    return int(round(amount * n))


#: from this many values on, `_kth_value` finds the k-th value inside a band picked from a sample
_SAMPLE_FROM = 1 << 22


def _kth_value(arrays: list, k: int) -> float:
    """The k-th smallest value (1-based) over the concatenation of ``arrays``. For many values: a
    random sample brackets it in a band [lo, hi]; counting the values below lo and partitioning only
    those inside the band finds it exactly, without a copy of them all (a full partition where the
    band misses)."""
    arrays = [np.asarray(a).reshape(-1) for a in arrays]
    sizes = np.array([a.size for a in arrays], dtype=np.int64)
    n = int(sizes.sum())
    if n >= _SAMPLE_FROM:
        at_global = np.sort(np.random.default_rng(0).integers(0, n, 1 << 16))
        ends = np.cumsum(sizes)
        which = np.searchsorted(ends, at_global, side="right")
        offsets = ends - sizes
        sample = np.sort(np.concatenate([arrays[i][at_global[which == i] - offsets[i]] for i in np.unique(which)]))
        at = (k - 1) / n * (sample.size - 1)
        lo, hi = sample[max(0, int(at) - 400)], sample[min(sample.size - 1, int(at) + 401)]
        below, band = _below_and_band(arrays, lo, hi)
        if below < k <= below + band.size:
            return float(np.partition(band, k - below - 1)[k - below - 1])
    flat = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    return float(np.partition(flat, k - 1)[k - 1])  # a scratch copy, freed at once


def _below_and_band(arrays: list, lo: float, hi: float, chunk: int = 1 << 18) -> tuple[int, np.ndarray]:
    """(how many values are < lo, the values in [lo, hi]), a cache-sized chunk at a time."""
    below, band = 0, []
    for a in arrays:
        for i in range(0, a.size, chunk):
            part = a[i:i + chunk]
            below += int(np.count_nonzero(part < lo))
            inside = part >= lo
            inside &= part <= hi
            band.append(part[inside])
    return below, np.concatenate(band) if band else np.zeros(0)


def _keep_masks(arrays: list, k: int) -> list:
    """Per array a bool mask of its shape, False on the k smallest values over all of them (among equal
    values the earlier ones in the concatenation, as a stable sort picks them; nan is never picked)."""
    n = sum(a.size for a in arrays)
    if k <= 0:
        return [np.ones(a.shape, dtype=bool) for a in arrays]
    if k >= n:
        return [np.zeros(a.shape, dtype=bool) for a in arrays]
    t = _kth_value(arrays, k)
    masks, ties, below = [], [], 0
    for a in arrays:
        keep = np.less(a, t)
        below += int(np.count_nonzero(keep))
        np.logical_not(keep, out=keep)
        masks.append(keep)
        ties.append(np.flatnonzero(a == t))
    left = k - below  # ties at t to pick, in order
    for keep, at in zip(masks, ties):
        take = at[:left]
        keep.reshape(-1)[take] = False
        left -= take.size
    return masks


def prune_masks(graph: Graph, amount, criterion: str = "path-magnitude", scope: str = "global",
                include_biases: bool = False, backend=None, log_scores=None) -> dict[str, np.ndarray]:
    """{param name: bool array of the param's shape, True = keep} for every candidate param.

    ``global``: the ``amount`` smallest scores among all candidates; ``local``:
    the ``amount`` smallest of each param. Ties go to the earlier entry in θ
    order, so the selection is deterministic. ``log_scores``: the criterion's
    scores (`_log_scores`) if already computed."""
    if criterion not in CRITERIA:
        raise ArgumentError(f"criterion must be one of {CRITERIA}, got '{criterion}'")
    if scope not in SCOPES:
        raise ArgumentError(f"scope must be one of {SCOPES}, got '{scope}'")
    params = _candidates(graph, include_biases)
    if not params:
        raise PathirError("nothing to prune: the graph has no dense or conv weight")
    logs = (_log_scores(graph, criterion, backend) if log_scores is None else log_scores).values
    if scope == "global":  # the threshold over all candidates, each param's mask read off its own scores
        chosen = _keep_masks([logs[id(p)] for p in params], _count(amount, sum(p.size for p in params)))
        return {p.name: keep.reshape(p.shape) for p, keep in zip(params, chosen)}
    return {p.name: _keep_masks([logs[id(p)]], _count(amount, p.size))[0].reshape(p.shape) for p in params}


def prune_graph(graph: Graph, masks, out: dict | None = None) -> Graph:
    """The graph with θ ⊙ mask (``masks``: {param name: bool array}, True = keep). ``out``: {param name:
    a scratch array the caller gives up}, written with θ ⊙ mask where it has the param's shape and
    dtype and shares no memory with it (else a new array)."""
    by_name = {p.name for p in graph.params()}
    unknown = set(masks) - by_name
    if unknown:
        raise PathirError(f"masks name params not in the graph: {sorted(unknown)}")
    out = out or {}

    def masked(p):
        buf = out.get(p.name)
        if (buf is None or buf.shape != p.shape or buf.dtype != p.value.dtype or not buf.flags.writeable
                or np.may_share_memory(buf, p.value)):
            return p.with_value(p.value * masks[p.name], owned=True)
        np.multiply(p.value, masks[p.name], out=buf)
        return p.with_value(buf, owned=True)

    return graph.map_params(lambda p: masked(p) if p.name in masks else p)


# ------------------------------------------------------------ the report


@dataclass
class PruneReport:
    """What ``cm.prune`` did.

    ``pruned`` entries of ``candidates`` were selected (already-zero ones
    included); ``bound`` = Σ_{i∈P} S_i (docs/math.md §4; times 1 + the walks' rounding, ``walk_rounding``) and ``path_metric`` = d
    = ‖Φ(θ)‖₁ − ‖Φ(θ⊙mask)‖₁ ≤ bound (exact, or the upper end of its bracket where it is the two norms' difference,
    within the walks' rounding of their sum: docs/pruning.md): for every input,
    ‖R_θ(x) − R_{θ⊙mask}(x)‖₁ ≤ max(‖x‖∞, 1) · path_metric. ``per_tensor``:
    {source name: (pruned, size)}. Values beyond float64 are ``math.inf``.
    """

    criterion: str
    scope: str
    amount: float
    pruned: int
    candidates: int
    bound: float
    path_metric: float
    path_norm_before: float
    path_norm_after: float
    per_tensor: dict[str, tuple[int, int]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["per_tensor"] = {k: list(v) for k, v in self.per_tensor.items()}
        return out

    def __str__(self) -> str:
        rows = [
            ("criterion", f"{self.criterion} ({self.scope})"),
            ("pruned", f"{self.pruned:,} of {self.candidates:,} ({self.pruned / max(self.candidates, 1):.1%})"),
            ("l1 path-norm before", f"{self.path_norm_before:.6g}"),
            ("l1 path-norm after", f"{self.path_norm_after:.6g}"),
            ("path-metric d(θ, θ⊙mask)", f"{self.path_metric:.6g}"),
            ("bound Σ S_i over pruned", f"{self.bound:.6g}"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _exp(log_value: float) -> float:
    return math.exp(log_value) if log_value <= _LOG_MAX else math.inf


def _log_bound(graph: Graph, masks, scores: _Scores) -> float:
    """log Σ_{i pruned} S_i (``scores``: the path-magnitude scores), param by param: in the linear
    domain a masked sum (no exponentials), else a log-sum-exp of the pruned logs."""
    parts = []
    for p in graph.params():
        if p.name not in masks:
            continue
        values, keep = scores.values[id(p)], masks[p.name]
        if scores.linear:
            total = _pruned_sum(values, keep)
            parts.append(math.log(total) + scores.log_scale if total > 0 else -math.inf)
            continue
        picked = values[~keep]
        picked = picked[picked > -math.inf]
        if picked.size:
            top = float(picked.max())
            picked -= top
            parts.append(top + math.log(float(np.sum(np.exp(picked, out=picked)))))
    parts = [v for v in parts if v > -math.inf]
    if not parts:
        return -math.inf
    top = max(parts)
    return top + math.log(math.fsum(math.exp(v - top) for v in parts))


def _pruned_sum(values: np.ndarray, keep: np.ndarray, chunk: int = 1 << 16) -> float:
    """Σ values where not ``keep`` (values ≥ 0, finite): a dot product with the pruned entries as 0/1
    floats, a cache-sized chunk at a time (a masked reduction runs several times slower)."""
    values, keep = values.reshape(-1), keep.reshape(-1)
    total = 0.0
    for i in range(0, values.size, chunk):
        pruned = np.logical_not(keep[i:i + chunk]).view(np.uint8).astype(np.float64)
        total += float(np.dot(values[i:i + chunk], pruned))
    return total


def prune(graph: Graph, backend, amount, criterion: str = "path-magnitude", scope: str = "global",
          include_biases: bool = False, commit=None) -> PruneReport:
    """Zero the ``amount`` lowest-scoring candidate entries of ``graph``.

    ``commit(pruned_graph, masks)`` is called last with θ ⊙ mask and the masks of the
    params that lose an entry ({param name: bool array, False = pruned});
    ``Compiled.prune`` writes them into the model (torch:
    ``torch.nn.utils.prune.custom_from_mask``; ONNX: the initializers), all at once.
    """

    if criterion not in CRITERIA:  # before the scores are computed
        raise ArgumentError(f"criterion must be one of {CRITERIA}, got '{criterion}'")
    scores = _log_scores(graph, "path-magnitude", backend)
    masks = prune_masks(graph, amount, criterion, scope, include_biases, backend,
                        log_scores=scores if criterion == "path-magnitude" else None)
    # the bound reads the scores (a float64 copy of θ's size); then their arrays, written once and
    # already in memory, take θ ⊙ mask, so the pruned graph costs no second copy
    log_bound = _log_bound(graph, masks, scores)
    log_norm = scores.log_norm
    after = prune_graph(graph, masks, out={p.name: scores.values[id(p)] for p in graph.params() if p.name in masks})
    del scores
    # θ' = θ ⊙ mask by construction; ‖Φ(θ)‖₁ from the scores' walk; the bound tells beforehand when
    # the two norms are too close to subtract
    # (its brackets only: the metric object stays here, so no digest of the pair)
    metric = pruned_path_metric(graph, after, backend, log_norm_a=log_norm, log_bound=log_bound, digest=False)
    sources = {p.name: p.source_name for p in graph.params()}
    lost = {k: int(m.size - np.count_nonzero(m)) for k, m in masks.items()}  # entries pruned per param
    report = PruneReport(
        criterion=criterion,
        scope=scope,
        amount=float(amount),
        pruned=sum(lost.values()),
        candidates=int(sum(m.size for m in masks.values())),
        # Σ S_i and d are summed by different walks: where they are equal (each pruned path through one pruned
        # entry), either can come out last-bits above the other; the bound takes the walks' rounding (walk_rounding) of itself on top. Below
        # float64's smallest numbers (pruned paths of mass 1e-330) Σ S_i rounds to 0 where d rounds to 5e-324: the
        # bound is then d, which it bounds in exact arithmetic
        bound=max(_exp(log_bound + math.log1p(walk_rounding(graph, log_bound))), metric.upper),
        path_metric=metric.upper,
        path_norm_before=metric.norm_a,
        path_norm_after=metric.norm_b,
        per_tensor={sources[k]: (lost[k], int(m.size)) for k, m in masks.items()},
    )
    if commit is not None:
        commit(after, {k: m for k, m in masks.items() if lost[k]})
    return report
