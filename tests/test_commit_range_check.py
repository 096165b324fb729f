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
