"""Casts of an activation (``x.float()``, ``x.to(torch.float32)``): the identity where the target is the model's own
dtype, which the IR computes in throughout (a ``x = x.float()`` at the top of a float32 model's forward); refused
by name where it is another, whose rounding the graph does not follow."""

from __future__ import annotations

import torch

from pathir.frontends.torch.inputs import model_dtype_device

__all__ = ["float_", "double", "half", "bfloat16", "to", "type_", "type_as"]

#: the legacy type strings of ``Tensor.type``
_TYPE_NAMES = {"torch.FloatTensor": torch.float32, "torch.DoubleTensor": torch.float64, "torch.HalfTensor": torch.float16,
               "torch.BFloat16Tensor": torch.bfloat16}


def _cast(low, input, dtype, how: str):
    """``input`` where ``dtype`` is the model's dtype (or None: no dtype named, a move between devices only)."""
    model_dtype = model_dtype_device(low.model)[0]
    if dtype is None or dtype == model_dtype:
        return input
    shown = str(dtype).replace("torch.", "")
    low.unsupported(f"{how} casts an activation to {shown} in a {str(model_dtype).replace('torch.', '')} model: the "
                    "IR computes in the model's dtype throughout and does not follow the other dtype's rounding")


def float_(low, input, *args, **kwargs):
    return _cast(low, input, torch.float32, ".float()")


def double(low, input, *args, **kwargs):
    return _cast(low, input, torch.float64, ".double()")


def half(low, input, *args, **kwargs):
    return _cast(low, input, torch.float16, ".half()")


def bfloat16(low, input, *args, **kwargs):
    return _cast(low, input, torch.bfloat16, ".bfloat16()")


def _dtype_of(low, other) -> torch.dtype:
    """The dtype of ``other``: an activation's is the model's (the self-check refuses a model of mixed dtypes), a
    parameter's, buffer's or constant's its own."""
    if isinstance(other, torch.Tensor):
        return other.dtype
    if hasattr(other, "tensor"):  # (a ParamTensor)
        return other.tensor.dtype
    return model_dtype_device(low.model)[0]


def to(low, input, *args, **kwargs):
    """``x.to(dtype)``, ``x.to(device)``, ``x.to(device, dtype)``, ``x.to(dtype=...)``, ``x.to(other)`` (another
    tensor's dtype)."""
    other = next((a for a in args if isinstance(a, torch.Tensor) or hasattr(a, "shape") or hasattr(a, "tensor")), None)
    if other is not None:
        return _cast(low, input, _dtype_of(low, other), ".to(tensor)")
    dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), None))
    return _cast(low, input, dtype, f".to({str(dtype).replace('torch.', '')})" if dtype is not None else ".to()")


def type_(low, input, dtype=None, *args, **kwargs):
    """``x.type(torch.float32)`` or ``x.type('torch.FloatTensor')``; ``x.type()`` returns a string, no tensor."""
    target = _TYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(target, torch.dtype):
        low.unsupported(f".type({dtype!r}) is not a cast to a floating dtype pathir reads")
    return _cast(low, input, target, f".type({dtype!r})")


def type_as(low, input, other):
    """``x.type_as(other)``: the cast to ``other``'s dtype (:func:`_dtype_of`)."""
    return _cast(low, input, _dtype_of(low, other), ".type_as()")
