"""Equalization for quantization (docs/equalize.md, docs/math.md §12), against definitions: the function
kept, Nagel's closed form on chains, the pairwise balance iteration on DAGs, the certified bound against
the real output change, refusals that leave the model untouched, the report, ONNX and the CLI."""

import copy
import json
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import written
from enumerated import path_factors
from hypothesis import given, settings

import pathir
from pathir.app.cli import main
from pathir.equalization.objective import Objective
from pathir.equalization.tensors import quantize, quantized_params, tensor_pairs
from pathir.errors import ArgumentError, PathirError, UnsupportedOperation
from pathir.testing import relu_dags


def _outputs(out):
    return list(out.values()) if isinstance(out, dict) else [out]


def _spread_bn(model, seed=0):
    """Batch-norm statistics as training leaves them: γ log-normal, the running statistics not unit."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.copy_(torch.exp(torch.randn(m.weight.shape, generator=g)))
                m.bias.copy_(0.3 * torch.randn(m.bias.shape, generator=g))
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.2)
    return model.eval()


def _noise_objective(graph):
    """F_noise read from the definition: log Σ_T (max_{i∈T} |θ_i|)² Σ_{i∈T} G_ii, G_ii = Σ_{p∋i} (Φ_p/θ_i)²
    over the enumerated paths (docs/math.md §12); None where no quantized weight lies on a path."""
    paths, layout = path_factors(graph)
    g = np.zeros(sum(p.value.size for p in graph.params()))
    for const, free in paths:
        values = np.array([v for _, v in free])
        for k, (index, _) in enumerate(free):
            g[index] += (const * np.prod(np.delete(values, k))) ** 2
    terms = []
    for p in quantized_params(graph):
        sl = layout.slice(p)
        if np.abs(p.value).max() > 0 and g[sl].sum() > 0:
            terms.append(2 * math.log(np.abs(p.value).max()) + math.log(g[sl].sum()))
    return float(np.logaddexp.reduce(terms)) if terms else None


def _range_objective(graph):
    """F_range(0) read from the definition, tensor by tensor (docs/math.md §12)."""
    total = 0.0
    for p in quantized_params(graph):
        a = np.abs(p.value)
        if a.max() > 0:
            total += math.log(a.max()) - float(np.mean(np.log(a[a > 0])))
    return total


# ---------------------------------------------------------------- the function is kept


@settings(max_examples=15, deadline=None)
@given(relu_dags(max_neurons=50, max_paths=500))
def test_random_dags_keep_their_function(graph):
    cm = pathir.compile(graph)
    if not quantized_params(graph):
        with pytest.raises(PathirError, match="nothing to equalize"):
            cm.equalize()
        return
    rng = np.random.default_rng(0)
    x = {n.name: rng.normal(size=(3, *n.shape)) for n in graph.nodes if n.kind.name == "INPUT"}
    before = _outputs(pathir.compile(graph).forward(x, "numpy"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pathir.NotConvergedWarning)
        report = cm.equalize(max_log_scale=20.0)
    assert report.objective_after <= report.objective_before + 1e-12 or report.objective_before == -math.inf
    for a, b in zip(before, _outputs(cm.forward(x, "numpy"))):
        np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-9 * max(1.0, float(np.abs(a).max())))
    # the reported objective is the definition's, read off the rescaled graph
    reference = _noise_objective(cm.graph)
    assert report.objective_after == (-math.inf if reference is None else pytest.approx(reference, rel=1e-9, abs=1e-9))


def test_zoo_model_keeps_its_function_and_quantizes_with_less_output_change():
    torch.manual_seed(0)
    import torchvision

    model = _spread_bn(torchvision.models.resnet18()).double()
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    before, kept = model(x), written.state(model)
    report = pathir.equalize(model, input_shape=(3, 32, 32), bits=6, inputs=x, certify=True)
    torch.testing.assert_close(model(x), before, rtol=1e-9, atol=1e-9 * float(before.abs().max()))
    assert report.written and report.objective_after < report.objective_before
    assert written.moved(model, kept) > 0.1  # into the model's own tensors
    # quantizing at W6 now moves the outputs less (the noise objective's aim; per-tensor weight SQNR may not)
    assert report.observed_after is not None and report.observed_after < 0.5 * report.observed_before
    assert report.bound_after >= report.observed_after


# ---------------------------------------------------------------- chains and DAGs


def _chain(seed, widths=(6, 5, 3)):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(widths[0], widths[1]), nn.ReLU(), nn.Linear(widths[1], widths[2])).double()
    with torch.no_grad():
        net[0].weight.mul_(torch.exp(2 * torch.randn(widths[1], 1)))
    return net


@pytest.mark.parametrize("seed", range(5))
def test_chains_reach_nagels_closed_form(seed):
    net = _chain(seed)
    cm = pathir.compile(net, input_shape=(6,))
    facts = cm.facts
    objective = Objective(tensor_pairs(facts.graph, facts.units, facts.row_ends))
    w1, w2 = net[0].weight.detach().numpy(), net[2].weight.detach().numpy()
    nagel = np.log(np.abs(w2).max(axis=0) / np.abs(w1).max(axis=1))  # s_h = sqrt(r1/r2): incoming e^{z/2}
    report = cm.equalize(objective="range", write_back=False)
    assert report.objective_after <= objective.value(nagel) + 1e-9
    assert report.objective_after == pytest.approx(objective.value(nagel), abs=1e-9)


def _pairwise_balance(graph, units, row_ends, sweeps=200):
    """Nagel's rule iterated over units: incoming max-abs = outgoing max-abs at every unit (the p -> inf
    limit of ENorm's balance), over the quantized tensors; returns z."""
    H = len(units)
    z = np.zeros(H)
    ends = {id(p): e for p, e in zip(units.params, row_ends.ends)}
    tensors = [(np.log(np.abs(p.value) + 1e-300), *ends[id(p)]) for p in quantized_params(graph)]
    for _ in range(sweeps):
        for h in range(H):
            zp = np.append(z, 0.0)
            inc = out = -np.inf
            for logs, e, l in tensors:
                shifted = logs + 0.5 * (zp[e] - zp[l])
                inc = max(inc, float(np.max(np.where(np.broadcast_to(e == h, logs.shape), shifted, -np.inf))))
                out = max(out, float(np.max(np.where(np.broadcast_to(l == h, logs.shape), shifted, -np.inf))))
            if np.isfinite(inc) and np.isfinite(out):
                z[h] += out - inc  # both sides meet at the geometric mean
    return z


def _skip_net(seed):
    torch.manual_seed(seed)

    class Skip(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c, self.o = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 2)
            with torch.no_grad():
                for layer in (self.a, self.b, self.c):
                    layer.weight.mul_(torch.exp(1.5 * torch.randn(6, 1)))

        def forward(self, x):
            h = torch.relu(self.a(x))
            h = h + torch.relu(self.b(h))  # a residual stream: every channel tied across the blocks
            h = h + torch.relu(self.c(h))
            return self.o(h)

    return Skip().double()


@pytest.mark.parametrize("seed", range(4))
def test_dags_do_no_worse_than_the_pairwise_iteration(seed):
    cm = pathir.compile(_skip_net(seed), input_shape=(4,))
    facts = cm.facts
    objective = Objective(tensor_pairs(facts.graph, facts.units, facts.row_ends))
    pairwise = objective.value(_pairwise_balance(facts.graph, facts.units, facts.row_ends))
    report = cm.equalize(objective="range", write_back=False)
    assert report.objective_after <= pairwise + 1e-9


# ---------------------------------------------------------------- the certified bound


@pytest.mark.parametrize("objective", ["noise", "range", "path-metric"])
def test_certified_bound_holds_on_random_inputs(objective):
    net = _spread_bn(nn.Sequential(nn.Conv2d(2, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                   nn.Linear(6 * 3 * 3, 5), nn.ReLU(), nn.Linear(5, 2))).double()
    x = torch.randn(64, 2, 8, 8, dtype=torch.float64) * 3
    cm = pathir.compile(net, input_shape=(2, 8, 8))
    report = cm.equalize(bits=4, objective=objective, inputs=x, certify=True)
    assert report.observed_before <= report.bound_before and report.observed_after <= report.bound_after
    # the observed change, read without pathir: the model with every weight tensor quantized
    graph = cm.graph
    weights = {id(p) for p in quantized_params(graph)}
    quantized = graph.map_params(lambda p: p.__class__(p.name, quantize(p.value, 4), p.sources, p.how)
                                 if id(p) in weights else p)
    diff = np.abs(_outputs(cm.forward(x.numpy(), "numpy"))[0] - _outputs(pathir.compile(quantized).forward(x.numpy(), "numpy"))[0])
    assert float(diff.sum(axis=1).max()) == pytest.approx(report.observed_after, rel=1e-9)


def test_path_metric_objective_lowers_its_own_bound():
    net = _spread_bn(nn.Sequential(nn.Conv2d(2, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3),
                                   nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 3))).double()
    cm = pathir.compile(net, input_shape=(2, 8, 8))
    report = cm.equalize(bits=6, objective="path-metric", write_back=False)
    assert report.objective_after <= report.objective_before
    assert report.bound_after <= report.bound_before * 1.05


@pytest.mark.parametrize("absorb_bias", [False, True])
def test_path_metric_objective_never_writes_a_rescaling_that_raises_the_certified_bound(absorb_bias):
    """At 2 bits the first-order objective fell (5.81 -> 5.46) while the certified bound it estimates rose
    (36.0 -> 39.1), and that rescaling was written; with absorb_bias=True the guard did not run at all."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    with torch.no_grad():
        net[0].weight[:4] *= 20
        net[2].weight[:, :2] *= 0.05
    state = _state(net)
    cm = pathir.compile(net, input_shape=(4,), progress=False)
    report = cm.equalize(bits=2, objective="path-metric", absorb_bias=absorb_bias)
    assert report.bound_after == report.bound_before and not np.any(report.z) and report.units_moved == 0
    assert "raises the certified bound" in str(report) and all(torch.equal(v, state[k]) for k, v in net.state_dict().items())
    # nothing written, and the report says so once: it read "none is written (z = 0)" then "written into the model"
    assert report.write_back and (report.written == absorb_bias) and ("written into the model" in str(report)) == absorb_bias
    assert absorb_bias or "nothing to write" in str(report)


class _TwiceReturned(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 3), nn.Linear(6, 2)

    def forward(self, x):
        h = torch.relu(self.a(x))
        y = self.b(h)
        return y, self.c(h), y


def test_the_observed_change_counts_an_output_returned_twice_twice():
    """observed_before summed the node-keyed outputs once (1.22 where ‖R(x) − R_Q(x)‖₁ over the returned vector
    is 2.00), under the certified bound, which counts y twice."""
    torch.manual_seed(0)
    net = _TwiceReturned().double()
    x = torch.randn(16, 4, dtype=torch.float64)
    report = pathir.compile(net, input_shape=(4,)).equalize(bits=3, inputs=x.numpy(), certify=True, write_back=False)
    quantized = copy.deepcopy(net)
    with torch.no_grad():
        for lin in (quantized.a, quantized.b, quantized.c):
            step = lin.weight.abs().max() / 3  # symmetric per tensor at 3 bits: 2^(3-1) - 1 = 3 levels a side
            lin.weight.copy_(torch.round(lin.weight / step) * step)
    change = sum((u - v).abs().sum(dim=1) for u, v in zip(net(x), quantized(x))).max()
    assert report.observed_before == pytest.approx(float(change), rel=1e-9)
    assert report.observed_before <= report.bound_before


def test_bits_may_be_a_numpy_integer():
    torch.manual_seed(0)
    cm = pathir.compile(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)), input_shape=(4,))
    assert cm.equalize(bits=np.int64(6), write_back=False).bits == 6


# ---------------------------------------------------------------- refusals leave the model untouched


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(model, state):
    return all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_refusals_leave_the_model_untouched():
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.b(torch.sigmoid(self.a(x)))

    model = Gate()
    state = _state(model)
    with pytest.raises(UnsupportedOperation, match="sigmoid"):
        pathir.equalize(model, input_shape=(3,))
    assert _same(model, state)

    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    torch.nn.utils.parametrize.register_parametrization(net[0], "weight", _Twice())
    state = _state(net)
    cm = pathir.compile(net, input_shape=(3,))
    with pytest.raises(PathirError):
        cm.equalize()
    assert _same(net, state)
    for bad in ({"bits": 1}, {"bits": 8.5}, {"objective": "nagel"}):
        with pytest.raises(PathirError):
            pathir.compile(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), input_shape=(3,)).equalize(**bad)


class _Twice(nn.Module):
    def forward(self, w):
        return 2 * w


# ---------------------------------------------------------------- report, ONNX, CLI


def test_report_table_and_dict():
    cm = pathir.compile(_chain(0), input_shape=(6,))
    report = cm.equalize(bits=6, certify=True)
    d = report.to_dict()
    assert d["bits"] == 6 and len(d["tensors"]) == 2 and "z" not in d
    json.dumps(d)
    text = str(report)
    assert "0.weight" in text and "certified output bound" in text


def test_onnx_file_equalized_matches_onnxruntime(tmp_path):
    import onnxruntime as ort

    net = _spread_bn(nn.Sequential(nn.Conv2d(2, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 4, 3), nn.ReLU(),
                                   nn.Flatten(), nn.Linear(4 * 4 * 4, 3)))
    path, out = tmp_path / "m.onnx", tmp_path / "eq.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.randn(1, 2, 8, 8),), str(path), dynamo=False, input_names=["x"],
                          dynamic_axes={"x": {0: "batch"}})
    cm = pathir.compile(str(path))
    report = cm.equalize(bits=6)
    assert report.written
    cm.save(str(out))
    x = np.random.default_rng(0).normal(size=(5, 2, 8, 8)).astype(np.float32)
    a = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    b = ort.InferenceSession(str(out)).run(None, {"x": x})[0]
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * float(np.abs(a).max()))
    import onnx  # the saved file's own tensors moved (a copy of the input keeps its output too)
    import onnx.numpy_helper as nh
    old, new = ({t.name: nh.to_array(t) for t in onnx.load(str(f)).graph.initializer} for f in (path, out))
    assert max(float(np.abs(new[k] - v).max() / np.abs(v).max()) for k, v in old.items() if np.abs(v).max()) > 0.1


def test_cli_writes_an_equalized_state_dict(tmp_path, capsys, monkeypatch):
    (tmp_path / "eq_models.py").write_text(
        "import torch\nfrom torch import nn\n\n\ndef small():\n    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).eval()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "eq.pt"
    code = main(["equalize", "eq_models:small", "--input-shape", "4", "--bits", "6", "-o", str(out), "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert code == 0 and printed["bits"] == 6 and printed["written"]
    import eq_models

    fresh = eq_models.small()
    x = torch.randn(7, 4)
    before = fresh(x)
    fresh.load_state_dict(torch.load(out))
    torch.testing.assert_close(fresh(x), before, rtol=1e-5, atol=1e-6)


RELU6_FACTORY = (
    "import torch\nfrom torch import nn\n\n\ndef net():\n"
    "    m = nn.Sequential(nn.Linear(4, 6), nn.ReLU6(), nn.Linear(6, 2))\n"
    "    with torch.no_grad():\n"
    "        m[0].weight.mul_(torch.logspace(-1, 1.5, 6).reshape(6, 1))\n"
    "    return m.eval()\n")


@pytest.mark.parametrize("command", ["equalize", "pathcond"])
@pytest.mark.parametrize("json_out", [False, True])
def test_cli_saves_the_whole_model_where_modules_were_replaced(command, json_out, tmp_path, capsys, monkeypatch):
    (tmp_path / "eq_relu6.py").write_text(RELU6_FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "eq.pt"
    code = main([command, "eq_relu6:net", "--input-shape", "4", "-o", str(out), "-q", *(["--json"] if json_out else [])])
    printed = capsys.readouterr().out
    assert code == 0
    if json_out:
        info = json.loads(printed)
        assert info["output_format"] == "module" and info["replaced_modules"] == ["1"]
    else:
        assert f"torch.load({str(out)!r}, weights_only=False)" in printed and "not as a state_dict" in printed
    import eq_relu6

    torch.manual_seed(0)  # the CLI builds the factory's model under --seed 0
    original = eq_relu6.net()
    loaded = torch.load(out, weights_only=False)  # as the output line says
    assert type(loaded[1]).__name__ == "ClippedReLU"  # per-channel thresholds: no fresh instance holds them
    x = torch.randn(64, 4) * 3
    with torch.no_grad():
        want = original(x)
        torch.testing.assert_close(loaded(x), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_relu6_replaced_by_relu_reports_the_change_and_restores_on_error():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU6(), nn.Linear(8, 2)).double()
    with torch.no_grad():
        net[0].weight.mul_(5.0)  # activations past 6: the swap changes the function
    x = torch.randn(32, 4, dtype=torch.float64)
    before = net(x)
    report = pathir.equalize(net, input_shape=(4,), relu6="relu", inputs=x)
    assert type(net[1]) is nn.ReLU and report.relu_change > 0 and "replaced by ReLU" in str(report)
    relu = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double()
    relu.load_state_dict(net.state_dict())
    torch.testing.assert_close(relu(x), net(x))
    change = float((net(x) - before).abs().max()) / float(before.abs().max())  # equalized: ReLU's function kept
    assert report.relu_change == pytest.approx(change, rel=1e-6)
    # a refusal after the swap puts the clipped ReLU back
    gate = nn.Sequential(nn.Linear(4, 8), nn.ReLU6(), nn.Sigmoid(), nn.Linear(8, 2))
    with pytest.raises(UnsupportedOperation):
        pathir.equalize(gate, input_shape=(4,), relu6="relu")
    assert type(gate[1]) is nn.ReLU6
    with pytest.raises(PathirError, match="relu6"):
        pathir.equalize(nn.Sequential(nn.Linear(4, 2)), input_shape=(4,), relu6="drop")


def test_relu6_relu_without_write_back_leaves_the_clipped_relus():
    """write_back=False wrote no rescaling but left every ReLU6 replaced by a ReLU."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU6(), nn.Linear(8, 2))
    state = {k: v.clone() for k, v in net.state_dict().items()}
    report = pathir.equalize(net, input_shape=(4,), relu6="relu", write_back=False)
    assert type(net[1]) is nn.ReLU6 and all(torch.equal(v, net.state_dict()[k]) for k, v in state.items())
    assert "put back, the model is untouched" in str(report)


@pytest.mark.parametrize("json_out", [False, True])
def test_cli_relu6_relu_writes_the_model_with_relus(json_out, tmp_path, capsys, monkeypatch):
    (tmp_path / "eq_relu6b.py").write_text(RELU6_FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "eq.pt"
    code = main(["equalize", "eq_relu6b:net", "--input-shape", "4", "--relu6", "relu", "-o", str(out), "-q",
                 *(["--json"] if json_out else [])])
    printed = capsys.readouterr().out
    assert code == 0
    if json_out:
        info = json.loads(printed)
        assert info["output_format"] == "module" and info["replaced_modules"] == ["1"]
        assert info["model"] == "eq_relu6b:net"
    else:
        assert "replaced by ReLU" in printed and "each clipped ReLU made a ReLU" in printed
    import eq_relu6b

    torch.manual_seed(0)  # the CLI builds the factory's model under --seed 0
    relu = eq_relu6b.net()
    relu[1] = nn.ReLU()
    loaded = torch.load(out, weights_only=False)
    assert type(loaded[1]) is nn.ReLU
    x = torch.randn(64, 4) * 3
    with torch.no_grad():
        want = relu(x)  # the equalized model computes the ReLU model's function
        torch.testing.assert_close(loaded(x), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


class _TwoInputs(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.a, self.b, self.act, self.c = nn.Linear(6, 8), nn.Linear(3, 8), act, nn.Linear(8, 2)

    def forward(self, x, y):
        return self.c(self.act(self.a(x) + self.b(y)))


def _two_inputs(act):
    torch.manual_seed(0)
    net = _TwoInputs(act).double().eval()
    with torch.no_grad():
        net.a.weight.mul_(torch.logspace(-1, 1.5, 8, dtype=torch.float64).reshape(8, 1))  # some pass 6
    return net


_XY = (torch.randn(32, 6, dtype=torch.float64) * 3, torch.randn(32, 3, dtype=torch.float64) * 3)


@pytest.mark.parametrize("relu6", ["clip", "relu"])
@pytest.mark.parametrize("form", ["example_input", "input_shape list", "inputs tuple", "inputs dict"])
def test_every_input_form_of_a_two_input_model(form, relu6):
    net = _two_inputs(nn.ReLU6())
    definition = _two_inputs(nn.ReLU6() if relu6 == "clip" else nn.ReLU())  # the same weights
    original = net(*_XY).detach()
    kwargs = {"example_input": (_XY[0][:1], _XY[1][:1])} if form != "input_shape list" else {
        "input_shape": [(6,), (3,)]}
    inputs = {"inputs tuple": _XY, "inputs dict": {"x": _XY[0], "y": _XY[1]}}.get(form)
    report = pathir.equalize(net, relu6=relu6, inputs=inputs, progress=False, **kwargs)
    want = definition(*_XY).detach()
    torch.testing.assert_close(net(*_XY).detach(), want, rtol=1e-9, atol=1e-9 * float(want.abs().max()))
    if relu6 == "relu" and inputs is not None:  # measured on the inputs given
        change = float((want - original).abs().max() / original.abs().max())
        assert report.relu_change == pytest.approx(change, rel=1e-6) and change > 0.01


@pytest.mark.parametrize("relu6", ["clip", "relu"])
@pytest.mark.parametrize("model,kwargs,inputs,match", [
    ("one", {"input_shape": (4,)}, torch.randn(5, 7), r"input 'input_1' expects \(B, 4\), got \(5, 7\)"),
    ("two", {"input_shape": [(6,), (3,)]}, (torch.randn(5, 7), torch.randn(5, 3)), r"input 'x' expects \(B, 6\)"),
    ("two", {"input_shape": [(6,), (3,)]}, torch.randn(5, 6), r"the graph has inputs \['x', 'y'\]"),
    ("two", {"input_shape": [(6,), (3,)]}, {"x": torch.randn(5, 6)}, r"lacks \['y'\]"),
])
def test_wrong_inputs_are_an_input_shape_error_and_nothing_changes(model, kwargs, inputs, match, relu6):
    from pathir.errors import InputShapeError

    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU6(), nn.Linear(8, 2)) if model == "one" else _two_inputs(nn.ReLU6())
    act, state = net.get_submodule("1" if model == "one" else "act"), {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(InputShapeError, match=match):
        pathir.equalize(net, relu6=relu6, inputs=inputs, progress=False, **kwargs)
    assert net.get_submodule("1" if model == "one" else "act") is act
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())


class _AddThenBatchNorm(nn.Module):
    """A batch-norm after a residual add cannot be folded: a rescaling writes its running statistics."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1)
        self.bn, self.c, self.head = nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3, padding=1), nn.Linear(4, 2)

    def forward(self, x):
        h = torch.relu(self.bn(self.a(x) + self.b(x)))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(torch.relu(self.c(h)), 1), 1))


def test_an_unfolded_batch_norm_bounds_only_its_own_units_and_only_downward():
    torch.manual_seed(0)
    net = _spread_bn(_AddThenBatchNorm()).double()
    with torch.no_grad():
        net.bn.running_var[0] = 0.0  # a dead channel: var + eps = eps
        net.c.weight.mul_(torch.exp(2 * torch.randn(4, 1, 1, 1, dtype=torch.float64)))
    x = torch.randn(8, 3, 6, 6, dtype=torch.float64)
    before = net(x)
    cm = pathir.compile(net, input_shape=(3, 6, 6))
    lower = cm.variance_lower_bounds()
    assert lower is not None and np.isfinite(lower).sum() == 4  # the four channels the batch-norm reads
    assert np.nanmax(lower[np.isfinite(lower)]) == pytest.approx(math.log(4e-3), abs=1e-6)  # var = 0: λ² ≥ 4e-3
    report = cm.equalize(bits=6)
    assert report.units_moved > 0  # the scalar bound (var/eps = 1) would have held every unit at z = 0
    assert np.all(report.z[np.isfinite(lower)] >= lower[np.isfinite(lower)] - 1e-9)
    assert torch.all(net.bn.running_var >= 0)
    torch.testing.assert_close(net(x), before, rtol=1e-9, atol=1e-9 * float(before.abs().max()))


def test_the_one_call_form_refuses_an_onnx_model_it_could_not_hand_back(tmp_path):
    """An ONNX model is never changed in place: ``pathir.equalize`` on one would equalize a copy and drop
    it, so it refuses and names the way that keeps the result; ``relu6='relu'`` (a torch module swap)
    is refused for it too. A report without a write (``write_back=False``) is given."""
    import onnx
    from onnx_cases import exported

    _, shape, proto = exported("mlp", "legacy")
    path = tmp_path / "m.onnx"
    onnx.save(proto, str(path))
    source = path.read_bytes()
    for model in (str(path), proto):
        with pytest.raises(ArgumentError, match=r"cm\.save"):
            pathir.equalize(model, progress=False)
        with pytest.raises(ArgumentError, match="relu6='relu'"):
            pathir.equalize(model, relu6="relu", write_back=False, progress=False)
        report = pathir.equalize(model, write_back=False, progress=False)
        assert not report.written and report.units_moved > 0
    assert path.read_bytes() == source


def test_after_describes_the_float32_model_as_written():
    """At 16 bits a float32 weight's rounding is a fifth of a step: the report's "after" (SQNR, observed change)
    was that of the float64 products, not of the tensors written (93.5935 dB where the written weight's is
    93.5966). Against the model's own folded float32 tensors, quantized here."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 6), nn.BatchNorm1d(6), nn.ReLU(),
                        nn.Linear(6, 2))
    _spread_bn(net)
    with torch.no_grad():
        net[1].weight.copy_(torch.logspace(-1.5, 1.5, 8))
    x = torch.randn(32, 3)
    report = pathir.equalize(net, input_shape=(3,), bits=16, inputs=x.numpy())
    double = copy.deepcopy(net).double()  # the written float32 tensors, read exactly
    layers = [(double[0], double[1]), (double[3], double[4]), (double[6], None)]

    def bn_scale(bn):
        return bn.weight / torch.sqrt(bn.running_var + bn.eps)

    folded = [(lin.weight * bn_scale(bn)[:, None] if bn is not None else lin.weight).detach().numpy()
              for lin, bn in layers]
    for row, w in zip(report.tensors, folded):
        q = quantize(w, 16)  # Δ·round(w/Δ), Δ = max|w| / (2^15 − 1)
        assert row.sqnr_after == pytest.approx(10 * math.log10(np.sum(w ** 2) / np.sum((w - q) ** 2)), abs=1e-9)
    quantized = copy.deepcopy(double)
    with torch.no_grad():
        for (lin, bn), w in zip([(quantized[0], quantized[1]), (quantized[3], quantized[4]), (quantized[6], None)],
                                folded):
            q = torch.from_numpy(quantize(w, 16))
            lin.weight.copy_(q / bn_scale(bn)[:, None] if bn is not None else q)
    change = (double(x.double()) - quantized(x.double())).abs().sum(dim=1).max()
    assert report.observed_after == pytest.approx(float(change), rel=1e-6)


def test_absorption_into_a_functional_clip_names_what_to_change():
    """F.relu6 in forward with absorb_bias=True and relu6='relu': the refusal advised relu6='relu' (given already,
    and it replaces modules only), and named the node's origin as '( ('."""

    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.b1, self.c2 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1)

        def forward(self, x):
            return self.c2(nn.functional.relu6(self.b1(self.c1(x))))

    net = _spread_bn(Functional())
    with torch.no_grad():
        net.b1.bias.fill_(3.0)
    before = copy.deepcopy(net.state_dict())
    with pytest.raises(PathirError, match=r"functional one in forward \(F.relu6") as err:
        pathir.equalize(net, input_shape=(3, 6, 6), absorb_bias=True)
    assert "( (" not in str(err.value)
    # relu6='relu' replaces modules only: a call is refused up front, by name
    with pytest.raises(PathirError, match=r"relu6='relu': the clipped ReLU\(s\) relu6.threshold .*F.relu6"):
        pathir.equalize(net, input_shape=(3, 6, 6), absorb_bias=True, relu6="relu")
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())


def test_a_write_that_replaces_clipped_relus_leaves_the_compiled_on_the_model_as_written():
    """ReLU6 modules made per-channel ClippedReLUs: the Compiled kept float64 products (the report's "after" up to
    2.6e-3 dB off the written float32 weights, path-norms 3.7e-6 below a fresh compile). It traces the model again."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU6(), nn.Linear(8, 8), nn.ReLU6(), nn.Linear(8, 3))
    with torch.no_grad():
        net[0].weight.mul_(torch.logspace(-2, 1.5, 8)[:, None])
    cm = pathir.compile(net, input_shape=(6,))
    report = cm.equalize(bits=16)
    assert type(net[1]).__name__ == "ClippedReLU"
    fresh = pathir.compile(net, input_shape=(6,))
    assert cm.path_norm(1) == fresh.path_norm(1) and cm.path_norm(2) == fresh.path_norm(2)
    for row, lin in zip(report.tensors, (net[0], net[2], net[4])):
        w = lin.weight.detach().double().numpy()
        q = quantize(w, 16)
        assert row.sqnr_after == pytest.approx(10 * math.log10(np.sum(w ** 2) / np.sum((w - q) ** 2)), abs=1e-9)
