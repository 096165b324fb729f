"""cm.enorm() and cm.normalize() / passes.normalize (docs/math.md §8)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
nn = torch.nn

from torch_models import randomize_bn as _randomize_bn  # noqa: E402

import pathir  # noqa: E402
from pathir.analyses.find_units import find_units  # noqa: E402
from pathir.enorm.normalize import normalize, normalize_log_scales  # noqa: E402
from pathir.errors import PathirError  # noqa: E402
from pathir.ir import Conv, Dense, GraphBuilder, Identity, Reshape  # noqa: E402
from pathir.rescaling.apply import rescale_graph  # noqa: E402
from pathir.testing import relu_dags, rescalings  # noqa: E402


def cnn(seed=0):
    torch.manual_seed(seed)
    return _randomize_bn(nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4, 3),
    )).double().eval()


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)).double()


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _forward(graph, x):
    out = pathir.compile(graph).forward(x, "numpy")
    return list(out.values()) if isinstance(out, dict) else [out]


def _inputs(graph, seed=0):
    rng = np.random.default_rng(seed)
    return {n.name: rng.normal(size=(3, *n.shape)) for n in graph.nodes if n.kind.name == "INPUT"}


def _phi(graph):
    from pathir.neurons.expand import expand
    from pathir.neurons.paths import enumerate_paths, phi

    net = expand(graph)
    return phi(net, enumerate_paths(net))


def _incoming_norms(graph, p):
    _, units = find_units(graph)
    return np.array([sum(float((np.abs(q.value.ravel()[idx]) ** p).sum()) for q, idx in u.incoming) for u in units])


# ------------------------------------------------------------------ ENorm


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0])
@pytest.mark.parametrize("solver", ["newton", "block", "coordinate"])
def test_enorm_decreases_monotonically_and_preserves_the_function(p, solver):
    model = cnn()
    x = torch.randn(5, 2, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        before = model(x)
    cm = pathir.compile(model, input_shape=(2, 6, 6))
    theta = cm.incidence()[1].theta()
    report = cm.enorm(p=p, solver=solver)
    assert report.converged and report.criterion_after < report.criterion_before
    assert np.all(np.diff(report.history) <= 1e-12 * report.criterion_before)
    assert report.criterion_before == pytest.approx(np.sum(np.abs(theta) ** p), rel=1e-12)
    # the criterion is Σ|θ|^p of the rescaled graph, which is the written model's
    assert report.criterion_after == pytest.approx(np.sum(np.abs(cm.incidence()[1].theta()) ** p), rel=1e-9)
    fresh = pathir.compile(model, input_shape=(2, 6, 6)).incidence()[1].theta()
    np.testing.assert_allclose(fresh, cm.incidence()[1].theta(), rtol=1e-10, atol=1e-14)
    with torch.no_grad():
        assert _rel(model(x), before) <= 1e-10
    assert report.imbalance <= 1e-6


def test_enorm_fixed_point_balances_every_unit():
    cm = pathir.compile(mlp(), input_shape=(6,))
    cm.enorm(p=2, tol=1e-13)
    B, layout = cm.incidence()
    w = layout.theta() ** 2
    out_mass, in_mass = B.maximum(0).T @ w, (-B).maximum(0).T @ w
    np.testing.assert_allclose(out_mass, in_mass, rtol=1e-8)


def test_enorm_costs_weigh_the_criterion():
    cm = pathir.compile(mlp(), input_shape=(6,))
    _, layout = cm.incidence()
    costs = {"0.weight": 1.0, "2.weight": 2.0, "4.weight": 3.0}
    c = np.ones(len(layout))
    for name, v in costs.items():
        c[layout.slice(name)] = v
    report = cm.enorm(costs=costs, write_back=False)
    assert report.criterion_before == pytest.approx(float(c @ layout.theta() ** 2), rel=1e-12)
    again = cm.enorm(costs=c, write_back=False)
    np.testing.assert_allclose(again.z, report.z)
    with pytest.raises(KeyError, match="no parameter"):
        cm.enorm(costs={"nope": 1.0})
    with pytest.raises(ValueError, match="one entry per parameter"):
        cm.enorm(costs=np.ones(3))


@pytest.mark.parametrize("p", [1.0, 2.0])
@pytest.mark.parametrize("solver", ["newton", "block"])
def test_zero_costs_on_one_side_make_degenerate_units_not_an_underflow(p, solver):
    """costs of 0 on every weight leaving a layer: its units have no mass on that side (math.md: kept at z = 0 and
    reported); they were refused as '|θ|^p underflows float64', 'use a smaller p' even at p = 1 (units review)."""
    cm = pathir.compile(mlp(), input_shape=(6,))
    report = cm.enorm(p=p, costs={"2.weight": 0.0}, solver=solver, write_back=False)
    first = [u for u in report.degenerate_units if u.startswith("0:")]
    assert len(first) == 5 and len(report.degenerate_units) == 5
    assert all(report.z[cm.units.index(u)] == 0 for u in first) and np.any(report.z != 0)


def test_enorm_dead_unit_and_report():
    model = mlp()
    with torch.no_grad():
        model[2].weight[2].zero_(), model[2].bias[2].zero_()
    cm = pathir.compile(model, input_shape=(6,))
    report = cm.enorm()
    assert report.degenerate_units == ("2:c2",) and report.z[cm.units.index("2:c2")] == 0
    text = str(report)
    assert "Σ c |θ|^2" in text and "2:c2" in text
    assert set(report.to_dict()) >= {"criterion_before", "criterion_after", "sweeps", "degenerate_units"}


# ------------------------------------------------------------------ normalisation


def _residual(scale, seed=0):
    """stem -> block (conv1, conv2 + skip) -> dense: the stream and the inner channels form a cycle of units."""
    rng = np.random.default_rng(seed)
    b = GraphBuilder("block")
    x = b.input("x", (1, 3, 3))

    def conv(name, o, i):
        return Conv(b.param(name, scale * rng.normal(size=(o, i, 3, 3))), (1, 1), ((1, 1), (1, 1)), (1, 1))

    a = b.relu("stem", [(x, conv("stem.weight", 2, 1))], bias=b.param("stem.bias", rng.normal(size=2)))
    h = b.relu("layer1.conv1", [(a, conv("layer1.conv1.weight", 2, 2))], bias=b.param("b1", rng.normal(size=2)))
    s = b.relu("layer1.out", [(h, conv("layer1.conv2.weight", 2, 2)), (a, Identity())])
    f = b.identity("flat", [(s, Reshape((18,)))])
    y = b.identity("fc", [(f, Dense(b.param("fc.weight", rng.normal(size=(1, 18)))))])
    return b.build(outputs=[y])


@settings(max_examples=40)
@given(st.data(), st.sampled_from([1.0, 2.0]))
def test_normalize_is_canonical_on_random_dags(data, p):
    graph = data.draw(relu_dags())
    _, units = find_units(graph)
    z = data.draw(rescalings(graph))
    moved = rescale_graph(graph, units, z)
    try:
        result = normalize_log_scales(graph, units, p)
    except PathirError as err:  # a cycle of units with too much mass: a property of the orbit
        assert "spectral" in str(err) or "only receive" in str(err)
        with pytest.raises(PathirError):
            normalize(moved, p, units)
        return
    a, b = rescale_graph(graph, units, result.z), normalize(moved, p, units)
    x = _inputs(graph)
    for u, v in zip(_forward(graph, x), _forward(a, x)):  # the function is unchanged
        np.testing.assert_allclose(u, v, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(_phi(a), _phi(graph), rtol=1e-9, atol=1e-12)  # and so is Φ, path by path
    live = np.ones(len(units), bool)
    live[result.degenerate] = False
    np.testing.assert_allclose(_incoming_norms(a, p)[live], 1.0, rtol=1e-9)
    if result.degenerate.size == 0:  # dead units keep z = 0, so only live orbits are canonical
        for pa, pb in zip(a.params(), b.params()):
            np.testing.assert_allclose(pa.value, pb.value, rtol=1e-9, atol=1e-12)
        for pa, pc in zip(a.params(), normalize(a, p, units).params()):  # idempotent
            np.testing.assert_allclose(pa.value, pc.value, rtol=1e-9, atol=1e-12)


def test_normalize_on_a_dag_is_the_topological_pass():
    """On an MLP the result is visiting the units in order, normalising each (docs/math.md §8)."""
    model = mlp()
    cm = pathir.compile(model, input_shape=(6,))
    Ws = [model[i].weight.detach().numpy().copy() for i in (0, 2, 4)]
    bs = [model[i].bias.detach().numpy().copy() for i in (0, 2, 4)]
    for layer in range(2):  # layer by layer is a topological order of the units
        norms = np.sqrt((Ws[layer] ** 2).sum(1) + bs[layer] ** 2)
        Ws[layer] /= norms[:, None]
        bs[layer] /= norms
        Ws[layer + 1] *= norms[None, :]
    report = cm.normalize(p=2)
    assert report.cycles == 0 and report.degenerate_units == ()
    for i, W, b in zip((0, 2, 4), Ws, bs):
        np.testing.assert_allclose(model[i].weight.detach().numpy(), W, rtol=1e-12)
        np.testing.assert_allclose(model[i].bias.detach().numpy(), b, rtol=1e-12)


def test_normalize_solves_a_cycle_of_units_and_is_canonical():
    graph = _residual(0.1)
    _, units = find_units(graph)
    result = normalize_log_scales(graph, units, 2)
    assert result.cycles == 1
    a = rescale_graph(graph, units, result.z)
    np.testing.assert_allclose(_incoming_norms(a, 2), 1.0, rtol=1e-10)
    for seed in range(3):
        z = np.random.default_rng(seed).uniform(-3, 3, len(units))
        b = normalize(rescale_graph(graph, units, z), 2, units)
        for pa, pb in zip(a.params(), b.params()):
            np.testing.assert_allclose(pa.value, pb.value, rtol=1e-9, atol=1e-13)
    x = _inputs(graph)
    np.testing.assert_allclose(_forward(graph, x)[0], _forward(a, x)[0], rtol=1e-10)


def test_normalize_refuses_a_cycle_without_a_normalisation_and_leaves_the_model():
    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(1, 2, 3, padding=1)
            self.conv1, self.conv2 = nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 3, padding=1)
            self.fc = nn.Linear(18, 1)

        def forward(self, x):
            a = torch.relu(self.stem(x))
            return self.fc(torch.flatten(torch.relu(a + self.conv2(torch.relu(self.conv1(a)))), 1))

    torch.manual_seed(0)
    model = Res().double()
    with torch.no_grad():
        model.conv1.weight.mul_(10), model.conv2.weight.mul_(10)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    cm = pathir.compile(model, input_shape=(1, 3, 3))
    with pytest.raises(PathirError, match="spectral radius"):
        cm.normalize()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    cm.enorm()  # ENorm needs no such condition


def test_cm_normalize_writes_back():
    model = cnn()
    x = torch.randn(4, 2, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        before = model(x)
    cm = pathir.compile(model, input_shape=(2, 6, 6))
    report = cm.normalize(p=1)
    with torch.no_grad():
        assert _rel(model(x), before) <= 1e-10
    fresh = pathir.compile(model, input_shape=(2, 6, 6))
    np.testing.assert_allclose(_incoming_norms(fresh.graph, 1), 1.0, rtol=1e-9)
    assert "normalised, l1" in str(report) and report.to_dict()["units"] == len(cm.units)
    again = fresh.normalize(p=1, write_back=False)
    assert again.max_abs_log_scale <= 1e-9  # already canonical


def test_normalize_pass_leaves_its_input_alone():
    graph = _residual(0.1)
    values = [p.value.copy() for p in graph.params()]
    out = normalize(graph)
    assert out is not graph
    for v, p in zip(values, graph.params()):
        np.testing.assert_array_equal(v, p.value)
    with pytest.raises(ValueError, match="p must be a finite number > 0"):
        normalize(graph, p=0)


def _scaled_mlp(*factors):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 5), torch.nn.ReLU(),
                              torch.nn.Linear(5, 3)).double()
    with torch.no_grad():
        for layer, f in zip(net[::2], factors):
            layer.weight.mul_(f)
            layer.bias.mul_(f)
    return net


@pytest.mark.parametrize("factors, what", [((1.0, 1e300, 1.0), "overflows"), ((1e-170, 1.0, 1.0), "underflows")])
def test_powers_outside_float64_are_refused_not_read_as_degenerate_or_minus_inf(factors, what):
    """|θ|² of 1e300 overflowed: normalize reported z = -inf for five units (no error); |θ|² of 1e-170
    underflowed: every unit of that layer was listed as degenerate (no nonzero incoming entry), z = 0."""
    net = _scaled_mlp(*factors)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    cm = pathir.compile(net, input_shape=(4,))
    with pytest.raises(PathirError, match=f"normalize: .θ.\\^2 {what} float64"):
        cm.normalize(p=2)
    assert cm.normalize(p=1, write_back=False).degenerate_units == []  # |θ| itself is in range
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())


def test_enorm_on_layers_scaled_far_apart_keeps_the_function():
    """Pair masses spanning more than 1e-282 of their largest were kept linear: the smallest was 0, and
    math.log(0) ended ENorm in a bare ValueError."""
    net = _scaled_mlp(1e100, 1e-100, 1.0)
    x = torch.randn(8, 4, dtype=torch.float64)
    before = net(x).detach()
    pathir.compile(net, input_shape=(4,)).enorm(p=2)
    assert torch.allclose(net(x), before, rtol=1e-9, atol=0)


@pytest.mark.parametrize("costs", [{"0.weight": -1.0}, {"2.bias": float("nan")}])
def test_enorm_refuses_negative_or_nan_costs_naming_them(costs):
    """A negative cost was refused as 'g must be finite and non-negative', naming an internal array."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).double()
    cm = pathir.compile(net, input_shape=(3,))
    state = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(pathir.errors.ArgumentError, match="costs must be finite and non-negative"):
        cm.enorm(costs=costs)
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in state.items())
