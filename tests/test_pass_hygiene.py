"""A user pass that misbehaves is named, never met later as a wrong number: one that writes into the graph it was
given (in place, through torch), one whose result changes on a live re-read, and fields not of their IR type."""

import dataclasses

import numpy as np
import pytest
import torch

import pathir
from pathir.errors import ArgumentError, GraphVerificationError, ModelChanged, PassWroteInput
from pathir.ir import Dense, Edge, GraphBuilder, NodeKind, Pool
from pathir.passes import run_passes


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).double()


def _l1(net) -> float:
    """The ℓ1 path-norm of a Linear-ReLU-Linear net from its own tensors: Σ_paths Π|θ| (input, bias and output paths)."""
    W1, b1, W2, b2 = (p.detach().abs().numpy() for p in net.parameters())
    return float((W2 @ W1).sum() + (W2 @ b1).sum() + b2.sum())


def _clip_through_torch(graph):
    """Clip every param to [-0.1, 0.1], written (wrongly) into the param's own memory."""
    def clip(p):
        t = torch.as_tensor(p.value)  # shares the read-only array's memory (torch only warns)
        t.clamp_(-0.1, 0.1)
        return p.with_value(t.numpy())
    return graph.map_params(clip)


def _halve_then_fail(graph):
    for p in graph.params():
        p.value.base.setflags(write=True)  # an owner's write flag can always be set again
        p.value.base[...] *= 0.5
    raise RuntimeError("gave up")


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
@pytest.mark.parametrize("bad", [_clip_through_torch, _halve_then_fail])
def test_a_pass_that_writes_its_input_is_refused_and_the_compiled_reads_its_model_again(bad):
    net = _net()
    cm = pathir.compile(net, input_shape=(3,))
    state = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(PassWroteInput, match=f"in pass '{bad.__name__}'.*wrote into the graph it was given") as info:
        cm.apply(bad)
    assert "read its model's values again" in "".join(info.value.__notes__)
    assert all(torch.equal(net.state_dict()[k], v) for k, v in state.items())
    assert cm.path_norm(1) == pytest.approx(_l1(net), rel=1e-12)
    x = torch.randn(5, 3, dtype=torch.float64)
    np.testing.assert_allclose(cm.forward(x.numpy(), backend="numpy"), net(x).detach().numpy(), rtol=1e-12)


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_a_pass_given_at_compile_that_writes_its_input_is_refused_and_the_model_is_untouched():
    net = _net()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(PassWroteInput, match="in pass '_clip_through_torch' after \\['fold_batchnorm'\\]"):
        pathir.compile(net, input_shape=(3,), passes=[_clip_through_torch])
    assert all(torch.equal(net.state_dict()[k], v) for k, v in state.items())


def _graph():
    rng = np.random.default_rng(0)
    b = GraphBuilder("mlp")
    x = b.input("x", (3,))
    h = b.relu("h", [(x, Dense(b.param("w1", rng.normal(size=(4, 3)))))], bias=b.param("b1", rng.normal(size=4)))
    y = b.identity("y", [(h, Dense(b.param("w2", rng.normal(size=(2, 4)))))])
    return b.build(outputs=[y])


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_a_compiled_graph_written_by_a_pass_refuses_every_query_after():
    cm = pathir.compile(_graph())
    with pytest.raises(PassWroteInput):
        cm.apply(_clip_through_torch)
    with pytest.raises(ModelChanged, match="no longer holds its model's values"):
        cm.path_norm(1)


def _clip_above_one(graph):
    """Clip every param to [-1, 1], where some entry is outside (a pass that changes nothing on small weights)."""
    return graph.map_params(lambda p: p.with_value(np.clip(p.value, -1, 1)) if np.abs(p.value).max() > 1 else p)


def test_a_pass_that_kept_the_graph_at_compile_and_changes_it_on_a_live_re_read_is_refused():
    net = _net()
    cm = pathir.compile(net, input_shape=(3,), passes=[_clip_above_one])
    assert cm.transformed_by == ()
    assert cm.path_norm(1) == pytest.approx(_l1(net), rel=1e-12)
    with torch.no_grad():
        net[0].weight.mul_(10.0)  # now some |w| > 1: the pass would clip the values the Compiled reads
    with pytest.raises(ModelChanged, match="pass '_clip_above_one' changed the graph read from the model's current"):
        cm.path_norm(1)
    x = torch.randn(4, 3, dtype=torch.float64)
    before = net(x).detach().clone()
    with pytest.raises(ModelChanged):
        cm.normalize(p=2)
    assert torch.equal(net(x).detach(), before)


def _edit_node(**fields):
    def edit(graph):
        return graph.replace_nodes([dataclasses.replace(n, **fields) if n.name == "h" else n for n in graph.nodes])
    return edit


@pytest.mark.parametrize("fields, reason", [
    ({"kind": "relu"}, "kind 'relu' is not a NodeKind"),
    ({"shape": [4]}, "shape \\[4\\] is a list, not a tuple"),
    ({"bias": np.ones(4)}, "its bias is a ndarray, not a pathir.ir.Param"),
    ({"edges": (("x", Dense(pathir.ir.Param("w", np.ones((4, 3))))),)}, "edge 0 is a tuple, not a pathir.ir.Edge"),
    ({"edges": (Edge("x", Dense(np.ones((4, 3)))),)}, "edge 0 \\(dense\\) holds a ndarray as its weight"),
])
def test_a_field_not_of_its_ir_type_is_named_with_the_pass(fields, reason):
    edit = _edit_node(**fields)
    with pytest.raises(GraphVerificationError, match=f"in pass 'edit' after \\[\\]: graph failed verification:\n  - "
                                                     f"node 'h': {reason}"):
        run_passes(_graph(), [edit])


def test_a_maxpool_k_that_is_not_an_integer_is_refused():
    b = GraphBuilder("pool")
    x = b.input("x", (1, 4))
    m = b.maxpool("m", x, Pool(kernel=(2,), stride=(2,), padding=((0, 0),), dilation=(1,)), k=1)
    b.identity("y", [(m, Dense(b.param("w", np.ones((1, 2)))))])
    graph = b.build(outputs=["y"])
    for k in (1.5, True):
        bad = _edit_k(k)
        with pytest.raises(GraphVerificationError, match=f"node 'm': k = {k} is not an integer"):
            run_passes(graph, [bad])
    assert run_passes(graph, [_edit_k(np.int64(2))]).node("m").k == 2


def _edit_k(k):
    def edit(graph):
        return graph.replace_nodes([dataclasses.replace(n, k=k) if n.kind is NodeKind.MAXPOOL else n for n in graph.nodes])
    return edit


def test_a_complex_value_is_refused_naming_the_param_and_the_pass():
    def sqrt(graph):
        return graph.map_params(lambda p: p.with_value(np.lib.scimath.sqrt(p.value)) if p.name == "w1" else p)
    with pytest.raises(ArgumentError, match="param 'w1': its value is complex") as info:
        run_passes(_graph(), [sqrt])
    assert "in pass 'sqrt' after []" in info.value.__notes__


def _keep(graph):
    return graph


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_a_pass_that_writes_a_snapshot_shared_with_its_parent_mends_the_parent_too():
    net = _net()
    cm = pathir.compile(net, input_shape=(3,))
    snapshot = cm.apply(_keep)  # shares cm's params
    with pytest.raises(PassWroteInput) as info:
        snapshot.apply(_clip_through_torch)
    assert any("a Compiled sharing those params (apply, rescaled) read its model's values again" in n
               for n in info.value.__notes__)
    assert cm.path_norm(1) == pytest.approx(_l1(net), rel=1e-12)
    with pytest.raises(ModelChanged, match="no longer holds its model's values"):
        snapshot.path_norm(1)


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_run_passes_refuses_a_pass_that_writes_its_input():
    graph = _graph()
    before = {p.name: p.value.copy() for p in graph.params()}
    with pytest.raises(PassWroteInput, match="params 'b1', 'w1', 'w2'"):
        run_passes(graph, [_clip_through_torch])
    assert run_passes(graph, [_keep]) is graph
    assert any(not np.array_equal(p.value, before[p.name]) for p in graph.params())  # (it did write: found)


def _clip_above(limit):
    def clip(graph):
        return graph.map_params(lambda p: p.with_value(np.clip(p.value, -limit, limit))
                                if np.abs(p.value).max() > limit else p)
    clip.__name__ = f"clip{limit}"
    return clip


def test_a_compiled_already_transformed_follows_its_passes_on_a_re_read():
    net = _net()
    cm = pathir.compile(net, input_shape=(3,), passes=[_clip_above(3.0), _clip_above(0.05)], self_check=False)
    assert cm.transformed_by == ("clip0.05",)
    with torch.no_grad():
        net[0].weight.mul_(100.0)  # now clip3 clips too: the graph is still clip0.05 of the model
        clipped = [p.detach().clamp(-0.05, 0.05).abs().numpy() for p in net.parameters()]
    W1, b1, W2, b2 = clipped
    assert cm.path_norm(1) == pytest.approx(float((W2 @ W1).sum() + (W2 @ b1).sum() + b2.sum()), rel=1e-12)


def test_an_onnx_model_written_past_what_a_pass_kept_refuses_its_next_query():
    onnx = pytest.importorskip("onnx")
    import io

    net = _net().float()
    buffer = io.BytesIO()
    torch.onnx.export(net, (torch.randn(1, 3),), buffer, dynamo=False, input_names=["x"])
    cm = pathir.compile(onnx.load_from_string(buffer.getvalue()), passes=[_clip_above(5.0)])
    assert cm.transformed_by == ()
    z = np.zeros(len(cm.units))
    z[0] = -8.0  # the unit's incoming weights grow by e^4: past the clip
    cm.commit_rescaling(z)
    with pytest.raises(ModelChanged, match="pass 'clip5.0' changed the graph read .* written in full"):
        cm.path_norm(1)
