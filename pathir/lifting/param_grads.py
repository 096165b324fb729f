"""The weight-gradients of the path-norm network, per param: diag G (q = 2), path-magnitude scores,
path-norm gradients and path-metrics all read them (docs/math.md §3, §4, §6).

One forward walk of |w|^q on the all-ones input and one backward walk
(:func:`pathir.lifting.walk.path_backward`) give Σ_{p ∋ i} Π_{other factors of p}. On a backend that can
gather, the forward keeps its feature maps along their constant runs (:mod:`pathir.lifting.ones_walk`)
and the backward expands each only while it reads it, dropping it once its last reader is walked: the
walk holds the stored maps, one adjoint per pending edge and the gradients, not every node's full map
twice. Where the fast walks cannot certify a node, both run again with per-channel log-scales
(:mod:`pathir.lifting.scaled`).
"""

from __future__ import annotations

import math

import numpy as np

from pathir.errors import PathirError, PathNormOverflow
from pathir.ir import Graph
from pathir.lifting.low_rank import LowRank
from pathir.lifting.ones_walk import Expanded, ones_forward, ones_log_total
from pathir.lifting.scaled import FLOOR, NORMAL, Certifier, Uncertified, robust_param_grads
from pathir.lifting.walk import log_total, path_backward, path_forward
from pathir.passes import maxpool_to_sum, path_view

__all__ = ["param_grads", "param_log_parts", "at_common_scale", "check_common_scale"]

#: m ⊙ e^L keeps every entry of a param to full precision only where it is within e^SPAN of the param's
#: largest (e^{-708} is float64's smallest normal): one log-scale per param holds no wider spread
SPAN = 708.0


def param_grads(graph: Graph, backend, q: float = 1.0, forward_graph: Graph | None = None,
                totals: dict | None = None, outer=frozenset()) -> dict[int, list]:
    """{id(param of graph): [(array, log-scale) per use]}: the param grads of the
    backward walk on the path-norm network of ``graph`` (weights |w|^q), whose
    weight-gradients read the forward walk of ``forward_graph`` (default
    ``graph``; same structure). An entry is None where no path reaches it; a
    log-scale is a float, or (from the scaled walk) a numpy array broadcastable to
    the param's shape (per target and source channel, or per entry).
    ``totals``, when given, receives ``"log_path_sum"``: log Σ_p |Φ_p|^q of the
    forward walk (what `path_norm.log_path_sum` of ``forward_graph`` returns), at no extra walk.

    Backends with ``power_view`` walk the graph itself (``linearize``); others
    walk ``path_view(maxpool_to_sum(graph), q)``, which gives every edge its own
    Param object, so a shared param has one part per use. Where the fast walks
    cannot certify a node, both walks run again with per-channel log-scales.
    ``outer``: ids of dense and 1×1-convolution params of ``graph`` used once whose grad the fast walks
    keep as a `LowRank` (`path_backward`); the per-channel walk gives every grad as an array."""
    try:
        return _fast_param_grads(graph, backend, q, forward_graph, totals, outer)
    except Uncertified:
        return robust_param_grads(graph, backend, q, forward_graph, totals)


def _fast_param_grads(graph, backend, q, forward_graph, totals, outer):

    fwd = graph if forward_graph is None else forward_graph
    if hasattr(backend, "power_view"):
        view_be = backend.power_view(q)
        cert = Certifier(fwd, q == 0, backend)
        if hasattr(view_be, "take"):  # the forward's maps kept along their constant runs, expanded per read
            stored = ones_forward(fwd, view_be, linearize=True, certify=cert)
            if totals is not None:
                totals["log_path_sum"] = ones_log_total(view_be, stored, fwd.outputs)
            acts = Expanded(view_be, stored, fwd)
        else:
            acts = path_forward(fwd, view_be, linearize=True, certify=cert)
            if totals is not None:
                totals["log_path_sum"] = log_total(view_be, acts, fwd.outputs)
        _, grads = path_backward(graph, view_be, acts, linearize=True,
                                 certify=Certifier(graph, q == 0, backend, forward=cert), outer=outer, node_grads=False)
        return {id(p): [grads.get(id(p))] for p in graph.params()}
    with np.errstate(over="ignore", under="ignore"):  # |w|^q out of range: the walk refuses to certify
        view = path_view(maxpool_to_sum(graph), q)
        fview = view if forward_graph is None else path_view(maxpool_to_sum(fwd), q)
    cert = Certifier(fwd, q == 0, backend)
    acts = path_forward(fview, backend, certify=cert)
    if totals is not None:
        totals["log_path_sum"] = log_total(backend, acts, fview.outputs)
    outer_view = {id(ev.map.weight) for n, nv in zip(graph.nodes, view.nodes) for e, ev in zip(n.edges, nv.edges)
                  if e.map.weight is not None and id(e.map.weight) in outer}
    _, grads = path_backward(view, backend, acts, certify=Certifier(graph, q == 0, backend, forward=cert),
                             outer=outer_view, node_grads=False)
    del acts
    parts: dict[int, list] = {}
    for n, nv in zip(graph.nodes, view.nodes):
        for e, ev in zip(n.edges, nv.edges):
            if e.map.weight is not None:
                parts.setdefault(id(e.map.weight), []).append(grads.get(id(ev.map.weight)))
        if n.bias is not None:
            parts.setdefault(id(n.bias), []).append(grads.get(id(nv.bias)))
    return parts


def param_log_parts(graph: Graph, backend, q: float, scale=None, what: str = "value",
                    totals: dict | None = None, outer=frozenset()) -> list[tuple]:
    """Per param of ``graph.params()``: (m, L) with value = m·e^L, m ≥ 0 of the
    param's shape, max m = 1 (m = 0, L = -inf where the value vanishes), where
    value = |scale(p)| ⊙ (param grad of the path-norm network with weights |w|^q),
    summed over the param's uses. ``scale`` (default 1) gives a numpy array per param.

    q = 2 gives diag G (docs/math.md §6); q = 1 with scale θ the path-magnitude
    scores (docs/math.md §4). ``totals``: as for `param_grads`. ``outer`` (without ``scale``): as for
    `param_grads`; such a param's m is a `LowRank` where the walk kept it so.

    Memory: the walk's param grads are the only full-size arrays. Each is turned
    into its m in place and dropped from the walk's record once read, so the result
    takes the grads' place (about one float64 copy of θ, no second one)."""
    if outer and scale is not None:
        raise ValueError("outer= keeps unscaled grads only")
    parts = param_grads(graph, backend, q, totals=totals, outer=outer)
    out = []
    for p in graph.params():
        terms, uses = [], parts.pop(id(p))
        shared = sum(part is not None for part in uses) > 1
        reached = np.zeros(p.shape, dtype=bool) if shared else None  # the entries some use reaches (a shared param)
        for part in uses:
            if part is None:
                continue
            grad, log_scale = part
            if isinstance(grad, LowRank):  # (a param used once: its only term)
                kept = grad.normalised(float(log_scale), what, p.name)
                if kept is not None:
                    terms.append(kept)
                continue
            m = np.asarray(backend.to_numpy(grad), dtype=np.float64).reshape(p.shape)
            del grad, part
            factor = None if scale is None else np.asarray(scale(p), dtype=np.float64)
            top = None if np.ndim(log_scale) else float(m.max()) if m.size else 0.0
            if top is None or leaves_normal_range(m, factor, top):
                # the scaled walk's per-channel scales, or a product (or its quotient by the largest) that one
                # scale would take out of float64's normal range: |scale| ⊙ grad in log space
                with np.errstate(divide="ignore"):
                    logs = np.log(np.abs(m)) + np.broadcast_to(log_scale, p.shape)
                    if factor is not None:
                        logs += np.log(np.abs(factor))
                if np.any(np.isnan(logs)) or np.any(np.isposinf(logs)):
                    raise PathirError(f"{what} of param '{p.name}' is not finite (NaN or inf weights?)")
                top = float(logs.max(initial=-np.inf))
                if top > -math.inf:
                    if shared:  # judged on the sum of the uses (an entry swamped there by another use is fine)
                        reached |= logs > -np.inf
                    else:
                        _check_span(float(np.min(logs, where=logs > -np.inf, initial=np.inf)), top, what, p.name)
                    terms.append((np.exp(logs - top, out=logs), top))
                continue
            if not m.flags.writeable:  # everything else is the walk's own fresh array
                m = m.copy()
            if factor is not None:
                np.multiply(m, factor, out=m)
                np.abs(m, out=m)  # the grads are >= 0: |scale| ⊙ grad
            peak = top if factor is None else float(m.max()) if m.size else 0.0
            if not math.isfinite(peak):
                raise PathirError(f"{what} of param '{p.name}' is not finite (NaN or inf weights?)")
            if peak > 0:
                if shared:
                    reached |= m > 0
                m /= peak
                terms.append((m, float(log_scale) + math.log(peak)))
        if not terms:
            out.append((np.zeros(p.shape), -math.inf))
            continue
        if len(terms) == 1 and not shared:  # one use: m already has max 1
            out.append(terms[0])
            continue
        top = max(L for _, L in terms)
        m = np.zeros(p.shape)
        while terms:  # a shared param: sum its uses at a common scale, freeing each (a use's entry flushed there
            mt, L = terms.pop()  # is below 2.2e-308 of the scale: lost only where the sum itself is that small)
            m += mt * math.exp(L - top)
            del mt
        peak = float(m.max())
        m /= peak
        lost = reached & (m < NORMAL)
        if lost.any():
            _check_span(-math.inf, top, what, p.name)
        out.append((m, top + math.log(peak)))
    return out


def leaves_normal_range(grad: np.ndarray, factor: np.ndarray | None, top: float) -> bool:
    """Whether ``factor`` ⊙ ``grad`` (a certified weight-gradient in its walk's units: each entry 0 or at least
    FLOOR; ``top`` its largest), or its quotient by its largest entry, could hold a nonzero entry below NORMAL: a
    product that underflows, or one that a single scale per param flushes (a score of 1e-249 beside 1e100 read as
    0). Then the caller works in log space. One pass over ``factor`` where one is given, none over ``grad``."""
    if not math.isfinite(top):
        return False  # (refused as non-finite by the caller)
    if factor is None:
        return FLOOR < NORMAL * max(top, 1.0)
    magnitude = np.abs(factor)
    low = float(magnitude.min(where=magnitude > 0, initial=np.inf))
    return low < np.inf and FLOOR * low < NORMAL * max(top * float(magnitude.max(initial=0.0)), 1.0)


def _check_span(low: float, top: float, what: str, name: str) -> None:
    """Refuse a param whose nonzero entries span more than e^SPAN (lowest e^low, largest e^top; low = -inf: the
    uses of a shared param whose sum leaves an entry below that): one log-scale per param would read its smallest
    entries as 0 or as subnormals."""
    if top - low > SPAN:
        spans = f"spans e^{low:.0f} to e^{top:.0f} within the tensor" if low > -math.inf else \
            "has entries more than e^708 below its largest (its uses differ by that much)"
        fix = ("the scores are the same on every rescaling of the model, so no rescaling brings them closer" if
               "score" in what else
               "where that comes from the scales of whole layers, cm.enorm() balances them first (function kept)")
        raise PathNormOverflow(
            f"{what} of param '{name}' {spans}, wider than float64 holds at one scale (e^{SPAN:.0f}): its smallest "
            f"entries would read as 0. Its layer's weights differ from their neighbours' by hundreds of decades; "
            f"{fix}")


#: the fast walks' grads hold no entry below FLOOR of a mantissa of at most ~1e50 (pathir.lifting.scaled):
#: within e^575 of their param's largest, so only a param e^{SPAN − 575} below the top can lose entries
_FAST_FLOOR = 575.0


def check_common_scale(graph: Graph, parts: list[tuple], what: str) -> None:
    """Refuse (PathNormOverflow, naming the param) where `at_common_scale` would read a nonzero entry of
    ``parts`` (`param_log_parts` of ``graph``) as 0 or as a subnormal: one more than e^SPAN below the
    largest of all. Only params whose scale sits e^{SPAN − 575} below the top are read entry by entry
    (a `LowRank`'s smallest entry is bounded below by its factors')."""
    top = max((L for _, L in parts), default=-math.inf)
    for prm, (m, L) in zip(graph.params(), parts):
        if not (L > -math.inf and L < top - (SPAN - _FAST_FLOOR)):
            continue
        if isinstance(m, LowRank):
            low = sum(math.log(float(np.min(x, where=x > 0, initial=1.0))) for x in (m.b, m.a))
        else:
            low = math.log(float(np.min(m, where=m > 0, initial=1.0)))
        if L + low < top - SPAN:
            raise PathNormOverflow(
                f"{what}: param '{prm.name}' has entries e^{L + low - top:.0f} of the largest of the model, "
                f"below what float64 holds at one scale (e^-{SPAN:.0f}): they would read as 0 and take their "
                "units for degenerate. Where the spread comes from the scales of whole layers (one at 1e-170 "
                "beside layers at 1), cm.enorm(p=1) balances them first (function kept)")


def at_common_scale(parts: list[tuple]) -> tuple[list, float]:
    """``([m·e^{L − top} per part], top)`` of `param_log_parts`' (m, L), top = max L: each m scaled in
    place (copied first where not writeable), so the values share one log-scale with no second copy
    of θ. top is -inf where every value vanishes (the arrays are then all 0)."""
    top = max((L for _, L in parts), default=-math.inf)
    out = []
    for m, L in parts:
        if isinstance(m, LowRank):  # its row factor carries the scale
            m.b *= 0.0 if L == -math.inf else math.exp(L - top)
        elif L != top:  # (then top > -inf)
            if not m.flags.writeable:
                m = m.copy()
            m *= 0.0 if L == -math.inf else math.exp(L - top)
        out.append(m)
    return out, top
