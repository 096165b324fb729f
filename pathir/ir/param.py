"""Params: named float64 arrays bound to where they live in the source model."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

__all__ = ["Role", "SourceRef", "Param"]


class Role(enum.Enum):
    """How a source tensor takes part in an IR param (used by write-back).

    VALUE      the param's value is this tensor (same shape, or transposed):
               masks, scores and diag G are reported under its name.
    OUT_SCALE  a per-output-channel tensor that multiplies the param (batch-norm
               gamma or beta of a folded batch-norm): a rescaling's outgoing-side
               factor of the unit lands here instead of on the VALUE tensor.
    IN_STATS   batch-norm running statistics that absorb an incoming factor of
               an unfolded batch-norm scale (eval-mode exact).
    """

    VALUE = "value"
    OUT_SCALE = "out_scale"
    IN_STATS = "in_stats"


@dataclass(frozen=True, slots=True)
class SourceRef:
    """One source tensor a param is made from.

    ``transposed`` is true when the param's value is the transpose of the
    source tensor (ONNX Gemm with transB=0, MatMul initializers).
    """

    name: str
    role: Role = Role.VALUE
    transposed: bool = False


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
        if not (isinstance(value, np.ndarray) and value.dtype == np.float64 and not value.flags.writeable):
            value = np.array(value, dtype=np.float64, copy=True)  # never alias an array someone may write
            value.setflags(write=False)
        object.__setattr__(self, "value", value)

    @classmethod
    def adopt(cls, name: str, value: np.ndarray, sources=(), how: str = "") -> "Param":
        """A Param owning ``value`` (a fresh float64 array nobody else holds): no copy."""
        value = np.ascontiguousarray(value, dtype=np.float64)
        value.setflags(write=False)
        return cls(name, value, tuple(sources), how)

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
        value = np.asarray(value, dtype=np.float64)
        if value.shape != self.value.shape:
            raise ValueError(f"param '{self.name}': new value has shape {value.shape}, expected {self.shape}")
        if owned:
            return Param.adopt(self.name, value, self.sources, self.how)
        return Param(self.name, value, self.sources, self.how)
