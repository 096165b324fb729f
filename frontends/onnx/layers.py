"""ONNX rules for the layer ops, lowered to parameterized maps and pools: Gemm, MatMul, Conv,
ConvTranspose, BatchNormalization, MaxPool / GlobalMaxPool, AveragePool / GlobalAveragePool. Each
rule is ``rule(low, node, inputs) -> outputs`` on an :class:`~.lowering.OnnxLowering`, which
provides the values, params and bindings.

Gemm with the activation as A: W = alpha * op(B)^T (the source tensor B is
transposed unless transB); as B (batch on axis 1): W = alpha * op(A). The bias
is beta * C, one value per output feature. AveragePool multiplies output
position p by 1 / (the window positions counted at p), as onnxruntime does:
inside the padded input with count_include_pad, inside the input without.
"""

from __future__ import annotations

import math

import numpy as np

from pathir.frontends.core.conv_transpose import conv_transpose as lower_conv_transpose
from pathir.frontends.core.pointwise_linear import over_rows, pointwise_last_axis
from pathir.frontends.core.values import NegInfPadded, ParamTensor, Value
from pathir.ir import Conv, Dense, Param, PointwiseKernelLayout, Pool, SourceRef, pool_output_size

__all__ = ["gemm", "matmul", "conv", "conv_transpose", "batch_normalization", "max_pool", "global_max_pool",
           "average_pool", "global_average_pool", "attrs", "f64"]


def attrs(node) -> dict:
    from onnx import helper

    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


def f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def gemm(low, node, ins):
    a = attrs(node)
    alpha, beta = float(a.get("alpha", 1.0)), float(a.get("beta", 1.0))
    tA, tB = bool(a.get("transA", 0)), bool(a.get("transB", 0))
    if isinstance(ins[0], Value) and isinstance(ins[1], Value):
        low.unsupported("multiplies two activations: not positively homogeneous of degree 1")
    if isinstance(ins[0], Value):
        k, wk, axis_in = 0, 1, 1 if node.input[0] in low.axis1 else 0
        if axis_in != int(tA):
            low.unsupported(f"transA={int(tA)} contracts over the batch axis of '{node.input[0]}'")
        B = f64(low.const(node, 1, "weight"))
        W = B if tB else B.T  # W = op(B)^T
        transposed, out_axis = not tB, 0
        how = f"{alpha:g} * " * (alpha != 1) + node.input[1] + ("" if tB else "^T")
    else:
        k, wk, axis_in = 1, 0, 1 if node.input[1] in low.axis1 else 0
        if axis_in == int(tB):
            low.unsupported(f"transB={int(tB)} contracts over the batch axis of '{node.input[1]}'")
        A = f64(low.const(node, 0, "weight"))
        W = A.T if tA else A  # W = op(A)
        transposed, out_axis = tA, 1
        how = f"{alpha:g} * " * (alpha != 1) + node.input[0] + ("^T" if tA else "")
    v = low.act(node, k)
    Wp = low.weight(node, wk, alpha * W, transposed, how)
    bias = None
    C = low.bias_const(node, 2)
    if C is not None and beta != 0.0:
        out = Value(v.terms, (W.shape[0],), None)
        vec, layout = low.channel_vector(C, out, out_axis, beta)
        bias = low.bias(node, 2, vec, layout, f"{beta:g} * " * (beta != 1) + node.input[2])
    if out_axis:
        low.axis1.add(node.output[0])
    return [_dense(low, v, Wp, bias)]


def _dense(low, v: Value, Wp: Param, bias) -> Value:
    if math.prod(v.shape) != Wp.shape[1]:
        low.unsupported(f"weight {list(Wp.shape)} does not fit an activation of per-sample shape {list(v.shape)}")
    return low.apply(v, Dense(Wp), bias, flat_ok=True)


def matmul(low, node, ins):
    if isinstance(ins[0], Value) and isinstance(ins[1], Value):
        low.unsupported("multiplies two activations: not positively homogeneous of degree 1")
    if isinstance(ins[0], Value):
        v = ins[0]
        if node.input[0] in low.axis1:
            low.unsupported(f"MatMul of an activation of per-sample shape {list(v.shape)} whose batch is on axis 1: "
                            "only (batch, ..., features) @ W is lowered")
        B = f64(low.const(node, 1, "weight"))
        if B.ndim != 2:
            low.unsupported(f"MatMul with a weight of rank {B.ndim}")
        if len(v.shape) != 1:  # (batch, *S, F) @ B: B at every position of S (a per-token layer)
            return [_last_axis(low, node, v, B)]
        return [_dense(low, v, low.weight(node, 1, B.T, True, node.input[1] + "^T"), None)]
    v = ins[1]
    if node.input[1] not in low.axis1:  # W @ x per sample (x: (..., N, F)): the dense layer (xᵀ Wᵀ)ᵀ at every column
        A = f64(low.const(node, 0, "weight"))
        if A.ndim != 2:
            low.unsupported(f"MatMul with a weight of rank {A.ndim} on the left")
        if not 2 <= len(v.shape) <= 4 or A.shape[1] != v.shape[-2]:
            low.unsupported(f"W @ activation with the weight '{node.input[0]}' of shape {list(A.shape)} and an activation "
                            f"of per-sample shape {list(v.shape)}: lowered where W is (M, N) and the activation (..., N, F) "
                            "per sample, at most 4 axes (a dense layer over its second-to-last axis); a product over "
                            "the batch axis is outside the ReLU DAG model")
        return [over_rows(low, v, lambda swapped: _last_axis(low, node, swapped, A, index=0, stored_in_out=False))]
    A = f64(low.const(node, 0, "weight"))
    if A.ndim != 2:
        low.unsupported(f"MatMul with a weight of rank {A.ndim}")
    low.axis1.add(node.output[0])
    return [_dense(low, v, low.weight(node, 0, A, False, node.input[0]), None)]


def _last_axis(low, node, v: Value, B: np.ndarray, index: int = 1, stored_in_out: bool = True) -> Value:
    """``v @ B`` with v of per-sample shape (*S, F) and B, input ``index`` of the node, stored (F, O) (or, not
    ``stored_in_out``, (O, F): ``v @ Bᵀ``): a convolution of kernel size 1 over v's feature axis moved first, its
    kernel B entry by entry (``PointwiseKernelLayout``)."""
    layout = PointwiseKernelLayout(len(v.shape) - 1, transposed=stored_in_out)

    def kernel() -> Param:
        ref, _ = low.param_ref(node, index, ("weight", layout, B))
        p = low.param(ref, layout.from_source(B), (SourceRef(ref, layout=layout),),
                      f"{node.input[index]} as a pointwise convolution kernel")
        low.bind(ref, node, index, "weight")
        return p

    return pointwise_last_axis(low, v, (B.shape[1], B.shape[0]) if stored_in_out else B.shape, kernel)


def _conv_inputs(low, node, what: str):
    """(activation, weight, spatial rank, attributes, kernel, strides, dilations) of a Conv or
    ConvTranspose node, its kernel_shape checked against the weight."""
    v = low.act(node, 0)
    W = f64(low.const(node, 1, "weight"))
    n = W.ndim - 2
    if n < 1 or len(v.shape) != n + 1:
        low.unsupported(f"{n}-d {what} on an activation of per-sample shape {list(v.shape)}")
    a = attrs(node)
    k = tuple(W.shape[2:])
    if tuple(a.get("kernel_shape", k)) != k:
        low.fail(f"kernel_shape {a['kernel_shape']} disagrees with the weight {list(W.shape)}")
    return v, W, n, a, k, tuple(a.get("strides", (1,) * n)), tuple(a.get("dilations", (1,) * n))


def conv(low, node, ins):
    v, W, n, a, k, strides, dil = _conv_inputs(low, node, "convolution")
    pads = _pads(low, a, v.shape[1:], k, strides, dil)
    Wp = low.weight(node, 1, W, False, "")
    B = low.bias_const(node, 2)
    bias = low.bias(node, 2, f64(B).reshape(-1), (W.shape[0],)) if B is not None else None
    return [low.apply(v, Conv(Wp, strides, pads, dil, int(a.get("group", 1))), bias)]


def conv_transpose(low, node, ins):
    """A zero-stuffing Gather and a Conv whose kernel is W in direct layout (frontends/core/conv_transpose.py);
    the param stays bound to the initializer W (C_in, C_out/group, *k)."""
    import torch

    v, W, n, a, k, strides, dil = _conv_inputs(low, node, "transposed convolution")
    op = tuple(a.get("output_padding", (0,) * n))
    pads = _transpose_pads(low, a, v.shape[1:], k, strides, dil, op)
    ref, _ = low.param_ref(node, 1, ("conv_transpose", int(a.get("group", 1)), W))  # tied only in this layout
    low.bind(ref, node, 1, "weight")
    w = ParamTensor(ref, torch.from_numpy(W))
    B = low.bias_const(node, 2)
    bias, group = None, int(a.get("group", 1))
    if B is not None:
        if B.size != W.shape[1] * group:
            low.fail(f"bias of {B.size} entries for {W.shape[1] * group} output channels")
        bref, _ = low.param_ref(node, 2, ("bias", (B.size,), f64(B).reshape(-1)))
        low.bind(bref, node, 2, "bias", (B.size,))
        bias = ParamTensor(bref, torch.from_numpy(f64(B).reshape(-1).copy()))
    return [lower_conv_transpose(low, v, w, bias, strides, pads, dil, op, group)]


def _transpose_pads(low, a, spatial, k, strides, dil, op):
    """(before, after) per axis of an ONNX ConvTranspose: ``pads``, or from ``output_shape`` /
    auto_pad SAME_* (total = s·(L − 1) + output_padding + d·(k − 1) + 1 − out; the odd unit goes
    after for SAME_UPPER, before otherwise; a negative total is that many positions more at the end
    for an ``output_shape``, and none for SAME_*'s own out = L·s: the full output), as onnxruntime
    computes them."""
    n = len(k)
    mode = a.get("auto_pad", "NOTSET") or "NOTSET"
    out = a.get("output_shape")
    same = out is None and mode in ("SAME_UPPER", "SAME_LOWER")
    if same:
        out = [L * s for L, s in zip(spatial, strides)]
    if out is None:
        if mode == "VALID":
            return ((0, 0),) * n
        if mode != "NOTSET":
            low.fail(f"unknown auto_pad '{mode}'")
        p = list(a.get("pads", [0] * (2 * n)))
        return tuple((int(p[i]), int(p[i + n])) for i in range(n))
    out = list(out)[-n:]
    pads = []
    for L, kk, s, d, o, target in zip(spatial, k, strides, dil, op, out):
        total = s * (L - 1) + o + d * (kk - 1) + 1 - int(target)
        if same:  # L·s past the full output (a kernel shorter than the stride): no padding, the full output
            total = max(total, 0)
        if total < 0:  # an output_shape past the full output: onnxruntime adds the positions at the end,
            if -total >= s:  # as many as an output_padding could (fewer than the stride)
                low.fail(f"output_shape {list(out)} is {-total} positions past the full output along an axis of "
                         f"stride {s}: no input of this size gives it (onnxruntime refuses it too)")
            pads.append((0, total))
            continue
        small = total // 2
        pads.append((small, total - small) if mode == "SAME_UPPER" else (total - small, small))
    return tuple(pads)


def batch_normalization(low, node, ins):
    import torch

    a = attrs(node)
    if a.get("training_mode", 0):
        low.unsupported("batch-norm in training mode uses batch statistics: input-dependent")
    v = low.act(node, 0)
    if not a.get("spatial", 1) and len(v.shape) > 1:  # opset 7-8's per-element statistics; on (N, C) the same
        low.unsupported(f"spatial=0 (opset 7-8) normalizes each element of the {len(v.shape) + 1}-d input with its own "
                        f"statistics (shape [C, ...] = {list(v.shape)}); pathir lowers the per-channel form only: "
                        "export with spatial=1 or at opset 9 or later")
    # the attribute is float32, and onnxruntime widens it as it is (0.0010000000475 for 1e-3): a float64
    # model's variance + eps is then exact to 1e-16 (the decimal 1e-3 was off by 4e-11)
    eps = float(np.float32(a.get("epsilon", 1e-5)))
    # a batch-norm applied twice shares all four; one tensor in two slots of one node (a deduplicated
    # initializer: scale = variance = 1, bias = mean = 0) is one ref per slot, each written in its own role
    group = ("bn", tuple(node.input[1:5]), eps)
    names = [low.param_ref(node, k, (*group, k))[0] for k in range(1, 5)]
    what = ("scale", "bias", "running mean", "running variance")
    tensors = [ParamTensor(n, torch.from_numpy(f64(low.const(node, k, w)).reshape(-1).copy()))
               for k, (n, w) in enumerate(zip(names, what), start=1)]
    out = low.batch_norm(v, "", *tensors, eps)
    C = v.shape[0]
    for k, (ref, kind) in enumerate(zip(names, ("bn_scale", "bn_bias", "bn_mean", "bn_var")), start=1):
        low.bind(ref, node, k, kind, (C,), eps)
    return [out]


def _pads(low, a, spatial, k, strides, dil):
    n = len(k)
    mode = a.get("auto_pad", "NOTSET") or "NOTSET"
    if mode == "NOTSET":
        p = list(a.get("pads", [0] * (2 * n)))
        return tuple((int(p[i]), int(p[i + n])) for i in range(n))
    if mode == "VALID":
        return ((0, 0),) * n
    if mode not in ("SAME_UPPER", "SAME_LOWER"):
        low.fail(f"unknown auto_pad '{mode}'")
    out = []
    for L, kk, s, d in zip(spatial, k, strides, dil):
        total = max(0, (-(-L // s) - 1) * s + (kk - 1) * d + 1 - L)
        small = total // 2
        out.append((small, total - small) if mode == "SAME_UPPER" else (total - small, small))
    return tuple(out)


def _window(low, node, v: Value):
    n = len(v.shape) - 1
    if n < 1:
        low.unsupported(f"pooling on an activation of per-sample shape {list(v.shape)}")
    a = attrs(node)
    k = tuple(int(x) for x in a["kernel_shape"])
    strides, dil = tuple(a.get("strides", (1,) * n)), tuple(a.get("dilations", (1,) * n))
    if (a.get("auto_pad") or "NOTSET") in ("SAME_UPPER", "SAME_LOWER") and any(d != 1 for d in dil):
        low.unsupported(f"auto_pad {a['auto_pad']} with dilations {list(dil)}: onnxruntime pads this pool as if "
                        "undilated and sizes its output dilated, against the ONNX specification, so pathir would "
                        "disagree with one of them (write the padding out: pads=[...])")
    pads = _pads(low, a, v.shape[1:], k, strides, dil)
    ceil = bool(a.get("ceil_mode", 0)) and a.get("auto_pad", "NOTSET") in ("NOTSET", "", "VALID")  # (SAME pads to it)
    return Pool(k, strides, pads, dil, ceil), a


def max_pool(low, node, ins):
    if isinstance(ins[0], NegInfPadded):
        return [_max_pool_padded(low, node, ins[0]), None]
    v = low.act(node, 0)
    pool, _ = _window(low, node, v)
    src = low.materialize(v)
    name = low.b.maxpool(low.label, src, pool, origin=low.where)
    return [Value.of_node(name, low.b.shape(name)), None]


def _max_pool_padded(low, node, padded: NegInfPadded) -> Value:
    """MaxPool of Pad(v, -inf): one max-pool whose padding is both (neither is ever selected), where its output
    lengths are those of the MaxPool on the padded shape (the padding's own geometry: auto_pad, ceil_mode)."""
    v = padded.value
    shape = (v.shape[0], *(L + lo + hi for L, (lo, hi) in zip(v.shape[1:], padded.pads)))
    pool, _ = _window(low, node, Value(v.terms, shape, v.bias, v.origin))  # the pool as the padded tensor sees it
    merged = padded.pool(pool)
    if merged.out_shape(v.shape) != pool.out_shape(shape):
        low.unsupported(f"a MaxPool ({pool.describe()}) of an activation padded with -inf {list(padded.pads)}: its "
                        f"output {list(pool.out_shape(shape)[1:])} is not that of one max-pool with both paddings")
    return low.max_pool_of(low.materialize(v), merged)


def global_max_pool(low, node, ins):
    v = low.act(node, 0)
    n = len(v.shape) - 1
    pool = Pool(tuple(v.shape[1:]), (1,) * n, ((0, 0),) * n, (1,) * n)
    name = low.b.maxpool(low.label, low.materialize(v), pool, origin=low.where)
    return [Value.of_node(name, low.b.shape(name))]


def average_pool(low, node, ins):
    """mult[p] = 1 / (number of window positions counted at p): inside the
    padded input with count_include_pad, inside the input without (ONNX Runtime)."""
    v = low.act(node, 0)
    pool, a = _window(low, node, v)
    include = bool(a.get("count_include_pad", 0))
    counts = []
    for L, kk, s, (p0, p1), d in zip(v.shape[1:], pool.kernel, pool.stride, pool.padding, pool.dilation):
        out = pool_output_size(L, kk, s, (p0, p1), d, pool.ceil_mode)
        pos = np.arange(out)[:, None] * s - p0 + np.arange(kk)[None, :] * d
        lo, hi = (-p0, L + p1) if include else (0, L)
        counts.append(((pos >= lo) & (pos < hi)).sum(axis=1))
    count = counts[0]
    for c in counts[1:]:
        count = np.multiply.outer(count, c)
    mult = np.where(count > 0, 1.0 / np.maximum(count, 1), 0.0)
    pool = Pool(pool.kernel, pool.stride, pool.padding, pool.dilation, pool.ceil_mode, mult)
    src = low.materialize(v)
    return [Value([(src, pool)], pool.out_shape(low.b.shape(src)), None, low.label)]


def global_average_pool(low, node, ins):
    v = low.act(node, 0)
    return [low.adaptive_avg_pool(v, (1,) * (len(v.shape) - 1))]
