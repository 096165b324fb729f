"""The sympy backend: exact forward against numpy, exact adjoint identities,
symbolic Φ against enumeration, exact neuron values, exact path sums."""

from collections import Counter

import numpy as np
import pytest
import sympy as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from pathir.backends import get_backend
from pathir.backends.numpy import NumpyBackend
from pathir.backends.sympy import (
    SympyBackend,
    exact,
    exact_array,
    param_symbols,
    symbol,
)
from pathir.errors import BackendError
from pathir.ir import Dense, GraphBuilder, NodeKind, Pool
from pathir.lifting.walk import forward
from pathir.neurons.exact import neuron_values, symbolic_phi
from pathir.neurons.expand import expand
from pathir.neurons.paths import activations, enumerate_num_paths, enumerate_paths, neuron_forward, phi
from pathir.passes import maxpool_to_sum, path_view
from pathir.testing import mlps, random_inputs, relu_dags


def as_float(a) -> np.ndarray:
    return np.array(a, dtype=object).astype(np.float64)


def rational_array(rng, shape) -> np.ndarray:
    num, den = rng.integers(-9, 10, size=shape), rng.integers(1, 6, size=shape)
    return exact_array(np.vectorize(lambda a, b: sp.Rational(int(a), int(b)), otypes=[object])(num, den))


# ------------------------------------------------------------------ numbers


def test_exact_reads_simple_rationals_and_binary_values():
    assert exact(0.5) == sp.Rational(1, 2)
    assert exact(1 / 3) == sp.Rational(1, 3) and exact(-1 / 7) == sp.Rational(-1, 7)
    assert exact(3) == 3 and isinstance(exact(np.int64(3)), sp.Integer)
    x = 0.7381927361827361  # no small-denominator rational rounds to it: read exactly
    assert float(exact(x)) == x and exact(x) == sp.Rational(x)
    s = sp.Symbol("s")
    assert exact(s) is s
    with pytest.raises(ValueError):
        exact(float("inf"))


def test_symbols_are_named_after_param_and_flat_index():
    assert symbol("fc1.weight", 3).name == "fc1.weight[3]"
    b = GraphBuilder()
    x = b.input("x", (3,))
    y = b.identity("y", [(x, Dense(b.param("fc.weight", np.ones((2, 3)))))], bias=b.param("fc.bias", [0.0, 0.0]))
    syms = param_symbols(b.build(outputs=[y]))
    assert syms["fc.weight"].shape == (2, 3) and syms["fc.bias"].shape == (2,)
    assert syms["fc.weight"][1, 0] == symbol("fc.weight", 3)


def test_get_backend_builds_it_by_name():
    assert isinstance(get_backend("sympy"), SympyBackend)


# ------------------------------------------------------------------ forward


@settings(max_examples=60)
@given(st.data())
def test_forward_agrees_with_numpy(data):
    graph = data.draw(relu_dags())
    x = data.draw(random_inputs(graph, batch=2))
    want = forward(graph, NumpyBackend(), x)
    got = forward(graph, SympyBackend(), x)
    for o in graph.outputs:
        assert got[o].dtype == object
        assert np.allclose(as_float(got[o]), want[o], rtol=1e-9, atol=1e-9), str(graph)


@settings(max_examples=60)
@given(st.data())
def test_forward_is_exact_on_integers(data):
    """Integer weights and inputs, no fractional fixed weights: float64 is exact
    too, so the two must agree to the last bit (k-max-pool ties included)."""
    graph = data.draw(relu_dags(integer_weights=True, avgpool=False, adaptive_pool=False))
    x = data.draw(random_inputs(graph, batch=2, integer=True))
    want = forward(graph, NumpyBackend(), x)
    got = forward(graph, SympyBackend(), x)
    for o in graph.outputs:
        assert all(isinstance(exact(v), sp.Integer) for v in got[o].ravel())
        assert np.array_equal(as_float(got[o]), want[o]), str(graph)


@settings(max_examples=40)
@given(st.data())
def test_rules_satisfy_the_adjoint_identities_exactly(data):
    """<M x, g> = <x, Mᵀ g> and, for a parameterized map, <M x, g> = <W, weight_grad(x, g)>
    (M x is linear in W), in exact arithmetic at random rational x, g and W."""
    graph = data.draw(relu_dags())
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    values = {p.name: rational_array(rng, p.shape) for p in graph.params()}
    be = SympyBackend(values)
    for node in graph.nodes:
        for e in node.edges:
            s = graph.node(e.source).shape
            x, g = rational_array(rng, (2, *s)), rational_array(rng, (2, *node.shape))
            y = be.apply(e.map, x, s)
            assert y.shape == (2, *node.shape)
            inner = sp.Add(*(y * g).ravel())
            assert inner == sp.Add(*(x * be.adjoint(e.map, g, s)).ravel()), e.map.describe()
            if e.map.weight is not None:
                gw = be.weight_grad(e.map, x, g, s)
                assert gw.shape == e.map.weight.shape
                assert inner == sp.Add(*(values[e.map.weight.name] * gw).ravel()), e.map.describe()


def test_symbolic_forward_gives_max_expressions_that_substitute_to_numbers():
    b = GraphBuilder()
    x = b.input("x", (2,))
    h = b.relu("h", [(x, Dense(b.param("w1", [[1.0, -2.0], [0.5, 1.0]])))], bias=b.param("b1", [0.5, -1.0]))
    y = b.identity("y", [(h, Dense(b.param("w2", [[2.0, -1.0]])))])
    g = b.build(outputs=[y])
    syms = param_symbols(g)
    expr = forward(g, SympyBackend(syms), np.array([[3, 1]]))["y"][0, 0]
    assert expr.has(sp.Max)
    at = {s: exact(v) for p in g.params() for s, v in zip(syms[p.name].ravel(), p.value.ravel())}
    assert expr.xreplace(at) == forward(g, SympyBackend(), np.array([[3, 1]]))["y"][0, 0] == sp.Rational(3, 2)  # relu(3 - 2 + 1/2) * 2 - relu(3/2 + 1 - 1)


def test_symbolic_kmax_pool_with_k_above_one_is_refused():
    b = GraphBuilder()
    x = b.input("x", (1, 4))
    pool = b.maxpool("pool", x, Pool((2,), (2,), ((0, 0),), (1,)), k=2)
    y = b.identity("y", [(pool, Dense(b.param("w", np.ones((1, 2)))))])
    g = b.build(outputs=[y])
    s = np.array([[[sp.Symbol("a"), sp.Symbol("b"), 1, 2]]], dtype=object)
    with pytest.raises(BackendError, match="2-max-pool"):
        forward(g, SympyBackend(), s)
    assert forward(g, SympyBackend(), np.array([[[3, 5, 2, 2]]]))["y"][0, 0] == 3 + 2


def test_values_must_fit_the_param():
    b = GraphBuilder()
    x = b.input("x", (2,))
    y = b.identity("y", [(x, Dense(b.param("w", np.ones((1, 2)))))])
    with pytest.raises(Exception, match="values\\['w'\\] has 3 entries"):
        forward(b.build(outputs=[y]), SympyBackend({"w": [1, 2, 3]}), np.ones((1, 2)))


# ------------------------------------------------------------ neuron level


@settings(max_examples=40)
@given(st.data())
def test_symbolic_phi_is_the_enumerated_phi(data):
    graph = data.draw(relu_dags(max_paths=600))
    net = expand(graph)
    paths = enumerate_paths(net)
    symbolic = symbolic_phi(net, paths)
    numeric = symbolic_phi(net, paths, values={})  # the graph's own θ, read exactly
    assert np.allclose(as_float(numeric), phi(net, paths), rtol=1e-12, atol=0)
    at = {symbol(p.name, i): exact(v) for p in graph.params() for i, v in enumerate(p.value.ravel())}
    for s, n, path in zip(symbolic, numeric, paths):
        assert s.xreplace(at) == n
        # a monomial: each parameter entry to the power of its occurrences along the path (docs/math.md §2: once in
        # a layered network; a weight read at two depths, which relu_dags draws, twice), the start's bias once
        along = Counter(d["param"] for *_, d in _edges(net, path) if d["param"] is not None)
        powers = {b: e for b, e in s.as_powers_dict().items() if isinstance(b, sp.Symbol)}
        start = 0 if net.nodes[path.start]["is_input"] else 1
        assert all(powers[symbol(*key)] == count for key, count in along.items())
        assert sum(powers.values()) == sum(along.values()) + start and len(s.free_symbols) == len(along) + start


def _edges(net, path):
    return [(u, v, k, net.edges[u, v, k]) for u, v, k in path.edges()]


@settings(max_examples=40)
@given(st.data())
def test_neuron_values_are_the_exact_neuron_forward(data):
    graph = data.draw(relu_dags(max_paths=600))
    x = data.draw(random_inputs(graph, batch=1))
    net = expand(graph)
    sample = {k: v[0] for k, v in x.items()}
    ref, got = neuron_forward(net, sample), neuron_values(net, sample)
    for v in net.nodes:
        assert np.isclose(float(got.out[v]), ref.out[v], rtol=1e-9, atol=1e-9)
    paths = enumerate_paths(net)
    assert np.array_equal(activations(net, paths, got), activations(net, paths, ref))


def test_neuron_values_read_given_values():
    g = GraphBuilder()
    x = g.input("x", (1,))
    h = g.relu("h", [(x, Dense(g.param("w1", [[1.0]])))], bias=g.param("b1", [0.0]))
    y = g.identity("y", [(h, Dense(g.param("w2", [[1.0]])))])
    net = expand(g.build(outputs=[y]))
    vals = neuron_values(net, {"x": np.array([3])}, {"w1": [sp.Rational(1, 3)], "b1": [-1]})
    assert vals.pre[("h", 0)] == 0 and vals.out[("y", 0)] == 0  # exactly on the ReLU boundary


# ------------------------------------------------------------------ path sums


@settings(max_examples=30)
@given(relu_dags(max_paths=600))
def test_power_view_forward_sums_phi_to_the_q(graph):
    """On the path-norm network, forward with power_view(q) is Σ_p |Φ_p|^q exactly;
    q = 0 counts the paths."""
    net = expand(graph)
    paths = enumerate_paths(net)
    values = symbolic_phi(net, paths, values={})
    view = path_view(maxpool_to_sum(graph), 1)
    ones = {name: np.ones((1, *view.node(name).shape)) for name in view.inputs}
    for q in (0, 1, 2):
        out = forward(view, SympyBackend().power_view(q), ones)
        total = sp.Add(*(v for o in view.outputs for v in out[o].ravel()))
        want = len(paths) if q == 0 else sp.Add(*(abs(v) ** q for v in values))
        assert total == want, (q, str(graph))
    assert len(paths) == enumerate_num_paths(graph)


@settings(max_examples=10)
@given(mlps(bias=True))
def test_power_view_keeps_given_values(graph):
    values = {p.name: np.full(p.shape, sp.Rational(-1, 2), dtype=object) for p in graph.params()}
    view = path_view(maxpool_to_sum(graph), 1)
    ones = {name: np.ones((1, *view.node(name).shape)) for name in view.inputs}
    out = forward(view, SympyBackend(values).power_view(2), ones)
    net = expand(graph)
    paths = enumerate_paths(net)
    want = sp.Add(*(v**2 for v in symbolic_phi(net, paths, values)))
    assert sp.Add(*out[view.outputs[0]].ravel()) == want
    assert all(view.node(n).kind in (NodeKind.INPUT, NodeKind.IDENTITY) for n in [m.name for m in view.nodes])


def test_values_naming_no_param_are_refused():
    """A key of values= that names no param (a typo: 'fc1.weigth') was ignored, and the result read the graph's
    own value without a word (symbolic review): the forward, symbolic_phi, neuron_values and conservation_laws
    refuse it by name."""
    from pathir.errors import ArgumentError
    from pathir.lifting.walk import forward
    from pathir.neurons.exact import neuron_values, symbolic_phi
    from pathir.neurons.expand import expand
    from pathir.neurons.paths import enumerate_paths
    from pathir.neurons.symbolic import conservation_laws

    b = GraphBuilder()
    x = b.input("x", (2,))
    h = b.relu("h", [(x, Dense(b.param("fc1.weight", [[1.0, 2.0], [3.0, -1.0]])))], bias=b.param("fc1.bias", [1.0, 0.5]))
    graph = b.build(outputs=[b.identity("y", [(h, Dense(b.param("fc2.weight", [[2.0, -1.0]])))])])
    typo = {"fc1.weigth": np.zeros((2, 2))}
    with pytest.raises(ArgumentError, match=r"names no param.*fc1\.weigth"):
        forward(graph, SympyBackend(typo), np.array([[1.0, 1.0]]))
    assert forward(graph, SympyBackend({"fc1.weight": np.zeros((2, 2))}), np.array([[1, 1]]))["y"][0, 0] == sp.Rational(3, 2)
    net = expand(graph)
    with pytest.raises(ArgumentError, match=r"fc2\.wieght"):
        symbolic_phi(net, enumerate_paths(net), {"fc2.wieght": [1, 2]})
    with pytest.raises(ArgumentError, match=r"fc2\.wieght"):
        neuron_values(net, {"x": [1, 1]}, {"fc2.wieght": [1, 2]})
    theta = {p.name: p.value for p in graph.params()}
    with pytest.raises(ArgumentError, match=r"junk"):
        conservation_laws(graph, theta={**theta, "junk": 1.0})
