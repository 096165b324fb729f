"""Transposed convolutions (ConvTranspose1d/2d/3d, F.conv_transpose*d, the ATen ops, ONNX ConvTranspose).

A transposed convolution is a linear map with a learnable kernel T of shape
(C_in, C_out/g, *k): input position i of channel c sends T[c, o, m] · x[c, i] to
output position i·s − p_before + d·m of channel (group of c)·C_out/g + o. It is
lowered exactly as

1. a fixed selection (``Gather``): per spatial axis, the input is zero-stuffed
   (s − 1 empty positions between two inputs) and framed by d·(k − 1) − p_before
   empty positions before and d·(k − 1) − p_after + output_padding after (a
   negative frame crops). An empty position reads nothing (index −1: no edge);
2. an ordinary convolution (stride 1, no padding, dilation d, groups g) whose
   kernel W is T with the channel axes swapped per group and every spatial axis
   flipped (``TransposedConvLayout``): W[j·O_g + o, i, κ] = T[j·I_g + i, o, k − 1 − κ].

Every (input neuron, output neuron) edge of the transposed convolution is
exactly one path through one stuffed position, with weight 1 · T[...], so Φ, the
path-norms and counts, diag G and the units are the transposed convolution's.
The IR param is W; its ``SourceRef.layout`` carries the index map back to T, so
rescalings, masks, diag G and pruning scores land on the module's own weight
entries. A transposed convolution whose kernel is a buffer (a fixed upsampling
filter) is refused: it is not a parameter.
"""

from __future__ import annotations

import numpy as np
import torch

from pathir.frontends.core.values import ParamTensor, Value
from pathir.ir import Conv, SourceRef, TransposedConvLayout

__all__ = ["conv_transpose", "stuffing_index"]



def _ints(x, n: int) -> tuple[int, ...]:
    if isinstance(x, (list, tuple)):
        return tuple(int(e) for e in x) if len(x) == n else tuple(int(x[0]) for _ in range(n))
    return tuple(int(x) for _ in range(n))


def stuffing_index(shape, kernel, stride, pads, dilation, output_padding) -> tuple[np.ndarray, tuple[int, ...]]:
    """(index, stuffed shape): stuffed.flat[t] = x.flat[index[t]] (−1: empty) for x of per-sample
    ``shape`` (C, *L), so that the stride-1 convolution of the stuffed tensor with the flipped,
    channel-swapped kernel is the transposed convolution. ``pads``: (before, after) per axis."""
    C, spatial = shape[0], tuple(shape[1:])
    axes, out = [], []
    for L, k, s, (pb, pe), d, op in zip(spatial, kernel, stride, pads, dilation, output_padding):
        left, right = d * (k - 1) - pb, d * (k - 1) - pe + op
        total = left + (L - 1) * s + 1 + right
        j = np.arange(max(total, 0)) - left
        src = np.where((j >= 0) & (j % s == 0) & (j // s < L), j // s, -1)
        axes.append(src)
        out.append(max(total, 0))
    index = np.arange(C).reshape(C, *([1] * len(spatial)))
    valid = np.ones((1,) * (len(spatial) + 1), dtype=bool)
    for a, (src, L) in enumerate(zip(axes, spatial)):
        view = [1] * (len(spatial) + 1)
        view[a + 1] = src.size
        index = index * L + np.maximum(src, 0).reshape(view)
        valid = valid & (src >= 0).reshape(view)
    index = np.where(valid, index, -1)
    stuffed = (C, *out)
    return np.broadcast_to(index, stuffed).reshape(-1).copy(), stuffed


def conv_transpose(low, v: Value, weight: ParamTensor, bias, stride, pads, dilation, output_padding, groups) -> Value:
    """The transposed convolution of ``v``: a zero-stuffing Gather, then a Conv with the
    kernel in direct layout (its param bound to ``weight`` through ``TransposedConvLayout``).
    ``pads``: an int, one int per axis (before = after), or (before, after) pairs."""
    v = low.value(v)
    T = weight.tensor
    n = T.dim() - 2
    if n < 1 or len(v.shape) != n + 1:
        low.unsupported(f"{n}-d transposed convolution on a tensor of shape {list(v.shape)}")
    groups = int(groups)
    c_in, o_g, *k = (int(x) for x in T.shape)
    if v.shape[0] != c_in or c_in % groups:
        low.unsupported(f"transposed-convolution weight {list(T.shape)} (groups={groups}) does not fit "
                        f"{v.shape[0]} input channels")
    stride, dilation, op = _ints(stride, n), _ints(dilation, n), _ints(output_padding, n)
    if isinstance(pads, (list, tuple)) and pads and isinstance(pads[0], (list, tuple)):
        pads = tuple((int(a), int(b)) for a, b in pads)
    else:
        pads = tuple((p, p) for p in _ints(pads, n))
    if any(s < 1 for s in stride) or any(d < 1 for d in dilation) or any(o < 0 for o in op):
        low.unsupported(f"stride {list(stride)}, dilation {list(dilation)}, output_padding {list(op)}")
    index, stuffed = stuffing_index(v.shape, k, stride, pads, dilation, op)
    if any(L < d * (kk - 1) + 1 for L, d, kk in zip(stuffed[1:], dilation, k)):
        low.unsupported(f"the transposed convolution's output on input {list(v.shape)} would be empty")
    framed = low.compose_selection([(low.selectable(v), index)], stuffed)
    framed = Value.of_node(low.materialize(framed, f"{low.label}.stuffed"), stuffed)
    layout = TransposedConvLayout(groups)
    refs = (SourceRef(weight.name, layout=layout),)
    W = low.param(weight.name, layout.from_source(T.detach().to("cpu", torch.float64, copy=True)).numpy(), refs,
                  f"{weight.name} as a convolution kernel (in/out channels swapped per group, kernel flipped)")
    b = low.direct(bias) if bias is not None else None
    return low.apply(framed, Conv(W, (1,) * n, ((0, 0),) * n, dilation, groups), b)
