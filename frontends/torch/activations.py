"""Rules for ReLU and its other spellings, and for ops that are the identity in inference.

A ReLU is ``relu`` / ``relu_`` / ``nn.ReLU``, and ``leaky_relu`` with slope 0, ``clamp(min=0)`` /
``clamp_min(0)`` without a max, ``threshold(0, 0)``, ``hardtanh(0, inf)``. Dropout (any kind) and
``nn.Identity`` are the identity (inference semantics; dropout fixed in train mode in the code is
refused by the capture checks before any rule runs).
"""

from __future__ import annotations

import math
import numbers

import torch.nn as nn

from pathir.frontends.torch.why import refuse

__all__ = ["relu", "relu_module", "leaky_relu", "leaky_relu_module", "clamp", "clamp_min", "threshold",
           "threshold_module", "hardtanh", "hardtanh_module", "same", "same_module"]


def _is_zero(c) -> bool:
    return isinstance(c, numbers.Real) and not isinstance(c, bool) and float(c) == 0.0


def relu(low, input, inplace=False):
    return low.relu(input)


def relu_module(low, mod, input):
    return low.relu(input)


def leaky_relu(low, input, negative_slope=0.01, inplace=False):
    if not _is_zero(negative_slope):
        refuse(low)
    return low.relu(input)


def leaky_relu_module(low, mod, input):
    return leaky_relu(low, input, mod.negative_slope)


def clamp(low, input, min=None, max=None):
    """``clamp(x, 0)``: a ReLU; a clamp with a max (a clipped ReLU) or another min is refused."""
    if not _is_zero(min) or max is not None:
        refuse(low)
    return low.relu(input)


def clamp_min(low, input, min):
    return clamp(low, input, min)


def threshold(low, input, threshold, value, inplace=False):
    if not (_is_zero(threshold) and _is_zero(value)):
        refuse(low)
    return low.relu(input)


def threshold_module(low, mod, input):
    return threshold(low, input, mod.threshold, mod.value)


def hardtanh(low, input, min_val=-1.0, max_val=1.0, inplace=False):
    """``hardtanh(x, 0, inf)`` is a ReLU; any finite bound clips (refused)."""
    if not (min_val == 0 and max_val == math.inf):
        refuse(low)
    return low.relu(input)


def hardtanh_module(low, mod, input):
    if isinstance(mod, nn.ReLU6):
        refuse(low)
    return hardtanh(low, input, mod.min_val, mod.max_val)


def same(low, input, *args, **kwargs):
    """The identity in inference (dropout, detach, contiguous, clone): the argument itself."""
    return input


def same_module(low, mod, input, *args, **kwargs):
    return input
