"""Path-magnitude scores and pruning (docs/math.md §4) against enumeration, their
rescaling invariance, and write-back into torch and ONNX models."""

import copy
import json
import math
import os

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import pathir
from pathir.analyses.find_units import find_units
from pathir.analyses.incidence import ParamLayout
from pathir.app.cli import main
from pathir.errors import PathirError
from pathir.frontends.torch.writer import TorchWriter
from pathir.lifting.pruning import path_magnitude_scores, prune_graph
from pathir.lifting.walk import forward
from pathir.neurons.expand import expand
from pathir.neurons.paths import enumerate_paths, phi
from pathir.rescaling.apply import log_scales, rescale_graph
from pathir.testing import mlps, random_inputs, relu_dags, rescalings

BACKENDS = ["numpy", "torch"]


def enumerated_scores(graph) -> np.ndarray:
    """S_i = Σ_p |Φ_p| · (times θ_i is a factor of p), flat in θ order."""
    layout = ParamLayout(tuple(graph.params()))
    net = expand(graph)
    paths = enumerate_paths(net)
    S = np.zeros(len(layout))
    for p, value in zip(paths, phi(net, paths)):
        start = net.nodes[p.start]
        if not start["is_input"]:
            S[layout.slice(start["bias"][0]).start + start["bias"][1]] += abs(value)
        for u, v, k in p.edges():
            ref = net.edges[u, v, k]["param"]
            if ref is not None:
                S[layout.slice(ref[0]).start + ref[1]] += abs(value)
    return S


def flat_scores(graph, backend) -> np.ndarray:
    s = path_magnitude_scores(graph, backend)
    return np.concatenate([s[p.source_name].ravel() for p in graph.params()] + [np.zeros(0)])


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40)
@given(graph=relu_dags())
def test_scores_equal_enumeration(backend, graph):
    expected = enumerated_scores(graph)
    np.testing.assert_allclose(flat_scores(graph, backend), expected, rtol=1e-10, atol=1e-12 * max(expected.max(initial=0), 1))


@settings(max_examples=15)
@given(graph=mlps(), data=st.data())
def test_score_is_the_path_norm_lost_by_zeroing_the_entry(graph, data):
    cm = pathir.compile(graph, backend="numpy")
    layout = ParamLayout(tuple(graph.params()))
    i = data.draw(st.integers(0, len(layout) - 1))
    name, idx = layout.locate(i)
    keep = np.ones(graph.params()[layout.position(name)].shape, dtype=bool)
    keep[idx] = False
    zeroed = prune_graph(graph, {name: keep})
    lost = cm.path_norm(1) - pathir.compile(zeroed, backend="numpy").path_norm(1)
    assert flat_scores(graph, "numpy")[i] == pytest.approx(lost, rel=1e-9, abs=1e-12)


@settings(max_examples=30)
@given(data=st.data(), graph=relu_dags())
def test_scores_are_invariant_under_rescaling(data, graph):
    z = data.draw(rescalings(graph))
    rescaled = rescale_graph(graph, find_units(graph)[1], z)
    a, b = flat_scores(graph, "numpy"), flat_scores(rescaled, "numpy")
    np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-12 * max(a.max(initial=0), 1))


@settings(max_examples=30)
@given(data=st.data(), graph=relu_dags(), amount=st.sampled_from([0.0, 0.3, 0.5, 1.0]),
       criterion=st.sampled_from(["path-magnitude", "magnitude"]), scope=st.sampled_from(["global", "local"]))
def test_pruning_report_and_guarantee(data, graph, amount, criterion, scope):
    cm = pathir.compile(graph, backend="numpy")
    if not report_names(graph):
        with pytest.raises(PathirError, match="nothing to prune"):
            cm.prune(amount)
        return
    s = path_magnitude_scores(graph, "numpy")
    scores = {p.name: s[p.source_name] for p in graph.params()}
    report = cm.prune(amount, criterion=criterion, scope=scope)
    masks = {p.name: p.value != 0 for p in cm.graph.params()}
    weights = [p for p in graph.params() if p.name in report_names(graph)]
    assert report.candidates == sum(p.size for p in weights)
    assert report.pruned == (round(amount * report.candidates) if scope == "global" else sum(round(amount * p.size) for p in weights))
    # which entries: the smallest by the criterion (ties at the threshold aside)
    key = (lambda p: scores[p.name]) if criterion == "path-magnitude" else (lambda p: np.abs(p.value))
    if scope == "global" and 0 < report.pruned < report.candidates:
        kept = np.concatenate([key(p)[masks[p.name]] for p in weights])
        cut = np.concatenate([key(p)[~masks[p.name]] for p in weights if (~masks[p.name]).any()] or [np.zeros(0)])
        assert cut.max() <= kept.min() * (1 + 1e-12)
    # the exact path-metric of the pruning, and Σ S_i over the pruned set bound it
    bound = math.fsum(scores[p.name][~masks[p.name]].sum() for p in weights)
    assert report.bound == pytest.approx(bound, rel=1e-9, abs=1e-12)
    assert report.path_metric == pytest.approx(report.path_norm_before - report.path_norm_after, rel=1e-7, abs=1e-9)
    assert report.path_metric <= report.bound * (1 + 1e-9) + 1e-12
    x = data.draw(random_inputs(graph))
    be = pathir.backends.get_backend("numpy")
    ya, yb = forward(graph, be, x), forward(cm.graph, be, x)
    diff = sum(np.abs(ya[o] - yb[o]).reshape(len(ya[o]), -1).sum(axis=1) for o in graph.outputs)
    sup = np.maximum(np.max([np.abs(v).reshape(len(v), -1).max(axis=1) for v in x.values()], axis=0), 1)
    assert np.all(diff <= sup * report.path_metric * (1 + 1e-9) + 1e-12)


def test_prune_graph_writes_into_the_scratch_arrays_it_is_given_and_never_into_the_graph():
    from pathir.lifting.pruning import _pruned_sum

    rng = np.random.default_rng(0)
    from pathir.ir import Dense, GraphBuilder

    b = GraphBuilder()
    x = b.input("x", (3,))
    h = b.relu("h", [(x, Dense(b.param("w1", rng.normal(size=(4, 3)))))], bias=b.param("b1", rng.normal(size=4)))
    graph = b.build(outputs=[b.identity("y", [(h, Dense(b.param("w2", rng.normal(size=(2, 4)))))])])
    w1, w2 = (p.value.copy() for p in graph.params() if p.name in ("w1", "w2"))
    masks = {"w1": rng.random((4, 3)) > 0.5, "w2": rng.random((2, 4)) > 0.5}
    scratch = {"w1": np.full((4, 3), np.nan), "w2": graph.params()[2].value}  # w2's: the graph's own array
    after = {p.name: p.value for p in prune_graph(graph, masks, out=scratch).params()}
    assert np.shares_memory(after["w1"], scratch["w1"])  # written in place (a read-only view of it)
    np.testing.assert_array_equal(after["w1"], w1 * masks["w1"])
    np.testing.assert_array_equal(after["w2"], w2 * masks["w2"])  # a new array: the scratch was θ itself
    np.testing.assert_array_equal(graph.params()[2].value, w2)  # the graph is untouched
    values = rng.random(200_000)
    keep = rng.random(200_000) > 0.3
    assert _pruned_sum(values, keep, chunk=4096) == pytest.approx(float(values[~keep].sum()), rel=1e-12)


@settings(max_examples=40)
@given(graph=relu_dags(), data=st.data())
def test_the_pruned_path_metric_from_two_norms_equals_the_telescoped_walk(graph, data):
    """pruned_path_metric: ‖Φ(θ)‖₁ − ‖Φ(θ ⊙ mask)‖₁ (min_gap 0) and the telescoped sum (min_gap above 1)
    against path_metric's exact bracket, for random masks."""
    from pathir.lifting.path_metric import ROUNDING, path_metric, pruned_path_metric

    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    keep = data.draw(st.sampled_from([0.2, 0.7, 0.95]))
    masks = {p.name: rng.random(p.shape) < keep for p in graph.params()}
    pruned = prune_graph(graph, masks)
    be = pathir.backends.get_backend("numpy")
    want = path_metric(graph, pruned, be, progress=False)
    assert want.exact
    slack = 1.01 * ROUNDING * (want.norm_a + want.norm_b)
    for gap in (0.0, 2.0):
        got = pruned_path_metric(graph, pruned, be, min_gap=gap)
        assert got.exact or not gap  # min_gap above 1: the telescoped walk
        if got.exact:
            assert got.lower == got.upper
            assert got.upper == pytest.approx(want.upper, rel=1e-9, abs=1e-300)
        else:  # the two norms' difference: a bracket of their rounding, ROUNDING of their sum
            assert got.lower <= want.upper * (1 + 1e-9) and want.upper <= got.upper * (1 + 1e-9)
            assert got.upper - got.lower <= 2 * slack + 1e-300
        assert (got.norm_a, got.norm_b) == (want.norm_a, want.norm_b)
    # the bound Σ S_i over the pruned entries says beforehand when the norms are close: then no walk of
    # θ', ‖Φ(θ')‖₁ = ‖Φ(θ)‖₁ − d; ‖Φ(θ)‖₁ given as the scores' walk gives it
    s = path_magnitude_scores(graph, "numpy")
    bound = math.fsum(float(s[p.source_name][~masks[p.name]].sum()) for p in graph.params())
    log_bound = math.log(bound) if bound > 0 else -math.inf
    log_a = math.log(want.norm_a) if want.norm_a > 0 else -math.inf
    for gap in (1e-3, 0.5):
        got = pruned_path_metric(graph, pruned, be, min_gap=gap, log_norm_a=log_a, log_bound=log_bound)
        assert got.lower == got.upper if got.exact else got.upper - got.lower <= 2 * slack + 1e-300
        assert abs(got.upper - want.upper) <= 1e-9 * want.upper + 2 * slack + 1e-300
        assert got.norm_a == pytest.approx(want.norm_a, rel=1e-13, abs=1e-300)
        assert got.norm_b == pytest.approx(want.norm_b, rel=1e-12, abs=1e-300)


def report_names(graph):
    from pathir.ir import MapKind

    return {e.map.weight.name for n in graph.nodes for e in n.edges if e.map.kind in (MapKind.DENSE, MapKind.CONV)}


# ------------------------------------------------------------ trained torch networks


def trained(model: nn.Module, shape, steps: int = 40, seed: int = 0) -> nn.Module:
    """``model`` in float64 after a few SGD steps on a random regression task."""
    torch.manual_seed(seed)
    model = model.double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(64, *shape, dtype=torch.float64)
    y = torch.randn(64, model(x[:2]).shape[1], dtype=torch.float64)
    for _ in range(steps):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return model.eval()


def mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 3))


def cnn():
    return nn.Sequential(nn.Conv2d(2, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(6, 5, 3), nn.BatchNorm2d(5), nn.ReLU(), nn.Flatten(), nn.Linear(20, 3))


def masks_of(model) -> dict[str, torch.Tensor]:
    return {name: buf.clone() for name, buf in model.named_buffers() if name.endswith("_mask")}


@pytest.mark.parametrize("make, shape", [(mlp, (6,)), (cnn, (2, 8, 8))], ids=["mlp", "cnn-bn"])
def test_path_magnitude_selection_is_rescaling_invariant_magnitude_is_not(make, shape):
    net = trained(make(), shape)
    cm = pathir.compile(net, input_shape=shape)
    z = np.random.default_rng(1).uniform(-2, 2, size=len(cm.units))
    twin = copy.deepcopy(net)
    TorchWriter(twin).rescale(cm.graph, log_scales(cm.graph, cm.units, z))
    x = torch.randn(8, *shape, dtype=torch.float64)
    torch.testing.assert_close(twin(x), net(x), rtol=1e-10, atol=1e-12)  # the same function
    chosen = {}
    for criterion in ("path-magnitude", "magnitude"):
        pair = []
        for model in (copy.deepcopy(net), copy.deepcopy(twin)):
            pathir.compile(model, input_shape=shape).prune(0.5, criterion=criterion)
            pair.append(masks_of(model))
        chosen[criterion] = pair
    a, b = chosen["path-magnitude"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    a, b = chosen["magnitude"]
    assert not all(torch.equal(a[k], b[k]) for k in a)


def test_torch_write_back_matches_the_pruned_graph_and_its_bound():
    net = trained(cnn(), (2, 8, 8))
    before = copy.deepcopy(net)
    cm = pathir.compile(net, input_shape=(2, 8, 8))
    scores = cm.path_magnitude_scores()
    assert set(scores) == {"0.weight", "1.bias", "4.weight", "5.bias", "8.weight", "8.bias"}  # folded batch-norms
    assert scores["0.weight"].shape == net[0].weight.shape
    report = cm.prune(0.6)
    assert report.pruned == round(0.6 * report.candidates)
    masks = masks_of(net)
    assert set(masks) == {"0.weight_mask", "4.weight_mask", "8.weight_mask"}
    assert sum(int((m == 0).sum()) for m in masks.values()) == report.pruned
    for p in cm.graph.params():  # the graph is θ ⊙ mask, the model agrees
        if p.name.endswith("weight") and p.name in ("0.weight", "4.weight", "8.weight"):
            np.testing.assert_array_equal(p.value != 0, masks[p.name + "_mask"].numpy() != 0)
    x = 2 * torch.randn(32, 2, 8, 8, dtype=torch.float64)
    np.testing.assert_allclose(cm.forward(x.numpy()), net(x).detach().numpy(), rtol=1e-9, atol=1e-12)
    diff = (before(x) - net(x)).abs().sum(dim=1).detach().numpy()
    sup = np.maximum(x.abs().amax(dim=(1, 2, 3)).numpy(), 1)
    assert np.all(diff <= sup * report.path_metric) and report.path_metric <= report.bound * (1 + 1e-12)
    assert report.path_norm_after == pytest.approx(cm.path_norm(1), rel=1e-12)


def test_a_second_pruning_keeps_the_first_zeros():
    net = trained(mlp(), (6,))
    cm = pathir.compile(net, input_shape=(6,))
    cm.prune(0.3)
    first = masks_of(net)
    report = cm.prune(0.6)
    second = masks_of(net)
    assert all(torch.all(second[k] <= first[k]) for k in first)
    assert sum(int((m == 0).sum()) for m in second.values()) == report.pruned


def test_folded_batchnorm_bias_cannot_be_pruned_and_nothing_changes():
    net = trained(cnn(), (2, 8, 8))
    state = copy.deepcopy(net.state_dict())
    cm = pathir.compile(net, input_shape=(2, 8, 8))
    graph = cm.graph
    with pytest.raises(PathirError, match="not its source tensor"):
        cm.prune(0.9, include_biases=True)
    assert cm.graph is graph and masks_of(net) == {}
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())


def test_bad_arguments_are_refused():
    cm = pathir.compile(trained(mlp(), (6,)), input_shape=(6,))
    with pytest.raises(ValueError, match="criterion"):
        cm.prune(0.5, criterion="random")
    with pytest.raises(ValueError, match="scope"):
        cm.prune(0.5, scope="layer")
    with pytest.raises(ValueError, match="amount"):
        cm.prune(1.5)
    with pytest.raises(ValueError, match="amount"):
        cm.prune(10**6)
    assert masks_of(cm.model) == {}


def test_count_amount_and_biases():
    net = trained(mlp(), (6,))
    cm = pathir.compile(net, input_shape=(6,))
    report = cm.prune(7, include_biases=True)
    assert report.pruned == 7 and report.candidates == sum(p.numel() for p in net.parameters())


@pytest.mark.parametrize("amount", ["0.5", "5", b"0.5"])
def test_an_amount_given_as_a_string_is_refused_with_the_model_untouched(amount):
    net = trained(mlp(), (6,))
    state = copy.deepcopy(net.state_dict())
    with pytest.raises(PathirError, match="amount must be a number"):
        pathir.compile(net, input_shape=(6,)).prune(amount)
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())


# ------------------------------------------------------------ ONNX models


def matmul_model(rng) -> onnx.ModelProto:
    """x @ W1 + b1 -> relu -> @ W2: MatMul initializers are the transposes of the dense weights."""
    W1, b1, W2 = rng.normal(size=(3, 4)), rng.normal(size=4), rng.normal(size=(4, 2))
    inits = [numpy_helper.from_array(a.astype(np.float32), n) for a, n in [(W1, "W1"), (b1, "b1"), (W2, "W2")]]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["m1"]), helper.make_node("Add", ["m1", "b1"], ["a1"]),
             helper.make_node("Relu", ["a1"], ["r1"]), helper.make_node("MatMul", ["r1", "W2"], ["y"])]
    graph = helper.make_graph(nodes, "mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_onnx_scores_in_source_layout_and_masks_in_initializers():
    rng = np.random.default_rng(0)
    model = matmul_model(rng)
    cm = pathir.compile(model)
    scores = cm.path_magnitude_scores()
    assert scores["W1"].shape == (3, 4) and scores["W2"].shape == (4, 2)
    W1 = numpy_helper.to_array(model.graph.initializer[0]).astype(np.float64)
    W2 = numpy_helper.to_array(model.graph.initializer[2]).astype(np.float64)
    b1 = numpy_helper.to_array(model.graph.initializer[1]).astype(np.float64)
    # S of W1[i, j] (input i -> hidden j): |W1[i, j]| * Σ_k |W2[j, k]|
    np.testing.assert_allclose(scores["W1"], np.abs(W1) * np.abs(W2).sum(axis=1)[None, :], rtol=1e-12)
    report = cm.prune(0.5)
    out = {t.name: numpy_helper.to_array(t) for t in cm.to_onnx().graph.initializer}
    zeros = sum(int((out[n] == 0).sum()) for n in ("W1", "W2"))
    assert zeros == report.pruned
    np.testing.assert_array_equal(out["W1"] != 0, cm.graph.params()[0].value.T != 0)
    x = rng.normal(size=(1, 3))
    h = np.maximum(x @ (out["W1"].astype(np.float64)) + b1, 0)
    np.testing.assert_allclose(cm.forward(x), h @ out["W2"].astype(np.float64), rtol=1e-6)
    assert numpy_helper.to_array(model.graph.initializer[0]).all()  # the source model is untouched


# ------------------------------------------------------------ the CLI


def test_cli_prunes_a_torch_model_into_a_state_dict(tmp_path, monkeypatch, capsys):
    (tmp_path / "tiny_models.py").write_text(
        "import torch\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "pruned.pt"
    assert main(["prune", "tiny_models:make", "--input-shape", "4", "--amount", "0.5", "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pruned"] == 24 and report["path_metric"] <= report["bound"] * (1 + 1e-12)
    state = torch.load(out)
    assert set(state) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert int((state["0.weight"] == 0).sum() + (state["2.weight"] == 0).sum()) == 24
    fresh = __import__("tiny_models").make()
    fresh.load_state_dict(state)


def test_cli_prunes_an_onnx_file_and_writes_nothing_on_failure(tmp_path, capsys):
    src = tmp_path / "mm.onnx"
    onnx.save(matmul_model(np.random.default_rng(2)), str(src))
    out = tmp_path / "out.onnx"
    assert main(["prune", str(src), "--amount", "0.25", "-o", str(out)]) == 0
    assert "written to" in capsys.readouterr().out
    zeros = sum(int((numpy_helper.to_array(t) == 0).sum()) for t in onnx.load(str(out)).graph.initializer)
    assert zeros == round(0.25 * (12 + 8))
    bad = tmp_path / "bad.onnx"
    assert main(["prune", str(src), "--amount", "1.5", "-o", str(bad)]) == 2
    assert "amount" in capsys.readouterr().err
    assert main(["prune", str(src), "--amount", "0.5", "-o", str(tmp_path / "x.pt")]) == 2
    assert main(["prune", str(src), "--amount", "0.5", "-o", str(tmp_path / "no" / "x.onnx")]) == 2
    assert sorted(os.listdir(tmp_path)) == ["mm.onnx", "out.onnx"]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 3000), frac=st.floats(0, 1), ties=st.booleans())
def test_the_kth_value_from_a_sampled_band_equals_a_full_partition(seed, n, frac, ties):
    """pruning._keep_masks on one array picks the same entries with the sampled band (forced on small
    arrays) as a stable sort."""
    from pathir.lifting import pruning

    values = rng_values(seed, n, ties, 20)
    k = int(round(frac * n))
    (keep,) = with_sampled_band(lambda: pruning._keep_masks([values], k))
    want = np.sort(np.argsort(values, kind="stable")[:k])
    assert np.array_equal(np.flatnonzero(~keep), want)


def rng_values(seed, n, ties: bool, levels: int) -> np.ndarray:
    """n random values: integers in [0, levels) as floats (many ties) or normal ones."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, levels, n).astype(float) if ties else rng.normal(size=n)


def with_sampled_band(fn):
    """``fn()`` with pruning's sampled-band search forced on arrays of any size."""
    from pathir.lifting import pruning

    saved = pruning._SAMPLE_FROM
    try:
        pruning._SAMPLE_FROM = 1
        return fn()
    finally:
        pruning._SAMPLE_FROM = saved


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), sizes=st.lists(st.integers(0, 400), min_size=1, max_size=5),
       frac=st.floats(0, 1), ties=st.booleans(), nans=st.booleans())
def test_the_global_threshold_over_several_arrays_picks_what_a_stable_sort_of_them_all_picks(seed, sizes, frac, ties, nans):
    """pruning._keep_masks over several params (the sampled band forced) against a stable argsort of their
    concatenation: the k smallest, ties to the earlier entry, nan never picked (it sorts last)."""
    from pathir.lifting import pruning

    arrays = [rng_values(seed + i, n, ties, 6).reshape(-1, 1) for i, n in enumerate(sizes)]
    if nans and sum(sizes):
        arrays[int(np.argmax(sizes))][0, 0] = np.nan
    flat = np.concatenate([a.ravel() for a in arrays])
    k = int(round(frac * int(np.count_nonzero(~np.isnan(flat)))))
    masks = with_sampled_band(lambda: pruning._keep_masks(arrays, k))
    want = np.ones(flat.size, dtype=bool)
    want[np.argsort(flat, kind="stable")[:k]] = False
    assert all(m.shape == a.shape for m, a in zip(masks, arrays))
    assert np.array_equal(np.concatenate([m.ravel() for m in masks]), want)


@settings(max_examples=25, deadline=None)
@given(graph=relu_dags(), amount=st.sampled_from([0.3, 0.5, 0.9]), scope=st.sampled_from(["global", "local"]))
def test_scores_ranked_in_log_space_select_and_bound_as_the_linear_domain(graph, amount, scope):
    """The log-space ranking (taken where scaled scores would leave the normal range) gives the same masks
    and the same bound Σ S_i as the linear domain."""
    from pathir.lifting import pruning

    if not report_names(graph):
        return
    linear = pruning._log_scores(graph, "path-magnitude", "numpy")
    saved = pruning._LINEAR_FLOOR
    try:
        pruning._LINEAR_FLOOR = math.inf  # no scaled score clears it: log space
        logs = pruning._log_scores(graph, "path-magnitude", "numpy")
    finally:
        pruning._LINEAR_FLOOR = saved
    assert linear.linear and not logs.linear
    a = pruning.prune_masks(graph, amount, scope=scope, backend="numpy", log_scores=linear)
    b = pruning.prune_masks(graph, amount, scope=scope, backend="numpy", log_scores=logs)
    s = path_magnitude_scores(graph, "numpy")
    by_name = {p.name: s[p.source_name] for p in graph.params()}
    for name in a:  # the same entries, up to ties the two roundings order differently
        cut_a, cut_b = by_name[name][~a[name]], by_name[name][~b[name]]
        assert cut_a.size == cut_b.size
    bound = math.fsum(by_name[n][~a[n]].sum() for n in a)
    for scores, masks in ((linear, a), (logs, b)):
        got = pruning._log_bound(graph, masks, scores)
        assert (math.exp(got) if got > -math.inf else 0.0) == pytest.approx(bound, rel=1e-9, abs=1e-300)


# ----------------------------------------------------------------------------- names torch prune also uses


def _net_with(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2)).double()


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, {
        n: (dict(m._parameters), dict(m._buffers), dict(m._forward_pre_hooks)) for n, m in model.named_modules()}


def _unchanged(model, snap):
    state, tables = snap
    now = model.state_dict()
    return now.keys() == state.keys() and all(torch.equal(now[k], state[k]) for k in state) and all(
        (dict(m._parameters), dict(m._buffers), dict(m._forward_pre_hooks)) == tables[n] for n, m in model.named_modules())


@pytest.mark.parametrize("method", ["pathcond", "normalize", "enorm"])
def test_a_users_own_weight_orig_parameter_is_not_taken_for_torch_prunes(method):
    net = _net_with()
    net[0].weight_orig = nn.Parameter(net[0].weight.detach().clone() * 3, requires_grad=False)  # a rewinding copy
    keep = net[0].weight_orig.detach().clone()
    x = torch.randn(16, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    before = net(x).detach()
    getattr(pathir.compile(net, input_shape=(4,)), method)(progress=False)
    torch.testing.assert_close(net(x), before, rtol=1e-12, atol=1e-12)
    assert torch.equal(net[0].weight_orig, keep)


def test_prune_refuses_a_name_torch_prune_needs_and_leaves_model_and_compiled_as_they_were():
    net = _net_with()
    net[4].weight_orig = torch.zeros(1)  # a plain attribute: torch prune could not register its own
    cm = pathir.compile(net, input_shape=(4,))
    norm, snap = cm.path_norm(1), _snapshot(net)
    with pytest.raises(PathirError, match="weight_orig"):
        cm.prune(0.5)
    assert _unchanged(net, snap)
    assert cm.path_norm(1) == norm == pathir.compile(net, input_shape=(4,)).path_norm(1)


def test_a_prune_that_fails_halfway_puts_every_module_back(monkeypatch):
    from torch.nn.utils import prune as torch_prune

    net = _net_with()
    cm = pathir.compile(net, input_shape=(4,))
    snap, calls, real = _snapshot(net), [], torch_prune.custom_from_mask

    def failing(module, name, mask):
        calls.append(name)
        if len(calls) == 2:
            raise RuntimeError("the second mask fails")
        return real(module, name, mask)

    monkeypatch.setattr(torch_prune, "custom_from_mask", failing)
    with pytest.raises(RuntimeError, match="second mask"):
        cm.prune(0.5)
    assert _unchanged(net, snap)
    assert cm.path_norm(1) == pathir.compile(net, input_shape=(4,)).path_norm(1)


def test_optimizer_state_made_under_inference_mode_is_refused_before_anything_moves():
    net = _net_with()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    net(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    with torch.inference_mode():
        opt.state[net[4].weight]["momentum_buffer"] = torch.ones(2, 6, dtype=torch.float64)
    snap = _snapshot(net)
    momenta = {id(p): opt.state[p]["momentum_buffer"].clone() for p in net.parameters()}
    with pytest.raises(PathirError, match="inference_mode"):
        pathir.compile(net, input_shape=(4,)).pathcond(optimizer=opt, progress=False)
    assert _unchanged(net, snap)
    assert all(torch.equal(opt.state[p]["momentum_buffer"], momenta[id(p)]) for p in net.parameters())


@pytest.mark.parametrize("seed", [0, 3, 7, 40])
def test_the_bound_stays_above_the_path_metric_where_the_two_are_equal(seed):
    """A ReLU6 MLP pruned to 60%: each pruned path crosses one pruned entry, so Σ S_i = d, summed by two walks;
    path_metric came out above bound in its last bits (9 seeds of 100)."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU6(), torch.nn.Linear(4, 2)).double().eval()
    report = pathir.compile(net, input_shape=(3,)).prune(0.6)
    assert report.path_metric <= report.bound <= report.path_metric * (1 + 1e-11)


@pytest.mark.parametrize("scale", [1e-110, 1e-150])
def test_the_bound_stays_above_the_path_metric_below_float64s_smallest_numbers(scale):
    """Every param times 1e-110: the pruned paths' mass (about 1e-330) made Σ S_i round to 0.0 and d to 5e-324, so
    the report said path_metric > bound. Both are exact to the nearest float64: the bound is at least d."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3), torch.nn.ReLU(),
                              torch.nn.Linear(3, 2)).double()
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(scale)
    report = pathir.compile(net, input_shape=(3,)).prune(0.5)
    assert 0.0 <= report.path_metric <= report.bound <= 1e-300


@pytest.mark.parametrize("scale", [1.0, 1e100, 1e300])
def test_a_pruned_path_metric_from_two_large_norms_is_a_bracket_of_their_rounding(scale):
    """Two paths, a·c about 0.12 % of the path-norm, pruned: d = |a·c|. Taken as the difference of two log-scaled
    norms near 1e300 (each within about L·ε of itself, the subtraction magnifying it 800 times) the report's
    path_metric read 7e-11 under d, and under the model's own output change at x = 1 (pruning review). It is the
    upper end of the bracket d ± ROUNDING·(both norms) now: at or above d and the output change."""
    from fractions import Fraction

    net = torch.nn.Sequential(torch.nn.Linear(1, 2, bias=False), torch.nn.ReLU(),
                              torch.nn.Linear(2, 1, bias=False)).double()
    a, c, b, e = 0.7 * scale**0.5, 0.0123456789 * scale**0.5, 1.9 * scale**0.5, 3.7 * scale**0.5
    with torch.no_grad():
        net[0].weight[:] = torch.tensor([[a], [b]], dtype=torch.float64)
        net[2].weight[:] = torch.tensor([[c, e]], dtype=torch.float64)
    x = torch.ones(1, 1, dtype=torch.float64)
    before = net(x).detach()
    report = pathir.compile(net, input_shape=(1,)).prune(1)
    d = float(Fraction(a) * Fraction(c))  # the path a·c is the one cut
    assert report.per_tensor["0.weight"] == (1, 2) and net[0].weight[0, 0] == 0
    assert d <= report.path_metric <= d * (1 + 1e-8)
    assert float((net(x) - before).abs().sum()) <= report.path_metric <= report.bound


def test_the_walk_rounding_bound_covers_sums_that_all_round_down():
    """Rows [1, δ, δ, ...] with δ = 0.75·2^-53: every sum of a layer rounds down, and the walk of a deep wide MLP
    loses a little per layer (3.3e-12 over 80 layers of 1024: the pruned metric's bracket of ±1e-12 missed d by
    1.4e-10 of it; latest-commits review). walk_rounding bounds the walk's relative error; checked here on 24
    layers of 256 against the exact norm, and the pruned bracket holds d."""
    import mpmath as mp

    from pathir.lifting.path_metric import pruned_path_metric, walk_rounding

    n, depth, delta, bias = 256, 24, 0.75 * 2.0**-53, 0.01

    def build(pruned):
        layers = []
        for k in range(depth):
            last = k == depth - 1
            lin = torch.nn.Linear(n, 1 if last else n, bias=last).double()
            with torch.no_grad():
                lin.weight.fill_(0.0 if pruned else delta)
                lin.weight[:, 0] = 1.0
                if last:
                    lin.bias.fill_(0.0 if pruned else bias)
            layers += [lin, torch.nn.ReLU()]
        return pathir.compile(torch.nn.Sequential(*layers[:-1]), input_shape=(n,), self_check=False)

    a, b = build(False), build(True)
    mp.mp.dps = 40
    exact = (1 + (n - 1) * mp.mpf(delta)) ** depth + mp.mpf(bias)
    r = walk_rounding(a.graph, math.log(float(exact)))
    for be in ("torch", "numpy"):
        got = a.path_norm(1, backend=be)
        assert abs(mp.mpf(got) - exact) <= r * exact
        m = pruned_path_metric(a.graph, b.graph, pathir.backends.get_backend(be))
        assert m.lower <= float(exact - 1) <= m.upper
