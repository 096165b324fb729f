"""The torch frontend's op table: ``{target: rule}``, one row per op pathir lowers.

A target is what a torch.fx node calls: a function (``F.relu``, ``operator.add``), a tensor
method name (``"relu"``), a module class (``nn.Conv2d``: a subclass finds its nearest base in
the table) or, on the torch.export path, an ATen overload (``aten.relu.default``). The fx
interpreter and the export interpreter read the same table; where an ATen op has the semantics
and the argument order of its torch spelling, both rows name the same rule.

A rule is a plain function ``rule(low, *args, **kwargs)`` called with the node's own arguments
(for a module, the module first: ``rule(low, mod, *args, **kwargs)``), whose parameter list
binds them as torch does; it returns the lowered Value(s) through the public lowering API of
``low`` (:class:`~pathir.frontends.core.lowering.Lowering`, and ``low.model``, ``low.is_buffer``,
``low.is_parameter`` of :class:`~pathir.frontends.torch.interpreter.TorchLowering`), or refuses
with ``low.unsupported(why)`` / :func:`~pathir.frontends.torch.why.refuse`. A target with no
row is refused with its reason from :mod:`.why`.
"""

from __future__ import annotations

import operator

import torch
import torch.nn as nn
import torch.nn.functional as F

from pathir.frontends.torch import activations as act
from pathir.frontends.torch import arithmetic as ar
from pathir.frontends.torch import casts as cs
from pathir.frontends.torch import indexing as ix
from pathir.frontends.torch import layers as ly
from pathir.frontends.torch import pooling as pl
from pathir.frontends.torch import resampling as rs
from pathir.nn import ClippedReLU

__all__ = ["RULES", "rule_for", "target_name"]

aten = torch.ops.aten

#: ops that only move, copy or drop elements: run on element ids (torch functions and ATen ops)
_MOVES = [
    torch.flatten, torch.reshape, torch.transpose, torch.permute, torch.chunk, torch.split, torch.squeeze,
    torch.unsqueeze, operator.getitem, torch.hstack, torch.flip, torch.fliplr,
    torch.roll, torch.rot90, torch.tile, torch.movedim, torch.moveaxis, torch.swapaxes, torch.swapdims, torch.unbind,
    torch.select, torch.narrow, torch.index_select, torch.repeat_interleave, torch.tensor_split, torch.channel_shuffle,
    torch.adjoint, aten.mT.default, aten.mH.default, aten.adjoint.default,
    torch.t, aten.t.default, aten.numpy_T.default, aten.matrix_H.default,  # (2-d: across the batch axis, refused)
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
    aten.permute.default, aten.transpose.int, aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default,
    aten.chunk.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.narrow.default,
    aten.select.int, aten.expand.default, aten.flip.default, aten.roll.default, aten.repeat.default,
    aten.unbind.int, aten.index_select.default, aten.repeat_interleave.self_int, aten.repeat_interleave.self_Tensor,
    aten.movedim.int, aten.unfold.default, aten.rot90.default, aten.tile.default, aten.swapaxes.default,
    aten.tensor_split.sections, aten.tensor_split.indices, aten.fliplr.default,
    aten.swapdims.default, aten.moveaxis.int, aten.hstack.default, aten.movedim.intlist, aten.channel_shuffle.default,
    aten.squeeze.default, aten.view_as.default, aten.reshape_as.default, aten.expand_as.default,
]
_METHOD_MOVES = [
    "view", "reshape", "flatten", "transpose", "permute", "chunk", "split", "squeeze", "unsqueeze", "view_as",
    "reshape_as", "narrow", "flip", "fliplr", "roll", "rot90", "repeat", "expand", "expand_as",
    "repeat_interleave", "tile", "movedim", "moveaxis", "swapaxes", "swapdims", "unbind", "select", "index_select",
    "unfold", "tensor_split", "split_with_sizes", "adjoint",
    "t",  # (of a (batch, features) activation: always across the batch axis, refused on ids)
]


def _rows(rule, *targets) -> dict:
    return dict.fromkeys(targets, rule)


#: target -> rule (functions, method names, module classes, ATen overloads)
RULES: dict = {
    # ---------------------------------------------------------------- layers
    **_rows(ly.linear, F.linear, aten.linear.default),
    **_rows(ly.linear_module, nn.Linear),
    **_rows(ly.conv, F.conv1d, F.conv2d, F.conv3d, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
            aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding),
    **_rows(ly.conv_module, nn.Conv1d, nn.Conv2d, nn.Conv3d),
    **_rows(ly.convolution, aten.convolution.default),
    **_rows(ly.conv_transpose_fn, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
            aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input),
    **_rows(ly.conv_transpose_module, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d),
    **_rows(ly.batch_norm, F.batch_norm),
    **_rows(ly.batch_norm_module, nn.modules.batchnorm._BatchNorm),
    **_rows(ly.batch_norm_aten, aten.batch_norm.default),
    **_rows(ly.batch_norm_no_training, aten._native_batch_norm_legit_no_training.default),
    **_rows(ar.matmul, torch.matmul, torch.mm, operator.matmul, "matmul", "mm", aten.matmul.default,
            aten.mm.default),
    **_rows(ar.addmm, torch.addmm, "addmm", aten.addmm.default),
    # ---------------------------------------------------------------- ReLU, clipped ReLUs and the identity
    **_rows(act.relu, F.relu, torch.relu, torch.relu_, F.relu_, "relu", "relu_", aten.relu.default,
            aten.relu_.default),
    **_rows(act.relu_module, nn.ReLU),
    **_rows(act.leaky_relu, F.leaky_relu, aten.leaky_relu.default, F.leaky_relu_),
    **_rows(act.leaky_relu_module, nn.LeakyReLU),
    **_rows(act.clamp, torch.clamp, torch.clip, "clamp", "clip", aten.clamp.default, aten.clip.default, aten.clamp.Tensor,
            torch.clamp_, torch.clip_, "clamp_", "clip_"),  # (in place: later readers read the result)
    **_rows(act.clamp_min, torch.clamp_min, "clamp_min", aten.clamp_min.default, torch.clamp_min_, "clamp_min_"),
    **_rows(act.threshold, F.threshold, torch.threshold, aten.threshold.default, F.threshold_),
    **_rows(act.threshold_module, nn.Threshold),
    **_rows(act.hardtanh, F.hardtanh, F.hardtanh_, aten.hardtanh.default, aten.hardtanh_.default),
    **_rows(act.hardtanh_module, nn.Hardtanh),
    **_rows(act.relu6, F.relu6, aten.relu6.default, aten.relu6_.default),
    **_rows(act.clipped_relu_module, ClippedReLU),
    **_rows(act.minimum, torch.minimum, "minimum", aten.minimum.default),
    **_rows(act.same, F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
            "contiguous",
            "clone", "detach", "detach_", aten.clone.default, aten.alias.default, aten.detach.default, aten.detach_.default,
            aten.contiguous.default, aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default,
            aten.feature_alpha_dropout.default, aten.lift_fresh_copy.default),
    **_rows(act.copy_, "copy_"),
    **_rows(act.same_module, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
            nn.FeatureAlphaDropout, nn.Identity),
    **_rows(cs.float_, "float"), **_rows(cs.double, "double"), **_rows(cs.half, "half"),
    **_rows(cs.bfloat16, "bfloat16"), **_rows(cs.type_, "type"),
    **_rows(cs.to, "to", aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default),
    **_rows(cs.type_as, "type_as", aten.type_as.default),
    **_rows(ix.zeros_like, torch.zeros_like, aten.zeros_like.default),
    **_rows(ix.new_zeros, "new_zeros", aten.new_zeros.default),
    # ---------------------------------------------------------------- sums and constant factors
    **_rows(ar.add, operator.add, operator.iadd, torch.add, "add", "add_", aten.add.Tensor, aten.add_.Tensor,
            aten.add.Scalar),
    **_rows(ar.sub, operator.sub, operator.isub, torch.sub, torch.subtract, "sub", "sub_", "subtract", aten.sub.Tensor,
            aten.sub.Scalar, aten.sub_.Tensor, aten.subtract.Tensor),
    **_rows(ar.rsub, torch.rsub, "__rsub__", aten.rsub.Scalar, aten.rsub.Tensor),
    **_rows(ar.neg, operator.neg, torch.neg, torch.negative, "neg", "negative", aten.neg.default, aten.negative.default),
    **_rows(ar.mul, operator.mul, operator.imul, torch.mul, torch.multiply, "mul", "mul_", "multiply", aten.mul.Tensor,
            aten.mul.Scalar, aten.mul_.Tensor, aten.multiply.Tensor),
    **_rows(ar.div, operator.truediv, operator.itruediv, torch.div, torch.divide, torch.true_divide, "div", "div_",
            "divide", "true_divide", aten.div.Tensor, aten.div.Scalar, aten.div_.Tensor, aten.divide.Tensor,
            aten.true_divide.Tensor),
    **_rows(ar.maximum, torch.maximum, torch.fmax, "maximum", "fmax", aten.maximum.default, aten.fmax.default),
    # ---------------------------------------------------------------- pools and reductions
    **_rows(pl.max_pool, F.max_pool1d, F.max_pool2d, F.max_pool3d, torch.max_pool1d, torch.max_pool2d,
            aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default),
    **_rows(pl.max_pool_with_indices, F.max_pool1d_with_indices, F.max_pool2d_with_indices, F.max_pool3d_with_indices,
            aten.max_pool1d_with_indices.default, aten.max_pool2d_with_indices.default,
            aten.max_pool3d_with_indices.default),
    **_rows(pl.max_pool_module, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d),
    **_rows(pl.avg_pool, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, torch.avg_pool1d, aten.avg_pool1d.default,
            aten.avg_pool2d.default, aten.avg_pool3d.default),
    **_rows(pl.avg_pool_module, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d),
    **_rows(pl.adaptive_avg_pool, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d,
            torch.adaptive_avg_pool1d, aten.adaptive_avg_pool1d.default, aten.adaptive_avg_pool2d.default,
            aten._adaptive_avg_pool2d.default, aten.adaptive_avg_pool3d.default, aten._adaptive_avg_pool3d.default),
    **_rows(pl.adaptive_avg_pool_module, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d),
    **_rows(pl.adaptive_max_pool, F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d),
    **_rows(pl.adaptive_max_pool_with_indices, F.adaptive_max_pool1d_with_indices, F.adaptive_max_pool2d_with_indices,
            F.adaptive_max_pool3d_with_indices),
    **_rows(pl.adaptive_max_pool_aten, aten.adaptive_max_pool1d.default, aten.adaptive_max_pool2d.default,
            aten.adaptive_max_pool3d.default),
    **_rows(pl.adaptive_max_pool_module, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d),
    **_rows(pl.mean, torch.mean, "mean", aten.mean.dim),
    **_rows(pl.sum_, torch.sum, "sum", aten.sum.dim_IntList),
    **_rows(pl.amax, torch.amax, "amax", aten.amax.default),
    **_rows(pl.max_, torch.max, "max", aten.max.dim, aten.max.other),
    **_rows(pl.where_, torch.where, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf),
    **_rows(pl.where_method, "where"),
    **_rows(pl.masked_fill, torch.masked_fill, "masked_fill", "masked_fill_", aten.masked_fill.Scalar,
            aten.masked_fill_.Scalar),
    # ---------------------------------------------------------------- fixed linear maps
    **_rows(rs.pad_fn, F.pad, aten.pad.default),
    **_rows(rs.constant_pad, aten.constant_pad_nd.default),
    **{op: rs.mode_pad(mode) for op, mode in rs.ATEN_PADS.items()},
    **dict.fromkeys(rs.PAD_MODULES, rs.pad_module),
    **_rows(rs.interpolate_fn, F.interpolate),
    **_rows(rs.upsample_module, nn.Upsample),
    **{op: rs.upsample_vec(mode) for op, mode in rs.ATEN_UPSAMPLE.items()},
    **{op: rs.upsample_explicit(op, n) for op, n in rs.ATEN_EXPLICIT.items()},
    **_rows(rs.pixel_shuffle, F.pixel_shuffle, torch.pixel_shuffle, aten.pixel_shuffle.default),
    **_rows(rs.pixel_unshuffle, F.pixel_unshuffle, torch.pixel_unshuffle, aten.pixel_unshuffle.default),
    **_rows(rs.pixel_shuffle_module, nn.PixelShuffle),
    **_rows(rs.pixel_unshuffle_module, nn.PixelUnshuffle),
    # ---------------------------------------------------------------- element moves and shapes
    **{fn: ix.moves(fn) for fn in _MOVES},
    **{name: ix.method_moves(name) for name in _METHOD_MOVES},
    **_rows(ix.stack(torch.stack), torch.stack),
    **_rows(ix.stack(aten.stack.default), aten.stack.default),
    **_rows(ix.roll(torch.roll), torch.roll),
    **_rows(ix.roll(aten.roll.default), aten.roll.default),
    "roll": ix.roll(lambda t, *a, **k: t.roll(*a, **k)),
    **_rows(ix.cat, torch.cat, torch.concat, aten.cat.default, aten.concat.default),
    **_rows(ix.scatter(aten.slice_scatter.default, aten.slice.Tensor), torch.slice_scatter,
            aten.slice_scatter.default),
    **_rows(ix.scatter(aten.select_scatter.default, aten.select.int), torch.select_scatter,
            aten.select_scatter.default),
    **_rows(ix.index_put, aten.index_put.default, aten.index_put_.default),
    **_rows(ix.fill, aten.fill.Scalar, aten.fill.Tensor),
    **_rows(ix.copy, aten.copy.default),
    **_rows(ix.zero, aten.zero.default),
    **_rows(ix.index_with(aten.index.Tensor), aten.index.Tensor),
    **_rows(ix.index_with(aten._unsafe_index.Tensor), aten._unsafe_index.Tensor),
    **_rows(ix.unflatten, torch.unflatten, "unflatten", aten.unflatten.int),
    **_rows(ix.unflatten_module, nn.Unflatten),
    **_rows(ix.flatten_module, nn.Flatten),
    **_rows(ix.channel_shuffle_module, nn.ChannelShuffle),
    **_rows(ix.getattr_, getattr),
    **_rows(ix.size, "size", aten.sym_size.int),
    **_rows(ix.dim, "dim"),
    **_rows(ix.numel, "numel", torch.numel),
}


#: the index ops that read torch.stack(..., dim=0) of activations (picking whole ones along dim 0: .batch_stack)
for _target in (operator.getitem, torch.unbind, torch.select, torch.narrow, aten.unbind.int, aten.select.int,
                aten.slice.Tensor, aten.narrow.default, "unbind", "select", "narrow"):
    RULES[_target].reads_batch_stacked = True


def rule_for(target):
    """The rule of ``target``; for a module class, of its nearest base class with a row."""
    if isinstance(target, type):
        return next((RULES[c] for c in target.__mro__ if c in RULES), None)
    try:
        return RULES.get(target)
    except TypeError:  # an unhashable target
        return None


def _public_names() -> dict:
    """id(function) -> its public dotted name in torch.nn.functional, torch or operator."""
    names = {}
    for module, prefix in ((operator, "operator"), (torch, "torch"), (F, "torch.nn.functional")):
        for attr in dir(module):
            obj = getattr(module, attr, None)
            if callable(obj) and not attr.startswith("_") and not isinstance(obj, type):
                names.setdefault(id(obj), f"{prefix}.{attr}")
    return names


_PUBLIC = _public_names()


def target_name(target) -> str:
    """How docs and errors name a target: ``torch.nn.Conv2d``, ``torch.nn.functional.relu``,
    ``Tensor.relu``, ``aten.relu.default``, ``operator.add``."""
    if isinstance(target, str):
        return f"Tensor.{target}"
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target.__name__}"
    if isinstance(target, type):
        module = target.__module__
        if module.startswith("torch.nn.modules"):
            return f"torch.nn.{target.__name__}"
        if module.startswith("pathir.nn."):  # pathir.nn re-exports its modules
            return f"pathir.nn.{target.__name__}"
        return f"{module}.{target.__name__}"
    if target is getattr:
        return "getattr"
    return _PUBLIC.get(id(target), getattr(target, "__name__", str(target)))
