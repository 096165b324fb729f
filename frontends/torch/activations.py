"""Rules for ReLU and its other spellings, clipped ReLUs, and ops that are the identity in inference.

A ReLU is ``relu`` / ``relu_`` / ``nn.ReLU``, and ``leaky_relu`` with slope 0 (with slope 1 it is the
identity), ``clamp(min=0)`` / ``clamp_min(0)`` without a max, ``threshold(0, 0)``, ``hardtanh(0, inf)``. A clipped ReLU
min(max(x, 0), t) is ``nn.ReLU6`` / ``relu6``, ``nn.Hardtanh(0, t)`` / ``hardtanh(x, 0, t)``,
``clamp(x, 0, t)``, ``pathir.nn.ClippedReLU`` and ``torch.minimum(relu(x), buffer)``: ReLU(x) −
ReLU(ReLU(x) − t) with −t a param of the unit (:mod:`pathir.frontends.core.clipped`), bound to the
module, buffer or call that holds it (:mod:`.clipped`). Dropout (any kind) and ``nn.Identity`` are
the identity (inference semantics; dropout fixed in train mode in the code is refused by the
capture checks before any rule runs).
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from pathir.frontends.core.clipped import ClipLayout, clip_layout, threshold_vector
from pathir.frontends.core.values import ParamTensor, Value, f64
from pathir.frontends.torch.clipped import WRITABLE, ClipSite, module_threshold
from pathir.frontends.torch.why import refuse
from pathir.ir import Role, SourceRef

__all__ = ["copy_", "relu", "relu_module", "leaky_relu", "leaky_relu_module", "clamp", "clamp_min", "threshold",
           "threshold_module", "hardtanh", "hardtanh_module", "relu6", "clipped_relu_module", "minimum", "same",
           "same_module"]


def _is_zero(c) -> bool:
    return isinstance(c, numbers.Real) and not isinstance(c, bool) and float(c) == 0.0


def _number(c) -> bool:
    return isinstance(c, numbers.Real) and not isinstance(c, bool)


# ---------------------------------------------------------------- clipped ReLUs


def _clip_module(low, t: float, module_path: str | None) -> str | None:
    """The path of the nn.ReLU6 / nn.Hardtanh(0, t) module that runs this clip (the fx module call, or
    on the export path the module the ATen op runs in), or None for a functional call."""
    path = module_path if module_path is not None else low.where
    if not path:
        return None
    try:
        m = low.model.get_submodule(path)
    except AttributeError:
        return None
    if type(m) in WRITABLE and float(m.min_val) == 0.0 and float(m.max_val) == float(t):
        return path
    return None


def _clip(low, input, t, module_path: str | None = None):
    """min(max(input, 0), t) with t a number: the threshold param bound to its module or its call."""
    v = low.value(input)
    layout = clip_layout(low, v)
    c = layout.channels
    what = f"{low.op} at '{low.fx_name}'" + (f" in '{low.where}'" if low.where else "")
    vec = threshold_vector(low, t, c, what)
    path = _clip_module(low, t, module_path)
    trailing = layout.trailing(len(v.shape))
    if path is not None:
        name = f"{path}.threshold"
        known = low.param_of(name)
        if known is not None and (known.shape != (c,) or low.clips[name].trailing != trailing):
            name = low.unique_param_name(name)  # one module called on other channel counts or layouts: held
        model = low.model

        def make(model=model, path=path, c=c):  # the module as it is now (pathir.nn.ClippedReLU after a write-back)
            return -module_threshold(model.get_submodule(path), c)

        site, how = ClipSite("module", path, trailing), f"-{path}.max_val, one entry per channel"
    else:
        name = low.unique_param_name(f"{low.label}.threshold")

        def make(vec=vec):
            return vec.copy()

        site, how = ClipSite("call", what), f"-{float(t):g}, the threshold of {what}"
    low.clips[name] = site
    p = low.made(name, make, (), (SourceRef(name, Role.CLIP_THRESHOLD),), how)
    return low.clipped_relu(v, p, layout)


def _per_channel(t: np.ndarray, shape, name: str, layout=None) -> np.ndarray:
    """A threshold tensor that broadcasts against (N, *shape) to one value per channel, as (C,) (the channels of
    ``layout``, a :class:`ClipLayout`, where it is a permuted one); ValueError saying why for any other."""
    full = (1, *shape)
    try:
        ok = np.broadcast_shapes(t.shape, full) == full and t.ndim <= len(full)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"the threshold '{name}' of shape {list(t.shape)} does not broadcast to one value per "
                         f"channel of an activation of per-sample shape {list(shape)}")
    if layout is not None and layout.permuted:
        per = layout.per_channel(np.broadcast_to(t, full)[0])
        if per is None:
            raise ValueError(f"the threshold '{name}' of shape {list(t.shape)} is not one value per feature of the "
                             f"activation of per-sample shape {list(shape)}, a permuted layout (tokens, features or "
                             "channels last) whose features are the channels: it varies along another axis")
        return per
    per = np.broadcast_to(t, full)[0].reshape(shape[0], -1)
    if not np.all(per == per[:, :1]):
        raise ValueError(f"the threshold '{name}' of shape {list(t.shape)} is not one value per channel (axis 1) of "
                         f"an activation of per-sample shape {list(shape)}: it varies along another axis (one value "
                         "per feature of a (tokens, features) layout, say); pathir holds a clipped ReLU's threshold "
                         "per channel only")
    return per[:, 0].copy()


def _buffer_clip(low, v, pt: ParamTensor):
    """min(ReLU(v), buffer): the threshold param −buffer, per channel, written back into the buffer."""
    if not (low.is_buffer(pt) and low.is_registered(pt)):  # a threshold written back needs a tensor of the model
        what = "is a learnable parameter" if low.is_parameter(pt) else \
            "is a tensor computed in the forward, neither a parameter nor a buffer of the model: made there " \
            "(torch.tensor(...)), or computed from a buffer (self.t * 2, self.t.clamp(...), which the trace folds " \
            "into one constant); register the threshold itself as a buffer"
        low.unsupported(f"the threshold '{pt.name}' {what}: pathir lowers clipped ReLUs whose threshold is a number "
                        "(torch.clamp(x, 0, 0.3)) or a registered buffer")
    shape = v.shape
    if not bool(torch.isfinite(pt.tensor).all()):  # (NaN would read as "varies over positions")
        low.unsupported(f"the threshold '{pt.name}' holds NaN or infinite entries: a clipped ReLU's threshold is a "
                        "finite number per channel")
    layout = clip_layout(low, v)
    try:
        vec = _per_channel(f64(pt.tensor), shape, pt.name, layout)
    except ValueError as err:
        if not layout.permuted:
            low.unsupported(str(err))
        layout = ClipLayout.own(shape)  # a permutation's threshold per position of axis 1 (per token): exact, its
        try:                            # features tied by it
            vec = _per_channel(f64(pt.tensor), shape, pt.name, layout)
        except ValueError:
            low.unsupported(str(err))
    threshold_vector(low, vec, layout.channels, f"the threshold '{pt.name}'")  # finite, >= 0

    def make(t, shape=shape, name=pt.name, layout=layout):
        return -_per_channel(f64(t), shape, name, layout)

    # a buffer along another axis than the channels (one number repeated) cannot be scaled per channel: held
    name, trailing = pt.name, layout.trailing(len(shape)) if layout.holds(pt.tensor.shape, len(shape)) else None
    known = low.param_of(name)
    if known is not None and (known.shape != (layout.channels,) or low.clips[name].trailing != trailing):
        name = low.unique_param_name(name)  # one buffer read on other channel counts or layouts: held
    low.clips[name] = ClipSite("buffer", pt.name, trailing)
    p = low.made(name, make, (pt,), (SourceRef(name, Role.CLIP_THRESHOLD),), f"-{pt.name}, per channel")
    return low.clipped_relu(v, p, layout)


def relu6(low, input, inplace=False):
    """``relu6``: min(max(x, 0), 6), a clipped ReLU."""
    return _clip(low, input, 6.0)


def clipped_relu_module(low, mod, input):
    """``pathir.nn.ClippedReLU``: min(max(x, 0), t) with its threshold buffer per channel."""
    kind = "buffer" if low.is_buffer(ParamTensor(f"{low.where}.threshold", mod.threshold)) else "parameter"
    return _buffer_clip(low, low.value(input), ParamTensor(f"{low.where}.threshold", mod.threshold, kind))


def minimum(low, input, other):
    """``torch.minimum(relu(x), t)`` with t a buffer of one value per channel: a clipped ReLU."""
    v, t = (input, other) if isinstance(input, Value) else (other, input)
    if not (isinstance(v, Value) and isinstance(t, ParamTensor)) or not low.is_relu_output(v):
        refuse(low)
    return _buffer_clip(low, v, t)


def relu(low, input, inplace=False):
    return low.relu(input)


def relu_module(low, mod, input):
    return low.relu(input)


def leaky_relu(low, input, negative_slope=0.01, inplace=False):
    """Slope 0: a ReLU; slope 1: the identity (x·1 is x in every float); any other slope is refused."""
    if _number(negative_slope) and float(negative_slope) == 1.0:
        return input
    if not _is_zero(negative_slope):
        refuse(low)
    return low.relu(input)


def leaky_relu_module(low, mod, input):
    return leaky_relu(low, input, mod.negative_slope)


def clamp(low, input, min=None, max=None):
    """``clamp(x, 0)``: a ReLU; ``clamp(x, 0, t)``: a clipped ReLU; another min is refused. A max that is a
    buffer of one value per channel after a ReLU (``relu(x).clamp(max=t)``, ``pathir.nn.ClippedReLU``'s in-place
    form) is :func:`minimum`'s clipped ReLU."""
    if isinstance(max, ParamTensor) and min is None:
        return minimum(low, input, max)
    if any(isinstance(b, (torch.Tensor, ParamTensor)) for b in (min, max)):
        low.unsupported("clamps with a tensor bound: clamp(x, 0) and clamp(x, 0, t) with numbers are lowered; a "
                        "threshold per channel is torch.minimum(torch.relu(x), t) or torch.relu(x).clamp(max=t) with t a "
                        "buffer of shape (C, 1, ..., 1)")
    if not _is_zero(min) or not (max is None or _number(max)):
        refuse(low)
    if max is None or float(max) == math.inf:
        return low.relu(input)
    return _clip(low, input, float(max))


def clamp_min(low, input, min):
    return clamp(low, input, min)


def threshold(low, input, threshold, value, inplace=False):
    if not (_is_zero(threshold) and _is_zero(value)):
        refuse(low)
    return low.relu(input)


def threshold_module(low, mod, input):
    return threshold(low, input, mod.threshold, mod.value)


def _hardtanh(low, input, min_val, max_val, module_path):
    if not (_is_zero(min_val) and _number(max_val)):
        refuse(low)
    if float(max_val) == math.inf:
        return low.relu(input)
    return _clip(low, input, float(max_val), module_path)


def hardtanh(low, input, min_val=-1.0, max_val=1.0, inplace=False):
    """``hardtanh(x, 0, inf)`` is a ReLU, ``hardtanh(x, 0, t)`` a clipped ReLU; another min is refused."""
    return _hardtanh(low, input, min_val, max_val, None)


def hardtanh_module(low, mod, input):
    """``nn.Hardtanh`` / ``nn.ReLU6``: its threshold bound to the module (a rescaling replaces it by a
    ``pathir.nn.ClippedReLU`` when it moves the channels' thresholds)."""
    return _hardtanh(low, input, mod.min_val, mod.max_val, low.where)


def same(low, input, *args, **kwargs):
    """The identity in inference (dropout, detach, contiguous, clone): the argument itself."""
    return input


def same_module(low, mod, input, *args, **kwargs):
    return input


def copy_(low, input, src, non_blocking=False):
    """``h.copy_(src)``: h holds src from then on (its later readers read src: the capture's alias plan),
    broadcast to h's shape as torch broadcasts it (an element move); a constant written over an activation is
    refused."""
    if not isinstance(src, Value):
        low.unsupported("copy_ writes a constant over an activation: no input reaches the values it leaves")
    src, shape = low.value(src), tuple(low.value(input).shape)
    if tuple(src.shape) == shape:
        return src
    if len(src.shape) != len(shape) or any(a not in (1, b) for a, b in zip(src.shape, shape)):
        # (of another rank, the value's batch axis would broadcast along one of h's own)
        low.unsupported(f"copy_ of a value of shape {list(src.shape)} into one of shape {list(shape)} (per sample): "
                        "only a value of the same rank broadcasts sample by sample")
    return low.index_op(lambda x: x.expand(x.shape[0], *shape), [src])[0][0]
