"""Custom passes: remove_dead (structure, function preserved, fixpoint), running
user passes through compile / apply / the registry, and the pass manager's errors."""

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pathir
from pathir.backends.numpy import NumpyBackend
from pathir.errors import GraphVerificationError
from pathir.ir import Conv, Dense, GraphBuilder, Identity, NodeKind
from pathir.lifting.walk import forward
from pathir.neurons.paths import enumerate_num_paths, enumerate_path_norm
from pathir.passes import PASSES, register, remove_dead, run_passes
from pathir.testing import mlps, random_inputs, relu_dags


def kill(graph, rng, p=0.4):
    """Zero, at random, every weight into some channels (and their bias) and
    every weight out of others: dead channels of both kinds."""
    new: dict[int, np.ndarray] = {}

    def value(param):
        return new.setdefault(id(param), param.value.copy())

    for v in graph.nodes:
        if v.kind is NodeKind.INPUT or v.name in graph.outputs:
            continue
        dead_in = np.flatnonzero(rng.random(v.channels) < p)
        for e in v.edges:
            if isinstance(e.map, (Dense, Conv)) and (not isinstance(e.map, Conv) or e.map.groups == 1):
                value(e.map.weight)[dead_in] = 0.0
        if v.bias is not None:
            value(v.bias)[dead_in] = 0.0
        dead_out = np.flatnonzero(rng.random(v.channels) < p / 2)
        per = int(np.prod(v.shape[1:], dtype=np.int64))
        for w, i in graph.consumers[v.name]:
            m = w.edges[i].map
            for c in dead_out:
                if isinstance(m, Conv) and m.groups == 1:
                    value(m.weight)[:, c] = 0.0
                elif isinstance(m, Dense):
                    value(m.weight)[:, c * per:(c + 1) * per] = 0.0
    return graph.map_params(lambda q: q.with_value(new[id(q)]) if id(q) in new else q)


def neurons(graph):
    return sum(n.numel for n in graph.nodes)


def outputs_close(a, b, x):
    fa, fb = forward(a, NumpyBackend(), x), forward(b, NumpyBackend(), x)
    return all(np.allclose(fa[o], fb[o], rtol=1e-12, atol=1e-12) for o in a.outputs)


# ------------------------------------------------------------------ remove_dead


@settings(max_examples=80)
@given(st.data())
def test_remove_dead_preserves_the_function_and_the_path_norms(data):
    # dense / conv stacks (most of their channels are removable) or anything
    plain = dict(skip=False, concat=False, channel_maps=False, gather=False, scale=False, maxpool=False,
                 avgpool=False, adaptive_pool=False)
    graph = data.draw(relu_dags(max_paths=600, **(plain if data.draw(st.booleans()) else {})))
    graph = kill(graph, np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))))
    before = str(graph)
    out = run_passes(graph, [remove_dead])  # verified
    assert str(graph) == before  # the input graph is untouched
    x = data.draw(random_inputs(graph, batch=3))
    assert outputs_close(graph, out, x)
    for q in (1, 2):
        assert np.isclose(enumerate_path_norm(out, q), enumerate_path_norm(graph, q), rtol=1e-12, atol=1e-300)
    assert enumerate_num_paths(out) <= enumerate_num_paths(graph)
    assert neurons(out) <= neurons(graph)
    assert [n.name for n in out.nodes] == [n.name for n in graph.nodes] and out.outputs == graph.outputs
    assert str(remove_dead(out)) == str(out)  # a fixed point


@settings(max_examples=30)
@given(st.data())
def test_remove_dead_removes_every_dead_neuron_of_an_mlp(data):
    graph = data.draw(mlps(max_depth=4, max_width=5))
    graph = kill(graph, np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))))
    out = remove_dead(graph)
    # in an MLP every hidden neuron is removable: none left with zero fan-in (and
    # zero bias) or zero fan-out, except a layer's last one
    for n in out.nodes:
        if n.kind is NodeKind.RELU and n.channels > 1:
            W_in = n.edges[0].map.weight.value
            b = n.bias.value if n.bias is not None else np.zeros(n.channels)
            W_out = next(w.edges[i].map.weight.value for w, i in out.consumers[n.name])
            assert np.all(W_in.any(axis=1) | (b != 0)) and np.all(W_out.any(axis=0))
    assert outputs_close(graph, out, data.draw(random_inputs(graph, batch=2)))


def test_remove_dead_follows_chains_and_leaves_the_rest():
    b = GraphBuilder("chain")
    x = b.input("x", (2,))
    h1 = b.relu("h1", [(x, Dense(b.param("w1", [[1.0, 1.0], [0.0, 0.0], [2.0, -1.0]])))])
    # h2[0] reads only the dead h1[1]: dead once h1[1] is gone
    h2 = b.relu("h2", [(h1, Dense(b.param("w2", [[0.0, 4.0, 0.0], [1.0, 1.0, 1.0]])))])
    y = b.identity("y", [(h2, Dense(b.param("w3", [[1.0, 2.0]])))])
    g = b.build(outputs=[y])
    out = remove_dead(g)
    assert [n.shape for n in out.nodes] == [(2,), (2,), (1,), (1,)]
    assert out.node("h2").edges[0].map.weight.value.tolist() == [[1.0, 1.0]]
    assert out.node("y").edges[0].map.weight.value.tolist() == [[2.0]]
    # the removed params lost their write-back binding, the others kept theirs
    assert out.node("h1").edges[0].map.weight.sources == () and "dead" in out.node("h1").edges[0].map.weight.how
    assert outputs_close(g, out, np.random.default_rng(0).normal(size=(5, 2)))


def test_remove_dead_keeps_shared_and_fixed_neighbourhoods():
    b = GraphBuilder("skip")
    x = b.input("x", (2,))
    h = b.relu("h", [(x, Dense(b.param("w1", [[0.0, 0.0], [1.0, 1.0]])))])
    s = b.relu("s", [(h, Dense(b.param("w2", np.eye(2)))), (h, Identity())])  # the skip fixes h's shape
    y = b.identity("y", [(s, Dense(b.param("w3", [[1.0, 1.0]])))])
    g = b.build(outputs=[y])
    assert str(remove_dead(g)) == str(g)
    w = GraphBuilder.param("shared", [[0.0, 0.0], [1.0, -1.0]])
    b = GraphBuilder("shared")
    x = b.input("x", (2,))
    h = b.relu("h", [(x, Dense(w))])
    k = b.relu("k", [(h, Dense(w))])
    y = b.identity("y", [(k, Dense(b.param("w3", [[1.0, 1.0]])))])
    g = b.build(outputs=[y])
    assert str(remove_dead(g)) == str(g)


def test_remove_dead_on_a_cnn():
    rng = np.random.default_rng(1)
    b = GraphBuilder("cnn")
    x = b.input("x", (2, 5))
    W = rng.normal(size=(4, 2, 3))
    W[1] = 0.0  # channel 1 of conv1 is always 0 (no bias)
    c1 = b.relu("conv1", [(x, Conv(b.param("c1", W), (1,), ((1, 1),), (1,)))])
    W2 = rng.normal(size=(3, 4, 3))
    W2[:, 3] = 0.0  # nothing reads channel 3 of conv1
    c2 = b.relu("conv2", [(c1, Conv(b.param("c2", W2), (1,), ((0, 0),), (1,)))], bias=b.param("b2", rng.normal(size=3)))
    f = b.identity("fc", [(c2, Dense(b.param("fc", rng.normal(size=(2, 9)))))])
    g = b.build(outputs=[f])
    out = remove_dead(g)
    assert out.node("conv1").shape == (2, 5) and out.node("conv2").edges[0].map.weight.shape == (3, 2, 3)
    assert outputs_close(g, out, rng.normal(size=(4, 2, 5)))


# ------------------------------------------------------------------ running user passes


def torch_mlp_with_a_dead_neuron():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    with torch.no_grad():
        net[0].weight[2] = 0.0
        net[0].bias[2] = 0.0
    return torch, net


def test_compile_and_apply_run_user_passes():
    torch, net = torch_mlp_with_a_dead_neuron()
    cm = pathir.compile(net, input_shape=(3,), passes=[remove_dead])
    assert cm.graph.nodes[1].shape == (4,)
    x = np.random.default_rng(0).normal(size=(6, 3))
    want = net(torch.tensor(x, dtype=torch.float32)).detach().numpy()
    assert np.allclose(cm.forward(x, backend="numpy"), want, atol=1e-5)
    plain = pathir.compile(net, input_shape=(3,))
    applied = plain.apply(remove_dead)
    assert str(applied.graph) == str(cm.graph) and plain.graph.nodes[1].shape == (5,)
    by_name = plain.apply("remove_dead")
    assert str(by_name.graph) == str(cm.graph)
    assert np.isclose(applied.path_norm(2), plain.path_norm(2), rtol=1e-12)
    assert len(applied.units) == len(plain.units) - 1


def test_register_a_user_pass_and_run_it_by_name():
    def double_output(graph):
        """Multiplies the output layer's weights by 2."""
        out = graph.node(graph.outputs[0])
        return graph.map_params(lambda p: p.with_value(2 * p.value) if p is out.edges[0].map.weight else p)

    try:
        assert register("double_output", double_output) is double_output
        assert PASSES["double_output"] is double_output
        g = run_passes(pathir.compile(GraphBuilderMLP()).graph, ["double_output"])
        assert g.node("y").edges[0].map.weight.value.tolist() == [[2.0, 4.0]]
        register("double_output", double_output)  # the same function again: fine
        with pytest.raises(ValueError, match="already registered"):
            register("double_output", lambda g: g)
        register("double_output", remove_dead, replace=True)
        assert PASSES["double_output"] is remove_dead
    finally:
        PASSES.pop("double_output", None)
    with pytest.raises(KeyError, match="no pass named 'nope'; registered: .*remove_dead"):
        run_passes(GraphBuilderMLP(), ["nope"])
    with pytest.raises(TypeError, match="must be a function"):
        register("bad", 42)
    with pytest.raises(TypeError, match="a registered name"):
        run_passes(GraphBuilderMLP(), [42])


def GraphBuilderMLP():
    b = GraphBuilder("mlp")
    x = b.input("x", (2,))
    h = b.relu("h", [(x, Dense(b.param("w1", [[1.0, 0.0], [0.0, 1.0]])))])
    y = b.identity("y", [(h, Dense(b.param("w2", [[1.0, 2.0]])))])
    return b.build(outputs=[y])


def test_errors_name_the_pass_and_those_before_it():
    from dataclasses import replace

    def break_shapes(graph):
        return graph.replace_nodes([replace(n, shape=(7,)) if n.name == "h" else n for n in graph.nodes])

    def not_a_graph(graph):
        return "oops"

    def boom(graph):
        raise RuntimeError("boom")

    with pytest.raises(GraphVerificationError, match=r"in pass 'break_shapes' after \['fold_batchnorm'\]") as err:
        pathir.compile(GraphBuilderMLP(), passes=[break_shapes])
    assert "node 'h'" in str(err.value) and "mlp(inputs=[x]" in str(err.value)  # the graph is shown
    with pytest.raises(TypeError, match=r"in pass 'not_a_graph' after \['remove_dead'\]: returned str"):
        run_passes(GraphBuilderMLP(), [remove_dead, not_a_graph])
    with pytest.raises(RuntimeError, match="boom") as err:
        pathir.compile(GraphBuilderMLP()).apply(remove_dead, boom)
    if sys.version_info >= (3, 11):  # exceptions carry notes
        assert err.value.__notes__ == ["in pass 'boom' after ['remove_dead']"]
    # check=False runs without verifying
    g = run_passes(GraphBuilderMLP(), [break_shapes], check=False)
    assert g.node("h").shape == (7,)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_pass_writing_a_non_finite_weight_is_named_and_nothing_changes(bad):
    """A user pass that writes NaN or ±inf into a weight is refused where it ran (compile, cm.apply,
    run_passes), naming the pass, the param and the entry; cm is unchanged. Before, cm.apply accepted it and
    only the next path computation refused the graph, naming no pass. check=False still runs it unverified."""
    def spoil(graph):
        first = next(iter(graph.params()))
        value = first.value.copy()
        value.reshape(-1)[1] = bad
        return graph.map_params(lambda p: p.with_value(value) if p is first else p)

    cm = pathir.compile(GraphBuilderMLP())
    before = cm.path_norm(1)
    match = r"in pass 'spoil' after \['remove_dead'\]: it wrote 1 NaN or infinite entries into param 'w1' .*flat index 1"
    with pytest.raises(GraphVerificationError, match=match):
        cm.apply(remove_dead, spoil)
    with pytest.raises(GraphVerificationError, match=match):
        run_passes(GraphBuilderMLP(), [remove_dead, spoil])
    with pytest.raises(GraphVerificationError, match=r"in pass 'spoil' after \['fold_batchnorm'\]"):
        pathir.compile(GraphBuilderMLP(), passes=[spoil])
    assert cm.path_norm(1) == before
    g = run_passes(GraphBuilderMLP(), [spoil], check=False)
    assert not np.isfinite(g.params()[0].value).all()


def test_a_pass_that_cleans_one_nan_and_writes_another_is_named_and_unverified_ones_are_blamed_too():
    """A graph given with a NaN in 'w1' and a pass that clears it but writes inf into 'w2': refused at the pass,
    naming 'w2' and the NaN it was given (the check skipped every pass given a non-finite graph). A NaN a pass
    wrote with check=False is named later as the model's or that pass's."""
    def clean_but_break(graph):
        return graph.map_params(lambda p: p.with_value(np.nan_to_num(p.value) / (0.0 if p.name == "w2" else 1.0)))

    def spoil(graph):
        return graph.map_params(lambda p: p.with_value(p.value * np.nan) if p.name == "w1" else p)

    given = GraphBuilderMLP().map_params(lambda p: p.with_value(p.value * np.nan) if p.name == "w1" else p)
    with np.errstate(divide="ignore", invalid="ignore"):
        with pytest.raises(GraphVerificationError, match=r"into param 'w2' .*; the graph it was given held non-finite "
                                                         r"entries in 'w1'"):
            run_passes(given, [clean_but_break])
        assert np.isnan(run_passes(given, [spoil]).params()[0].value).all()  # the NaN it was given: not the pass's
        cm = pathir.compile(GraphBuilderMLP()).apply(spoil, check=False)
    with pytest.raises(pathir.PathirError, match=r"fix the model's tensors, or the pass that wrote them \('spoil'"):
        cm.path_norm(1)


def test_a_pass_cannot_empty_the_consumer_lists_a_later_pass_reads():
    """graph.consumers was a cached dict of lists: a user's analysis pass popping them as a worklist emptied them
    for cm.graph itself, and remove_dead then dropped 3 of 4 live hidden channels (off by 0.19, ‖Φ‖₁ 2.10 -> 0.64)."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).double()
    cm = pathir.compile(net, input_shape=(3,))

    def worklist(graph):
        for todo in graph.consumers.values():
            with pytest.raises((AttributeError, TypeError)):
                todo.pop()
        with pytest.raises(TypeError):
            graph.consumers["x"] = ()
        return graph

    x = np.random.default_rng(0).normal(size=(5, 3))
    small = cm.apply(worklist, "remove_dead")
    assert np.allclose(small.forward(x), net(torch.tensor(x)).detach().numpy(), rtol=1e-12, atol=1e-12)


def test_a_pass_that_writes_nan_into_a_model_with_nan_is_named_beside_the_model():
    """A model with a NaN in 'w1' and a pass that writes NaN into 'w2' (cleaning nothing): the refusal names the
    model's own NaN, and now also the pass and what it wrote (it named the model only)."""
    def spoil_w2(graph):
        return graph.map_params(lambda p: p.with_value(p.value * np.nan) if p.name == "w2" else p)

    given = GraphBuilderMLP().map_params(lambda p: p.with_value(p.value * np.nan) if p.name == "w1" else p)
    with np.errstate(invalid="ignore"):
        with pytest.raises(pathir.PathirError, match="'w1'") as err:
            run_passes(given, [spoil_w2])
    notes = " ".join(getattr(err.value, "__notes__", []))
    assert "'w2'" in notes and "in pass 'spoil_w2'" in notes
