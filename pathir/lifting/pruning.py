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
``include_biases``; per-channel scales of unfolded batch-norms never). A folded
batch-norm weight W' = W·γ/σ is pruned through its VALUE source W: W'_i = 0 iff
W_i = 0, and S_i is the same for both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from pathir.errors import PathirError
from pathir.ir import Graph, MapKind, Param

__all__ = ["PruneReport", "score_log_parts", "path_magnitude_scores", "prune_masks", "prune_graph", "prune"]

_LOG_MAX = math.log(np.finfo(np.float64).max)
CRITERIA = ("path-magnitude", "magnitude")
SCOPES = ("global", "local")


def score_log_parts(graph: Graph, backend=None) -> list[tuple[np.ndarray, float]]:
    """For each param of ``graph.params()``: (m, L) with S = m·e^L, m ≥ 0 of the
    param's shape, max m = 1 (m = 0, L = -inf where S vanishes)."""
    from pathir.backends import get_backend
    from pathir.lifting.walk import param_log_parts

    return param_log_parts(graph, get_backend(backend), 1.0, scale=lambda p: p.value,
                           what="path-magnitude score")


def path_magnitude_scores(graph: Graph, backend=None) -> dict[str, np.ndarray]:
    """S_i per source parameter: {``Param.source_name``: float64 array in the
    source tensor's layout (ONNX transposed initializers transposed back)}.

    Raises PathNormOverflow naming the param when a score exceeds float64.

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
    from pathir.lifting.diag_g import arrays_by_source, source_layout

    return arrays_by_source(graph.params(), score_log_parts(graph, backend), "path-magnitude score",
                            "pathir.lifting.pruning.score_log_parts (normalised, with its log-scale)", source_layout)


# ------------------------------------------------------------ selection


def _candidates(graph: Graph, include_biases: bool) -> list[Param]:
    """Params pruning may zero, in ``graph.params()`` order."""
    weights = {id(e.map.weight) for n in graph.nodes for e in n.edges if e.map.kind in (MapKind.DENSE, MapKind.CONV)}
    biases = {id(n.bias) for n in graph.nodes if n.bias is not None}
    keep = weights | (biases if include_biases else set())
    return [p for p in graph.params() if id(p) in keep]


def _log_scores(graph: Graph, criterion: str, backend) -> dict[int, np.ndarray]:
    """{id(param): log of the criterion per entry} (-inf for a zero score)."""
    with np.errstate(divide="ignore"):
        if criterion == "magnitude":
            return {id(p): np.log(np.abs(p.value)) for p in graph.params()}
        out = {}
        for p, (m, L) in zip(graph.params(), score_log_parts(graph, backend)):
            if not m.flags.writeable:
                m = m.copy()
            np.log(m, out=m)  # in place: the scores' mantissas become their logs
            m += L
            out[id(p)] = m
        return out


def _count(amount, n: int) -> int:
    """Entries to prune out of n: a fraction in [0, 1] (rounded, as torch's prune) or a count."""
    if isinstance(amount, (bool, np.bool_)):
        raise ValueError(f"amount must be a fraction in [0, 1] or a number of entries, got {amount!r}")
    if isinstance(amount, (int, np.integer)):
        if not 0 <= amount <= n:
            raise ValueError(f"amount={amount} entries, but there are {n} candidates")
        return int(amount)
    amount = float(amount)
    if not 0.0 <= amount <= 1.0:
        raise ValueError(f"amount must be a fraction in [0, 1] or a number of entries, got {amount}")
    return int(round(amount * n))


#: from this many values on, `_smallest` finds the k-th value inside a band picked from a sample
_SAMPLE_FROM = 1 << 22


def _kth_value(values: np.ndarray, k: int) -> float:
    """The k-th smallest value (1-based). For a large array: a random sample brackets it in a band
    [lo, hi]; counting the values below lo and partitioning only those inside the band finds it
    exactly, without a scratch copy of the whole array (a full partition where the band misses)."""
    n = values.size
    if n >= _SAMPLE_FROM:
        sample = np.sort(values[np.random.default_rng(0).integers(0, n, 1 << 16)])
        at = (k - 1) / n * (sample.size - 1)
        lo, hi = sample[max(0, int(at) - 400)], sample[min(sample.size - 1, int(at) + 401)]
        below = int(np.count_nonzero(values < lo))
        band = values[(values >= lo) & (values <= hi)]
        if below < k <= below + band.size:
            return float(np.partition(band, k - below - 1)[k - below - 1])
    return float(np.partition(values, k - 1)[k - 1])  # a scratch copy, freed at once


def _smallest(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k smallest entries; among equal values the earlier ones
    (as a stable sort would pick them), in O(n)."""
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    if k >= values.size:
        return np.arange(values.size)
    t = _kth_value(values, k)
    below = np.flatnonzero(values < t)
    ties = np.flatnonzero(values == t)[: k - below.size]
    return np.concatenate([below, ties])


def prune_masks(graph: Graph, amount, criterion: str = "path-magnitude", scope: str = "global",
                include_biases: bool = False, backend=None, log_scores=None) -> dict[str, np.ndarray]:
    """{param name: bool array of the param's shape, True = keep} for every candidate param.

    ``global``: the ``amount`` smallest scores among all candidates; ``local``:
    the ``amount`` smallest of each param. Ties go to the earlier entry in θ
    order, so the selection is deterministic. ``log_scores``: the criterion's
    {id(param): log score} if already computed."""
    if criterion not in CRITERIA:
        raise ValueError(f"criterion must be one of {CRITERIA}, got '{criterion}'")
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got '{scope}'")
    params = _candidates(graph, include_biases)
    if not params:
        raise PathirError("nothing to prune: the graph has no dense or conv weight")
    logs = _log_scores(graph, criterion, backend) if log_scores is None else log_scores
    masks = {}
    if scope == "global":
        flat = np.empty(sum(p.size for p in params))
        start = 0
        for p in params:
            flat[start : start + p.size] = logs[id(p)].ravel()
            logs[id(p)] = flat[start : start + p.size].reshape(p.shape)  # one copy of the scores, not two
            start += p.size
        keep = np.ones(flat.size, dtype=bool)
        keep[_smallest(flat, _count(amount, flat.size))] = False
        del flat
        start = 0
        for p in params:
            masks[p.name] = keep[start : start + p.size].reshape(p.shape)
            start += p.size
    else:
        for p in params:
            keep = np.ones(p.size, dtype=bool)
            keep[_smallest(logs[id(p)].ravel(), _count(amount, p.size))] = False
            masks[p.name] = keep.reshape(p.shape)
    return masks


def prune_graph(graph: Graph, masks) -> Graph:
    """The graph with θ ⊙ mask (``masks``: {param name: bool array}, True = keep)."""
    by_name = {p.name for p in graph.params()}
    unknown = set(masks) - by_name
    if unknown:
        raise PathirError(f"masks name params not in the graph: {sorted(unknown)}")
    return graph.map_params(lambda p: p.with_value(p.value * masks[p.name], owned=True) if p.name in masks else p)


# ------------------------------------------------------------ the report


@dataclass
class PruneReport:
    """What ``cm.prune`` did.

    ``pruned`` entries of ``candidates`` were selected (already-zero ones
    included); ``bound`` = Σ_{i∈P} S_i (docs/math.md §4) and ``path_metric`` = the
    exact ‖Φ(θ)‖₁ − ‖Φ(θ⊙mask)‖₁ ≤ bound: for every input,
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


def _log_bound(graph: Graph, masks, logs) -> float:
    """log Σ_{i pruned} S_i (``logs``: the path-magnitude log scores), param by param."""
    parts = []
    for p in graph.params():
        if p.name not in masks:
            continue
        picked = logs[id(p)][~masks[p.name]]
        picked = picked[picked > -math.inf]
        if picked.size:
            top = float(picked.max())
            picked -= top
            parts.append(top + math.log(float(np.sum(np.exp(picked, out=picked)))))
    if not parts:
        return -math.inf
    top = max(parts)
    return top + math.log(math.fsum(math.exp(v - top) for v in parts))


def prune(graph: Graph, backend, amount, criterion: str = "path-magnitude", scope: str = "global",
          include_biases: bool = False, commit=None) -> PruneReport:
    """Zero the ``amount`` lowest-scoring candidate entries of ``graph``.

    ``commit(pruned_graph, masks)`` is called last with θ ⊙ mask and the masks of the
    params that lose an entry ({param name: bool array, False = pruned});
    ``Compiled.prune`` writes them into the model (torch:
    ``torch.nn.utils.prune.custom_from_mask``; ONNX: the initializers), all at once.
    """
    from pathir.lifting.path_metric import pruned_path_metric

    if criterion not in CRITERIA:  # before the scores are computed
        raise ValueError(f"criterion must backend one of {CRITERIA}, got '{criterion}'")
    scores = _log_scores(graph, "path-magnitude", backend)
    masks = prune_masks(graph, amount, criterion, scope, include_biases, backend,
                        log_scores=scores if criterion == "path-magnitude" else None)
    after = prune_graph(graph, masks)
    # the bound reads the scores (a flat float64 copy of θ's size): taken, and the scores freed,
    # before the path-metric walk, whose own arrays would otherwise sit beside them
    log_bound = _log_bound(graph, masks, scores)
    del scores
    metric = pruned_path_metric(graph, after, backend)  # θ' = θ ⊙ mask by construction
    sources = {p.name: p.source_name for p in graph.params()}
    report = PruneReport(
        criterion=criterion,
        scope=scope,
        amount=float(amount),
        pruned=int(sum((~m).sum() for m in masks.values())),
        candidates=int(sum(m.size for m in masks.values())),
        bound=_exp(log_bound),
        path_metric=metric.upper,
        path_norm_before=metric.norm_a,
        path_norm_after=metric.norm_b,
        per_tensor={sources[k]: (int((~m).sum()), int(m.size)) for k, m in masks.items()},
    )
    if commit is not None:
        commit(after, {k: m for k, m in masks.items() if not m.all()})
    return report
