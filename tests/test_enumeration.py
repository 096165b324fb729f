"""The neuron-level expansion and exhaustive path enumeration (the definition itself)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pathir
from pathir.backends.numpy import NumpyBackend
from pathir.ir import Dense, GraphBuilder, Identity, NodeKind, Pool, Reshape
from pathir.lifting.walk import forward
from pathir.neurons.expand import antecedents, expand
from pathir.neurons.paths import (
    activations,
    count_paths,
    enumerate_num_paths,
    enumerate_paths,
    input_incidence,
    lifted_output,
    neuron_forward,
    phi,
    starts,
)
from pathir.testing import random_inputs, relu_dags

NP = NumpyBackend()


def _basis(shape, j):
    e = np.zeros((1, math.prod(shape)))
    e[0, j] = 1.0
    return e.reshape(1, *shape)


# -------------------------------------------------------------- expansion


@settings(max_examples=60)
@given(graph=relu_dags())
def test_expansion_neurons_and_edges_follow_the_backend(graph):
    net = expand(graph)
    assert net.number_of_nodes() == sum(n.numel for n in graph.nodes)
    assert list(net.nodes) == [(n.name, j) for n in graph.nodes for j in range(n.numel)]
    for node in graph.nodes:
        d = net.nodes[(node.name, 0)]
        assert d["kind"] is node.kind and d["is_input"] == (node.kind is NodeKind.INPUT)
        assert d["is_output"] == (node.name in graph.outputs)
        last = net.nodes[(node.name, node.numel - 1)]["bias"]
        assert (last is None) == (node.bias is None)
        if node.bias is not None:
            assert last == (node.bias.name, node.channels - 1, float(node.bias.value[-1]))
    # every neuron edge, checked one by one against the rules it was not built from:
    # a free weight's entry is where weight_grad(e_source, e_target) puts its 1
    for u, v, key, d in net.edges(keys=True, data=True):
        src, tgt = graph.node(u[0]), graph.node(v[0])
        m = tgt.edges[key].map
        assert tgt.edges[key].source == u[0] and d["map"] is m.kind
        if m.weight is None:
            assert d["param"] is None
            assert NP.apply(m, _basis(src.shape, u[1]), src.shape).reshape(-1)[v[1]] == d["weight"]
        else:
            grad = NP.weight_grad(m, _basis(src.shape, u[1]), _basis(tgt.shape, v[1]), src.shape).reshape(-1)
            assert np.flatnonzero(grad).tolist() == [d["param"][1]] and grad[d["param"][1]] == 1.0
            assert d["param"][0] == m.weight.name and d["weight"] == m.weight.value.reshape(-1)[d["param"][1]]


@settings(max_examples=60)
@given(data=st.data(), graph=relu_dags())
def test_neuron_forward_equals_the_graph_forward_at_every_node(data, graph):
    x = data.draw(random_inputs(graph, batch=1))
    acts = forward(graph, NP, x, all_nodes=True)
    values = neuron_forward(expand(graph), {k: v[0] for k, v in x.items()})
    for node in graph.nodes:
        got = np.array([values.out[(node.name, j)] for j in range(node.numel)])
        np.testing.assert_allclose(got, acts[node.name].reshape(-1), rtol=1e-10, atol=1e-10)


def test_maxpool_antecedents_are_the_in_input_window_positions_in_order():
    b = GraphBuilder()
    x = b.input("x", (1, 5))
    # kernel 3, stride 2, padding (1, 1), ceil_mode: windows [-1..1], [1..3], [3..5]
    p = b.maxpool("p", x, Pool((3,), (2,), ((1, 1),), (1,), True), k=1)
    net = expand(b.build(outputs=[p]))
    windows = [[u for u, _, _ in antecedents(net, ("p", t))] for t in range(3)]
    assert windows == [[("x", 0), ("x", 1)], [("x", 1), ("x", 2), ("x", 3)], [("x", 3), ("x", 4)]]
    for t in range(3):
        assert [u for u, _ in net.in_edges(("p", t))] == windows[t]  # insertion order is the same
        assert all(d["weight"] == 1.0 and d["param"] is None for _, _, d in net.in_edges(("p", t), data=True))
        assert net.nodes[("p", t)]["kind"] is NodeKind.MAXPOOL


def test_two_dimensional_window_order_is_c_order():
    b = GraphBuilder()
    x = b.input("x", (1, 3, 3))
    p = b.maxpool("p", x, Pool((2, 2), (1, 1), ((0, 0), (0, 0)), (1, 1)), k=2)
    net = expand(b.build(outputs=[p]))
    assert [u[1] for u, _, _ in antecedents(net, ("p", 3))] == [4, 5, 7, 8]
    assert net.nodes[("p", 3)]["k"] == 2


def test_parallel_edges_are_distinct_paths():
    b = GraphBuilder()
    x = b.input("x", (2,))
    h = b.relu("h", [(x, Dense(b.param("w", [[2.0, 0.5], [3.0, 4.0]]))), (x, Identity())])
    graph = b.build(outputs=[h])
    net = expand(graph)
    assert net.number_of_edges(("x", 0), ("h", 0)) == 2
    assert net.edges[("x", 0), ("h", 0), 0]["param"] == ("w", 0)
    assert net.edges[("x", 0), ("h", 0), 1]["param"] is None
    paths = enumerate_paths(net)
    assert len(paths) == 6
    assert sorted(phi(net, paths)) == [0.5, 1.0, 1.0, 2.0, 3.0, 4.0]


def test_a_neuron_without_bias_starts_no_path_a_zero_bias_does():
    b = GraphBuilder()
    x = b.input("x", (1,))
    h = b.relu("h", [(x, Dense(b.param("w1", [[2.0], [3.0]])))], bias=b.param("b1", [0.0, 5.0]))
    y = b.identity("y", [(h, Dense(b.param("w2", [[7.0, 11.0]])))])
    net = expand(b.build(outputs=[y]))
    assert starts(net) == [("x", 0), ("h", 0), ("h", 1)]
    paths = enumerate_paths(net)
    assert [p.neurons for p in paths] == [
        (("x", 0), ("h", 0), ("y", 0)),
        (("x", 0), ("h", 1), ("y", 0)),
        (("h", 0), ("y", 0)),
        (("h", 1), ("y", 0)),
    ]
    assert phi(net, paths).tolist() == [14.0, 33.0, 0.0, 55.0]
    A, columns = input_incidence(net, paths)
    assert columns == [("x", 0), "1"]
    assert A.tolist() == [[1, 0], [1, 0], [0, 1], [0, 1]]


def test_an_output_bias_is_a_path_of_length_zero_and_paths_go_on_through_outputs():
    b = GraphBuilder()
    x = b.input("x", (1,))
    h = b.identity("h", [(x, Dense(b.param("w1", [[2.0]])))], bias=b.param("b1", [3.0]))
    y = b.identity("y", [(h, Dense(b.param("w2", [[5.0]])))], bias=b.param("b2", [7.0]))
    net = expand(b.build(outputs=[h, y]))
    got = {(p.neurons, v) for p, v in zip(enumerate_paths(net), phi(net, enumerate_paths(net)))}
    assert got == {
        ((("x", 0), ("h", 0)), 2.0),
        ((("x", 0), ("h", 0), ("y", 0)), 10.0),
        ((("h", 0),), 3.0),
        ((("h", 0), ("y", 0)), 15.0),
        ((("y", 0),), 7.0),
    }


@settings(max_examples=80)
@given(graph=relu_dags())
def test_enumeration_agrees_with_the_path_count_recursion_and_the_incidence(graph):
    net = expand(graph)
    paths = enumerate_paths(net)
    assert len(paths) == count_paths(net) == len(set(paths))
    A, columns = input_incidence(net, paths)
    assert columns == [v for v in net if net.nodes[v]["is_input"]] + ["1"]
    assert A.shape == (len(paths), sum(graph.node(i).numel for i in graph.inputs) + 1)
    assert (A.sum(axis=1) == 1).all()
    for p, row in zip(paths, A):
        assert net.nodes[p.end]["is_output"]
        assert net.nodes[p.start]["is_input"] or net.nodes[p.start]["bias"] is not None
        assert all(net.has_edge(u, v, key) for u, v, key in p.edges())
        assert (row[-1] == 1) == (not net.nodes[p.start]["is_input"])


def test_enumeration_refuses_too_many_paths():
    b = GraphBuilder("wide")
    prev = b.input("x", (30,))
    for i in range(3):
        prev = b.relu(f"h{i}", [(prev, Dense(b.param(f"w{i}", np.ones((30, 30)))))])
    graph = b.build(outputs=[prev])
    with pytest.raises(pathir.GraphTooLarge, match=r"810,000 paths, above the limit max_paths=200,000"):
        enumerate_num_paths(graph)
    small = _scalar_layers(4, 3)
    with pytest.raises(pathir.GraphTooLarge, match=r"has 256 paths, above the limit max_paths=255 "):
        enumerate_num_paths(small, max_paths=255)
    assert enumerate_num_paths(small, max_paths=256) == 256


def _scalar_layers(width, depth):
    b = GraphBuilder("layers")
    prev = b.input("x", (width,))
    for i in range(depth):
        prev = b.relu(f"h{i}", [(prev, Dense(b.param(f"w{i}", np.ones((width, width)))))])
    return b.build(outputs=[prev])


def test_expansion_refuses_too_many_neurons():
    b = GraphBuilder("big")
    x = b.input("x", (3, 100, 100))
    y = b.relu("y", [(x, Identity())])
    graph = b.build(outputs=[y])
    with pytest.raises(pathir.GraphTooLarge, match=r"graph 'big' has 60,000 neurons, above the limit max_neurons=20,000"):
        expand(graph)
    small = _scalar_layers(5, 2)
    with pytest.raises(pathir.GraphTooLarge, match=r"has 15 neurons, above the limit max_neurons=14 "):
        expand(small, max_neurons=14)
    assert expand(small, max_neurons=15).number_of_nodes() == 15


def test_expansion_refuses_too_many_edges():
    b = GraphBuilder("dense")
    x = b.input("x", (200,))
    y = b.identity("y", [(x, Dense(b.param("w", np.ones((100, 200)))))])
    graph = b.build(outputs=[y])
    with pytest.raises(pathir.GraphTooLarge, match=r"has 20,000 neuron edges, above the limit max_edges=10,000"):
        expand(graph, max_edges=10_000)
    assert expand(graph, max_edges=20_000).number_of_edges() == 20_000


# --------------------------------------------------------------- lifting


@settings(max_examples=150)
@given(data=st.data(), graph=relu_dags())
def test_lifting_identity_on_random_dags(data, graph):
    x = data.draw(random_inputs(graph))
    expected = forward(graph, NP, x)
    got = lifted_output(graph, x)
    for o in graph.outputs:
        scale = max(1.0, float(np.abs(expected[o]).max(initial=0)))
        np.testing.assert_allclose(got[o], expected[o], rtol=1e-9, atol=1e-9 * scale)


@settings(max_examples=150)
@given(data=st.data(), graph=relu_dags(integer_weights=True, avgpool=False, adaptive_pool=False))
def test_lifting_identity_is_exact_with_integers_and_max_pool_ties(data, graph):
    """Integer weights and inputs: both sides are exact in float64, ties at max-pools are common."""
    x = data.draw(random_inputs(graph, integer=True))
    expected = forward(graph, NP, x)
    got = lifted_output(graph, x)
    for o in graph.outputs:
        assert np.array_equal(got[o], expected[o])


def _tie_graph(k):
    """x[2] -> h = relu(diag(2, 3) x) -> reshape [1, 2] -> k-max-pool over both -> y = 5 * pool."""
    b = GraphBuilder()
    x = b.input("x", (2,))
    h = b.relu("h", [(x, Dense(b.param("w", [[2.0, 0.0], [0.0, 3.0]])))])
    r = b.identity("r", [(h, Reshape((1, 2)))])
    p = b.maxpool("p", r, Pool((2,), (1,), ((0, 0),), (1,)), k=k)
    y = b.identity("y", [(p, Dense(b.param("v", [[5.0]])))])
    return b.build(outputs=[y])


@pytest.mark.parametrize("k", [1, 2])
def test_max_pool_tie_selects_the_lexicographically_first_antecedent(k):
    graph = _tie_graph(k)
    net = expand(graph)
    paths = enumerate_paths(net)
    x = np.array([[3.0, 2.0]])  # h = (6, 6): a tie, both the largest and the 2nd largest
    values = neuron_forward(net, {"x": x[0]})
    assert values.selected[("p", 0)] == (("r", 0), 0)
    a = activations(net, paths, values)
    via = {p.neurons[1]: ai for p, ai in zip(paths, a) if p.start == ("x", 0) or p.start == ("x", 1)}
    assert via == {("h", 0): 1.0, ("h", 1): 0.0}
    np.testing.assert_array_equal(lifted_output(graph, x)["y"], forward(graph, NP, x)["y"])
    assert lifted_output(graph, x)["y"].tolist() == [[30.0]]


def test_k_max_pool_selects_the_first_antecedent_attaining_the_kth_value():
    # window values (5, 3, 5): the 2nd largest is 5, first attained at position 0
    b = GraphBuilder()
    x = b.input("x", (1, 3))
    p = b.maxpool("p", x, Pool((3,), (1,), ((0, 0),), (1,)), k=2)
    graph = b.build(outputs=[p])
    net = expand(graph)
    values = neuron_forward(net, {"x": np.array([[5.0, 3.0, 5.0]])})
    assert values.selected[("p", 0)] == (("x", 0), 0) and values.out[("p", 0)] == 5.0
    values = neuron_forward(net, {"x": np.array([[1.0, 4.0, 2.0]])})
    assert values.selected[("p", 0)] == (("x", 2), 0) and values.out[("p", 0)] == 2.0


def test_inactive_relu_kills_its_paths_including_its_bias_path():
    b = GraphBuilder()
    x = b.input("x", (1,))
    h = b.relu("h", [(x, Dense(b.param("w1", [[1.0]])))], bias=b.param("b1", [-2.0]))
    y = b.identity("y", [(h, Dense(b.param("w2", [[3.0]])))])
    graph = b.build(outputs=[y])
    net = expand(graph)
    paths = enumerate_paths(net)
    assert activations(net, paths, neuron_forward(net, {"x": np.array([1.0])})).tolist() == [0.0, 0.0]
    assert activations(net, paths, neuron_forward(net, {"x": np.array([5.0])})).tolist() == [1.0, 1.0]
    assert lifted_output(graph, np.array([[5.0], [1.0]]))["y"].tolist() == [[9.0], [0.0]]
