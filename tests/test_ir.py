"""The IR: each verifier rule broken on purpose, the printer, maps' shapes."""

from dataclasses import replace

import numpy as np
import pytest

from pathir import GraphVerificationError
from pathir.ir import (
    ChannelMap,
    Conv,
    Dense,
    Edge,
    Gather,
    Graph,
    GraphBuilder,
    Identity,
    Param,
    Pool,
    Reshape,
    Scale,
    verify,
)


def small_graph():
    b = GraphBuilder("small")
    x = b.input("x", (2, 4, 4))
    c = b.relu("c", [(x, Conv(b.param("w", np.ones((3, 2, 3, 3))), (1, 1), ((1, 1), (1, 1)), (1, 1)))],
               bias=b.param("cb", np.zeros(3)))
    p = b.maxpool("p", c, Pool((2, 2), (2, 2), ((0, 0), (0, 0)), (1, 1)))
    y = b.identity("y", [(p, Dense(b.param("d", np.ones((2, 12)))))], bias=b.param("db", np.zeros(2)))
    return b.build([y])


def broken(graph, index, **changes):
    nodes = list(graph.nodes)
    nodes[index] = replace(nodes[index], **changes)
    return Graph(tuple(nodes), graph.outputs, graph.name)


def test_valid_graph_verifies():
    g = small_graph()
    assert verify(g) is g


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda g: Graph(g.nodes + (g.nodes[1],), g.outputs), "name defined twice"),
        (lambda g: Graph(g.nodes[::-1], g.outputs), "which is not defined before it"),
        (lambda g: broken(g, 0, bias=Param("xb", np.zeros(2))), "an input node has no edges and no bias"),
        (lambda g: broken(g, 3, edges=()), "needs at least one incoming edge"),
        (lambda g: broken(g, 3, shape=(5,)), "node has shape [5]"),
        (lambda g: broken(g, 1, bias=Param("cb", np.zeros(4))), "bias 'cb' has shape [4], expected [3]"),
        (lambda g: broken(g, 2, edges=(Edge("c", Identity()),)), "a maxpool node has exactly one edge"),
        (lambda g: broken(g, 2, k=5), "k = 5 outside 1..4"),
        (lambda g: broken(g, 3, bias=Param("d", np.zeros(2))), "two different params are named 'd'"),
        (lambda g: Graph(g.nodes, ("nope",)), "output 'nope' is not a node"),
        (lambda g: Graph(g.nodes, ("x",)), "is an input node"),
        (lambda g: Graph(g.nodes, ()), "the graph has no outputs"),
        (lambda g: Graph(g.nodes, ("c",)), "node 'y' does not reach any output"),
        (lambda g: broken(g, 3, edges=(Edge("p", Dense(Param("d", np.ones((2, 7))))),)), "does not fit source 'p'"),
    ],
)
def test_each_rule_breaks_with_its_message(make, message):
    with pytest.raises(GraphVerificationError) as info:
        verify(make(small_graph()))
    text = str(info.value)
    assert message in text
    assert "x: input[2,4,4]" in text  # the error prints the graph


def test_k_is_bounded_by_the_smallest_padded_window():
    b = GraphBuilder()
    x = b.input("x", (1, 3))
    r = b.relu("r", [(x, Conv(b.param("w", np.ones((1, 1, 1))), (1,), ((0, 0),), (1,)))])
    p = b.maxpool("p", r, Pool((2,), (1,), ((1, 1),), (1,)), k=2)
    with pytest.raises(GraphVerificationError, match="k = 2 outside 1..1"):
        b.build([p])


def test_printer_is_deterministic_and_readable():
    text = str(small_graph())
    assert text.splitlines() == [
        "small(inputs=[x], outputs=[y])",
        "  0  x: input[2,4,4]",
        "  1  c: relu[3,4,4] = conv(w, p=[[1,1],[1,1]])(x) + bias(cb)",
        "  2  p: maxpool[3,2,2] = window[2,2]/s[2,2](c)",
        "  3  y: identity[2] = dense(d)(p) + bias(db)",
    ]
    assert str(small_graph()) == text


def test_params_flat_order_and_sharing():
    b = GraphBuilder()
    x = b.input("x", (2,))
    w = b.param("w", np.eye(2))
    h = b.relu("h", [(x, Dense(w))], bias=b.param("b", np.ones(2)))
    y = b.identity("y", [(h, Dense(w))])
    g = b.build([y])
    assert [p.name for p in g.params()] == ["w", "b"]
    assert g.num_params() == 6


def test_params_are_read_only_copies():
    value = np.ones(3)
    p = Param("p", value)
    value[0] = 5.0
    assert p.value[0] == 1.0
    with pytest.raises(ValueError):
        p.value[1] = 2.0


@pytest.mark.parametrize(
    "m, in_shape, out_shape",
    [
        (Reshape((12,)), (3, 2, 2), (12,)),
        (ChannelMap((2, -1, 0)), (3, 5), (3, 5)),
        (Pool((3,), (2,), ((1, 1),), (1,), ceil_mode=True), (2, 6), (2, 4)),
        (Pool((2, 2), (2, 2), ((0, 0), (0, 0)), (2, 2)), (1, 5, 5), (1, 2, 2)),
        (Gather(np.array([3, -1, 0]), (3,)), (2, 2), (3,)),
        (Conv(Param("w", np.ones((4, 1, 3))), (2,), ((1, 0),), (1,), groups=2), (2, 7), (4, 3)),
        (Scale(Param("s", np.ones(3))), (3, 2), (3, 2)),
    ],
)
def test_map_shapes(m, in_shape, out_shape):
    assert m.out_shape(in_shape) == out_shape


def test_channel_ties_and_weight_channels():
    assert ChannelMap((2, -1, 0)).channel_ties((3, 5)).tolist() == [[2, 0], [0, 2]]
    assert Reshape((6,)).channel_ties((2, 3)).tolist() == [[0, 0], [0, 1], [0, 2], [1, 3], [1, 4], [1, 5]]
    conv = Conv(Param("w", np.ones((4, 1, 1))), (1,), ((0, 0),), (1,), groups=2)
    out, inc = conv.weight_channels((2, 3))
    assert np.broadcast_to(out, (4, 1, 1)).ravel().tolist() == [0, 1, 2, 3]
    assert np.broadcast_to(inc, (4, 1, 1)).ravel().tolist() == [0, 0, 1, 1]
    dense = Dense(Param("d", np.ones((1, 6))))
    assert np.broadcast_to(dense.weight_channels((3, 2))[1], (1, 6)).ravel().tolist() == [0, 0, 1, 1, 2, 2]


def _one_edge(m, in_shape, out_shape):
    from pathir.ir.node import Edge, Node, NodeKind

    return Graph((Node("x", NodeKind.INPUT, in_shape), Node("y", NodeKind.IDENTITY, out_shape, (Edge("x", m),))),
                 ("y",))


@pytest.mark.parametrize("make, words", [
    (lambda: _one_edge(Conv(GraphBuilder.param("w", np.ones((1, 1, 2))), (1,), ((0, 0),), (0,)), (1, 3), (1, 3)),
     r"dilation \[0\]"),  # the numpy backend read each position twice, the torch backend raised
    (lambda: _one_edge(Pool((1,), (0,), ((0, 0),), (1,)), (1, 3), (1, 3)), r"stride \[0\]"),  # a raw ZeroDivisionError
    (lambda: _one_edge(Pool((1,), (1,), ((-1, 0),), (1,)), (1, 3), (1, 2)), "padding"),  # failed in the backends
    (lambda: _one_edge(Dense(GraphBuilder.param("w", [1.0, 2.0, 3.0])), (3,), (1,)), "is a matrix"),  # IndexError
    (lambda: _one_edge(Gather(np.array([-2, 0, 1]), (3,)), (3,), (3,)), "below -1"),
    # a conv's geometry of another rank than its kernel, or an empty kernel axis: the numpy backend zipped the
    # tuples and gave [3, 6, 9, 12] where conv1d gives [5, 8, 11] (review)
    (lambda: _one_edge(Conv(GraphBuilder.param("w", [[[1.0, 2.0]]]), (), (), ()), (1, 4), (1,)), "conv geometry"),
    (lambda: _one_edge(Conv(GraphBuilder.param("w", [[[1.0, 2.0]]]), (1, 1), ((0, 0), (0, 0)), (1, 1)), (1, 4),
                       (1, 3)), "conv geometry"),
    (lambda: _one_edge(Conv(GraphBuilder.param("w", np.ones((1, 1, 0))), (1,), ((0, 0),), (1,)), (1, 4), (1, 5)),
     r"kernel \[0\]"),
])
def test_verify_refuses_a_map_whose_own_fields_are_invalid(make, words):
    with pytest.raises(GraphVerificationError, match=words):
        verify(make())


def test_the_builder_refuses_what_it_cannot_infer_a_shape_from_with_a_pathir_error():
    """Raw ZeroDivisionError and KeyError where the shape was inferred; a fractional shape or index truncated
    (review)."""
    from pathir.errors import ArgumentError

    b = GraphBuilder()
    x = b.input("x", (1, 4))
    with pytest.raises(ArgumentError, match=r"node 'y': its first edge .*stride \[0\]"):
        b.identity("y", [(x, Pool((2,), (0,), ((0, 0),), (1,)))])
    with pytest.raises(ArgumentError, match="reads 'nope', which is not defined before it"):
        b.identity("y", [("nope", Identity())])
    with pytest.raises(ArgumentError, match="conv geometry"):
        b.identity("y", [(x, Conv(b.param("w", [[[1.0, 2.0]]]), (), (), ()))])
    with pytest.raises(ArgumentError, match="whole numbers"):
        b.input("z", (2.7,))
    with pytest.raises(ArgumentError, match="whole numbers"):
        Gather([0.5, 1.7], (2,))
    assert b.input("w", (2.0, np.int64(3))) == "w" and b.shape("w") == (2, 3)


def test_a_params_value_cannot_be_made_writable_again():
    """A user pass's p.value.setflags(write=True) then an in-place write changed the Compiled it was applied to,
    which records nothing (path_norm(1) 2.10 -> 48.75, review): a Param's value is a read-only view of a read-only
    array, whose flag numpy refuses to set again."""
    for p in (Param("p", np.ones(3)), Param.adopt("q", np.ones(3)), Param("r", Param.adopt("q", np.ones(3)).value)):
        with pytest.raises(ValueError, match="WRITEABLE"):
            p.value.setflags(write=True)


def test_a_param_over_a_read_only_view_of_a_writable_array_copies_it():
    """Param(name, a[:3]) with a[:3] read-only and a writable locked a's whole chain, making the caller's own
    array read-only (last notes' Left): such a view is copied; an array read-only down to its owner is taken."""
    a = np.arange(6.0)
    view = a[:3]
    view.setflags(write=False)
    p = Param("w", view)
    assert a.flags.writeable and not np.shares_memory(p.value, a)
    a[0] = 5.0  # the caller writes its array: the param keeps its value
    np.testing.assert_array_equal(p.value, [0.0, 1.0, 2.0])
    owner = np.arange(3.0)
    owner.setflags(write=False)
    assert np.shares_memory(Param("o", owner).value, owner)


def test_pool_output_size_is_torchs_for_every_small_geometry():
    """Including a dilated window longer than the input in ceil mode (one window in torch; was 0, and the
    model was refused at the next layer for reading 0 features)."""
    import itertools

    import torch

    from pathir.ir.maps import pool_output_size

    for L, k, s, p, d, ceil in itertools.product(range(1, 8), range(1, 5), range(1, 4), range(0, 3), range(1, 3),
                                                 (False, True)):
        if p > k // 2:
            continue
        try:
            expected = torch.nn.functional.max_pool1d(torch.zeros(1, 1, L), k, s, p, d, ceil_mode=ceil).shape[-1]
        except RuntimeError:  # torch: output size too small
            expected = 0
        assert pool_output_size(L, k, s, (p, p), d, ceil) == expected, (L, k, s, p, d, ceil)


def test_a_folded_weight_and_a_pickled_or_copied_param_stay_locked():
    """fold_batchnorm(in_place=True) unlocked the weight's owner to scale it in place and left it writable under a
    read-only view, whose flag numpy then let a user pass set again (review); a pickled or deep-copied Graph came
    back with writable params."""
    import copy
    import pickle

    import torch

    import pathir

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(12, 2)).eval()
    graph = pathir.compile(net, input_shape=(2, 4, 4)).graph
    for g in (graph, pickle.loads(pickle.dumps(graph)), copy.deepcopy(graph)):
        for p in g.params():
            assert not p.value.flags.writeable
            with pytest.raises(ValueError, match="WRITEABLE"):
                p.value.setflags(write=True)
