"""Backend-agnostic walks over a Graph.

- ``forward``: the network's own function R_theta(x) (docs/math.md §1).
- ``path_forward`` / ``path_backward``: the linear walks behind every path
  quantity. They run on a *path graph* (all nodes identity, e.g. the output of
  ``path_view``) and keep each node's tensor as ``(m, L)`` with value
  ``m * exp(L)`` and 1e-50 <= max|m| <= 1e50, so that no path sum overflows or underflows
  float64 however deep the network (the l1 path-norm of ResNet-50 is ~1e73,
  path counts far beyond 1e308). Every node is certified (:class:`pathir.lifting.scaled.Certifier`):
  where |w|^q or the spread of a node's entries leaves float64 they raise
  :class:`~pathir.lifting.scaled.Uncertified`, and the path quantities below walk again with
  per-channel log-scales (:mod:`pathir.lifting.scaled`) or per-neuron logs
  (:mod:`pathir.lifting.log_walk`): exact on any representative of θ and for any q.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager

import numpy as np

from pathir.errors import BackendError, InputShapeError, PathirError
from pathir.ir import Graph, MapKind, Node, NodeKind
from pathir.ir.inputs import refuse_unreadable
from pathir.lifting.low_rank import LowRank
from pathir.lifting.scaled import Certifier, Uncertified, check_stored

__all__ = ["forward", "path_forward", "path_backward", "log_total", "combine_scaled"]


def node_context(node: Node) -> str:
    return f"while evaluating node '{node.name}' ({node.kind.value}, {'x'.join(map(str, node.shape))})"


@contextmanager
def node_errors(node: Node, where: str = ""):
    """A backend's failure inside the block as a BackendError naming ``node`` (``where``: e.g. " (backward)");
    a PathirError passes as it is."""
    try:
        yield
    except PathirError:
        raise
    except Exception as err:
        raise BackendError(f"{node_context(node)}{where}: {type(err).__name__}: {err}") from err


def readable(v):
    """``v`` as every backend reads it: a torch bfloat16 or float8 tensor (numpy has neither) as float32, exactly."""
    dtype = str(getattr(v, "dtype", ""))
    return v.float() if dtype == "torch.bfloat16" or dtype.startswith("torch.float8") else v


def forward(graph: Graph, backend, inputs, all_nodes: bool = False):
    """Evaluate the graph on a batch. ``inputs``: one array (single input) or
    {input name: array}, each of shape (B, *shape). Returns {output name: array}
    (every node with ``all_nodes``)."""
    names = graph.inputs
    if not isinstance(inputs, dict):
        if len(names) != 1:
            raise InputShapeError(f"x: the graph has inputs {list(names)}: pass a dict {{input name: array}}")
        inputs = {names[0]: inputs}
    missing, unknown = [n for n in names if n not in inputs], [k for k in inputs if k not in names]
    if missing or unknown:
        raise InputShapeError(f"x: a dict of inputs is keyed by the graph's input names {list(names)}; "
                              + (f"no value for {missing}" if missing else f"{unknown} name no input"))
    for n in names:
        refuse_unreadable(n, inputs[n], objects=getattr(backend, "name", "") == "sympy")  # (exact numbers)
    shapes = {n: tuple(inputs[n].shape) if hasattr(inputs[n], "shape") else np.shape(inputs[n]) for n in names}
    for n, shape in shapes.items():
        if not shape:
            raise InputShapeError(f"x: input '{n}' expects (B, {', '.join(map(str, graph.node(n).shape))}), got a "
                                  "scalar")
    batches = {int(shape[0]) for shape in shapes.values()}
    if len(batches) > 1:
        raise InputShapeError(f"x: the inputs have different batch sizes {sorted(batches)}")
    if hasattr(backend, "check_graph"):  # a backend given values by param name (sympy) checks the names
        backend.check_graph(graph)
    acts = {}
    for node in graph.nodes:
        with node_errors(node):
            if node.kind is NodeKind.INPUT:
                x = backend.asarray(readable(inputs[node.name]))
                if tuple(x.shape[1:]) != node.shape or not x.shape[0]:
                    raise InputShapeError(f"x: input '{node.name}' expects (B, {', '.join(map(str, node.shape))}) with "
                                          f"B >= 1, got {tuple(x.shape)}")
                acts[node.name] = x
                continue
            if node.kind is NodeKind.MAXPOOL:
                src = graph.node(node.edges[0].source)
                pre = backend.kth_max_pool(node, acts[src.name], src.shape)
            else:
                pre = None
                for e in node.edges:
                    t = backend.apply(e.map, acts[e.source], graph.node(e.source).shape)
                    pre = t if pre is None else pre + t
            if node.bias is not None:
                pre = pre + backend.bias(node, len(node.shape) + 1)
            acts[node.name] = backend.relu(pre) if node.kind is NodeKind.RELU else pre
    return acts if all_nodes else {o: acts[o] for o in graph.outputs}


#: mantissas are renormalised only outside this band, so that a walk costs one
#: max-reduction per node and products of two mantissas (weight-gradients) stay
#: far from float64's limits; a weight or product that underflows next to a mantissa
#: of at most _HIGH loses below 2.2e-258 of its node's unit (what the certificate bounds)
_LOW, _HIGH = 1e-50, 1e50

#: a term more than this many e-folds below its node's sum has its factor underflow: it is
#: certified only if its largest entry stays below e^_LOG_LOST of the sum's unit
_SPAN, _LOG_LOST = 700.0, math.log(2.2e-258)


def combine_scaled(backend, terms, shape=None, placed=(), check=None):
    """Sum of m_t * exp(L_t) as (m, L) with _LOW <= max|m| <= _HIGH (or m = 0, L = 0).

    Terms may broadcast (a bias is (1, C, 1, ...)); ``shape`` is the full shape. ``placed`` terms
    ``((values, positions, channels), L)`` are zero but at ``positions`` along axis 1 (the
    backend's ``placed``): added into those channels of the sum. ``check(acc)``, when given,
    certifies the sum before it is renormalised and returns its largest entry
    (:meth:`pathir.lifting.scaled.Certifier.node`)."""
    terms = [(m, L) for m, L in terms if L != -math.inf]
    placed = [(p, L) for p, L in placed if L != -math.inf]
    if not terms and not placed:
        return None, 0.0
    top = max(L for _, L in [*terms, *placed])
    if check is not None:
        for m, L in [*terms, *((p[0], L) for p, L in placed)]:
            # a term whose factor e^{L - top} underflows is dropped: certified only if it is negligible
            if L < top - _SPAN and math.log(max(backend.amax(m), 1e-300)) + L - top > _LOG_LOST:
                raise Uncertified("a term of a node more than e^700 below its sum")
    acc = None
    for m, L in terms:
        t = m if L == top else m * math.exp(L - top)
        acc = t if acc is None else acc + t
    if placed:
        (values, _, channels), _ = placed[0]
        full = (values.shape[0], channels, *values.shape[2:])
        # a fresh sum to add into (a lone term may be another node's array)
        acc = backend.zeros(full) if acc is None else acc + backend.zeros(full)
        for (values, positions, _), L in placed:
            if isinstance(positions, slice):  # one run of channels (a concat operand): added in place, scaled
                acc[:, positions].add_(values, alpha=1.0 if L == top else math.exp(L - top))
            else:
                acc.index_add_(1, positions, values if L == top else values * math.exp(L - top))
    if shape is not None and tuple(acc.shape) != tuple(shape):
        acc = acc + backend.zeros(shape)
    peak = backend.amax(acc) if check is None else check(acc)
    if not math.isfinite(peak):
        raise PathirError("non-finite value in a path computation (NaN or inf weights?)")
    if peak == 0.0:
        return acc, 0.0
    if _LOW <= peak <= _HIGH:
        return acc, top
    stored = acc / peak
    if check is not None and peak > _HIGH:
        check_stored(acc, stored)  # an entry far below the peak must not leave float64 once divided by it
    return stored, top + math.log(peak)


def require_path_graph(graph: Graph, linearize: bool = False):
    if linearize:
        return
    for node in graph.nodes:
        if node.kind not in (NodeKind.INPUT, NodeKind.IDENTITY):
            raise PathirError(
                f"path walks need a path graph (identity nodes only); node '{node.name}' is {node.kind.value}: "
                "run maxpool_to_sum and path_view first"
            )


def flushing(walk):
    """Run a walk inside the backend's flush_denormals context."""

    @functools.wraps(walk)
    def wrapped(graph, backend, *args, **kwargs):
        with backend.flush_denormals():
            return walk(graph, backend, *args, **kwargs)

    return wrapped


def _certifier(graph: Graph, backend) -> Certifier:
    """The certificate of a walk of ``graph`` on ``backend`` (a power view with q = 0 counts every
    edge of a free weight; a path view graph holds its weights already)."""
    return Certifier(graph, getattr(backend, "q", None) == 0, backend)


@flushing
def path_forward(graph: Graph, backend, inputs=None, linearize: bool = False, certify: Certifier | None = None):
    """Forward on a path graph with the all-ones input (or ``inputs``: {name: (B,*shape)}).

    With ``linearize`` any graph is walked as its path graph: ReLU nodes as
    identity, max-pool nodes as the sum of their window (maxpool_to_sum), so a
    backend's ``power_view(q)`` stands for the ``path_view(q)`` pass.
    Returns {node name: (m, L)}; node value = m * exp(L). On the all-ones input it raises
    :class:`~pathir.lifting.scaled.Uncertified` where a node cannot be certified exact
    (``certify``: the check, by default read from ``graph``'s own weights; a path view's
    caller passes the one of the graph it was made from, whose zeros are the true ones);
    given ``inputs`` (signed values) it checks nothing."""
    require_path_graph(graph, linearize)
    cert = certify if certify is not None or inputs is not None else _certifier(graph, backend)
    acts = {}
    for node in graph.nodes:
        if node.kind is NodeKind.INPUT:
            x = backend.ones((1, *node.shape)) if inputs is None else backend.asarray(inputs[node.name])
            acts[node.name] = combine_scaled(backend, [(x, 0.0)]) if inputs is not None else (x, 0.0)
            continue
        with node_errors(node):
            terms, placed = [], []
            place = getattr(backend, "placed", None)
            for e in node.edges:
                m, L = acts[e.source]
                if m is None:
                    continue
                part = None if place is None else place(e.map, m, graph.node(e.source).shape)
                if part is None:
                    terms.append((backend.apply(e.map, m, graph.node(e.source).shape), L))
                else:  # a concat operand: added into its channels of the node's sum, not padded with zeros
                    placed.append((part, L))
            if node.bias is not None:
                terms.append((backend.bias(node, len(node.shape) + 1), 0.0))
            acts[node.name] = combine_scaled(backend, terms, (1, *node.shape), placed,
                                       check=lambda acc, name=node.name: cert.node(name, acc))
    return acts


def log_total(backend, acts, names) -> float:
    """log of the sum of every entry of the named nodes (-inf if zero)."""
    parts = []
    for n in names:
        m, L = acts[n]
        if m is None:
            continue
        s = backend.total(m)
        if s < 0:
            raise PathirError(f"negative total at node '{n}' in a path computation")
        if s > 0:
            parts.append(math.log(s) + L)
    if not parts:
        return -math.inf
    top = max(parts)
    return top + math.log(sum(math.exp(p - top) for p in parts))


@flushing
def path_backward(graph: Graph, backend, acts, seeds=None, linearize: bool = False,
                  certify: Certifier | None = None, outer=frozenset(), node_grads: bool = True):
    """Reverse walk on a path graph: d(sum of outputs)/d(everything).

    ``acts`` from :func:`path_forward`. Returns (node_grads, param_grads):
    node_grads[name] = (m, M), gradient w.r.t. the node's output = m * exp(M),
    i.e. B(v) of docs/math.md §3: the sum over paths from v to an output of the
    product of weights; param_grads[id(param)] = (array, log-scale) with the
    weight-gradient (sum over paths through the parameter of the other factors).
    ``linearize`` and ``certify`` (a backward one) as in :func:`path_forward`.
    ``outer``: ids of dense and 1×1-convolution params used once (`low_rank.factorable`) whose
    weight-gradient, on a batch of one, is kept as its factors (a `LowRank` of the target's gradient
    and the source's value, both certified with their nodes; a convolution's where its rows are
    `low_rank.rows_bounded`, else formed as any other).
    ``node_grads=False``: node_grads comes back empty, each node's gradient freed once its edges are
    walked (a walk that wants the param grads only holds one adjoint map per pending edge, not all).
    """
    require_path_graph(graph, linearize)
    cert = certify if certify is not None or seeds is not None else _certifier(graph, backend)
    release = getattr(backend, "forget", None) if linearize else None
    done = getattr(acts, "release", None)  # acts that can drop a node's map once its last reader is walked
    grads: dict[str, tuple] = {}
    pending: dict[str, list] = {n.name: [] for n in graph.nodes}
    for o in graph.outputs:
        seed = backend.ones((1, *graph.node(o).shape)) if seeds is None else backend.asarray(seeds[o])
        pending[o].append((seed, 0.0))
    by_param: dict[int, tuple] = {}
    for node in reversed(graph.nodes):
        check = None if cert is None else (lambda acc, name=node.name: cert.node(name, acc, backward=True))
        g, M = combine_scaled(backend, pending.pop(node.name), check=check)
        if node_grads:
            grads[node.name] = (g, M)
        if done is not None:
            done(node.name)  # every edge reading it came later in the graph, so was walked already
        if g is None or node.kind is NodeKind.INPUT:
            continue
        with node_errors(node, " (backward)"):
            for e in node.edges:
                src = graph.node(e.source)
                x, L = acts[e.source]
                if node_grads or src.kind is not NodeKind.INPUT:  # (an input's own gradient: asked for, or nowhere)
                    pending[e.source].append((backend.adjoint(e.map, g, src.shape), M))
                w = e.map.weight
                if w is not None and release:
                    release(w)  # the backward walk is its last use: no copy of θ held to the end
                kept = None
                if w is not None and x is not None and id(w) in outer and g.shape[0] == 1:
                    kept = LowRank.of(backend, g[0], x.reshape(1, -1)[0]) if e.map.kind is MapKind.DENSE \
                        else LowRank.of_conv(backend, g[0], x[0])
                if kept is not None:
                    by_param[id(w)] = (kept, L + M)
                elif w is not None and x is not None:
                    wg = backend.weight_grad(e.map, x, g, src.shape)
                    if cert is not None:
                        cert.weights(w.name, e.source, node.name, e.map, src.shape, wg)
                    _accumulate(by_param, w, wg, L + M)
            if node.bias is not None:
                bg = backend.channel_sum(g)
                if cert is not None:
                    cert.bias_grad(node.bias.name, node.name, bg)
                _accumulate(by_param, node.bias, bg, M)
    return grads, by_param


def _accumulate(store, param, value, log_scale):
    key = id(param)
    if key in store:  # a shared weight: sum the contributions at a common scale
        old, L = store[key]
        top = max(L, log_scale)
        store[key] = (old * math.exp(L - top) + value * math.exp(log_scale - top), top)
    else:
        store[key] = (value, log_scale)
