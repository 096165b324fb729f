"""The torch frontend: every supported op, checked against the model's own forward."""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pathir
from pathir.ir import MapKind, NodeKind


def _randomize_bn(model):
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.3)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            if m.weight is not None:
                m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.data.copy_(torch.randn(m.num_features, generator=g) * 0.3)
    return model


def assert_same_function(model, input_shape, batch=3, backend="numpy", tol=1e-9):
    """Compile, then compare the IR forward with the model's own eval forward in float64."""
    torch.manual_seed(0)
    model = _randomize_bn(model)
    cm = pathir.compile(model, input_shape=input_shape)
    x = torch.randn(batch, *input_shape, dtype=torch.float64)
    reference = _eval_forward(model, x)
    out = cm.forward(x.numpy(), backend=backend)
    out = np.asarray(out.cpu() if hasattr(out, "cpu") else out)
    err = np.abs(out - reference).max() / max(np.abs(reference).max(), 1e-300)
    assert err <= tol, f"relative error {err:.3g}\n{cm.graph}"
    return cm


def _eval_forward(model, x):
    """The model's own forward in float64 eval mode, without changing the model."""
    import copy

    twin = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        return twin(x).numpy()


class Residual(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return torch.relu_(out)


class Branches(nn.Module):
    """cat, chunk, channel shuffle, functional pools, view(x.size(0), -1)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(4, 6, 1)
        self.b = nn.Conv2d(4, 2, 3, padding=1)
        self.fc = nn.Linear(8 * 2 * 2, 3)

    def forward(self, x):
        y = torch.cat([F.relu(self.a(x)), F.relu(self.b(x))], dim=1)
        n, c, h, w = y.size()
        y = y.view(n, 2, c // 2, h, w).transpose(1, 2).contiguous().view(n, c, h, w)
        left, right = y.chunk(2, dim=1)
        y = torch.cat((left, F.max_pool2d(right, 3, 1, 1)), 1)
        y = F.adaptive_avg_pool2d(y, (2, 2))
        return self.fc(y.view(y.size(0), -1))


class SharedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(5, 5)
        self.out = nn.Linear(5, 2)

    def forward(self, x):
        return self.out(self.inner(torch.relu(self.inner(x))).relu())


CASES = {
    "mlp": (lambda: nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3)), (6,)),
    "mlp_bn1d": (lambda: nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(inplace=True), nn.Linear(8, 3)), (6,)),
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(2, 4, 3, stride=2, padding=1), nn.ReLU(), nn.MaxPool1d(2, ceil_mode=True),
                                     nn.Conv1d(4, 4, 2, dilation=2), nn.Flatten(), nn.Linear(4, 2)), (2, 11)),
    "cnn_bn_pool": (lambda: nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                                          nn.MaxPool2d(3, 2, padding=1, dilation=1, ceil_mode=True),
                                          nn.Conv2d(6, 6, 3, groups=3), nn.ReLU(), nn.Identity(),
                                          nn.AvgPool2d(2, ceil_mode=True, count_include_pad=False),
                                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 4)), (3, 13, 13)),
    "depthwise_dilated": (lambda: nn.Sequential(nn.Conv2d(4, 4, 3, groups=4, dilation=2, padding=2, stride=2),
                                                nn.ReLU(), nn.MaxPool2d(2, dilation=2), nn.Flatten(),
                                                nn.Linear(4 * 2 * 2, 2)), (4, 10, 10)),
    "avgpool_padded": (lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.AvgPool2d(3, 2, padding=1, ceil_mode=True),
                                             nn.AvgPool2d(2, divisor_override=3), nn.Flatten(), nn.Linear(3 * 2 * 2, 2)), (2, 10, 10)),
    "adaptive_uneven": (lambda: nn.Sequential(nn.Conv2d(2, 3, 2), nn.ReLU(), nn.AdaptiveAvgPool2d((3, 2)), nn.Flatten(),
                                              nn.Linear(18, 2)), (2, 8, 6)),
    "residual": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), Residual(4), Residual(4),
                                       nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)), (3, 6, 6)),
    "branches": (Branches, (4, 4, 4)),
    "shared_module": (SharedTwice, (5,)),
    "conv_same_padding": (lambda: nn.Sequential(nn.Conv2d(2, 3, 4, padding="same"), nn.ReLU(), nn.Flatten(),
                                                nn.Linear(3 * 5 * 5, 2)), (2, 5, 5)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_matches_model(case):
    factory, shape = CASES[case]
    assert_same_function(factory(), shape)


def test_batchnorm_folded_into_conv():
    cm = assert_same_function(CASES["cnn_bn_pool"][0](), CASES["cnn_bn_pool"][1])
    kinds = [e.map.kind for n in cm.graph for e in n.edges]
    assert MapKind.SCALE not in kinds
    first = cm.graph.nodes[1]
    assert first.kind is NodeKind.RELU and first.edges[0].map.kind is MapKind.CONV


def test_shared_module_shares_one_param():
    cm = pathir.compile(SharedTwice(), input_shape=(5,))
    names = [e.map.weight.name for n in cm.graph for e in n.edges]
    assert names.count("inner.weight") == 2
    assert len({id(p) for p in cm.graph.params()}) == len(cm.graph.params())
    assert sum(p.name == "inner.weight" for p in cm.graph.params()) == 1


def test_source_bindings_after_folding():
    cm = pathir.compile(_randomize_bn(CASES["mlp_bn1d"][0]()), input_shape=(6,))
    w = cm.graph.nodes[1].edges[0].map.W
    roles = {(r.name, r.role.value) for r in w.sources}
    assert roles == {("0.weight", "value"), ("1.weight", "out_scale"), ("1.bias", "out_scale")}
    assert w.source_name == "0.weight"
    assert cm.graph.nodes[1].bias.source_name == "1.bias"


def test_model_untouched_and_mode_kept():
    model = _randomize_bn(CASES["cnn_bn_pool"][0]()).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pathir.compile(model, input_shape=(3, 13, 13))
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class ShapeBranch(nn.Module):
    """Python control flow on a shape: torch.fx cannot trace it, torch.export can."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 3 * 3, 2)

    def forward(self, x):
        if x.shape[-1] > 5:
            x = torch.relu(self.bn(self.conv(x)))
        x = F.max_pool2d(x, 2, ceil_mode=True)
        return self.fc(torch.flatten(torch.cat([x, x], 1)[:, :4], 1))


def test_torch_export_fallback():
    with pytest.raises(Exception):
        torch.fx.symbolic_trace(ShapeBranch())
    assert_same_function(ShapeBranch(), (3, 8, 8))


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * torch.sigmoid(x)


@pytest.mark.parametrize(
    "model, op, where, words",
    [
        (nn.Sequential(nn.Linear(3, 3), nn.Hardtanh(-1.0, 1.0)), "Hardtanh", "1", "clips"),
        (nn.Sequential(nn.Linear(3, 3), nn.GELU()), "GELU", "1", "homogeneous"),
        (nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)), "LayerNorm", "1", "statistics"),
        (Gated(), "sigmoid", "", "homogeneous"),
    ],
)
def test_unsupported_names_node_op_and_module(model, op, where, words):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(pathir.UnsupportedOperation) as info:
        pathir.compile(model, input_shape=(3,) if op != "sigmoid" else (4,))
    err = info.value
    assert err.op == op and err.where == where and words in str(err)
    assert err.node in str(err)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_constant_bias_rejected():
    class AddOne(nn.Module):
        def forward(self, x):
            return torch.relu(x + 1.0)

    with pytest.raises(pathir.UnsupportedOperation, match="constant"):
        pathir.compile(nn.Sequential(nn.Linear(2, 2), AddOne()), input_shape=(2,))


def test_needs_an_input_shape():
    with pytest.raises(pathir.PathirError, match="input_shape"):
        pathir.compile(nn.Linear(2, 2))


def test_example_input_gives_the_shape():
    cm = pathir.compile(nn.Sequential(nn.Linear(3, 2)), example_input=torch.zeros(7, 3))
    assert cm.graph.node(cm.graph.inputs[0]).shape == (3,)


def test_linear_on_an_unflattened_tensor_acts_on_its_last_axis_as_torch_does():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 1), nn.ReLU(), nn.Linear(3, 2)).double().eval()
    cm = pathir.compile(model, input_shape=(1, 3, 3))
    x = torch.randn(4, 1, 3, 3, dtype=torch.float64)
    np.testing.assert_allclose(cm.forward(x.numpy(), backend="numpy"), model(x).detach().numpy(), rtol=1e-12, atol=1e-14)


class UsedTwice(nn.Module):
    """A pending value (conv + bn) read by two ops must become one node."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 1)
        self.bn = nn.BatchNorm2d(3)
        self.head = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        y = self.bn(self.conv(x))
        return self.head(torch.relu(y)) + y


def test_a_value_used_twice_is_one_node():
    cm = assert_same_function(UsedTwice(), (2, 4, 4))
    assert sum(e.map.weight is not None and e.map.weight.name == "conv.weight" for n in cm.graph for e in n.edges) == 1
    assert [n.name for n in cm.graph] == ["x", "bn", "relu", "add"]  # conv+bn once, read by relu and add


def test_a_node_returned_twice_is_two_outputs_of_forward_in_the_models_order():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 2)

        def forward(self, x):
            h = self.a(x)
            return h, h

    torch.manual_seed(0)
    net = TwoHeads().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    out = pathir.compile(net, input_shape=(3,)).forward(x.numpy())
    want = net(x)
    assert isinstance(out, tuple) and len(out) == 2
    for got, ref in zip(out, want):
        np.testing.assert_allclose(got, ref.detach().numpy(), rtol=1e-12, atol=1e-12)


class _VarArgs(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how, self.a, self.b, self.c = how, nn.Linear(3, 4), nn.Linear(2, 4), nn.Linear(4, 2)

    def forward(self, *xs):
        if self.how == "first":
            return self.c(F.relu(self.a(xs[0])))
        if self.how == "unpack":
            (x,) = xs
            return self.c(F.relu(self.a(x)))
        x, y = xs
        return self.c(F.relu(self.a(x) + self.b(y)))


@pytest.mark.parametrize("how, shapes", [("first", (3,)), ("unpack", (3,)), ("two", [(3,), (2,)])])
def test_a_forward_of_varargs_takes_its_inputs_as_a_tuple(how, shapes):
    torch.manual_seed(0)
    net = _VarArgs(how).double()
    cm = pathir.compile(net, input_shape=shapes)
    shapes = [shapes] if how != "two" else shapes
    xs = [torch.randn(5, *s, dtype=torch.float64) for s in shapes]
    out = cm.forward(xs[0].numpy() if len(xs) == 1 else dict(zip(cm.graph.inputs, (x.numpy() for x in xs))))
    np.testing.assert_allclose(out, net(*xs).detach().numpy(), rtol=1e-12, atol=1e-12)


def test_a_gather_by_an_index_expanded_from_a_buffer_is_refused_by_name():
    class Gathered(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.c = nn.Linear(3, 4), nn.Linear(3, 2)
            self.register_buffer("idx", torch.tensor([[3, 0, 3]]))

        def forward(self, x):
            return self.c(torch.gather(F.relu(self.a(x)), 1, self.idx.expand(x.shape[0], 3)))

    with pytest.raises(pathir.UnsupportedOperation, match="gather"):  # was an internal IndexError at expand
        pathir.compile(Gathered(), input_shape=(3,))


class _BufferIndexed(nn.Module):
    """An index and a mask buffer moved by an op of their own; the shape branch sends it through torch.export."""

    def __init__(self, how):
        super().__init__()
        self.how, self.a, self.c = how, nn.Linear(3, 4), nn.Linear(4, 2)
        self.register_buffer("ib", torch.tensor([3, 0, 1, 2]))
        self.register_buffer("mb", torch.tensor([True, False, True, True]))

    def forward(self, x):
        if x.shape[1] != 3:  # Python control flow on a shape: torch.fx cannot trace it
            raise ValueError("expects 3 features")
        h = F.relu(self.a(x))
        return self.c(h[:, self.ib.flip(0)] if self.how == "index" else h.masked_fill(self.mb.flip(0), 0.0))


@pytest.mark.parametrize("how", ["index", "mask"])
def test_an_integer_buffer_moved_by_its_own_op_is_a_constant_on_the_export_path_and_followed(how):
    torch.manual_seed(0)
    net = _BufferIndexed(how).double().eval()
    cm = pathir.compile(net, input_shape=(3,))
    x = torch.randn(5, 3, dtype=torch.float64)
    np.testing.assert_allclose(cm.forward(x.numpy()), net(x).detach().numpy(), rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # the live Compiled follows an edit of the buffer
        net.ib.copy_(torch.tensor([1, 2, 3, 0]))
        net.mb.copy_(torch.tensor([False, True, False, True]))
    np.testing.assert_allclose(cm.forward(x.numpy()), net(x).detach().numpy(), rtol=1e-12, atol=1e-12)


class _FactorBuffer(nn.Module):
    """A float buffer moved by an op of its own, then a per-channel factor; ``export``: the shape branch
    sends it through torch.export (where the buffer is a lifted input, not fx's folded constant)."""

    def __init__(self, export):
        super().__init__()
        self.export, self.a, self.c = export, nn.Linear(3, 4), nn.Linear(4, 2)
        self.register_buffer("fb", torch.tensor([0.5, 2.0, 1.5, 3.0]))

    def forward(self, x):
        if self.export and x.shape[1] != 3:
            raise ValueError("expects 3 features")
        return self.c(F.relu(self.a(x)) * self.fb.flip(0))


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
def test_a_float_buffer_moved_by_its_own_op_is_a_fixed_factor_on_both_paths(export):
    """Both paths compute it as the fixed factor it is (the export path refused it as a parameter moved into
    the activations); the path-norm is the definition's (the factor |fb| on each hidden unit's paths); an
    edit of the buffer changes the structure, which the live Compiled reports."""
    torch.manual_seed(0)
    net = _FactorBuffer(export).double().eval()
    cm = pathir.compile(net, input_shape=(3,))
    x = torch.randn(5, 3, dtype=torch.float64)
    np.testing.assert_allclose(cm.forward(x.numpy()), net(x).detach().numpy(), rtol=1e-12, atol=1e-12)
    a, c, f = net.a.weight.detach().abs(), net.c.weight.detach().abs(), net.fb.flip(0)
    ones = torch.ones(3, dtype=torch.float64)
    expected = float((c @ (f * (a @ ones + net.a.bias.detach().abs()))).sum() + net.c.bias.detach().abs().sum())
    assert cm.path_norm(1) == pytest.approx(expected, rel=1e-12)
    with torch.no_grad():
        net.fb.mul_(2.0)
    with pytest.raises(pathir.ModelChanged):
        cm.forward(x.numpy())


def test_an_input_the_forward_never_uses_is_refused_by_name():
    """It failed the graph's own verification ("node 'y' does not reach any output"), an internal-looking error."""

    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 2)

        def forward(self, x, y):
            return self.a(x) if y.shape[-1] == 4 else self.a(x)

    with pytest.raises(pathir.UnsupportedOperation, match=r"node 'y'.*input\(s\) 'y' reach no output"):
        pathir.compile(Unused(), input_shape=[(3,), (4,)])
