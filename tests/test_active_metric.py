"""The active path-metric (pathir.lifting.active_metric) against path enumeration with a(θ, x)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_path_metric import KINDS, variant

from pathir.analyses.find_units import find_units
from pathir.backends import get_backend
from pathir.errors import PathirError
from pathir.ir import NodeKind
from pathir.lifting.active_metric import active_path_metric
from pathir.lifting.walk import forward
from pathir.neurons.expand import expand
from pathir.neurons.paths import activations, enumerate_paths, neuron_forward, phi
from pathir.rescaling.apply import rescale_graph
from pathir.testing import random_inputs, relu_dags, rescalings

BACKENDS = ["numpy", "torch"]


def enumerated(ga, gb, x):
    """Per sample: (d_x, ‖Φ(θ)⊙a‖₁, ‖Φ(θ')⊙a‖₁, same neuron-level pattern) by enumeration."""
    na, nb = expand(ga), expand(gb)
    pa, pb = enumerate_paths(na), enumerate_paths(nb)
    fa, fb = phi(na, pa), phi(nb, pb)
    out = []
    for b in range(next(iter(x.values())).shape[0]):
        sample = {name: value[b] for name, value in x.items()}
        va, vb = neuron_forward(na, sample), neuron_forward(nb, sample)
        a = activations(na, pa, va)
        relus = [v for v, d in na.nodes(data=True) if d["kind"] is NodeKind.RELU]
        same = all((va.pre[v] > 0) == (vb.pre[v] > 0) for v in relus) and va.selected == vb.selected
        out.append((math.fsum(np.abs(fa - fb) * a), math.fsum(np.abs(fa) * a), math.fsum(np.abs(fb) * a), same))
    return out


def _le(a, b, rtol=1e-9):
    return a <= b * (1 + rtol) + 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40, deadline=None)
@given(data=st.data(), kind=st.sampled_from(KINDS), seed=st.integers(0, 2**32 - 1))
def test_brackets_match_enumeration(backend, data, kind, seed):
    graph = data.draw(relu_dags())
    other = variant(graph, kind, seed)
    x = data.draw(random_inputs(graph))
    m = active_path_metric(graph, other, x, get_backend(backend))
    fa, fb = forward(graph, get_backend("numpy"), x), forward(other, get_backend("numpy"), x)
    for b, (d, norm_a, norm_b, same) in enumerate(enumerated(graph, other, x)):
        assert _le(m.lower[b], d) and _le(d, m.upper[b])
        assert math.isclose(m.norm_a[b], norm_a, rel_tol=1e-10, abs_tol=1e-12)
        assert math.isclose(m.norm_b[b], norm_b, rel_tol=1e-10, abs_tol=1e-12)
        if m.exact:
            assert math.isclose(m.upper[b], d, rel_tol=1e-10, abs_tol=1e-12)
        assert bool(m.shared[b]) == same
        if same:
            change = sum(np.abs(fa[o][b] - fb[o][b]).sum() for o in graph.outputs)
            assert _le(change, m.bound[b], 1e-8)
        else:
            assert math.isnan(m.bound[b])


@settings(max_examples=20, deadline=None)
@given(data=st.data(), kind=st.sampled_from(KINDS), seed=st.integers(0, 2**32 - 1))
def test_invariant_under_a_joint_rescaling(data, kind, seed):
    graph = data.draw(relu_dags())
    units = find_units(graph)[1]
    other = variant(graph, kind, seed)
    x = data.draw(random_inputs(graph))
    z = data.draw(rescalings(graph))
    m = active_path_metric(graph, other, x, "torch")
    r = active_path_metric(rescale_graph(graph, units, z), rescale_graph(other, units, z), x, "torch")
    assert np.allclose(r.upper, m.upper, rtol=1e-9, atol=1e-12)
    assert np.array_equal(r.shared, m.shared)


def test_refuses_two_architectures():
    from pathir.ir import Dense, GraphBuilder

    def net(width):
        b = GraphBuilder()
        x = b.input("x", (2,))
        h = b.relu("h", [(x, Dense(b.param("w1", np.ones((width, 2)))))])
        return b.build(outputs=[b.identity("y", [(h, Dense(b.param("w2", np.ones((1, width)))))])])

    with pytest.raises(PathirError, match="architecture"):
        active_path_metric(net(2), net(3), np.ones((1, 2)), "numpy")


def _two_layer(w1, w2):
    """x (2) -> h = relu(w1 x) (2) -> y = w2 h (1), no biases."""
    from pathir.ir import Dense, GraphBuilder

    b = GraphBuilder()
    x = b.input("x", (2,))
    h = b.relu("h", [(x, Dense(b.param("w1", w1)))])
    return b.build(outputs=[b.identity("y", [(h, Dense(b.param("w2", w2)))])])


def _refused_or_enumerated(a, b, refused: bool):
    """The active path-metric of (a, b) at x = (1, 1) on numpy and its enumeration; None where ``refused`` (checked:
    the refusal names the certificate)."""
    x = np.ones((1, 2))
    if refused:
        with pytest.raises(PathirError, match="cannot be certified"):
            active_path_metric(a, b, x, "numpy")
        return None
    (row,) = enumerated(a, b, {"x": x})
    return active_path_metric(a, b, x, "numpy"), row


@pytest.mark.parametrize("tiny, refused", [(1e-150, False), (1e-250, True)])
def test_a_walk_it_cannot_certify_is_refused(tiny, refused):
    """θ' whose hidden channels spread beyond the certificate (an entry below 1e-200 of its node's
    largest): refused rather than a bracket that may have lost terms; within it, the brackets equal
    enumeration."""
    a, b = _two_layer([[1.0, 2.0], [1.0, 1.0]], [[3.0, 1.0]]), _two_layer([[tiny, 0.0], [1.0, 1.0]], [[3.0, 1.0]])
    got = _refused_or_enumerated(a, b, refused)
    if got is not None:
        m, (d, norm_a, norm_b, _) = got
        assert _le(m.lower[0], d) and _le(d, m.upper[0]) and m.norm_b[0] == pytest.approx(norm_b, rel=1e-12)


@pytest.mark.parametrize("backend", ["torch", "numpy"])
@pytest.mark.parametrize("w11, x", [(1e-170, [1.0, -2.0]), (1e-70, [1.0, -2.0]), (1e-70, [1.0, 1.0])])
def test_a_backward_walk_masked_before_it_is_renormalised(backend, w11, x):
    """w2 = [1e60, 1e-80]; at x = (1, -2) the mask switches h0 (backward 1e60) off. The backward node was
    renormalised by h0's 1e60 before the mask: h1's 1e-80 stored as 1e-140, times w1[1,1] = 1e-170 flushed to 0,
    d_x reported 0 (exact, bound 0) on torch where it is 5e-251, or refused where it was fine (diff review). The
    mask is applied first now, and each contraction is certified against the supports; d_x equals enumeration."""
    a, b = (_two_layer([[1.0, 1.0], [1.0, w]], [[1e60, 1e-80]]) for w in (w11, 0.5 * w11))
    m = active_path_metric(a, b, np.array([x]), backend)
    (d, _, _, _), = enumerated(a, b, {"x": np.array([x])})
    assert d > 0 and m.upper[0] == pytest.approx(d, rel=1e-12) and m.lower[0] <= m.upper[0]


@pytest.mark.parametrize("spread, refused", [(1e100, False), (1e130, False), (1e200, True)])
def test_a_backward_walk_it_cannot_certify_is_refused(spread, refused):
    """θ's hidden neurons reach the output through weights 1/spread and spread: the backward walk's node holds
    both, and is divided by the larger when renormalised. At 1e200 the small one was flushed and the upper
    bracket (and the "guaranteed" bound) came out 0 where d_x = 1.2e-202 (numerics review): refused now; at
    1e100 the brackets equal enumeration."""
    w2 = [[1.0 / spread, spread]]
    a, b = _two_layer([[1.0, 2.0], [1.0, 1.0]], w2), _two_layer([[1.5, 1.0], [1.0, 1.0]], w2)  # edges into h0 differ
    got = _refused_or_enumerated(a, b, refused)
    if got is not None:
        m, (d, _, _, _) = got
        assert d > 0 and _le(m.lower[0], d) and _le(d, m.upper[0])
        assert m.upper[0] == pytest.approx(d, rel=1e-12)


def test_the_lower_bound_of_two_networks_with_one_lifting_is_zero_not_their_rounding():
    """θ' is θ with hidden units rescaled by powers of two: Φ(θ') = Φ(θ) bit for bit, d_x = 0, yet the two
    active norms are walked separately and may differ in their last bits."""
    from pathir.ir import Dense, GraphBuilder

    rng = np.random.default_rng(3)
    W1, W2 = rng.normal(size=(16, 8)), rng.normal(size=(3, 16))

    def mlp(w1, w2):
        b = GraphBuilder()
        x = b.input("x", (8,))
        h = b.relu("h", [(x, Dense(b.param("w1", w1)))])
        return b.build(outputs=[b.identity("y", [(h, Dense(b.param("w2", w2)))])])

    s = 2.0 ** rng.integers(-20, 20, size=16)
    m = active_path_metric(mlp(W1, W2), mlp(W1 * s[:, None], W2 / s[None, :]), rng.normal(size=(40, 8)), "numpy")
    assert np.all(m.lower == 0.0) and np.all(m.upper >= 0.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_inputs_that_are_not_finite_are_refused(bad):
    from pathir.errors import InputShapeError
    from pathir.ir import Dense, GraphBuilder
    from pathir.lifting.path_metric import output_bound

    b = GraphBuilder()
    x = b.input("x", (2,))
    h = b.relu("h", [(x, Dense(b.param("w1", [[1.0, 2.0], [1.0, -1.0]])))])
    g = b.build(outputs=[b.identity("y", [(h, Dense(b.param("w2", [[3.0, 1.0]])))])])
    xs = np.array([[bad, 1.0]])
    with pytest.raises(InputShapeError, match="NaN or infinite"):
        active_path_metric(g, g, xs, "numpy")
    with pytest.raises(InputShapeError, match="NaN or infinite"):
        output_bound(g, g, xs, "numpy")


def _mlp(w1, w2, w3=None):
    from pathir.ir import Dense, GraphBuilder

    b = GraphBuilder()
    x = b.input("x", (np.shape(w1)[1],))
    h = b.relu("h", [(x, Dense(b.param("w1", w1)))])
    if w3 is not None:
        h = b.relu("k", [(h, Dense(b.param("w3", w3)))])
    return b.build(outputs=[b.identity("y", [(h, Dense(b.param("w2", w2)))])])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_network_of_tiny_weights_gets_its_brackets(backend):
    """Every path value near 1e-205 (weights of 1e-45 then 1e-160): float64 holds them, but the walk multiplied a
    node near 1e-45 by weights of 1e-160 and refused entries below its floor. The pair divided by each param's
    scale (the scales added back as logs) walks numbers near 1."""
    a = _mlp(np.array([[1.0, 2.0], [3.0, 1.0]]) * 1e-45, np.array([[1.0, 1.0]]) * 1e-160)
    b = _mlp(np.array([[1.0, 0.0], [3.0, 1.0]]) * 1e-45, np.array([[1.0, 1.0]]) * 1e-160)
    x = np.array([[1.0, 1.0], [2.0, 0.5]])
    m = active_path_metric(a, b, x, get_backend(backend))
    for k, (d, norm_a, norm_b, _) in enumerate(enumerated(a, b, {"x": x})):
        assert d > 0 and m.lower[k] == pytest.approx(d, rel=1e-10, abs=0) and m.upper[k] == pytest.approx(d, rel=1e-10, abs=0)
        assert m.norm_a[k] == pytest.approx(norm_a, rel=1e-10, abs=0) and m.norm_b[k] == pytest.approx(norm_b, rel=1e-10, abs=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_brackets_are_the_same_on_an_extreme_joint_rescaling(backend):
    """docs/activations.md: both brackets are invariant under a rescaling of θ and θ' jointly. One that puts the
    weights between 1e-206 and 1e205 was refused (the walk of θ' cannot be certified); it gives the brackets of the
    pair as it was."""
    rng = np.random.default_rng(0)
    w1, w3, w2 = rng.normal(size=(4, 3)), rng.normal(size=(4, 4)), rng.normal(size=(2, 4))
    a = _mlp(w1, w2, w3)
    b = _mlp(w1 + 0.05 * np.abs(rng.normal(size=w1.shape)) * np.sign(w1), w2, w3 * 0.9)
    units = find_units(a)[1]
    z = np.array([2 * math.log(1e-45) if name.startswith("h") else 2 * math.log(1e-205) for name in units.names])
    ra, rb = rescale_graph(a, units, z), rescale_graph(b, units, z)
    assert max(float(np.abs(p.value).max()) for p in ra.params()) > 1e200
    x = rng.normal(size=(5, 3))
    m, r = active_path_metric(a, b, x, get_backend(backend)), active_path_metric(ra, rb, x, get_backend(backend))
    for field in ("lower", "upper", "norm_a", "norm_b"):
        assert np.allclose(getattr(r, field), getattr(m, field), rtol=1e-10, atol=0), field
    assert np.array_equal(r.shared, m.shared)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_difference_of_one_ulp_survives_the_rescaled_walk(backend):
    """The fallback walks the pair divided by each param's scale. Divided by a scale that is no power of two, two
    entries one ulp apart can round to one quotient: the difference came out 0, and ``exact`` called d_x 0. The
    scales are powers of two and the differences are taken before dividing: d_x to the last digit."""
    a_ = np.array([[1.7, 0.0], [1.7, 1.7]]) * 1e-45
    rng = np.random.default_rng(0)
    for t in rng.uniform(0.1, 1.0, 100000):  # an entry whose one-ulp neighbour divides by max|w1| to the same float
        if (t * 1e-45) / (1.7 * 1e-45) == np.nextafter(t * 1e-45, 0) / (1.7 * 1e-45):
            break
    a_[0, 1] = t * 1e-45
    b_ = a_.copy()
    b_[0, 1] = np.nextafter(a_[0, 1], 0)
    w2 = np.array([[1.0, 1.0]]) * 1e-160
    a, b = _mlp(a_, w2), _mlp(b_, w2)
    m = active_path_metric(a, b, np.ones((1, 2)), get_backend(backend))
    d = (a_[0, 1] - b_[0, 1]) * w2[0, 0]  # the one path whose weight moved, active at x = (1, 1)
    assert m.exact and m.lower[0] == pytest.approx(d, rel=1e-12, abs=0) and \
        m.upper[0] == pytest.approx(d, rel=1e-12, abs=0)
