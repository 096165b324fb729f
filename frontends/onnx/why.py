"""Why an ONNX op has no place in a ReLU DAG (docs/math.md §1): the reasons ``UnsupportedOperation``
gives for op types without a row in the op table (:mod:`.table`)."""

from __future__ import annotations

__all__ = ["WHY", "DEFAULT_WHY", "SECOND_OUTPUT", "AXIS1_OK", "QUANTIZED"]

#: the ops of a quantized model (refused even where their inputs are constants: `WHY`)
QUANTIZED = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul",
                       "ConvInteger", "MatMulInteger"})

_NOT_HOMOGENEOUS = ("not positively homogeneous: f(λx) ≠ λ·f(x) for λ > 0, "
                    "so rescaling a neuron would change the function")
_NORMALIZES = "normalizes by statistics of the activation itself (an input-dependent scale): not positively homogeneous"

#: why an op has no place in a ReLU DAG (docs/math.md §1)
WHY = {
    **{op: _NOT_HOMOGENEOUS for op in (
        "Sigmoid", "Tanh", "Gelu", "FastGelu", "Elu", "Selu", "Celu", "Softsign", "Mish", "HardSigmoid",
        "HardSwish", "Swish", "Exp", "Log", "Sqrt", "Erf", "Sin", "Cos", "Reciprocal", "Sign", "Round", "Floor", "Ceil",
        "Shrink",
    )},
    "Softplus": ("not positively homogeneous: Softplus(x) = log(1 + e^x) is a smooth ReLU, Softplus(0) = log(2) ≠ 0 and "
                 "Softplus(λx) ≠ λ·Softplus(x) for λ > 0, so rescaling a neuron would change the function (use Relu)"),
    "PRelu": ("positively homogeneous, but its slope input (x·slope for x < 0, a learnable parameter of the source "
              "model) makes it a neuron pathir does not have: pathir's neurons are identity, ReLU and max-pool only "
              "(use Relu)"),
    "Abs": "positively homogeneous, but pathir's neurons are identity, ReLU and max-pool only",
    **{op: ("a quantized (QDQ) model: onnxruntime runs DequantizeLinear -> Conv/Gemm/MatMul as integer kernels "
            "that may quantize the activations too (its QDQ fusions), which no float linear map reproduces; analyse the float model "
            "before quantization") for op in sorted(QUANTIZED)},
    "Softmax": "softmax inside the graph normalizes across features: not positively homogeneous",
    "LogSoftmax": "log-softmax normalizes across features: not positively homogeneous",
    "Hardmax": "not positively homogeneous",
    **{op: _NORMALIZES for op in (
        "LayerNormalization", "GroupNormalization", "InstanceNormalization", "LpNormalization", "LRN",
        "MeanVarianceNormalization", "RMSNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
    )},
    "Attention": "attention multiplies activations together (queries by keys, weights by values)",
    "MultiHeadAttention": "attention multiplies activations together (queries by keys, weights by values)",
    "Pow": "a power of an activation: not positively homogeneous",
    "LpPool": "an Lp pool (the p-norm of each window) is positively homogeneous, but for p other than 1 not piecewise "
              "linear, and pathir's neurons are identity, ReLU and max-pool only (p = 1, a window sum of |x| = "
              "ReLU(x) + ReLU(-x), is not lowered either)",
    "TopK": "selects by value: not a fixed map",
    "If": "control flow on activations is not lowered",
    "Loop": "control flow on activations is not lowered",
    "Scan": "control flow on activations is not lowered",
}


DEFAULT_WHY = "outside the ops pathir lowers from ONNX (see docs/onnx.md): not known to keep the network a ReLU DAG"

#: ops whose second output means training semantics or data pathir cannot give
SECOND_OUTPUT = {
    "BatchNormalization": "running statistics updated in training mode",
    "MaxPool": "max-pool indices",
    "Dropout": "a dropout mask",
}

#: ops that read a 2-d activation with its batch on axis 1
AXIS1_OK = frozenset({"Gemm", "MatMul", "Relu", "Add", "Identity", "Dropout", "Cast", "CastLike", "Shape", "Size"})
