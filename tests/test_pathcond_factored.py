"""cm.pathcond() with large dense layers' and 1×1 convolutions' diag G kept factored (g = b aᵀ,
`pathir.lifting.low_rank`) against the same call with every param grouped pair by pair: the same z,
report and written model, on random torch MLPs (flattened conv-shaped inputs, biases or none, dead
units, layers scaled over decades) and CNNs (1×1 convolutions between padded 3×3 ones, residual
adds, dead and scaled channels), on the torch and numpy backends; and the factors against the dense
diag G they stand for."""

import copy
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pathir
import pathir.lifting.low_rank as low_rank
from pathir.lifting.diag_g import diag_g_parts
from pathir.lifting.low_rank import LowRank, factorable
from pathir.pairs.gridded_pairs import GriddedPairs
from pathir.pathcond import g_summary

FIELDS = ("objective_before", "objective_after", "log_spread_before", "log_spread_after", "divergence_before",
          "divergence_after", "max_abs_log_scale", "params", "units")


@st.composite
def mlps(draw):
    """(model, input shape): Flatten, then Linear/ReLU layers of random widths, some rows zeroed (dead
    units), each layer's rows scaled by up to e^{±spread}."""
    seed = draw(st.integers(0, 2**31 - 1))
    torch.manual_seed(seed)
    shape = draw(st.sampled_from([(6,), (2, 3), (3, 2, 2)]))
    widths = [math.prod(shape)] + [draw(st.integers(1, 6)) for _ in range(draw(st.integers(1, 3)))] + [draw(st.integers(1, 3))]
    bias = draw(st.booleans())
    spread = draw(st.sampled_from([0.0, 2.0, 20.0]))
    dead = draw(st.sampled_from([0.0, 0.3]))
    layers = [torch.nn.Flatten()]
    for k in range(len(widths) - 1):
        lin = torch.nn.Linear(widths[k], widths[k + 1], bias=bias).double()
        with torch.no_grad():
            lin.weight.mul_(torch.exp(spread * torch.randn(widths[k + 1], 1, dtype=torch.float64)))
            lin.weight.mul_((torch.rand(widths[k + 1], 1) >= dead).double())
        layers += [lin, torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]), shape


def _pathcond(model, shape, factored: bool, backend=None, row_spread: float = low_rank.ROW_SPREAD):
    """The report, or the PathirError's message where PathCond refuses (diag G vanishing everywhere)."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(low_rank, "MIN_SIZE", 0 if factored else 1 << 62)
        m.setattr(low_rank, "CONV_RATIO", math.inf)
        m.setattr(low_rank, "ROW_SPREAD", row_spread)
        cm = pathir.compile(model, input_shape=shape)
        try:
            return cm.pathcond(backend=backend)
        except pathir.PathirError as err:
            return str(err)


@settings(derandomize=True, max_examples=40, deadline=None)
@given(mlps(), st.sampled_from(["torch", "numpy"]))
def test_pathcond_on_factored_dense_layers_matches_pathcond_on_every_pair(mlp, backend):
    _factored_matches_grouped(*mlp, backend)


def _factored_matches_grouped(model, shape, backend, row_spread: float = low_rank.ROW_SPREAD):
    """PathCond with factoring and without, on copies of ``model``: the same report, z and written model."""
    x = torch.randn(5, *shape, dtype=torch.float64)
    before = model(x).detach()
    grouped, factored = copy.deepcopy(model), copy.deepcopy(model)
    a, b = _pathcond(grouped, shape, False, backend), _pathcond(factored, shape, True, backend, row_spread)
    if isinstance(a, str) or isinstance(b, str):
        assert a == b
        return
    assert b.degenerate_units == a.degenerate_units and b.converged == a.converged
    for name in ("objective_before", "objective_after", "log_spread_before", "divergence_before", "params", "units"):
        assert getattr(b, name) == pytest.approx(getattr(a, name), rel=1e-9, abs=1e-9), name
    torch.testing.assert_close(factored(x).detach(), before, rtol=1e-9, atol=1e-9 * float(before.abs().max()))
    if a.gradient_relative > 1e-6:
        # some unit's terms sit below float64's resolution of the sum (weights spread over hundreds of
        # nats): F is flat to rounding along it, and the two solves may stop at different points of that
        # flat stretch; F agrees (above), z need not
        return
    # the same solver on sums taken in another order: z agrees to the Newton solve's own precision
    for name in FIELDS:
        assert getattr(b, name) == pytest.approx(getattr(a, name), rel=1e-7, abs=1e-7), name
    np.testing.assert_allclose(b.z, a.z, rtol=1e-7, atol=1e-7 * max(1.0, np.abs(a.z).max(initial=0.0)))
    for p, q in zip(grouped.parameters(), factored.parameters()):
        np.testing.assert_allclose(q.detach().numpy(), p.detach().numpy(), rtol=1e-6, atol=0)


class _Block(torch.nn.Module):
    """x + conv1x1(relu(conv3x3(x))) or the plain branch: 1×1 convolutions read maps whose borders differ."""

    def __init__(self, c, hidden, residual, bias):
        super().__init__()
        self.a = torch.nn.Conv2d(c, hidden, 3, padding=1, bias=bias)
        self.b = torch.nn.Conv2d(hidden, c, 1, bias=bias)
        self.residual = residual

    def forward(self, x):
        y = self.b(torch.relu(self.a(x)))
        return torch.relu(x + y if self.residual else y)


@st.composite
def cnns(draw):
    """(model, input shape): a 1×1 stem, blocks, a 1×1 head, global pooling or a flatten, a Linear; some
    output channels zeroed (dead units), each conv's channels scaled by up to e^{±spread}."""
    torch.manual_seed(draw(st.integers(0, 2**31 - 1)))
    c, side = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    width, bias = draw(st.integers(1, 5)), draw(st.booleans())
    spread, dead = draw(st.sampled_from([0.0, 2.0, 20.0])), draw(st.sampled_from([0.0, 0.3]))
    layers = [torch.nn.Conv2d(c, width, 1, bias=bias), torch.nn.ReLU()]
    for _ in range(draw(st.integers(0, 2))):
        layers.append(_Block(width, draw(st.integers(1, 4)), draw(st.booleans()), bias))
    out = draw(st.integers(1, 5))
    layers += [torch.nn.Conv2d(width, out, 1, bias=bias), torch.nn.ReLU()]
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()] if draw(st.booleans()) else [torch.nn.Flatten()]
    layers.append(torch.nn.Linear(out if isinstance(layers[-2], torch.nn.AdaptiveAvgPool2d) else out * side * side,
                                  draw(st.integers(1, 3))))
    model = torch.nn.Sequential(*layers).double()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Conv2d):
                m.weight.mul_(torch.exp(spread * torch.randn(m.out_channels, 1, 1, 1, dtype=torch.float64)))
                m.weight.mul_((torch.rand(m.out_channels, 1, 1, 1) >= dead).double())
    return model, (c, side, side)


@settings(derandomize=True, max_examples=40, deadline=None)
@given(cnns(), st.sampled_from(["torch", "numpy"]), st.sampled_from([low_rank.ROW_SPREAD, 1.0 + 1e-9]))
def test_pathcond_on_factored_pointwise_convs_matches_pathcond_on_every_pair(cnn, backend, row_spread):
    """Every 1×1 convolution factored (its rows bounded), or only those whose rows are constant (a row
    spread of 1: the others formed by the walk as any param)."""
    _factored_matches_grouped(*cnn, backend, row_spread)


def test_a_pointwise_convs_factors_multiply_to_its_dense_diag_g(monkeypatch):
    """A 1×1 convolution after a padded 3×3 one (rows not constant): its LowRank has one column per
    output position and multiplies to diag G's own part; with a row spread below its rows' it is formed."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 40, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(40, 50, 1),
                              torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(50 * 4, 2))
    cm = pathir.compile(net, input_shape=(3, 2, 2))
    graph, rows = cm.facts.graph, cm.facts.row_ends
    monkeypatch.setattr(low_rank, "MIN_SIZE", 0)
    outer = factorable(graph, rows.ends)
    assert [p.shape for p in graph.params() if id(p) in outer] == [(50, 40, 1, 1), (2, 200)]
    dense, top = diag_g_parts(graph, "numpy")
    kept, top_kept = diag_g_parts(graph, "numpy", outer)
    conv = [k for k in kept if isinstance(k, LowRank) and k.b.ndim == 2]
    assert len(conv) == 1 and conv[0].b.shape == (50, 4) and conv[0].a.shape == (40, 4)
    for p, d, k in zip(graph.params(), dense, kept):  # both at their common scales: g = part · e^top
        got = k.dense().reshape(p.shape) if isinstance(k, LowRank) else k
        np.testing.assert_allclose(got * math.exp(top_kept - top), d, rtol=1e-12, atol=1e-300)
    monkeypatch.setattr(low_rank, "ROW_SPREAD", 1.0)
    formed, _ = diag_g_parts(graph, "numpy", outer)
    assert not any(isinstance(k, LowRank) and k.b.ndim == 2 for k in formed)


def _alexnet_head():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d((4, 4)),
                               torch.nn.Flatten(), torch.nn.Linear(128, 600), torch.nn.ReLU(),
                               torch.nn.Linear(600, 300), torch.nn.ReLU(), torch.nn.Linear(300, 10))


def test_the_factors_multiply_to_the_dense_diag_g_and_only_large_dense_params_used_once_qualify(monkeypatch):
    """A conv stem, then three Linears: the two of ≥ 2^16 entries qualify (the first reads a flatten's run
    of positions per channel unit); their LowRank is diag G's own part, to rounding."""
    cm = pathir.compile(_alexnet_head(), input_shape=(3, 10, 10))
    graph, rows = cm.facts.graph, cm.facts.row_ends
    outer = factorable(graph, rows.ends)
    params = graph.params()
    assert [p.shape for p in params if id(p) in outer] == [(600, 128), (300, 600)]
    dense, top = diag_g_parts(graph, "numpy")
    kept, top_kept = diag_g_parts(graph, "numpy", outer)
    assert top_kept == pytest.approx(top, rel=1e-13)
    for p, d, k in zip(params, dense, kept):
        assert isinstance(k, LowRank) == (id(p) in outer)
        np.testing.assert_allclose(k.dense() if isinstance(k, LowRank) else k, d, rtol=1e-12, atol=1e-300)
    pairs, summary = g_summary.summarize_factored(kept, rows)
    assert isinstance(pairs, GriddedPairs) and len(summary.grids) == len(outer)
    monkeypatch.setattr(low_rank, "MIN_SIZE", 0)
    assert len(factorable(graph, rows.ends)) == 3


def test_a_shared_linear_and_a_walk_that_needs_per_channel_scales_stay_dense():
    """A Linear called twice is not factored; where the fast walk cannot certify a node (five rows of a layer
    scaled by e^250: the next weight's diag G spans e^500) the per-channel walk gives every part as an array, and
    pathcond still matches. (At e^400 that diag G spans e^800, more than one float64 scale holds: refused.)"""
    torch.manual_seed(1)
    lin = torch.nn.Linear(300, 300)
    shared = torch.nn.Sequential(lin, torch.nn.ReLU(), lin)
    cm = pathir.compile(shared, input_shape=(300,))
    assert not factorable(cm.facts.graph, cm.facts.row_ends.ends)
    net = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.ReLU(), torch.nn.Linear(300, 4)).double()
    with torch.no_grad():
        net[0].weight[:5] *= math.exp(250)
    facts = pathir.compile(net, input_shape=(300,)).facts
    graph = facts.graph
    outer = factorable(graph, facts.row_ends.ends)
    assert outer
    parts, _ = diag_g_parts(graph, "torch", outer)
    assert not any(isinstance(part, LowRank) for part in parts)
    x = torch.randn(3, 300, dtype=torch.float64)
    before = net(x).detach()
    a, b = _pathcond(copy.deepcopy(net), (300,), False), _pathcond(net, (300,), True)
    np.testing.assert_allclose(b.z, a.z, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(net(x).detach(), before.detach(), rtol=1e-9, atol=1e-9 * float(before.abs().max()))


class _PaddedPointwise(torch.nn.Module):
    """A 1×1 convolution reading a zero-padded map: its source rows hold zeros (the border) beside positive
    entries, so the walk must form its weight-gradient rather than keep factors."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(2, 30, 3, padding=1)
        self.point = torch.nn.Conv2d(30, 40, 1)
        self.head = torch.nn.Linear(40 * 16, 3)

    def forward(self, x):
        y = torch.relu(self.point(torch.nn.functional.pad(torch.relu(self.stem(x)), (1, 1, 1, 1))))
        return self.head(torch.flatten(y, 1))


def test_a_pointwise_conv_reading_zero_padding_is_formed_and_pathcond_is_unchanged(monkeypatch):
    torch.manual_seed(3)
    model = _PaddedPointwise().double()
    cm = pathir.compile(model, input_shape=(2, 2, 2))
    graph, rows = cm.facts.graph, cm.facts.row_ends
    monkeypatch.setattr(low_rank, "MIN_SIZE", 0)
    monkeypatch.setattr(low_rank, "CONV_RATIO", math.inf)
    outer = factorable(graph, rows.ends)
    point = next(p for p in graph.params() if p.shape == (40, 30, 1, 1))
    assert id(point) in outer  # allowed by its shape; refused by its rows
    parts, _ = diag_g_parts(graph, "torch", outer)
    assert not any(isinstance(k, LowRank) and k.b.ndim == 2 for k in parts)
    _factored_matches_grouped(model, (2, 2, 2), "torch")
