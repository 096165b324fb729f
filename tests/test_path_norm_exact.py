"""The path-norm / path-count fast path (pathnorm.py over path_view) equals path enumeration."""

import math

import numpy as np
import pytest
from hypothesis import given, settings

import pathir
from pathir.ir import Dense, GraphBuilder, NodeKind
from pathir.neurons.expand import expand
from pathir.neurons.paths import enumerate_num_paths, enumerate_path_norm, enumerate_paths, phi
from pathir.testing import mlps, relu_dags


def _torch_backend_available() -> bool:
    try:
        import pathir.backends.torch  # noqa: F401
    except ImportError:
        return False
    return True


BACKENDS = [
    "numpy",
    pytest.param("torch", marks=pytest.mark.skipif(not _torch_backend_available(), reason="backends/torch.py not importable")),
]
QS = (0.5, 1, 2, 3)


def _check_against_enumeration(graph, backend):
    cm = pathir.compile(graph, backend=backend)
    net = expand(cm.graph)
    paths = enumerate_paths(net)
    Phi = phi(net, paths)
    for q in QS:
        expected = math.fsum(np.abs(Phi) ** q) ** (1 / q)
        assert cm.path_norm(q) == pytest.approx(expected, rel=1e-12, abs=0)
        if expected > 0:
            assert cm.path_norm(q, log10=True) == pytest.approx(math.log10(expected), rel=1e-12, abs=1e-12)
    assert cm.num_paths() == pytest.approx(len(paths), rel=1e-12, abs=0)


@settings(max_examples=250)
@given(graph=relu_dags())
def test_path_norms_and_count_equal_enumeration_numpy(graph):
    _check_against_enumeration(graph, "numpy")


@pytest.mark.skipif(not _torch_backend_available(), reason="backends/torch.py not importable")
@settings(max_examples=120)
@given(graph=relu_dags())
def test_path_norms_and_count_equal_enumeration_torch(graph):
    _check_against_enumeration(graph, "torch")


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40)
@given(graph=mlps())
def test_mlp_path_norms_equal_enumeration(graph, backend):
    cm = pathir.compile(graph, backend=backend)
    for q in QS:
        assert cm.path_norm(q) == pytest.approx(enumerate_path_norm(graph, q), rel=1e-12, abs=0)


def _layered_count(widths, bias: bool) -> int:
    """Input paths prod(d_0..d_L); with biases, each layer l >= 1 adds prod(d_l..d_L) bias paths."""
    count = math.prod(widths)
    if bias:
        count += sum(math.prod(widths[l:]) for l in range(1, len(widths)))
    return count


@settings(max_examples=40)
@given(graph=mlps(bias=False, max_depth=4))
def test_layered_without_biases_has_prod_widths_paths(graph):
    widths = [n.shape[0] for n in graph.nodes]
    assert enumerate_num_paths(graph) == math.prod(widths)
    assert pathir.compile(graph).num_paths(backend="numpy") == pytest.approx(math.prod(widths), rel=1e-12)


@settings(max_examples=40)
@given(graph=mlps(bias=True, max_depth=4))
def test_layered_with_biases_count_formula(graph):
    widths = [n.shape[0] for n in graph.nodes]
    assert enumerate_num_paths(graph) == _layered_count(widths, True)
    assert pathir.compile(graph).num_paths(backend="numpy") == pytest.approx(_layered_count(widths, True), rel=1e-12)


def test_layered_count_formula_by_hand():
    assert _layered_count((4, 3, 2), True) == 24 + 6 + 2
    assert _layered_count((4, 3, 2), False) == 24


def test_zero_weights_still_count_as_paths():
    b = GraphBuilder()
    x = b.input("x", (2,))
    h = b.relu("h", [(x, Dense(b.param("w1", [[0.0, 1.0], [2.0, 0.0]])))], bias=b.param("b1", [0.0, 1.0]))
    y = b.identity("y", [(h, Dense(b.param("w2", [[1.0, 3.0]])))])
    cm = pathir.compile(b.build(outputs=[y]), backend="numpy")
    assert enumerate_num_paths(cm.graph) == 6
    assert cm.num_paths() == pytest.approx(6, rel=1e-12)
    # l1: paths x0-h1-y (2*3), x1-h0-y (1*1), bias h1 (1*3); the zero ones add nothing
    assert cm.path_norm(1) == pytest.approx(10.0, rel=1e-12)


# --------------------------------------------------------------- overflow


def _chain(depth: int, width: int, weight: float, name: str = "chain"):
    """``depth`` dense layers of ``width`` neurons, every weight equal to ``weight``, no biases."""
    b = GraphBuilder(name)
    prev = b.input("x", (width,))
    for i in range(depth):
        kind = NodeKind.IDENTITY if i == depth - 1 else NodeKind.RELU
        prev = b.node(f"h{i}", kind, [(prev, Dense(b.param(f"w{i}", np.full((width, width), weight))))])
    return b.build(outputs=[prev])


def test_l1_path_norm_beyond_float64_is_exact_in_log10():
    depth, width, w = 300, 2, 10.0
    cm = pathir.compile(_chain(depth, width, w), backend="numpy")
    # width^(depth+1) paths, each of product w^depth
    log10_paths = (depth + 1) * math.log10(width)
    assert cm.num_paths(log10=True) == pytest.approx(log10_paths, rel=1e-12)
    for q in (1, 2):
        expected = (log10_paths + q * depth * math.log10(w)) / q
        assert expected > 308
        assert cm.path_norm(q, log10=True) == pytest.approx(expected, rel=1e-12)
        with pytest.raises(pathir.PathNormOverflow, match="log10=True"):
            cm.path_norm(q)


def test_path_count_beyond_float64():
    depth, width = 400, 10
    cm = pathir.compile(_chain(depth, width, 1.0), backend="numpy")
    assert cm.num_paths(log10=True) == pytest.approx(depth + 1, rel=1e-12)
    with pytest.raises(pathir.PathNormOverflow):
        cm.num_paths()
    assert cm.path_norm(1, log10=True) == pytest.approx(depth + 1, rel=1e-12)


def test_tiny_path_norm_is_exact_in_log10():
    depth, width, w = 300, 2, 0.01
    cm = pathir.compile(_chain(depth, width, w), backend="numpy")
    expected = (depth + 1) * math.log10(width) + depth * math.log10(w)
    assert expected < -308 - 16  # below the smallest subnormal float64
    assert cm.path_norm(1, log10=True) == pytest.approx(expected, rel=1e-12)
    assert cm.path_norm(1) == 0.0  # underflows to zero; the log10 form is the faithful one


def _scalar_chain(weights):
    b = GraphBuilder()
    prev = b.input("x", (1,))
    for i, w in enumerate(weights):
        prev = b.relu(f"h{i}", [(prev, Dense(b.param(f"w{i}", [[w]])))])
    return b.build(outputs=[prev])


@pytest.mark.parametrize("q, e", [(1, 200), (2, 100), (3, 70)])
def test_intermediate_underflow_does_not_lose_the_norm(q, e):
    """Weights 10^-e, 10^-e, 10^e, 10^e: partial products of |w|^q fall below 1e-308, the norm is 1."""
    graph = _scalar_chain([10.0**-e, 10.0**-e, 10.0**e, 10.0**e])
    assert pathir.compile(graph, backend="numpy").path_norm(q) == pytest.approx(1.0, rel=1e-12)
    if q == 1:
        assert enumerate_path_norm(graph, q) == 0.0  # the plain float product of the definition underflows
