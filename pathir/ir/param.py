"""Params: named float64 arrays bound to where they live in the source model."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from pathir.errors import ArgumentError

__all__ = ["Role", "SourceRef", "TransposedConvLayout", "Param"]


class Role(enum.Enum):
    """How a source tensor takes part in an IR param (used by write-back).

    VALUE      the param's value is this tensor (same shape, or transposed):
               masks, scores and diag G are reported under its name.
    OUT_SCALE  a per-output-channel tensor that multiplies the param (batch-norm
               gamma or beta of a folded batch-norm): a rescaling's outgoing-side
               factor of the unit lands here instead of on the VALUE tensor.
    IN_STATS   batch-norm running statistics that absorb an incoming factor of
               an unfolded batch-norm scale (eval-mode exact).
    CLIP_THRESHOLD  the threshold t of a clipped ReLU min(max(x, 0), t): the param
               is −t, one entry per channel, the bias of the ReLU neuron
               ReLU(ReLU(x) − t) (docs/ir.md, "Clipped ReLUs"). The source is the
               clipped ReLU itself (an ``nn.ReLU6`` / ``nn.Hardtanh`` module, a
               ``pathir.nn.ClippedReLU``'s threshold buffer, a functional call, an
               ONNX Clip or Min node), not a model parameter: a rescaling's
               factor e^{s} of the unit moves t like a bias (t ← e^{s} t).
    """

    VALUE = "value"
    OUT_SCALE = "out_scale"
    IN_STATS = "in_stats"
    CLIP_THRESHOLD = "clip_threshold"


def _real(name: str, value):
    """``value``, refused where it is complex (a float64 cast would drop its imaginary part without a word)."""
    if np.iscomplexobj(value):
        raise ArgumentError(f"param '{name}': its value is complex ({np.asarray(value).dtype}); a param is real: take "
                            "the real part or the modulus yourself, if either is what you meant")
    return value


@dataclass(frozen=True, slots=True)
class TransposedConvLayout:
    """The param is the direct-convolution kernel of a transposed convolution.

    A transposed convolution's weight T has shape (C_in, C_out/g, *k). pathir lowers it as a
    zero-stuffing ``Gather`` followed by an ordinary ``Conv`` whose kernel W (C_out, C_in/g, *k)
    is T with the two channel axes swapped inside each of the g groups and every spatial axis
    flipped: W[j·O_g + o, i, κ] = T[j·I_g + i, o, k − 1 − κ]. A bijection of entries, so a factor,
    mask or score of W maps back to T entry by entry (``to_source``), and T to W (``from_source``).
    Both accept numpy arrays and torch tensors.
    """

    groups: int

    def from_source(self, t):
        """T (C_in, C_out/g, *k) -> W (C_out, C_in/g, *k)."""
        g = self.groups
        c_in, o_g, *k = t.shape
        a = _swap12(t.reshape(g, c_in // g, o_g, *k))
        return _flip(a, tuple(range(3, 3 + len(k)))).reshape(g * o_g, c_in // g, *k)

    def to_source(self, w):
        """W (C_out, C_in/g, *k) -> T (C_in, C_out/g, *k)."""
        g = self.groups
        c_out, i_g, *k = w.shape
        a = _swap12(w.reshape(g, c_out // g, i_g, *k))
        return _flip(a, tuple(range(3, 3 + len(k)))).reshape(g * i_g, c_out // g, *k)


@dataclass(frozen=True, slots=True)
class PointwiseKernelLayout:
    """The param is a Linear weight used as a pointwise (kernel 1) convolution kernel.

    ``nn.Linear`` on the last axis of a (..., F) activation acts at every other position: pathir
    lowers it as a convolution with kernel size 1 over the channels-first activation. Its kernel
    W (O, F, 1, …, 1) (``spatial`` ones) holds the weight L (O, F) entry by entry; ``transposed``:
    the source tensor is stored (F, O), as ``x @ B`` (ONNX MatMul) and ``F.linear(x, W.t())`` read it."""

    spatial: int
    transposed: bool = False

    def from_source(self, t):
        """L (O, F) (or its transpose, stored (F, O)) -> W (O, F, 1, …)."""
        t = t.T if self.transposed else t
        return t.reshape(*t.shape[:2], *(1,) * self.spatial)

    def to_source(self, w):
        """W (O, F, 1, …) -> L (O, F) (or its transpose (F, O), as stored)."""
        flat = w.reshape(*w.shape[:2])
        return flat.T if self.transposed else flat


def _swap12(a):
    return a.swapaxes(1, 2) if isinstance(a, np.ndarray) else a.transpose(1, 2)


def _flip(a, axes):
    if not axes:
        return a
    return np.flip(a, axes) if isinstance(a, np.ndarray) else a.flip(axes)


@dataclass(frozen=True, slots=True)
class SourceRef:
    """One source tensor a param is made from.

    ``transposed`` is true when the param's value is the transpose of the
    source tensor (ONNX Gemm with transB=0, MatMul initializers); ``layout``
    names any other entry-by-entry rearrangement (a transposed convolution's
    kernel). :meth:`to_source` / :meth:`from_source` apply them. ``fixed``: no
    rescaling may move the source (its node's channels are no unit).
    """

    name: str
    role: Role = Role.VALUE
    transposed: bool = False
    layout: TransposedConvLayout | PointwiseKernelLayout | None = None
    #: the source cannot take a rescaling's factor (a clipped ReLU's threshold written as one number in the code,
    #: one module called on tensors of several widths): find_units pins the channels of the node it is the bias of
    fixed: bool = False

    def to_source(self, a):
        """``a`` (the param's layout; numpy array or torch tensor) in the source tensor's layout."""
        if self.layout is not None:
            return self.layout.to_source(a)
        return a.T if self.transposed else a

    def from_source(self, t):
        """The source tensor ``t`` (numpy array or torch tensor) in the param's layout."""
        if self.layout is not None:
            return self.layout.from_source(t)
        return t.T if self.transposed else t


def _chain(value: np.ndarray) -> list[np.ndarray]:
    """``value``, then every array it is a view of, down to the one that owns the memory (or views a buffer)."""
    chain = [value]
    while isinstance(chain[-1].base, np.ndarray):
        chain.append(chain[-1].base)
    return chain


def _locked(value: np.ndarray) -> bool:
    """Whether ``value`` is read-only for good: a view whose every base down to its owner is read-only (numpy
    refuses to set a view's WRITEABLE flag again while its owner is read-only; an owner may always set it)."""
    chain = _chain(value)
    return len(chain) > 1 and not any(a.flags.writeable for a in chain)


def _frozen(value: np.ndarray) -> np.ndarray:
    """``value`` (float64, no other writer) as an array nobody can write: its whole chain of arrays made read-only,
    and a view of it returned, so that a user pass's ``p.value.setflags(write=True)`` is refused and a Param two
    graphs share cannot change under one."""
    if _locked(value):
        return value
    for a in reversed(_chain(value)):
        a.setflags(write=False)
    return value.view()


def unlocked(value: np.ndarray) -> np.ndarray:
    """``value`` made writable again, with every array it is a view of: pathir's own in-place fold of a graph no
    one else reads (``fold_batchnorm(in_place=True)``). ValueError over memory that is read-only at its root."""
    for a in reversed(_chain(value)):
        a.setflags(write=True)
    return value


@dataclass(frozen=True, eq=False)
class Param:
    """A named float64 tensor; read-only. Passes make new Params, never edit one.

    ``sources`` binds the param to the source model; ``how`` says in words what
    transform produced it (e.g. "conv1.weight * bn1.weight / sqrt(bn1.running_var + eps)").
    """

    name: str
    value: np.ndarray
    sources: tuple[SourceRef, ...] = ()
    how: str = ""

    def __post_init__(self):
        value = self.value
        if not (isinstance(value, np.ndarray) and value.dtype == np.float64
                and not any(a.flags.writeable for a in _chain(value))):
            # never alias an array someone may write, nor lock one: a read-only view of a writable array is copied
            # (locking its chain would make the caller's own array read-only)
            value = np.array(_real(self.name, value), dtype=np.float64, copy=True)
        object.__setattr__(self, "value", _frozen(value))

    def __reduce__(self):
        """Pickled and deep-copied as its fields, rebuilt by :meth:`adopt` (the array unpickled is fresh): locked
        again, where a plain dataclass copy came back writable."""
        return (Param.adopt, (self.name, self.value, self.sources, self.how))

    @classmethod
    def adopt(cls, name: str, value: np.ndarray, sources=(), how: str = "") -> "Param":
        """A Param owning ``value`` (a fresh float64 array nobody else holds): no copy."""
        value = np.ascontiguousarray(_real(name, value), dtype=np.float64)
        return cls(name, _frozen(value), tuple(sources), how)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    @property
    def size(self) -> int:
        return int(self.value.size)

    @property
    def source_name(self) -> str:
        """The name results are reported under: the VALUE source, else the param name."""
        for ref in self.sources:
            if ref.role is Role.VALUE:
                return ref.name
        return self.name

    def with_value(self, value, owned: bool = False) -> "Param":
        """The same binding with another value (shape must agree). ``owned``: ``value`` is a
        fresh float64 array nobody else holds, taken without a copy (as :meth:`adopt`)."""
        value = np.asarray(_real(self.name, value), dtype=np.float64)
        if value.shape != self.value.shape:
            raise ArgumentError(f"param '{self.name}': new value has shape {value.shape}, expected {self.shape}")
        if owned:
            return Param.adopt(self.name, value, self.sources, self.how)
        return Param(self.name, value, self.sources, self.how)
