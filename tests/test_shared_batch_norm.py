"""One batch-norm's tensors at two places: a rescaling keeps the function, or is refused untouched.

- an ONNX BatchNormalization reading one initializer in two slots (a deduplicated fresh batch-norm:
  scale = variance = 1, bias = mean = 0) is written per slot: onnxruntime's output is kept;
- one batch-norm module (or initializer set) applied twice, folded into a layer at one place and
  kept as a per-channel scale at the other, compiles (its folded bias under a name of its own) and
  its analysis is exact, but a write-back is refused: the kept one's running statistics move
  with a rescaling and the folded one reads them too.
"""

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from onnx_cases import make_model, node, ort_run, rel, tensor_info

import pathir
from pathir.errors import PathirError


def _bn_convnet(bn_inputs, inits, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.normal(size=s)  # noqa: E731
    nodes = [node("Conv", ["x", "W1"], ["h1"], pads=[1, 1, 1, 1]),
             node("BatchNormalization", ["h1", *bn_inputs], ["n1"], epsilon=1e-3),
             node("Relu", ["n1"], ["r1"]),
             node("Conv", ["r1", "W2", "b2"], ["h2"], pads=[1, 1, 1, 1]),
             node("Relu", ["h2"], ["r2"]),
             node("GlobalAveragePool", ["r2"], ["p"]), node("Flatten", ["p"], ["f"]),
             node("Gemm", ["f", "Wf", "bf"], ["y"], transB=1)]
    inits = dict(W1=f(8, 3, 3, 3), W2=f(8, 8, 3, 3), b2=f(8), Wf=f(4, 8), bf=f(4), **inits)
    return make_model(nodes, [tensor_info("x", ["N", 3, 6, 6])], [tensor_info("y", ["N", 4])], inits)


_SPREAD = np.logspace(-1.5, 1.5, 8)
SLOTS = {
    "scale is variance": (["S", "B", "M", "S"], dict(S=_SPREAD + 0.5, B=np.linspace(-1, 1, 8), M=np.linspace(1, -1, 8))),
    "bias is mean": (["S", "B", "B", "V"], dict(S=_SPREAD, B=np.linspace(-1, 1, 8), V=np.linspace(0.5, 2, 8))),
    "all four one tensor": (["S", "S", "S", "S"], dict(S=_SPREAD + 0.5)),
}


@pytest.mark.parametrize("case", SLOTS)
def test_one_initializer_in_two_batch_norm_slots_keeps_onnxruntime_outputs(case):
    proto = _bn_convnet(*SLOTS[case])
    x = np.random.default_rng(1).normal(size=(4, 3, 6, 6)).astype(np.float32)
    before = ort_run(proto, x)[0]
    cm = pathir.compile(proto)
    report = cm.equalize(progress=False)
    assert report.written and report.units_moved > 0
    after = ort_run(cm.to_onnx(), x)[0]
    assert rel(after, before) < 1e-5


class _SharedBN(nn.Module):
    """``bn`` after ``c1`` (foldable) and again after a residual sum (kept as a scale)."""

    def __init__(self, bias: bool):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1, bias=bias), nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.bn(self.c1(x)))
        s = h + torch.relu(self.c2(h))
        return self.fc(torch.relu(self.bn(s)).mean((2, 3)))


def _shared_bn(bias: bool) -> nn.Module:
    torch.manual_seed(0)
    net = _SharedBN(bias).eval()
    with torch.no_grad():
        net.bn.weight.copy_(torch.logspace(-1.5, 1.5, 8))
        net.bn.bias.uniform_(-1, 1)
        net.bn.running_mean.uniform_(-1, 1)
        net.bn.running_var.uniform_(0.5, 2)
    return net


@pytest.mark.parametrize("bias", [False, True])
def test_a_batch_norm_folded_at_one_place_and_kept_at_another_is_refused_untouched(bias):
    net = _shared_bn(bias)
    state = copy.deepcopy(net.state_dict())
    cm = pathir.compile(net, input_shape=(3, 8, 8))  # the self-check holds: the analysis is of this model
    x = torch.randn(5, 3, 8, 8, dtype=torch.float64)
    graph_out = pathir.lifting.walk.forward(cm.graph, cm.get_backend(), x.numpy())
    (y,) = graph_out.values()
    assert rel(np.asarray(y), net.double()(x).detach().numpy()) < 1e-12
    net.float()
    for method in (cm.equalize, cm.pathcond):
        with pytest.raises(PathirError, match="used at two places"):
            method(progress=False)
        assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())


def test_a_shared_batch_norm_in_an_onnx_file_is_refused_and_the_file_kept(tmp_path):
    net = _shared_bn(False)
    path = tmp_path / "m.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.randn(1, 3, 8, 8),), str(path), dynamo=False, input_names=["x"],
                          dynamic_axes={"x": {0: "N"}}, do_constant_folding=False)
    source = path.read_bytes()
    cm = pathir.compile(str(path))
    with pytest.raises(PathirError, match="used at two places"):
        cm.equalize(progress=False)
    assert cm.to_onnx().SerializeToString() == cm.writer.source.SerializeToString()
    assert path.read_bytes() == source


class _LayerScale(nn.Module):
    """``g * b(h)``: a layer-scale g, a parameter of its own, not a batch-norm."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(2, 3), nn.Linear(3, 2), nn.Linear(2, 1)
        self.g = nn.Parameter(torch.tensor([0.5, -2.0]))

    def forward(self, x):
        return self.head(torch.relu(self.g * self.b(torch.relu(self.a(x)))))


def test_a_layer_scale_stays_a_param_of_the_graph():
    """A layer-scale's Scale edge is not folded as a batch-norm's is (it has no γ, β to take the unit's
    factor): folded, g vanished from the graph, diag_g['b.weight'] was G of g·W, and the differentiable
    path-norm refused the model as 'changed after compiling'. diag G against its definition,
    G_ii = ∂(Σ_p Π θ²)/∂θ_i² (autograd on the squared parameters)."""
    torch.manual_seed(0)
    net = _LayerScale().double()
    cm = pathir.compile(net, input_shape=(2,))
    squares = {k: (p.detach() ** 2).requires_grad_(True) for k, p in net.named_parameters()}
    v = squares["a.weight"] @ torch.ones(2, dtype=torch.float64) + squares["a.bias"]
    v = squares["g"] * (squares["b.weight"] @ v + squares["b.bias"])
    (squares["head.weight"] @ v + squares["head.bias"]).sum().backward()
    g = cm.diag_g()
    assert set(g) == set(squares)
    for name, s in squares.items():
        np.testing.assert_allclose(g[name], s.grad.numpy(), rtol=1e-12)
    value = cm.path_norm(2, differentiable=True)
    value.backward()
    assert float(value) == pytest.approx(cm.path_norm(2), rel=1e-14)
    assert net.g.grad is not None and torch.isfinite(net.g.grad).all()
    x = torch.randn(6, 2, dtype=torch.float64)
    before = net(x).detach()
    cm.commit_rescaling(np.random.default_rng(0).normal(size=len(cm.units)))
    assert rel(net(x).detach().numpy(), before.numpy()) < 1e-12
