"""pathir.testing: the random graphs are valid, small, switchable, and cover every feature."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import pathir
from pathir.backends.numpy import NumpyBackend
from pathir.ir import MapKind, NodeKind
from pathir.lifting.walk import forward
from pathir.neurons.expand import expand
from pathir.neurons.paths import count_paths
from pathir.testing import mlps, random_inputs, relu_dags


def features(graph) -> set[str]:
    """Names of the structures a graph shows (what relu_dags promises to draw)."""
    out = set()
    for n in graph.nodes:
        kinds = [e.map.kind for e in n.edges]
        out.update(f"map:{k.value}" for k in kinds)
        out.add(f"node:{n.kind.value}")
        if n.bias is not None:
            out.add("bias")
        if len(n.edges) > 1:
            out.add("several in-edges")
        if len({e.source for e in n.edges}) < len(n.edges):
            out.add("parallel edges")
        if kinds.count(MapKind.CHANNEL_MAP) >= 2:
            out.add("concat")
        for e in n.edges:
            m = e.map
            if m.kind is MapKind.CONV:
                out.add(f"conv{len(m.stride)}d")
                out.update(name for name, on in [
                    ("conv stride", any(s > 1 for s in m.stride)), ("conv padding", any(p != (0, 0) for p in m.padding)),
                    ("conv dilation", any(d > 1 for d in m.dilation)), ("conv groups", m.groups > 1),
                ] if on)
            if m.kind is MapKind.POOL:
                kind = "maxpool" if n.kind is NodeKind.MAXPOOL else "avgpool"
                out.update(f"{kind} {name}" for name, on in [
                    ("padding", any(p != (0, 0) for p in m.padding)), ("ceil_mode", m.ceil_mode),
                    ("stride", any(s > 1 for s in m.stride)), ("dilation", any(d > 1 for d in m.dilation)),
                ] if on)
                if m.mult is not None and len(np.unique(m.mult)) > 1:
                    out.add("avgpool without padded positions")
            if m.kind is MapKind.CHANNEL_MAP and -1 in m.index:
                out.add("zero channel")
        if n.kind is NodeKind.MAXPOOL:
            out.add("k-max-pool" if n.k > 1 else "max-pool")
    if len(graph.outputs) > 1:
        out.add("several outputs")
    if len(graph.inputs) > 1:
        out.add("several inputs")
    used = [e.map.weight for n in graph.nodes for e in n.edges if e.map.weight is not None]
    biases = [n.bias for n in graph.nodes if n.bias is not None]
    if len({id(p) for p in used}) < len(used):
        out.add("shared weight")
    if len({id(p) for p in biases}) < len(biases):
        out.add("shared bias")
    return out


EVERY_FEATURE = {
    *(f"map:{k.value}" for k in MapKind),
    *(f"node:{k.value}" for k in NodeKind),
    "bias", "several in-edges", "parallel edges", "concat", "zero channel",
    "conv1d", "conv2d", "conv stride", "conv padding", "conv dilation", "conv groups",
    "maxpool padding", "maxpool ceil_mode", "maxpool stride", "avgpool padding", "avgpool without padded positions",
    "max-pool", "k-max-pool", "several outputs", "several inputs", "shared weight", "shared bias",
}


def test_relu_dags_cover_every_feature():
    seen: set[str] = set()

    @settings(max_examples=400)
    @given(graph=relu_dags())
    def collect(graph):
        seen.update(features(graph))

    collect()
    assert EVERY_FEATURE - seen == set()


@settings(max_examples=100)
@given(graph=relu_dags())
def test_relu_dags_are_valid_and_small(graph):
    pathir.verify(graph)
    assert graph.outputs and all(graph.node(o).kind is not NodeKind.INPUT for o in graph.outputs)
    assert not any(graph.consumers[o] for o in graph.outputs)  # the outputs are the sinks
    assert sum(n.numel for n in graph.nodes) <= 200 + 2 + 100  # head: flatten + 2 outputs beyond the budget
    assert count_paths(expand(graph)) <= 3000
    for n in graph.nodes:
        if n.kind is NodeKind.MAXPOOL:  # every window holds at least k neurons
            net = expand(graph)
            assert min(net.in_degree((n.name, j)) for j in range(n.numel)) >= n.k


@settings(max_examples=60)
@given(graph=relu_dags(max_paths=100, max_neurons=40))
def test_budgets_bound_the_graphs(graph):
    assert count_paths(expand(graph)) <= 100


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([30, 40, 60, 90]), st.sampled_from([10, 20, 200]), st.data())
def test_small_budgets_bound_the_input_and_its_head_too(max_paths, max_neurons, data):
    """A spatial input of up to 3 x 4 x 4 neurons and its forced head (a flatten, 1-2 outputs) were never
    counted: max_paths=30 drew 38 paths, max_paths=90 drew 96, max_neurons=10 drew 49 neurons. The input is
    drawn smaller where the budgets are small."""
    graph = data.draw(relu_dags(max_paths=max_paths, max_neurons=max_neurons))
    assert count_paths(expand(graph)) <= max_paths
    inputs = sum(graph.node(n).numel for n in graph.inputs)
    assert inputs <= max(max_neurons // 2, 4) + 3  # (a second, flat input of at most 3)


@settings(max_examples=60)
@given(graph=relu_dags(bias=False, skip=False, concat=False, maxpool=False, avgpool=False, gather=False))
def test_switched_off_features_are_absent(graph):
    f = features(graph)
    assert not f & {"bias", "concat", "node:maxpool", "map:pool", "map:gather", "map:identity"}


@settings(max_examples=60)
@given(graph=relu_dags(bias=True, spatial_dims=(0,)))
def test_bias_everywhere_and_flat_inputs(graph):
    assert all(n.bias is not None for n in graph.nodes if n.kind is not NodeKind.INPUT and any(e.map.weight is not None for e in n.edges))
    assert len(graph.node("x").shape) == 1


@settings(max_examples=60)
@given(graph=relu_dags(integer_weights=True))
def test_integer_weights_are_nonzero_integers(graph):
    for p in graph.params():
        assert np.all(p.value == np.round(p.value)) and np.all(p.value != 0) and np.all(np.abs(p.value) <= 3)


@settings(max_examples=60)
@given(graph=relu_dags())
def test_float_weights_stay_away_from_zero(graph):
    for p in graph.params():
        assert np.all(np.abs(p.value) >= 0.3)


@settings(max_examples=30)
@given(graph=mlps(widths=(3, 4, 2), bias=True))
def test_mlps_with_given_widths(graph):
    assert [n.shape for n in graph.nodes] == [(3,), (4,), (2,)]
    assert [n.kind for n in graph.nodes] == [NodeKind.INPUT, NodeKind.RELU, NodeKind.IDENTITY]
    assert [p.name for p in graph.params()] == ["w1", "b1", "w2", "b2"]
    assert graph.outputs == ("out",)


@settings(max_examples=30)
@given(graph=mlps(bias=False, max_depth=3, max_width=5))
def test_drawn_mlps(graph):
    assert 2 <= len(graph.nodes) <= 4
    assert all(n.bias is None for n in graph.nodes)
    assert all(1 <= n.shape[0] <= 5 for n in graph.nodes)


@settings(max_examples=30)
@given(data=st.data(), graph=relu_dags())
def test_random_inputs_fit_the_graph(data, graph):
    x = data.draw(random_inputs(graph, batch=2))
    assert set(x) == set(graph.inputs)
    for name, value in x.items():
        assert value.shape == (2, *graph.node(name).shape) and value.dtype == np.float64
    xi = data.draw(random_inputs(graph, integer=True))
    assert all(np.all(v == np.round(v)) and np.abs(v).max() <= 2 for v in xi.values())
    B = {v.shape[0] for v in xi.values()}
    assert len(B) == 1 and 1 <= B.pop() <= 3
    out = forward(graph, NumpyBackend(), x)
    assert all(np.isfinite(v).all() and v.shape[0] == 2 for v in out.values())
