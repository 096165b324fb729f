"""ONNX layer ops lowered to parameterized maps and pools: Gemm, MatMul, Conv,
BatchNormalization, MaxPool / GlobalMaxPool, AveragePool / GlobalAveragePool,
(ReduceMean: onnx_extra). A mixin of ``OnnxLowering`` (onnx_lower.py), which provides the
values, params and bindings these handlers use.

Gemm with the activation as A: W = alpha * op(B)^T (the source tensor B is
transposed unless transB); as B (batch on axis 1): W = alpha * op(A). The bias
is beta * C, one value per output feature. AveragePool multiplies output
position p by 1 / (the window positions counted at p), as onnxruntime does:
inside the padded input with count_include_pad, inside the input without.
"""

from __future__ import annotations

import math

import numpy as np

from pathir.frontends.values import ParamTensor, Value
from pathir.ir import Conv, Dense, Param, Pool, pool_output_size

__all__ = ["LayerOps", "attrs", "f64"]


def attrs(node) -> dict:
    from onnx import helper

    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


def f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


class LayerOps:
    """op_<OpType>(node, inputs) -> outputs, for the layer ops."""

    # ------------------------------------------------------------ affine layers
    def op_Gemm(self, node, ins):
        a = attrs(node)
        alpha, beta = float(a.get("alpha", 1.0)), float(a.get("beta", 1.0))
        tA, tB = bool(a.get("transA", 0)), bool(a.get("transB", 0))
        if isinstance(ins[0], Value) and isinstance(ins[1], Value):
            self.unsupported("multiplies two activations: not positively homogeneous of degree 1")
        if isinstance(ins[0], Value):
            k, wk, axis_in = 0, 1, 1 if node.input[0] in self.axis1 else 0
            if axis_in != int(tA):
                self.unsupported(f"transA={int(tA)} contracts over the batch axis of '{node.input[0]}'")
            B = f64(self.const(node, 1, "weight"))
            W = B if tB else B.T  # W = op(B)^T
            transposed, out_axis = not tB, 0
            how = f"{alpha:g} * " * (alpha != 1) + node.input[1] + ("" if tB else "^T")
        else:
            k, wk, axis_in = 1, 0, 1 if node.input[1] in self.axis1 else 0
            if axis_in == int(tB):
                self.unsupported(f"transB={int(tB)} contracts over the batch axis of '{node.input[1]}'")
            A = f64(self.const(node, 0, "weight"))
            W = A.T if tA else A  # W = op(A)
            transposed, out_axis = tA, 1
            how = f"{alpha:g} * " * (alpha != 1) + node.input[0] + ("^T" if tA else "")
        v = self.act(node, k)
        Wp = self.weight(node, wk, alpha * W, transposed, how)
        bias = None
        C = self._bias_const(node, 2)
        if C is not None and beta != 0.0:
            out = Value(v.terms, (W.shape[0],), None)
            vec, layout = self.channel_vector(C, out, out_axis, beta)
            bias = self.bias(node, 2, vec, layout, f"{beta:g} * " * (beta != 1) + node.input[2])
        if out_axis:
            self.axis1.add(node.output[0])
        return [self._dense(v, Wp, bias)]

    def _dense(self, v: Value, Wp: Param, bias) -> Value:
        if math.prod(v.shape) != Wp.shape[1]:
            self.unsupported(f"weight {list(Wp.shape)} does not fit an activation of per-sample shape {list(v.shape)}")
        return self._apply(v, Dense(Wp), bias, flat_ok=True)

    def op_MatMul(self, node, ins):
        if isinstance(ins[0], Value) and isinstance(ins[1], Value):
            self.unsupported("multiplies two activations: not positively homogeneous of degree 1")
        if isinstance(ins[0], Value):
            v = ins[0]
            if node.input[0] in self.axis1 or len(v.shape) != 1:
                self.unsupported(f"MatMul of an activation of per-sample shape {list(v.shape)}: "
                                 "only (batch, features) @ W is lowered")
            B = f64(self.const(node, 1, "weight"))
            if B.ndim != 2:
                self.unsupported(f"MatMul with a weight of rank {B.ndim}")
            return [self._dense(v, self.weight(node, 1, B.T, True, node.input[1] + "^T"), None)]
        v = ins[1]
        if node.input[1] not in self.axis1:
            self.unsupported("W @ activation contracts over the batch axis")
        A = f64(self.const(node, 0, "weight"))
        if A.ndim != 2:
            self.unsupported(f"MatMul with a weight of rank {A.ndim}")
        self.axis1.add(node.output[0])
        return [self._dense(v, self.weight(node, 0, A, False, node.input[0]), None)]

    def op_Conv(self, node, ins):
        v = self.act(node, 0)
        W = f64(self.const(node, 1, "weight"))
        n = W.ndim - 2
        if len(v.shape) != n + 1:
            self.unsupported(f"{n}-d convolution on an activation of per-sample shape {list(v.shape)}")
        a = attrs(node)
        k = tuple(W.shape[2:])
        if tuple(a.get("kernel_shape", k)) != k:
            self.fail(f"kernel_shape {a['kernel_shape']} disagrees with the weight {list(W.shape)}")
        strides, dil = tuple(a.get("strides", (1,) * n)), tuple(a.get("dilations", (1,) * n))
        pads = self._pads(a, v.shape[1:], k, strides, dil)
        Wp = self.weight(node, 1, W, False, "")
        B = self._bias_const(node, 2)
        bias = self.bias(node, 2, f64(B).reshape(-1), (W.shape[0],)) if B is not None else None
        return [self._apply(v, Conv(Wp, strides, pads, dil, int(a.get("group", 1))), bias)]

    def op_ConvTranspose(self, node, ins):
        """A zero-stuffing Gather and a Conv whose kernel is W in direct layout (frontends/conv_transpose.py);
        the param stays bound to the initializer W (C_in, C_out/group, *k)."""
        import torch

        from pathir.frontends.conv_transpose import conv_transpose

        v = self.act(node, 0)
        W = f64(self.const(node, 1, "weight"))
        n = W.ndim - 2
        if n < 1 or len(v.shape) != n + 1:
            self.unsupported(f"{n}-d transposed convolution on an activation of per-sample shape {list(v.shape)}")
        a = attrs(node)
        k = tuple(W.shape[2:])
        if tuple(a.get("kernel_shape", k)) != k:
            self.fail(f"kernel_shape {a['kernel_shape']} disagrees with the weight {list(W.shape)}")
        strides, dil = tuple(a.get("strides", (1,) * n)), tuple(a.get("dilations", (1,) * n))
        op = tuple(a.get("output_padding", (0,) * n))
        pads = self._transpose_pads(a, v.shape[1:], k, strides, dil, op)
        ref, _ = self._ref(node, 1, ("conv_transpose", int(a.get("group", 1)), W))  # tied only in this layout
        self._bind(ref, node, 1, "weight")
        w = ParamTensor(ref, torch.from_numpy(W))
        B = self._bias_const(node, 2)
        bias, group = None, int(a.get("group", 1))
        if B is not None:
            if B.size != W.shape[1] * group:
                self.fail(f"bias of {B.size} entries for {W.shape[1] * group} output channels")
            bref, _ = self._ref(node, 2, ("bias", (B.size,), f64(B).reshape(-1)))
            self._bind(bref, node, 2, "bias", (B.size,))
            bias = ParamTensor(bref, torch.from_numpy(f64(B).reshape(-1).copy()))
        return [conv_transpose(self, v, w, bias, strides, pads, dil, op, group)]

    def _transpose_pads(self, a, spatial, k, strides, dil, op):
        """(before, after) per axis of an ONNX ConvTranspose: ``pads``, or from ``output_shape`` /
        auto_pad SAME_* (total = s·(L − 1) + output_padding + d·(k − 1) + 1 − out; the odd unit goes
        after for SAME_UPPER, before otherwise), as onnxruntime computes them."""
        n = len(k)
        mode = a.get("auto_pad", "NOTSET") or "NOTSET"
        out = a.get("output_shape")
        if out is None and mode in ("SAME_UPPER", "SAME_LOWER"):
            out = [L * s for L, s in zip(spatial, strides)]
        if out is None:
            if mode == "VALID":
                return ((0, 0),) * n
            if mode != "NOTSET":
                self.fail(f"unknown auto_pad '{mode}'")
            p = list(a.get("pads", [0] * (2 * n)))
            return tuple((int(p[i]), int(p[i + n])) for i in range(n))
        out = list(out)[-n:]
        pads = []
        for L, kk, s, d, o, target in zip(spatial, k, strides, dil, op, out):
            total = s * (L - 1) + o + d * (kk - 1) + 1 - int(target)
            small = total // 2
            pads.append((small, total - small) if mode == "SAME_UPPER" else (total - small, small))
        return tuple(pads)

    def op_BatchNormalization(self, node, ins):
        import torch

        a = attrs(node)
        if a.get("training_mode", 0):
            self.unsupported("batch-norm in training mode uses batch statistics: input-dependent")
        v = self.act(node, 0)
        # the attribute is float32: take the decimal it was written from (1e-3, not 0.0010000000475)
        eps = float(str(np.float32(a.get("epsilon", 1e-5))))
        group = ("bn", tuple(node.input[1:5]), eps)  # a batch-norm applied twice shares all four
        names = [self._ref(node, k, group)[0] for k in range(1, 5)]
        what = ("scale", "bias", "running mean", "running variance")
        tensors = [ParamTensor(n, torch.from_numpy(f64(self.const(node, k, w)).reshape(-1).copy()))
                   for k, (n, w) in enumerate(zip(names, what), start=1)]
        out = self.batch_norm(v, "", *tensors, eps)
        C = v.shape[0]
        for k, (ref, kind) in enumerate(zip(names, ("bn_scale", "bn_bias", "bn_mean", "bn_var")), start=1):
            self._bind(ref, node, k, kind, (C,), eps)
        return [out]

    # ------------------------------------------------------------ pools
    def _pads(self, a, spatial, k, strides, dil):
        n = len(k)
        mode = a.get("auto_pad", "NOTSET") or "NOTSET"
        if mode == "NOTSET":
            p = list(a.get("pads", [0] * (2 * n)))
            return tuple((int(p[i]), int(p[i + n])) for i in range(n))
        if mode == "VALID":
            return ((0, 0),) * n
        if mode not in ("SAME_UPPER", "SAME_LOWER"):
            self.fail(f"unknown auto_pad '{mode}'")
        out = []
        for L, kk, s, d in zip(spatial, k, strides, dil):
            total = max(0, (-(-L // s) - 1) * s + (kk - 1) * d + 1 - L)
            small = total // 2
            out.append((small, total - small) if mode == "SAME_UPPER" else (total - small, small))
        return tuple(out)

    def _window(self, node, v: Value):
        n = len(v.shape) - 1
        if n < 1:
            self.unsupported(f"pooling on an activation of per-sample shape {list(v.shape)}")
        a = attrs(node)
        k = tuple(int(x) for x in a["kernel_shape"])
        strides, dil = tuple(a.get("strides", (1,) * n)), tuple(a.get("dilations", (1,) * n))
        pads = self._pads(a, v.shape[1:], k, strides, dil)
        ceil = bool(a.get("ceil_mode", 0)) and a.get("auto_pad", "NOTSET") in ("NOTSET", "")
        return Pool(k, strides, pads, dil, ceil), a

    def op_MaxPool(self, node, ins):
        v = self.act(node, 0)
        pool, _ = self._window(node, v)
        src = self.materialize(v)
        name = self.b.maxpool(self.label, src, pool, origin=self.where)
        return [Value.of_node(name, self.b.shape(name)), None]

    def op_GlobalMaxPool(self, node, ins):
        v = self.act(node, 0)
        n = len(v.shape) - 1
        pool = Pool(tuple(v.shape[1:]), (1,) * n, ((0, 0),) * n, (1,) * n)
        name = self.b.maxpool(self.label, self.materialize(v), pool, origin=self.where)
        return [Value.of_node(name, self.b.shape(name))]

    def op_AveragePool(self, node, ins):
        """mult[p] = 1 / (number of window positions counted at p): inside the
        padded input with count_include_pad, inside the input without (ONNX Runtime)."""
        v = self.act(node, 0)
        pool, a = self._window(node, v)
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
        src = self.materialize(v)
        return [Value([(src, pool)], pool.out_shape(self.b.shape(src)), None, self.label)]

    def op_GlobalAveragePool(self, node, ins):
        v = self.act(node, 0)
        return [self.adaptive_avg_pool(v, (1,) * (len(v.shape) - 1))]
