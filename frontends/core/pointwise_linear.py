"""``nn.Linear`` on the last axis of an activation with more axes, (..., F) -> (..., O): the same
weight at every other position (a per-token MLP, a channels-last 1×1 layer).

Lowered as the convolution it is: the feature axis moved first (an index op, no neuron), a
convolution with kernel size 1 whose kernel is the Linear weight entry by entry
(``PointwiseKernelLayout``: write-back, masks, diag G and scores land on the (O, F) weight in its
own layout), the bias per output feature, and the feature axis moved back last."""

from __future__ import annotations

from pathir.frontends.core.values import ParamTensor, Value
from pathir.ir import Conv, PointwiseKernelLayout, SourceRef

__all__ = ["linear_last_axis", "pointwise_last_axis", "over_rows"]


def linear_last_axis(low, v: Value, weight: ParamTensor, bias: ParamTensor | None) -> Value:
    """``F.linear(v, weight, bias)`` with v of per-sample shape (*S, F), S non-empty; ``weight`` read as stored
    (O, F), or transposed (``F.linear(x, W.t())``, W stored (F, O))."""
    t = weight.read()
    layout = PointwiseKernelLayout(len(v.shape) - 1, transposed=weight.transposed)

    def kernel():
        read = f"{weight.name}ᵀ" if weight.transposed else weight.name  # (the two layouts told apart in a refusal)
        return low.widened(weight, (SourceRef(weight.name, layout=layout),),
                           f"{read} as a pointwise convolution kernel", view=layout.from_source)

    return pointwise_last_axis(low, v, tuple(t.shape), kernel, (lambda: low.direct(bias)) if bias is not None else None)


def pointwise_last_axis(low, v: Value, shape: tuple, kernel, bias=None) -> Value:
    """v of per-sample shape (*S, F) times an (O, F) matrix on its last axis (``shape``: (O, F)): the feature axis
    moved first, a convolution of kernel size 1 whose kernel Param ``kernel()`` gives (O, F, 1, …, 1) in a
    ``PointwiseKernelLayout``, plus the Param ``bias()`` per output feature (None: no bias), the axis moved back."""
    *positions, features = v.shape
    if len(shape) != 2 or shape[1] != features:
        low.unsupported(f"weight {list(shape)} does not fit {features} input features")
    if len(positions) > 3:
        low.unsupported(f"linear layer on a tensor of shape {list(v.shape)}: more than 3 axes before the features")
    n = len(positions)
    first = low.index_op(lambda x: x.movedim(-1, 1), [v])[0][0]  # (F, *S)
    W = kernel()
    b = bias() if bias is not None else None
    out = low.apply(first, Conv(W, (1,) * n, ((0, 0),) * n, (1,) * n, 1), b)
    return low.index_op(lambda x: x.movedim(1, -1), [out])[0][0]


def over_rows(low, v: Value, layer) -> Value:
    """``layer`` (Value -> Value over the last axis) applied over v's second-to-last axis instead: v's last two axes
    swapped (an index move, no neuron), the layer, swapped back (``A @ v`` = (vᵀ Aᵀ)ᵀ)."""
    swapped = low.index_op(lambda x: x.transpose(-1, -2), [v])[0][0]
    return low.index_op(lambda x: x.transpose(-1, -2), [layer(swapped)])[0][0]
