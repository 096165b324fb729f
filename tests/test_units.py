"""find_units: rescaling units (docs/math.md §5) on hand-built and random graphs."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pathir.analyses.find_units import Units, find_units
from pathir.errors import PathirError
from pathir.ir import ChannelMap, Conv, Dense, GraphBuilder, Identity, Pool, Reshape, Scale, SpatialMatrix
from pathir.testing import mlps, relu_dags

RNG = np.random.default_rng(0)


def _p(b, name, shape):
    return b.param(name, RNG.normal(size=shape))


def _conv(b, name, o, i, k=3, pad=1):
    return Conv(_p(b, name, (o, i, k, k)), (1, 1), ((pad, pad), (pad, pad)), (1, 1))


def _window(k=2):
    return Pool((k, k), (k, k), ((0, 0), (0, 0)), (1, 1))


def plain_cnn():
    """x -> conv1 relu -> maxpool -> conv2 relu -> avgpool -> flatten -> fc."""
    b = GraphBuilder("cnn")
    x = b.input("x", (2, 4, 4))
    a = b.relu("conv1", [(x, _conv(b, "conv1.weight", 3, 2))], bias=_p(b, "conv1.bias", 3))
    p = b.maxpool("pool", a, _window())
    c = b.relu("conv2", [(p, _conv(b, "conv2.weight", 4, 3))], bias=_p(b, "conv2.bias", 4))
    avg = b.identity("avg", [(c, Pool((2, 2), (2, 2), ((0, 0), (0, 0)), (1, 1), mult=np.full((1, 1), 0.25)))])
    f = b.identity("flat", [(avg, Reshape((4,)))])
    y = b.identity("fc", [(f, Dense(_p(b, "fc.weight", (2, 4))))], bias=_p(b, "fc.bias", 2))
    return b.build(outputs=[y])


def resnet_like(C=3):
    """stem -> two residual blocks on one stream -> adaptive pool -> fc."""
    b = GraphBuilder("res")
    x = b.input("x", (2, 4, 4))
    s = b.relu("stem", [(x, _conv(b, "stem.weight", C, 2))])
    for k in range(2):
        h = b.relu(f"layer1.{k}.relu", [(s, _conv(b, f"layer1.{k}.conv1.weight", C, C))], bias=_p(b, f"layer1.{k}.b1", C))
        s = b.relu(
            f"layer1.{k}.out", [(h, _conv(b, f"layer1.{k}.conv2.weight", C, C)), (s, Identity())],
            bias=_p(b, f"layer1.{k}.b2", C),
        )
    g = b.identity("gap", [(s, SpatialMatrix(np.full((1, 16), 1 / 16), (1, 1)))])
    f = b.identity("flat", [(g, Reshape((C,)))])
    y = b.identity("fc", [(f, Dense(_p(b, "fc.weight", (2, C))))])
    return b.build(outputs=[y])


def concat_net():
    """two conv branches concatenated along channels, then a conv and a head."""
    b = GraphBuilder("cat")
    x = b.input("x", (2, 3, 3))
    a = b.relu("a", [(x, _conv(b, "ca.weight", 2, 2))])
    h = b.relu("h", [(x, _conv(b, "ch.weight", 3, 2))])
    c = b.identity("cat", [(a, ChannelMap((0, 1, -1, -1, -1))), (h, ChannelMap((-1, -1, 0, 1, 2)))])
    d = b.relu("d", [(c, _conv(b, "cd.weight", 2, 5))])
    f = b.identity("flat", [(d, Reshape((18,)))])
    y = b.identity("y", [(f, Dense(_p(b, "fc.weight", (1, 18))))])
    return b.build(outputs=[y])


# --------------------------------------------------------------- counts


@settings(max_examples=25)
@given(mlps())
def test_mlp_has_one_unit_per_hidden_neuron(graph):
    _, units = find_units(graph)
    hidden = [n for n in graph.nodes if graph.is_hidden(n.name)]
    assert len(units) == sum(n.channels for n in hidden)
    for unit in units:
        (node, c), = unit.members
        layer = int(node[1:])  # h<i> is fed by w<i> and read by w<i+1>
        assert unit.name == f"w{layer}:c{c}"
        incoming = {p.name: idx.tolist() for p, idx in unit.incoming}
        outgoing = {p.name: idx.tolist() for p, idx in unit.outgoing}
        d_in = graph.node(node).edges[0].map.W.shape[1]
        assert incoming.pop(f"w{layer}") == list(range(c * d_in, (c + 1) * d_in))
        assert incoming == ({f"b{layer}": [c]} if graph.node(node).bias is not None else {})
        W_next = graph.params()[[p.name for p in graph.params()].index(f"w{layer + 1}")]
        assert outgoing == {f"w{layer + 1}": list(range(c, W_next.size, W_next.shape[1]))}


def test_plain_cnn_has_one_unit_per_channel():
    graph = plain_cnn()
    _, units = find_units(graph)
    assert units.names == ("conv1:c0", "conv1:c1", "conv1:c2", "conv2:c0", "conv2:c1", "conv2:c2", "conv2:c3")
    # pooling windows and the flatten tie a channel across nodes
    assert units["conv1:c1"].members == (("conv1", 1), ("pool", 1))
    assert units["conv2:c3"].members == (("conv2", 3), ("avg", 3), ("flat", 3))
    u = units["conv2:c3"]
    assert [(p.name, idx.size) for p, idx in u.incoming] == [("conv2.weight", 27), ("conv2.bias", 1)]
    assert [(p.name, idx.tolist()) for p, idx in u.outgoing] == [("fc.weight", [3, 7])]
    assert [(p.name, idx.size) for p, idx in units[0].outgoing] == [("conv2.weight", 36)]


def test_resnet_stream_channels_are_tied_across_blocks():
    graph = resnet_like(C=3)
    _, units = find_units(graph)
    assert len(units) == 3 + 2 * 3  # one stream unit per channel + each block's inner channels
    stream = units[units.index("stream:layer1/c2")]
    assert [m for m in stream.members] == [
        ("stem", 2), ("layer1.0.out", 2), ("layer1.1.out", 2), ("gap", 2), ("flat", 2)
    ]
    assert units.names[3:6] == ("layer1.0.conv1:c0", "layer1.0.conv1:c1", "layer1.0.conv1:c2")
    # the stream's inputs: stem and both conv2 (plus biases); outputs: both conv1 and fc
    assert sorted(p.name for p, _ in stream.incoming) == sorted(
        ["stem.weight", "layer1.0.conv2.weight", "layer1.0.b2", "layer1.1.conv2.weight", "layer1.1.b2"]
    )
    assert sorted(p.name for p, _ in stream.outgoing) == ["fc.weight", "layer1.0.conv1.weight", "layer1.1.conv1.weight"]


def test_concat_ties_each_slice_to_its_branch():
    graph = concat_net()
    _, units = find_units(graph)
    assert units.names == ("ca:c0", "ca:c1", "ch:c0", "ch:c1", "ch:c2", "cd:c0", "cd:c1")
    assert units["ch:c1"].members == (("h", 1), ("cat", 3))
    assert units.channel_units["cat"].tolist() == [0, 1, 2, 3, 4]


def test_inputs_and_outputs_pin_their_classes():
    b = GraphBuilder()
    x = b.input("x", (2, 4, 4))
    p = b.identity("pool", [(x, _window())])  # tied to the input: pinned
    h = b.relu("h", [(p, _conv(b, "c1", 2, 2))])
    k = b.relu("k", [(h, _conv(b, "c2", 2, 2))])
    y = b.identity("y", [(k, Identity()), (h, _conv(b, "c3", 2, 2))])  # k tied to the output
    graph = b.build(outputs=[y])
    _, units = find_units(graph)
    assert units.names == ("c1:c0", "c1:c1")
    assert units.channel_units["pool"].tolist() == [units.no_unit] * 2
    assert units.channel_units["k"].tolist() == [units.no_unit] * 2


def test_weight_shared_by_two_edges_ties_their_ends():
    b = GraphBuilder()
    x = b.input("x", (2,))
    W = b.param("shared", RNG.normal(size=(3, 2)))
    a = b.relu("a", [(x, Dense(W))])
    c = b.relu("c", [(x, Dense(W))], bias=b.param("bias", RNG.normal(size=3)))
    y = b.identity("y", [(a, Dense(b.param("va", RNG.normal(size=(1, 3))))), (c, Dense(b.param("vc", RNG.normal(size=(1, 3)))))])
    _, units = find_units(b.build(outputs=[y]))
    assert len(units) == 3
    assert units.names[0] == "shared:c0" and units[0].members == (("a", 0), ("c", 0))
    assert units[1].members == (("a", 1), ("c", 1))


def test_chained_shared_weight_pins_what_the_input_pins():
    b = GraphBuilder()
    x = b.input("x", (2,))
    W = b.param("W", RNG.normal(size=(2, 2)))
    h1 = b.relu("h1", [(x, Dense(W))])
    h2 = b.relu("h2", [(h1, Dense(W))])  # W's source side ties h1 to x
    h3 = b.relu("h3", [(h2, Dense(b.param("V", RNG.normal(size=(2, 2)))))])
    y = b.identity("y", [(h3, Dense(b.param("U", RNG.normal(size=(1, 2)))))])
    _, units = find_units(b.build(outputs=[y]))
    assert units.names == ("V:c0", "V:c1")


def test_param_used_as_weight_and_bias_is_refused():
    b = GraphBuilder()
    x = b.input("x", (2, 3))
    s = b.param("s", np.ones(2))
    h = b.relu("h", [(x, Scale(s))], bias=s)
    y = b.identity("y", [(h, Dense(b.param("w", np.ones((1, 6)))))])
    with pytest.raises(PathirError, match="param 's' is both an edge weight and a bias"):
        find_units(b.build(outputs=[y]))


def test_weight_inside_one_unit_is_on_neither_side():
    b = GraphBuilder()
    x = b.input("x", (2,))
    a = b.relu("a", [(x, Dense(b.param("w", RNG.normal(size=(2, 2)))))])
    c = b.relu("c", [(a, Scale(b.param("s", RNG.normal(size=2)))), (a, Identity())])
    y = b.identity("y", [(c, Dense(b.param("v", RNG.normal(size=(1, 2)))))])
    _, units = find_units(b.build(outputs=[y]))
    assert len(units) == 2
    for u in units:
        assert "s" not in {p.name for p, _ in u.incoming + u.outgoing}
    assert units.sizes[0].tolist() == [2, 2] and units.sizes[1].tolist() == [1, 1]


def test_units_object_is_readable_and_frozen():
    _, units = find_units(plain_cnn())
    assert isinstance(units, Units) and len(units) == 7
    text = str(units)
    assert text.splitlines()[0] == "7 rescaling units over 18 channels"
    assert "conv2:c3: 3 channels in 3 nodes, in 28, out 2" in text
    assert str(units[0]) == "unit 0 'conv1:c0': 2 channels in conv1, pool; in: conv1.weight[18], conv1.bias[1]; out: conv2.weight[36]"
    with pytest.raises(Exception):
        units.names = ()
    with pytest.raises(KeyError, match="no unit named 'nope'"):
        units["nope"]


def test_find_units_returns_the_graph_untouched():
    graph = resnet_like()
    out, _ = find_units(graph)
    assert out is graph


# --------------------------------------------------------------- random DAGs


@settings(max_examples=200)
@given(relu_dags())
def test_units_partition_the_free_channels_and_respect_every_tie(graph):
    _, units = find_units(graph)
    cu = units.channel_units
    for n in graph.nodes:
        if not graph.is_hidden(n.name):
            assert (cu[n.name] == units.no_unit).all(), n.name
        for e in n.edges:
            if e.map.weight is None:
                pairs = e.map.channel_ties(graph.node(e.source).shape)
                assert (cu[e.source][pairs[:, 0]] == cu[n.name][pairs[:, 1]]).all()
    seen = set()
    for h, members in enumerate(units.members):
        assert members, f"unit {h} is empty"
        for node, c in members:
            assert cu[node][c] == h and (node, c) not in seen
            seen.add((node, c))
    assert len(seen) == sum(int((a < units.no_unit).sum()) for a in cu.values())
    assert len(set(units.names)) == len(units)
    # each unit's sides, entry by entry, are what B's columns say
    n_in, n_out = units.sizes
    for h in range(len(units)):
        u = units[h]
        assert sum(i.size for _, i in u.incoming) == n_in[h]
        assert sum(i.size for _, i in u.outgoing) == n_out[h]


@given(st.data())
@settings(max_examples=150)
def test_classes_marked_crossing_are_those_of_the_full_broadcast(data):
    """The compact shortcut (no shared axis: every target meets every source) marks what the
    entry-by-entry definition on the broadcast param marks."""
    from pathir.analyses.find_units import mark_crossing

    ndim = data.draw(st.integers(1, 3))
    full = data.draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim))
    t_shape = [d if data.draw(st.booleans()) else 1 for d in full]
    s_shape = [d if data.draw(st.booleans()) else 1 for d in full]
    s_shape = s_shape[data.draw(st.integers(0, ndim - 1)):]  # fewer leading axes broadcast too
    classes = data.draw(st.integers(1, 4))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    tc, sc = rng.integers(0, classes, t_shape), rng.integers(0, classes, s_shape)
    got = np.zeros(classes, dtype=bool)
    mark_crossing(got, tc, sc)
    a, b = np.broadcast_arrays(tc, sc)
    expected = np.zeros(classes, dtype=bool)
    expected[a[a != b]] = True
    expected[b[a != b]] = True
    assert np.array_equal(got, expected)


def _token_mlp(relu_after):
    import torch

    class TokenMLP(torch.nn.Module):
        """Linear over the last axis of (tokens, features), as MLP-Mixer and transformer MLPs write it."""

        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)

        def forward(self, x):
            h = self.a(x)
            h = torch.relu(h) if relu_after == "linear" else torch.relu(h.transpose(1, 2)).transpose(1, 2)
            return self.b(h)

    torch.manual_seed(0)
    return TokenMLP().double()


@pytest.mark.parametrize("relu_after", ["linear", "transpose"])
def test_a_token_wise_mlp_has_one_unit_per_hidden_feature(relu_after):
    """The ReLU of a token-wise Linear's output was a node of the token layout, whose channels are the tokens: an
    element move tied every hidden feature to every other, one unit where the model has 4 (each hidden feature's
    rescaling keeps it exactly). The ReLU of a permutation is now the permutation of the ReLU."""
    import torch

    import pathir

    model = _token_mlp(relu_after)
    cm = pathir.compile(model, input_shape=(2, 3))
    assert len(cm.units) == 4
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    for f in range(4):  # the symmetry each unit stands for, on the model itself
        scaled = _token_mlp(relu_after)
        with torch.no_grad():
            scaled.a.weight[f] *= 3.0
            scaled.a.bias[f] *= 3.0
            scaled.b.weight[:, f] /= 3.0
        assert torch.allclose(scaled(x), model(x), rtol=1e-12, atol=1e-12)
    cm.pathcond(progress=False)  # the rescaling written per feature keeps the function
    assert torch.allclose(model(x), _token_mlp(relu_after)(x), rtol=1e-9, atol=1e-12)


def _token_residual_mlp():
    import torch

    class TokenResidual(torch.nn.Module):
        """A token-wise MLP with a skip: relu(b(h)) + h, h = relu(a(x)), on (tokens, features)."""

        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = torch.nn.Linear(3, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

        def forward(self, x):
            h = torch.relu(self.a(x))
            return self.c(torch.relu(self.b(h)) + h)

    torch.manual_seed(0)
    return TokenResidual().double()


@pytest.mark.parametrize("path", ["fx", "export", "onnx"])
def test_a_token_wise_residual_mlp_has_one_unit_per_stream_feature(path):
    """h read twice (by b and by the skip) was made one node of the token layout, whose channels are the tokens:
    its element move tied every feature to every other, one unit where the model has 4 (a feature of the stream,
    rescaled in a, b and c together, keeps the function), and equalize moved nothing (review). A permutation
    read twice is now no node of its own."""
    import contextlib

    import torch
    from torch_programs import export_path

    import pathir

    model, x = _token_residual_mlp(), torch.randn(5, 2, 3, dtype=torch.float64)
    if path == "onnx":
        from onnx_cases import export

        cm = pathir.compile(export(model.float(), (2, 3), "legacy-nofold"))
        model = model.double()
    else:
        with export_path() if path == "export" else contextlib.nullcontext():
            cm = pathir.compile(model, input_shape=(2, 3))
    assert len(cm.units) == 4
    for f in range(4):  # the symmetry each unit stands for, on the model itself
        scaled = _token_residual_mlp()
        with torch.no_grad():
            for layer in (scaled.a, scaled.b):
                layer.weight[f] *= 3.0
                layer.bias[f] *= 3.0
            scaled.b.weight[:, f] /= 3.0
            scaled.c.weight[:, f] /= 3.0
        assert torch.allclose(scaled(x), model(x), rtol=1e-12, atol=1e-12)
    if path != "onnx":
        cm.equalize(bits=6, progress=False)
        assert torch.allclose(model(x), _token_residual_mlp()(x), rtol=1e-9, atol=1e-12)
