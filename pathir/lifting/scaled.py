"""The certificate of the fast path walks, and the walk with one log-scale per channel.

The fast walks of :mod:`pathir.lifting.walk` and :mod:`pathir.lifting.pattern` keep
each node's tensor as ``m · e^L`` with one L per node (per sample) and read the
weights as ``|w|^q`` in float64. That is exact as long as nothing that matters
underflows or overflows on the way; it stops being so when ``|w|^q`` leaves
float64 (q in the hundreds, a unit rescaled by e^100) or when the neurons of one
node spread beyond float64's range (an extreme rescaling, q in the thousands). So:

- **the certificate** (:class:`Certifier`). A fast walk checks every node's sum
  before renormalising it, with the (min, max) reduction that finds its peak
  anyway. What a walk can lose is bounded: an underflowed weight, product or
  rescaled term is below 2.2e-308 next to a mantissa of at most 1e50, so below
  2.2e-258 of the node's unit. An entry of at least :data:`FLOOR` = 1e-200 has
  lost at most ~1e-58 of itself per term; an entry exactly 0 is exact if no path
  of nonzero weights reaches it (its *support*, walked only when such an entry
  appears). Any other entry, or a non-finite one, raises :class:`Uncertified`,
  and the caller walks again. Weight-gradients are checked the same way.

- **the scaled walk** (:func:`scaled_forward`, :func:`scaled_backward`): every
  node's tensor is ``m ⊙ e^{lc}`` with lc one log-scale per channel and every live
  channel of m of largest entry 1. A weighted edge (dense, conv, scale) is applied
  with its weights folded with the scales in log space,
  ``exp(q log|W| + lc_src − t_tgt)`` with ``t_tgt = max(q log|W| + lc_src)`` over
  the target's entries: every folded weight is at most 1 and nothing is raised to
  q outside a logarithm. A fixed map is applied with its coefficients divided by
  their largest (that largest, to the power q, goes into lc). This is the walk of
  the representation normalised channel by channel (every neuron of a channel
  rescaled by one factor, which leaves every Φ_p unchanged), done as it goes: a
  unit rescaling of θ only shifts the lc of its channels, so the result does not
  depend on the representative. Its terms are at most the fan-in, so it is
  certified with the same check; where the positions of one channel still spread
  beyond float64, :mod:`pathir.lifting.log_walk` (per neuron, exact) answers.

All are walks of the path-norm network of docs/math.md §3 (weights |w|^q, ReLUs
and max-pools linearised, or with an activation pattern frozen), on the all-ones input.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from pathir.errors import PathirError
from pathir.ir import Graph, MapKind, NodeKind
from pathir.lifting.log_walk import log_backward, log_forward, log_grand_total

__all__ = ["Uncertified", "FLOOR", "NORMAL", "check_stored", "Certifier", "scaled_forward", "scaled_backward", "scaled_log_total",
           "robust_log_path_sum", "robust_param_grads"]

#: an entry below this (in the units of the sum it belongs to) is not certified
FLOOR = 1e-200
#: an entry of a node's sum, once divided by the sum's largest, must stay at least this: a normal float64 (one of
#: 1e-160 beside 1e160 is stored as 1e-320, flushed to 0, and every path through it lost). Products of it that
#: underflow later are bounded by the next node's own check, as any product's
NORMAL = 1e-290

_NONFINITE = "non-finite value in a path computation (NaN or inf weights?)"


class Uncertified(PathirError):
    """A fast walk cannot certify a node (a channel below :data:`FLOOR` or non-finite):
    caught by the walk's caller, which walks again with :func:`scaled_forward`."""


# ------------------------------------------------------------------ support


def _support_map(m, zeros_count: bool):
    """``m`` with every edge of nonzero weight read as 1 and every other as 0 (every edge of
    a free weight as 1 with ``zeros_count``): its walks say which neurons nonzero paths reach.
    Made for each use and dropped after it: a support walk holds one layer's 0/1 weights, not a
    float64 copy of the model's."""
    def free(w):
        return np.ones(w.shape) if zeros_count else (w != 0).astype(np.float64)

    return m.with_weights(free, lambda c: (c != 0).astype(np.float64))


class Certifier:
    """The checks of a fast walk of ``graph`` on ``backend`` (see the module docstring).

    The walk is fed the all-ones input, biases included. ``zeros_count``: every edge of a free
    weight counts (q = 0, path counts); ``pattern`` (and ``sample``, one of its samples, or all):
    an activation pattern frozen; ``forward``: the certifier of the walk whose values feed the
    weight-gradients of this (backward) one, if not this one's graph. A check
    raises :class:`Uncertified` unless every entry is finite and at least :data:`FLOOR`
    (in the units of the sum it belongs to) or exactly 0 where no nonzero path reaches it.
    The support (which neurons nonzero paths reach, from the inputs or to the outputs; with a
    pattern, through its active neurons and max-pool choices on the backward side) is walked only
    when a zero entry has to be judged."""

    def __init__(self, graph: Graph, zeros_count: bool, backend, pattern=None, sample=None,
                 forward: "Certifier | None" = None):
        self.graph, self.zeros_count = graph, zeros_count
        self.backend = getattr(backend, "base", backend)  # a power view's own backend: 0/1 weights as they are
        self.pattern, self.sample = pattern, sample
        self._source = forward  # the certifier of the walk whose values feed the weight-gradients
        self._forward = self._backward = None

    def node(self, name: str, acc, backward: bool = False, full=None, masked: bool = False) -> float:
        """Check the sum ``acc`` (before renormalisation) of node ``name``, forward or backward;
        returns its largest entry. ``full(acc)``: the node's full tensor, where ``acc`` is stored
        compressed (pathir.lifting.ones_walk), read only to judge entries that are 0. ``masked``: a forward
        ``acc`` already multiplied by the pattern's mask (its zeros judged against the support after it; a
        backward one with a pattern always is)."""
        hi = self._fine(acc)
        if hi is None:
            acc = acc if full is None else full(acc)
            sup = self.backward_support()[name] if backward else self.forward_support()[1 if masked else 0][name]
            self._zeros(acc, sup, f"node '{name}'")
            hi = float(self.backend.extrema(acc)[1])
        return hi

    def weights(self, name: str, source: str, target: str, m, in_shape, grad) -> None:
        """Check the weight-gradient ``grad`` of map ``m`` (an edge source → target)."""
        if self._fine(grad) is not None:
            return
        be = self.backend
        fwd = (self if self._source is None else self._source).forward_support()[1]
        sup = be.weight_grad(m, fwd[source], self.backward_support()[target], in_shape)
        self._zeros(grad, sup > 0, f"the gradient of '{name}'")

    def bias_grad(self, name: str, node: str, grad) -> None:
        if self._fine(grad) is not None:
            return
        self._zeros(grad, self.backend.channel_sum(self.backward_support()[node]) > 0, f"the gradient of '{name}'")

    def _fine(self, acc) -> float | None:
        """The largest entry if every entry is at least FLOOR; None if some are exactly 0
        (to be judged by the support); raises if one is finite, positive and below FLOOR."""
        lo, hi = self.backend.extrema(acc)
        if not (math.isfinite(lo) and math.isfinite(hi)) or lo < 0:
            raise Uncertified(_NONFINITE)
        if lo >= FLOOR:
            return hi
        if bool(((acc > 0) & (acc < FLOOR)).any()):
            raise Uncertified(f"an entry below {FLOOR:g} of its sum's scale")
        return None

    def total(self, value: np.ndarray, support, terms: int, where: str) -> None:
        """Check per-sample sums of ``terms`` products, ``value`` (B,), of two certified walks' stored tensors:
        each at least ``terms`` × :data:`NORMAL` × 10 (a product lost to underflow is below 2.2e-308, so all of
        them below 1e-16 of the sum), or 0 where ``support()`` (the same sums over the walks' supports, computed
        only where a sum is below that) is 0."""
        value = np.asarray(value, dtype=np.float64)
        floor = 10 * NORMAL * max(int(terms), 1)
        if not np.any(value < floor):
            return
        reached = np.broadcast_to(np.asarray(self.backend.to_numpy(support()), dtype=np.float64).reshape(-1),
                                  value.shape) > 0
        if bool(np.any((value < floor) & reached)):
            raise Uncertified(f"{where}: a sum of products below {floor:g} that nonzero paths reach")

    @staticmethod
    def _zeros(acc, sup, where: str) -> None:
        if bool(((acc == 0) & (sup > 0)).any()):
            raise Uncertified(f"{where}: an entry reached by nonzero paths sums to 0")

    def forward_support(self) -> tuple[dict, dict]:
        """({node: bool array, before its ReLU mask}, {node: 0/1 array, after it})."""
        if self._forward is None:
            self._forward = self._walk_forward()
        return self._forward

    def _slice(self, a):
        return a if self.sample is None else a[self.sample:self.sample + 1]

    def _walk_forward(self):
        g, be, pat = self.graph, self.backend, self.pattern
        pre, post = {}, {}
        for node in g.nodes:
            shape = (1, *node.shape)
            if node.kind is NodeKind.INPUT:
                post[node.name] = be.ones(shape)
                continue
            acc = be.zeros(shape)
            for e in node.edges:
                src, x = g.node(e.source).shape, post[e.source]
                if pat is not None and node.kind is NodeKind.MAXPOOL:
                    acc = acc + be.select_apply(node, self._slice(pat.choice[node.name]), x, src)
                else:
                    acc = acc + be.apply(self.support_map(e.map), x, src)
            if node.bias is not None:
                b = node.bias.value
                on = np.ones(b.shape) if self.zeros_count else (b != 0).astype(np.float64)
                acc = acc + be.asarray(on.reshape(_bshape(b.size, len(shape))))
            pre[node.name] = acc > 0
            mask = pre[node.name]
            if pat is not None and node.kind is NodeKind.RELU:
                mask = mask & self._slice(pat.relu[node.name])
            post[node.name] = be.asarray(mask * 1.0)
        return pre, post

    def backward_support(self) -> dict:
        """{node: 0/1 array}: 1 where a path of nonzero weights leads from the neuron to an output (with a
        pattern: through active neurons and chosen max-pool inputs only, the neuron itself active)."""
        if self._backward is None:
            g, be, pat = self.graph, self.backend, self.pattern
            pending = {o: be.ones((1, *g.node(o).shape)) for o in g.outputs}  # (a node no path leaves: none)
            out = {}
            for node in reversed(g.nodes):
                got = pending.pop(node.name, None)
                reach = got > 0 if got is not None else be.zeros((1, *node.shape)) > 0
                if pat is not None and node.kind is NodeKind.RELU:
                    reach = reach & self._slice(pat.relu[node.name])
                sup = be.asarray(reach * 1.0)
                out[node.name] = sup
                for e in node.edges:
                    src = g.node(e.source).shape
                    if pat is not None and node.kind is NodeKind.MAXPOOL:
                        back = be.select_adjoint(node, self._slice(pat.choice[node.name]), sup, src)
                    else:
                        back = be.adjoint(self.support_map(e.map), sup, src)
                    pending[e.source] = pending[e.source] + back if e.source in pending else back
            self._backward = out
        return self._backward

    def support_map(self, m):
        """``m`` with every edge of nonzero weight read as 1 (the support walks' map)."""
        return _support_map(m, self.zeros_count)


def check_stored(acc, stored) -> None:
    """Raise Uncertified where an entry of a node's sum ``acc`` (> 0) is below :data:`NORMAL` once divided by the
    sum's largest (``stored``, the walk's renormalised tensor of the same shape)."""
    if bool(((acc > 0) & (stored < NORMAL)).any()):
        raise Uncertified(f"an entry below {NORMAL:g} of its sum's largest: renormalised, it would leave float64's "
                          "normal range")


# ------------------------------------------------------------ per-channel scales


def _bshape(C: int, ndim: int) -> tuple:
    return (1, C, *([1] * (ndim - 2)))


def _factors(lc: np.ndarray, top: np.ndarray) -> np.ndarray:
    """exp(lc − top), 0 where lc = −inf (top ≥ lc)."""
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(invalid="ignore"):
        return np.where(np.isneginf(lc), 0.0, np.exp(lc - safe))


def _scale_channels(be, m, f: np.ndarray):
    """m with channel c multiplied by f[c] (no-op when all are 1)."""
    if np.all(f == 1.0):
        return m
    return m * be.asarray(f.reshape(_bshape(f.size, m.ndim)))


def _normalise(be, acc, top: np.ndarray):
    """(acc / largest entry per channel, top + log of it): every live channel of largest entry 1."""
    cmax = np.asarray(be.channel_amax(acc), dtype=np.float64).max(axis=0)
    if not np.all(np.isfinite(cmax)) or np.any(np.isposinf(top)) or np.any(np.isnan(top)):
        raise PathirError(_NONFINITE)
    live = cmax > 0
    if not live.any():
        return None, None
    acc = acc / be.asarray(np.where(live, cmax, 1.0).reshape(_bshape(cmax.size, acc.ndim)))
    with np.errstate(divide="ignore"):
        lc = np.where(live, top + np.log(np.where(live, cmax, 1.0)), -np.inf)
    return acc, lc


def _combine(be, terms, shape, check=None):
    """Σ_t m_t ⊙ e^{lc_t} as a normalised (m, lc); (None, None) if no term reaches the node.
    ``check(acc)`` certifies the sum first (its units: every term's channels at most ~fan-in)."""
    terms = [(m, lc) for m, lc in terms if m is not None and np.any(lc > -np.inf)]
    if not terms:
        return None, None
    top = np.max(np.stack([lc for _, lc in terms]), axis=0)
    acc = None
    for m, lc in terms:
        t = _scale_channels(be, m, _factors(lc, top))
        acc = t if acc is None else acc + t
    if tuple(acc.shape[1:]) != tuple(shape):
        acc = acc + be.zeros((1, *shape))
    if check is not None:
        check(acc)
    return _normalise(be, acc, top)


def _log_abs(W: np.ndarray, q: float) -> np.ndarray:
    """q log|W| (−inf where W = 0); q = 0: 0 everywhere (every edge counts)."""
    if q == 0:
        return np.zeros(W.shape)
    with np.errstate(divide="ignore"):
        return q * np.log(np.abs(W))


#: maps whose coefficients join source channels to other target channels entry by entry
_CHANNEL_MIXING = frozenset({MapKind.DENSE, MapKind.CONV, MapKind.SCALE, MapKind.FIXED_CONV})


def _mixing_parts(m, q: float, in_shape):
    """(coefficients, their target and source channels, q log|c|): a free weight's zeros count at
    q = 0, a fixed kernel's zeros are no edge (−inf)."""
    if m.kind is MapKind.FIXED_CONV:
        W = m.kernel
        o, c = m.kernel_channels(in_shape)
        logs = _log_abs(W, q) if q != 0 else np.where(W != 0, 0.0, -np.inf)
        return W, o, c, logs
    W = m.weight.value
    o, c = m.weight_channels(in_shape)
    return W, o, c, _log_abs(W, q)


def _subtract(E0: np.ndarray, t: np.ndarray) -> np.ndarray:
    """E0 − t with −inf where t = −inf (the whole target is zero)."""
    dead = np.isneginf(t)
    with np.errstate(invalid="ignore"):
        return np.where(dead, -np.inf, E0 - np.where(dead, 0.0, t))


def _finite_or_raise(*arrays) -> None:
    for a in arrays:
        if np.any(np.isnan(a)) or np.any(np.isposinf(a)):
            raise PathirError(_NONFINITE)


def _by_source(E: np.ndarray, m, in_shape) -> np.ndarray:
    """max of E (the weight's shape) over the entries reading each source channel: (C_source,)."""
    c_in = in_shape[0]
    if m.kind is MapKind.SCALE:
        return E
    if m.kind is MapKind.DENSE:
        return E.max(axis=0).reshape(c_in, -1).max(axis=1)
    O, I_g = E.shape[:2]
    per = E.reshape(m.groups, O // m.groups, I_g, -1).max(axis=(1, 3))
    return per.reshape(c_in)


class _Fixed:
    """A fixed map with its coefficients divided by their largest, to the power q, and the
    log of that largest to the power q (a float, or per channel for a per-channel pool)."""

    def __init__(self, m, q: float, in_shape):
        self.map, self.log = m, 0.0

        def norm(a, top):
            with np.errstate(divide="ignore", invalid="ignore"):
                r = np.abs(a) / np.where(top > 0, top, 1.0)
                return np.where(a != 0, 1.0 if q == 0 else r ** q, 0.0)

        def log_of(top):
            with np.errstate(divide="ignore"):
                return np.where(top > 0, 0.0 if q == 0 else q * np.log(np.where(top > 0, top, 1.0)), -np.inf)

        if m.kind is MapKind.POOL and m.mult is not None:
            mult = np.asarray(m.mult)
            if mult.ndim == len(in_shape):  # per channel
                top = np.abs(mult).reshape(mult.shape[0], -1).max(axis=1)
                self.map = replace(m, mult=norm(mult, top.reshape(-1, *([1] * (mult.ndim - 1)))))
                self.log = log_of(top)
            else:
                top = np.abs(mult).max(initial=0.0)
                self.map, self.log = replace(m, mult=norm(mult, top)), float(log_of(top))
        elif m.kind is MapKind.SPATIAL_MATRIX:
            top = np.abs(m.matrix).max(initial=0.0)
            self.map, self.log = replace(m, matrix=norm(m.matrix, top)), float(log_of(top))
        elif m.kind is MapKind.RESAMPLE:
            tops = [np.abs(a).max(initial=0.0) for a in m.matrices]
            self.map = replace(m, matrices=tuple(norm(a, t) for a, t in zip(m.matrices, tops)))
            self.log = float(sum(log_of(t) for t in tops))


def _element_lc(lc: np.ndarray, shape) -> np.ndarray:
    """The per-channel log-scales read per element of a tensor of ``shape`` (C order, flat)."""
    return np.repeat(lc, math.prod(shape[1:]))


def _target_elements(m, lc_el: np.ndarray) -> np.ndarray:
    """Per target element of a reshape or gather, the log-scale of the source element it reads."""
    if m.kind is MapKind.RESHAPE:
        return lc_el
    idx = np.asarray(m.index)
    return np.where(idx >= 0, lc_el[np.where(idx >= 0, idx, 0)], -np.inf)


def _forward_term(be, m, x, lc, in_shape, q, cache):
    """(map applied to x ⊙ e^{lc}) as (y, lc_y), y's channels of largest entry at most ~1."""
    in_shape = tuple(in_shape)
    if m.kind in _CHANNEL_MIXING:
        W, o, c, logs = _mixing_parts(m, q, in_shape)
        E0 = logs + lc[c]
        t = E0.reshape(W.shape[0], -1).max(axis=1) if E0.size else np.full(W.shape[0], -np.inf)
        _finite_or_raise(E0, t)
        Wq = np.exp(_subtract(E0, t[o]))
        return be.apply(m.with_weights(lambda _: Wq), x, in_shape), t
    fixed = cache.get(id(m))
    if fixed is None:
        fixed = cache[id(m)] = _Fixed(m, q, in_shape)
    y = be.apply(fixed.map, x, in_shape)
    if m.kind is MapKind.CHANNEL_MAP:
        idx = np.asarray(m.index)
        return y, np.where(idx >= 0, lc[np.where(idx >= 0, idx, 0)], -np.inf)
    if m.kind in (MapKind.RESHAPE, MapKind.GATHER):
        out = m.out_shape(in_shape)
        el = _target_elements(m, _element_lc(lc, in_shape))
        lc_t = el.reshape(out[0], -1).max(axis=1, initial=-np.inf)
        f = _factors(el, np.repeat(lc_t, math.prod(out[1:])))
        if not np.all(f == 1.0):
            y = y * be.asarray(f.reshape(1, *out))
        return y, lc_t
    return y, lc + fixed.log


def _adjoint_term(be, m, g, lcg, in_shape, q, cache):
    """(adjoint of the map applied to g ⊙ e^{lcg}) as (gx, lc_gx)."""
    in_shape = tuple(in_shape)
    if m.kind in _CHANNEL_MIXING:
        W, o, c, logs = _mixing_parts(m, q, in_shape)
        E0 = np.broadcast_to(logs + lcg[o], W.shape)
        t = _by_source(E0, m, in_shape) if E0.size else np.full(in_shape[0], -np.inf)
        _finite_or_raise(E0, t)
        Wq = np.exp(_subtract(E0, t[c]))
        return be.adjoint(m.with_weights(lambda _: Wq), g, in_shape), t
    fixed = cache.get(id(m))
    if fixed is None:
        fixed = cache[id(m)] = _Fixed(m, q, in_shape)
    if m.kind is MapKind.CHANNEL_MAP:
        idx = np.asarray(m.index)
        keep = idx >= 0
        lc_s = np.full(in_shape[0], -np.inf)
        np.maximum.at(lc_s, idx[keep], lcg[keep])
        f = np.where(keep, _factors(lcg, lc_s[np.where(keep, idx, 0)]), 0.0)
        return be.adjoint(m, _scale_channels(be, g, f), in_shape), lc_s
    if m.kind in (MapKind.RESHAPE, MapKind.GATHER):
        out = m.out_shape(in_shape)
        el = _element_lc(lcg, out)  # per target element
        src = np.arange(el.size) if m.kind is MapKind.RESHAPE else np.asarray(m.index)
        keep = src >= 0
        lc_el = np.full(math.prod(in_shape), -np.inf)
        np.maximum.at(lc_el, src[keep], el[keep])
        lc_s = lc_el.reshape(in_shape[0], -1).max(axis=1, initial=-np.inf)
        ch = src // max(1, math.prod(in_shape[1:]))
        f = np.where(keep, _factors(el, lc_s[np.where(keep, ch, 0)]), 0.0)
        if not np.all(f == 1.0):
            g = g * be.asarray(f.reshape(1, *out))
        return be.adjoint(m, g, in_shape), lc_s
    return be.adjoint(fixed.map, g, in_shape), lcg + fixed.log


def _bias_term(be, node, q):
    b = node.bias.value
    lc = np.zeros(b.shape) if q == 0 else _log_abs(b, q)
    m = np.ones(b.shape) if q == 0 else (b != 0).astype(np.float64)
    return be.asarray(m.reshape(_bshape(b.size, len(node.shape) + 1))), lc


def _per_channel(graph: Graph) -> None:
    """Raise Uncertified where a node has no channel axis (one number per sample, shape ()): the per-channel walk
    does not read it, and its caller walks per neuron (log space) instead."""
    for node in graph.nodes:
        if not node.shape:
            raise Uncertified(f"node '{node.name}' holds one number per sample (shape ()): no channel to scale")


def scaled_forward(graph: Graph, backend, q: float, pattern=None, sample: int = 0) -> dict:
    """The path-norm network's forward walk with per-channel log-scales (module docstring).

    ``graph`` holds θ itself (weights read as |w|^q here; q = 0: every edge and existing bias
    counts 1), fed the all-ones input. Without ``pattern`` ReLUs and max-pools are linearised
    (a max-pool sums its window); with it, sample ``sample`` of the pattern is frozen: ReLU
    masks, max-pool selections. Returns {node: (m, lc)}, value m ⊙ e^{lc} per channel
    ((None, None) where nothing reaches the node); m has batch 1."""
    _per_channel(graph)
    be, cache, acts = backend, {}, {}
    cert = Certifier(graph, q == 0, be, pattern=pattern, sample=None if pattern is None else sample)
    with be.flush_denormals():
        for node in graph.nodes:
            if node.kind is NodeKind.INPUT:
                acts[node.name] = (be.ones((1, *node.shape)), np.zeros(node.shape[0]))
                continue
            terms = []
            for e in node.edges:
                x, lc = acts[e.source]
                if x is None:
                    continue
                src = graph.node(e.source).shape
                if pattern is not None and node.kind is NodeKind.MAXPOOL:
                    choice = pattern.choice[node.name][sample:sample + 1]
                    terms.append((be.select_apply(node, choice, x, src), lc))
                else:
                    terms.append(_forward_term(be, e.map, x, lc, src, q, cache))
            if node.bias is not None:
                terms.append(_bias_term(be, node, q))
            m, lc = _combine(be, terms, node.shape, lambda acc, name=node.name: cert.node(name, acc))
            if m is not None and pattern is not None and node.kind is NodeKind.RELU:
                m = m * pattern.relu[node.name][sample:sample + 1]
                cut, shift = _normalise(be, m, np.zeros_like(lc))
                m, lc = (None, None) if cut is None else (cut, lc + shift)
            acts[node.name] = (m, lc)
    return acts


def scaled_backward(graph: Graph, backend, q: float, acts: dict, forward_graph: Graph | None = None) -> tuple[dict, dict]:
    """The reverse walk of :func:`scaled_forward` (linearised), seeded by ones at the outputs.

    ``acts``: a forward walk of ``forward_graph`` (default ``graph``; same structure), whose
    values feed the weight-gradients. Raises :class:`Uncertified` as the forward. Returns (node grads {name: (m, lc)}, param parts
    {id(param): [(array, L) per use]}) with the weight-gradient of a use = array ⊙ e^L, L a
    numpy array broadcastable to the param's shape (per target and source channel)."""
    _per_channel(graph)
    be, cache = backend, {}
    fwd = Certifier(graph if forward_graph is None else forward_graph, q == 0, be)
    cert = Certifier(graph, q == 0, be, forward=fwd)
    pending: dict[str, list] = {n.name: [] for n in graph.nodes}
    for o in graph.outputs:
        node = graph.node(o)
        pending[o].append((be.ones((1, *node.shape)), np.zeros(node.shape[0])))
    grads, parts = {}, {}
    with be.flush_denormals():
        for node in reversed(graph.nodes):
            g, lcg = _combine(be, pending.pop(node.name), node.shape,
                              lambda acc, name=node.name: cert.node(name, acc, backward=True))
            grads[node.name] = (g, lcg)
            if g is None or node.kind is NodeKind.INPUT:
                continue
            for e in node.edges:
                src = graph.node(e.source).shape
                pending[e.source].append(_adjoint_term(be, e.map, g, lcg, src, q, cache))
                x, lcx = acts[e.source]
                if e.map.weight is not None and x is not None:
                    o, c = e.map.weight_channels(tuple(src))
                    wg = be.weight_grad(e.map, x, g, src)
                    cert.weights(e.map.weight.name, e.source, node.name, e.map, src, wg)
                    parts.setdefault(id(e.map.weight), []).append((wg, lcg[o] + lcx[c]))
            if node.bias is not None:
                bg = be.channel_sum(g)
                cert.bias_grad(node.bias.name, node.name, bg)
                parts.setdefault(id(node.bias), []).append((bg, lcg.copy()))
    return grads, parts


def scaled_log_total(backend, acts: dict, names) -> float:
    """log of the sum of every entry of the named nodes of a scaled walk (-inf if zero)."""
    logs = []
    for n in names:
        m, lc = acts[n]
        if m is None:
            continue
        s = np.asarray(backend.to_numpy(backend.channel_sum(m)), dtype=np.float64)
        live = s > 0
        logs.extend((np.log(s[live]) + lc[live]).tolist())
    if not logs:
        return -math.inf
    top = max(logs)
    return top + math.log(math.fsum(math.exp(v - top) for v in logs))


def robust_log_path_sum(graph: Graph, backend, q: float, pattern=None, sample: int = 0) -> float:
    """log Σ_p |Φ_p|^q (a_p of ``pattern``'s sample ``sample`` if given) by the scaled walk,
    or where it cannot certify its sums, by the exact log-space walk (:mod:`pathir.lifting.log_walk`)."""

    try:
        return scaled_log_total(backend, scaled_forward(graph, backend, q, pattern, sample), graph.outputs)
    except Uncertified:
        return log_grand_total(log_forward(graph, q, pattern, sample, backend), graph.outputs)


def robust_param_grads(graph: Graph, backend, q: float, forward_graph: Graph | None = None,
                       totals: dict | None = None) -> dict[int, list]:
    """`pathir.lifting.param_grads.param_grads` by the scaled walks, or the exact log-space ones."""

    fwd = graph if forward_graph is None else forward_graph
    try:
        acts = scaled_forward(fwd, backend, q)
        total = scaled_log_total(backend, acts, fwd.outputs)
        _, parts = scaled_backward(graph, backend, q, acts, forward_graph)
    except Uncertified:
        acts = log_forward(fwd, q)
        total = log_grand_total(acts, fwd.outputs)
        parts = log_backward(graph, q, acts)
    if totals is not None:
        totals["log_path_sum"] = total
    return {id(p): parts.pop(id(p), [None]) for p in graph.params()}
