"""The float64 range check of a write-back runs on each block as the graph is rescaled
(``rescale_graph(..., kept=)``): every block is seen, and a refusal leaves model and graph untouched."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import pathir  # noqa: E402
from pathir.errors import PathirError  # noqa: E402
from pathir.rescaling import apply  # noqa: E402
from pathir.rescaling.apply import rescale_graph  # noqa: E402
from pathir.rescaling.commit import _kept_in_range  # noqa: E402


def _mlp(dtype=torch.float64):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 40), torch.nn.ReLU(), torch.nn.Linear(40, 50), torch.nn.ReLU(),
                              torch.nn.Linear(50, 2)).to(dtype)
    return net, pathir.compile(net, input_shape=(3,))


def _state(net):
    return {k: v.clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("blocks", [1, 7])
def test_an_overflow_in_the_last_entry_of_the_last_tensor_is_refused_untouched(monkeypatch, blocks):
    monkeypatch.setattr(apply, "_BLOCK", blocks)  # rows of one entry: the break is in the last block
    net, _ = _mlp()
    with torch.no_grad():
        net[4].weight[-1, -1] = 1e307
    cm = pathir.compile(net, input_shape=(3,))
    state, graph = _state(net), cm.graph
    z = np.zeros(len(cm.units))
    z[cm.units.channel_units[graph.nodes[-2].name][-1]] = -10.0  # the last hidden channel: its out-weights x e^5
    with pytest.raises(PathirError, match="overflows or underflows float64"):
        cm.commit_rescaling(z)
    assert cm.graph is graph and all(torch.equal(v, state[k]) for k, v in net.state_dict().items())


@settings(max_examples=30, deadline=None)
@given(st.floats(-3, 3), st.integers(1, 64))
def test_the_checked_rescaling_is_the_unchecked_one_bit_for_bit(scale, blocks):
    _, cm = _mlp()
    z = scale * np.cos(np.arange(len(cm.units)))
    old_block = apply._BLOCK
    try:
        apply._BLOCK = blocks
        checked = rescale_graph(cm.graph, cm.units, z, _kept_in_range)
    finally:
        apply._BLOCK = old_block
    plain = rescale_graph(cm.graph, cm.units, z)
    for p, q in zip(checked.params(), plain.params()):
        assert np.array_equal(p.value, q.value)


def test_a_float16_overflow_is_still_refused_untouched():
    net, cm = _mlp(torch.float16)
    state, graph = _state(net), cm.graph
    with pytest.raises(PathirError, match="does not fit torch.float16"):
        cm.commit_rescaling(np.full(len(cm.units), 30.0))
    assert cm.graph is graph and all(torch.equal(v, state[k]) for k, v in net.state_dict().items())


def test_a_float32_entry_a_small_rescaling_takes_below_the_normal_range_is_refused_untouched():
    """float32 tensors went unchecked under max|z| < log(1e6): a weight of 1e-44 (a float32 subnormal) became 0 and
    one of 1e-36 a subnormal at z = -13."""
    net, cm = _mlp(torch.float32)
    with torch.no_grad():
        net[0].weight[0, 0], net[0].weight[1, 0] = 1e-44, 1e-36
    cm = pathir.compile(net, input_shape=(3,))
    state, graph = _state(net), cm.graph
    with pytest.raises(PathirError, match="does not fit torch.float32: 2 entries"):
        cm.commit_rescaling(np.full(len(cm.units), -13.0))
    assert cm.graph is graph and all(torch.equal(v, state[k]) for k, v in net.state_dict().items())


@pytest.mark.parametrize("block", [1, 3, 7, 1 << 18])
def test_the_float32_range_check_counts_every_broken_entry_block_by_block(monkeypatch, block):
    """The written tensors are checked a block at a time, each block by one min/max unless it holds a zero, a
    subnormal or a non-finite entry: entries that break in different blocks, beside exact zeros that stay so,
    are all counted (and the write refused, model untouched), whatever the block size."""
    from pathir.rescaling import commit

    monkeypatch.setattr(commit, "_CHECK_BLOCK", block)
    net, cm = _mlp(torch.float32)
    with torch.no_grad():
        w = net[0].weight  # 40 x 3, scaled by e^-6.5: two entries that leave the normal range, two zeros that stay
        w[0, 0], w[10, 1], w[20, 2], w[39, 2] = 1e-44, 0.0, 1e-36, 0.0
    cm = pathir.compile(net, input_shape=(3,))
    state, graph = _state(net), cm.graph
    with pytest.raises(PathirError, match="does not fit torch.float32: 2 entries"):
        cm.commit_rescaling(np.full(len(cm.units), -13.0))
    assert cm.graph is graph and all(torch.equal(v, state[k]) for k, v in net.state_dict().items())


def _graph_with(values):
    from pathir.ir import Dense, GraphBuilder

    b = GraphBuilder()
    x = b.input("x", (len(values),))
    y = b.identity("y", [(x, Dense(b.param("w", [values])))])
    return b.build(outputs=[y])


@pytest.mark.parametrize("values, M, safe", [
    ([1e-300, 1.0], 10.0, True),          # e^{-10} keeps 1e-300 normal, with the margin
    ([1e-300, 1.0], 20.0, False),         # ... e^{-20} does not
    ([1e300, 1.0], 20.0, False),          # overflow side
    ([1e-310, 1.0], 0.5, False),          # a subnormal entry: any shrink may flush it
    ([0.0, 0.0], 300.0, True),            # zeros stay zeros
    ([np.inf, 1.0], 0.0, False),          # not finite: left to the entrywise check
])
def test_float64_safe_is_a_sufficient_condition(values, M, safe):
    from pathir.rescaling.bounds import float64_safe

    assert float64_safe(_graph_with(values), np.array([M, -M / 2])) is safe


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-300, 300), min_size=2, max_size=6), st.floats(0, 700))
def test_where_float64_safe_holds_the_entrywise_check_passes(log10s, M):
    """float64_safe only skips checks that would pass: wherever it holds, every entry times every
    factor in [e^{-M}, e^M] (both halves at either end) stays finite and nonzero."""
    from pathir.rescaling.bounds import float64_safe

    values = [10.0 ** v for v in log10s]
    if float64_safe(_graph_with(values), np.array([M])):
        for a in (np.exp(M / 2), np.exp(-M / 2)):  # θ · e^{z_e/2} · e^{-z_l/2}, as the commit multiplies
            for b in (np.exp(M / 2), np.exp(-M / 2)):
                assert _kept_in_range(np.asarray(values), np.asarray(values) * a * b)


def test_a_commit_past_the_magnitude_range_still_checks_every_entry(monkeypatch):
    """Where the graph's magnitude range does not settle it, the commit checks entry by entry (and
    refuses), and where it does the entrywise check is skipped."""
    from pathir.rescaling import commit

    calls = []
    real = commit.check_rescaling
    monkeypatch.setattr(commit, "check_rescaling", lambda *a, **k: (calls.append(1), real(*a, **k)))
    net, cm = _mlp()
    cm.commit_rescaling(0.1 * np.ones(len(cm.units)))
    assert calls == []
    with torch.no_grad():
        net[4].weight[0, 0] = 1e307
    cm = pathir.compile(net, input_shape=(3,))
    z = np.zeros(len(cm.units))
    z[cm.units.channel_units[cm.graph.nodes[-2].name][0]] = -10.0
    with pytest.raises(PathirError, match="overflows or underflows float64"):
        cm.commit_rescaling(z)
    assert calls == [1]
