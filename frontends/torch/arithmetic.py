"""Rules for arithmetic inside the ReLU DAG model (docs/math.md §1): sums, differences and constant
factors of activations, elementwise max, and matmul by a parameter.

- ``a + b``, ``a - b`` (a −1 edge), ``-x``, ``add(a, b, alpha=c)``: a constant c is a *fixed*
  weight (never rescaled, it ties source and target channels); adding the literal 0 adds nothing,
  any other constant is refused (a fixed bias no parameter carries); adding a learnable per-channel
  tensor is a bias;
- ``x * c``, ``c * x``, ``x / c`` with c a number or a constant *tensor* (a buffer or a constant, no
  ``nn.Parameter``): one fixed factor per channel, position or element (:mod:`..core.fixed_factors`);
- ``x * self.gamma`` with gamma a learnable per-channel ``nn.Parameter``: a parameterized ``Scale``
  edge (layer-scale);
- ``torch.max(a, b)`` / ``maximum`` / ``fmax`` of two activations: a max-pool neuron over them; of an activation
  and a constant 0 (``torch.zeros_like(h)``, ``torch.tensor(0.)``): a ReLU;
- ``x @ W`` with W an (in, out) parameter: a dense layer; ``torch.addmm(b, x, W, beta=, alpha=)`` that
  layer, a constant alpha a fixed factor on it, plus b (beta 1, or 0: b ignored, as torch does; a constant
  beta on an activation b is a fixed factor).
"""

from __future__ import annotations

import numbers
from dataclasses import replace

import numpy as np
import torch
import torch.nn as nn

from pathir.frontends.core.fixed_factors import fixed_scale
from pathir.frontends.core.fixed_maps import fixed_left_matmul, fixed_linear
from pathir.frontends.core.lowering import adds_nothing
from pathir.frontends.core.pointwise_linear import over_rows
from pathir.frontends.core.reductions import elementwise_max
from pathir.frontends.core.values import ParamTensor, Value, described, f64, reads_transposed
from pathir.frontends.torch.transposes import transposed_param
from pathir.frontends.torch.why import refuse
from pathir.ir import Scale, SourceRef

__all__ = ["add", "sub", "rsub", "mul", "div", "neg", "maximum", "matmul", "addmm", "literal"]


def literal(x) -> bool:
    """A Python number written in the code (not a bool)."""
    return isinstance(x, numbers.Number) and not isinstance(x, bool)


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
    """A tensor that is no learnable parameter (a buffer, a constant made in the forward) as a
    float64 array; else None."""
    if isinstance(c, ParamTensor):
        c = c.tensor
    if isinstance(c, np.ndarray) and (np.issubdtype(c.dtype, np.floating) or np.issubdtype(c.dtype, np.integer)
                                      or c.dtype == np.bool_):
        return c.astype(np.float64)
    if isinstance(c, torch.Tensor) and not isinstance(c, nn.Parameter) and c.dtype not in _COMPLEX:
        return f64(c)  # a bool mask multiplies by 0 / 1
    return None


def _alpha(low, alpha) -> float:
    c = _scalar(alpha)
    if c is None:
        low.unsupported("a non-constant alpha")
    return c


def add(low, input, other, *, alpha=1):
    """``input + alpha * other``: a literal 0 adds nothing, another literal is refused; a
    constant alpha ≠ 1 is a fixed edge on ``other``."""
    if literal(input) or literal(other):
        const, term = (input, other) if literal(input) else (alpha * other, input)
        if const != 0:
            low.unsupported(f"adding the constant {const}: a fixed non-zero bias no parameter carries")
        if not isinstance(term, Value):
            low.unsupported(f"adding {type(term).__name__} to a constant")
        if term is other and alpha != 1:
            low.unsupported("add with alpha != 1 (a fixed weight other than 1)")
        return term
    if alpha != 1:
        other = fixed_scale(low, other, _alpha(low, alpha))
    return low.add(input, other)


def sub(low, input, other, *, alpha=1):
    """``input - alpha * other``: a fixed edge of weight −alpha on ``other``; subtracting the literal 0
    is nothing, and ``0 - x`` is ``-x``."""
    if isinstance(input, Value) and (literal(other) and other == 0 or adds_nothing(other, input)):
        return input  # (h - 0, h - torch.zeros_like(h))
    if literal(input) and input == 0 and isinstance(other, Value):
        return fixed_scale(low, other, -_alpha(low, alpha))
    if not (isinstance(input, Value) and isinstance(other, Value)):
        term = other if isinstance(input, Value) else input
        if isinstance(term, ParamTensor):
            low.unsupported(f"subtracting {described(term)}: pathir lowers a learnable bias that is added (h + b), "
                            "not subtracted (store its negative and write h + b)")
        low.unsupported("subtracting a constant: a fixed non-zero bias breaks the rescaling symmetry")
    return low.add(input, fixed_scale(low, other, -_alpha(low, alpha)))


def rsub(low, input, other, *, alpha=1):
    """``other - alpha * input`` (``torch.rsub``, ``x.__rsub__(y)``)."""
    return sub(low, other, input, alpha=alpha)


def neg(low, input):
    return fixed_scale(low, input, -1.0)


def mul(low, input, other):
    """An activation times a constant (a fixed factor) or a learnable per-channel parameter (a
    ``Scale`` edge); a product of two activations is refused."""
    a, b = (other, input) if isinstance(other, Value) and not isinstance(input, Value) else (input, other)
    if not isinstance(a, Value) or isinstance(b, Value):
        refuse(low)  # a gate between two activations, or no activation
    c = _scalar(b)
    if c is not None:
        return fixed_scale(low, a, c)
    const = _constant_tensor(b)
    if const is not None:
        return fixed_scale(low, a, const)  # a buffer or constant: a fixed factor, never rescaled
    if isinstance(b, ParamTensor):
        return _layer_scale(low, a, b)
    refuse(low)


def div(low, input, other, *, rounding_mode=None):
    """An activation divided by a non-zero constant: a fixed factor 1/c."""
    if rounding_mode is not None:
        low.unsupported(f"division with rounding_mode='{rounding_mode}' is not linear")
    if isinstance(other, Value):
        low.unsupported("division by an activation is not positively homogeneous")
    if isinstance(other, ParamTensor) and isinstance(other.tensor, nn.Parameter):
        low.unsupported(f"divides an activation by the learnable parameter '{other.name}': a rescaling could not be "
                        "written back through 1/θ; multiply by a per-channel parameter (a layer-scale) instead")
    if not isinstance(input, Value):
        refuse(low)
    c = _scalar(other)
    if c is None:
        const = _constant_tensor(other)
        if const is None:
            refuse(low)
        if np.any(const == 0):
            low.unsupported("division by a constant tensor with zero entries")
        return fixed_scale(low, input, 1.0 / const)
    if c == 0:
        low.unsupported("division by the constant 0")
    return fixed_scale(low, input, 1.0 / c)


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
    value = f64(t).reshape(channels)
    W = low.param(gamma.name, value, (SourceRef(gamma.name),))
    src = low.materialize(v)
    return Value([(src, Scale(W))], tuple(v.shape), None, low.label)


def maximum(low, input, other):
    """Elementwise max of two activations: a max-pool neuron over them. Of an activation and a constant 0 that
    broadcasts to it without growing it (``torch.zeros_like(h)``, ``torch.tensor(0.)``, a zero buffer): a ReLU."""
    for a, b in ((input, other), (other, input)):
        if isinstance(a, Value) and not isinstance(b, Value) and adds_nothing(b, a):
            return low.relu(a)
        if isinstance(a, Value) and isinstance(b, (ParamTensor, torch.Tensor)) and not low.is_parameter(b):
            low.unsupported("a max of an activation and a constant other than 0 everywhere (or one that broadcasts it "
                            "to a larger shape): a shifted ReLU, whose threshold no parameter carries; max(x, 0) with "
                            "a 0 of the activation's shape or less is a ReLU")
    if not (isinstance(input, Value) and isinstance(other, Value)):
        refuse(low)
    return elementwise_max(low, [input, other])


@reads_transposed
def matmul(low, input, other):
    """``x @ W`` with W an (in, out) parameter, or ``x @ W.t()`` with W an (out, in) one: a dense layer; with W a
    buffer, a fixed map; ``A @ x`` with A a buffer (a fixed adjacency over x's second-to-last axis), a fixed map:
    (xᵀ @ Aᵀ)ᵀ; ``W @ x`` (or ``W.t() @ x``) with W a parameter, the dense layer over x's second-to-last axis at
    every position of its last: (xᵀ @ Wᵀ)ᵀ."""
    if isinstance(input, ParamTensor) and isinstance(other, Value) and not low.is_buffer(input):
        return _left_matmul_param(low, input, other)
    if isinstance(input, ParamTensor) and input.transposed:
        low.unsupported(transposed_param(input, "a product on the left of an activation"))
    if isinstance(input, ParamTensor) and isinstance(other, Value) and low.is_buffer(input):
        return fixed_left_matmul(low, input, other)
    if not (isinstance(input, Value) and isinstance(other, ParamTensor)):
        refuse(low)
    if low.is_buffer(other):  # x @ B is F.linear(x, Bᵀ); x @ B.t() is F.linear(x, B)
        return fixed_linear(low, input, replace(other, transposed=False), None, transposed=not other.transposed)
    return low.matmul_param(input, other)



def _left_matmul_param(low, weight: ParamTensor, v: Value) -> Value:
    """``W @ v`` with W an (M, N) parameter as read (``W.t() @ v``: W stored (N, M)) and v of at least two axes per sample, N
    its second-to-last: v's last two axes swapped, times Wᵀ as a dense layer at every position, swapped back."""
    v = low.value(v)
    t = weight.read()
    if t.dim() != 2 or len(v.shape) < 2 or t.shape[1] != v.shape[-2]:  # (t: the matrix as read, W.t() transposed)
        low.unsupported(f"the parameter '{weight.name}'{' read transposed' if weight.transposed else ''} of shape "
                        f"{list(t.shape)} times an activation of shape {list(v.shape)} (per sample): W @ x is a dense "
                        "layer over x's second-to-last axis, and needs W of shape (M, N) and x of shape (..., N, F) per "
                        "sample; a product that mixes the batch axis is outside the ReLU DAG model")
    if len(v.shape) > 4:
        low.unsupported(f"the parameter '{weight.name}' times an activation of per-sample shape {list(v.shape)}: W @ x "
                        "is lowered as a layer over x's second-to-last axis with at most 3 axes besides it")
    return over_rows(low, v, lambda swapped: low.matmul_param(swapped, replace(weight, transposed=not weight.transposed)))

@reads_transposed
def addmm(low, input, mat1, mat2, *, beta=1, alpha=1):
    """``beta * input + alpha * (mat1 @ mat2)``: the product as :func:`matmul` lowers it, a constant alpha ≠ 1 a
    fixed factor on it, plus ``input`` as :func:`add` adds it (a bias parameter, an activation); beta = 0 drops
    ``input`` (torch ignores it then), another constant beta is a fixed factor on an activation ``input`` and
    refused on a parameter (a bias is added as it is stored)."""
    if isinstance(input, ParamTensor) and input.transposed:
        low.unsupported(transposed_param(input, "addmm's added term"))
    product = matmul(low, mat1, mat2)
    a = _alpha(low, alpha)
    if a != 1:
        product = fixed_scale(low, product, a)
    b = _scalar(beta)
    if b is None:
        low.unsupported("a non-constant beta")
    if b == 0:
        return product
    if b != 1:
        if not isinstance(input, Value):
            low.unsupported(f"beta = {b:g} on {described(input)}: a bias is lowered as it is stored, added with "
                            "beta = 1 (store beta · b, or scale the activation instead)")
        input = fixed_scale(low, input, b)
    return add(low, product, input)
