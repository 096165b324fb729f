"""Dispatch of the torch frontend's fixed-map ops (:mod:`.fixed_maps`): which nn modules,
functions, tensor methods and ATen ops are padding, resampling, pixel shuffle, fixed
filters or literal arithmetic, with their arguments bound. Each dispatcher returns the
lowered Value, or ``NOT_MINE`` for an op that is not one of these (the caller goes on).
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from pathir.frontends.fixed_maps import (
    add,
    axis_matrices,
    conv_with_mode,
    fixed_conv,
    interpolate,
    is_buffer,
    literal,
    mul,
    pad,
    pixel_shuffle,
    pixel_unshuffle,
    resampled,
)
from pathir.frontends.values import NOT_MINE, ParamTensor, Value

__all__ = ["NOT_MINE", "module", "function", "method", "aten_op", "conv_with_mode"]

#: returned by the dispatchers when the op is not one of theirs


def _pad_modules() -> dict:
    nn = torch.nn
    table = {}
    for n in (1, 2, 3):
        for prefix, mode in (("Zero", "constant"), ("Constant", "constant"), ("Reflection", "reflect"),
                             ("Replication", "replicate"), ("Circular", "circular")):
            cls = getattr(nn, f"{prefix}Pad{n}d", None)
            if cls is not None:
                table[cls] = mode
    return table


_PAD_MODULES = _pad_modules()


def module(low, mod, x):
    """A fixed-map module (padding, upsampling, pixel shuffle), or NOT_MINE."""
    nn = torch.nn
    for cls, mode in _PAD_MODULES.items():
        if isinstance(mod, cls):
            return pad(low, x, mod.padding, mode, getattr(mod, "value", None) if mode == "constant" else None)
    if isinstance(mod, nn.Upsample):  # UpsamplingNearest2d / UpsamplingBilinear2d included
        return interpolate(low, x, mod.size, mod.scale_factor, mod.mode, mod.align_corners,
                           getattr(mod, "recompute_scale_factor", None))
    if isinstance(mod, nn.PixelShuffle):
        return pixel_shuffle(low, x, mod.upscale_factor)
    if isinstance(mod, nn.PixelUnshuffle):
        return pixel_unshuffle(low, x, mod.downscale_factor)
    return NOT_MINE


def _bind(args, kwargs, names, defaults):
    out = dict(defaults)
    out.update(zip(names, args))
    out.update(kwargs)
    return [out[n] for n in names]


_INTERP_NAMES = ["input", "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias"]
_INTERP_DEFAULTS = {"size": None, "scale_factor": None, "mode": "nearest", "align_corners": None,
                    "recompute_scale_factor": None, "antialias": False}


def function(low, model, fn, args, kwargs):
    """A fixed-map function of the fx graph, or NOT_MINE."""
    if fn is F.pad or fn is torch.nn.functional.pad:
        x, p, mode, value = _bind(args, kwargs, ["input", "pad", "mode", "value"], {"mode": "constant", "value": None})
        return pad(low, x, p, mode, value)
    if fn in (F.interpolate, F.upsample):
        return interpolate(low, *_bind(args, kwargs, _INTERP_NAMES, _INTERP_DEFAULTS))
    if fn in (F.upsample_nearest, F.upsample_bilinear):
        x, size, scale = _bind(args, kwargs, ["input", "size", "scale_factor"], {"size": None, "scale_factor": None})
        linear = fn is F.upsample_bilinear
        return interpolate(low, x, size, scale, "bilinear" if linear else "nearest", True if linear else None)
    if fn in (F.pixel_shuffle, torch.pixel_shuffle):
        return pixel_shuffle(low, *_bind(args, kwargs, ["input", "upscale_factor"], {}))
    if fn in (F.pixel_unshuffle, torch.pixel_unshuffle):
        return pixel_unshuffle(low, *_bind(args, kwargs, ["input", "downscale_factor"], {}))
    if fn in (operator.add, operator.iadd, torch.add) and any(literal(a) for a in args[:2]):
        return add(low, args[0], args[1], kwargs.get("alpha", 1))
    if fn in (operator.mul, operator.imul, torch.mul):
        out = mul(low, args[0], args[1])
        return NOT_MINE if out is None else out
    if fn in (F.conv1d, F.conv2d, F.conv3d):
        a = _bind(args, kwargs, ["input", "weight", "bias", "stride", "padding", "dilation", "groups"],
                  {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1})
        if is_buffer(model, a[1]):
            return fixed_conv(low, *a)
    return NOT_MINE


def method(low, name, args, kwargs):
    """A fixed-map tensor method (``x.add(0)``, ``x * 1``), or NOT_MINE."""
    if name in ("add", "add_", "__add__", "__iadd__", "__radd__") and literal(args[1]):
        return add(low, args[0], args[1], kwargs.get("alpha", 1))
    if name in ("mul", "mul_", "__mul__", "__imul__", "__rmul__"):
        out = mul(low, args[0], args[1])
        return NOT_MINE if out is None else out
    return NOT_MINE


def _aten_tables():
    aten = torch.ops.aten
    pads = {}
    for n in (1, 2, 3):
        for op, mode in (("reflection", "reflect"), ("replication", "replicate")):
            overload = getattr(aten, f"{op}_pad{n}d", None)
            if overload is not None:
                pads[overload.default] = mode
    upsample, explicit = {}, {}
    for name, mode in (("upsample_nearest{}d", "nearest"), ("_upsample_nearest_exact{}d", "nearest-exact"),
                       ("upsample_linear1d", "linear"), ("upsample_bilinear2d", "bilinear"),
                       ("upsample_trilinear3d", "trilinear"), ("upsample_bicubic2d", "bicubic")):
        for n in (1, 2, 3):
            overload = getattr(aten, name.format(n), None)
            if overload is not None and hasattr(overload, "vec"):
                upsample[overload.vec] = mode
            if overload is not None and hasattr(overload, "default"):
                explicit[overload.default] = n
    return pads, upsample, explicit


#: pad overload -> mode; upsample .vec overload -> mode; upsample .default overload (input,
#: output_size, [align_corners], one scale or None per axis) -> number of spatial axes
_ATEN_PADS, _ATEN_UPSAMPLE, _ATEN_EXPLICIT = _aten_tables()


def _aten_upsample_default(low, fn, args, n):
    """An explicit-size upsample overload, its matrices read off the ATen op itself per axis
    (the size of axis d and its scale, the other axes kept at length 2, scale None)."""
    x, size = args[0], list(args[1])
    rest = list(args[2:])
    has_align = "nearest" not in fn.__name__
    align, scales = rest[:int(has_align)], (rest[int(has_align):] + [None] * n)[:n]

    def call(basis, d):
        sizes = [size[e] if e == d else 2 for e in range(n)]
        return fn(basis, sizes, *align, *[scales[e] if e == d else None for e in range(n)])

    return resampled(low, x, axis_matrices(low, x.shape[1:], call), fn.__name__.split(".")[0].lstrip("_"))


def aten_op(low, model, fn, args, kwargs):
    """A fixed-map ATen op of a torch.export graph, or NOT_MINE."""
    aten = torch.ops.aten
    flat = list(args) + [a for v in list(args) + list(kwargs.values()) if isinstance(v, (list, tuple)) for a in v]
    if not any(isinstance(a, (Value, ParamTensor)) for a in flat + list(kwargs.values())):
        return fn(*args, **kwargs)  # index arithmetic of decomposed ops (arange, clamp, ...): a constant
    if fn is aten.pad.default:
        x, p, mode, value = _bind(args, kwargs, ["input", "pad", "mode", "value"], {"mode": "constant", "value": None})
        return pad(low, x, p, mode, value)
    if fn is aten.constant_pad_nd.default:
        x, p, value = _bind(args, kwargs, ["input", "pad", "value"], {"value": 0})
        return pad(low, x, p, "constant", value)
    if fn in _ATEN_PADS:
        return pad(low, args[0], args[1], _ATEN_PADS[fn])
    if fn in _ATEN_UPSAMPLE:
        mode = _ATEN_UPSAMPLE[fn]
        if mode in ("nearest", "nearest-exact"):
            x, size, scales = _bind(args, kwargs, ["input", "output_size", "scale_factors"], {})
            return interpolate(low, x, size, scales, mode)
        x, size, align, scales = _bind(args, kwargs, ["input", "output_size", "align_corners", "scale_factors"], {})
        return interpolate(low, x, size, scales, mode, align)
    if fn in _ATEN_EXPLICIT:
        return _aten_upsample_default(low, fn, args, _ATEN_EXPLICIT[fn])
    if fn in (aten.index.Tensor, aten._unsafe_index.Tensor) and not any(
            isinstance(i, Value) for i in (args[1] or [])):
        return low.index_op(lambda t: fn(t, *args[1:]), [args[0]])[0][0]  # decomposed padding / nearest
    if fn is aten.pixel_shuffle.default:
        return pixel_shuffle(low, args[0], args[1])
    if fn is aten.pixel_unshuffle.default:
        return pixel_unshuffle(low, args[0], args[1])
    if fn in (aten.add.Tensor, aten.add_.Tensor, aten.add.Scalar) and any(literal(a) for a in args[:2]):
        return add(low, args[0], args[1], kwargs.get("alpha", 1))
    if fn in (aten.mul.Tensor, aten.mul.Scalar):
        out = mul(low, args[0], args[1])
        return NOT_MINE if out is None else out
    if fn in (aten.conv1d.default, aten.conv2d.default, aten.convolution.default) and is_buffer(model, args[1]):
        if fn is aten.convolution.default:
            x, w, b, stride, padding, dilation, transposed, _, groups = args[:9]
            if not transposed:
                return fixed_conv(low, x, w, b, stride, padding, dilation, groups)
            return NOT_MINE
        return fixed_conv(low, *_bind(args, kwargs, ["input", "weight", "bias", "stride", "padding", "dilation",
                                                     "groups"], {"bias": None, "stride": 1, "padding": 0,
                                                                 "dilation": 1, "groups": 1}))
    return NOT_MINE
