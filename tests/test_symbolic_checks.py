"""verify_symbolic: passes on random graphs, fails the right check on broken
inputs (with a counterexample), and finds rank DΦ = n − H on layered networks."""

import numpy as np
import pytest
import sympy as sp
from hypothesis import given, settings

import pathir
from pathir.analyses.find_units import find_units
from pathir.analyses.incidence import incidence
from pathir.backends.sympy import SympyBackend, exact, symbol
from pathir.errors import GraphTooLarge
from pathir.ir import Dense, GraphBuilder, Identity
from pathir.neurons.symbolic import (
    CHECK_NAMES,
    Check,
    SymbolicReport,
    conservation_law_expressions,
    conservation_laws,
    verify_symbolic,
)
from pathir.testing import mlps, relu_dags


def names(report):
    return [c.name for c in report.checks]


@settings(max_examples=150)
@given(relu_dags(max_paths=600, max_neurons=80))
def test_every_check_passes_on_random_dags(graph):
    report = verify_symbolic(graph)
    assert report.passed, f"{report}\n{graph}"
    assert names(report) == list(CHECK_NAMES)
    assert report.num_units == len(find_units(graph)[1]) and report.num_params == graph.num_params()
    assert report.rank <= report.num_params - report["rank"].data["unit_directions"]
    assert all(c.counterexample is None for c in report.checks)


@settings(max_examples=15)
@given(mlps())
def test_every_check_passes_on_random_mlps(graph):
    assert verify_symbolic(graph, seed=3).passed


MATH_9_WIDTHS = [(2, 2, 1), (2, 3, 2), (3, 4, 2), (4, 3, 3, 2), (2, 5, 5, 2), (5, 2, 5), (1, 3, 1), (3, 2, 2, 3)]


@pytest.mark.parametrize("widths", MATH_9_WIDTHS, ids=lambda w: "-".join(map(str, w)))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_rank_of_dphi_is_n_minus_h_on_layered_networks(widths, bias):
    @settings(max_examples=2)
    @given(mlps(widths=widths, bias=bias))
    def check(graph):
        report = verify_symbolic(graph)
        assert report.passed, str(report)
        data = report["rank"].data
        hidden = sum(widths[1:-1])
        assert data["H"] == hidden and data["n"] == graph.num_params()
        assert data["rank"] == data["n"] - data["H"] == data["n_minus_H"], str(report)
        assert "= n − H" in report["rank"].detail

    check()


def test_rank_is_reported_below_n_minus_h_when_params_lie_on_no_path():
    """h[1]'s output is dropped by a gather: its incoming weights are on no
    path, so DΦ has two zero columns but only one unit direction among them."""
    from pathir.ir import Gather

    b = GraphBuilder("dropped")
    x = b.input("x", (2,))
    h = b.relu("h", [(x, Dense(b.param("w", [[1.0, -2.0], [0.5, 1.5]])))])
    g = b.identity("g", [(h, Gather(np.array([0]), (1,)))])
    y = b.identity("y", [(g, Dense(b.param("v", [[3.0]])))])
    report = verify_symbolic(b.build(outputs=[y]))
    data = report["rank"].data
    assert report.passed
    assert (data["rank"], data["n"], data["H"], data["paths"]) == (2, 5, 2, 2)
    assert "rank DΦ = 2 < n − H = 3" in report["rank"].detail


# ------------------------------------------------------------ broken inputs


def skip_pair():
    """The same params in two graphs: without, and with, a skip h -> y."""
    def build(skip):
        b = GraphBuilder("skip" if skip else "plain")
        x = b.input("x", (2,))
        h = b.relu("h", [(x, Dense(w1))], bias=b1)
        edges = [(h, Dense(w2))] + ([(h, Identity())] if skip else [])
        y = b.identity("y", edges)
        return b.build(outputs=[y])

    w1 = GraphBuilder.param("w1", [[1.0, -2.0], [0.5, 1.5]])
    b1 = GraphBuilder.param("b1", [0.5, -0.25])
    w2 = GraphBuilder.param("w2", [[2.0, -1.0], [1.0, 3.0]])
    return build(False), build(True)


def test_units_that_ignore_a_skip_fail_invariance_conservation_and_rank():
    plain, skip = skip_pair()
    assert len(find_units(skip)[1]) == 0  # the skip ties h to the output
    report = verify_symbolic(skip, units=find_units(plain)[1])
    assert not report.passed
    failed = {c.name for c in report.failed}
    # and the rank exceeds n − H: the wrong unit directions are not in ker DΦ
    assert failed == {"rescaling_invariance", "conservation_laws", "rank"}, str(report)
    assert report["rank"].counterexample == {"rank": 10, "bound": 8}
    for name in ("rescaling_invariance", "conservation_laws"):
        ce = report[name].counterexample
        assert ce["unit"] in ("w1:c0", "w1:c1") and "h[" in ce["path"]
        assert isinstance(ce["Phi_p"], sp.Expr)
    # the failing path is a skip path: it enters the unit and leaves through the constant 1
    ce = report["rescaling_invariance"].counterexample
    assert ce["rescaled"] != ce["Phi_p"] and ce["rescaled"].has(sp.Symbol("λ", positive=True))
    assert sp.expand(report["conservation_laws"].counterexample["sum_i dPhi_p/dtheta_i B[i,h] theta_i"]) != 0
    text = str(report)
    assert "FAIL" in text and "rescaling_invariance" in text and "unit: w1:c" in text
    assert verify_symbolic(skip).passed and verify_symbolic(plain).passed


class LeakyBackend(SympyBackend):
    """A broken backend: its ReLU lets negative values through at half slope."""

    def relu(self, x):
        return np.frompyfunc(lambda v: v if exact(v) > 0 else exact(v) / 2, 1, 1)(x).astype(object)


def test_a_wrong_forward_fails_the_lifting_identity_only():
    _, skip = skip_pair()
    report = verify_symbolic(skip, backend=LeakyBackend, samples=3)
    assert [c.name for c in report.failed] == ["lifting_identity"], str(report)
    ce = report["lifting_identity"].counterexample
    assert set(ce) >= {"theta", "x", "output", "forward"}
    assert ce["forward"] != ce["sum_p Phi_p a_p (A[x;1])_p"]
    assert ce["output"].startswith("y[")


def test_a_wrong_path_view_fails_the_path_norm_check(monkeypatch):
    import pathir.neurons.symbolic as symbolic

    real = symbolic.path_view

    def no_fixed_weights(graph, q=1.0):  # forgets the constant edges (skip, pools)
        view = real(graph, q)
        nodes = [n if not n.edges else type(n)(n.name, n.kind, n.shape, tuple(e for e in n.edges if e.map.weight is not None) or n.edges, n.bias, n.k, n.origin) for n in view.nodes]
        return view.replace_nodes(nodes)

    monkeypatch.setattr(symbolic, "path_view", no_fixed_weights)  # where the check calls it
    _, skip = skip_pair()
    report = verify_symbolic(skip)
    assert [c.name for c in report.failed] == ["path_norm"], str(report)
    ce = report["path_norm"].counterexample
    assert ce["q"] == 1 and ce["path-norm pass"] < ce["sum_p |Phi_p|^q"]


def test_a_check_that_raises_is_reported_failed():
    class Broken(SympyBackend):
        def kth_max_pool(self, node, x, in_shape):
            raise RuntimeError("no max-pool today")

    from pathir.ir import Pool

    b = GraphBuilder()
    x = b.input("x", (1, 4))
    p = b.maxpool("pool", x, Pool((2,), (2,), ((0, 0),), (1,)))
    y = b.identity("y", [(p, Dense(b.param("w", [[1.0, 2.0]])))])
    report = verify_symbolic(b.build(outputs=[y]), backend=Broken)
    assert [c.name for c in report.failed] == ["lifting_identity"]
    assert "RuntimeError" in report["lifting_identity"].detail and "no max-pool today" in report["lifting_identity"].detail


def test_too_many_paths_raise_before_any_check():
    with pytest.raises(GraphTooLarge, match="max_paths=5"):
        verify_symbolic(skip_pair()[0], max_paths=5)


def test_report_surface():
    report = verify_symbolic(skip_pair()[0])
    assert isinstance(report, SymbolicReport) and all(isinstance(c, Check) for c in report.checks)
    assert report.passed and report.failed == []
    assert str(report).splitlines()[0].startswith("symbolic checks of 'plain': passed")
    assert sum(line.strip().startswith("[PASS]") for line in str(report).splitlines()) == 5
    with pytest.raises(KeyError, match="no check named"):
        report["nope"]
    with pytest.raises(Exception):
        report.checks[0].passed = False  # frozen


def test_seed_changes_the_random_point_not_the_verdict():
    g = skip_pair()[0]
    a, b = verify_symbolic(g, seed=1), verify_symbolic(g, seed=2)
    assert a.passed and b.passed
    assert a["path_norm"].data["sums"] != b["path_norm"].data["sums"]


# ------------------------------------------------------------ conservation laws


@settings(max_examples=30)
@given(relu_dags(max_paths=600, max_neurons=80))
def test_conservation_laws_are_minus_b_transpose_theta_squared(graph):
    units = find_units(graph)[1]
    B, layout = incidence(graph, units)
    theta = layout.theta()
    laws = conservation_laws(graph, units)
    assert list(laws) == list(units.names)
    assert np.allclose(list(laws.values()), -(B.T @ theta**2), rtol=1e-12, atol=1e-12)
    exprs = conservation_law_expressions(graph, units)
    at = {symbol(p.name, i): exact(v) for p in layout.params for i, v in enumerate(p.value.ravel())}
    for name, expr in exprs.items():
        assert np.isclose(float(expr.xreplace(at)), laws[name], rtol=1e-12, atol=1e-12)
    # H_h moves under the rescaling of its own unit (it is not rescaling-invariant)...
    rng = np.random.default_rng(0)
    theta2 = theta * rng.uniform(0.5, 2.0, size=theta.size)
    assert np.allclose(list(conservation_laws(graph, units, theta2).values()), -(B.T @ theta2**2))
    by_name = layout.split(theta2)
    assert conservation_laws(graph, units, by_name) == conservation_laws(graph, units, theta2)


def test_conservation_laws_of_an_mlp_by_hand():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    cm = pathir.compile(net, input_shape=(3,))
    laws = cm.conservation_laws()
    W1, b1, W2 = (t.detach().double().numpy() for t in (net[0].weight, net[0].bias, net[2].weight))
    want = (W1**2).sum(1) + b1**2 - (W2**2).sum(0)
    assert list(laws) == [f"0:c{j}" for j in range(4)]
    assert np.allclose(list(laws.values()), want, rtol=1e-12)
    exprs = cm.conservation_laws(symbolic=True)
    assert exprs["0:c1"] == sum(symbol("0.weight", 3 + i) ** 2 for i in range(3)) + symbol("0.bias", 1) ** 2 - (
        symbol("2.weight", 1) ** 2 + symbol("2.weight", 5) ** 2)
    report = cm.verify_symbolic()
    assert report.passed and report.rank == cm.graph.num_params() - len(cm.units)


def test_conservation_laws_reject_a_theta_of_the_wrong_length():
    with pytest.raises(ValueError, match="flat of length"):
        conservation_laws(skip_pair()[0], theta=np.zeros(3))


def test_conservation_laws_name_a_missing_or_misshapen_param_of_a_theta_dict():
    """A dict θ missing a param raised a bare KeyError; one of the wrong size numpy's matmul error."""
    graph = skip_pair()[0]
    full = {p.name: np.ones(np.shape(p.value)) for p in graph.params()}
    first = graph.params()[0].name
    with pytest.raises(ValueError, match=f"no entry for param.*{first}"):
        conservation_laws(graph, theta={k: v for k, v in full.items() if k != first})
    for wrong in (np.ones(np.size(full[first]) + 1), full[first].T.copy() if full[first].ndim == 2 else full[first][None]):
        if wrong.shape != full[first].shape:  # the right size in the wrong shape too (a transposed weight)
            with pytest.raises(ValueError, match=f"theta\\['{first}'\\] has shape"):
                conservation_laws(graph, theta={**full, first: wrong})
    assert conservation_laws(graph, theta=full) == conservation_laws(graph, theta=np.ones(graph.num_params()))
