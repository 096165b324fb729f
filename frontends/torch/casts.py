"""Casts of an activation (``x.float()``, ``x.to(torch.float32)``): the identity where the target is the model's own
dtype, which the IR computes in throughout (a ``x = x.float()`` at the top of a float32 model's forward); refused
by name where it is another, whose rounding the graph does not follow."""

from __future__ import annotations

import torch

from pathir.frontends.torch.inputs import model_dtype_device

__all__ = ["float_", "double", "half", "bfloat16", "to", "type_"]

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


def to(low, input, *args, **kwargs):
    """``x.to(dtype)``, ``x.to(device)``, ``x.to(device, dtype)``, ``x.to(dtype=...)``; ``x.to(other)`` (another
    tensor's dtype) is refused."""
    if any(isinstance(a, torch.Tensor) or hasattr(a, "shape") or hasattr(a, "tensor") for a in args):  # (ParamTensor)
        low.unsupported(".to(tensor) casts an activation to another tensor's dtype, which pathir does not read")
    dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), None))
    return _cast(low, input, dtype, f".to({str(dtype).replace('torch.', '')})" if dtype is not None else ".to()")


def type_(low, input, dtype=None, *args, **kwargs):
    """``x.type(torch.float32)`` or ``x.type('torch.FloatTensor')``; ``x.type()`` returns a string, no tensor."""
    target = _TYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(target, torch.dtype):
        low.unsupported(f".type({dtype!r}) is not a cast to a floating dtype pathir reads")
    return _cast(low, input, target, f".type({dtype!r})")
