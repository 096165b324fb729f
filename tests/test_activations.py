"""Activation-filtered observables (pathir.lifting.active) against path enumeration with a(θ, x)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pathir.analyses.find_units import find_units
from pathir.backends import get_backend
from pathir.lifting.active import active_path_counts, active_path_norm, local_affine
from pathir.lifting.pattern import activation_pattern
from pathir.lifting.walk import forward
from pathir.neurons.expand import expand
from pathir.neurons.paths import activations, enumerate_paths, input_incidence, neuron_forward, phi
from pathir.rescaling.apply import rescale_graph
from pathir.testing import random_inputs, relu_dags, rescalings

BACKENDS = ["numpy", "torch"]


def enumerated(graph, x):
    """Per sample: (Φ, a, A(x, 1), path ends) by enumeration (the definition, docs/math.md §2)."""
    net = expand(graph)
    paths = enumerate_paths(net)
    Phi = phi(net, paths)
    A, columns = input_incidence(net, paths)
    batch = next(iter(x.values())).shape[0]
    out = []
    for b in range(batch):
        sample = {name: value[b] for name, value in x.items()}
        x1 = np.array([sample[v[0]].reshape(-1)[v[1]] for v in columns[:-1]] + [1.0])
        out.append((Phi, activations(net, paths, neuron_forward(net, sample)), A @ x1, [p.end for p in paths]))
    return out


def _close(got, want, rtol=1e-10):
    return math.isclose(got, want, rel_tol=rtol, abs_tol=1e-12 * max(1.0, abs(want)))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40, deadline=None)
@given(data=st.data(), q=st.sampled_from([1.0, 2.0, 0.5]))
def test_active_path_norm_and_counts_match_enumeration(backend, data, q):
    graph = data.draw(relu_dags())
    x = data.draw(random_inputs(graph, integer=data.draw(st.booleans())))
    be = get_backend(backend)
    norms = active_path_norm(graph, be, x, q=q)
    counts = active_path_counts(graph, be, x, log10=False)
    for b, (Phi, a, _, _) in enumerate(enumerated(graph, x)):
        assert _close(norms[b], math.fsum(np.abs(Phi) ** q * a) ** (1 / q))
        assert counts[b] == a.sum()


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_local_affine_is_the_lifting_identity(backend, data):
    """Slope and intercept equal the enumerated sums Σ Φ_p a_p over input and bias paths,
    and J x + c reproduces the model's output to 1e-10."""
    graph = data.draw(relu_dags())
    x = data.draw(random_inputs(graph, integer=data.draw(st.booleans())))
    piece = local_affine(graph, get_backend(backend), x)
    want = forward(graph, get_backend("numpy"), x)
    net = expand(graph)
    paths = enumerate_paths(net)
    A, columns = input_incidence(net, paths)
    jx = piece.jvp(x)
    for o in graph.outputs:
        assert np.allclose(jx[o] + piece.intercept[o], want[o], rtol=1e-10, atol=1e-10)
        assert np.allclose(piece.values[o], want[o], rtol=1e-10, atol=1e-10)
    for b, (Phi, a, _, ends) in enumerate(enumerated(graph, x)):
        for o in graph.outputs:
            n = graph.node(o).numel
            c = np.zeros(n)
            for t, (name, j), row in zip(Phi * a, ends, A):
                if name == o and row[-1]:
                    c[j] += t
            assert np.allclose(piece.intercept[o][b].reshape(-1), c, rtol=1e-10, atol=1e-10)
    if len(graph.inputs) == 1 and len(graph.outputs) == 1:
        o, i = graph.outputs[0], graph.inputs[0]
        J = piece.slope().reshape(piece.pattern.batch, graph.node(o).numel, graph.node(i).numel)
        for b, (Phi, a, _, ends) in enumerate(enumerated(graph, x)):
            want_J = np.zeros(J.shape[1:])
            for t, (name, j), row in zip(Phi * a, ends, A):
                if name == o and not row[-1]:
                    want_J[j, int(np.argmax(row[:-1]))] += t
            assert np.allclose(J[b], want_J, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_invariant_under_rescaling(backend, data):
    graph = data.draw(relu_dags())
    g2, units = find_units(graph)
    if not units:
        return
    x = data.draw(random_inputs(graph))
    moved = rescale_graph(graph, units, data.draw(rescalings(graph)))
    be = get_backend(backend)
    for q in (1.0, 2.0):
        assert np.allclose(active_path_norm(moved, be, x, q=q), active_path_norm(graph, be, x, q=q), rtol=1e-9)
    assert np.array_equal(active_path_counts(moved, be, x, log10=False), active_path_counts(graph, be, x, log10=False))
    pa, pb = local_affine(graph, be, x), local_affine(moved, be, x)
    for o in graph.outputs:
        assert np.allclose(pa.intercept[o], pb.intercept[o], rtol=1e-9, atol=1e-9)


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_backends_agree_on_patterns(data):
    graph = data.draw(relu_dags())
    x = data.draw(random_inputs(graph, integer=True))
    pn, pt = activation_pattern(graph, get_backend("numpy"), x), activation_pattern(graph, get_backend("torch"), x)
    for name in pn.relu:
        assert np.array_equal(pn.relu[name], pt.relu[name].numpy())
    for name in pn.choice:
        assert np.array_equal(pn.choice[name], pt.choice[name].numpy())


def test_chunks_and_log10():
    from pathir.ir import Dense, GraphBuilder

    b = GraphBuilder()
    x = b.input("x", (3,))
    h = b.relu("h", [(x, Dense(b.param("w1", np.ones((4, 3)))))], bias=b.param("b1", np.ones(4)))
    g = b.build(outputs=[b.identity("y", [(h, Dense(b.param("w2", np.ones((2, 4)))))])])
    xs = np.random.default_rng(0).normal(size=(7, 3))
    be = get_backend("torch")
    whole = active_path_norm(g, be, xs)
    assert np.allclose(active_path_norm(g, be, xs, chunk=2), whole, rtol=1e-14)
    with np.errstate(divide="ignore"):
        assert np.allclose(active_path_norm(g, be, xs, log10=True), np.log10(whole), rtol=1e-12)
    dead = active_path_norm(g, be, np.full((1, 3), -1e6), log10=True)  # every h off, y has no bias
    assert dead[0] == -math.inf


@pytest.mark.parametrize("backend", BACKENDS)
def test_local_affine_beyond_float64_raises_instead_of_inf(backend):
    """J of 200 layers of weight 40 (every ReLU active at x = 1) is 40^200 ≈ 10^320: beyond float64.
    The signed walks (J v, uᵀ J, the intercept) raise PathNormOverflow, not inf or nan; below
    float64's range they equal the product of the layers."""
    from pathir.errors import PathNormOverflow
    from pathir.ir import Dense, GraphBuilder

    def chain(depth):
        b = GraphBuilder("chain")
        h = b.input("x", (1,))
        for i in range(depth):
            h = b.relu(f"h{i}", [(h, Dense(b.param(f"w{i}", [[40.0]])))], bias=b.param(f"b{i}", [1.0]))
        return b.build(outputs=[h])

    be, x = get_backend(backend), np.ones((1, 1))
    small = local_affine(chain(150), be, x)
    assert _close(float(small.jvp(np.ones((1, 1)))["h149"][0, 0]), 40.0**150)
    assert _close(float(small.vjp(np.ones((1, 1)))["x"][0, 0]), 40.0**150)
    with pytest.raises(PathNormOverflow, match="does not fit in float64"):
        local_affine(chain(200), be, x)  # the intercept Σ_k 40^k ≈ 10^320


def _mlp_piece():
    torch = pytest.importorskip("torch")
    import pathir

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).double()
    cm = pathir.compile(net, input_shape=(3,))
    x = np.random.default_rng(1).normal(size=(5, 3))
    return net, cm, x


def test_vjp_refuses_an_unknown_output_a_wrong_shape_and_nan_as_jvp_does():
    """A misspelled output gave uᵀJ = 0 for every sample; NaN blamed the weights; a wrong shape a raw torch error."""
    from pathir.errors import InputShapeError

    _, cm, x = _mlp_piece()
    piece = cm.local_affine(x)
    out = cm.graph.outputs[0]
    for u, match in (({"logits": np.ones((5, 2))}, "name no output"), ({out: np.ones((5, 3))}, "expects"),
                     ({out: np.ones((4, 2))}, "expects"), ({out: np.full((5, 2), np.nan)}, "NaN")):
        with pytest.raises(InputShapeError, match=match):
            piece.vjp(u)
    assert np.abs(piece.vjp({out: np.ones((1, 2))})[cm.graph.inputs[0]]).max() > 0


def test_a_reversed_array_and_unknown_input_names():
    """x[::-1] (a negative stride) gave a BackendError where output_bound read it; a key naming no input was ignored."""
    from pathir.errors import InputShapeError

    net, cm, x = _mlp_piece()
    reversed_view = x[::-1]
    np.testing.assert_array_equal(cm.active_path_norm(reversed_view), cm.active_path_norm(reversed_view.copy()))
    with pytest.raises(InputShapeError, match="name no input"):
        cm.active_path_norm({cm.graph.inputs[0]: x, "typo": x})


def test_an_empty_batch_and_a_direction_that_requires_grad():
    """0 samples: a raw ValueError (path-norms) or a BackendError (local_affine); a direction with requires_grad:
    BackendError in jvp only."""
    torch = pytest.importorskip("torch")
    from pathir.errors import InputShapeError

    net, cm, x = _mlp_piece()
    for method in (cm.active_path_norm, cm.active_path_counts, cm.local_affine):
        with pytest.raises(InputShapeError, match="empty batch"):
            method(np.zeros((0, 3)))
    v = torch.tensor(x, requires_grad=True)
    J = np.stack([torch.autograd.functional.jacobian(net, torch.tensor(r)).numpy() for r in x])
    np.testing.assert_allclose(cm.local_affine(x).jvp(v)[cm.graph.outputs[0]], np.einsum("bij,bj->bi", J, x),
                               rtol=1e-12, atol=1e-14)
