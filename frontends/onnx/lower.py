"""The ONNX frontend: an .onnx file, its bytes or an onnx.ModelProto -> Graph.

Lowered ops: Gemm (transA/transB, alpha/beta), MatMul (+ Add), Conv (groups,
pads, strides, dilations, auto_pad), BatchNormalization (inference), Relu,
MaxPool / GlobalMaxPool (ceil_mode, pads, dilations), AveragePool
(count_include_pad), GlobalAveragePool, ReduceMean over the spatial axes, Add
(skip or constant bias), Sub and Neg (a fixed -1 edge), Mul / Div by a scalar
constant (a fixed edge), Max of activations (a max-pool neuron), LeakyRelu with
alpha 0, Concat, Flatten, Reshape, Transpose, Squeeze,
Unsqueeze, Slice, Split, Gather, Pad (zeros), Identity, Dropout, Cast; any node
that reads no activation (the Shape / Gather / Unsqueeze / Concat arithmetic in
front of a Reshape, Constant nodes) is folded to a constant. Anything else
that touches an activation raises ``pathir.UnsupportedOperation`` naming the
ONNX node, its op type and why it breaks the rescaling symmetry.

The model is never modified; write-back goes to a copy (``OnnxWriter``).
"""

from __future__ import annotations

from pathir.frontends.core.lowered import Lowered
from pathir.frontends.onnx.load import OnnxModelError, infer_shapes, input_shapes, load
from pathir.frontends.onnx.writer import OnnxWriter

__all__ = ["lower", "OnnxModelError"]

#: binding kinds the torch count of parameters includes (running statistics are buffers)
_COUNTED = frozenset({"weight", "bias", "neg_bias", "bn_scale", "bn_bias"})


def lower(model, input_shape=None) -> Lowered:
    """Lower an ONNX model (path, bytes or ModelProto) to a raw Graph.

    ``input_shape`` (without the batch axis; a dict {input name: shape} for
    several inputs) fixes input sizes the model leaves dynamic.

    >>> import io, warnings, torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    >>> f = io.BytesIO()
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     torch.onnx.export(net, (torch.randn(1, 4),), f, dynamo=False)
    >>> low = lower(f.getvalue())
    >>> print(low.graph)
    model(inputs=[onnx::Gemm_0], outputs=[/2/Gemm])
      0  onnx::Gemm_0: input[4]
      1  /1/Relu: relu[3] = dense(0.weight)(onnx::Gemm_0) + bias(0.bias)
      2  /2/Gemm: identity[2] = dense(2.weight)(/1/Relu) + bias(2.bias)
    >>> low.source_num_params
    23
    """
    from pathir.frontends.onnx.lowering import OnnxLowering  # lazy: imports torch

    src = load(model)
    shapes, batch = input_shapes(src, input_shape)
    types = infer_shapes(src, shapes)
    lowering = OnnxLowering(src, shapes, batch, types)
    graph, out_nodes = lowering.run()
    outputs = {o.name: (n, o.name in lowering.axis1) for o, n in zip(src.proto.graph.output, out_nodes)}
    writer = OnnxWriter(src.proto, lowering.bindings, outputs, read_from=src.files)
    n_params = sum(b.value.size for b in lowering.bindings.values() if b.kind in _COUNTED)
    return Lowered(graph, writer, int(n_params), src.name)
