"""The incidence matrix B and rescalings (docs/math.md §5, §9), against the neuron-level definition."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pathir.analyses.find_units import find_units
from pathir.analyses.incidence import ParamLayout, incidence, row_keys
from pathir.backends.numpy import NumpyBackend
from pathir.errors import PathirError
from pathir.ir import ChannelMap, Conv, Dense, GraphBuilder, Identity, Pool, Reshape, Scale
from pathir.lifting.walk import forward
from pathir.neurons.expand import expand
from pathir.rescaling.apply import apply_log_scales, check_log_scales, log_scales, rescale_graph
from pathir.testing import mlps, random_inputs, relu_dags, rescalings

RNG = np.random.default_rng(1)


from enumerated import path_factors  # noqa: E402


def jacobian(graph):
    """DΦ(θ) exactly: ∂Φ_p/∂θ_i = product of the other factors of p (each θ_i at most once per path)."""
    paths, layout = path_factors(graph)
    D = np.zeros((len(paths), len(layout)))
    for r, (const, free) in enumerate(paths):
        values = [w for _, w in free]
        for j, (i, _) in enumerate(free):
            D[r, i] += const * np.prod(values[:j] + values[j + 1 :])
    return D


def phi(graph):
    paths, _ = path_factors(graph)
    return np.array([c * np.prod([w for _, w in free]) for c, free in paths])


def _conv(b, name, o, i):
    return Conv(b.param(name, RNG.normal(size=(o, i, 3, 3))), (1, 1), ((1, 1), (1, 1)), (1, 1))


def small_cnn():
    b = GraphBuilder()
    x = b.input("x", (2, 4, 4))
    a = b.relu("a", [(x, _conv(b, "c1", 3, 2))], bias=b.param("b1", RNG.normal(size=3)))
    p = b.maxpool("p", a, Pool((2, 2), (2, 2), ((0, 0), (0, 0)), (1, 1)))
    f = b.identity("f", [(p, Reshape((12,)))])
    y = b.identity("y", [(f, Dense(b.param("w", RNG.normal(size=(2, 12)))))], bias=b.param("bw", RNG.normal(size=2)))
    return b.build(outputs=[y])


def small_resnet(bias=True):
    b = GraphBuilder()
    x = b.input("x", (1, 3, 3))
    bias_of = (lambda n: b.param(n, RNG.normal(size=2))) if bias else (lambda n: None)
    a = b.relu("a", [(x, _conv(b, "c1", 2, 1))], bias=bias_of("b1"))
    h = b.relu("h", [(a, _conv(b, "c2", 2, 2))], bias=bias_of("b2"))
    c = b.relu("c", [(h, _conv(b, "c3", 2, 2)), (a, Identity())], bias=bias_of("b3"))
    f = b.identity("f", [(c, Reshape((18,)))])
    y = b.identity("y", [(f, Dense(b.param("w", RNG.normal(size=(1, 18)))))])
    return b.build(outputs=[y])


def small_concat():
    b = GraphBuilder()
    x = b.input("x", (2, 3, 3))
    a = b.relu("a", [(x, _conv(b, "c1", 2, 2))], bias=b.param("b1", RNG.normal(size=2)))
    h = b.relu("h", [(x, _conv(b, "c2", 1, 2))])
    c = b.identity("cat", [(a, ChannelMap((0, 1, -1))), (h, ChannelMap((-1, -1, 0)))])
    d = b.relu("d", [(c, _conv(b, "c3", 2, 3))], bias=b.param("b3", RNG.normal(size=2)))
    p = b.identity("p", [(d, Pool((3, 3), (1, 1), ((0, 0), (0, 0)), (1, 1), mult=np.full((1, 1), 1 / 9)))])
    f = b.identity("f", [(p, Reshape((2,)))])
    y = b.identity("y", [(f, Dense(b.param("w", RNG.normal(size=(2, 2)))))])
    return b.build(outputs=[y])


# --------------------------------------------------------------- structure


@settings(max_examples=150)
@given(relu_dags())
def test_b_rows_follow_the_neuron_level_definition(graph):
    _, units = find_units(graph)
    B, layout = incidence(graph, units)
    assert B.shape == (len(layout), len(units)) == (graph.num_params(), len(units))
    dense = B.toarray()
    assert set(np.unique(dense)) <= {-1.0, 0.0, 1.0}
    assert ((dense == -1).sum(1) <= 1).all() and ((dense == 1).sum(1) <= 1).all()
    assert (np.abs(dense).sum(1) <= 2).all()
    # expected rows from single neurons: channel = flat index // positions per channel
    net = expand(graph)

    def unit(neuron):
        name, j = neuron
        node = graph.node(name)
        return units.channel_units[name][j // (node.numel // node.channels)]

    expected: dict[int, np.ndarray] = {}

    def put(i, row):
        if i in expected:  # a shared entry must be rescaled the same way by every edge
            assert (expected[i] == row).all()
        expected[i] = row

    for u, v, d in net.edges(data=True):
        if d["param"] is not None:
            row = np.zeros(len(units))
            tu, su = unit(v), unit(u)
            if tu != su:
                if tu < units.no_unit:
                    row[tu] = -1
                if su < units.no_unit:
                    row[su] = 1
            put(layout.slice(d["param"][0]).start + d["param"][1], row)
    for v, d in net.nodes(data=True):
        if d["bias"] is not None:
            row = np.zeros(len(units))
            if unit(v) < units.no_unit:
                row[unit(v)] = -1
            put(layout.slice(d["bias"][0]).start + d["bias"][1], row)
    for i, row in expected.items():
        assert (dense[i] == row).all(), (layout.locate(i), dense[i], row)


@given(relu_dags())
def test_row_keys_from_the_units_are_those_of_b(graph):
    """The solvers' row keys, read straight from the units' ends, equal those read back from B."""
    from pathir.analyses.unit_rows import column_balance, key_balance
    from pathir.analyses.unit_rows import matrix_row_keys as keys_of_b

    _, units = find_units(graph)
    B, _ = incidence(graph, units)
    rows = row_keys(units)
    expected, H = keys_of_b(B)
    assert rows.key.dtype == np.int64 and np.array_equal(rows.key, expected)
    assert np.array_equal(rows.balance, column_balance(B)) and np.array_equal(key_balance(expected, H), rows.balance)


def test_bias_rows_enter_and_weight_rows_cross():
    graph = small_cnn()
    B, layout = incidence(graph, find_units(graph)[1])
    dense = B.toarray()
    b1 = dense[layout.slice("b1")]
    assert (b1 == -np.eye(3)).all()  # bias of channel c enters unit c
    c1 = dense[layout.slice("c1")].reshape(3, 2, 3, 3, 3)
    assert (c1.sum(-1) == -1).all() and (c1.min(-1) == -1).all()  # from the pinned input: one -1
    w = dense[layout.slice("w")].reshape(2, 3, 4, 3)
    for c in range(3):
        assert (w[:, c, :, c] == 1).all()  # leaving channel c through the flatten to the output
    assert (dense[layout.slice("bw")] == 0).all()


def test_layout_maps_offsets_params_and_source_names():
    b = GraphBuilder()
    x = b.input("x", (2,))
    h = b.relu("h", [(x, Dense(b.param("fc.w", np.arange(6.0).reshape(3, 2), source="net.fc.weight")))])
    y = b.identity("y", [(h, Dense(b.param("out.w", np.ones((1, 3)))))], bias=b.param("out.b", [7.0]))
    layout = ParamLayout(tuple(b.build(outputs=[y]).params()))
    assert len(layout) == 10 and layout.offsets.tolist() == [0, 6, 9, 10]
    assert layout.locate(3) == ("fc.w", (1, 1)) and layout.locate(9) == ("out.b", (0,))
    assert layout.source_name(3) == "net.fc.weight" and layout.source_name(7) == "out.w"
    theta = layout.theta()
    assert theta.tolist() == [0, 1, 2, 3, 4, 5, 1, 1, 1, 7]
    assert list(layout.by_source(theta)) == ["net.fc.weight", "out.w", "out.b"]
    assert (layout.split(theta)["fc.w"] == np.arange(6.0).reshape(3, 2)).all()
    with pytest.raises(IndexError):
        layout.locate(10)


def test_units_of_another_graph_are_refused():
    with pytest.raises(PathirError, match="units were found on another graph"):
        incidence(small_cnn(), find_units(small_resnet())[1])


# --------------------------------------------------------------- kernel of DΦ


@settings(max_examples=150)
@given(relu_dags(max_paths=1500))
def test_unit_directions_lie_in_the_kernel_of_dphi(graph):
    _, units = find_units(graph)
    B, layout = incidence(graph, units)
    K = B.toarray() * layout.theta()[:, None]  # the orbit's tangent: d/dz θ ⊙ exp(-Bz/2) ∝ B_h ⊙ θ
    D = jacobian(graph)
    scale = np.abs(D).max(initial=0) * np.abs(K).max(initial=0) + 1e-300
    assert np.abs(D @ K).max(initial=0) <= 1e-12 * scale
    assert np.linalg.matrix_rank(K) == len(units)


WIDTHS = [(2, 2, 1), (2, 3, 2), (3, 4, 2), (4, 3, 3, 2), (2, 5, 5, 2), (5, 2, 5), (1, 3, 1), (3, 2, 2, 3)]


@settings(max_examples=16)
@given(st.sampled_from(WIDTHS).flatmap(lambda w: mlps(widths=w)))
def test_units_span_the_kernel_of_dphi_on_layered_networks(graph):
    # docs/math.md §9: rank DΦ = n - H for generic θ, so span{B_h ⊙ θ} is the whole kernel
    _, units = find_units(graph)
    D = jacobian(graph)
    assert np.linalg.matrix_rank(D) == graph.num_params() - len(units)


@pytest.mark.parametrize("build", [small_cnn, small_resnet, small_concat, lambda: small_resnet(bias=False)])
def test_units_span_the_kernel_of_dphi_on_small_conv_graphs(build):
    graph = build()
    _, units = find_units(graph)
    B, layout = incidence(graph, units)
    D = jacobian(graph)
    K = B.toarray() * layout.theta()[:, None]
    assert np.abs(D @ K).max() <= 1e-12 * np.abs(D).max() * np.abs(K).max()
    assert np.linalg.matrix_rank(D) == graph.num_params() - len(units)


# --------------------------------------------------------------- rescaling


def _rel(a, b):
    return np.abs(a - b).max(initial=0) / max(np.abs(b).max(initial=0), 1e-300)


@settings(max_examples=50)
@given(st.data())
def test_rescaling_keeps_the_function_and_phi(data):
    graph = data.draw(relu_dags())
    z = data.draw(rescalings(graph))
    _, units = find_units(graph)
    new = rescale_graph(graph, units, z)
    # the flat form and the per-channel form are one group element
    other = apply_log_scales(graph, log_scales(graph, units, z))
    for p, q in zip(new.params(), other.params()):
        assert p.name == q.name and np.allclose(p.value, q.value, rtol=1e-13, atol=0)
    # and the flat form is θ ⊙ exp(-Bz/2) with B itself
    B, layout = incidence(graph, units)
    np.testing.assert_allclose(ParamLayout(tuple(new.params())).theta(), layout.theta() * np.exp(-(B @ z) / 2),
                               rtol=1e-13, atol=0)
    x = data.draw(random_inputs(graph))
    be = NumpyBackend()
    before, after = forward(graph, be, x), forward(new, be, x)
    for o in graph.outputs:
        assert _rel(after[o], before[o]) <= 1e-10
    assert _rel(phi(new), phi(graph)) <= 1e-10


@settings(max_examples=25)
@given(st.data())
def test_rescalings_compose_additively(data):
    graph = data.draw(relu_dags())
    z1, z2 = data.draw(rescalings(graph)), data.draw(rescalings(graph))
    _, units = find_units(graph)
    twice = rescale_graph(rescale_graph(graph, units, z1), units, z2)  # units reused on an equal-structure graph
    once = rescale_graph(graph, units, z1 + z2)
    for p, q in zip(twice.params(), once.params()):
        assert np.allclose(p.value, q.value, rtol=1e-12, atol=0)


def test_rescaling_changes_exactly_the_unit_sides():
    b = GraphBuilder()
    x = b.input("x", (2,))
    a = b.relu("a", [(x, Dense(b.param("w", RNG.normal(size=(2, 2)))))], bias=b.param("bias", RNG.normal(size=2)))
    c = b.relu("c", [(a, Scale(b.param("s", RNG.normal(size=2)))), (a, Identity())])
    y = b.identity("y", [(c, Dense(b.param("v", RNG.normal(size=(1, 2)))))])
    graph = b.build(outputs=[y])
    _, units = find_units(graph)
    new = rescale_graph(graph, units, [np.log(4.0), 0.0])
    old = {p.name: p.value for p in graph.params()}
    got = {p.name: p.value for p in new.params()}
    assert np.allclose(got["w"], old["w"] * [[2.0], [1.0]])
    assert np.allclose(got["bias"], old["bias"] * [2.0, 1.0])
    assert (got["s"] == old["s"]).all()  # both ends in one unit: unchanged
    assert np.allclose(got["v"], old["v"] * [0.5, 1.0])


def test_log_scales_that_break_a_tie_or_move_a_pin_are_refused():
    graph = small_resnet()
    _, units = find_units(graph)
    s = log_scales(graph, units, np.ones(len(units)))
    check_log_scales(graph, s)
    broken = dict(s, c=s["c"] + 0.5)  # the skip a -> c ties them
    with pytest.raises(PathirError, match="fixed edge a -> c"):
        check_log_scales(graph, broken)
    with pytest.raises(PathirError, match="input/output node 'y'"):
        check_log_scales(graph, dict(s, y=np.ones(1)))
    with pytest.raises(ValueError, match="one entry per unit"):
        rescale_graph(graph, units, np.ones(len(units) + 1))
    with pytest.raises(KeyError, match="not in the graph"):
        check_log_scales(graph, dict(s, ghost=np.ones(2)))


def test_rescaling_with_shared_weights_and_biases_keeps_the_function():
    b = GraphBuilder()
    x = b.input("x", (2, 4, 4))
    W = Conv(b.param("W", RNG.normal(size=(2, 2, 3, 3))), (1, 1), ((1, 1), (1, 1)), (1, 1))
    bias = b.param("bias", RNG.normal(size=2))
    a = b.relu("a", [(x, _conv(b, "c0", 2, 2))])
    c = b.relu("c", [(a, W)], bias=bias)
    d = b.relu("d", [(c, _conv(b, "c1", 2, 2))])
    e = b.relu("e", [(d, W)], bias=bias)  # W and bias shared: (a, c) ~ (d, e) channel by channel
    y = b.identity("y", [(e, Reshape((32,)))])
    graph = b.build(outputs=[y])
    _, units = find_units(graph)
    assert units.members == ((("a", 0), ("d", 0)), (("a", 1), ("d", 1)))
    assert units.channel_units["c"].tolist() == [units.no_unit] * 2  # tied to e, which the output pins
    z = np.array([0.7, -1.3])
    new = rescale_graph(graph, units, z)
    other = apply_log_scales(graph, log_scales(graph, units, z))
    for p, q in zip(new.params(), other.params()):
        assert np.allclose(p.value, q.value, rtol=1e-13, atol=0)
    xs = RNG.normal(size=(3, 2, 4, 4))
    be = NumpyBackend()
    assert _rel(forward(new, be, xs)["y"], forward(graph, be, xs)["y"]) <= 1e-12
