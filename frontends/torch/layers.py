"""Rules for the layers with learnable weights: linear, convolution (any padding mode; a fixed
buffer kernel is a fixed filter), transposed convolution, inference batch-norm, ``x @ W``.

A ConvNd with ``padding_mode`` reflect / replicate / circular is the padding (a selection) then a
convolution without padding. A convolution whose kernel is a registered buffer is a fixed map
(:func:`..core.fixed_maps.fixed_conv`), and so is a linear layer whose matrix is a buffer
(:func:`..core.fixed_maps.fixed_linear`); a transposed convolution with a buffer kernel is refused.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pathir.frontends.core.conv_transpose import conv_transpose
from pathir.frontends.core.fixed_maps import fixed_conv, fixed_linear, pad
from pathir.frontends.core.values import ParamTensor, Value, reads_transposed
from pathir.frontends.torch.transposes import transposed_param

__all__ = ["linear", "linear_module", "conv", "conv_module", "convolution", "conv_transpose_fn",
           "conv_transpose_module", "batch_norm", "batch_norm_module", "batch_norm_aten", "batch_norm_no_training"]


def _param(mod, path: str, attr: str):
    t = getattr(mod, attr, None)
    return None if t is None else ParamTensor(f"{path}.{attr}", t)


def _bias(low, bias):
    """``bias``, or None for zeros made in the forward (``torch.zeros(n)``: nothing added); any other constant made
    in the forward (a fixed tensor no parameter or buffer of the model holds: a rescaling of the layer's units could
    not be written into it) is refused as the fixed bias it is. A layer's own tensor the model does not register (a
    layer held in a plain list, read by torch.export) is read, its write refused by the writer, naming it."""
    if not isinstance(bias, ParamTensor) or low.is_registered(bias) or bias.kind != "buffer":
        return bias
    if not bool(torch.any(bias.tensor != 0)):
        return None
    low.unsupported(f"the bias '{bias.name}' is a tensor made in the forward, not a parameter or buffer of the model: "
                    "a fixed non-zero bias no parameter carries (register it: nn.Parameter, or a buffer)")


@reads_transposed
def linear(low, input, weight, bias=None):
    """A linear layer (its weight read as stored, or transposed: ``F.linear(x, W.t())``); with a buffer matrix,
    a fixed map (the buffer is never rescaled)."""
    if isinstance(bias, ParamTensor) and bias.transposed:
        low.unsupported(transposed_param(bias, "a linear layer's bias"))
    bias = _bias(low, bias)
    if isinstance(weight, ParamTensor) and low.is_buffer(weight):
        return fixed_linear(low, input, replace(weight, transposed=False), bias, transposed=weight.transposed)
    return low.linear(input, weight, bias)


def linear_module(low, mod, input):
    """``nn.Linear``; whose weight is a registered buffer: a fixed map (as ``F.linear(x, buffer)``)."""
    return linear(low, input, _param(mod, low.label, "weight"), _param(mod, low.label, "bias"))


def conv(low, input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """A convolution; with a buffer kernel, a fixed filter."""
    bias = _bias(low, bias)
    if low.is_buffer(weight):
        return fixed_conv(low, input, weight, bias, stride, padding, dilation, groups)
    return low.conv(input, weight, bias, stride, padding, dilation, groups)


def conv_module(low, mod, input):
    """A ConvNd; whose weight is a registered buffer: a fixed filter (as ``F.conv2d(x, buffer)``)."""
    w, b = _param(mod, low.label, "weight"), _param(mod, low.label, "bias")
    if mod.padding_mode == "zeros":
        return conv(low, input, w, b, mod.stride, mod.padding, mod.dilation, mod.groups)
    if mod.padding_mode not in ("reflect", "replicate", "circular"):
        low.unsupported(f"padding_mode='{mod.padding_mode}'")
    padded = pad(low, input, mod._reversed_padding_repeated_twice, mod.padding_mode)
    return conv(low, padded, w, b, mod.stride, 0, mod.dilation, mod.groups)


def convolution(low, input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """ATen's ``convolution``: a convolution or, with ``transposed``, a transposed one."""
    if transposed:
        return _conv_transpose_bound(low, input, weight, bias, stride, padding, output_padding, groups, dilation)
    return conv(low, input, weight, bias, stride, padding, dilation, groups)


def conv_transpose_fn(low, input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    return _conv_transpose_bound(low, input, weight, bias, stride, padding, output_padding, groups, dilation)


def _conv_transpose_bound(low, x, w, b, stride, padding, output_padding, groups, dilation):
    if isinstance(w, Value) or isinstance(b, Value):
        low.unsupported("a transposed convolution whose kernel or bias is an activation: not a linear map of the input")
    if not isinstance(w, ParamTensor):
        low.unsupported("a transposed convolution with a kernel computed in the forward: it has no parameter to bind")
    if low.is_buffer(w) or not low.is_parameter(w):
        low.unsupported(f"a transposed convolution with the fixed (buffer) kernel '{w.name}': a constant upsampling "
                        "filter, not a parameter; it is not lowered")
    return conv_transpose(low, x, w, _bias(low, b), stride, padding, dilation, output_padding, groups)


def conv_transpose_module(low, mod, input, output_size=None):
    """nn.ConvTranspose1d/2d/3d called as ``mod(x)`` or ``mod(x, output_size)``."""
    if mod.padding_mode != "zeros":
        low.unsupported(f"padding_mode='{mod.padding_mode}' (torch allows only zeros for a transposed convolution)")
    x = low.value(input)
    n = len(mod.kernel_size)
    op = mod.output_padding
    if output_size is not None:  # torch picks output_padding from the requested size
        try:
            probe = torch.empty((1, *x.shape), device="meta")
            op = mod._output_padding(probe, list(output_size), list(mod.stride), list(mod.padding),
                                     list(mod.kernel_size), n, list(mod.dilation))
        except ValueError as err:
            low.unsupported(f"output_size {list(output_size)}: {err}")
    return conv_transpose(low, x, _param(mod, low.label, "weight"), _param(mod, low.label, "bias"), mod.stride,
                          mod.padding, mod.dilation, op, mod.groups)


def batch_norm(low, input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
               eps=1e-5):
    """``F.batch_norm`` with running statistics (inference): a Scale edge and a bias."""
    return low.batch_norm(input, "", weight, bias, running_mean, running_var, eps)


def batch_norm_module(low, mod, input):
    p = lambda attr: _param(mod, low.label, attr)  # noqa: E731
    return low.batch_norm(input, low.label, p("weight"), p("bias"), p("running_mean"), p("running_var"), mod.eps)


def batch_norm_aten(low, input, weight, bias, running_mean, running_var, training, momentum, eps,
                    cudnn_enabled=True):
    return low.batch_norm(input, "", weight, bias, running_mean, running_var, eps)


def batch_norm_no_training(low, input, weight, bias, running_mean, running_var, momentum, eps):
    """ATen's ``_native_batch_norm_legit_no_training``: (output, saved mean, saved invstd)."""
    return low.batch_norm(input, "", weight, bias, running_mean, running_var, eps), None, None
