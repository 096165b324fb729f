"""cm.pathcond(): exact minimisation of F (docs/math.md §7), write-back, bad input."""

import copy
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
nn = torch.nn

# ------------------------------------------------------------------ models
import written  # noqa: E402
from torch_models import ResidualBlock  # noqa: E402
from torch_models import randomize_bn as _randomize_bn

import pathir  # noqa: E402
from pathir.errors import PathirError  # noqa: E402
from pathir.testing import mlps, relu_dags  # noqa: E402


def mlp():
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))


def cnn():
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
    )


class ResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(2, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3)
        self.layer1 = nn.Sequential(ResidualBlock(3), ResidualBlock(3))
        self.down, self.bnd = nn.Conv2d(3, 4, 1, stride=2, bias=False), nn.BatchNorm2d(4)
        self.layer2 = ResidualBlock(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x = self.layer1(torch.relu(self.bn(self.stem(x))))
        x = self.layer2(torch.relu(self.bnd(self.down(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


MODELS = {"mlp": (mlp, (6,)), "cnn": (cnn, (2, 6, 6)), "resnet": (ResNet, (2, 6, 6))}


def build(name, seed=0, dtype=torch.float64):
    factory, shape = MODELS[name]
    torch.manual_seed(seed)
    return _randomize_bn(factory(), seed).to(dtype).eval(), shape


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_state(model, state):
    now = model.state_dict()
    return now.keys() == state.keys() and all(torch.equal(now[k], v) for k, v in state.items())


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# ------------------------------------------------------------------ the optimum


@pytest.mark.parametrize("name", sorted(MODELS))
def test_block_solver_reaches_the_coordinate_fixed_point(name):
    model, shape = build(name)
    cm = pathir.compile(model, input_shape=shape)
    coord = cm.pathcond(solver="coordinate", max_sweeps=100_000, tol=1e-14, write_back=False)
    block = cm.pathcond(write_back=False)
    assert coord.converged and block.converged
    assert block.objective_after <= coord.objective_after + 1e-9 * abs(coord.objective_after)
    assert block.objective_before == pytest.approx(coord.objective_before, rel=1e-12)
    assert block.objective_after < block.objective_before


def _flat_g(cm):
    from pathir.lifting.diag_g import diag_g_flat

    g, log_top = diag_g_flat(cm.graph, "numpy")
    return g, log_top


@pytest.mark.parametrize("name", sorted(MODELS))
def test_after_pathcond_diag_g_is_g_times_exp_bz_and_the_gradient_vanishes(name):
    model, shape = build(name)
    cm = pathir.compile(model, input_shape=shape)
    B, layout = cm.incidence()
    before = cm.diag_g()
    g, _ = _flat_g(cm)
    report = cm.pathcond(tol=1e-12)
    z = report.z
    factor = layout.by_source(np.exp(B @ z))
    after = cm.diag_g()
    assert after.keys() == before.keys()
    for k in before:
        np.testing.assert_allclose(after[k], before[k] * factor[k], rtol=1e-9, atol=0)
    # ∇F(z*) = n Bᵀp − Bᵀ1, p = g e^{Bz} / Σ: zero up to the solver's tolerance
    n = g.size
    ell = np.log(g) + B @ z
    p = np.exp(ell - ell.max())
    p /= p.sum()
    grad = n * (B.T @ p) - B.T @ np.ones(n)
    scale = n * (abs(B).T @ p) + np.abs(B.T @ np.ones(n))
    assert np.max(np.abs(grad) / scale) <= 1e-6
    # and the compiled graph follows the model
    fresh = pathir.compile(model, input_shape=shape)
    for a, b in zip(fresh.graph.params(), cm.graph.params()):
        np.testing.assert_allclose(a.value, b.value, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_function_preserved_in_eval_and_train_mode(name):
    model, shape = build(name)
    reference = copy.deepcopy(model)
    cm = pathir.compile(model, input_shape=shape)
    report = cm.pathcond()
    assert report.max_abs_log_scale > 1e-3 and written.moved(model, written.state(reference)) > 1e-3  # it really moved
    x = torch.randn(8, *shape, dtype=torch.float64)
    with torch.no_grad():
        assert _rel(model(x), reference(x)) <= 1e-10
        model.train(), reference.train()  # batch statistics: folded batch-norms scale with gamma, beta
        assert _rel(model(x), reference(x)) <= 1e-10
        assert _rel(model(x), reference(x)) <= 1e-10  # running statistics updated alike


def test_report_reads_well_and_serialises():
    model, shape = build("cnn")
    report = pathir.compile(model, input_shape=shape).pathcond()
    text = str(report)
    for word in ("objective F", "sweeps", "max |z|", "spread of log diag G", "degenerate units", "time"):
        assert word in text
    d = json.loads(json.dumps(report.to_dict()))
    for key in ("objective_before", "objective_after", "sweeps", "max_abs_log_scale", "seconds",
                "degenerate_units", "log_spread_before", "log_spread_after", "units", "params", "history"):
        assert key in d
    assert d["history"][0] == pytest.approx(d["objective_before"])
    assert d["history"][-1] == pytest.approx(d["objective_after"])
    assert report.log_spread_after <= report.log_spread_before + 1e-9
    assert report.divergence_after <= report.divergence_before
    assert "z" in report.to_dict(z=True) and len(report.to_dict(z=True)["z"]) == report.units


def test_objective_is_f_of_the_true_diag_g():
    model, shape = build("mlp")
    cm = pathir.compile(model, input_shape=shape)
    B, layout = cm.incidence()
    g = np.concatenate([cm.diag_g()[p.source_name].ravel() for p in layout.params])
    report = cm.pathcond(write_back=False)
    n, bz = g.size, B @ report.z
    assert report.objective_before == pytest.approx(n * np.log(g.sum()), rel=1e-12)
    assert report.objective_after == pytest.approx(n * np.log((g * np.exp(bz)).sum()) - bz.sum(), rel=1e-12)


def test_constant_diag_g_leaves_the_network_as_is():
    b = pathir.GraphBuilder()
    x = b.input("x", (1,))
    from pathir.ir import Dense

    h = b.relu("h", [(x, Dense(b.param("w1", [[1.0]])))])
    y = b.identity("y", [(h, Dense(b.param("w2", [[1.0]])))])
    cm = pathir.compile(b.build(outputs=[y]))
    report = cm.pathcond()
    assert report.max_abs_log_scale <= 1e-12
    assert report.objective_after == pytest.approx(report.objective_before, abs=1e-12)


def test_write_back_false_touches_nothing_and_rescaled_applies_z():
    model, shape = build("resnet")
    state = _state(model)
    cm = pathir.compile(model, input_shape=shape)
    graph = cm.graph
    report = cm.pathcond(write_back=False)
    assert not report.written and cm.graph is graph and _same_state(model, state)
    cm.pathcond()
    for a, b in zip(graph.params(), cm.graph.params()):
        assert not np.shares_memory(a.value, b.value)
    expected = pathir.compile(copy.deepcopy(graph)).rescaled(report.z).graph
    for a, b in zip(expected.params(), cm.graph.params()):
        np.testing.assert_allclose(a.value, b.value, rtol=1e-8, atol=1e-14)


@settings(max_examples=15)
@given(relu_dags(max_neurons=60, max_paths=600))
def test_bare_graphs_random_dags(graph):
    cm = pathir.compile(graph)
    if not np.isfinite(_flat_g(cm)[1]):  # no path with nonzero weights: refused
        with pytest.raises(PathirError, match="diag G vanishes"):
            cm.pathcond()
        return
    coord = cm.pathcond(solver="coordinate", max_sweeps=100_000, tol=1e-14, write_back=False)
    report = cm.pathcond()
    assert report.objective_after <= coord.objective_after + 1e-9 * max(1.0, abs(coord.objective_after))
    rng = np.random.default_rng(0)
    x = {n.name: rng.normal(size=(3, *n.shape)) for n in graph.nodes if n.kind.name == "INPUT"}
    before, after = pathir.compile(graph).forward(x, "numpy"), cm.forward(x, "numpy")
    for a, b in zip(np.atleast_1d(before) if not isinstance(before, dict) else before.values(),
                    np.atleast_1d(after) if not isinstance(after, dict) else after.values()):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)


@settings(max_examples=10)
@given(mlps(bias=True, max_width=5))
def test_mlps_function_and_path_norm_preserved(graph):
    cm = pathir.compile(graph)
    norm = cm.path_norm(2)
    cm.pathcond()
    assert cm.path_norm(2) == pytest.approx(norm, rel=1e-9)


# ------------------------------------------------------------------ bad input


def test_dead_units_are_kept_and_listed():
    torch.manual_seed(0)
    model = mlp().double()
    with torch.no_grad():
        model[0].weight[1].zero_(), model[0].bias[1].zero_()  # unit 0:c1 receives nothing
        model[2].weight[:, 3].zero_()  # unit 0:c3 sends nothing
    reference = copy.deepcopy(model)
    cm = pathir.compile(model, input_shape=(6,))
    report = cm.pathcond()
    assert set(report.degenerate_units) == {"0:c1", "0:c3"}
    for name in report.degenerate_units:
        assert report.z[cm.units.index(name)] == 0.0
    assert "0:c1" in str(report)
    x = torch.randn(5, 6, dtype=torch.float64)
    assert _rel(model(x), reference(x)) <= 1e-10
    # the log-det divergences by their definition, over the entries g > 0 only (here some g are 0)
    g = _flat_g(pathir.compile(reference, input_shape=(6,)))[0]
    assert (g == 0).any()
    B, _ = cm.incidence()
    for z, value, spread in ((np.zeros(len(cm.units)), report.divergence_before, report.log_spread_before),
                             (report.z, report.divergence_after, report.log_spread_after)):
        gz = (g * np.exp(B @ z))[g > 0]
        assert value == pytest.approx(gz.size * np.log(gz.mean()) - np.log(gz).sum(), rel=1e-9)
        assert spread == pytest.approx(np.log(gz.max()) - np.log(gz.min()), rel=1e-12)


def test_pruned_model():
    from torch.nn.utils import prune

    model, shape = build("cnn")
    prune.l1_unstructured(model[4], "weight", amount=0.4)
    prune.random_unstructured(model[9], "weight", amount=0.5)
    mask, orig = model[4].weight_mask.clone(), model[4].weight_orig.detach().clone()
    x = torch.randn(4, *shape, dtype=torch.float64)
    with torch.no_grad():
        before = model(x)
    cm = pathir.compile(model, input_shape=shape)
    report = cm.pathcond()
    assert report.converged
    assert torch.equal(model[4].weight_mask, mask) and torch.all(model[4].weight[mask == 0] == 0)
    assert not torch.equal(model[4].weight_orig, orig)  # written through weight_orig
    with torch.no_grad():
        assert _rel(model(x), before) <= 1e-10


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2), (torch.float32, 1e-6)])
def test_low_precision_models_computed_in_float64_written_in_their_dtype(dtype, tol):
    model, shape = build("resnet", dtype=dtype)
    twin = copy.deepcopy(model).double()
    cm = pathir.compile(model, input_shape=shape)
    report = cm.pathcond(max_log_scale=math.inf)  # this model fits its dtype unbounded; the twin solves the same
    pathir.compile(twin, input_shape=shape).pathcond(max_log_scale=math.inf)
    assert all(t.dtype == dtype for t in model.state_dict().values() if t.is_floating_point())
    for (k, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        if a.is_floating_point():
            assert torch.allclose(a.double(), b, rtol=tol, atol=1e-6), k
    assert report.objective_after < report.objective_before


@pytest.mark.parametrize("dtype,log_scale", [(torch.float16, 30.0), (torch.bfloat16, 200.0), (torch.float32, 200.0)])
def test_overflow_in_the_model_dtype_is_refused_and_the_model_untouched(dtype, log_scale):
    model, shape = build("mlp", dtype=dtype)
    state = _state(model)
    cm = pathir.compile(model, input_shape=shape)
    graph = cm.graph
    with pytest.raises(PathirError, match=f"does not fit {dtype}"):
        cm.commit_rescaling(np.full(len(cm.units), log_scale))  # e^{15} > 65504, e^{100} > 3.4e38
    assert _same_state(model, state) and cm.graph is graph
    with pytest.raises(PathirError, match="overflows or underflows float64"):
        cm.commit_rescaling(np.full(len(cm.units), 1500.0))
    assert _same_state(model, state) and cm.graph is graph


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_model():
    model, shape = build("resnet")
    model = model.cuda()
    reference = copy.deepcopy(model)
    cm = pathir.compile(model, input_shape=shape)
    cm.pathcond()
    assert all(t.device.type == "cuda" for t in model.state_dict().values())
    x = torch.randn(4, *shape, dtype=torch.float64, device="cuda")
    assert _rel(model(x), reference(x)) <= 1e-10


def test_train_mode_unfolded_batchnorm_is_refused_then_eval_works():
    torch.manual_seed(0)
    model = _randomize_bn(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.BatchNorm1d(5), nn.Linear(5, 3))).double()
    model.train()
    state = _state(model)
    cm = pathir.compile(model, input_shape=(4,))
    with pytest.raises(PathirError, match="train mode.*'2'"):
        cm.pathcond()
    assert _same_state(model, state) and model.training
    model.eval()
    reference = copy.deepcopy(model)
    cm.pathcond()
    x = torch.randn(6, 4, dtype=torch.float64)
    assert _rel(model(x), reference(x)) <= 1e-10


def test_injected_failures_leave_model_and_graph_untouched(monkeypatch):
    from torch.nn.utils import prune

    import pathir.frontends.torch.writer as writer
    import pathir.pathcond.run

    model, shape = build("cnn")
    prune.l1_unstructured(model[4], "weight", amount=0.3)
    state = _state(model)
    weight = model[4].weight
    cm = pathir.compile(model, input_shape=shape)
    graph = cm.graph

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    with monkeypatch.context() as m:
        m.setattr(pathir.pathcond.run, "diag_g_log_parts", boom)
        with pytest.raises(RuntimeError, match="injected"):
            cm.pathcond()
    assert _same_state(model, state) and cm.graph is graph
    # a failure after the writer has copied every tensor: the snapshot is restored
    monkeypatch.setattr(writer, "_refresh_pruned", boom)
    with pytest.raises(RuntimeError, match="injected"):
        cm.pathcond()
    assert _same_state(model, state) and cm.graph is graph and model[4].weight is weight
    monkeypatch.undo()
    cm.pathcond()
    assert not _same_state(model, state)


def test_unknown_solver():
    model, shape = build("mlp")
    with pytest.raises(ValueError, match="unknown PathCond solver"):
        pathir.compile(model, input_shape=shape).pathcond(solver="gauss-seidel")


@pytest.mark.slow
def test_resnet18_write_back():
    from pathir.app.zoo import build as zoo_build

    model = zoo_build("resnet18").double()
    reference = copy.deepcopy(model)
    cm = pathir.compile(model, input_shape=(3, 224, 224))
    report = cm.pathcond()
    assert report.converged and report.objective_after < report.objective_before
    assert report.gradient_relative <= 1e-8  # balanced to newton.SETTLED (1e-9), not merely F unmoved (3e-8 there)
    assert written.moved(model, written.state(reference)) > 1e-3  # into the model's own tensors
    x = torch.randn(2, 3, 224, 224, dtype=torch.float64)
    with torch.no_grad():
        assert _rel(model(x), reference(x)) <= 1e-9


@given(relu_dags(), st.integers(0, 2**32 - 1), st.sampled_from([0.5, 400.0]))
@settings(max_examples=40)
def test_report_log_spreads_are_their_definition(graph, seed, scale):
    """The report's log-spreads, param by param from the units' compact ends, equal max − min of
    log(g ⊙ e^{Bz}) over g > 0 with B itself; z far beyond float64's exp range included."""
    from pathir.analyses.find_units import find_units
    from pathir.analyses.incidence import incidence
    from pathir.pathcond.run import unit_log_spreads

    _, units = find_units(graph)
    B, _ = incidence(graph, units)
    rng = np.random.default_rng(seed)
    g = rng.random(B.shape[0]) * (rng.random(B.shape[0]) < 0.9)
    z = rng.normal(scale=scale, size=len(units))
    expected = []
    for shift in (np.zeros(B.shape[0]), B @ z):
        logs = (np.log(g[g > 0]) + shift[g > 0]) if (g > 0).any() else np.zeros(1)
        expected.append(logs.max() - logs.min())
    np.testing.assert_allclose(unit_log_spreads(units, g, z), expected, rtol=1e-12, atol=1e-9)


@given(relu_dags(), st.integers(0, 2**32 - 1), st.sampled_from([0.5, 400.0]), st.sampled_from([1.0, 900.0]))
@settings(max_examples=40)
def test_report_figures_from_the_pair_summary_are_their_definition(graph, seed, scale, spread):
    """The log-spreads and log-det divergences the report takes from the per-pair summary of g
    (g_summary: g is freed before the solve) equal their definition over the entries g > 0, with B
    itself; g spanning 900 nats (log-space pair sums) and z beyond float64's exp range included."""
    from pathir.analyses.find_units import find_units
    from pathir.analyses.incidence import incidence, row_ends
    from pathir.pathcond.g_summary import summarize
    from pathir.pathcond.objective import logsumexp, objective

    _, units = find_units(graph)
    B, _ = incidence(graph, units)
    rng = np.random.default_rng(seed)
    n = B.shape[0]
    g = np.exp(-spread * rng.random(n)) * (rng.random(n) < 0.9)
    z = rng.normal(scale=scale, size=len(units))
    rows = row_ends(units)
    pairs, summary = summarize(g, rows)
    keep = g > 0
    expected_spreads, expected_div = [], []
    for shift in (np.zeros(n), B @ z):
        logs = (np.log(g[keep]) + shift[keep]) if keep.any() else np.zeros(1)
        expected_spreads.append(logs.max() - logs.min())
        expected_div.append(keep.sum() * (logsumexp(logs) - np.log(keep.sum())) - logs.sum() if keep.any() else 0.0)
    np.testing.assert_allclose(summary.spreads(z), expected_spreads, rtol=1e-12, atol=1e-9)
    if keep.any() and scale < 1:
        f0, f1 = objective(g, B, np.zeros(len(units))), objective(g, B, z)
        np.testing.assert_allclose(summary.divergences(f0, f1, z, rows.balance), expected_div, rtol=1e-9, atol=1e-6)
    assert summary.kept == int(keep.sum()) and summary.n == n


def test_the_range_check_of_a_write_back_sees_every_chunk():
    from pathir.rescaling.commit import _kept_in_range

    old = np.arange(1.0, 11.0)
    new = old * 2
    assert _kept_in_range(old, new, chunk=4)
    for broken in (0.0, np.inf, np.nan):  # an entry underflowed to 0, overflowed, or lost, in the last chunk
        bad = new.copy()
        bad[9] = broken
        assert not _kept_in_range(old, bad, chunk=4)
    zeros = old.copy()
    zeros[5] = 0.0  # a zero that stays zero is no underflow
    assert _kept_in_range(zeros, zeros * 3, chunk=4)
