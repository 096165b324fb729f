"""Path walks stay exact in log scale for any q and on any representative of θ (issue 26).

Three walks compute every path sum (docs/math.md §3, docs/paths.md "Range"): the fast one,
certified node by node (pathir.lifting.walk, pattern), the per-channel scaled one
(pathir.lifting.scaled) and the per-neuron log-space one (pathir.lifting.log_walk, also
q = inf). Each is checked here against path enumeration, and the public quantities against
enumeration for large q and against the unrescaled model under rescalings up to e^±700.
"""

import math

import numpy as np
import pytest
import torch
from enumerated import path_factors
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import pathir
from pathir.backends import get_backend
from pathir.ir import Dense, GraphBuilder, Resample, SpatialMatrix
from pathir.lifting.log_walk import log_backward, log_forward, log_grand_total
from pathir.lifting.param_grads import param_grads
from pathir.lifting.path_metric import path_metric
from pathir.lifting.pattern import activation_pattern
from pathir.lifting.scaled import Uncertified, scaled_backward, scaled_forward, scaled_log_total
from pathir.lifting.walk import forward, path_forward
from pathir.neurons.expand import expand
from pathir.neurons.paths import activations, enumerate_path_norm, enumerate_paths, neuron_forward, phi
from pathir.passes.find_units import find_units
from pathir.rescaling.apply import rescale_graph
from pathir.testing import random_inputs, relu_dags

BACKENDS = ["numpy", "torch"]
LARGE_Q = [0.5, 3.0, 100.0, 700.0, 3000.0, math.inf]


def slow(examples: int):
    return settings(max_examples=examples, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def log_sum(values: np.ndarray, q: float) -> float:
    """log Σ |v|^q (log max |v| for q = inf) in log space; -inf when every v is 0."""
    v = np.abs(values[values != 0])
    if not v.size:
        return -math.inf
    if q == math.inf:
        return float(np.log(v).max())
    logs = q * np.log(v)
    top = logs.max()
    return float(top + math.log(np.exp(logs - top).sum()))


def enumerated_logs(graph, q: float) -> float:
    net = expand(graph)
    paths = enumerate_paths(net)
    if q == 0:
        return math.log(len(paths)) if paths else -math.inf
    return log_sum(phi(net, paths), q)


def same_log(got: float, want: float, rel: float = 1e-12) -> bool:
    if want == -math.inf:
        return got == -math.inf
    return abs(got - want) <= rel * max(1.0, abs(want))


# ------------------------------------------------------------ public quantities, large q


@pytest.mark.parametrize("backend", BACKENDS)
@slow(60)
@given(graph=relu_dags(), q=st.sampled_from(LARGE_Q))
def test_path_norm_for_any_q_equals_enumeration(backend, graph, q):
    cm = pathir.compile(graph, backend=backend)
    want = enumerated_logs(cm.graph, q)
    got = cm.path_norm(q, log10=True) * math.log(10)
    assert same_log(got, want / (1 if q == math.inf else q))


def test_l_inf_is_the_largest_path():
    b = GraphBuilder()
    x = b.input("x", (2,))
    h = b.relu("h", [(x, Dense(b.param("w1", [[1.0, -2.0], [3.0, 0.5]])))], bias=b.param("b1", [0.0, 1.0]))
    y = b.identity("y", [(h, Dense(b.param("w2", [[2.0, -1.0]])))], bias=b.param("b2", [0.5]))
    cm = pathir.compile(b.build(outputs=[y]))
    assert cm.path_norm(math.inf) == 4.0 == enumerate_path_norm(cm.graph, math.inf)  # |(-2) * 2|
    assert cm.path_norm(1e4) == pytest.approx(4.0, rel=1e-3)  # the l_q norms tend to it


def test_fresh_mlp_at_q_in_the_hundreds_and_thousands():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4), torch.nn.ReLU(),
                              torch.nn.Linear(4, 2))
    cm = pathir.compile(net, input_shape=(3,))
    for q in (300.0, 500.0, 2000.0, 1e5, math.inf):
        want = enumerated_logs(cm.graph, q) / (1 if q == math.inf else q)
        for backend in BACKENDS:
            assert cm.path_norm(q, backend=backend) == pytest.approx(math.exp(want), rel=1e-12)


# ------------------------------------------------------------ each walk against enumeration


@pytest.mark.parametrize("backend", BACKENDS)
@slow(60)
@given(graph=relu_dags(), q=st.sampled_from([0.0, 1.0, 2.0, *LARGE_Q]))
def test_each_walk_equals_enumeration(backend, graph, q):
    be = get_backend(backend)
    want = enumerated_logs(graph, q)
    assert same_log(log_grand_total(log_forward(graph, q), graph.outputs, q), want)
    if q == math.inf:
        return
    try:
        assert same_log(scaled_log_total(be, scaled_forward(graph, be, q), graph.outputs), want)
    except Uncertified:  # then the log-space walk answers; the scaled one must not be wrong
        assert q > 2


def enumerated_grads(graph, q: float) -> np.ndarray:
    """log Σ_{p ∋ i} Π_{other factors of p} |factor|^q per θ_i (the weight-gradient of the |θ|^q network)."""
    factors, layout = path_factors(graph)
    terms = [[] for _ in range(len(layout))]
    for const, free in factors:
        for j, (i, _) in enumerate(free):
            others = [abs(const), *(abs(w) for jj, (_, w) in enumerate(free) if jj != j)]
            terms[i].append(q * sum(math.log(v) if v else -math.inf for v in others))
    out = np.full(len(layout), -np.inf)
    for i, t in enumerate(terms):
        t = [v for v in t if v > -math.inf]
        if t:
            top = max(t)
            out[i] = top + math.log(sum(math.exp(v - top) for v in t))
    return out


def grad_logs(graph, parts, backend) -> np.ndarray:
    """The walk's param parts as log per θ entry (uses summed)."""
    out = []
    for p in graph.params():
        total = np.full(p.shape, -np.inf)
        for part in parts.get(id(p)) or []:
            if part is None:
                continue
            array = np.asarray(backend.to_numpy(part[0]), dtype=np.float64).reshape(p.shape)
            with np.errstate(divide="ignore"):
                total = np.logaddexp(total, np.log(array) + np.broadcast_to(part[1], p.shape))
        out.append(total.ravel())
    return np.concatenate(out) if out else np.zeros(0)


def same_logs(got: np.ndarray, want: np.ndarray) -> bool:
    finite = np.isfinite(want)
    if not np.array_equal(finite, np.isfinite(got)):
        return False
    scale = np.maximum(1.0, np.abs(want[finite]))
    return bool(np.all(np.abs(got[finite] - want[finite]) <= 1e-11 * scale))


@pytest.mark.parametrize("backend", BACKENDS)
@slow(40)
@given(graph=relu_dags(max_paths=500), q=st.sampled_from([1.0, 2.0, 40.0]))
def test_each_backward_walk_equals_enumeration(backend, graph, q):
    be = get_backend(backend)
    want = enumerated_grads(graph, q)
    assert same_logs(grad_logs(graph, param_grads(graph, be, q), be), want)
    assert same_logs(grad_logs(graph, log_backward(graph, q, log_forward(graph, q)), be), want)
    try:
        _, parts = scaled_backward(graph, be, q, scaled_forward(graph, be, q))
    except Uncertified:
        return
    assert same_logs(grad_logs(graph, parts, be), want)


@slow(40)
@given(graph=relu_dags(), q=st.sampled_from([1.0, 5.0, 300.0, math.inf]), data=st.data())
def test_active_path_norms_for_any_q_equal_enumeration(graph, q, data):
    cm = pathir.compile(graph, backend="numpy")
    g = cm.graph
    x = data.draw(random_inputs(g))
    net = expand(g)
    paths = enumerate_paths(net)
    values = phi(net, paths)
    got = cm.active_path_norm(x, q, log10=True) * math.log(10)
    for b in range(got.shape[0]):
        a = activations(net, paths, neuron_forward(net, {k: v[b] for k, v in x.items()}))
        want = log_sum(values * a, q) / (1 if q == math.inf else q)
        assert same_log(got[b], want)


# ------------------------------------------------------------ the certificate


def test_the_fast_walk_refuses_what_it_would_lose():
    """At q = 3000 a resample's entries 1 and 1.375 part by e^955: one channel can hold both
    only by losing the first, which carries the largest path (0.757 > 1.375 · 0.258)."""
    b = GraphBuilder()
    x = b.input("x", (1, 2))
    r = b.relu("r", [(x, Resample((np.array([[0.125, 0.0], [0.375, 1.0], [0.0, -1.375]]),)))])
    y = b.identity("y", [(r, SpatialMatrix(np.array([[0.0, 0.7566899, 0.25809006]]), (1,)))])
    g = b.build(outputs=[y])
    be = get_backend("torch")
    with pytest.raises(Uncertified):
        path_forward(g, be.power_view(3000.0), linearize=True)
    with pytest.raises(Uncertified):
        scaled_forward(g, be, 3000.0)
    want = enumerated_logs(g, 3000.0) / 3000.0
    assert want == pytest.approx(math.log(0.7566899), rel=1e-12)
    assert pathir.compile(g, backend="torch").path_norm(3000, log10=True) * math.log(10) == pytest.approx(want, rel=1e-12)


@slow(60)
@given(graph=relu_dags())
def test_ordinary_walks_are_certified_on_the_fast_path(graph):
    """The fallbacks are for range trouble only: q = 1, 2, 4 and counts stay on the fast walk."""
    be = get_backend("torch")
    for q in (0.0, 1.0, 2.0, 4.0):
        path_forward(graph, be.power_view(q), linearize=True)


def test_a_cnn_stays_on_the_fast_path():
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(8, 4)).double().eval()
    cm = pathir.compile(net, input_shape=(3, 16, 16), backend="torch")
    be = cm.get_backend()
    for q in (0.0, 1.0, 2.0, 4.0):
        path_forward(cm.graph, be.power_view(q), linearize=True)
    param_grads(cm.graph, be, 2.0)  # diag G's walks: certified as they are


# ------------------------------------------------------------ rescalings up to e^±700


def _finite_normal(graph) -> bool:
    tiny = np.finfo(np.float64).tiny
    for p in graph.params():
        v = np.abs(p.value)
        if not np.all(np.isfinite(v)) or np.any((v != 0) & (v < tiny)):
            return False
    return True


def _same_log10(a, b) -> bool:
    """Two log10 values of one quantity equal to 1e-12 relative (in the value; |log| beyond 1: in it)."""
    a, b = np.asarray(a, dtype=np.float64) * math.log(10), np.asarray(b, dtype=np.float64) * math.log(10)
    with np.errstate(invalid="ignore"):
        return bool(np.all((a == b) | (np.abs(a - b) <= 1e-12 * np.maximum(1.0, np.abs(b)))))


def _close(a, b, rel: float = 1e-12, scale: float = 0.0) -> bool:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return bool(np.all((a == b) | (np.abs(a - b) <= rel * np.maximum(np.abs(b), scale))))


@slow(80)
@given(graph=relu_dags(), seed=st.integers(0, 2**32 - 1), reach=st.sampled_from([1.0, 100.0, 350.0, 700.0]),
       data=st.data())
def test_extreme_rescalings_change_no_invariant(graph, seed, reach, data):
    units = find_units(graph)[1]
    assume(len(units) > 0)
    rng = np.random.default_rng(seed)
    z = rng.uniform(-reach, reach, size=len(units))
    twin = rescale_graph(graph, units, z)
    assume(_finite_normal(twin))
    a, b = pathir.compile(graph, backend="torch"), pathir.compile(twin, backend="torch")
    l1 = a.path_norm(1)
    x = data.draw(random_inputs(graph))
    bound = l1 * max(1.0, max(float(np.abs(v).max()) for v in x.values()))
    fa, fb = forward(graph, get_backend("numpy"), x), forward(twin, get_backend("numpy"), x)
    for o in graph.outputs:  # the function, to rounding against the bound |R| <= ||Φ||_1 max(|x|, 1)
        assert _close(fb[o], fa[o], 1e-12, bound)
    for q in (0.5, 1.0, 2.0, 4.0, 8.0, 300.0):
        assert _same_log10(b.path_norm(q, log10=True), a.path_norm(q, log10=True))
    assert b.num_paths(log10=True) == a.num_paths(log10=True)
    pa = activation_pattern(graph, get_backend("numpy"), x)
    pb = activation_pattern(twin, get_backend("numpy"), x)
    same = pa.same_as(pb, get_backend("numpy"))  # a ReLU at exactly 0 may tip by rounding
    for q in (1.0, 2.0):
        na, nb = a.active_path_norm(x, q, log10=True), b.active_path_norm(x, q, log10=True)
        assert _same_log10(nb[same], na[same])
    other = graph.map_params(lambda p: p.with_value(p.value * rng.uniform(0, 1, p.shape)))  # shrunk: exact brackets
    m = path_metric(graph, other, "torch")
    r = path_metric(twin, rescale_graph(other, units, z), "torch")
    assert _same_log10(r.log10_upper, m.log10_upper)
    assert _same_log10(r.log10_lower, m.log10_lower)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_units_of_one_layer_at_opposite_extremes(backend):
    """Two neurons of one layer rescaled by about 1e-160 and 1e160 (the function is the same): the fast walk's
    node sum peaks near 1e160 and is divided by it, which would store the other neuron's 1e-160 as a flushed
    1e-320. Its paths must not be lost: the walk is not certified there and walks again per channel."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3), torch.nn.ReLU(),
                              torch.nn.Linear(3, 2)).double()
    cm = pathir.compile(net, input_shape=(3,), backend=backend)
    x = torch.tensor([[0.7376408280756231, 0.34551718764575784, -1.5591559347261015]], dtype=torch.float64)
    for spread in (300.0, 356.0, 368.0, 400.0):  # log of the factor: e^368 ≈ 1e160
        z = np.zeros(len(cm.units.names))
        z[0], z[1] = 2 * spread, -2 * spread
        twin = cm.rescaled(z)
        assert _finite_normal(twin.graph)
        want = math.exp(enumerated_logs(twin.graph, 1.0))
        assert want == pytest.approx(cm.path_norm(1), rel=1e-12)
        for q in (1, 1.2, 2, 4.5):
            assert twin.path_norm(q) == pytest.approx(cm.path_norm(q), rel=1e-12), (spread, q)
        assert twin.active_path_norm(x, q=1) == pytest.approx(cm.active_path_norm(x, q=1), rel=1e-12)
        scores, ref = twin.path_magnitude_scores(), cm.path_magnitude_scores()
        for name in ref:
            assert np.allclose(scores[name], ref[name], rtol=1e-12, atol=0), (spread, name)


def _far_paths(a: float):
    """x -> h (2 ReLU) -> k (1 ReLU) -> y, no biases: paths a·1e51·1e150 and 1e-100·1e250·1e150 = (a·1e201, 1e300)."""
    net = torch.nn.Sequential(torch.nn.Linear(1, 2, bias=False), torch.nn.ReLU(), torch.nn.Linear(2, 1, bias=False),
                              torch.nn.ReLU(), torch.nn.Linear(1, 1, bias=False)).double()
    with torch.no_grad():
        net[0].weight[:] = torch.tensor([[a], [1e-100]], dtype=torch.float64)
        net[2].weight[:] = torch.tensor([[1e51, 1e250]], dtype=torch.float64)
        net[4].weight[:] = torch.tensor([[1e150]], dtype=torch.float64)
    return pathir.compile(net, input_shape=(1,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_products_of_raw_weights_and_scaled_gradients_do_not_underflow(backend):
    """A weight-gradient stored in its walk's units (1e-199 here, times e^L) was multiplied by the raw weight or
    difference (1e-130) before e^L went back: the path-metric read d = 0 'exact' where d = 1e71 (and a pruning
    report its bound 0), the path-magnitude scores 0 where they are 1e71 (certificates review). Such a param is
    summed in log space now."""
    a = _far_paths(1e-130)
    for other, d in ((0.0, 1e71), (3e-130, 2e71), (-1e-130, 2e71)):
        m = path_metric(a, _far_paths(other), backend)
        assert m.upper == pytest.approx(d, rel=1e-12) and m.lower <= m.upper
        if other >= 0:
            assert m.exact and m.lower == pytest.approx(d, rel=1e-12)
    scores = a.path_magnitude_scores(backend=backend)
    np.testing.assert_allclose(scores["0.weight"].ravel(), [1e71, 1e300], rtol=1e-12)
    np.testing.assert_allclose(scores["2.weight"].ravel(), [1e71, 1e300], rtol=1e-12)


class _SharedTwice(torch.nn.Module):
    """c1·relu(w x) + c2·relu(w x), one w read by two branches: S(w) = 2(|c1| + |c2|), g(w) = c1² + c2²."""

    def __init__(self, c1: float, c2: float):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([[2.0]], dtype=torch.float64))
        self.c1 = torch.nn.Parameter(torch.tensor([[c1]], dtype=torch.float64))
        self.c2 = torch.nn.Parameter(torch.tensor([[c2]], dtype=torch.float64))

    def forward(self, x):
        lin = torch.nn.functional.linear
        return lin(torch.relu(lin(x, self.w)), self.c1) + lin(torch.relu(lin(x, self.w)), self.c2)


class _LayerTwice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self.v = torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 1, bias=False)

    def forward(self, x):
        return self.v(torch.relu(self.w(torch.relu(self.w(x)))))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shared_layer_one_of_whose_uses_spans_beyond_one_scale(backend):
    """W = [[1e-200, 1e100], [1e-100, 1]] applied twice: one use's scores span 1e400, but at each entry the other
    use swamps its small part. Refused on numpy, which hands each use over on its own (latest-commits review):
    the span is judged on the uses' sum."""
    net = _LayerTwice().double()
    with torch.no_grad():
        net.w.weight[:] = torch.tensor([[1e-200, 1e100], [1e-100, 1.0]], dtype=torch.float64)
        net.v.weight[:] = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    scores = pathir.compile(net, input_shape=(2,)).path_magnitude_scores(backend=backend)["w.weight"]
    np.testing.assert_allclose(scores, [[1e-100, 1e100], [2.0, 1e100]], rtol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("c1", [1e-100, 1e-250])
def test_a_shared_weight_whose_uses_differ_by_hundreds_of_decades(backend, c1):
    """Its small use flushes at the common scale, but the sum at that entry is the large use's: nothing is lost.
    Refused once every use was checked on its own (pruning review); only an entry whose sum is lost is now."""
    cm = pathir.compile(_SharedTwice(c1, 1e100), input_shape=(1,))
    assert cm.path_magnitude_scores(backend=backend)["w"].item() == pytest.approx(2 * (c1 + 1e100), rel=1e-12)
    assert cm.diag_g(backend=backend)["w"].item() == pytest.approx(c1 * c1 + 1e200, rel=1e-12)


def test_one_unit_rescaled_by_e100_and_e200():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4), torch.nn.ReLU(),
                              torch.nn.Linear(4, 2))
    cm = pathir.compile(net, input_shape=(3,))
    for log_scale in (200.0, 400.0, -400.0):  # the unit's weights by e^100, e^200, e^-200
        z = np.zeros(len(cm.units.names))
        z[0] = log_scale
        twin = cm.rescaled(z)
        for q in (1, 2, 4, 8):
            assert twin.path_norm(q) == pytest.approx(cm.path_norm(q), rel=1e-12)
        assert twin.summary().log10_path_norms == pytest.approx(cm.summary().log10_path_norms, rel=1e-12)
        scores, ref = twin.path_magnitude_scores(), cm.path_magnitude_scores()
        for name in ref:
            assert np.allclose(scores[name], ref[name], rtol=1e-12, atol=0)
