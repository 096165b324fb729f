"""diag G (docs/math.md §6) against path enumeration, its rescaling law and its overflow handling."""

import math

import numpy as np
import pytest
from enumerated import path_factors
from hypothesis import given, settings
from hypothesis import strategies as st

import pathir
from pathir.analyses.find_units import find_units
from pathir.analyses.incidence import incidence
from pathir.errors import PathNormOverflow
from pathir.ir import Conv, Dense, GraphBuilder, Identity, Pool, Reshape
from pathir.lifting.diag_g import diag_g, diag_g_flat
from pathir.rescaling.apply import rescale_graph
from pathir.testing import mlps, relu_dags, rescalings

BACKENDS = ["numpy", "torch"]


def enumerated_diag_g(graph) -> np.ndarray:
    """g_i = sum over paths p through θ_i of the product of p's other factors, squared (fixed ones too)."""
    factors, layout = path_factors(graph)
    g = np.zeros(len(layout))
    for const, free in factors:
        for j, (i, _) in enumerate(free):
            others = [w for jj, (_, w) in enumerate(free) if jj != j]
            g[i] += (const * math.prod(others)) ** 2
    return g


def _flat(graph, backend):
    g, log_max = diag_g_flat(graph, backend)
    return g * math.exp(log_max) if log_max > -math.inf else g


def _close(a, b, rtol=1e-10):
    return np.abs(a - b).max(initial=0) <= rtol * max(np.abs(b).max(initial=0), 1e-300)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=100)
@given(graph=relu_dags())
def test_diag_g_equals_enumeration(backend, graph):
    assert _close(_flat(graph, backend), enumerated_diag_g(graph))


@settings(max_examples=20)
@given(mlps())
def test_diag_g_equals_enumeration_on_mlps(graph):
    assert _close(_flat(graph, "numpy"), enumerated_diag_g(graph))


def test_diag_g_on_conv_maxpool_skip_and_shared_weights():
    rng = np.random.default_rng(3)
    b = GraphBuilder()
    x = b.input("x", (2, 4, 4))
    W = b.param("shared", rng.normal(size=(2, 2, 3, 3)))  # read by two convs
    a = b.relu("a", [(x, Conv(W, (1, 1), ((1, 1), (1, 1)), (1, 1)))], bias=b.param("ba", rng.normal(size=2)))
    c = b.relu("c", [(a, Conv(W, (1, 1), ((1, 1), (1, 1)), (1, 1))), (a, Identity())], bias=b.param("bc", rng.normal(size=2)))
    p = b.maxpool("p", c, Pool((2, 2), (2, 2), ((0, 0), (0, 0)), (1, 1)), k=2)
    avg = b.identity("avg", [(p, Pool((2, 2), (2, 2), ((0, 0), (0, 0)), (1, 1), mult=np.full((1, 1), 0.25)))])
    y = b.identity("y", [(avg, Reshape((2,)))], bias=b.param("by", rng.normal(size=2)))
    graph = b.build(outputs=[y])
    expected = enumerated_diag_g(graph)
    for backend in BACKENDS:
        assert _close(_flat(graph, backend), expected)
    per_source = diag_g(graph, "numpy")
    assert list(per_source) == ["shared", "ba", "bc", "by"]
    assert per_source["shared"].shape == (2, 2, 3, 3)
    assert _close(np.concatenate([v.ravel() for v in per_source.values()]), expected)


@settings(max_examples=30)
@given(st.data())
def test_diag_g_transforms_as_g_times_exp_bz(data):
    graph = data.draw(relu_dags())
    z = data.draw(rescalings(graph))
    _, units = find_units(graph)
    B, _ = incidence(graph, units)
    before = _flat(graph, "numpy")
    after = _flat(rescale_graph(graph, units, z), "numpy")
    assert _close(after, before * np.exp(B @ z), rtol=1e-9)


def _deep_chain(depth: int, weight: float):
    b = GraphBuilder("chain")
    v = b.input("x", (1,))
    for k in range(depth):
        v = b.relu(f"h{k}", [(v, Dense(b.param(f"w{k}", [[weight]])))])
    y = b.identity("y", [(v, Dense(b.param("out", [[weight]])))])
    return b.build(outputs=[y])


@pytest.mark.parametrize("backend", BACKENDS)
def test_diag_g_beyond_float64_raises_and_the_flat_form_keeps_its_log(backend):
    graph = _deep_chain(depth=200, weight=100.0)  # g = 100^(2*200) = 1e800 for every weight
    with pytest.raises(PathNormOverflow, match="diag G of param 'w0' reaches about 10\\^800"):
        diag_g(graph, backend)
    g, log_max = diag_g_flat(graph, backend)
    assert np.allclose(g, 1.0, rtol=1e-12) and math.isclose(log_max, 400 * math.log(100.0), rel_tol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_diag_g_below_float64_raises_rather_than_reading_as_no_path(backend):
    """w2 = 1e-170: g(w1) = w2² = 1e-340, which float64 holds as 0, "no path through w1" (review); a value that
    lands on a subnormal (w2 = 1e-161: 1e-322) is returned."""
    def net(w2):
        b = GraphBuilder("tiny")
        h = b.relu("h", [(b.input("x", (2,)), Dense(b.param("w1", [[1.0, 2.0], [0.5, 1.0]])))])
        return b.build(outputs=[b.identity("y", [(h, Dense(b.param("w2", [[w2, w2]])))])])

    with pytest.raises(PathNormOverflow, match="diag G of param 'w1' falls to about 10\\^-340"):
        diag_g(net(1e-170), backend)
    assert np.all(diag_g(net(1e-161), backend)["w1"] > 0)


def test_diag_g_flat_is_normalised_by_its_maximum():
    graph = _deep_chain(depth=3, weight=2.0)
    g, log_max = diag_g_flat(graph, "numpy")
    assert g.max() == 1.0 and math.isclose(log_max, math.log(4.0**3), rel_tol=1e-14)


def test_compiled_diag_g_reports_under_source_names():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8, 2)
    )
    cm = pathir.compile(net, input_shape=(1, 4, 4))
    g = cm.diag_g(backend="numpy")
    assert list(g) == ["0.weight", "1.bias", "4.weight", "4.bias"]
    assert g["0.weight"].shape == (2, 1, 3, 3) and g["4.weight"].shape == (2, 8)
    assert _close(np.concatenate([v.ravel() for v in g.values()]), enumerated_diag_g(cm.graph))


def test_concat_operands_added_as_slices_match_the_definition():
    """A dense block (each layer reads the concat of all before it): every concat operand is all of its source,
    in order, into one run of channels, which the torch walks add as a slice and differentiate as a view. Path
    norms and diag G against path enumeration, on the ones walk (torch) and the plain walk (numpy)."""
    torch = pytest.importorskip("torch")
    from pathir.lifting.path_norm import log_path_sum
    from pathir.neurons.paths import enumerate_path_norm

    class Dense(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Conv2d(1, 2, 3, padding=1)
            self.a, self.b = torch.nn.Conv2d(2, 2, 3, padding=1), torch.nn.Conv2d(4, 1, 1)
            self.head = torch.nn.Linear(5 * 9, 2)

        def forward(self, x):
            h = torch.relu(self.stem(x))
            h = torch.cat([h, torch.relu(self.a(h))], 1)
            h = torch.cat([h, torch.relu(self.b(h))], 1)
            return self.head(h.flatten(1))

    torch.manual_seed(0)
    cm = pathir.compile(Dense().double().eval(), input_shape=(1, 3, 3))
    assert any(e.map.kind.name == "CHANNEL_MAP" for n in cm.graph.nodes for e in n.edges)
    for backend in BACKENDS:
        be = pathir.backends.get_backend(backend)
        for q in (1.0, 2.0):
            assert math.exp(log_path_sum(cm.graph, q, be)) == pytest.approx(enumerate_path_norm(cm.graph, q) ** q, rel=1e-10)
        assert _close(_flat(cm.graph, backend), enumerated_diag_g(cm.graph))


def _two_units(out_weights):
    torch = pytest.importorskip("torch")
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1)).double()
    with torch.no_grad():
        net[0].weight.fill_(1.0), net[0].bias.fill_(1.0), net[2].bias.fill_(1.0)
        net[2].weight.copy_(torch.tensor([out_weights], dtype=torch.float64))
    return pathir.compile(net, input_shape=(2,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_diag_g_entries_spread_over_hundreds_of_decades_are_exact_each(backend):
    cm = _two_units([1e100, 1e-50])  # g of layer 0's rows: 1e200 and 1e-100, both representable
    g = cm.diag_g(backend=backend)["0.weight"]
    assert np.allclose(g, [[1e200, 1e200], [1e-100, 1e-100]], rtol=1e-12, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_diag_g_wider_than_one_float64_scale_is_refused_not_read_as_zero(backend):
    cm = _two_units([1e150, 1e-50])  # 1e300 and 1e-100 in one tensor: one log-scale would read 1e-100 as 0
    with pytest.raises(PathNormOverflow, match="diag G of param '0.weight' spans e\\^-230 to e\\^691"):
        cm.diag_g(backend=backend)
    with pytest.raises(PathNormOverflow, match="cm.enorm\\(\\) balances them first"):
        cm.pathcond(write_back=False)  # its optimum would take the 1e-100 unit for degenerate
    cm.enorm()
    g = cm.diag_g(backend=backend)["0.weight"]
    assert (g > 0).all()
