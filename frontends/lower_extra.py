"""More torch ops inside the ReLU DAG model (docs/math.md §1), on the lowering core's Values.

- fixed scalar edges: ``a - b`` (a −1 edge), ``-x``, ``x * c``, ``c * x``, ``x / c``,
  ``add(a, b, alpha=c)``: a constant c is a *fixed* weight (never rescaled, it ties
  source and target channels); a scalar on a (C, *S) tensor is a 1-window Pool
  whose multiplier is c at every position, on a flat (C,) tensor a 1×1 SpatialMatrix;
- a constant *tensor* factor ``x * self.buf`` / ``x / self.buf`` (a buffer or a constant,
  no ``nn.Parameter``): one fixed factor per channel, position or element, a 1-window
  Pool whose multiplier has shape (C, *S) (a flat tensor goes through (C, 1));
- a learnable per-channel scale ``x * self.gamma`` (gamma of shape (C,), (C, 1, ..)
  or (1, C, 1, ..)): a parameterized ``Scale`` edge (layer-scale);
- elementwise ``torch.max(a, b)`` / ``torch.maximum`` / ``fmax``: a max-pool neuron
  (k = 1) over the antecedents a and b: the inputs are stacked on a new last axis
  (fixed selection edges into an identity node) and max-pooled over it;
- ReLU spelled otherwise: ``nn.LeakyReLU(0)``, ``F.leaky_relu(x, 0)``, ``clamp(min=0)``,
  ``clamp_min(x, 0)``, ``F.threshold(x, 0, 0)``;
- ``nn.Unflatten`` / ``x.unflatten``: an index op.

Each ``lower_*`` returns the result Value, or :data:`NOT_MINE` when the op is not
one of these (the interpreter goes on with its own table).
"""

from __future__ import annotations

import numbers
import operator

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from pathir.frontends import reductions
from pathir.frontends.fixed_factors import fixed_scale
from pathir.frontends.values import NOT_MINE, ParamTensor, Value
from pathir.ir import Pool, Scale, SourceRef

__all__ = ["NOT_MINE", "lower_function", "lower_method", "lower_module", "fixed_scale"]



def _scalar(c):
    """A Python/numpy number or a 0-d / 1-element non-parameter tensor, as float; else None."""
    if isinstance(c, ParamTensor) and not isinstance(c.tensor, nn.Parameter):
        c = c.tensor  # a constant or buffer: a fixed weight
    if isinstance(c, bool):
        return None
    if isinstance(c, numbers.Real):
        return float(c)
    if isinstance(c, torch.Tensor) and c.numel() == 1 and not isinstance(c, nn.Parameter):
        return float(c.detach().reshape(()).cpu())
    return None


_COMPLEX = (torch.complex64, torch.complex128)


def _constant_tensor(c) -> np.ndarray | None:
    """A tensor that is no learnable parameter (a buffer, a constant made in the forward, an
    ONNX initializer) as a float64 array; else None."""
    if isinstance(c, ParamTensor):
        c = c.tensor
    if isinstance(c, np.ndarray) and (np.issubdtype(c.dtype, np.floating) or np.issubdtype(c.dtype, np.integer) or c.dtype == np.bool_):
        return c.astype(np.float64)
    if isinstance(c, torch.Tensor) and not isinstance(c, nn.Parameter) and c.dtype not in _COMPLEX:
        return c.detach().to("cpu", torch.float64).numpy()  # a bool mask multiplies by 0 / 1
    return None


def _add(low, a, b, alpha=1):
    if alpha != 1:
        c = _scalar(alpha)
        if c is None:
            low.unsupported("add with a non-constant alpha")
        b = fixed_scale(low, b, c)
    return low.add(a, b)


def _sub(low, a, b, alpha=1):
    if not (isinstance(a, Value) and isinstance(b, Value)):
        low.unsupported("subtracting a constant: a fixed non-zero bias breaks the rescaling symmetry")
    c = _scalar(alpha)
    if c is None:
        low.unsupported("sub with a non-constant alpha")
    return low.add(a, fixed_scale(low, b, -c))


def _mul(low, a, b):
    if isinstance(b, Value) and not isinstance(a, Value):
        a, b = b, a
    if not isinstance(a, Value) or isinstance(b, Value):
        return NOT_MINE  # a gate between two activations, or no activation: the interpreter refuses
    c = _scalar(b)
    if c is not None:
        return fixed_scale(low, a, c)
    const = _constant_tensor(b)
    if const is not None:
        return fixed_scale(low, a, const)  # a buffer or constant: a fixed factor, never rescaled
    if isinstance(b, ParamTensor):
        return _layer_scale(low, a, b)
    return NOT_MINE


def _div(low, a, b):
    if isinstance(b, Value):
        low.unsupported("division by an activation is not positively homogeneous")
    if isinstance(b, ParamTensor) and isinstance(b.tensor, nn.Parameter):
        low.unsupported(f"divides an activation by the learnable parameter '{b.name}': a rescaling could not be "
                        "written back through 1/θ; multiply by a per-channel parameter (a layer-scale) instead")
    c = _scalar(b)
    if c is None:
        const = _constant_tensor(b)
        if const is None or not isinstance(a, Value):
            return NOT_MINE
        if np.any(const == 0):
            low.unsupported("division by a constant tensor with zero entries")
        return fixed_scale(low, a, 1.0 / const)
    if c == 0:
        return NOT_MINE
    return fixed_scale(low, a, 1.0 / c)


def _layer_scale(low, v: Value, gamma: ParamTensor) -> Value:
    """x * gamma, gamma one learnable number per channel: a parameterized Scale edge."""
    t = gamma.tensor
    if gamma.kind != "parameter" or not t.is_floating_point():
        low.unsupported(f"multiplies an activation by the {gamma.kind} '{gamma.name}' of dtype {t.dtype}: only a "
                        "floating-point nn.Parameter is a rescalable (learnable) scale, and a write-back could "
                        "not keep the function through it")
    channels = v.shape[0]
    nd = len(v.shape) + 1  # with the batch axis
    dims = list(t.shape)
    while len(dims) < nd:
        dims.insert(0, 1)
    per_channel = len(dims) == nd and dims[0] == 1 and dims[1] == channels and all(d == 1 for d in dims[2:])
    if not per_channel:
        low.unsupported(f"multiplies an activation of shape {list(v.shape)} by the parameter '{gamma.name}' of "
                        f"shape {list(t.shape)}: only one learnable factor per channel (a layer-scale) is a "
                        "rescalable edge")
    value = t.detach().to("cpu", torch.float64).reshape(channels).numpy().copy()
    W = low.param(gamma.name, value, (SourceRef(gamma.name),))
    src = low.materialize(v)
    return Value([(src, Scale(W))], tuple(v.shape), None, low.label)


def _max(low, values) -> Value:
    """Elementwise max of activations: a max-pool neuron over them (stacked on a new last axis)."""
    values = [low._value(v) for v in values]
    if len({v.shape for v in values}) != 1:
        low.unsupported("elementwise max of activations of different shapes (broadcasting)")
    k = len(values)
    stacked = low.index_op(lambda *ts: torch.stack(ts, dim=-1), values)[0][0]
    n = len(stacked.shape) - 1
    window = (1,) * (n - 1) + (k,)
    pool = Pool(window, window, ((0, 0),) * n, (1,) * n, False)
    src = low.materialize(stacked)
    name = low.b.maxpool(low.label, src, pool, origin=getattr(low, "where", ""))
    pooled = Value.of_node(name, low.b.shape(name))
    return low.index_op(lambda t: t.squeeze(-1), [pooled])[0][0]


def _is_zero(c) -> bool:
    s = _scalar(c)
    return s is not None and s == 0.0


_SUB = {operator.sub, operator.isub, torch.sub, torch.subtract}
_MUL = {operator.mul, operator.imul, torch.mul, torch.multiply}
_DIV = {operator.truediv, operator.itruediv, torch.div, torch.divide, torch.true_divide}
_MAX2 = {torch.maximum, torch.fmax, torch.max}


_MATMUL = {torch.matmul, torch.mm, operator.matmul}


def lower_function(low, fn, args, kwargs):
    """A call_function the core does not lower, or NOT_MINE."""
    out = reductions.lower_function(low, fn, args, kwargs)
    if out is not NOT_MINE:
        return out
    if fn in _MATMUL and len(args) == 2 and isinstance(args[0], Value) and isinstance(args[1], ParamTensor):
        return low.matmul_param(args[0], args[1])
    if fn in _SUB:
        alpha = kwargs.get("alpha", 1)
        return _sub(low, args[0], args[1], alpha)
    if fn in (torch.add,) and "alpha" in kwargs and kwargs["alpha"] != 1:
        return _add(low, args[0], args[1], kwargs["alpha"])
    if fn is torch.rsub:
        return _sub(low, args[1], args[0], kwargs.get("alpha", 1))
    if fn in _MUL:
        return _mul(low, args[0], args[1])
    if fn in _DIV and kwargs.get("rounding_mode") is None:
        return _div(low, args[0], args[1])
    if fn in (operator.neg, torch.neg, torch.negative):
        return fixed_scale(low, args[0], -1.0)
    if fn in _MAX2 and len(args) == 2 and isinstance(args[0], Value) and isinstance(args[1], Value):
        return _max(low, args)
    if fn in (F.leaky_relu,):
        slope = args[1] if len(args) > 1 else kwargs.get("negative_slope", 0.01)
        return low.relu(args[0]) if _is_zero(slope) else NOT_MINE
    if fn in (torch.clamp, torch.clip, torch.clamp_min):
        return _clamp(low, fn, args, kwargs)
    if fn is F.threshold or fn is torch.threshold:
        th, value = (list(args[1:3]) + [kwargs.get("threshold"), kwargs.get("value")])[:2]
        return low.relu(args[0]) if _is_zero(th) and _is_zero(value) else NOT_MINE
    if fn is torch.unflatten:
        return low.index_op(lambda t: torch.unflatten(t, *args[1:], **kwargs), [args[0]])[0][0]
    return NOT_MINE


def _clamp(low, fn, args, kwargs):
    lo = args[1] if len(args) > 1 else kwargs.get("min")
    hi = args[2] if len(args) > 2 else kwargs.get("max")
    if fn is torch.clamp_min:
        hi = None
    return low.relu(args[0]) if _is_zero(lo) and hi is None else NOT_MINE


def lower_method(low, name, args, kwargs):
    """A call_method the core does not lower, or NOT_MINE."""
    self_ = args[0]
    out = reductions.lower_method(low, name, args, kwargs)
    if out is not NOT_MINE:
        return out
    if name in ("add", "add_") and kwargs.get("alpha", 1) != 1:
        return _add(low, self_, args[1], kwargs["alpha"])
    if name in ("sub", "sub_", "__sub__", "__isub__", "subtract"):
        return _sub(low, self_, args[1], kwargs.get("alpha", 1))
    if name == "__rsub__":
        return _sub(low, args[1], self_)
    if name in ("mul", "__mul__", "__rmul__", "multiply"):
        return _mul(low, self_, args[1])
    if name in ("div", "__truediv__", "divide", "true_divide") and kwargs.get("rounding_mode") is None:
        return _div(low, self_, args[1])
    if name in ("matmul", "__matmul__", "mm") and len(args) == 2 and isinstance(args[1], ParamTensor):
        return low.matmul_param(self_, args[1])
    if name in ("neg", "__neg__", "negative"):
        return fixed_scale(low, self_, -1.0)
    if name in ("maximum", "fmax", "max") and len(args) == 2 and isinstance(args[1], Value):
        return _max(low, args)
    if name in ("clamp", "clip", "clamp_min"):
        return _clamp(low, torch.clamp_min if name == "clamp_min" else torch.clamp, args, kwargs)
    if name == "unflatten":
        return low.index_op(lambda t: t.unflatten(*args[1:], **kwargs), [self_])[0][0]
    return NOT_MINE


def lower_module(low, mod, args):
    """A call_module the core does not lower, or NOT_MINE."""
    out = reductions.lower_module(low, mod, args)
    if out is not NOT_MINE:
        return out
    if isinstance(mod, nn.LeakyReLU) and mod.negative_slope == 0:
        return low.relu(args[0])
    if isinstance(mod, nn.Threshold) and mod.threshold == 0 and mod.value == 0:
        return low.relu(args[0])
    if isinstance(mod, nn.Unflatten):
        return low.index_op(lambda t: t.unflatten(mod.dim, mod.unflattened_size), [args[0]])[0][0]
    return NOT_MINE
