"""Path-metric brackets and the output bound (docs/math.md §3) against path enumeration."""

import copy
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pathir
from pathir.analyses.find_units import find_units
from pathir.errors import PathirError
from pathir.ir import Dense, GraphBuilder
from pathir.lifting.path_metric import check_same_architecture, output_bound, path_metric
from pathir.lifting.path_norm import path_norm as lifted_path_norm
from pathir.lifting.walk import forward
from pathir.neurons.expand import expand
from pathir.neurons.paths import enumerate_paths, phi
from pathir.rescaling.apply import rescale_graph
from pathir.testing import random_inputs, relu_dags, rescalings

BACKENDS = ["numpy", "torch"]
#: how θ' is made from θ; the first three keep signs and order |θ'| against |θ|
KINDS = ["prune", "shrink", "grow", "same_signs", "perturb"]


def enumerated_metric(ga, gb) -> float:
    """d(θ, θ') = Σ_p |Φ_p(θ) − Φ_p(θ')| over the enumerated paths (one structure)."""
    na, nb = expand(ga), expand(gb)
    pa, pb = enumerate_paths(na), enumerate_paths(nb)
    assert [(p.neurons, p.keys) for p in pa] == [(p.neurons, p.keys) for p in pb]
    return math.fsum(np.abs(phi(na, pa) - phi(nb, pb)))


def variant(graph, kind: str, seed: int):
    """θ' from θ: every param entry changed by the rule of ``kind``."""
    rng = np.random.default_rng(seed)

    def change(p):
        v = p.value
        if kind == "prune":
            return p.with_value(v * (rng.random(v.shape) < 0.6))
        if kind == "shrink":
            return p.with_value(v * rng.uniform(0, 1, v.shape))
        if kind == "grow":
            return p.with_value(v * rng.uniform(1, 2, v.shape))
        if kind == "same_signs":
            return p.with_value(v * rng.uniform(0, 2, v.shape))
        return p.with_value(v + rng.normal(scale=0.5, size=v.shape))

    return graph.map_params(change)


def _le(a, b, rtol=1e-9):
    return a <= b * (1 + rtol) + 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40)
@given(graph=relu_dags(), kind=st.sampled_from(KINDS), seed=st.integers(0, 2**32 - 1))
def test_brackets_hold_around_enumeration(backend, graph, kind, seed):
    other = variant(graph, kind, seed)
    m = path_metric(graph, other, backend)
    d = enumerated_metric(graph, other)
    assert _le(m.lower, d) and _le(d, m.upper)
    if kind in ("prune", "shrink", "grow"):
        assert m.exact and m.same_signs
    if m.exact:
        assert m.lower == m.upper
        assert m.lower == pytest.approx(d, rel=1e-9, abs=1e-12)
    if kind != "perturb":
        assert m.same_signs


@settings(max_examples=30)
@given(graph=relu_dags(), seed=st.integers(0, 2**32 - 1))
def test_lower_bracket_is_the_difference_of_path_norms(graph, seed):
    other = variant(graph, "perturb", seed)
    m = path_metric(graph, other, "numpy")
    # the same graph, not compile(graph): its batch-norm folding merges a bias met by a shift
    # into one path (|a b1 + b2|, docs/ir.md), which is another, equally exact, lifting
    be = pathir.backends.get_backend("numpy")
    assert m.norm_a == pytest.approx(lifted_path_norm(graph, 1, be), rel=1e-12, abs=0)
    assert m.lower == pytest.approx(abs(m.norm_a - m.norm_b), rel=1e-9, abs=1e-12)


@settings(max_examples=30)
@given(data=st.data(), graph=relu_dags(), kind=st.sampled_from(KINDS), seed=st.integers(0, 2**32 - 1))
def test_brackets_are_invariant_under_a_joint_rescaling(data, graph, kind, seed):
    other = variant(graph, kind, seed)
    z = data.draw(rescalings(graph))
    units = find_units(graph)[1]
    m = path_metric(graph, other, "numpy")
    r = path_metric(rescale_graph(graph, units, z), rescale_graph(other, units, z), "numpy")
    assert r.upper == pytest.approx(m.upper, rel=1e-9, abs=1e-12)
    assert r.lower == pytest.approx(m.lower, rel=1e-7, abs=1e-9 * max(m.norm_a, 1))
    assert (r.exact, r.same_signs) == (m.exact, m.same_signs)  # D scales θ_i and θ'_i alike


@settings(max_examples=60)
@given(data=st.data(), graph=relu_dags(), kind=st.sampled_from(["prune", "shrink", "grow", "same_signs"]),
       seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([0.1, 1.0, 10.0]))
def test_output_difference_never_exceeds_the_bound(data, graph, kind, seed, scale):
    other = variant(graph, kind, seed)
    x = {k: v * scale for k, v in data.draw(random_inputs(graph)).items()}
    be = pathir.backends.get_backend("numpy")
    ya, yb = forward(graph, be, x), forward(other, be, x)
    diff = sum(np.abs(ya[o] - yb[o]).reshape(len(ya[o]), -1).sum(axis=1) for o in graph.outputs)
    bound = output_bound(graph, other, x, "numpy")
    assert bound.shape == diff.shape
    assert np.all(diff <= bound * (1 + 1e-9) + 1e-12)
    # the theorem itself, with the enumerated d
    sup = np.maximum(np.max([np.abs(v).reshape(len(v), -1).max(axis=1) for v in x.values()], axis=0), 1)
    assert np.all(diff <= sup * enumerated_metric(graph, other) * (1 + 1e-9) + 1e-12)


def test_output_bound_on_torch_models():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                              torch.nn.Flatten(), torch.nn.Linear(3, 2)).double()
    pruned = copy.deepcopy(net)
    with torch.no_grad():
        pruned[0].weight.mul_((torch.rand_like(pruned[0].weight) < 0.5).double())
    a, b = pathir.compile(net, input_shape=(2, 4, 4)), pathir.compile(pruned, input_shape=(2, 4, 4))
    m = pathir.path_metric(a, b)
    assert m.exact and m.lower == m.upper > 0
    x = 3 * torch.randn(16, 2, 4, 4, dtype=torch.float64)
    diff = (net(x) - pruned(x)).abs().sum(dim=1).detach().numpy()
    bound = pathir.output_bound(a, b, x)
    assert np.all(diff <= bound) and np.allclose(bound, np.maximum(x.abs().amax(dim=(1, 2, 3)).numpy(), 1) * m.upper)


def test_opposite_signs_refuse_the_output_bound():
    g = next_mlp(((1.0, -2.0), (3.0,)))
    flipped = next_mlp(((1.0, 2.0), (3.0,)))
    m = path_metric(g, flipped, "numpy")
    assert not m.same_signs and not m.exact
    with pytest.raises(PathirError, match=r"signs differ at param '.*', entry \(0, 1\): -2 against 2 \(1 entries"):
        output_bound(g, flipped, np.ones((1, 2)), "numpy")


def test_a_sign_flip_made_by_batch_norm_folding_is_named_as_such():
    """Every torch parameter keeps its sign; the folded bias (b - μ)γ/σ + β flips. The refusal said "the two
    models have parameters of opposite signs", false of the user's models, naming nothing."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2), torch.nn.ReLU(),
                              torch.nn.Linear(2, 1)).double().eval()
    with torch.no_grad():
        net[0].bias.fill_(0.5), net[1].running_mean.fill_(1.0), net[1].weight.fill_(1.0), net[1].bias.fill_(0.1)
    grown = copy.deepcopy(net)
    with torch.no_grad():
        for p in grown.parameters():
            p.mul_(2.0)  # same signs everywhere; the folded bias goes from -0.4 to +0.2
    a, b = pathir.compile(net, input_shape=(3,)), pathir.compile(grown, input_shape=(3,))
    with pytest.raises(PathirError, match=r"param '1.bias', computed from .*batch-norm folded"):
        output_bound(a, b, np.ones((1, 3)), "numpy")


def next_mlp(weights, bias=None):
    b = GraphBuilder()
    x = b.input("x", (len(weights[0]),))
    h = b.relu("h", [(x, Dense(b.param("w1", [weights[0]])))], bias=None if bias is None else b.param("b1", [bias]))
    return b.build(outputs=[b.identity("y", [(h, Dense(b.param("w2", [weights[1]])))])])


def test_different_architectures_are_refused_with_the_difference():
    with pytest.raises(PathirError, match="same architecture.*bias"):
        path_metric(next_mlp(((1.0, 2.0), (3.0,))), next_mlp(((1.0, 2.0), (3.0,)), bias=1.0))
    with pytest.raises(PathirError, match=r"same architecture: node 0 'x': input\[2\] vs 'x': input\[3\]"):
        check_same_architecture(next_mlp(((1.0, 2.0), (3.0,))), next_mlp(((1.0, 2.0, 3.0), (3.0,))))
    with pytest.raises(TypeError, match="Compiled or a Graph"):
        path_metric(object(), object())


# ------------------------------------------------ the classical bound along a rescaling orbit


def classical_bound(ga, gb, x) -> np.ndarray:
    """A parameter-space Lipschitz bound for a layered network (hybrid argument):
    ‖R_θ(x) − R_θ'(x)‖₁ ≤ √d_out Σ_ℓ Π_{k>ℓ} ‖W_k‖₂ (‖W_ℓ − W'_ℓ‖₂ a'_{ℓ−1} + ‖b_ℓ − b'_ℓ‖₂),
    with a'_0 = ‖x‖₂ and a'_ℓ = ‖W'_ℓ‖₂ a'_{ℓ−1} + ‖b'_ℓ‖₂ bounding θ''s activations."""
    layers_a = [(n.edges[0].map.W.value, n.bias.value) for n in ga.nodes[1:]]
    layers_b = [(n.edges[0].map.W.value, n.bias.value) for n in gb.nodes[1:]]
    norm = lambda m: np.linalg.norm(m, 2)  # noqa: E731
    a = np.linalg.norm(x, axis=1)
    total = 0.0
    for l, ((Wa, ba), (Wb, bb)) in enumerate(zip(layers_a, layers_b)):
        lip = math.prod(norm(W) for W, _ in layers_a[l + 1:])
        total = total + lip * (norm(Wa - Wb) * a + np.linalg.norm(ba - bb))
        a = norm(Wb) * a + np.linalg.norm(bb)
    return math.sqrt(ga.node(ga.outputs[0]).numel) * total


def layered(widths, rng):
    b = GraphBuilder("mlp")
    prev = b.input("x", (widths[0],))
    for i, (d_in, d_out) in enumerate(zip(widths[:-1], widths[1:]), start=1):
        last = i == len(widths) - 1
        edges = [(prev, Dense(b.param(f"w{i}", rng.normal(size=(d_out, d_in)))))]
        prev = (b.identity if last else b.relu)("out" if last else f"h{i}", edges, bias=b.param(f"b{i}", rng.normal(size=d_out)))
    return b.build(outputs=[prev])


def test_classical_bound_grows_along_a_rescaling_orbit_the_path_bound_does_not():
    rng = np.random.default_rng(0)
    graph = layered((3, 5, 4, 2), rng)
    other = graph.map_params(lambda p: p.with_value(p.value * rng.uniform(0.5, 1.5, p.shape)))
    units = find_units(graph)[1]
    x = rng.normal(size=(8, 3))
    be = pathir.backends.get_backend("numpy")
    direction = rng.choice([-1.0, 1.0], size=len(units))
    path_bounds, classical = [], []
    for t in [0.0, 2.0, 4.0, 8.0, 16.0]:
        a, b = rescale_graph(graph, units, t * direction), rescale_graph(other, units, t * direction)
        diff = np.abs(forward(a, be, x)["out"] - forward(b, be, x)["out"]).sum(axis=1)
        path_bounds.append(output_bound(a, b, x, "numpy"))
        classical.append(classical_bound(a, b, x))
        assert np.all(diff <= path_bounds[-1] * (1 + 1e-9)) and np.all(diff <= classical[-1] * (1 + 1e-9))
    for pb in path_bounds[1:]:
        np.testing.assert_allclose(pb, path_bounds[0], rtol=1e-9)
    ratios = [float(np.min(c / classical[0])) for c in classical]
    assert all(r2 > r1 for r1, r2 in zip(ratios[1:], ratios[2:])) and ratios[-1] > 1e3


def test_models_with_a_resample_edge_compare_their_per_axis_matrices():
    """nn.Upsample's Resample holds a tuple of per-axis matrices: the architecture check raised numpy's
    'truth value of an array is ambiguous'."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Upsample(scale_factor=2, mode="bilinear"), torch.nn.Flatten(),
                              torch.nn.Linear(2 * 8 * 8, 1)).double()
    pruned = copy.deepcopy(net)
    with torch.no_grad():
        pruned[0].weight[pruned[0].weight.abs() < 0.2] = 0.0
    a, b = (pathir.compile(m, input_shape=(1, 4, 4)) for m in (net, pruned))
    d = pathir.path_metric(a, b)
    assert 0 < d.lower <= d.upper
    assert pathir.path_metric(a, a).upper == 0


@pytest.mark.parametrize("scale", [1e-110, 1e-105, 1e-103])
def test_an_upper_bracket_below_float64s_range_is_not_read_as_zero(scale):
    """Three layers of weights 1e-110 and one weight pruned: d = 1e-330, below float64's smallest subnormal, so the
    upper bracket read 0 and output_bound 0 at ‖x‖∞ = 1e300 while the model's own outputs differ by 1e-30. The
    upper bracket now rounds up out of the normal range, and the bound is the product of the logs."""
    net = torch.nn.Sequential(torch.nn.Linear(1, 2, bias=False), torch.nn.ReLU(), torch.nn.Linear(2, 1, bias=False),
                              torch.nn.ReLU(), torch.nn.Linear(1, 1, bias=False)).double()
    with torch.no_grad():
        for layer in (net[0], net[2], net[4]):
            layer.weight.fill_(scale)
    pruned = copy.deepcopy(net)
    with torch.no_grad():
        pruned[0].weight[1] = 0.0
    a, b = pathir.compile(net, input_shape=(1,)), pathir.compile(pruned, input_shape=(1,))
    metric = pathir.path_metric(a, b)
    assert metric.upper > 0 and metric.log10_upper == pytest.approx(3 * math.log10(scale), rel=1e-12)
    x = torch.tensor([[1e300], [1.0]], dtype=torch.float64)
    with torch.no_grad():
        gap = (net(x) - pruned(x)).abs().sum(dim=1).numpy()
    bound = pathir.output_bound(a, b, x, metric=metric)
    assert np.all(bound >= gap) and bound[0] == pytest.approx(scale ** 3 * 1e300, rel=1e-10)


def test_output_bound_refuses_a_metric_that_is_not_one():
    net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1)).double()
    cm = pathir.compile(net, input_shape=(2,))
    with pytest.raises(PathirError, match="metric= takes the PathMetric"):
        pathir.output_bound(cm, cm, np.ones((1, 2)), metric="x")


def test_output_bound_refuses_the_metric_of_another_pair_or_of_weights_changed_since():
    """metric= of (a, a), d = 0, passed to bound (a, pruned a) gave a bound of 0 under a real change of 0.3
    (review): a PathMetric carries a digest of its pair, checked."""
    from pathir.errors import ArgumentError

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).double()
    pruned = copy.deepcopy(net)
    with torch.no_grad():
        pruned[0].weight[0] = 0.0
    a, b = pathir.compile(net, input_shape=(3,)), pathir.compile(pruned, input_shape=(3,))
    x = torch.randn(5, 3, dtype=torch.float64)
    with pytest.raises(ArgumentError, match="not the path-metric of these two models"):
        pathir.output_bound(a, b, x, metric=pathir.path_metric(a, a))
    m = pathir.path_metric(a, b)
    assert np.array_equal(pathir.output_bound(a, b, x, metric=m), pathir.output_bound(a, b, x))
    assert "pair" not in m.to_dict()
    with torch.no_grad():
        pruned[0].weight[1] = 0.0  # pruned again: b follows its model, m is stale
    with pytest.raises(ArgumentError, match="weights changed since"):
        pathir.output_bound(a, b, x, metric=m)


def test_the_lower_bracket_of_a_rescaled_twin_is_not_above_its_rounding():
    """θ' = θ with hidden units rescaled by 7.3 and 0.01: Φ' = Φ up to the rescaled weights' rounding (d about
    1e-17), and |‖Φ‖₁ − ‖Φ'‖₁| of two separately rounded norms read 2e-16 as a lower bracket (review). The
    lower bracket is that difference less the walks' rounding: 0 here."""
    b = GraphBuilder()
    x = b.input("x", (3,))
    rng = np.random.default_rng(0)
    h = b.relu("h", [(x, Dense(b.param("w1", rng.normal(size=(4, 3)))))], b.param("b1", rng.normal(size=4)))
    graph = b.build(outputs=[b.identity("y", [(h, Dense(b.param("w2", rng.normal(size=(2, 4)))))])])
    units = find_units(graph)[1]
    twin = rescale_graph(graph, units, np.log([7.3, 0.01, 1.0, 3.0]))
    m = path_metric(graph, twin, "numpy")
    assert m.lower == 0.0 and m.norm_b == pytest.approx(m.norm_a, rel=1e-14)


def test_the_metrics_digest_holds_the_fixed_maps_so_a_buffer_changed_since_is_refused():
    """fc2(relu(fc1(x)) * self.s) with s = 2 and s = 200: the digest held only the maps' kinds, so the metric of
    one pair (d = 0.41) certified a bound for the other under a real change of 28.6 (review)."""
    from pathir.errors import ArgumentError

    class Scaled(torch.nn.Module):
        def __init__(self, s):
            super().__init__()
            torch.manual_seed(0)
            self.fc1, self.fc2 = torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)
            self.register_buffer("s", torch.tensor(float(s), dtype=torch.float64))

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)) * self.s)

    def pair(s):
        a, b = Scaled(s).double(), Scaled(s).double()
        with torch.no_grad():
            b.fc1.weight[0] = 0.0
        return pathir.compile(a, input_shape=(2,)), pathir.compile(b, input_shape=(2,)), b

    a1, b1, model_b1 = pair(2)
    a2, b2, _ = pair(200)
    x = torch.randn(4, 2, dtype=torch.float64)
    m1 = pathir.path_metric(a1, b1)
    with pytest.raises(ArgumentError, match="not the path-metric of these two models"):
        pathir.output_bound(a2, b2, x, metric=m1)
    assert np.array_equal(pathir.output_bound(a1, b1, x, metric=m1), pathir.output_bound(a1, b1, x))
    with torch.no_grad():
        model_b1.s.mul_(100.0)  # a buffer changed in place since the metric
    with pytest.raises(ArgumentError, match="weights changed since"):
        pathir.output_bound(a1, b1, x, metric=m1)


def test_subnormal_brackets_round_outwards_on_both_metrics():
    """d = |w1 · w2| of one path in float64's subnormal range: exp(log d) rounds to nearest, and lower read one
    subnormal step above d, the active metric's upper (and local bound) one below, on about half of 300 draws
    (metric review). Checked against the exact rational d."""
    from fractions import Fraction

    rng = np.random.default_rng(0)
    for w2 in rng.uniform(5e-161, 1e-160, size=40):
        net = torch.nn.Sequential(torch.nn.Linear(1, 1, bias=False), torch.nn.ReLU(),
                                  torch.nn.Linear(1, 1, bias=False)).double()
        with torch.no_grad():
            net[0].weight.fill_(1e-160)
            net[2].weight.fill_(float(w2))
        half = copy.deepcopy(net)
        with torch.no_grad():
            half[0].weight.fill_(5e-161)
        a, b = pathir.compile(net, input_shape=(1,)), pathir.compile(half, input_shape=(1,))
        d = Fraction(1e-160) * Fraction(float(w2)) - Fraction(5e-161) * Fraction(float(w2))
        metric = pathir.path_metric(a, b)
        assert Fraction(metric.lower) <= d <= Fraction(metric.upper)
        active = pathir.active_path_metric(a, b, np.ones((1, 1)))
        assert Fraction(float(active.lower[0])) <= d <= Fraction(float(active.upper[0]))
        assert d <= Fraction(float(active.bound[0]))
