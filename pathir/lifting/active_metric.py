"""The active path-metric (docs/math.md §3 with the masks of §2): per sample x,
brackets of d_x(θ, θ') = ‖(Φ(θ) − Φ(θ')) ⊙ a(θ, x)‖₁, and the local output bound.

With θ's activation pattern at x frozen (:mod:`pathir.lifting.pattern`), the
global brackets of :mod:`pathir.lifting.path_metric` carry over path by path,
a_p being a product of per-neuron and per-edge indicators:

- lower = | ‖Φ(θ) ⊙ a‖₁ − ‖Φ(θ') ⊙ a‖₁ | less the two walks' rounding (``walk_rounding`` of their sum), ≥ 0;
- upper = Σ_{edges u→v} |θ_e − θ'_e| F^a_{|θ'|}(u) G^a_{|θ|}(v) + Σ_{biased v} |b_v − b'_v| G^a_{|θ|}(v),

F^a the masked forward walk on |θ'| (active path sums ending at u), G^a the
masked backward walk on |θ| (active path sums from v's pre-activation on). The
edge sum of one map is ⟨G(v), |W − W'| F(u)⟩: one extra application of the map
with weights |W − W'|. When θ_i θ'_i ≥ 0 and |θ'| ≤ |θ| (or ≥) everywhere, e.g.
pruning, every telescoped term of an active path has one sign: upper = d_x = lower
(``exact``).

If θ' has θ's pattern at x (``shared``), the lifting identity gives
‖R_θ(x) − R_θ'(x)‖₁ ≤ d_x · max(‖x‖∞, 1) whatever the signs: ``bound``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from pathir.errors import PathirError
from pathir.ir.inputs import tensor_float64
from pathir.lifting.active import chunks
from pathir.lifting.path_metric import (
    backend_of,
    check_same_architecture,
    exp_bracket,
    graph_of,
    param_pairs,
    sign_relations,
    walk_rounding,
)
from pathir.lifting.pattern import (
    activation_pattern,
    as_input_dict,
    log_row_total,
    logsumexp_rows,
    masked_backward,
    masked_forward,
    param_log_scale,
    power_walk,
)
from pathir.lifting.scaled import Certifier, Uncertified

__all__ = ["ActivePathMetric", "active_path_metric"]

_LN10 = math.log(10)


@dataclass(frozen=True)
class ActivePathMetric:
    """Per sample (arrays (B,)) brackets of d_x = ‖(Φ(θ) − Φ(θ')) ⊙ a(θ, x)‖₁ and the local bound.

    Attributes
    ----------
    lower, upper : lower ≤ d_x ≤ upper (inf beyond float64: read the log10 fields)
    log10_lower, log10_upper : their log10 (-inf for 0)
    exact : bool, lower = d_x = upper provably (same signs, |θ'| ≤ |θ| or ≥ everywhere)
    same_signs : bool, θ_i θ'_i ≥ 0 for every parameter
    shared : bool array, θ' has θ's activation pattern at x
    flipped : int array, how many ReLU neurons and max-pool selections of θ' differ from θ's at x
    norm_a, norm_b : ‖Φ(θ) ⊙ a(θ, x)‖₁ and ‖Φ(θ') ⊙ a(θ, x)‖₁
    x_scale : max(‖x‖∞, 1)
    bound : upper · x_scale where ``shared`` (a bound on ‖R_θ(x) − R_θ'(x)‖₁), nan elsewhere
    """

    lower: np.ndarray
    upper: np.ndarray
    log10_lower: np.ndarray
    log10_upper: np.ndarray
    exact: bool
    same_signs: bool
    shared: np.ndarray
    flipped: np.ndarray
    norm_a: np.ndarray
    norm_b: np.ndarray
    x_scale: np.ndarray
    bound: np.ndarray

    def to_dict(self) -> dict:
        return {f.name: (v.tolist() if isinstance(v, np.ndarray) else v)
                for f in fields(self) for v in [getattr(self, f.name)]}


def _exp(logs: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.exp(logs)


def _diff_maps(ga, gb, scales=None):
    """{(node name, edge index): map with weights |W − W'|} for the edges whose weights differ,
    and {node name: |b − b'|} for the differing biases; each divided by its param's scale where ``scales``
    {param name: s} is given (the difference of the pair as it is, then scaled: not the difference of two
    rounded quotients)."""
    def over(param):
        return 1.0 if scales is None else scales[param.name]

    edges, biases = {}, {}
    for na, nb in zip(ga.nodes, gb.nodes):
        for i, (ea, eb) in enumerate(zip(na.edges, nb.edges)):
            wa, wb = ea.map.weight, eb.map.weight
            if wa is not None and not np.array_equal(wa.value, wb.value):
                edges[(na.name, i)] = ea.map.with_weights(lambda w, other=wb.value, s=over(wa): np.abs(w - other) / s)
        if na.bias is not None and not np.array_equal(na.bias.value, nb.bias.value):
            biases[na.name] = np.abs(na.bias.value - nb.bias.value) / over(na.bias)
    return edges, biases


def _x_scale(x: dict) -> np.ndarray:
    out = None
    for v in x.values():
        v = tensor_float64(v) if hasattr(v, "detach") else np.asarray(v)
        m = np.abs(np.asarray(v, dtype=np.float64).reshape(v.shape[0], -1)).max(axis=1, initial=0.0)
        out = m if out is None else np.maximum(out, m)
    return np.maximum(out, 1.0)


def _scaled_pair(ga, gb):
    """(θ / s, θ' / s, {param name: s}): both graphs with every param divided by one power of two s, the one at or
    above the larger of its largest |entry| in θ and in θ' (1 where both are 0), so that every weight and bias of
    either is below 1 and each quotient is exact (a normal number divided by a power of two); the walks add log s
    back term by term (``log_scales``). Raises Uncertified where a quotient would leave float64's normal range."""
    scale = {}
    for pa, pb in zip(ga.params(), gb.params()):
        top = max(float(np.max(np.abs(pa.value), initial=0.0)), float(np.max(np.abs(pb.value), initial=0.0)))
        scale[pa.name] = math.ldexp(1.0, math.frexp(top)[1]) if top > 0 and math.isfinite(top) else 1.0

    def divided(p):
        value = p.value / scale[p.name]
        if np.any((p.value != 0) & (np.abs(value) < np.finfo(np.float64).tiny)):  # one 1e-250 of its largest
            raise Uncertified(f"'{p.name}' spreads beyond float64 once divided by its largest entry")
        return p.with_value(value)

    return ga.map_params(divided), gb.map_params(divided), scale


def _chunk_logs(ga, gb, be, x, diff_edges, diff_biases):
    """(log upper, log ‖Φ(θ)⊙a‖₁, log ‖Φ(θ')⊙a‖₁, flipped neurons) for one chunk. The walks are certified like the
    path walks (docs/paths.md); where θ' cannot be, they run again on the pair with every param divided by its
    scale (:func:`_scaled_pair`: weights of 1e-160 or 1e200 then multiply as numbers near 1), and are refused only
    where that cannot be certified either."""
    pat = activation_pattern(ga, be, x)
    flipped = pat.mismatches(activation_pattern(gb, be, x), be)
    try:
        return (*_walk_logs(ga, gb, be, pat, diff_edges, diff_biases, None), flipped)
    except Uncertified:
        pass
    try:
        sa, sb, scales = _scaled_pair(ga, gb)
        diff_edges, diff_biases = _diff_maps(ga, gb, scales)
        return (*_walk_logs(sa, sb, be, pat, diff_edges, diff_biases, {k: math.log(v) for k, v in scales.items()}),
                flipped)
    except Uncertified as err:
        raise PathirError(f"active path-metric: the walks of θ' and θ cannot be certified in float64 ({err}): a "
                          "bracket from them could lose terms; refused (docs/paths.md)") from err


def _walk_logs(ga, gb, be, pat, diff_edges, diff_biases, log_scales):
    """(log upper, log ‖Φ(θ)⊙a‖₁, log ‖Φ(θ')⊙a‖₁) of the pattern ``pat``; ``log_scales``: the params' log-scales
    the walks add (:func:`_scaled_pair`), or None. Raises Uncertified where a walk, or a sum of products of two
    (a contraction), cannot be certified: every node of both walks is checked (the backward's zeros against the
    pattern's support), and each contraction is at least 10·NORMAL per term, or 0 where the supports' is."""
    B = pat.batch
    va, be_a = power_walk(ga, be, 1.0)
    vb, be_b = power_walk(gb, be, 1.0)
    sources = {va.node(name).edges[i].source for name, i in diff_edges}
    cert_f, cert_b = Certifier(gb, False, be, pattern=pat), Certifier(ga, False, be, pattern=pat)
    fb = masked_forward(vb, be_b, pat, keep=sources | set(vb.outputs), certify=cert_f, log_scales=log_scales)
    log_b = log_row_total(be_b, fb, vb.outputs, B)
    upper_logs, norm_logs = [], []

    def certified(total, support, terms: int, where):
        """``total`` (per sample, a sum of ``terms`` products) checked against ``support()`` (the same contraction
        of the supports, walked only where a total is small): ``Certifier.total``."""
        cert_b.total(np.broadcast_to(np.asarray(be.to_numpy(total), dtype=np.float64).reshape(-1), (B,)), support,
                     terms, where)
        return total

    def contract(node, gM):
        g, M = gM
        sup = lambda: cert_b.backward_support()[node.name]  # noqa: E731 (walked only where a total is small)
        for i, e in enumerate(node.edges):
            m = diff_edges.get((node.name, i))
            if m is None or fb[e.source][0] is None:
                continue
            f, L = fb[e.source]
            shape = va.node(e.source).shape
            s = certified(be.row_total(g * be.apply(m, f, shape)),
                          lambda: be.row_total(sup() * be.apply(cert_b.support_map(m), cert_f.forward_support()[1][e.source],
                                                                shape)), m.weight.size + math.prod(node.shape),
                          f"edge {i} of '{node.name}'")
            upper_logs.append(_log(s, B) + L + M + param_log_scale(log_scales, e.map.weight))
        if node.bias is not None:
            bias = be_a.bias(node, g.ndim)
            size = math.prod(node.shape)
            total = certified(be_a.row_total(g * bias), lambda: be.row_total(sup() * (bias != 0)), size,
                              f"the bias of '{node.name}'")
            norm_logs.append(_log(total, B) + M + param_log_scale(log_scales, node.bias))
            if node.name in diff_biases:
                db = be.asarray(diff_biases[node.name].reshape(1, -1, *([1] * (g.ndim - 2))))
                total = certified(be.row_total(g * db), lambda: be.row_total(sup() * (db != 0)), size,
                                  f"the bias of '{node.name}'")
                upper_logs.append(_log(total, B) + M + param_log_scale(log_scales, node.bias))

    grads = masked_backward(va, be_a, pat, on_node=contract, log_scales=log_scales, certify=cert_b)
    norm_logs.append(log_row_total(be_a, grads, va.inputs, B))
    return logsumexp_rows(upper_logs, B), logsumexp_rows(norm_logs, B), log_b


def _log(s, batch: int) -> np.ndarray:
    """log of per-sample sums (B,) (a walk value of batch 1 stands for every sample)."""
    s = np.broadcast_to(np.asarray(s, dtype=np.float64), (batch,))
    if not np.all(np.isfinite(s)):
        raise PathirError("active path-metric: non-finite contribution (NaN or inf weights?)")
    with np.errstate(divide="ignore"):
        return np.log(np.maximum(s, 0.0))




def active_path_metric(a, b, x, backend=None, chunk: int | None = None) -> ActivePathMetric:
    """Per sample of ``x``, brackets of ‖(Φ(θ) − Φ(θ')) ⊙ a(θ, x)‖₁ with θ = ``a``, θ' = ``b``.

    Parameters
    ----------
    a, b : Compiled or Graph of one architecture (checked)
    x : array or tensor (B, *input shape), or {input name: array}
    backend : "torch", "numpy" or a Backend (default: ``a``'s)
    chunk : samples walked at once

    Examples
    --------
    >>> import numpy as np
    >>> from pathir.ir import GraphBuilder, Dense
    >>> def mlp(w1):
    ...     b = GraphBuilder()
    ...     x = b.input("x", (2,))
    ...     h = b.relu("h", [(x, Dense(b.param("w1", w1)))])
    ...     return b.build(outputs=[b.identity("y", [(h, Dense(b.param("w2", [[3.0, 1.0]])))])])
    >>> a, pruned = mlp([[1.0, 2.0], [1.0, -1.0]]), mlp([[1.0, 0.0], [1.0, -1.0]])
    >>> m = active_path_metric(a, pruned, np.array([[1.0, 1.0], [-1.0, 1.0]]), "numpy")
    >>> m.lower, m.exact          # the cut path x1-h0-y (|2*3|) is active at both points
    (array([6., 6.]), True)
    >>> m.shared, m.bound         # at (-1, 1) pruning switches h0 off: no local bound there
    (array([ True, False]), array([ 6., nan]))
    """
    ga, gb = graph_of(a), graph_of(b)
    check_same_architecture(ga, gb)
    be = backend_of(a, backend)
    same, dominated = sign_relations(param_pairs(ga, gb))
    exact = same and dominated
    diff_edges, diff_biases = _diff_maps(ga, gb)
    xs = as_input_dict(ga, x)
    parts = [_chunk_logs(ga, gb, be, part, diff_edges, diff_biases) for part in chunks(ga, xs, chunk)]
    log_up, la, lb, flipped = (np.concatenate(p) for p in zip(*parts))
    shared = flipped == 0
    if exact:
        log_low = log_up
    else:
        top, low = np.maximum(la, lb), np.minimum(la, lb)
        # |A − B| of two norms each summed with relative rounding below r (walk_rounding): the true difference is
        # at least |A − B| − r·(A + B) (two networks with equal Φ gave 1.6e-15 where d_x = 0)
        finite = top[np.isfinite(top)]
        reach = float(np.abs(finite).max()) if finite.size else 0.0
        r = walk_rounding(ga, reach)  # (one architecture: one chain for both)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.exp(low - top)
            gap = -np.expm1(low - top) - r * (1.0 + ratio)
            log_low = np.where(gap > 0, top + np.log(np.where(gap > 0, gap, 1.0)), -math.inf)
        log_low = np.minimum(log_low, log_up)  # rounding must not invert the bracket
    scale = _x_scale(xs)
    upper = exp_bracket(log_up, up=True)  # (below float64's normal range: the next float up, and down for lower)
    return ActivePathMetric(
        lower=exp_bracket(log_low, up=False), upper=upper, log10_lower=log_low / _LN10, log10_upper=log_up / _LN10,
        exact=exact, same_signs=same, shared=shared, flipped=flipped, norm_a=_exp(la), norm_b=_exp(lb),
        x_scale=scale, bound=np.where(shared, upper * scale, np.nan),
    )
