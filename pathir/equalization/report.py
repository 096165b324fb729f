"""What an equalization run reports: per weight tensor, the channel range spread and the per-tensor
quantization SQNR before and after; overall, the objective, the certified output bound of the
quantized model before and after, and the observed output change on the inputs given."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from pathir.equalization.absorb import AbsorbReport

__all__ = ["TensorRow", "EqualizeReport"]


@dataclass
class TensorRow:
    """One quantized weight tensor: max/min output-channel range and per-tensor SQNR (dB) at the
    report's bit width, before and after the rescaling."""

    name: str
    spread_before: float
    spread_after: float
    sqnr_before: float
    sqnr_after: float


@dataclass
class EqualizeReport:
    """The result of ``Compiled.equalize``.

    ``bound_before`` / ``bound_after``: the certified bound max(‖x‖∞, 1)·‖Φ(θ) − Φ(Q(θ))‖₁ (upper end
    of the path-metric bracket; ‖x‖∞ of the inputs given, else 1) on the change of the outputs that
    quantizing every weight tensor per tensor at ``bits`` causes, for inputs with max(‖x‖∞, 1) ≤
    ``input_scale`` (without inputs 1: the bound per unit of max(‖x‖∞, 1)); ``observed_before`` / ``_after``:
    the largest ‖R_θ(x) − R_Q(θ)(x)‖₁ over the inputs given (None without inputs). "After" is the model as
    written, its absorbed biases included. ``z``: the log-scales written (θ ← θ ⊙ exp(−Bz/2))."""

    name: str
    objective: str
    bits: int
    units: int
    tensors: list[TensorRow]
    objective_before: float
    objective_after: float
    bound_before: float | None  # None unless certified (``certify=True``, or the path-metric objective)
    bound_after: float | None
    observed_before: float | None
    observed_after: float | None
    units_moved: int
    units_at_bound: int
    max_log_scale: float
    iterations: list[int]
    converged: bool
    seconds: float
    written: bool
    z: object = field(repr=False, default=None)
    notes: list[str] = field(default_factory=list)
    relu_change: float | None = None  # relu6="relu": the largest output change, relative, replacing clipped ReLUs
    absorption: AbsorbReport | None = None  # absorb_bias=True: what bias absorption changed (absorb.py)
    input_scale: float = 1.0  # max(‖x‖∞, 1) of the inputs given: the bound holds for inputs up to it
    inputs_given: bool = False
    write_back: bool = False  # asked for; ``written`` is False with it where there was nothing to write (z = 0)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("z")
        out["tensors"] = [asdict(t) for t in self.tensors]
        return _finite(out)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        lines = [f"equalize ({self.objective}) of {self.name}: {len(self.tensors)} weight tensors, {self.units} units, "
                 f"W{self.bits} per tensor",
                 f"{'tensor':<32} {'spread before':>13} {'after':>9} {'SQNR before':>11} {'after':>7}"]
        for t in self.tensors:
            lines.append(f"{t.name[-32:]:<32} {t.spread_before:>13.3g} {t.spread_after:>9.3g} "
                         f"{t.sqnr_before:>11.2f} {t.sqnr_after:>7.2f}")
        lines.append(f"objective {self.objective_before:.6g} -> {self.objective_after:.6g}; "
                     f"{self.units_moved} units moved, {self.units_at_bound} at the bound |z| = {self.max_log_scale:.3g}; "
                     f"{sum(self.iterations)} iterations, {'converged' if self.converged else 'NOT converged'}, "
                     f"{self.seconds:.2f} s")
        if self.bound_before is not None:
            reach = (f"for inputs with ‖x‖∞ ≤ {self.input_scale:.4g}" if self.inputs_given else
                     "per unit of max(‖x‖∞, 1): multiply by it for larger inputs")
            lines.append(f"certified output bound of W{self.bits}: {self.bound_before:.4g} -> {self.bound_after:.4g} "
                         f"({reach})")
        if self.observed_before is not None:
            lines.append(f"observed output change on the inputs: {self.observed_before:.4g} -> {self.observed_after:.4g}")
        if self.absorption is not None:
            lines += self.absorption.lines()
        lines += self.notes
        if self.written or not self.write_back:
            lines.append("written into the model" if self.written else "not written (write_back=False)")
        return "\n".join(lines)


def _finite(obj):
    """JSON has no inf / nan: write them as strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj
