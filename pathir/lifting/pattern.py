"""Activation patterns at data and the walks of the path network they freeze.

The activation pattern of θ at a batch x (docs/math.md §2) is, per sample:

- for every ReLU neuron, whether its pre-activation is > 0;
- for every k-max-pool neuron, the antecedent it selects: the first, in
  flat-index order over its window, attaining the k-th largest weighted input.

A path is active (a_p(θ, x) = 1) iff every ReLU neuron on it is active and
every edge of it into a k-max-pool is the selected one. a_p is a product of
per-neuron and per-edge indicators, so with the pattern frozen every sum over
active paths is one walk of the graph in which a ReLU node multiplies by its
0/1 mask and a k-max-pool node passes only its selected antecedent:

- :func:`masked_forward` (inputs, biases, masks) → Σ over active paths ending at
  each neuron, of the walk's weights — on the |θ|^q network with the all-ones
  input, the terms of Σ_p |Φ_p|^q a_p;
- :func:`masked_backward` (output seeds) → per neuron the sum over active paths
  from it to an output (the gradient w.r.t. its pre-activation).

Both keep every node's value as ``(m, L)`` with value m · exp(L) and L a numpy
array (B,) — one log-scale per sample, so that samples whose path sums differ
by any factor stay exact (1e-50 ≤ max|m[b]| ≤ 1e50, as in
:mod:`pathir.lifting.walk`); with a :class:`~pathir.lifting.scaled.Certifier` the forward
walk certifies every node as the path walks do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from pathir.errors import BackendError, InputShapeError, PathirError, PathNormOverflow
from pathir.ir import Graph, Node, NodeKind
from pathir.ir.inputs import refuse_unreadable
from pathir.lifting.scaled import Uncertified, check_stored
from pathir.lifting.walk import flushing, readable
from pathir.passes.path_view import abs_pow

__all__ = ["ActivationPattern", "activation_pattern", "masked_forward", "masked_backward", "param_log_scale", "power_walk",
           "as_input_dict", "to_value"]

#: the band of the samples' mantissas (as in pathir.lifting.walk, whose certificate bounds hold here)
_LOW, _HIGH = 1e-50, 1e50
_SPAN, _LOG_LOST = 700.0, math.log(2.2e-258)


@dataclass
class ActivationPattern:
    """a(θ, x) of one graph at a batch, neuron-wise.

    ``relu[name]``: boolean mask (B, *shape) of a ReLU node (True where pre-activation > 0);
    ``choice[name]``: the selected window offset (B, C, *out) of a k-max-pool node;
    ``outputs``: the graph's outputs at x; arrays are the backend's."""

    batch: int
    relu: dict
    choice: dict
    outputs: dict

    def mismatches(self, other: "ActivationPattern", backend) -> np.ndarray:
        """Per sample: how many ReLU neurons and k-max-pool selections differ in ``other`` (int array (B,))."""
        count = np.zeros(self.batch, dtype=np.int64)
        for store, theirs in ((self.relu, other.relu), (self.choice, other.choice)):
            for name, mine in store.items():
                count += np.asarray(backend.row_total(mine != theirs[name])).astype(np.int64)
        return count

    def same_as(self, other: "ActivationPattern", backend) -> np.ndarray:
        """Per sample: whether ``other`` has this pattern exactly (bool array (B,))."""
        return self.mismatches(other, backend) == 0

    def active_fraction(self, backend) -> np.ndarray:
        """Per sample: the fraction of ReLU neurons that are active (nan without ReLU)."""
        on, total = np.zeros(self.batch), 0
        for mask in self.relu.values():
            on += np.asarray(backend.row_total(mask))
            total += int(np.prod(mask.shape[1:]))
        return on / total if total else np.full(self.batch, np.nan)


def as_input_dict(graph: Graph, x) -> dict:
    """{input name: array (B, *shape)} from one array or a dict; checks names and shapes."""
    if not isinstance(x, dict):
        if len(graph.inputs) != 1:
            raise InputShapeError(f"x: the graph has inputs {list(graph.inputs)}: pass a dict {{input name: array}}")
        x = {graph.inputs[0]: x}
    for k, v in x.items():
        refuse_unreadable(k, v)  # (a list read as numpy reads it)
    x = {k: v if hasattr(v, "shape") else np.asarray(v, dtype=np.float64) for k, v in x.items()}  # nested lists
    x = {k: v.detach() if hasattr(v, "detach") else v for k, v in x.items()}  # (a tensor that requires grad)
    x = {k: readable(v) for k, v in x.items()}
    x = {k: np.ascontiguousarray(v) if isinstance(v, np.ndarray) and any(st < 0 for st in v.strides) else v
         for k, v in x.items()}  # a reversed view (x[::-1]): torch reads no negative strides
    unknown = [k for k in x if k not in graph.inputs]
    if unknown:
        raise InputShapeError(f"x: {unknown} name no input of the graph (its inputs: {list(graph.inputs)})")
    for name in graph.inputs:
        if name not in x:
            raise InputShapeError(f"x: no value for input '{name}': a dict of inputs is keyed by the graph's input "
                                  f"names {list(graph.inputs)}, got keys {list(x)}")
        shape = tuple(x[name].shape)
        if shape[1:] != graph.node(name).shape:
            raise InputShapeError(f"x: input '{name}' expects (B, {', '.join(map(str, graph.node(name).shape))}), "
                                  f"got {shape}")
    batches = {int(x[name].shape[0]) for name in graph.inputs}
    if len(batches) != 1:
        raise InputShapeError(f"x: the inputs have different batch sizes {sorted(batches)}")
    if batches == {0}:
        raise InputShapeError("x: an empty batch (0 samples): there is no activation pattern to read; pass at least "
                              "one sample (pathir.observe takes an empty data set and returns an empty table)")
    for name in graph.inputs:
        v = x[name]
        finite = v.isfinite().all() if hasattr(v, "isfinite") else np.isfinite(np.asarray(v, dtype=np.float64)).all()
        if not bool(finite):
            raise InputShapeError(f"x: input '{name}' holds NaN or infinite entries: the network's output is not a "
                                  "number there, and no activation pattern, path-norm or bound describes it")
    return x


def _context(node: Node) -> str:
    return f"while evaluating node '{node.name}' ({node.kind.value}, {'x'.join(map(str, node.shape))})"


def _last_uses(graph: Graph) -> dict[str, int]:
    last = {}
    for i, node in enumerate(graph.nodes):
        for e in node.edges:
            last[e.source] = i
    return last


def activation_pattern(graph: Graph, backend, x) -> ActivationPattern:
    """Run θ on the batch ``x`` (array (B, *shape) or {input: array}) and record its pattern.

    A node's value is dropped after its last consumer, so only the masks (and
    the outputs) outlive the forward."""
    x = as_input_dict(graph, x)
    last, outputs = _last_uses(graph), set(graph.outputs)
    acts, relu, choice = {}, {}, {}
    batch = int(next(iter(x.values())).shape[0])
    for i, node in enumerate(graph.nodes):
        try:
            if node.kind is NodeKind.INPUT:
                acts[node.name] = backend.asarray(x[node.name])
                continue
            if node.kind is NodeKind.MAXPOOL:
                src = graph.node(node.edges[0].source)
                _check_finite(backend, node, acts[src.name], "its window's values")
                pre = backend.kth_max_pool(node, acts[src.name], src.shape)
                choice[node.name] = backend.pool_choice(node, acts[src.name], src.shape, kth=pre)
            else:
                pre = None
                for e in node.edges:
                    t = backend.apply(e.map, acts[e.source], graph.node(e.source).shape)
                    pre = t if pre is None else pre + t
            if node.bias is not None:
                pre = pre + backend.bias(node, len(node.shape) + 1)
            if node.kind is NodeKind.RELU:
                _check_finite(backend, node, pre, "its pre-activation")
                relu[node.name] = pre > 0  # bool: 1 byte per neuron and sample
                pre = backend.relu(pre)
            acts[node.name] = pre
        except PathirError:
            raise
        except Exception as err:
            raise BackendError(f"{_context(node)}: {type(err).__name__}: {err}") from err
        for e in node.edges:
            if last.get(e.source) == i and e.source not in outputs:
                acts.pop(e.source, None)
    return ActivationPattern(batch, relu, choice, {o: acts[o] for o in graph.outputs})


def _check_finite(backend, node: Node, values, what: str) -> None:
    """PathirError where ``values`` (a batch), which decide ``node``'s pattern, are not all finite: the float64
    forward at x overflowed (a representative whose hidden values pass 1.8e308, inputs far out of scale), and a
    sign or a max read off inf or NaN is not the network's. The sympy backend is exact: nothing to check."""
    if backend.name == "sympy":
        return
    lo, hi = backend.extrema(values)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise PathNormOverflow(f"{_context(node)}: {what} at x is not finite: the float64 forward does not fit in "
                               "float64 there (an overflow, or inf − inf), so its activation pattern cannot be read. "
                               "Rescale the model into range first (cm.enorm(), function kept), or scale the inputs "
                               "down")


# ------------------------------------------------------------ scaled values


def _scale(backend, m, factors: np.ndarray):
    """m[b] * factors[b] for every sample b."""
    if np.all(factors == 1.0):
        return m
    return m * backend.asarray(factors.reshape(-1, *([1] * (m.ndim - 1))))


def _combine(backend, terms, batch: int, check=None, mask=None):
    """Sum of m_t · exp(L_t) (L_t arrays (B,)) as (m, L) with max|m[b]| in [_LOW, _HIGH] or m[b] = 0, times
    ``mask`` (a ReLU's pattern) where given, before it is renormalised (a masked entry sets no sample's scale).

    ``check(acc)``, when given, certifies the sum (pathir.lifting.scaled.Certifier.node); a term
    whose factor e^{L − top} underflows for a sample is then certified only if negligible there, and an
    entry far below its sample's peak only if it stays a normal float64 once divided by it."""
    terms = [(m, L) for m, L in terms if m is not None]
    if not terms:
        return None, np.zeros(batch)
    top = np.max([L for _, L in terms], axis=0)
    top = np.where(np.isfinite(top), top, 0.0)
    acc = None
    for m, L in terms:
        if check is not None and np.any(L < top - _SPAN):
            with np.errstate(divide="ignore"):
                size = np.log(np.broadcast_to(backend.row_amax(m), (batch,))) + L - top
            if np.any((L < top - _SPAN) & (size > _LOG_LOST)):
                raise Uncertified("a term of a node more than e^700 below its sum")
        t = _scale(backend, m, np.exp(L - top))
        acc = t if acc is None else acc + t
    if mask is not None:
        acc = acc * mask
    if check is not None:
        check(acc)
    peak = backend.row_amax(acc) if acc.shape[0] == batch else np.repeat(backend.row_amax(acc), batch)
    if not np.all(np.isfinite(peak)):
        raise PathirError("non-finite value in a path computation (NaN or inf weights?)")
    move = (peak > 0) & ((peak < _LOW) | (peak > _HIGH))
    if move.any():
        factor = np.where(move, peak, 1.0)
        full = acc if acc.shape[0] == batch else acc + backend.zeros((batch, *acc.shape[1:]))
        acc = _scale(backend, full, 1 / factor)
        if check is not None and np.any(peak > _HIGH):
            check_stored(full, acc)
        top = top + np.log(factor)
    return acc, top


def to_value(backend, mL) -> np.ndarray:
    """A walk's (m, L) as a numpy float64 array m · exp(L) (inf where it exceeds float64)."""
    m, L = mL
    if m is None:  # no path reaches it
        return np.zeros(1)
    m = np.asarray(backend.to_numpy(m), dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        return m * np.exp(L).reshape(-1, *([1] * (m.ndim - 1)))


@flushing
def masked_forward(graph: Graph, backend, pattern: ActivationPattern, inputs=None, bias: bool = True,
                   keep=None, certify=None, log_scales=None) -> dict:
    """Walk of ``graph`` (on ``backend``'s weights) with the pattern frozen.

    ``inputs``: {input name: array (B or 1, *shape)} (default: all ones); an input
    missing from the dict contributes nothing. ``bias``: add the biases. ``keep``: node
    names whose values to return (default: the outputs; "all" for every node).
    ``certify``: a :class:`pathir.lifting.scaled.Certifier` of a walk of non-negative
    weights: a node it cannot certify raises :class:`~pathir.lifting.scaled.Uncertified`.
    ``log_scales``: {param name: log s}, the walk of the graph whose params are these times e^{log s} (each
    edge's and bias's term carries its log s, so the products stay in range however small or large s).
    Returns {name: (m, L)}, value m · exp(L), per sample."""
    B = pattern.batch
    inputs = {n: backend.ones((1, *graph.node(n).shape)) for n in graph.inputs} if inputs is None else inputs
    wanted = set(graph.outputs) if keep is None else None if keep == "all" else set(keep)
    last, acts = _last_uses(graph), {}
    for i, node in enumerate(graph.nodes):
        try:
            if node.kind is NodeKind.INPUT:
                v = inputs.get(node.name)
                acts[node.name] = (None, np.zeros(B)) if v is None else _combine(backend, [(backend.asarray(v), np.zeros(B))], B)
                continue
            terms = []
            for e in node.edges:
                m, L = acts[e.source]
                if m is None:
                    continue
                src = graph.node(e.source).shape
                if node.kind is NodeKind.MAXPOOL:
                    terms.append((backend.select_apply(node, pattern.choice[node.name], m, src), L))
                else:
                    terms.append((backend.apply(e.map, m, src), L + param_log_scale(log_scales, e.map.weight)))
            if bias and node.bias is not None:
                terms.append((backend.bias(node, len(node.shape) + 1), np.full(B, param_log_scale(log_scales, node.bias))))
                if len(terms) == 1:  # a bias alone broadcasts: give it the node's shape
                    terms[0] = (terms[0][0] + backend.zeros((1, *node.shape)), terms[0][1])
            check = None if certify is None else (lambda acc, name=node.name: certify.node(name, acc, masked=True))
            m, L = _combine(backend, terms, B, check, pattern.relu[node.name] if node.kind is NodeKind.RELU else None)
            acts[node.name] = (m, L)
        except PathirError:
            raise
        except Exception as err:
            raise BackendError(f"{_context(node)} (masked walk): {type(err).__name__}: {err}") from err
        if wanted is not None:
            for e in node.edges:
                if last.get(e.source) == i and e.source not in wanted:
                    acts.pop(e.source, None)
    return acts if wanted is None else {n: acts[n] for n in wanted}


def param_log_scale(log_scales, param) -> float:
    """The log-scale a walk adds to the term of ``param`` (0 without ``log_scales`` or param)."""
    return 0.0 if log_scales is None or param is None else log_scales[param.name]


@flushing
def masked_backward(graph: Graph, backend, pattern: ActivationPattern, seeds=None, on_node=None,
                    log_scales=None, certify=None) -> dict:
    """Reverse walk with the pattern frozen: per node, the sum over active paths from
    it to an output (seeded by ``seeds`` {output: array}, default ones), i.e. the
    gradient w.r.t. its pre-activation (its value for input nodes). Without seeds an output the graph
    returns twice is seeded twice (its paths counted twice, docs/math.md); ``seeds`` are per output
    *name* (a vjp's uᵀ at that tensor), each seeded once.

    ``on_node(node, (g, M))``, when given, sees each node's value as it is made
    (the metric contracts it with the forward on the fly) and nothing is kept
    but the inputs' values. ``log_scales``: as for :func:`masked_forward`; ``certify``: a backward
    :class:`~pathir.lifting.scaled.Certifier` checking each node's sum (raises Uncertified). Returns {name: (g, M)}."""
    B = pattern.batch
    pending: dict[str, list] = {n.name: [] for n in graph.nodes}
    for o in graph.outputs if seeds is None else dict.fromkeys(graph.outputs):
        seed = backend.ones((1, *graph.node(o).shape)) if seeds is None else backend.asarray(seeds[o])
        pending[o].append((seed, np.zeros(B)))
    grads = {}
    for node in reversed(graph.nodes):
        try:
            check = None if certify is None else (lambda acc, name=node.name: certify.node(name, acc, backward=True))
            g, M = _combine(backend, pending.pop(node.name), B, check,
                            pattern.relu[node.name] if node.kind is NodeKind.RELU else None)
            if on_node is None or node.kind is NodeKind.INPUT:
                grads[node.name] = (g, M)
            if g is None or node.kind is NodeKind.INPUT:
                continue
            if on_node is not None:
                on_node(node, (g, M))
            for e in node.edges:
                src = graph.node(e.source).shape
                if node.kind is NodeKind.MAXPOOL:
                    pending[e.source].append((backend.select_adjoint(node, pattern.choice[node.name], g, src), M))
                else:
                    pending[e.source].append((backend.adjoint(e.map, g, src), M + param_log_scale(log_scales, e.map.weight)))
        except PathirError:
            raise
        except Exception as err:
            raise BackendError(f"{_context(node)} (masked backward): {type(err).__name__}: {err}") from err
    return grads


def power_walk(graph: Graph, backend, q: float) -> tuple[Graph, object]:
    """(graph, backend) whose walks see every weight, bias and fixed constant w as |w|^q
    (q = 0: 1 for every edge and existing bias), node kinds kept.

    Backends with ``power_view`` do it lazily on their device; otherwise the graph is rewritten."""
    if hasattr(backend, "power_view"):
        return graph, backend.power_view(q)
    fn = abs_pow(q)
    nodes = []
    for n in graph.nodes:
        edges = tuple(replace(e, map=e.map.with_weights(fn)) for e in n.edges)
        b = None if n.bias is None else n.bias.with_value(fn(n.bias.value))
        nodes.append(replace(n, edges=edges, bias=b))
    return graph.replace_nodes(nodes), backend


def log_row_total(backend, acts, names, batch: int) -> np.ndarray:
    """Per sample, log of the sum of every entry of the named nodes' (m, L) (-inf if zero)."""
    logs = []
    for n in names:
        m, L = acts[n]
        if m is None:
            continue
        s = np.asarray(backend.row_total(m), dtype=np.float64)
        if s.shape[0] != batch:
            s = np.repeat(s, batch)
        if np.any(s < 0):
            raise PathirError(f"negative total at node '{n}' in a path computation")
        with np.errstate(divide="ignore"):
            logs.append(np.log(s) + L)
    return logsumexp_rows(logs, batch)


def logsumexp_rows(logs, batch: int) -> np.ndarray:
    """Elementwise log Σ exp over a list of (B,) arrays (-inf where all are -inf)."""
    if not logs:
        return np.full(batch, -math.inf)
    stack = np.stack(logs)
    top = stack.max(axis=0)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return np.where(np.isfinite(top), safe + np.log(np.exp(stack - safe).sum(axis=0)), -math.inf)
