"""Built-in passes: structure after, whether anything changed, numeric equivalence."""

import numpy as np
import pytest
import torch.nn as nn
from hypothesis import given, settings

import pathir
from pathir.backends.numpy import NumpyBackend
from pathir.ir import Conv, GraphBuilder, Identity, MapKind, NodeKind, Param, Role, Scale, SourceRef
from pathir.lifting.walk import forward
from pathir.neurons.paths import enumerate_num_paths, enumerate_path_norm
from pathir.passes import PASSES, fold_batchnorm, maxpool_to_sum, path_view, run_passes
from pathir.testing import relu_dags

BE = NumpyBackend()
rng = np.random.default_rng(0)


def conv_bn_graph(with_conv_bias=True, extra_consumer=False):
    """conv -> (identity node) -> Scale (bn) -> relu; optionally the conv node read twice."""
    b = GraphBuilder("cbr")
    x = b.input("x", (2, 5))
    conv_bias = b.param("conv.bias", rng.normal(size=3)) if with_conv_bias else None
    c = b.identity("conv", [(x, Conv(b.param("conv.weight", rng.normal(size=(3, 2, 3))), (1,), ((1, 1),), (1,)))],
                   bias=conv_bias)
    out = (SourceRef("bn.weight", Role.OUT_SCALE), SourceRef("bn.bias", Role.OUT_SCALE))
    s = Param("bn.weight", rng.uniform(0.5, 2, size=3), (SourceRef("bn.weight"),) + out)
    shift = Param("bn.bias", rng.normal(size=3), (SourceRef("bn.bias"),) + out)
    r = b.relu("relu", [(c, Scale(s))], bias=shift)
    outputs = [r]
    if extra_consumer:
        outputs.append(b.identity("side", [(c, Identity())]))
    return b.build(outputs)


@pytest.mark.parametrize("with_conv_bias", [True, False])
def test_fold_batchnorm_folds_and_preserves_the_function(with_conv_bias):
    g = conv_bn_graph(with_conv_bias)
    folded = fold_batchnorm(g)
    assert [n.name for n in folded] == ["x", "relu"]
    edge = folded.node("relu").edges[0]
    assert edge.source == "x" and edge.map.kind is MapKind.CONV
    roles = {(r.name, r.role) for r in edge.map.W.sources}
    assert ("bn.weight", Role.OUT_SCALE) in roles and ("conv.weight", Role.VALUE) in roles
    x = rng.normal(size=(4, 2, 5))
    np.testing.assert_allclose(forward(folded, BE, x)["relu"], forward(g, BE, x)["relu"], rtol=1e-12, atol=1e-12)
    assert len(g) == 3  # the input graph is untouched


def _read_only(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)  # a Param takes a float64 array read-only down to its owner as it is, without a copy
    return a


def conv_bn_graph_over(conv_weight: np.ndarray, conv_bias: np.ndarray) -> "pathir.ir.Graph":
    """conv_bn_graph with the conv's weight and bias given (read-only: the Params hold these very arrays)."""
    b = GraphBuilder("cbr")
    x = b.input("x", (2, 5))
    c = b.identity("conv", [(x, Conv(b.param("conv.weight", conv_weight), (1,), ((1, 1),), (1,)))],
                   bias=b.param("conv.bias", conv_bias))
    out = (SourceRef("bn.weight", Role.OUT_SCALE), SourceRef("bn.bias", Role.OUT_SCALE))
    s = Param("bn.weight", np.array([0.5, 2.0, -1.5]), (SourceRef("bn.weight"),) + out)
    r = b.relu("relu", [(c, Scale(s))], bias=Param("bn.bias", np.array([0.1, -0.2, 0.3]), (SourceRef("bn.bias"),) + out))
    return b.build([r])


def test_fold_batchnorm_in_place_scales_a_weight_in_its_own_memory():
    w = _read_only(rng.normal(size=(3, 2, 3)))
    g, twin = conv_bn_graph_over(w, _read_only(rng.normal(size=3))), conv_bn_graph_over(w.copy(), rng.normal(size=3))
    x = rng.normal(size=(4, 2, 5))
    expected = forward(g, BE, x)["relu"]
    copied, folded = fold_batchnorm(twin), fold_batchnorm(g, in_place=True)
    W = folded.node("relu").edges[0].map.W.value
    assert np.shares_memory(W, w) and not W.flags.writeable  # no new array, and read-only again
    np.testing.assert_array_equal(W, copied.node("relu").edges[0].map.W.value)  # the same rounding as a copy
    np.testing.assert_allclose(forward(folded, BE, x)["relu"], expected, rtol=1e-12, atol=1e-12)


def test_fold_batchnorm_in_place_copies_a_weight_whose_memory_another_param_reaches():
    block = _read_only(rng.normal(size=3 * 2 * 3 + 3))
    before = block.copy()
    w, bias = block[:18].reshape(3, 2, 3), block[18:]  # two params over one read-only array, taken as they are
    assert not w.flags.writeable and not bias.flags.writeable
    g = conv_bn_graph_over(w, bias)
    x = rng.normal(size=(4, 2, 5))
    expected = forward(g, BE, x)["relu"]
    folded = fold_batchnorm(g, in_place=True)
    np.testing.assert_array_equal(block, before)  # neither param's memory was written
    assert not np.shares_memory(folded.node("relu").edges[0].map.W.value, block)
    np.testing.assert_allclose(forward(folded, BE, x)["relu"], expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(forward(g, BE, x)["relu"], expected, rtol=0, atol=0)  # the input graph still computes it


def test_fold_batchnorm_in_place_copies_a_weight_over_read_only_memory():
    w = np.frombuffer(rng.normal(size=18).tobytes()).reshape(3, 2, 3)  # its root is immutable bytes
    g = conv_bn_graph_over(w, _read_only(rng.normal(size=3)))
    x = rng.normal(size=(4, 2, 5))
    folded = fold_batchnorm(g, in_place=True)
    assert not np.shares_memory(folded.node("relu").edges[0].map.W.value, w)
    np.testing.assert_allclose(forward(folded, BE, x)["relu"], forward(g, BE, x)["relu"], rtol=1e-12, atol=1e-12)


def test_compile_folds_a_torch_models_batch_norms_as_a_copy_would():
    """compile hands the fresh lowering's raw graph to fold_batchnorm(in_place=True): the same values."""
    net = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 3, 1), nn.BatchNorm2d(3)).eval()
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_var.uniform_(0.5, 2)
            m.weight.data.normal_()
    from pathir.frontends.torch.lower import lower
    from pathir.passes import DEFAULT_PIPELINE
    by_copy = run_passes(lower(net, input_shape=(2, 6, 6)).graph, DEFAULT_PIPELINE)
    cm = pathir.compile(net, input_shape=(2, 6, 6))
    for p, q in zip(cm.graph.params(), by_copy.params(), strict=True):
        assert p.name == q.name and np.array_equal(p.value, q.value)


def test_fold_batchnorm_leaves_a_shared_node_alone():
    g = conv_bn_graph(extra_consumer=True)
    folded = fold_batchnorm(g)
    assert [n.name for n in folded] == [n.name for n in g]
    assert folded.node("relu").edges[0].map.kind is MapKind.SCALE


def test_fold_batchnorm_on_torch_models_removes_every_scale():
    net = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2), nn.BatchNorm1d(2))
    for m in net.modules():
        if isinstance(m, nn.BatchNorm1d):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2)
    cm = pathir.compile(net, input_shape=(4,))
    assert all(e.map.kind is not MapKind.SCALE for n in cm.graph for e in n.edges)
    assert len(cm.graph) == 3


@pytest.mark.parametrize("second_bias", [True, False])
def test_a_batch_norm_after_a_sum_of_layers_is_kept_with_or_without_their_biases(second_bias):
    """bn(a(x) + b(x)) with b without bias was one node (at most one bias: the sum merges) into which the
    batch-norm folded, merging the bias paths; with two biases it was kept. Now kept either way: the path-norms
    of the documented graph (a's and b's biases through γ/σ, the batch-norm's own bias β − μγ/σ), by hand."""
    import torch

    torch.manual_seed(0)
    a, b, bn = nn.Linear(2, 2).double(), nn.Linear(2, 2, bias=second_bias).double(), nn.BatchNorm1d(2).double()
    with torch.no_grad():
        bn.running_mean.copy_(torch.tensor([1.0, -2.0]))
        bn.running_var.copy_(torch.tensor([0.5, 2.0]))
        bn.weight.copy_(torch.tensor([1.5, -0.7]))
        bn.bias.copy_(torch.tensor([-0.3, 0.8]))

    class Sum(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.bn = a, b, bn

        def forward(self, x):
            return self.bn(self.a(x) + self.b(x))

    cm = pathir.compile(Sum().eval(), input_shape=(2,))
    s = (bn.weight / torch.sqrt(bn.running_var + bn.eps)).detach()
    shift = (bn.bias - bn.running_mean * s).detach()
    b_bias = b.bias.detach() if second_bias else torch.zeros(2, dtype=torch.float64)
    for q in (1, 2):
        weights = ((s.abs() ** q)[:, None] * (a.weight.detach().abs() ** q + b.weight.detach().abs() ** q)).sum()
        biases = (s.abs() ** q * (a.bias.detach().abs() ** q + b_bias.abs() ** q)).sum() + (shift.abs() ** q).sum()
        assert cm.path_norm(q) == pytest.approx(float(weights + biases) ** (1 / q), rel=1e-12)


@settings(max_examples=40)
@given(relu_dags())
def test_maxpool_to_sum_keeps_paths(graph):
    summed = maxpool_to_sum(graph)
    assert all(n.kind is not NodeKind.MAXPOOL for n in summed)
    assert [n.name for n in summed] == [n.name for n in graph]
    assert enumerate_num_paths(summed) == enumerate_num_paths(graph)


@settings(max_examples=40)
@given(relu_dags())
def test_path_view_is_the_path_norm_network(graph):
    view = path_view(maxpool_to_sum(graph), 2.0)
    assert all(n.kind in (NodeKind.INPUT, NodeKind.IDENTITY) for n in view)
    assert all((p.value >= 0).all() for p in view.params())
    ones = {name: np.ones((1, *view.node(name).shape)) for name in view.inputs}
    total = sum(forward(view, BE, ones)[o].sum() for o in view.outputs)
    np.testing.assert_allclose(total, enumerate_path_norm(graph, 2.0) ** 2, rtol=1e-10)


def test_path_view_refuses_maxpool_and_negative_q():
    with pytest.raises(ValueError):
        path_view(conv_bn_graph(), -1)
    from test_ir import small_graph

    with pytest.raises(pathir.PathirError, match="run maxpool_to_sum first"):
        path_view(small_graph(), 1)


def test_pass_manager_names_the_failing_pass():
    def break_shapes(graph):
        n = graph.nodes[-1]
        from dataclasses import replace

        return graph.replace_nodes([*graph.nodes[:-1], replace(n, shape=(99,))])

    g = conv_bn_graph()
    with pytest.raises(pathir.GraphVerificationError, match=r"in pass 'break_shapes' after \['fold_batchnorm'\]"):
        run_passes(g, [fold_batchnorm, break_shapes])
    with pytest.raises(TypeError, match="returned int"):
        run_passes(g, [lambda graph: 3])
    assert set(PASSES) >= {"fold_batchnorm", "maxpool_to_sum", "path_view"}


def test_compile_runs_user_passes_after_the_default_pipeline():
    seen = []

    def spy(graph):
        seen.append([n.name for n in graph])
        return graph

    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.Linear(3, 1))
    pathir.compile(net, input_shape=(3,), passes=[spy])
    assert len(seen) == 1 and len(seen[0]) == 3  # batch-norm already folded
