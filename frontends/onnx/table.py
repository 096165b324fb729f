"""The ONNX frontend's op table: ``{op_type: rule}``, one row per op type pathir lowers.

A rule is ``rule(low, node, inputs) -> outputs``: ``low`` the :class:`~.lowering.OnnxLowering`
walking the graph (its public API: ``act``, ``const``, ``bias_const``, ``weight``, ``bias``,
``channel_vector``, ``same_axis``, ``unsupported``, ``fail`` and the lowering core's
:class:`~pathir.frontends.core.lowering.Lowering`), ``node`` the ONNX NodeProto, ``inputs``
one value per input (an activation ``Value``, a constant numpy array, or None); it returns one
value per output. A node that reads no activation is folded to a constant before any rule runs;
an op type with no row is refused with its reason from :mod:`.why`.
"""

from __future__ import annotations

from pathir.frontends.onnx import arithmetic as ar
from pathir.frontends.onnx import elementwise as el
from pathir.frontends.onnx import index as ix
from pathir.frontends.onnx import layers as ly
from pathir.frontends.onnx import resize as rz

__all__ = ["RULES", "INDEX_OPS"]

#: ops that move elements without computing: lowered by running them on element ids
INDEX_OPS = ("Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Split", "Slice", "Gather", "Expand",
             "Tile", "DepthToSpace", "SpaceToDepth")

#: op type -> rule
RULES = {
    # layers
    "Gemm": ly.gemm, "MatMul": ly.matmul, "Conv": ly.conv, "ConvTranspose": ly.conv_transpose,
    "BatchNormalization": ly.batch_normalization,
    "MaxPool": ly.max_pool, "GlobalMaxPool": ly.global_max_pool,
    "AveragePool": ly.average_pool, "GlobalAveragePool": ly.global_average_pool,
    # ReLU, the identity, sums
    "Relu": el.relu, "LeakyRelu": ar.leaky_relu, "ThresholdedRelu": ar.thresholded_relu, "Clip": ar.clip,
    "Identity": el.identity, "Dropout": el.dropout, "Cast": el.cast, "CastLike": el.cast_like,
    "Shape": el.shape, "Size": el.size, "Add": el.add,
    # constant factors, differences, maxima, reductions, masks
    "Sum": ar.sum_, "Mean": ar.sum_, "Sub": ar.sub, "Neg": ar.neg, "Mul": ar.mul, "Div": ar.div, "Max": ar.max_, "Min": ar.min_, "Where": ar.where_,
    "ReduceSum": ar.reduce_sum, "ReduceMean": ar.reduce_mean, "ReduceMax": ar.reduce_max,
    # resampling
    "Resize": rz.resize, "Upsample": rz.upsample,
    # element moves and sequences
    "Concat": ix.concat, "Pad": ix.pad, **dict.fromkeys(INDEX_OPS, ix.moved),
    "GatherElements": ix.gather_elements, "ScatterND": ix.scatter, "ScatterElements": ix.scatter,
    "SplitToSequence": ix.split_to_sequence, "SequenceAt": ix.sequence_at,
}
