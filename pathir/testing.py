"""Hypothesis strategies for random ReLU DAGs, for pathir's tests and yours.

- :func:`relu_dags` builds small random :class:`~pathir.Graph` s with
  :class:`~pathir.GraphBuilder`: dense and 1d/2d conv layers (stride, padding,
  dilation, groups), ReLU and identity nodes, biases, skip connections
  (Identity edges, parallel ones included), concatenation and channel
  slices/permutations (ChannelMap), k-max-pools (k >= 1, padding, ceil_mode),
  average pools (Pool with multiplier, per position or per channel and position), adaptive pools (SpatialMatrix), separable
  fixed maps with signed coefficients and structural zeros (Resample: interpolation,
  fixed filters), convolutions with a fixed kernel (FixedConv), element gathers, flatten (Reshape), per-channel Scale edges, several inputs and outputs.
- :func:`mlps` builds layered fully-connected networks.
- :func:`random_inputs` draws a batch of inputs for a graph.

Graphs stay small (by default at most ~200 neurons and ~3000 paths) so that
exhaustive path enumeration (:mod:`pathir.neurons.paths`) checks them in milliseconds.
Structure is drawn by hypothesis (it shrinks); weight values come from a numpy
generator seeded by one drawn integer. With ``integer_weights=True`` every free
weight and bias is a nonzero integer in [-3, 3] (fixed weights stay as they
are, e.g. 1/k for average pools; pass ``avgpool=False, adaptive_pool=False``
for graphs whose arithmetic is exact in float64 on integer inputs).

>>> from hypothesis import given, settings
>>> import pathir
>>> from pathir.neurons.paths import enumerate_num_paths
>>> from pathir.testing import relu_dags
>>> @settings(max_examples=5)
... @given(relu_dags())
... def test_path_count(graph):
...     cm = pathir.compile(graph)
...     assert round(cm.num_paths()) == enumerate_num_paths(cm.graph)
>>> test_path_count()
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from hypothesis import strategies as st

from pathir.analyses.find_units import find_units
from pathir.backends.numpy import NumpyBackend
from pathir.ir import (
    ChannelMap,
    Conv,
    Dense,
    FixedConv,
    Gather,
    Graph,
    GraphBuilder,
    Identity,
    Map,
    NodeKind,
    Pool,
    Resample,
    Reshape,
    Scale,
    SpatialMatrix,
    pool_output_size,
)

__all__ = ["relu_dags", "mlps", "random_inputs", "rescalings"]


# ------------------------------------------------------------------ values


def _weights(rng: np.random.Generator, shape, integer: bool) -> np.ndarray:
    """Nonzero values away from 0: integers in [-3, 3], or +-[0.3, 1.5)."""
    if integer:
        return rng.choice([-3.0, -2.0, -1.0, 1.0, 2.0, 3.0], size=shape)
    return rng.choice([-1.0, 1.0], size=shape) * rng.uniform(0.3, 1.5, size=shape)


def _apply(m: Map, x: np.ndarray, in_shape) -> np.ndarray:
    return NumpyBackend().apply(m, x[None], in_shape)[0]


def _count_in(m: Map, counts: np.ndarray, in_shape) -> np.ndarray:
    """Paths ending at each target neuron that come through map m (all weights 1)."""
    return _apply(m.with_weights(np.ones_like), counts, in_shape)


@dataclass(frozen=True)
class _Options:
    max_width: int
    max_channels: int
    max_neurons: int
    max_paths: int
    bias: bool | None
    integer: bool
    skip: bool
    concat: bool
    channel_maps: bool
    maxpool: bool
    kmax: bool
    avgpool: bool
    adaptive_pool: bool
    resample: bool
    gather: bool
    conv: bool
    scale: bool
    flatten: bool
    fixed_conv: bool
    shared: bool = False


class _Dag:
    """A GraphBuilder that also tracks, per node, the number of paths ending at each neuron."""

    def __init__(self, draw, opts: _Options, seed: int):
        self.draw, self.opts = draw, opts
        self.rng = np.random.default_rng(seed)
        self.b = GraphBuilder("dag")
        self.counts: dict[str, np.ndarray] = {}
        self.consumed: set[str] = set()
        self.n = 0
        self.made: dict[tuple, list] = {}  # (prefix, shape) -> the params drawn so far: a later one may be one of them

    # ----------------------------------------------------------- helpers
    def shape(self, name) -> tuple[int, ...]:
        return self.b.shape(name)

    def names(self, pred=lambda s: True, inputs=True) -> list[str]:
        return [n for n in self.counts if pred(self.shape(n)) and (inputs or not self._is_input(n))]

    def _is_input(self, name) -> bool:
        return self.b.kind(name) is NodeKind.INPUT

    def param(self, prefix: str, shape) -> object:
        """A new param, or (``shared``, one time in four where one of this kind and shape was drawn before) that same
        Param object again: one layer used at two places, as a module called twice lowers."""
        earlier = self.made.setdefault((prefix, tuple(shape)), [])
        if self.opts.shared and earlier and self.rng.random() < 0.25:
            return earlier[int(self.rng.integers(len(earlier)))]
        self.n += 1
        p = self.b.param(f"{prefix}{self.n}", _weights(self.rng, shape, self.opts.integer))
        earlier.append(p)
        return p

    def bias(self, channels: int):
        use = self.opts.bias if self.opts.bias is not None else self.draw(st.booleans())
        return self.param("b", (channels,)) if use else None

    def neurons(self) -> int:
        return sum(c.size for c in self.counts.values())

    def add_input(self, shape) -> str:
        name = self.b.input(f"x{len(self.counts) + 1}" if self.counts else "x", shape)
        self.counts[name] = np.ones(shape)
        return name

    def add(self, prefix, kind, edges, bias=None, k=1, force=False) -> str | None:
        """Add the node unless it breaks the neuron or path budget (``force``: add anyway)."""
        src_shape = self.shape(edges[0][0])
        shape = edges[0][1].out_shape(src_shape)
        count = sum(_count_in(m, self.counts[s], self.shape(s)) for s, m in edges) + (bias is not None)
        count = np.broadcast_to(count, shape)
        # paths of the graph if built now: those ending at the sinks. A third of
        # the budget (less 8) leaves room for the forced head: at most 2 * paths + 8, of a
        # node that need not be a sink (the loop branched back to it), so 2/3 more.
        sinks = {n for n in self.counts if n not in self.consumed and not self._is_input(n)}
        paths = sum(self.counts[n].sum() for n in sinks - {s for s, _ in edges}) + count.sum()
        too_big = self.neurons() + count.size > self.opts.max_neurons or paths > (self.opts.max_paths - 8) // 3
        if too_big and not force:
            return None
        name = self.b.node(self.b.unique(prefix), kind, edges, bias, k=k)
        self.counts[name] = np.array(count, dtype=np.float64)
        self.consumed.update(s for s, _ in edges)
        return name

    def activation(self) -> NodeKind:
        return self.draw(st.sampled_from([NodeKind.RELU, NodeKind.RELU, NodeKind.IDENTITY]))

    def skip_edges(self, shape, main_source) -> list[tuple[str, Map]]:
        """Identity edges from earlier nodes of the target's shape (the main source included)."""
        if not self.opts.skip:
            return []
        candidates = self.names(lambda s: s == tuple(shape))
        if not candidates or not self.draw(st.booleans()):
            return []
        picks = self.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=2))
        return [(p, Identity()) for p in picks]

    # ------------------------------------------------------------- layers
    def dense(self, src) -> str | None:
        flat_widths = sorted({self.shape(n)[0] for n in self.names(lambda s: len(s) == 1)})
        width = self.draw(st.integers(1, self.opts.max_width))
        if self.opts.skip and flat_widths and self.draw(st.booleans()):
            width = self.draw(st.sampled_from(flat_widths))
        edges = [(src, Dense(self.param("w", (width, math.prod(self.shape(src))))))]
        others = [n for n in self.names() if n != src]
        if others and self.draw(st.integers(0, 3)) == 0:  # a second parameterized input edge
            other = self.draw(st.sampled_from(others))
            edges.append((other, Dense(self.param("w", (width, math.prod(self.shape(other)))))))
        edges += self.skip_edges((width,), src)
        return self.add("dense", self.activation(), edges, self.bias(width))

    def conv(self, src, fixed: bool = False) -> str | None:
        """A convolution; ``fixed``: a FixedConv, its constant kernel dyadic (k/8; integers in [-2, 2]
        with ``integer_weights``) and signed, with structural zeros (whole filters among them)."""
        c_in, *spatial = self.shape(src)
        groups = self.draw(st.sampled_from([g for g in range(1, c_in + 1) if c_in % g == 0]))
        same = self.draw(st.booleans())  # shape-preserving, so skips can join it
        if same:
            c_out, stride = c_in, [1] * len(spatial)
            kernel = [self.draw(st.sampled_from([1, 3])) for _ in spatial]
            dilation = [self.draw(st.integers(1, 2)) for _ in spatial]
            padding = [((k - 1) // 2 * d,) * 2 for k, d in zip(kernel, dilation)]
        else:
            c_out = groups * self.draw(st.integers(1, max(1, self.opts.max_channels // groups)))
            kernel = [self.draw(st.integers(1, 3)) for _ in spatial]
            stride = [self.draw(st.integers(1, 2)) for _ in spatial]
            dilation = [self.draw(st.integers(1, 2)) for _ in spatial]
            padding = [(self.draw(st.integers(0, 1)), self.draw(st.integers(0, 1))) for _ in spatial]
        geometry = list(zip(spatial, kernel, stride, padding, dilation))
        if any(pool_output_size(L, k, s, p, d, False) < 1 for L, k, s, p, d in geometry):
            kernel, stride, dilation = [1] * len(spatial), [1] * len(spatial), [1] * len(spatial)
            padding = [(0, 0)] * len(spatial)
        if fixed:
            shape = (c_out, c_in // groups, *kernel)
            top, den = (2, 1) if self.opts.integer else (12, 8)
            K = self.rng.choice([-1.0, 1.0], size=shape) * self.rng.integers(1, top + 1, size=shape) / den
            K *= self.rng.random(shape) < 0.7
            K *= self.rng.random(shape[:2] + (1,) * len(kernel)) < 0.8  # whole (target, source) filters zero
            K[(self.rng.integers(0, c_out), self.rng.integers(0, c_in // groups)) + (0,) * len(kernel)] = 1.0
            m = FixedConv(K, tuple(stride), tuple(padding), tuple(dilation), groups)
        else:
            W = self.param("w", (c_out, c_in // groups, *kernel))
            m = Conv(W, tuple(stride), tuple(padding), tuple(dilation), groups)
        out = m.out_shape(self.shape(src))
        edges = [(src, m)] + self.skip_edges(out, src)
        return self.add("fixed_conv" if fixed else "conv", self.activation(), edges, self.bias(c_out))

    def fixed_conv(self, src) -> str | None:
        return self.conv(src, fixed=True)

    def _window(self, src):
        """A random pool window over ``src`` (padding at most half the kernel, as torch asks)."""
        spatial = self.shape(src)[1:]
        kernel = [min(L, self.draw(st.sampled_from([2, 3, 1]))) for L in spatial]
        stride = [self.draw(st.integers(1, 2)) for _ in spatial]
        padding = [(self.draw(st.integers(0, k // 2)), self.draw(st.integers(0, k // 2))) for k in kernel]
        dilation = [self.draw(st.sampled_from([1, 1, 2])) if L >= 2 * k - 1 else 1 for L, k in zip(spatial, kernel)]
        ceil = self.draw(st.booleans())
        return Pool(tuple(kernel), tuple(stride), tuple(padding), tuple(dilation), ceil)

    def _in_window(self, src, window: Pool) -> np.ndarray:
        """In-input positions of every window (padding positions are no neurons)."""
        one = Pool(window.kernel, window.stride, window.padding, window.dilation, window.ceil_mode)
        return _apply(one, np.ones(self.shape(src)), self.shape(src))[0]

    def maxpool(self, src) -> str | None:
        window = self._window(src)
        largest = int(self._in_window(src, window).min())
        k = self.draw(st.integers(1, min(3, largest))) if self.opts.kmax else 1
        return self.add("maxpool", NodeKind.MAXPOOL, [(src, window)], self.bias(self.shape(src)[0]), k=k)

    def avgpool(self, src) -> str | None:
        w = self._window(src)
        if self.draw(st.booleans()):  # count_include_pad
            mult = np.full(self._in_window(src, w).shape, 1.0 / math.prod(w.kernel))
        else:
            mult = 1.0 / self._in_window(src, w)
        if self.draw(st.booleans()):  # a constant factor per channel (x * c, c a buffer); 0 is no edge
            c = self.shape(src)[0]
            factors = self.rng.choice([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0], size=c)
            factors[self.rng.integers(0, c)] = 1.0  # some edge exists
            mult = factors.reshape(c, *([1] * mult.ndim)) * mult
        m = Pool(w.kernel, w.stride, w.padding, w.dilation, w.ceil_mode, mult)
        kind = self.draw(st.sampled_from([NodeKind.IDENTITY, NodeKind.RELU]))
        return self.add("avgpool", kind, [(src, m)], self.bias(self.shape(src)[0]))

    def adaptive_pool(self, src) -> str | None:
        spatial = self.shape(src)[1:]
        out = tuple(self.draw(st.integers(1, L)) for L in spatial)
        matrix = self.rng.uniform(0.1, 1.0, size=(math.prod(out), math.prod(spatial)))
        matrix *= self.rng.random(matrix.shape) < 0.6  # structural zeros are no edges
        return self.add("adaptive", NodeKind.IDENTITY, [(src, SpatialMatrix(matrix, out))], self.bias(self.shape(src)[0]))

    def resample(self, src) -> str | None:
        """A separable fixed map: per axis a small signed matrix with structural zeros.
        Coefficients are dyadic (k/8; integers in [-2, 2] with ``integer_weights``), as
        interpolation's are, so that products along an edge are exact in float64."""
        mats = []
        for L in self.shape(src)[1:]:
            shape = (self.draw(st.integers(1, L + 2)), L)
            top, den = (2, 1) if self.opts.integer else (12, 8)
            a = self.rng.choice([-1.0, 1.0], size=shape) * self.rng.integers(1, top + 1, size=shape) / den
            a *= self.rng.random(shape) < 0.7
            a[self.rng.integers(0, shape[0]), self.rng.integers(0, L)] = 1.0  # some edge exists
            mats.append(a)
        kind = self.activation()
        return self.add("resample", kind, [(src, Resample(tuple(mats)))], self.bias(self.shape(src)[0]))

    def scale(self, src) -> str | None:
        c = self.shape(src)[0]
        return self.add("bn", self.activation(), [(src, Scale(self.param("s", (c,))))], self.bias(c))

    def channel_map(self, src) -> str | None:
        """A channel slice, permutation or shuffle; an index -1 is a channel of zeros."""
        c = self.shape(src)[0]
        index = self.draw(st.lists(st.integers(-1, c - 1), min_size=1, max_size=c + 1))
        if max(index) < 0:
            index[0] = 0
        return self.add("channels", self.activation(), [(src, ChannelMap(tuple(index)))], self.bias(len(index)))

    def concat(self, src) -> str | None:
        spatial = tuple(self.shape(src)[1:])
        other = self.draw(st.sampled_from(self.names(lambda s: len(s) > 1 and s[1:] == spatial)))
        ca, cb = self.shape(src)[0], self.shape(other)[0]
        slots = self.draw(st.permutations(range(ca + cb)))  # target channel of each source channel
        ia, ib = [-1] * (ca + cb), [-1] * (ca + cb)
        for j in range(ca):
            ia[slots[j]] = j
        for j in range(cb):
            ib[slots[ca + j]] = j
        edges = [(src, ChannelMap(tuple(ia))), (other, ChannelMap(tuple(ib)))]
        return self.add("concat", NodeKind.IDENTITY, edges, self.bias(ca + cb))

    def flatten(self, src) -> str | None:
        n = math.prod(self.shape(src))
        return self.add("flatten", NodeKind.IDENTITY, [(src, Reshape((n,)))], self.bias(n))

    def gather(self, src) -> str | None:
        n = math.prod(self.shape(src))
        index = self.rng.integers(-1, n, size=self.draw(st.integers(1, min(n + 1, self.opts.max_width + 2))))
        return self.add("gather", NodeKind.IDENTITY, [(src, Gather(index, (index.size,)))], self.bias(index.size))

    def layers_for(self, src) -> list:
        spatial = len(self.shape(src)) > 1
        o = self.opts
        choices = [self.dense]
        if spatial:
            choices += [f for f, on in [
                (self.conv, o.conv), (self.conv, o.conv), (self.conv, o.conv), (self.maxpool, o.maxpool),
                (self.maxpool, o.maxpool), (self.avgpool, o.avgpool),
                (self.adaptive_pool, o.adaptive_pool), (self.resample, o.resample),
                (self.resample, o.resample), (self.concat, o.concat), (self.flatten, o.flatten),
                (self.fixed_conv, o.fixed_conv),
            ] if on]
        choices += [f for f, on in [(self.scale, o.scale), (self.channel_map, o.channel_maps), (self.gather, o.gather)] if on]
        return choices

    def head(self, src, extra_inputs) -> str:
        """Flatten (sometimes) and a dense identity output layer reading every extra input too."""
        if len(self.shape(src)) > 1 and self.opts.flatten and self.draw(st.booleans()):
            n = math.prod(self.shape(src))
            src = self.add("flatten", NodeKind.IDENTITY, [(src, Reshape((n,)))], self.bias(n), force=True)
        width = self.draw(st.integers(1, 2))
        edges = [(s, Dense(self.param("w", (width, math.prod(self.shape(s)))))) for s in [src, *extra_inputs]]
        return self.add("out", NodeKind.IDENTITY, edges, self.bias(width), force=True)

    def build(self) -> Graph:
        sinks = [n for n in self.counts if n not in self.consumed]
        return self.b.build(outputs=sinks)


def _within(shape: tuple, cap: int) -> tuple:
    """``shape`` with its largest spatial size (then its channels, then a flat width) cut by one until it holds at
    most ``cap`` entries, spatial sizes not below 2; as drawn where it already fits."""
    shape = list(shape)
    while math.prod(shape) > cap:
        spatial = [i for i in range(1, len(shape)) if shape[i] > 2]
        if spatial:
            i = max(spatial, key=lambda i: shape[i])
        elif shape[0] > 1:
            i = 0
        else:
            break
        shape[i] -= 1
    return tuple(shape)


@st.composite
def relu_dags(
    draw,
    max_depth: int = 5,
    max_width: int = 4,
    max_channels: int = 3,
    spatial_dims: Sequence[int] = (0, 1, 2),
    bias: bool | None = None,
    skip: bool = True,
    concat: bool = True,
    channel_maps: bool = True,
    maxpool: bool = True,
    kmax: bool = True,
    avgpool: bool = True,
    adaptive_pool: bool = True,
    resample: bool = True,
    gather: bool = True,
    conv: bool = True,
    scale: bool = True,
    flatten: bool = True,
    fixed_conv: bool = True,
    max_inputs: int = 2,
    integer_weights: bool = False,
    max_neurons: int = 200,
    max_paths: int = 3000,
    shared: bool = True,
) -> Graph:
    """Strategy for small random ReLU DAGs (verified Graphs).

    Parameters
    ----------
    max_depth : layers drawn before the optional dense head
    max_width, max_channels : widths of dense layers, channels of convs
    spatial_dims : spatial axes of the main input, drawn from these (0: a flat vector)
    bias : True / False for biases everywhere / nowhere; None draws each node
    skip, concat, channel_maps, maxpool, kmax, avgpool, adaptive_pool, resample, gather, conv, scale, flatten,
    fixed_conv :
        switch each feature on or off (``kmax``: k-max-pools with k > 1)
    max_inputs : a second, flat input joining the dense head may be drawn when 2
    integer_weights : free weights and biases are nonzero integers in [-3, 3]
    shared : a weight or bias may be one drawn before for another edge or node of the same shape (the same
        Param object, as a module called twice lowers), one time in four
    max_neurons, max_paths : budgets; layers that break them are not added, and the
        input is drawn smaller where they are small. The number of paths is at most
        ``max_paths`` (if >= 30); the head may add a few neurons beyond ``max_neurons``
        (with a spatial input at least 4, the smallest it takes, and a flatten of as many).

    Every node reaches an output: the outputs are the nodes nothing reads.
    """
    opts = _Options(max_width, max_channels, max_neurons, max_paths, bias, integer_weights, skip, concat,
                    channel_maps, maxpool, kmax, avgpool, adaptive_pool, resample, gather, conv, scale, flatten,
                    fixed_conv, shared)
    dag = _Dag(draw, opts, draw(st.integers(0, 2**32 - 1)))
    dims = draw(st.sampled_from([d for d in (1, 2, 0) if d in spatial_dims]))
    if dims == 0:
        shape = (draw(st.integers(1, max_width)),)
    else:
        sizes = [draw(st.integers(2, 6 if dims == 1 else 4)) for _ in range(dims)]
        shape = (draw(st.integers(1, max_channels)), *sizes)
    # the input, and its forced head (a flatten of as many neurons, then 1-2 outputs reading it and a second
    # input of at most 3): within the budgets, the input shrunk where they are small
    x = dag.add_input(_within(shape, min(max(max_neurons // 2, 1), max((max_paths - 8) // 2, 1))))
    second = max_inputs > 1 and draw(st.integers(0, 3)) == 0
    extra = [dag.add_input((draw(st.integers(1, 3)),))] if second else []
    current, added = x, 0
    for _ in range(draw(st.integers(1, max_depth))):
        if added and draw(st.integers(0, 4)) == 0:  # branch from an earlier node: the current one stays a sink
            current = draw(st.sampled_from(dag.names(inputs=False)))
        layer = draw(st.sampled_from(dag.layers_for(current)))
        new = layer(current)
        if new is None:
            break
        current, added = new, added + 1
    if extra or not added or draw(st.booleans()):
        dag.head(current, extra)
    return dag.build()


@st.composite
def mlps(
    draw,
    widths: Sequence[int] | None = None,
    bias: bool | None = None,
    max_depth: int = 3,
    max_width: int = 4,
    integer_weights: bool = False,
) -> Graph:
    """Strategy for layered fully-connected networks: input x[d_0], ReLU layers
    ``h1..`` and an identity output layer ``out``, dense weights ``w1..``.

    ``widths`` (d_0, ..., d_L) fixes the layer widths (else drawn: 1..max_depth
    weight layers, widths 1..max_width); ``bias`` True/False puts a bias on every
    non-input layer or none (None draws it once for the whole network)."""
    if widths is None:
        widths = draw(st.lists(st.integers(1, max_width), min_size=2, max_size=max_depth + 1))
    use_bias = draw(st.booleans()) if bias is None else bias
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    b = GraphBuilder("mlp")
    prev = b.input("x", (widths[0],))
    for i, (d_in, d_out) in enumerate(zip(widths[:-1], widths[1:]), start=1):
        last = i == len(widths) - 1
        W = b.param(f"w{i}", _weights(rng, (d_out, d_in), integer_weights))
        bias_param = b.param(f"b{i}", _weights(rng, (d_out,), integer_weights)) if use_bias else None
        kind = NodeKind.IDENTITY if last else NodeKind.RELU
        prev = b.node("out" if last else f"h{i}", kind, [(prev, Dense(W))], bias_param)
    return b.build(outputs=[prev])


@st.composite
def random_inputs(draw, graph: Graph, batch: int | None = None, integer: bool = False) -> dict[str, np.ndarray]:
    """Strategy for {input name: array (B, *shape)}: standard normal values, or
    integers in [-2, 2] with ``integer`` (which makes max-pool ties common).
    ``batch`` is drawn in 1..3 unless given."""
    B = draw(st.integers(1, 3)) if batch is None else batch
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    out = {}
    for name in graph.inputs:
        shape = (B, *graph.node(name).shape)
        out[name] = rng.integers(-2, 3, size=shape).astype(np.float64) if integer else rng.normal(size=shape)
    return out


@st.composite
def rescalings(draw, graph: Graph, max_log: float = 2.0) -> np.ndarray:
    """Strategy for a random element of the rescaling group (docs/math.md §5) of
    ``graph``: z, one log-scale per unit of ``find_units(graph)``, uniform in
    [-max_log, max_log] (θ ← θ ⊙ exp(-Bz/2) scales by at most e^{max_log})."""

    H = len(find_units(graph)[1])
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return rng.uniform(-max_log, max_log, size=H)
