"""In-place writes exported to ONNX (ScatterND, ScatterElements; the dynamo exporter's Transpose ->
ScatterND -> Transpose): exact against onnxruntime and against the torch frontend on the same model,
kept by a PathCond write-back, or refused naming the node, the op and why."""

import numpy as np
import pytest
import torch
from torch import nn

import pathir
from pathir.errors import UnsupportedOperation

onnx_cases = pytest.importorskip("onnx_cases")
from onnx_cases import make_model, node, tensor_info  # noqa: E402


class Writes(nn.Module):
    """The writes users make: a channel zeroed, a block zeroed, a channel copied from another."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 1)

    def forward(self, x):
        v = self.conv(x).relu()
        v[:, 1] = 0
        v[:, 2:, :, :1] = 0
        v[:, 0] = v[:, 3] * 2
        return self.head(v)


class WritesAConstant(Writes):
    def forward(self, x):
        v = self.conv(x).relu()
        v[:, 1] = 3.0
        return self.head(v)


class WritesOneSample(Writes):
    def forward(self, x):
        v = self.conv(x).relu()
        v[0, 1] = 0
        return self.head(v)


def _model(cls):
    torch.manual_seed(0)
    return cls().eval()


@pytest.mark.filterwarnings("ignore::pathir.NotConvergedWarning")
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("exporter", ["legacy-nofold", "dynamo-noopt", "dynamo"])
def test_exported_writes_give_the_torch_frontends_numbers_and_survive_pathcond(exporter, dynamic):
    model = _model(Writes)
    proto = onnx_cases.export(model, (3, 6, 6), exporter, dynamic_batch=dynamic)
    assert {"ScatterND", "ScatterElements"} & {n.op_type for n in proto.graph.node}
    cm, _ = onnx_cases.assert_export_matches(proto, model, (3, 6, 6))
    x = np.random.default_rng(1).normal(size=(2, 3, 6, 6)).astype(np.float32)
    ref = onnx_cases.ort_run(proto, x)[0]
    cm.pathcond(max_sweeps=5)
    assert onnx_cases.rel(onnx_cases.ort_run(cm.writer.to_onnx(), x)[0], ref) <= 1e-5


@pytest.mark.parametrize("cls, match", [(WritesAConstant, "constant other than 0"),
                                        (WritesOneSample, "mixes the samples|batch axis")])
@pytest.mark.parametrize("exporter", ["legacy-nofold", "dynamo"])
def test_writes_that_are_not_element_moves_are_refused_naming_the_node(cls, match, exporter):
    proto = onnx_cases.export(_model(cls), (3, 6, 6), exporter)
    with pytest.raises(UnsupportedOperation, match=match) as info:
        pathir.compile(proto)
    assert info.value.op in {n.op_type for n in proto.graph.node}


def _graph(nodes, inits, out_shape=(2, 3, 4, 4), opset=18):
    w = np.random.default_rng(0).normal(size=(3, 3, 1, 1))
    pre = [node("Conv", ["x", "w"], ["h"]), node("Relu", ["h"], ["r"])]
    return make_model(pre + nodes, [tensor_info("x", [2, 3, 4, 4])], [tensor_info("y", list(out_shape))], {"w": w, **inits}, opset)


def test_a_scatter_that_adds_into_the_elements_is_refused():
    proto = _graph([node("Transpose", ["r"], ["t"], perm=[1, 0, 2, 3]), node("Gather", ["t", "g"], ["u"], axis=0),
                    node("ScatterND", ["t", "i", "u"], ["s"], reduction="add"),
                    node("Transpose", ["s"], ["y"], perm=[1, 0, 2, 3])],
                   {"g": np.array([0], dtype=np.int64), "i": np.array([[1]], dtype=np.int64)})
    with pytest.raises(UnsupportedOperation, match="reduction='add'") as info:
        pathir.compile(proto)
    assert info.value.op == "ScatterND"


def test_a_moved_batch_axis_that_a_layer_reads_is_refused_naming_the_transpose():
    proto = _graph([node("Transpose", ["r"], ["t"], perm=[1, 0, 2, 3]), node("Relu", ["t"], ["y"])], {}, (3, 2, 4, 4))
    with pytest.raises(UnsupportedOperation, match="batch axis first") as info:
        pathir.compile(proto)
    assert info.value.op == "Transpose" and "'y' (Relu) reads the result" in str(info.value)


def test_a_moved_batch_axis_at_the_output_is_refused():
    proto = _graph([node("Transpose", ["r"], ["y"], perm=[1, 0, 2, 3])], {}, (3, 2, 4, 4))
    with pytest.raises(UnsupportedOperation, match="graph output 'y'"):
        pathir.compile(proto)
