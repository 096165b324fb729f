"""Activation-filtered path observables at data (docs/math.md §2, §3), batched.

For each sample x of a batch, with a(θ, x) the path activations:

- active path-norm ‖Φ(θ) ⊙ a(θ, x)‖_q = (Σ_p |Φ_p(θ)|^q a_p(θ, x))^(1/q): the
  masked walk (:mod:`pathir.lifting.pattern`) of the |θ|^q network on the
  all-ones input, outputs summed; q = 0 counts the active paths;
- the local affine piece: with the pattern frozen the network is linear in x,
  R_θ(x') = J x' + c for every x' with the same pattern, and by the lifting
  identity J[o, i] = Σ_{p: i → o} Φ_p a_p, c[o] = Σ_{bias paths p → o} Φ_p a_p.
  J v is the signed masked walk from v without biases, c the one from 0 with them,
  vᵀJ the masked backward walk.

Every result is per sample; a large batch is walked in chunks of ``chunk`` samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from pathir.errors import ArgumentError, InputShapeError, PathNormOverflow
from pathir.ir import Graph
from pathir.lifting.log_walk import log_forward, log_grand_total
from pathir.lifting.path_norm import check_q
from pathir.lifting.pattern import (
    ActivationPattern,
    activation_pattern,
    as_input_dict,
    log_row_total,
    masked_backward,
    masked_forward,
    power_walk,
    to_value,
)
from pathir.lifting.scaled import Certifier, Uncertified, robust_log_path_sum

__all__ = ["active_path_norm", "active_path_counts", "log_active_path_sum", "LocalAffine", "local_affine",
           "chunks", "parts", "walk_size", "WALK_BYTES", "MAX_WALK"]

#: the float64 bytes of all of a walk's feature maps (every node's value, one sample's times the samples walked
#: together) that sets the default walk size: the allocator keeps the memory of a walk's temporaries, several
#: times this, until the process ends (densenet121 at 64×64, 32 samples: 2.4 GB, 0.06 GB of it live; 7 samples:
#: 0.7 GB at the same speed, and resnet18 at 224×224 faster with 5 samples than with 32)
WALK_BYTES = 128 << 20
#: the most samples walked together by default (a small model's walks cost their per-node overhead per walk)
MAX_WALK = 32
_LOG_MAX = math.log(np.finfo(np.float64).max)


def walk_size(graph: Graph, chunk: int | None = None) -> int:
    """``chunk``, or by default the samples walked together: as many as keep 8 bytes times every node's size
    times the samples within ``WALK_BYTES``, from 1 to ``MAX_WALK``."""
    if chunk is not None:
        return int(chunk)
    per_sample = 8 * sum(math.prod(node.shape) for node in graph.nodes)
    return max(1, min(MAX_WALK, WALK_BYTES // max(per_sample, 1)))


def parts(x: dict, size: int) -> Iterator[dict]:
    """The batch ``x`` ({input: array (B, ...)}, as ``as_input_dict`` makes it) as consecutive slices of at most
    ``size`` samples (``x`` itself where it holds no more)."""
    n = int(next(iter(x.values())).shape[0])
    if n <= size:
        yield x
        return
    for start in range(0, n, size):
        yield {name: value[start:start + size] for name, value in x.items()}


def chunks(graph: Graph, x, chunk: int | None = None) -> Iterator[dict]:
    """The batch ``x`` (array or {input: array}) as consecutive {input: array} slices of ≤ ``chunk`` samples
    (default: :func:`walk_size`)."""
    yield from parts(as_input_dict(graph, x), walk_size(graph, chunk))


def log_active_path_sum(graph: Graph, backend, pattern: ActivationPattern, q: float) -> np.ndarray:
    """Per sample, the natural log of Σ_p |Φ_p|^q a_p (q = 0: of the number of active paths; q = inf:
    of max_p |Φ_p| a_p); -inf if none. Certified like the path walks (pathir.lifting.scaled): where the
    batched walk cannot be, each sample is walked again with per-channel (or per-neuron) log-scales."""
    if q == math.inf:

        return np.array([log_grand_total(log_forward(graph, q, pattern, b, backend), graph.outputs, q)
                         for b in range(pattern.batch)])
    view, view_be = power_walk(graph, backend, q)
    try:
        acts = masked_forward(view, view_be, pattern, certify=Certifier(graph, q == 0, backend, pattern=pattern))
        return log_row_total(view_be, acts, view.outputs, pattern.batch)
    except Uncertified:  # sample by sample, with per-channel (or per-neuron) log-scales
        return np.array([robust_log_path_sum(graph, backend, q, pattern, b) for b in range(pattern.batch)])


def _per_chunk(graph, backend, x, chunk, fn) -> np.ndarray:
    return np.concatenate([fn(activation_pattern(graph, backend, part)) for part in chunks(graph, x, chunk)])


def _finish(log_values: np.ndarray, log10: bool, what: str) -> np.ndarray:
    if log10:
        return log_values / math.log(10)
    if np.any(log_values > _LOG_MAX):
        top = float(np.max(log_values)) / math.log(10)
        raise PathNormOverflow(f"{what} is about 10^{top:.1f} for some samples, beyond float64: ask for log10=True")
    return np.exp(log_values)


def active_path_norm(graph: Graph, backend, x, q: float = 1.0, log10: bool = False,
                     chunk: int | None = None) -> np.ndarray:
    """‖Φ(θ) ⊙ a(θ, x)‖_q for every sample of ``x`` (array (B, *shape) or {input: array}): (B,);
    q = math.inf: max_p |Φ_p| a_p.

    ``log10``: its log10 (-inf for a sample with no active path); without it a value
    beyond float64 raises :class:`pathir.PathNormOverflow`.

    >>> import numpy as np
    >>> from pathir.backends import get_backend
    >>> from pathir.ir import GraphBuilder, Dense
    >>> b = GraphBuilder()
    >>> x = b.input("x", (2,))
    >>> h = b.relu("h", [(x, Dense(b.param("w1", [[1.0, 2.0], [-3.0, 4.0]])))])
    >>> g = b.build(outputs=[b.identity("y", [(h, Dense(b.param("w2", [[5.0, 6.0]])))])])
    >>> # at (1, 0) only h0 is active: |1*5| + |2*5|; at (0, 1) both are: 15 + |-3*6| + |4*6|
    >>> active_path_norm(g, get_backend("numpy"), np.array([[1.0, 0.0], [0.0, 1.0]]))
    array([15., 57.])
    """

    q = check_q(q, "active_path_norm")
    root = 1.0 if q == math.inf else q
    logs = _per_chunk(graph, backend, x, chunk, lambda pat: log_active_path_sum(graph, backend, pat, q) / root)
    return _finish(logs, log10, f"the active l{q:g} path-norm")


def active_path_counts(graph: Graph, backend, x, log10: bool = True, chunk: int | None = None) -> np.ndarray:
    """Number of active paths for every sample of ``x``: (B,), log10 by default.

    Below 1e12 (``log10=False``) the counts are exact integers."""
    logs = _per_chunk(graph, backend, x, chunk, lambda pat: log_active_path_sum(graph, backend, pat, 0))
    values = _finish(logs, log10, "the number of active paths")
    return values if log10 else np.where(values < 1e12, np.round(values), values)


@dataclass
class LocalAffine:
    """The affine piece x' ↦ J x' + c that the model computes around a batch x, per sample.

    ``intercept``: {output: (B, *out shape)}, c = R(x) − J x; ``values``: R(x);
    :meth:`jvp`, :meth:`vjp` and :meth:`slope` read J through the masked walks."""

    graph: Graph
    backend: object
    pattern: ActivationPattern
    intercept: dict
    values: dict

    def _inputs(self, v) -> dict:
        v = as_input_dict(self.graph, v)
        if any(int(a.shape[0]) not in (1, self.pattern.batch) for a in v.values()):
            raise InputShapeError(f"v: directions need batch 1 or {self.pattern.batch}")
        return v

    def jvp(self, v) -> dict:
        """J v per sample: {output: (B, *out shape)}; ``v`` array or {input: array}, batch B (or 1)."""
        v = self._inputs(v)
        acts = masked_forward(self.graph, self.backend, self.pattern, inputs=v, bias=False)
        return {o: _full(_finite(to_value(self.backend, acts[o]), v, f"J v at output '{o}'"), self.graph, o,
                         self.pattern.batch) for o in self.graph.outputs}

    def vjp(self, u) -> dict:
        """uᵀ J per sample: {input: (B, *in shape)}; ``u``: {output: array (B or 1, *out shape)}
        (an array when there is one output); a missing output contributes nothing."""
        seeds = self._seeds(u)
        grads = masked_backward(self.graph, self.backend, self.pattern, seeds=seeds)
        return {i: _full(_finite(to_value(self.backend, grads[i]), seeds, f"uᵀ J at input '{i}'"), self.graph, i,
                         self.pattern.batch) for i in self.graph.inputs}

    def _seeds(self, u) -> dict:
        """{output: array (B or 1, *out shape)} for every output (zeros where ``u`` names none); InputShapeError for a
        name that is no output, a shape or batch that does not fit, or a value that is not finite."""
        outputs = list(self.graph.outputs)
        if not isinstance(u, dict):
            if len(outputs) != 1:
                raise InputShapeError(f"u: the graph has outputs {outputs}: pass a dict")
            u = {outputs[0]: u}
        unknown = [k for k in u if k not in outputs]
        if unknown:
            raise InputShapeError(f"u: {unknown} name no output of the graph (its outputs: {outputs})")
        seeds = {}
        for o in outputs:
            shape = self.graph.node(o).shape
            a = u[o] if o in u else np.zeros((1, *shape))
            a = a if hasattr(a, "shape") else np.asarray(a, dtype=np.float64)
            if tuple(a.shape[1:]) != shape or int(a.shape[0]) not in (1, self.pattern.batch):
                raise InputShapeError(f"u: output '{o}' expects ({self.pattern.batch} or 1, "
                                      f"{', '.join(map(str, shape))}), got {tuple(a.shape)}")
            if not np.all(np.isfinite(np.asarray(a.detach().cpu() if hasattr(a, "detach") else a, dtype=np.float64))):
                raise InputShapeError(f"u: output '{o}' holds NaN or infinite entries")
            seeds[o] = a
        return seeds

    def slope(self, output: str | None = None, input: str | None = None) -> np.ndarray:
        """J of one output w.r.t. one input, (B, *out shape, *in shape): one :meth:`vjp` per output entry."""
        output = _only(self.graph.outputs, output, "output")
        input = _only(self.graph.inputs, input, "input")
        out_shape, in_shape = self.graph.node(output).shape, self.graph.node(input).shape
        n_out = int(np.prod(out_shape))
        rows = []
        for j in range(n_out):
            e = np.zeros((1, n_out))
            e[0, j] = 1.0
            rows.append(self.vjp({output: e.reshape(1, *out_shape)})[input].reshape(self.pattern.batch, -1))
        return np.stack(rows, axis=1).reshape(self.pattern.batch, *out_shape, *in_shape)


def _only(names, name, what):
    if name is None:
        if len(names) != 1:
            raise ArgumentError(f"{what}: the graph has {what}s {list(names)}: name one")
        return names[0]
    if name not in names:
        raise ArgumentError(f"{what}={name!r} is no {what} of the graph (its {what}s: {list(names)})")
    return name


def _finite(value: np.ndarray, given, what: str) -> np.ndarray:
    """``value`` (a signed walk's result), or PathNormOverflow if it left float64 while what it was
    walked from (``given``: {name: array}) is finite."""
    if not np.all(np.isfinite(value)) and all(np.all(np.isfinite(np.asarray(a, dtype=np.float64)))
                                              for a in given.values()):
        raise PathNormOverflow(f"local affine piece: {what} does not fit in float64 (the walk is exact in log "
                               "scale per node, its signed values are not)")
    return value


def _full(value: np.ndarray, graph: Graph, name: str, batch: int) -> np.ndarray:
    return np.broadcast_to(value, (batch, *graph.node(name).shape)).copy()


def local_affine(graph: Graph, backend, x) -> LocalAffine:
    """The affine piece active at ``x`` (array (B, *shape) or {input: array}): J and c with
    R(x') = J x' + c for every x' sharing x's activation pattern (so R(x) = J x + c).

    >>> import numpy as np
    >>> from pathir.backends import get_backend
    >>> from pathir.ir import GraphBuilder, Dense
    >>> b = GraphBuilder()
    >>> x = b.input("x", (2,))
    >>> h = b.relu("h", [(x, Dense(b.param("w1", [[1.0, 2.0], [-3.0, 4.0]])))], bias=b.param("b1", [1.0, 0.0]))
    >>> g = b.build(outputs=[b.identity("y", [(h, Dense(b.param("w2", [[5.0, 6.0]])))])])
    >>> piece = local_affine(g, get_backend("numpy"), np.array([[1.0, 0.0]]))
    >>> piece.slope(), piece.intercept["y"]      # only h0 active: y = 5 (x0 + 2 x1 + 1)
    (array([[[ 5., 10.]]]), array([[5.]]))
    """
    pattern = activation_pattern(graph, backend, x)
    acts = masked_forward(graph, backend, pattern, inputs={})
    intercept = {o: _full(_finite(to_value(backend, acts[o]), {}, f"the intercept at output '{o}'"), graph, o,
                          pattern.batch) for o in graph.outputs}
    values = {o: np.asarray(backend.to_numpy(v), dtype=np.float64) for o, v in pattern.outputs.items()}
    return LocalAffine(graph, backend, pattern, intercept, values)
