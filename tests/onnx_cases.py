"""Shared fixtures of the ONNX tests: small torch models, exporting them inside
the test run (both torch.onnx exporters), hand-built graphs, onnxruntime."""

from __future__ import annotations

import functools
import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn as nn
from onnx import TensorProto, helper, numpy_helper

#: exporter variants: the legacy TorchScript exporter and the dynamo one, each with
#: its graph optimisations (which fold batch-norms into convs in float32) and without
EXPORTERS = ("legacy", "legacy-nofold", "dynamo", "dynamo-noopt")
#: the variants that keep every torch parameter as it is (exact comparisons)
UNFOLDED = ("legacy-nofold", "dynamo-noopt")


def export(model: nn.Module, shape, exporter: str, batch: int = 2, dynamic_batch: bool = False) -> onnx.ModelProto:
    """``model`` (eval mode) exported to ONNX in memory."""
    model = model.eval()
    x = torch.randn(batch, *shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter.startswith("legacy"):
            f = io.BytesIO()
            kw = dict(input_names=["x"], output_names=["y"])
            if dynamic_batch:
                kw["dynamic_axes"] = {"x": {0: "N"}, "y": {0: "N"}}
            torch.onnx.export(model, (x,), f, dynamo=False, do_constant_folding=exporter == "legacy", **kw)
            return onnx.load_from_string(f.getvalue())
        kw = {"dynamic_shapes": ({0: torch.export.Dim("N")},)} if dynamic_batch else {}
        program = torch.onnx.export(model, (x,), dynamo=True, verbose=False, optimize=exporter == "dynamo", **kw)
        return program.model_proto


def ort_run(proto: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    """onnxruntime's outputs (in chunks of the batch size when the model fixes it)."""
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    inp = sess.get_inputs()[0]
    x = np.asarray(x, dtype=np.float32)
    fixed = inp.shape[0] if isinstance(inp.shape[0], int) else None
    if fixed is None or fixed == len(x):
        return sess.run(None, {inp.name: x})
    if len(x) % fixed:
        raise ValueError(f"the model takes batches of {fixed}: pick a multiple")
    parts = [sess.run(None, {inp.name: x[i : i + fixed]}) for i in range(0, len(x), fixed)]
    return [np.concatenate(p) for p in zip(*parts)]


def assert_export_matches(proto: onnx.ModelProto, model: nn.Module, shape, counts: bool = True):
    """The ONNX frontend on ``proto`` (``model`` exported) against onnxruntime's forward and against the
    torch frontend's path-norms (q = 1, 2) and, with ``counts``, path counts; returns both Compileds."""
    import pytest

    import pathir

    cm, ct = pathir.compile(proto), pathir.compile(model, input_shape=shape)
    x = np.random.default_rng(0).normal(size=(2, *shape)).astype(np.float32)
    assert rel(cm.forward(x, backend="numpy"), ort_run(proto, x)[0]) <= 1e-5
    for q in (1, 2):
        assert cm.path_norm(q) == pytest.approx(ct.path_norm(q), rel=1e-9)
    if counts:
        assert cm.num_paths() == pytest.approx(ct.num_paths(), rel=1e-12)
    return cm, ct


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def randomize_batchnorms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial batch-norm affine and statistics (fresh ones are the identity)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                n = m.num_features
                m.weight.copy_(torch.rand(n, generator=g) * 1.5 + 0.5)
                m.bias.copy_(torch.randn(n, generator=g))
                m.running_mean.copy_(torch.randn(n, generator=g) * 0.5)
                m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
    return model


# ------------------------------------------------------------------ small models


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(6)
        self.conv1 = nn.Conv2d(6, 6, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(6)
        self.down = nn.Conv2d(6, 8, 1, stride=2)
        self.bnd = nn.BatchNorm2d(8)
        self.conv3 = nn.Conv2d(6, 8, 3, stride=2, padding=1)
        self.bn3 = nn.BatchNorm2d(8)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.bn0(self.stem(x)))
        y = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(y)) + x)  # identity skip
        x = torch.relu(self.bn3(self.conv3(x)) + self.bnd(self.down(x)))  # two biased branches
        return self.fc(torch.flatten(self.pool(x), 1))


class Pools(nn.Module):
    """Max-pool with ceil_mode and padding, average pools with and without counting the padding."""

    def __init__(self, include_pad: bool):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3)
        self.bn = nn.BatchNorm2d(5)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True)
        self.avg = nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=include_pad)
        self.avg2 = nn.AvgPool2d(2, stride=1, padding=1, count_include_pad=include_pad)
        self.fc = nn.Linear(5 * 4 * 4, 3)

    def forward(self, x):
        x = self.maxpool(torch.relu(self.bn(self.conv(x))))
        x = self.avg2(self.avg(x))
        return self.fc(x.reshape(x.size(0), -1))


class Concat(nn.Module):
    """Concatenation, a batch-norm after it (not foldable), adaptive pooling to 2x2."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(3, 3, 1)
        self.bn = nn.BatchNorm2d(7)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(7 * 4, 5)

    def forward(self, x):
        x = torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], dim=1)
        x = self.pool(torch.relu(self.bn(x)))
        return self.fc(x.flatten(1))


class Shuffle(nn.Module):
    """A channel split, shuffle (view/transpose/view) and a spatial crop."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(4, 8, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 1)
        self.fc = nn.Linear(8 * 4 * 4, 3)

    def forward(self, x):
        x = torch.relu(self.c1(x))
        a, b = x.chunk(2, dim=1)
        x = torch.cat([a, torch.relu(self.c2(b))], 1)
        n, c, h, w = x.shape
        x = x.view(n, 2, c // 2, h, w).transpose(1, 2).contiguous().view(n, c, h, w)
        x = x[:, :, 1:5, 2:6]
        return self.fc(x.reshape(x.size(0), -1))


def fresh_bn_convnet() -> nn.Module:
    """Two conv + fresh batch-norm + ReLU layers and a linear head, for 3x6x6 inputs (seeded): the
    legacy exporter aliases the batch-norms' equal initializers through Identity nodes."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4),
                         nn.ReLU(), nn.Flatten(), nn.Linear(16, 2))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Dropout(0.3), nn.Linear(7, 6), nn.ReLU(), nn.Linear(6, 3))


def bn_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 3))


#: name -> (factory, per-sample input shape)
MODELS = {
    "mlp": (mlp, (5,)),
    "bn_mlp": (bn_mlp, (5,)),
    "residual": (Residual, (3, 8, 8)),
    "pools_include_pad": (lambda: Pools(True), (3, 9, 9)),
    "pools_exclude_pad": (lambda: Pools(False), (3, 9, 9)),
    "concat": (Concat, (3, 6, 6)),
    "shuffle": (Shuffle, (4, 6, 6)),
}


def build(name: str, seed: int = 0) -> tuple[nn.Module, tuple[int, ...]]:
    factory, shape = MODELS[name]
    torch.manual_seed(seed)
    return randomize_batchnorms(factory(), seed).eval(), shape


@functools.lru_cache(maxsize=None)
def exported(name: str, exporter: str, dynamic_batch: bool = False):
    """(torch model, input shape, ModelProto), exported once per test session.
    Callers must not modify the returned objects."""
    model, shape = build(name)
    return model, shape, export(model, shape, exporter, dynamic_batch=dynamic_batch)


# ------------------------------------------------------------------ hand-built graphs


def tensor_info(name: str, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def make_model(nodes, inputs, outputs, inits=None, opset: int = 17) -> onnx.ModelProto:
    """A checked ModelProto from onnx.helper pieces; ``inits`` {name: array} become
    float32 initializers (int64 arrays stay int64)."""
    tensors = []
    for k, v in (inits or {}).items():
        v = np.asarray(v)
        tensors.append(numpy_helper.from_array(v if v.dtype == np.int64 else v.astype(np.float32), k))
    graph = helper.make_graph(nodes, "handmade", inputs, outputs, tensors)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9  # what this onnxruntime reads
    onnx.checker.check_model(model)
    return model


def node(op: str, inputs, outputs, name: str | None = None, **attrs):
    return helper.make_node(op, inputs, outputs, name=name or outputs[0], **attrs)
