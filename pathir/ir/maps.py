"""Linear maps carried by edges.

A map sends the output of its source node (shape ``(C, *spatial)``, batch left
out) to a contribution to the pre-activation of its target node. Maps are either
parameterized (their weights are a free :class:`Param`: ``Dense``, ``Conv``,
``Scale``) or fixed (constant weights: ``Identity``, ``Reshape``,
``ChannelMap``, ``Pool``, ``SpatialMatrix``, ``Resample``, ``Gather``,
``FixedConv``).

Every map states its structure here; the arithmetic (apply, adjoint,
weight-gradient) lives in each backend's rule table, keyed by ``MapKind``.

Rescaling structure (docs/math.md §5) is read from two methods:

- ``weight_channels(in_shape)`` (parameterized maps): for every weight entry, the
  target channel and the source channel of the edges that read it;
- ``channel_ties(in_shape)`` (fixed maps): the (source channel, target channel)
  pairs joined by a constant edge, which must share one log-scale.

A "channel" is the first axis of a node's shape; for a flat node it is a feature.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Callable

import numpy as np

from pathir.errors import ArgumentError

from .param import Param

__all__ = [
    "MapKind",
    "PARAMETERIZED",
    "FIXED",
    "Map",
    "Identity",
    "Reshape",
    "ChannelMap",
    "Pool",
    "SpatialMatrix",
    "Resample",
    "Gather",
    "FixedConv",
    "Dense",
    "Conv",
    "Scale",
    "pool_output_size",
]


class MapKind(enum.Enum):
    IDENTITY = "identity"
    RESHAPE = "reshape"
    CHANNEL_MAP = "channel_map"
    POOL = "pool"
    SPATIAL_MATRIX = "spatial_matrix"
    RESAMPLE = "resample"
    GATHER = "gather"
    FIXED_CONV = "fixed_conv"
    DENSE = "dense"
    CONV = "conv"
    SCALE = "scale"


PARAMETERIZED = frozenset({MapKind.DENSE, MapKind.CONV, MapKind.SCALE})
FIXED = frozenset(MapKind) - PARAMETERIZED

Shape = tuple[int, ...]
WeightFn = Callable[[np.ndarray], np.ndarray]


def _fmt(xs) -> str:
    """[1,2] / [[1,1],[0,1]]: compact, space-free lists for the printer."""
    return str([list(x) if isinstance(x, tuple) else x for x in xs]).replace(" ", "")


def _prod(xs) -> int:
    return int(math.prod(xs))


def pool_output_size(length: int, kernel: int, stride: int, pad: tuple[int, int], dilation: int, ceil_mode: bool) -> int:
    """Output length of a pooling window along one axis (torch/ONNX semantics)."""
    span = length + pad[0] + pad[1] - dilation * (kernel - 1) - 1  # negative: the dilated window is longer
    out = (-(-span // stride) if ceil_mode else span // stride) + 1  # (torch rounds span / stride toward -inf
    if ceil_mode and (out - 1) * stride >= length + pad[0]:          # or, in ceil mode, up: one window then)
        out -= 1  # the last window must start inside the input or its left padding
    return max(out, 0)


class Map:
    """Base class: structure of a linear map. Subclasses are frozen dataclasses."""

    kind: MapKind

    @property
    def weight(self) -> Param | None:
        return None

    @property
    def fixed(self) -> bool:
        return self.kind in FIXED

    def out_shape(self, in_shape: Shape) -> Shape:
        raise NotImplementedError

    def describe(self) -> str:
        """Short text for the graph printer."""
        return self.kind.value

    def with_weights(self, fn: WeightFn, fixed_fn: WeightFn | None = None) -> "Map":
        """This map with every free weight w replaced by fn(w) and every fixed,
        non-unit weight c by fixed_fn(c) (default fn). Unit weights stay 1, so
        fn must send 1 to 1 for the implicit ones to stay right."""
        return self

    def weight_channels(self, in_shape: Shape) -> tuple[np.ndarray, np.ndarray]:
        raise TypeError(f"{self.kind.value} has no free weights")

    def channel_ties(self, in_shape: Shape) -> np.ndarray:
        """(k, 2) array of (source channel, target channel) pairs tied by constant edges."""
        raise TypeError(f"{self.kind.value} is not a fixed map")


def _element_channels(shape: Shape) -> np.ndarray:
    """Channel index of each element of a tensor of ``shape`` in C order (a scalar: one element, channel 0)."""
    return np.repeat(np.arange(shape[0]), _prod(shape[1:])) if len(shape) else np.zeros(1, dtype=np.int64)


def _unique_pairs(src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    if src.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    return np.unique(np.stack([src, tgt], axis=1).astype(np.int64), axis=0)


# --------------------------------------------------------------------- fixed maps


@dataclass(frozen=True)
class Identity(Map):
    """out = in (a skip connection, or an add operand)."""

    kind = MapKind.IDENTITY

    def out_shape(self, in_shape):
        return tuple(in_shape)

    def channel_ties(self, in_shape):
        c = np.arange(in_shape[0])
        return np.stack([c, c], axis=1)


@dataclass(frozen=True)
class Reshape(Map):
    """Same elements in C order, another shape (flatten, view)."""

    shape: Shape
    kind = MapKind.RESHAPE

    def out_shape(self, in_shape):
        if _prod(in_shape) != _prod(self.shape):
            raise ArgumentError(f"reshape {in_shape} -> {self.shape} changes the number of elements")
        return tuple(self.shape)

    def describe(self):
        return f"reshape{_fmt(self.shape)}"

    def channel_ties(self, in_shape):
        return _unique_pairs(_element_channels(tuple(in_shape)), _element_channels(self.shape))


@dataclass(frozen=True, eq=False)
class ChannelMap(Map):
    """Target channel t copies source channel ``index[t]`` (-1: none, zero).

    Covers a concat operand (embedding into a slice), a channel slice and a
    channel permutation (shuffle)."""

    index: tuple[int, ...]
    kind = MapKind.CHANNEL_MAP

    def out_shape(self, in_shape):
        if max(self.index, default=-1) >= in_shape[0]:
            raise ArgumentError(f"channel map reads channel {max(self.index)} of a {in_shape[0]}-channel input")
        return (len(self.index), *in_shape[1:])

    @cached_property
    def index_array(self) -> np.ndarray:
        """``index`` as a read-only int64 array (made once: a concat's map is read once per channel tie)."""
        a = np.asarray(self.index, dtype=np.int64)
        a.setflags(write=False)
        return a

    def describe(self):
        return self._description

    @cached_property
    def _description(self) -> str:
        """``describe()``, made once per map (a re-read graph keeps its maps: ``str(graph)`` compares the
        structure after each optimizer step, 1905 concatenation maps on densenet201)."""
        idx = self.index_array
        sel = np.flatnonzero(idx >= 0)
        src = idx[sel]
        if sel.size and np.all(np.diff(sel) == 1) and np.all(np.diff(src) == 1):
            return f"channels[{src[0]}:{src[-1] + 1}]->[{sel[0]}:{sel[-1] + 1}] of {len(idx)}"
        return f"channel_map({len(idx)} from {int(sel.size)})"

    def channel_ties(self, in_shape):
        idx = self.index_array
        t = np.flatnonzero(idx >= 0)
        return np.stack([idx[t], t], axis=1).astype(np.int64)


@dataclass(frozen=True, eq=False)
class Pool(Map):
    """Per-channel window sum over the spatial axes, each output position p
    multiplied by ``mult[p]`` (None: weight 1, a max-pool window).

    Average pooling is a Pool whose ``mult`` is 1/divisor per output position;
    ``padding`` holds (before, after) per spatial axis; windows never cross
    channels. The edge from source position q to output position p exists iff
    q lies in p's window inside the input and mult[p] != 0 (a coefficient
    exactly 0 is no edge); its weight is mult[p]. ``mult`` has the output's
    spatial shape, or (channels, *spatial) for a factor that differs per
    channel (a constant tensor ``x * c``, 1-windows)."""

    kernel: Shape
    stride: Shape
    padding: tuple[tuple[int, int], ...]
    dilation: Shape
    ceil_mode: bool = False
    mult: np.ndarray | None = None
    kind = MapKind.POOL

    def __post_init__(self):
        n = len(self.kernel)
        if not (len(self.stride) == len(self.padding) == len(self.dilation) == n):
            raise ArgumentError("pool geometry: kernel, stride, padding, dilation must have one entry per spatial axis")
        if self.mult is not None:
            m = np.array(self.mult, dtype=np.float64)
            m.setflags(write=False)
            object.__setattr__(self, "mult", m)

    def out_shape(self, in_shape):
        spatial = in_shape[1:]
        if len(spatial) != len(self.kernel):
            raise ArgumentError(f"{len(self.kernel)}-d pool on input of shape {in_shape}")
        out = tuple(
            pool_output_size(L, k, s, p, d, self.ceil_mode)
            for L, k, s, p, d in zip(spatial, self.kernel, self.stride, self.padding, self.dilation)
        )
        if self.mult is not None and tuple(self.mult.shape) not in (out, (in_shape[0], *out)):
            raise ArgumentError(f"pool multiplier has shape {self.mult.shape}, output positions {out} "
                             f"(or {(in_shape[0], *out)} per channel)")
        return (in_shape[0], *out)

    def describe(self):
        text = f"window{_fmt(self.kernel)}/s{_fmt(self.stride)}"
        if any(p != (0, 0) for p in self.padding):
            text += f"/p{_fmt(self.padding)}"
        if any(d != 1 for d in self.dilation):
            text += f"/d{_fmt(self.dilation)}"
        if self.ceil_mode:
            text += "/ceil"
        if self.mult is not None:
            u = np.unique(self.mult)
            text += f" x{u[0]:.6g}" if u.size == 1 else f" x[{u.min():.4g}..{u.max():.4g}]"
        return text

    def extra_right_padding(self, in_shape: Shape) -> tuple[int, ...]:
        """Zeros to add after each axis so that a plain strided window sum
        yields exactly ``out_shape`` positions (ceil_mode windows)."""
        out = self.out_shape(in_shape)[1:]
        extra = []
        for L, o, k, s, p, d in zip(in_shape[1:], out, self.kernel, self.stride, self.padding, self.dilation):
            need = (o - 1) * s + d * (k - 1) + 1 - (L + p[0] + p[1])
            extra.append(max(0, need))
        return tuple(extra)

    def with_weights(self, fn, fixed_fn=None):
        if self.mult is None:
            return self
        return replace(self, mult=np.where(self.mult != 0, (fixed_fn or fn)(self.mult), 0.0))

    def channel_ties(self, in_shape):
        c = np.arange(in_shape[0])
        return np.stack([c, c], axis=1)


@dataclass(frozen=True, eq=False)
class SpatialMatrix(Map):
    """Per-channel fixed matrix on the flattened spatial positions:
    out[c, p] = sum_q matrix[p, q] in[c, q] (adaptive average pooling of any sizes)."""

    matrix: np.ndarray
    out_spatial: Shape
    kind = MapKind.SPATIAL_MATRIX

    def __post_init__(self):
        m = np.array(self.matrix, dtype=np.float64)
        m.setflags(write=False)
        object.__setattr__(self, "matrix", m)

    def out_shape(self, in_shape):
        if self.matrix.shape != (_prod(self.out_spatial), _prod(in_shape[1:])):
            raise ArgumentError(f"spatial matrix {self.matrix.shape} does not fit input {in_shape} -> {self.out_spatial}")
        return (in_shape[0], *self.out_spatial)

    def describe(self):
        return f"spatial_matrix{_fmt(self.matrix.shape)}->{_fmt(self.out_spatial)}"

    def with_weights(self, fn, fixed_fn=None):
        m = np.where(self.matrix != 0, (fixed_fn or fn)(self.matrix), 0.0)
        return replace(self, matrix=m)

    def channel_ties(self, in_shape):
        c = np.arange(in_shape[0])
        return np.stack([c, c], axis=1)


@dataclass(frozen=True, eq=False)
class Resample(Map):
    """Separable per-channel fixed map: one small matrix per spatial axis,
    ``matrices[d]`` of shape (out_len_d, in_len_d), applied axis by axis:

        out[c, p_1..p_n] = sum_q  A_1[p_1, q_1] ... A_n[p_n, q_n] in[c, q_1..q_n]

    Interpolation in every mode (nearest, linear, cubic, area), separable fixed
    filters and per-axis padding are Resamples. The edge q -> p exists iff every
    factor A_d[p_d, q_d] is non-zero (a coefficient exactly 0 is no edge); its
    weight is their product. Since |prod a_d|^q = prod |a_d|^q, the |c|^q map is
    the Resample of the per-axis |A_d|^q: executors never form the dense product."""

    matrices: tuple
    label: str = "resample"
    kind = MapKind.RESAMPLE

    def __post_init__(self):
        mats = []
        for a in self.matrices:
            m = np.array(a, dtype=np.float64)
            if m.ndim != 2:
                raise ArgumentError(f"resample: each axis matrix is 2-d, got shape {m.shape}")
            m.setflags(write=False)
            mats.append(m)
        object.__setattr__(self, "matrices", tuple(mats))

    def out_shape(self, in_shape):
        spatial = tuple(in_shape[1:])
        if len(spatial) != len(self.matrices):
            raise ArgumentError(f"{len(self.matrices)}-axis resample on input of shape {tuple(in_shape)}")
        for d, (L, a) in enumerate(zip(spatial, self.matrices)):
            if a.shape[1] != L:
                raise ArgumentError(f"resample axis {d}: matrix {a.shape} on length {L}")
        return (in_shape[0], *(a.shape[0] for a in self.matrices))

    def describe(self):
        return f"{self.label}{_fmt([a.shape for a in self.matrices])}"

    def with_weights(self, fn, fixed_fn=None):
        """Per axis, every non-zero c -> f(c), zeros kept: exact for the
        multiplicative f the passes use (|c|^q, c^2, c -> 1)."""
        f = fixed_fn or fn
        return replace(self, matrices=tuple(np.where(a != 0, f(a), 0.0) for a in self.matrices))

    def channel_ties(self, in_shape):
        c = np.arange(in_shape[0])
        return np.stack([c, c], axis=1)


@dataclass(frozen=True, eq=False)
class Gather(Map):
    """General element selection: out.flat[t] = in.flat[index[t]] (-1: zero).

    The fallback for index-moving ops no other fixed map describes."""

    index: np.ndarray
    shape: Shape
    label: str = "gather"
    kind = MapKind.GATHER

    def __post_init__(self):
        raw = np.asarray(self.index)
        if raw.size and not (np.issubdtype(raw.dtype, np.integer) or np.array_equal(raw, np.round(raw))):
            raise ArgumentError(f"gather index must hold whole numbers, got {raw.reshape(-1)[:4].tolist()}...")
        idx = np.array(self.index, dtype=np.int64).reshape(-1)
        idx.setflags(write=False)
        object.__setattr__(self, "index", idx)

    def out_shape(self, in_shape):
        if self.index.size != _prod(self.shape):
            raise ArgumentError(f"gather of {self.index.size} elements into shape {self.shape}")
        if self.index.size and self.index.max() >= _prod(in_shape):
            raise ArgumentError(f"gather reads element {self.index.max()} of an input of {_prod(in_shape)}")
        return tuple(self.shape)

    def describe(self):
        return f"{self.label}{_fmt(self.shape)}"

    def channel_ties(self, in_shape):
        t = np.flatnonzero(self.index >= 0)
        src = _element_channels(tuple(in_shape))[self.index[t]]
        tgt = _element_channels(self.shape)[t]
        return _unique_pairs(src, tgt)


@dataclass(frozen=True, eq=False)
class FixedConv(Map):
    """A convolution whose kernel is a constant (a buffer or a constant of the model, never a
    free weight): ``Conv``'s semantics and geometry, the kernel (out_channels,
    in_channels // groups, *kernel) held as an array. Per-channel and dense fixed filter banks
    (Sobel, Gabor, fixed random features). A kernel entry exactly 0 is no edge; every other
    entry joins its source channel and target channel by a constant edge, so
    ``channel_ties`` ties them (one log-scale), and a rescaling never changes the kernel."""

    kernel: np.ndarray
    stride: Shape
    padding: tuple[tuple[int, int], ...]
    dilation: Shape
    groups: int = 1
    label: str = "fixed_conv"
    kind = MapKind.FIXED_CONV

    def __post_init__(self):
        k = np.array(self.kernel, dtype=np.float64)
        if k.ndim < 3:
            raise ArgumentError(f"fixed conv: the kernel has shape {k.shape}, expected (out, in/groups, *kernel)")
        k.setflags(write=False)
        object.__setattr__(self, "kernel", k)

    @property
    def W(self) -> Param:
        """The kernel as an unbound Param (for the convolution arithmetic the backends share with
        ``Conv``); it is not a param of the graph: ``weight`` is None."""
        return Param.adopt(self.label, self.kernel)

    def out_shape(self, in_shape):
        return Conv(self.W, self.stride, self.padding, self.dilation, self.groups).out_shape(in_shape)

    def describe(self):
        opts = [f"{k}={_fmt(v)}" for k, v, plain in (("s", self.stride, 1), ("p", self.padding, (0, 0)),
                                                     ("d", self.dilation, 1)) if any(e != plain for e in v)]
        opts += [f"g={self.groups}"] if self.groups != 1 else []
        return f"{self.label}{_fmt(self.kernel.shape)}" + (f"({', '.join(opts)})" if opts else "")

    def with_weights(self, fn, fixed_fn=None):
        return replace(self, kernel=np.where(self.kernel != 0, (fixed_fn or fn)(self.kernel), 0.0))

    def kernel_channels(self, in_shape: Shape) -> tuple[np.ndarray, np.ndarray]:
        """For every kernel entry, its target channel and source channel (as ``Conv.weight_channels``)."""
        return Conv(self.W, self.stride, self.padding, self.dilation, self.groups).weight_channels(in_shape)

    def channel_ties(self, in_shape):
        O, I_g = self.kernel.shape[:2]
        nz = np.any(self.kernel.reshape(O, I_g, -1) != 0, axis=2)
        o, i = np.nonzero(nz)
        src = (o // (O // self.groups)) * I_g + i
        return _unique_pairs(src, o)


# ---------------------------------------------------------- parameterized maps


@dataclass(frozen=True, eq=False)
class Dense(Map):
    """out = W @ in.flatten(); W has shape (out_features, numel(in))."""

    W: Param
    kind = MapKind.DENSE

    @property
    def weight(self):
        return self.W

    def out_shape(self, in_shape):
        if self.W.shape[1] != _prod(in_shape):
            raise ArgumentError(f"dense weight {self.W.shape} on input of shape {in_shape} ({_prod(in_shape)} features)")
        return (self.W.shape[0],)

    def describe(self):
        return f"dense({self.W.name})"

    def with_weights(self, fn, fixed_fn=None):
        return replace(self, W=self.W.with_value(fn(self.W.value)))

    def weight_channels(self, in_shape):
        per_channel = _prod(in_shape[1:])
        out = np.arange(self.W.shape[0])[:, None]
        inc = (np.arange(self.W.shape[1]) // per_channel)[None, :]
        return out, inc


@dataclass(frozen=True, eq=False)
class Conv(Map):
    """N-d convolution (cross-correlation, torch semantics): W has shape
    (out_channels, in_channels // groups, *kernel); padding is (before, after)
    per spatial axis."""

    W: Param
    stride: Shape
    padding: tuple[tuple[int, int], ...]
    dilation: Shape
    groups: int = 1
    kind = MapKind.CONV

    @property
    def weight(self):
        return self.W

    def out_shape(self, in_shape):
        O, I_g, *k = self.W.shape
        if not len(self.stride) == len(self.padding) == len(self.dilation) == len(k):
            raise ArgumentError(f"conv geometry: stride {list(self.stride)}, padding {list(self.padding)} and dilation "
                                f"{list(self.dilation)} must have one entry per spatial axis of the kernel {list(k)}")
        if not all(kk >= 1 for kk in k) or not isinstance(self.groups, (int, np.integer)) or self.groups < 1:
            raise ArgumentError(f"conv kernel {list(k)} (groups={self.groups}): every axis at least 1, groups >= 1")
        if in_shape[0] != I_g * self.groups or O % self.groups:
            raise ArgumentError(f"conv weight {self.W.shape} (groups={self.groups}) on input of shape {in_shape}")
        if len(in_shape) - 1 != len(k):
            raise ArgumentError(f"{len(k)}-d conv on input of shape {in_shape}")
        out = tuple(
            pool_output_size(L, kk, s, p, d, False)
            for L, kk, s, p, d in zip(in_shape[1:], k, self.stride, self.padding, self.dilation)
        )
        return (O, *out)

    def describe(self):
        text = f"conv({self.W.name}"
        if any(s != 1 for s in self.stride):
            text += f", s={_fmt(self.stride)}"
        if any(p != (0, 0) for p in self.padding):
            text += f", p={_fmt(self.padding)}"
        if any(d != 1 for d in self.dilation):
            text += f", d={_fmt(self.dilation)}"
        if self.groups != 1:
            text += f", g={self.groups}"
        return text + ")"

    def with_weights(self, fn, fixed_fn=None):
        return replace(self, W=self.W.with_value(fn(self.W.value)))

    def weight_channels(self, in_shape):
        O, I_g = self.W.shape[:2]
        extra = (1,) * (len(self.W.shape) - 2)
        o = np.arange(O).reshape(O, 1, *extra)
        i = np.arange(I_g).reshape(1, I_g, *extra)
        if self.groups == 1:  # the source channel does not depend on the output channel: keep it compact
            return o, i
        return o, (o // (O // self.groups)) * I_g + i


@dataclass(frozen=True, eq=False)
class Scale(Map):
    """out[c] = w[c] * in[c] (an unfolded batch-norm)."""

    W: Param
    kind = MapKind.SCALE

    @property
    def weight(self):
        return self.W

    def out_shape(self, in_shape):
        if self.W.shape != (in_shape[0],):
            raise ArgumentError(f"scale of shape {self.W.shape} on input of shape {in_shape}")
        return tuple(in_shape)

    def describe(self):
        return f"scale({self.W.name})"

    def with_weights(self, fn, fixed_fn=None):
        return replace(self, W=self.W.with_value(fn(self.W.value)))

    def weight_channels(self, in_shape):
        c = np.arange(self.W.shape[0])
        return c, c
