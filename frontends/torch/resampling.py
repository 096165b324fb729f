"""Rules for fixed linear maps (docs/fixed_maps.md): padding (every mode), interpolation and
upsampling (their matrices are torch's own per axis), pixel shuffle and unshuffle, and ATen's
explicit-size upsample overloads.
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn

from pathir.frontends.core.fixed_maps import axis_matrices, interpolate, resampled
from pathir.frontends.core.fixed_maps import pad as pad_selection

__all__ = ["pad_fn", "pad_module", "constant_pad", "mode_pad", "interpolate_fn", "upsample_module",
           "pixel_shuffle", "pixel_unshuffle", "pixel_shuffle_module",
           "pixel_unshuffle_module", "upsample_vec", "upsample_explicit", "PAD_MODULES", "ATEN_PADS",
           "ATEN_UPSAMPLE", "ATEN_EXPLICIT"]


def _pad_modules() -> dict:
    table = {}
    for n in (1, 2, 3):
        for prefix, mode in (("Zero", "constant"), ("Constant", "constant"), ("Reflection", "reflect"),
                             ("Replication", "replicate"), ("Circular", "circular")):
            cls = getattr(nn, f"{prefix}Pad{n}d", None)
            if cls is not None:
                table[cls] = mode
    return table


#: padding module class -> mode
PAD_MODULES = _pad_modules()


def pad_fn(low, input, pad, mode="constant", value=None):
    return pad_selection(low, input, pad, mode, value)


def pad_module(low, mod, input):
    mode = PAD_MODULES[type(mod)]
    return pad_selection(low, input, mod.padding, mode, getattr(mod, "value", None) if mode == "constant" else None)


def constant_pad(low, input, pad, value=0):
    return pad_selection(low, input, pad, "constant", value)


def mode_pad(mode: str):
    """The rule of ATen's ``{reflection,replication}_pad{n}d``."""
    def rule(low, input, padding):
        return pad_selection(low, input, padding, mode)
    return rule


def interpolate_fn(low, input, size=None, scale_factor=None, mode="nearest", align_corners=None,
                   recompute_scale_factor=None, antialias=False):
    return interpolate(low, input, size, scale_factor, mode, align_corners, recompute_scale_factor, antialias)


def upsample_module(low, mod, input):  # UpsamplingNearest2d / UpsamplingBilinear2d included
    return interpolate(low, input, mod.size, mod.scale_factor, mod.mode, mod.align_corners,
                       getattr(mod, "recompute_scale_factor", None))


def pixel_shuffle(low, input, upscale_factor):
    """r^2 input channels -> one output channel (a Gather: its ties make them one unit)."""
    r = int(upscale_factor)
    return low.index_op(lambda t: torch.nn.functional.pixel_shuffle(t, r), [low.value(input)])[0][0]


def pixel_unshuffle(low, input, downscale_factor):
    r = int(downscale_factor)
    return low.index_op(lambda t: torch.nn.functional.pixel_unshuffle(t, r), [low.value(input)])[0][0]


def pixel_shuffle_module(low, mod, input):
    return pixel_shuffle(low, input, mod.upscale_factor)


def pixel_unshuffle_module(low, mod, input):
    return pixel_unshuffle(low, input, mod.downscale_factor)


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
                       ("upsample_trilinear3d", "trilinear"), ("upsample_bicubic2d", "bicubic"),
                       ("_upsample_bilinear2d_aa", "bilinear-aa"), ("_upsample_bicubic2d_aa", "bicubic-aa")):
        # a name with {} comes in 1, 2 and 3 spatial axes; the others name their rank
        for n in ((1, 2, 3) if "{}" in name else (int(re.search(r"(\d)d", name).group(1)),)):
            overload = getattr(aten, name.format(n), None)
            if overload is not None and hasattr(overload, "vec"):
                upsample[overload.vec] = mode
            if overload is not None and hasattr(overload, "default"):
                explicit[overload.default] = n
    return pads, upsample, explicit


#: pad overload -> mode; upsample .vec overload -> mode (``-aa``: antialias=True); upsample .default overload (input,
#: output_size, [align_corners], one scale or None per axis) -> number of spatial axes
ATEN_PADS, ATEN_UPSAMPLE, ATEN_EXPLICIT = _aten_tables()


def upsample_vec(mode: str):
    """The rule of an ATen ``upsample_*.vec`` overload (output size or one scale per axis)."""
    if mode in ("nearest", "nearest-exact"):
        def rule(low, input, output_size, scale_factors):
            return interpolate(low, input, output_size, scale_factors, mode)
    else:
        base, antialias = mode.removesuffix("-aa"), mode.endswith("-aa")

        def rule(low, input, output_size, align_corners, scale_factors):
            return interpolate(low, input, output_size, scale_factors, base, align_corners, None, antialias)
    return rule


def upsample_explicit(fn, n: int):
    """The rule of an explicit-size ATen upsample overload: its matrices read off the op itself per
    axis (the size of axis d and its scale, the other axes kept at length 2, scale None)."""
    def rule(low, input, output_size, *rest):
        size, rest = list(output_size), list(rest)
        has_align = "nearest" not in fn.__name__
        align, scales = rest[:int(has_align)], (rest[int(has_align):] + [None] * n)[:n]

        def call(basis, d):
            sizes = [size[e] if e == d else 2 for e in range(n)]
            return fn(basis, sizes, *align, *[scales[e] if e == d else None for e in range(n)])

        return resampled(low, input, axis_matrices(low, input.shape[1:], call), fn.__name__.split(".")[0].lstrip("_"))
    return rule
