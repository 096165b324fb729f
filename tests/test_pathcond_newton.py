"""The Newton solver and bounded rescalings (docs/math.md §7) against the definition and the reference solver.

Random problems are the layered MLPs and ResNet-like stacks of
test_pathcond_solvers, plus DenseNet-like blocks where every layer reads the
concatenation of all earlier ones (the graphs on which block sweeps crawl).
"""

import copy
import gc
import math
import pickle
import warnings
import weakref

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from test_pathcond_solvers import f_reference, incidence, problems, rel

import pathir
from pathir.errors import PathirError
from pathir.pathcond.solvers import gradient, solve, solve_block, solve_coordinate, solve_newton
from pathir.rescaling.bounds import default_max_log_scale, dtype_range


def dense_rows(d_in, growth, layers, d_out, biases=True):
    """A DenseNet block: layer k's units read the input and every unit of layers < k."""
    rows, H, earlier = [], 0, []
    for _ in range(layers):
        units = list(range(H, H + growth))
        H += growth
        for u in units:
            rows += [(u, None)] * d_in + [(u, v) for v in earlier] + ([(u, None)] if biases else [])
        earlier += units
    rows += [(None, v) for _ in range(d_out) for v in earlier]
    return rows, H


@st.composite
def dense_problems(draw):
    rows, H = dense_rows(draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(2, 6)),
                         draw(st.integers(1, 3)), draw(st.booleans()))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    g = np.exp(rng.uniform(-1, 1, len(rows)) * draw(st.sampled_from([0.1, 3.0, 30.0, 300.0])))
    return g, incidence(rows, H)


def projected_gradient(g, B, z, bound):
    grad = gradient(g, B, z)
    return np.where(((z <= -bound) & (grad > 0)) | ((z >= bound) & (grad < 0)), 0.0, grad)


def random_groups(draw, H):
    """None (no coarse space), or the units in 1..H random groups: any grouping must leave z* alone."""
    if H == 0 or draw(st.booleans()):
        return None
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return rng.integers(0, draw(st.integers(1, H)), H)


@given(st.one_of(problems(), dense_problems()), st.data())
@settings(max_examples=60)
def test_newton_reaches_the_coordinate_minimum_with_zero_gradient(problem, data):
    g, B = problem
    coord = solve_coordinate(g, B, tol=1e-14, max_sweeps=3000)
    newton = solve_newton(g, B, tol=1e-14, groups=random_groups(data.draw, B.shape[1]))
    assert newton.converged
    assert rel(newton.f_final, f_reference(g, B, newton.z)) < 1e-12
    assert np.all(np.diff(newton.history) <= 1e-12 * np.abs(newton.history[1:]) + 1e-9)  # monotone
    assert newton.f_final <= coord.f_final + 1e-9 * max(1.0, abs(coord.f_final))
    np.testing.assert_allclose(gradient(g, B, newton.z), 0, atol=1e-6 * g.size)


@given(st.one_of(problems(), dense_problems()), st.data())
@settings(max_examples=40)
def test_the_settled_stop_leaves_f_where_the_balanced_stop_does(problem, data):
    """At the default tol Newton may stop at a relative imbalance of SETTLED (not BALANCED) once a full step
    moved F by at most tol: F is then where the stricter stop leaves it, to rounding."""
    import pathir.pathcond.newton as newton_module

    g, B = problem
    groups = random_groups(data.draw, B.shape[1])
    settled = solve_newton(g, B, groups=groups)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(newton_module, "SETTLED", 0.0)
        balanced = solve_newton(g, B, groups=groups)
    assert settled.converged and balanced.converged
    assert rel(settled.f_final, f_reference(g, B, settled.z)) < 1e-12
    assert settled.f_final <= balanced.f_final + 1e-12 * max(1.0, abs(balanced.f_final))
    assert settled.sweeps <= balanced.sweeps
    assert settled.grad_rel <= max(10 * newton_module.SETTLED, balanced.grad_rel)  # (1 where a unit is flat to rounding)
    np.testing.assert_allclose(gradient(g, B, settled.z), 0, atol=1e-6 * g.size)


@given(st.one_of(problems(spreads=(0.1, 3.0, 30.0)), dense_problems()), st.sampled_from([0.0, 0.05, 0.5, 2.0]),
       st.data())
@settings(max_examples=60)
def test_bounded_solvers_meet_the_kkt_conditions_and_agree(problem, bound, data):
    """With |z_h| <= M: every solver stays in the box; Newton ends at least as low as the clamped
    coordinate descent; the projected gradient vanishes (KKT); the bound can only raise F."""
    g, B = problem
    coord = solve_coordinate(g, B, tol=1e-14, max_sweeps=3000, max_log_scale=bound)
    newton = solve_newton(g, B, tol=1e-14, max_log_scale=bound, groups=random_groups(data.draw, B.shape[1]))
    block = solve_block(g, B, tol=1e-14, max_sweeps=3000, max_log_scale=bound)
    free = solve_newton(g, B, tol=1e-14)
    for r in (coord, newton, block):
        assert np.all(np.abs(r.z) <= bound)
        assert rel(r.f_final, f_reference(g, B, r.z)) < 1e-12
    assert newton.converged
    assert newton.f_final <= coord.f_final + 1e-9 * max(1.0, abs(coord.f_final))
    assert block.f_final <= coord.f_final + 1e-9 * max(1.0, abs(coord.f_final))
    assert newton.f_final >= free.f_final - 1e-9 * max(1.0, abs(free.f_final))
    np.testing.assert_allclose(projected_gradient(g, B, newton.z, bound), 0, atol=1e-6 * g.size)
    assert newton.grad_max <= 1e-6 * g.size
    assert sorted(newton.extra["at_bound"]) == np.flatnonzero(np.abs(newton.z) >= bound).tolist()


def test_the_default_method_is_newton_and_the_callback_sees_every_step():
    rows, H = dense_rows(2, 2, 5, 2)
    g = np.exp(np.random.default_rng(0).uniform(-30, 30, len(rows)))
    B = incidence(rows, H)
    seen = []
    r = solve(g, B, tol=1e-14, callback=lambda step, f: seen.append((step, f)))
    assert r.method == "newton"
    assert [s for s, _ in seen] == list(range(1, len(r.history)))
    np.testing.assert_allclose([f for _, f in seen], r.history[1:], rtol=1e-14)
    assert solve(g, B, tol=1e-14, max_log_scale=math.inf).f_final == r.f_final
    with pytest.raises(ValueError, match="max_log_scale"):
        solve(g, B, max_log_scale=-1.0)


# ---------------------------------------------------------------- the default bound and write-back


def _mlp(dtype, seed=0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(),
                              torch.nn.Linear(8, 3))
    with torch.no_grad():  # spread the magnitudes so that the bound is set by the data
        net[0].weight[0, 0] = 1e-3
        net[2].weight[1, 1] = 20.0
    return net.to(dtype)


def _finite_and_normal(model):
    for t in model.state_dict().values():
        if t.is_floating_point():
            tiny = torch.finfo(t.dtype).tiny
            assert bool(t.isfinite().all()) and not bool(((t.abs() < tiny) & (t != 0)).any())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_default_bound_keeps_write_back_finite_and_normal_and_beyond_it_is_refused(dtype):
    model = _mlp(dtype)
    cm = pathir.compile(model, input_shape=(6,))
    bound = default_max_log_scale(cm.graph, dtype)
    log_big, log_tiny = dtype_range(dtype)
    assert 0 < bound < (log_big - log_tiny) / 4
    H = len(cm.units)
    worst = np.where(np.arange(H) < 8, bound, -bound)  # layer 1 up, layer 2 down: factors e^{±M} on both sides
    for z in (worst, -worst):
        cm.commit_rescaling(z)
        _finite_and_normal(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if dtype != torch.float64:
        with pytest.raises(PathirError, match="max_log_scale") as err:
            cm.commit_rescaling(3 * worst + 20 * np.sign(worst))
        assert ".float()" not in str(err.value)
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_pathcond_reports_the_units_at_the_bound_and_keeps_the_function():
    model = _mlp(torch.float64)
    x = torch.randn(16, 6, dtype=torch.float64)
    before = model(x).detach()
    free = pathir.compile(model, input_shape=(6,)).pathcond(max_log_scale=math.inf, write_back=False)
    assert free.units_at_bound == () and not free.bound_cut and free.max_log_scale == math.inf
    bound = 0.5 * free.max_abs_log_scale
    cm = pathir.compile(model, input_shape=(6,))
    report = cm.pathcond(max_log_scale=bound)
    assert report.bound_cut and report.max_log_scale == bound
    assert set(report.units_at_bound) == {cm.units.names[h] for h in np.flatnonzero(np.abs(report.z) >= bound)}
    assert report.max_abs_log_scale == pytest.approx(bound)
    assert report.objective_after >= free.objective_after - 1e-9 * abs(free.objective_after)
    assert report.objective_after < report.objective_before
    assert "unconstrained optimum was cut" in str(report)
    assert report.to_dict()["units_at_bound"] == list(report.units_at_bound)
    assert torch.allclose(model(x), before, rtol=1e-10, atol=1e-12)
    # the default: the dtype's bound, far from this small model's optimum
    cm32 = pathir.compile(_mlp(torch.float32), input_shape=(6,))
    default = cm32.pathcond(write_back=False)
    assert default.max_log_scale == default_max_log_scale(cm32.graph, torch.float32)
    assert default.units_at_bound == ()


def test_reported_unit_names_are_made_when_read_and_keep_no_graph_alive():
    model = _mlp(torch.float64)
    expected = pathir.compile(model, input_shape=(6,)).units.names
    cm = pathir.compile(model, input_shape=(6,))
    units = cm.units
    lazy = units.names_of([2, 0])
    assert "names" not in units.__dict__ and "members" not in units.__dict__  # nothing named yet
    assert len(lazy) == 2 and lazy  # counted and tested for truth unnamed
    graph = weakref.ref(cm.graph)
    del cm, units
    gc.collect()
    assert graph() is None  # the lazy names hold node names and ids, not the graph's values
    assert lazy == (expected[2], expected[0]) and list(lazy) == [expected[2], expected[0]] and lazy[1] == expected[0]
    assert lazy != (expected[0],) and hash(lazy) == hash((expected[2], expected[0]))
    assert pickle.loads(pickle.dumps(lazy)) == (expected[2], expected[0]) == copy.deepcopy(lazy)


@pytest.mark.slow
def test_googlenet_float32_pathcond_keeps_function_and_every_parameter_normal():
    from pathir.app import zoo

    model = zoo.build("googlenet", aux_logits=False)
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(x)
    report = pathir.compile(model, input_shape=(3, 224, 224)).pathcond()
    assert report.written and report.converged
    assert report.objective_after < report.objective_before
    _finite_and_normal(model)
    with torch.no_grad():
        after = model(x)
    assert float((after - before).abs().max() / before.abs().max()) < 1e-3


def test_the_bound_follows_the_narrowest_dtype_of_torch_and_onnx_models():
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    assert pathir.compile(_mlp(torch.float64), input_shape=(6,)).narrowest_dtype() == "float64"
    assert pathir.compile(_mlp(torch.bfloat16), input_shape=(6,)).narrowest_dtype() == "bfloat16"
    w1, w2 = np.ones((2, 3), np.float32), np.ones((3, 1), np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"), helper.make_node("Relu", ["h"], ["r"], name="relu"),
         helper.make_node("MatMul", ["r", "W2"], ["y"], name="fc2")], "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert pathir.compile(model).narrowest_dtype() == "float32"
    assert pathir.compile(onnx.load_from_string(model.SerializeToString())).narrowest_dtype() == "float32"


def test_the_default_bound_keeps_rescaled_batchnorm_variances_above_eps():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 6),
                              torch.nn.ReLU(), torch.nn.Linear(6, 2)).eval()
    with torch.no_grad():
        net[2].running_var.copy_(torch.linspace(0.1, 2.0, 6))
        net[0].weight.mul_(1e-4)  # an optimum far out along the units before the batch-norm
    x = torch.randn(8, 4)
    before = net(x).detach()
    cm = pathir.compile(net, input_shape=(4,))
    ratio = cm.rescaled_variance_ratio()
    assert ratio == pytest.approx((0.1 + 1e-5) / 1e-5, rel=1e-5)
    report = cm.pathcond()
    assert report.max_log_scale == pytest.approx(0.5 * math.log(ratio / 1e3) - math.log(2.0))
    assert report.max_abs_log_scale <= report.max_log_scale
    _finite_and_normal(net)
    assert torch.allclose(net(x), before, rtol=1e-4, atol=1e-5)
    assert pathir.compile(_mlp(torch.float32), input_shape=(6,)).rescaled_variance_ratio() is None


def test_a_batch_norm_without_eps_sets_no_variance_bound_and_warns_nothing():
    """eps = 0: (var + eps) / eps has no floor to keep the rescaled variance above (found by review: a raw numpy
    divide-by-zero warning)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.BatchNorm1d(6, eps=0.0),
                              torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2)).double().eval()
    with torch.no_grad():
        net[2].running_var.copy_(torch.linspace(0.1, 2.0, 6))
    x = torch.randn(8, 4, dtype=torch.float64)
    before = net(x).detach()
    cm = pathir.compile(net, input_shape=(4,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cm.rescaled_variance_ratio() is None
        cm.pathcond()
    torch.testing.assert_close(net(x), before, rtol=1e-12, atol=1e-12)


def test_a_zero_default_bound_from_a_batch_norm_warns_naming_it_and_max_log_scale_lifts_it():
    """A float64 model whose unfoldable batch-norm has eps = 1e-3 and a running variance of 0.5 (timm's
    TF-ported models): the default bound is 0 and PathCond rescaled nothing without a word (timm review); it
    warns, naming the batch-norm and max_log_scale, and with max_log_scale the rescaling is written exactly."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(4, eps=1e-3)
    net = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), bn, nn.Conv2d(4, 3, 3), nn.ReLU(), nn.Conv2d(3, 2, 1)).double()
    with torch.no_grad():
        bn.running_var.fill_(0.5)
        bn.weight.uniform_(0.5, 1.5)
        net[0].weight.mul_(20)
    net.eval()
    x = torch.randn(5, 2, 8, 8, dtype=torch.float64)
    before = net(x).detach()
    cm = pathir.compile(net, input_shape=(2, 8, 8))
    with pytest.warns(pathir.errors.PathirWarning, match=r"default bound on the rescaling is 0.*batch-norm '2'.*max_log_scale"):
        report = cm.pathcond(write_back=False)
    assert report.max_log_scale == 0.0 and report.objective_after == report.objective_before
    report = cm.pathcond(max_log_scale=3.0)
    assert report.objective_after < report.objective_before and report.max_abs_log_scale > 1.0
    assert torch.allclose(net(x), before, rtol=1e-12, atol=1e-13)


@given(st.lists(st.sampled_from([0.0, 1e-320, 1e-300, 3e-8, 0.5, 7.0, 1e30, math.inf, -math.inf, math.nan, -2.0]),
                min_size=1, max_size=8), st.sampled_from(["float32", "float64"]))
@settings(max_examples=60, deadline=None, derandomize=True)
def test_the_default_bound_reads_the_finite_magnitudes_at_least_the_dtype_smallest_normal(values, dtype):
    """default_max_log_scale against its definition: min and max of |θ| over the finite entries >= tiny."""
    from pathir.ir import Dense, GraphBuilder

    b = GraphBuilder()
    x = b.input("x", (len(values),))
    y = b.identity("y", [(x, Dense(b.param("w", np.array([values]))))])
    graph = b.build(outputs=[y])
    log_big, log_tiny = dtype_range(dtype)
    kept = [abs(v) for v in values if math.isfinite(v) and abs(v) >= math.exp(log_tiny)]
    low, high = (min(kept), max(kept)) if kept else (1.0, 1.0)
    from pathir.rescaling.bounds import SAFETY_MARGIN

    margin = min(SAFETY_MARGIN, 0.1 * (log_big - log_tiny))
    expected = max((min(log_big - math.log(high), math.log(low) - log_tiny) - margin) / 2.0, 0.0)
    assert default_max_log_scale(graph, dtype) == pytest.approx(expected, rel=1e-12, abs=1e-12)


@given(st.integers(0, 3 * (1 << 16) + 7), st.lists(st.tuples(st.integers(0, 1 << 20), st.sampled_from(
    [0.0, 1e-310, math.inf, -math.inf, math.nan, 1e300, -1e-300])), max_size=4), st.integers(0, 2 ** 32 - 1))
@settings(max_examples=25, deadline=None, derandomize=True)
def test_the_bound_reads_magnitudes_chunk_by_chunk_as_over_the_whole_array(size, specials, seed):
    """The chunked min/max of the normal finite |θ| (and the min over the positive finite ones, and
    whether all are finite) equal the masked reductions over the whole array, with zeros, subnormals,
    infs and nans landing in any chunk."""
    from pathir.rescaling.bounds import _magnitude_range

    x = np.random.default_rng(seed).standard_normal(size) * 1e-3
    for at, v in specials:
        if size:
            x[at % size] = v
    tiny = np.finfo(np.float64).tiny
    mag = np.abs(x)
    keep = np.isfinite(mag) & (mag >= tiny)
    expected = (float(mag[keep].min()), float(mag[keep].max())) if keep.any() else (math.inf, -math.inf)
    low, low_any, high, finite = _magnitude_range(x, tiny)
    assert (low, high if keep.any() else -math.inf) == expected
    positive = np.isfinite(mag) & (mag > 0)
    assert low_any == (float(mag[positive].min()) if positive.any() else math.inf)
    assert finite == bool(np.isfinite(x).all())
