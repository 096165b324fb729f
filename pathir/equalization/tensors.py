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
           "quantize_graph"]

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


def _log_abs(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(np.abs(x))


def _grid(e: np.ndarray, l: np.ndarray, values: np.ndarray, reduce, fill: float, H: int, axes: tuple):
    """(rows, cols, grid) of ``reduce`` over the entries of each (entered, left) pair; ``fill`` elsewhere."""
    reduced = reduce.reduce(values, axis=axes, keepdims=True) if axes else values
    er, lr = np.broadcast_arrays(np.broadcast_to(e, reduced.shape), np.broadcast_to(l, reduced.shape))
    rows, r = np.unique(er.reshape(-1), return_inverse=True)
    cols, c = np.unique(lr.reshape(-1), return_inverse=True)
    grid = np.full((rows.size, cols.size), fill)
    reduce.at(grid, (r, c), reduced.reshape(-1))
    return rows, cols, grid


def _log_sum_grid(e, l, logs: np.ndarray, rows, cols, H: int) -> np.ndarray:
    """log Σ e^{logs} per (entered, left) pair on the grid of ``rows`` × ``cols``, without overflow."""
    er, lr = np.broadcast_to(e, logs.shape).reshape(-1), np.broadcast_to(l, logs.shape).reshape(-1)
    r, c = np.searchsorted(rows, er), np.searchsorted(cols, lr)
    top = np.full((rows.size, cols.size), -np.inf)
    flat = logs.reshape(-1)
    np.maximum.at(top, (r, c), flat)
    base = np.where(np.isfinite(top), top, 0.0)
    total = np.zeros_like(top)
    np.add.at(total, (r, c), np.exp(flat - base[r, c]))
    with np.errstate(divide="ignore"):
        return np.where(total > 0, base + np.log(total), -np.inf)


def tensor_pairs(graph: Graph, units, row_ends, log_weights: dict[int, np.ndarray] | None = None) -> TensorPairs:
    """The unit-pair grid of every quantized tensor of ``graph``. ``row_ends``: the graph's
    ``CompactRows`` (``GraphFacts.row_ends``); ``log_weights``: {id(param): log w of its shape, w ≥ 0},
    w summed per pair in log space (the path-metric objective's S_i / |θ_i|, which may exceed float64)."""
    H = len(units)
    ends = {id(p): e for p, e in zip(units.params, row_ends.ends)}
    grids = []
    for p in quantized_params(graph):
        e, l = ends[id(p)]
        value = np.asarray(p.value, dtype=np.float64)
        if not np.any(value):
            continue
        # axes where neither end varies (kernel positions) are reduced before the grid is keyed
        axes = tuple(a for a in range(value.ndim) if e.shape[a] == 1 and l.shape[a] == 1 and value.shape[a] > 1) \
            if e.ndim == value.ndim and l.ndim == value.ndim else ()
        rows, cols, log_max = _grid(e, l, _log_abs(value), np.maximum, -np.inf, H, axes)
        _, _, count = _grid(e, l, (value != 0).astype(np.float64), np.add, 0.0, H, axes)
        log_weight = None
        if log_weights is not None:
            w = np.asarray(log_weights[id(p)], dtype=np.float64).reshape(value.shape)
            log_weight = _log_sum_grid(e, l, w, rows, cols, H)
        logs = _log_abs(value[value != 0])
        grids.append(TensorGrid(p.source_name, rows, cols, log_max, log_weight, count.sum(axis=1), count.sum(axis=0),
                                float(logs.mean())))
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
    """10 log10(Σ θ² / Σ (θ − Q(θ))²): inf where quantization is exact."""
    signal = float(np.sum(np.square(value)))
    noise = float(np.sum(np.square(np.asarray(value) - quantized)))
    return np.inf if noise == 0 else 10.0 * np.log10(signal / noise) if signal > 0 else -np.inf


def channel_ranges(value: np.ndarray) -> np.ndarray:
    """max |θ| per output channel (axis 0)."""
    value = np.abs(np.asarray(value, dtype=np.float64))
    return value.reshape(value.shape[0], -1).max(axis=1) if value.ndim > 1 else value


def quantize_graph(graph: Graph, bits: int, per_channel: bool = False) -> Graph:
    """``graph`` with every quantized tensor replaced by Q(θ) (biases and other params as they are)."""
    ids = {id(p) for p in quantized_params(graph)}
    return graph.map_params(lambda p: Param(p.name, quantize(p.value, bits, per_channel), p.sources, p.how)
                            if id(p) in ids else p)
