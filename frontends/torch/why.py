"""Why an op has no place in a ReLU DAG (docs/math.md §1): the reasons the torch frontend's
``UnsupportedOperation`` gives, by module class name, function, method or ATen op name."""

from __future__ import annotations

__all__ = ["WHY", "why", "refuse"]

#: op name -> why it is refused
WHY = {
    "Hardtanh": ("clips below at a bound other than 0: not positively homogeneous (Hardtanh(0, t) is a clipped ReLU "
                 "and is lowered)"),
    "Hardswish": "not positively homogeneous (a smooth gate)",
    "Hardsigmoid": "not positively homogeneous",
    "Sigmoid": "not positively homogeneous",
    "Tanh": "not positively homogeneous",
    "GELU": "not positively homogeneous",
    "SiLU": "not positively homogeneous",
    "ELU": "not positively homogeneous",
    **{op: ("its negative slope (other than 0, a ReLU, or 1, the identity) keeps it positively homogeneous, "
           "but it is not one of pathir's neuron types (identity, ReLU, max-pool)")
       for op in ("LeakyReLU", "leaky_relu", "leaky_relu_", "RReLU", "rrelu")},
    **{op: "not positively homogeneous" for op in ("elu", "elu_", "selu", "celu", "gelu", "silu", "mish", "SELU",
                                                   "CELU", "Mish", "tanh", "hardswish", "logsigmoid")},
    **{op: "normalizes by input-dependent statistics"
       for op in ("group_norm", "rms_norm", "RMSNorm", "local_response_norm", "native_layer_norm", "native_group_norm")},
    **{op: ("normalizes each sample by its own statistics (input-dependent); one that tracks running statistics "
            "normalizes by them in eval mode, an affine map, which pathir does not lower: use a BatchNorm with the "
            "same statistics") for op in ("InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "instance_norm")},
    **{op: ("positively homogeneous, but its negative slope a (x·a for x < 0, a learnable parameter) makes it a "
            "neuron pathir does not have: pathir's neurons are identity, ReLU and max-pool only (use nn.ReLU)")
       for op in ("PReLU", "prelu")},
    **{op: ("not positively homogeneous: softplus(x) = log(1 + exp(βx))/β is a smooth ReLU, softplus(0) = log(2)/β "
            "≠ 0 and softplus(λx) ≠ λ·softplus(x) for λ > 0, so rescaling a neuron would change the function "
            "(use nn.ReLU)")
       for op in ("Softplus", "softplus")},
    **{op: ("threshold(x, t, v) is x where x > t and v elsewhere: a threshold t ≠ 0 or a value v ≠ 0 is not "
            "positively homogeneous (f(λx) ≠ λ·f(x) for λ > 0: the cut at t and the value v do not scale with x); "
            "threshold(x, 0, 0) is a ReLU and is lowered")
       for op in ("Threshold", "threshold", "_threshold")},
    **{op: ("a recurrent module is not lowered; with nonlinearity='relu' it is a ReLU network once unrolled over "
            "its time steps: write the loop by hand (h = torch.relu(W(x[:, t]) + U(h)) for a fixed number of steps) "
            "to analyse it") for op in ("RNN", "RNNCell", "rnn_relu", "rnn_relu_cell")},
    **{op: "gates by sigmoid and tanh: not positively homogeneous"
       for op in ("LSTM", "GRU", "LSTMCell", "GRUCell", "lstm", "gru", "rnn_tanh", "rnn_tanh_cell", "lstm_cell",
                  "gru_cell")},
    "Softmax": "softmax inside the graph is not positively homogeneous",
    "LogSoftmax": "log-softmax is not positively homogeneous",
    "LayerNorm": "normalizes by input-dependent statistics",
    "GroupNorm": "normalizes by input-dependent statistics",
    "LocalResponseNorm": "normalizes by input-dependent statistics",
    "MultiheadAttention": "attention multiplies activations together",
    "mul": "a multiplicative gate between two activations (or a constant factor)",
    "sigmoid": "not positively homogeneous",
    "hardsigmoid": "not positively homogeneous",
    "layer_norm": "normalizes by input-dependent statistics",
    "hardtanh": ("clips below at a bound other than 0: not positively homogeneous (hardtanh(x, 0, t) is a clipped "
                 "ReLU and is lowered)"),
    **{op: ("a lower bound other than 0 (or a max without one) is not lowered: clamp(x, 0) is a ReLU and clamp(x, 0, t) "
            "a clipped ReLU, ReLU(x) - ReLU(ReLU(x) - t); any other clamp is not positively homogeneous")
       for op in ("clamp", "clip", "clamp_min")},
    **{op: ("an elementwise minimum is lowered only as min(ReLU(x), t) with t a buffer of one value per channel "
            "(a clipped ReLU)") for op in ("minimum", "min", "fmin")},
    "abs": "positively homogeneous, but |x| is not one of pathir's neurons (identity, ReLU, max-pool)",
    "pow": "a power of an activation: not positively homogeneous",
    "sort": "orders by value: not a fixed map",
    "topk": "selects by value: not a fixed map",
    "cumsum": "a cumulative sum is a fixed linear map pathir does not lower (write it as a Linear with fixed weights)",
    "normalize": "divides by the activation's own norm: not positively homogeneous",
    **{op: "reverses axis 0, the batch axis: it mixes the samples of a batch" for op in ("flipud", "flipud.default")},
    "einsum": "einsum is not lowered: write a contraction with a weight as a Linear layer or x @ W",
    **{op: ("F.unfold / F.fold (nn.Unfold / nn.Fold, im2col) is a fixed copy map pathir does not lower "
            "(Tensor.unfold, a sliding window along one axis, is lowered; a convolution written as unfold then matmul "
            "is a Conv2d)") for op in ("unfold", "fold", "Unfold", "Fold", "im2col", "col2im")},
    **{op: ("a fixed linear map (a selection or mask of entries) pathir does not lower: pick entries with "
            "indexing (x[..., idx]) or multiply by a fixed 0/1 buffer") for op in (
        "diagonal", "diag", "diag_embed", "tril", "triu", "tril_", "triu_")},
    **{op: ("a matrix product with a bias is lowered as a Linear layer, as x @ W + b with W and b parameters, or as "
            "torch.addmm(b, x, W); addmv / baddbmm / addbmm / addr are not")
       for op in ("addmv", "baddbmm", "addbmm", "addr")},
    **{op: ("makes a new tensor of an activation's shape: a constant (or random) input inside the network, not a "
            "ReLU DAG edge (zeros, from zeros_like or new_zeros, are read: concatenated beside activations they are "
            "no element, as F.pad's)")
       for op in ("ones_like", "full_like", "empty_like", "rand_like", "randn_like", "randint_like",
                  "new_ones", "new_full", "new_empty", "new_tensor")},
    **{op: ("gathers or scatters along an axis by an index tensor: with a constant index a fixed copy map, which "
            "pathir does not lower; pick entries with index_select or indexing (x[..., idx], x[:, idx]) instead")
       for op in (
        "gather", "take_along_dim", "take", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce",
        "scatter_reduce_", "index_add", "index_add_", "index_copy", "index_copy_", "put", "put_")},
    **{op: "compares an activation: a data-dependent mask, not a fixed linear map" for op in (
        "gt", "lt", "ge", "le", "eq", "ne", "greater", "less", "greater_equal", "less_equal", "__gt__", "__lt__",
        "__ge__", "__le__", "__eq__", "__ne__")},
}


def why(op: str) -> str:
    """Why ``op`` (a module class name, a function or method name, an ATen op name) is refused."""
    return WHY.get(op, "outside the ReLU DAG model (identity, ReLU and max-pool neurons with linear edges)")


def refuse(low):
    """Refuse the op being lowered (``low.op``) with its reason; never returns."""
    op = low.op.split(".")[0]
    low.unsupported(why(op), low.op)
