"""The quantized weight tensors of a graph and what the equalization objectives read of them.

A *quantized tensor* is the weight Param of a dense or convolution edge (docs/math.md §12): the
batch-norm-folded weight a per-tensor quantizer sees. Biases, per-channel scales (batch-norms that
could not be folded, layer-scales) and fixed maps stay in float.

Under a rescaling z, entry i of a tensor becomes θ_i e^{(z_e(i) − z_l(i))/2}, e(i) and l(i) the units
it enters and leaves (docs/math.md §5, z = 0 for "no unit"). Entries sharing one (tensor, entered unit,
left unit) move together: a tensor's range is the max over its *unit pairs* of the pair's largest
|θ_i| times the pair's factor. :func:`tensor_pairs` reads each tensor once and keeps, per unit pair,
log max |θ_i| and, for the path-metric objective, log Σ_i w_i (w ≥ 0 a weight per entry).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pathir.ir import Graph, MapKind, Param

__all__ = ["quantized_params", "TensorGrid", "TensorPairs", "tensor_pairs", "quantize", "sqnr_db", "channel_ranges",
           "quantize_graph", "quantized_sqnr_db"]

#: edge maps whose weight is quantized
QUANTIZED_MAPS = frozenset({MapKind.DENSE, MapKind.CONV})


def quantized_params(graph: Graph) -> list[Param]:
    """The weight Params of dense and convolution edges, each once, in ``graph.params()`` order."""
    ids = {id(e.map.weight) for n in graph.nodes for e in n.edges if e.map.kind in QUANTIZED_MAPS}
    return [p for p in graph.params() if id(p) in ids]


@dataclass(frozen=True)
class TensorGrid:
    """One quantized tensor's unit pairs as a grid: entry [r, c] is the pair entering unit ``rows[r]``
    and leaving unit ``cols[c]`` (H for none); ``log_max`` its log max |θ_i| (-inf where no entry of
    the tensor is that pair, or all are 0), ``log_weight`` its log Σ w_i (None without weights);
    ``row_count`` / ``col_count`` the non-zero entries entering each row unit / leaving each column unit;
    ``mean_log`` the mean of log |θ_i| over the non-zero entries (the log of their geometric mean)."""

    name: str
    rows: np.ndarray
    cols: np.ndarray
    log_max: np.ndarray
    log_weight: np.ndarray | None
    row_count: np.ndarray
    col_count: np.ndarray
    mean_log: float = 0.0  # mean of log |θ_i| over the non-zero entries


    @property
    def nonzero(self) -> int:
        return int(self.row_count.sum())


@dataclass(frozen=True)
class TensorPairs:
    """Every quantized tensor's grid (a tensor of zeros only is left out: no rescaling changes its
    quantization), over H units."""

    grids: tuple[TensorGrid, ...]
    num_units: int

    def __len__(self) -> int:
        return len(self.grids)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.grids)

    @property
    def size(self) -> int:
        """The number of grid cells, what one objective evaluation reads."""
        return sum(g.log_max.size for g in self.grids)


def _log(x: np.ndarray, in_place: bool = False) -> np.ndarray:
    """log x (-inf at 0), into x itself with ``in_place`` where x is a writable float64 array."""
    with np.errstate(divide="ignore"):
        if in_place and x.dtype == np.float64 and x.flags.writeable:
            return np.log(x, out=x)
        return np.log(x)


def _varying(ends: np.ndarray, shape: tuple) -> np.ndarray:
    """``ends`` broadcast to ``shape``'s rank (a 0-d "none" end stays 0-d)."""
    return ends.reshape((1,) * (len(shape) - ends.ndim) + ends.shape) if 0 < ends.ndim < len(shape) else ends


def _groups(keys: np.ndarray):
    """(distinct keys ascending, order putting equal keys together or None where ``keys`` is sorted,
    start of each run in that order)."""
    order = None if keys.size < 2 or bool(np.all(keys[1:] >= keys[:-1])) else np.argsort(keys, kind="stable")
    ordered = keys if order is None else keys[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    return ordered[starts], order, starts


def _reduce_runs(v: np.ndarray, ufunc: np.ufunc, starts: np.ndarray, axis: int) -> np.ndarray:
    """``ufunc.reduceat(v, starts, axis)`` in float64 (runs of a 2-d ``v`` along ``axis``); runs of one
    length (a dense layer's features, channel by channel after a flatten) are reduced as a reshaped
    axis, many times faster than ``reduceat`` along the rows."""
    n = v.shape[axis]
    run = n // starts.size if starts.size else 0
    if run and run * starts.size == n and np.array_equal(starts, np.arange(0, n, run)):
        if run == 1:
            return v.astype(np.float64, copy=False)
        shape = (v.shape[0], starts.size, run) if axis == 1 else (starts.size, run, v.shape[1])
        return ufunc.reduce(v.reshape(shape), axis=axis + 1, dtype=np.float64)
    return ufunc.reduceat(v, starts, axis=axis, dtype=np.float64)


def _cells(e: np.ndarray, l: np.ndarray, arrays: list[tuple[np.ndarray, np.ufunc]]):
    """(rows, cols, [grid per array]): each array reduced by its ufunc over the entries of each
    (entered, left) unit pair; cells no entry belongs to hold the ufunc's identity (0 for max of |θ|).

    Axes along which neither end varies (kernel positions) are reduced first. Where no axis carries
    both ends (dense and convolution weights, a flatten before a dense), entries are grouped with one
    sort and ``reduceat`` per side; otherwise (grouped convolutions) pair by pair with ``ufunc.at``."""
    shape = arrays[0][0].shape
    e, l = _varying(e, shape), _varying(l, shape)
    ev = [a for a in range(e.ndim) if e.shape[a] > 1]
    lv = [a for a in range(l.ndim) if l.shape[a] > 1]
    keep = sorted(set(ev) | set(lv))
    if len(shape) and not set(ev) & set(lv):
        order = [a for a in range(len(shape)) if a in ev] + [a for a in range(len(shape)) if a in lv]
        rest = tuple(a for a in range(len(shape)) if a not in keep)
        n_rows = int(np.prod([shape[a] for a in ev])) if ev else 1
        ef = np.broadcast_to(e, shape).transpose(order + list(rest))[(...,) + (0,) * len(rest)].reshape(n_rows, -1)[:, 0]
        lf = np.broadcast_to(l, shape).transpose(order + list(rest))[(...,) + (0,) * len(rest)].reshape(n_rows, -1)[0]
        rows, r_order, r_starts = _groups(ef)
        cols, c_order, c_starts = _groups(lf)
        grids = []
        for a, ufunc in arrays:
            v = ufunc.reduce(a, axis=rest, dtype=np.float64) if rest else a
            v = v.transpose([keep.index(x) for x in order]).reshape(n_rows, -1)
            v = _reduce_runs(v if c_order is None else v[:, c_order], ufunc, c_starts, 1)
            grids.append(_reduce_runs(v if r_order is None else v[r_order], ufunc, r_starts, 0))
        return rows, cols, grids
    rest = tuple(a for a in range(len(shape)) if a not in keep)
    er = np.broadcast_to(e, shape)[tuple(slice(None) if a in keep else slice(0, 1) for a in range(len(shape)))]
    lr = np.broadcast_to(l, shape)[tuple(slice(None) if a in keep else slice(0, 1) for a in range(len(shape)))]
    reduced = [ufunc.reduce(a, axis=rest, keepdims=True, dtype=np.float64) if rest else a for a, ufunc in arrays]
    er, lr = np.broadcast_to(er, reduced[0].shape).reshape(-1), np.broadcast_to(lr, reduced[0].shape).reshape(-1)
    rows, r = np.unique(er, return_inverse=True)
    cols, c = np.unique(lr, return_inverse=True)
    grids = []
    for v, (_, ufunc) in zip(reduced, arrays):
        grid = np.zeros((rows.size, cols.size))
        ufunc.at(grid, (r, c), v.reshape(-1).astype(np.float64))
        grids.append(grid)
    return rows, cols, grids


def _sum_log(value: np.ndarray, chunk: int = 1 << 20) -> float:
    """Σ log |θ_i| over the non-zero entries of ``value`` (≥ 0), a chunk at a time (no θ-sized temporaries)."""
    flat, total = value.reshape(-1), 0.0
    for s in range(0, flat.size, chunk):
        part = flat[s:s + chunk]
        total += float(np.sum(np.log(part, where=part > 0, out=np.zeros_like(part))))
    return total


def _weight_parts(weight) -> tuple[np.ndarray, float]:
    """w = m·e^L (``weight`` = (m, L), L a float or an array broadcastable to m) at one scale per tensor:
    (m·e^{L − max L}, max L) (entries more than ~708 nats below the tensor's largest scale read 0)."""
    m, L = weight
    m = np.asarray(m, dtype=np.float64)
    if np.ndim(L) == 0:
        return m, float(L)
    L = np.asarray(L, dtype=np.float64)
    finite = L[np.isfinite(L)]
    if not finite.size:
        return np.zeros_like(m), -np.inf
    top = float(finite.max())
    with np.errstate(under="ignore"):
        return m * np.exp(L - top), top


def tensor_pairs(graph: Graph, units, row_ends, weights: dict[int, tuple] | None = None) -> TensorPairs:
    """The unit-pair grid of every quantized tensor of ``graph``. ``row_ends``: the graph's
    ``CompactRows`` (``GraphFacts.row_ends``); ``weights``: {id(param): (m, L)}, a weight per entry
    w = m·e^L ≥ 0 (m of the param's shape, L a float or broadcastable to it: the walks' log-scaled
    form, since w may exceed float64), summed per pair into ``log_weight``; each entry is taken out of
    ``weights`` once read (the dict ends empty: no second copy of the weights beside the grids)."""
    H = len(units)
    ends = {id(p): e for p, e in zip(units.params, row_ends.ends)}
    grids = []
    for p in quantized_params(graph):
        e, l = ends[id(p)]
        value = np.abs(np.asarray(p.value, dtype=np.float64))
        if not np.any(value):
            continue
        nonzero = value > 0
        arrays = [(value, np.maximum), (nonzero, np.add)]  # booleans counted in float64
        if weights is not None:
            mantissa, scale = _weight_parts(weights.pop(id(p)))
            arrays.append((mantissa, np.add))
        rows, cols, cells = _cells(e, l, arrays)
        count = cells[1]
        mean_log = _sum_log(value) / float(count.sum())
        # a dense layer's grids are views of the entries themselves (|θ|, and the weights taken out of ``weights``):
        # their logs are taken in place there, no third array of the tensor's size (never into the param's own)
        log_weight = None
        if weights is not None:
            log_weight = _log(cells[2], not np.may_share_memory(cells[2], p.value))
            log_weight += scale
        log_max = _log(cells[0], not np.may_share_memory(cells[0], p.value))
        del arrays, cells, value, nonzero
        grids.append(TensorGrid(p.source_name, rows, cols, log_max, log_weight, count.sum(axis=1),
                                count.sum(axis=0), mean_log))
    return TensorPairs(tuple(grids), H)


# ------------------------------------------------------------------ quantization


def quantize(value: np.ndarray, bits: int, per_channel: bool = False) -> np.ndarray:
    """Symmetric uniform quantization, Q(θ) = Δ·round(θ/Δ) with Δ = R/(2^{b−1} − 1), R the tensor's
    largest |θ| (per output channel, axis 0, with ``per_channel``); R = 0 leaves zeros."""
    value = np.asarray(value, dtype=np.float64)
    levels = 2 ** (int(bits) - 1) - 1
    axes = tuple(range(1, value.ndim)) if per_channel and value.ndim > 1 else None
    R = np.max(np.abs(value), axis=axes, keepdims=axes is not None)
    step = np.where(R > 0, R / levels, 1.0)
    return np.round(value / step) * step


def sqnr_db(value: np.ndarray, quantized: np.ndarray) -> float:
    """10 log10(Σ θ² / Σ (θ − Q(θ))²): inf where quantization is exact. Both sums are taken in units of
    max |θ| (the ratio is scale-free): no square over- or underflows float64 (weights of 1e160 or 1e-160)."""
    value = np.asarray(value, dtype=np.float64)
    top = float(np.max(np.abs(value), initial=0.0))
    top = top if 0 < top < np.inf else 1.0
    signal = float(np.sum(np.square(value / top)))
    noise = float(np.sum(np.square((value - quantized) / top)))
    return np.inf if noise == 0 else 10.0 * np.log10(signal / noise) if signal > 0 else -np.inf


def quantized_sqnr_db(value: np.ndarray, bits: int, chunk: int = 1 << 20) -> float:
    """``sqnr_db(value, quantize(value, bits))`` (per tensor), a block of ``chunk`` entries at a time: no
    temporary of the tensor's size, and one reused buffer for the rounding error (the same operations as
    ``quantize``, in place). Both sums are taken in units of R = max |θ|: no square over- or underflows."""
    flat = np.asarray(value, dtype=np.float64).reshape(-1)
    R = max(float(flat.max()), -float(flat.min())) if flat.size else 0.0  # max |θ| (NaN kept), no |θ| temporary
    step = R / (2 ** (int(bits) - 1) - 1) if R > 0 else 1.0
    unit = R if 0 < R < np.inf else 1.0
    signal = noise = 0.0
    buffer = np.empty(min(chunk, flat.size))
    for i in range(0, flat.size, chunk):
        part = flat[i:i + chunk]
        err = buffer[:part.size]
        np.divide(part, unit, out=err)
        signal += float(np.dot(err, err))
        np.divide(part, step, out=err)
        np.rint(err, out=err)  # np.round's rounding (half to even)
        err *= step
        np.subtract(part, err, out=err)
        err /= unit
        noise += float(np.dot(err, err))
    return np.inf if noise == 0 else 10.0 * np.log10(signal / noise) if signal > 0 else -np.inf


def channel_ranges(value: np.ndarray) -> np.ndarray:
    """max |θ| per output channel (axis 0), with no temporary of the tensor's size."""
    value = np.asarray(value, dtype=np.float64)
    if value.ndim <= 1:
        return np.abs(value)
    rows = value.reshape(value.shape[0], -1)
    return np.maximum(rows.max(axis=1), -rows.min(axis=1))


def quantize_graph(graph: Graph, bits: int, per_channel: bool = False) -> Graph:
    """``graph`` with every quantized tensor replaced by Q(θ) (biases and other params as they are)."""
    ids = {id(p) for p in quantized_params(graph)}
    return graph.map_params(lambda p: Param(p.name, quantize(p.value, bits, per_channel), p.sources, p.how)
                            if id(p) in ids else p)
