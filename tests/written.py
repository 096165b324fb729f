"""Checks that a write-back reached the user's model itself: its output kept is not enough (an untouched model
keeps it too)."""

import torch


def state(model) -> dict[str, torch.Tensor]:
    """A copy of every floating tensor the model holds (parameters and buffers), by name."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}


def moved(model, before: dict[str, torch.Tensor]) -> float:
    """The largest relative change of one of the model's floating tensors since ``before``: max |after − before| /
    max |before|, over the tensors."""
    now = model.state_dict()
    out = 0.0
    for k, v in before.items():
        scale = float(v.abs().max()) if v.numel() else 0.0
        if scale > 0:
            out = max(out, float((now[k].detach().to(v.dtype) - v).abs().max()) / scale)
    return out
