"""Write-back into ONNX models: a rescaling leaves onnxruntime's outputs as
they were (float32: relative error <= 1e-5), masks put zeros into the
initializers, the source model is never touched, failures change nothing."""


import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from onnx_cases import export, exported, fresh_bn_convnet, make_model, node, ort_run, rel, tensor_info

import pathir
from pathir.errors import PathirError
from pathir.rescaling.apply import log_scales, rescale_graph

CASES = [(m, e) for m in ("mlp", "bn_mlp", "residual", "pools_exclude_pad", "concat", "shuffle")
         for e in ("legacy", "legacy-nofold")] + [("residual", "dynamo"), ("concat", "dynamo-noopt")]


def _inits(model) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _random_rescaling(cm, seed=0):
    z = np.random.default_rng(seed).normal(size=len(cm.units))
    return z, log_scales(cm.graph, cm.units, z)


@pytest.mark.parametrize("name,exporter", CASES)
def test_random_rescaling_keeps_onnxruntime_outputs(name, exporter):
    _, shape, proto = exported(name, exporter)
    source = proto.SerializeToString()
    cm = pathir.compile(proto)
    z, scales = _random_rescaling(cm)
    assert len(cm.units) > 0
    x = np.random.default_rng(1).normal(size=(4, *shape)).astype(np.float32)
    before = ort_run(proto, x)[0]
    graph = cm.graph  # (after a write through its writer, cm reads the model again: cm.graph is then the new one)
    cm.writer.rescale(graph, scales)
    new = cm.to_onnx()
    onnx.checker.check_model(new)
    after = ort_run(new, x)[0]
    assert rel(after, before) <= 1e-5
    assert proto.SerializeToString() == source
    # the written model is the rescaled graph: compile it back and compare parameters
    again = pathir.compile(new)
    expected = rescale_graph(graph, cm.units, z)
    for p, q in zip(again.graph.params(), expected.params()):
        np.testing.assert_allclose(p.value, q.value, rtol=2e-6, atol=1e-6 * np.abs(q.value).max(), err_msg=p.name)
    assert rel(again.forward(x.astype(np.float64), backend="numpy"), after) <= 1e-5


def test_hidden_neuron_rescaling_of_an_mlp_writes_the_expected_factors():
    _, _, proto = exported("mlp", "legacy-nofold")
    cm = pathir.compile(proto)
    hidden = [n.name for n in cm.graph if cm.graph.is_hidden(n.name)]
    assert len(hidden) == 2
    s = {hidden[0]: np.log(np.arange(1, 8) / 2.0)}
    cm.writer.rescale(cm.graph, s)
    old, new = _inits(proto), _inits(cm.to_onnx())
    f = np.arange(1, 8) / 2.0
    np.testing.assert_allclose(new["0.weight"], old["0.weight"] * f[:, None], rtol=1e-6)
    np.testing.assert_allclose(new["0.bias"], old["0.bias"] * f, rtol=1e-6)
    np.testing.assert_allclose(new["3.weight"], old["3.weight"] / f[None, :], rtol=1e-6)
    np.testing.assert_array_equal(new["5.weight"], old["5.weight"])


def test_unfolded_batchnorm_takes_the_factor_on_its_statistics():
    # relu -> bn (a Scale edge: nothing to fold into) -> linear
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))
    with torch.no_grad():
        net[2].running_mean.uniform_(-1, 1)
        net[2].running_var.uniform_(0.5, 2)
        net[2].weight.uniform_(0.5, 2)
    proto = export(net, (4,), "legacy-nofold")
    cm = pathir.compile(proto)
    relu = next(n.name for n in cm.graph if n.kind.value == "relu")
    lam = np.array([2.0, 0.5, 3.0, 1.0, 0.25])
    cm.writer.rescale(cm.graph, {relu: np.log(lam)})
    old, new = _inits(proto), _inits(cm.to_onnx())
    eps = 1e-5
    np.testing.assert_allclose(new["2.running_mean"], lam * old["2.running_mean"], rtol=1e-6)
    np.testing.assert_allclose(new["2.running_var"] + eps, lam**2 * (old["2.running_var"] + eps), rtol=1e-5)
    np.testing.assert_array_equal(new["2.weight"], old["2.weight"])
    x = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    assert rel(ort_run(cm.to_onnx(), x)[0], ort_run(proto, x)[0]) <= 1e-5


def test_deduplicated_initializers_are_split_not_overwritten():
    # fresh batch-norms: the legacy exporter aliases equal tensors through Identity nodes
    proto = export(fresh_bn_convnet(), (3, 6, 6), "legacy-nofold")
    cm = pathir.compile(proto)
    _, scales = _random_rescaling(cm, seed=3)
    cm.writer.rescale(cm.graph, scales)
    new = cm.to_onnx()
    onnx.checker.check_model(new)
    x = np.random.default_rng(2).normal(size=(2, 3, 6, 6)).astype(np.float32)
    assert rel(ort_run(new, x)[0], ort_run(proto, x)[0]) <= 1e-5
    assert len({t.name for t in new.graph.initializer}) == len(new.graph.initializer)


def test_gemm_alpha_beta_transposed_weights_and_broadcast_bias():
    rng = np.random.default_rng(0)
    model = make_model(
        [node("Gemm", ["x", "W1", "c"], ["h"], "fc1", alpha=0.5, beta=2.0), node("Relu", ["h"], ["r"], "relu"),
         node("Gemm", ["r", "W2"], ["y"], "fc2", transB=1, alpha=3.0)],
        [tensor_info("x", ["N", 4])], [tensor_info("y", ["N", 2])],
        {"W1": rng.normal(size=(4, 3)), "c": np.array(0.3), "W2": rng.normal(size=(2, 3))})
    cm = pathir.compile(model)
    f = np.array([2.0, 0.5, 4.0])
    cm.writer.rescale(cm.graph, {"relu": np.log(f)})
    old, new = _inits(model), _inits(cm.to_onnx())
    np.testing.assert_allclose(new["W1"], old["W1"] * f[None, :], rtol=1e-6)  # W1 is (in, out): transposed
    np.testing.assert_allclose(new["c"], 0.3 * f, rtol=1e-6)  # the scalar bias became one per channel
    np.testing.assert_allclose(new["W2"], old["W2"] / f[None, :], rtol=1e-6)
    x = rng.normal(size=(5, 4)).astype(np.float32)
    assert rel(ort_run(cm.to_onnx(), x)[0], ort_run(model, x)[0]) <= 1e-5


def test_a_writer_made_from_the_model_alone():
    from pathir.frontends.onnx import lower

    _, shape, proto = exported("concat", "legacy")
    cm = pathir.compile(proto)
    _, scales = _random_rescaling(cm, seed=5)
    writer = lower(proto).writer
    writer.rescale(cm.graph, scales)
    cm.writer.rescale(cm.graph, scales)
    assert writer.to_onnx().SerializeToString() == cm.to_onnx().SerializeToString()


def test_two_rescalings_compose_and_to_onnx_returns_copies():
    _, shape, proto = exported("residual", "legacy-nofold")
    cm = pathir.compile(proto)
    z1, s1 = _random_rescaling(cm, 1)
    cm.writer.rescale(cm.graph, s1)
    first = cm.to_onnx()
    first.graph.initializer[0].raw_data = b""  # a caller editing the copy changes nothing inside
    cm.graph = rescale_graph(cm.graph, cm.units, z1)
    z2, s2 = _random_rescaling(cm, 2)
    cm.writer.rescale(cm.graph, s2)
    x = np.random.default_rng(0).normal(size=(2, *shape)).astype(np.float32)
    assert rel(ort_run(cm.to_onnx(), x)[0], ort_run(proto, x)[0]) <= 1e-5


def test_a_failed_rescaling_changes_nothing():
    _, _, proto = exported("mlp", "legacy-nofold")
    cm = pathir.compile(proto)
    before = cm.to_onnx().SerializeToString()
    out = cm.graph.outputs[0]
    with pytest.raises(PathirError, match="pinned"):
        cm.writer.rescale(cm.graph, {out: np.ones(cm.graph.node(out).channels)})
    with pytest.raises((PathirError, ValueError), match="shape"):
        cm.writer.rescale(cm.graph, {cm.graph.nodes[1].name: np.ones(2)})
    assert cm.to_onnx().SerializeToString() == before


# ------------------------------------------------------------------ masks


@pytest.mark.parametrize("name,exporter", [("residual", "legacy-nofold"), ("mlp", "legacy"), ("concat", "dynamo-noopt")])
def test_masks_zero_the_initializers(name, exporter):
    _, shape, proto = exported(name, exporter)
    source = proto.SerializeToString()
    cm = pathir.compile(proto)
    rng = np.random.default_rng(0)
    weights = [p for p in cm.graph.params() if p.value.ndim > 1]
    masks = {p.name: rng.random(p.shape) > 0.4 for p in weights}
    cm.writer.mask(cm.graph, masks)
    new = cm.to_onnx()
    inits = _inits(new)
    for p in weights:
        ref = p.sources[0]
        w = inits[ref.name].reshape(p.shape[::-1] if ref.transposed else p.shape)
        w = w.T if ref.transposed else w
        assert np.all(w[~masks[p.name]] == 0) and np.all(w[masks[p.name]] != 0), p.name
    masked = cm.graph.map_params(lambda p: p.with_value(p.value * masks[p.name]) if p.name in masks else p)
    x = rng.normal(size=(4, *shape)).astype(np.float32)
    ir = pathir.compile(masked).forward(x.astype(np.float64), backend="numpy")
    assert rel(ir, ort_run(new, x)[0]) <= 1e-5
    assert proto.SerializeToString() == source


def test_mask_of_a_folded_batchnorm_bias_is_refused_and_changes_nothing():
    _, _, proto = exported("residual", "legacy-nofold")
    cm = pathir.compile(proto)
    before = cm.to_onnx().SerializeToString()
    bias = cm.graph.node(cm.graph.outputs[0]).bias  # fc.bias: plain
    folded = next(p for p in cm.graph.params() if p.name == "bn2.bias")
    with pytest.raises(PathirError, match="would not zero the param"):
        cm.writer.mask(cm.graph, {bias.name: np.zeros(bias.shape, bool), folded.name: np.zeros(folded.shape, bool)})
    assert cm.to_onnx().SerializeToString() == before


def test_saved_file_round_trips(tmp_path):
    _, shape, proto = exported("concat", "legacy")
    cm = pathir.compile(proto)
    cm.writer.rescale(cm.graph, _random_rescaling(cm)[1])
    path = tmp_path / "rescaled.onnx"
    cm.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["rescaled.onnx"]
    assert onnx.load(str(path)).SerializeToString() == cm.to_onnx().SerializeToString()


# ------------------------------------------------------------------ the Compiled surface


@pytest.mark.parametrize("method,kwargs", [("pathcond", {}), ("enorm", {}), ("normalize", {}), ("prune", {"amount": 0.5})])
def test_compiled_write_backs_give_a_new_onnx_model(method, kwargs, tmp_path):
    _, shape, proto = exported("residual", "legacy-nofold")
    path = tmp_path / "model.onnx"
    path.write_bytes(proto.SerializeToString())
    cm = pathir.compile(str(path))
    x = np.random.default_rng(0).normal(size=(4, *shape)).astype(np.float32)
    before = ort_run(proto, x)[0]
    getattr(cm, method)(**kwargs)
    assert path.read_bytes() == proto.SerializeToString()
    new = cm.to_onnx()
    onnx.checker.check_model(new)
    after = ort_run(new, x)[0]
    ir = cm.forward(x.astype(np.float64), backend="numpy")
    assert rel(ir, after) <= 1e-5  # the compiled graph follows the written model
    if method == "prune":
        zeros = sum(int(np.sum(v == 0)) for v in _inits(new).values())
        assert zeros >= 0.5 * sum(p.size for p in cm.graph.params() if p.value.ndim > 1) * 0.99
    else:
        assert rel(after, before) <= 1e-5
        old, now = _inits(proto), _inits(new)  # written into the file's own tensors (a no-op keeps the output too)
        assert max(float(np.abs(now[k] - v).max() / np.abs(v).max()) for k, v in old.items() if np.abs(v).max()) > 1e-3
    cm.save(tmp_path / "out.onnx")
    assert onnx.load(str(tmp_path / "out.onnx")).SerializeToString() == new.SerializeToString()


def _ir3(model):
    """``model`` as IR version 3 writes it: every initializer also a graph input."""
    from onnx import helper

    model.ir_version = 3
    for t in model.graph.initializer:
        model.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return model


@pytest.mark.parametrize("opset", [8, 10])
def test_an_ir3_model_takes_its_rewritten_clip_and_rebound_initializers_as_graph_inputs(opset):
    """IR version 3 lists every initializer as a graph input: the per-channel Min thresholds of a rewritten
    Clip, and a scale initializer rebound apart from the variance slot it shared, are declared so too."""
    rng = np.random.default_rng(0)
    spread = np.logspace(-1, 1, 8)
    nodes = [node("Conv", ["x", "W1", "b1"], ["h1"], pads=[1, 1, 1, 1]),
             node("Clip", ["h1"], ["m1"], min=0.0, max=6.0),
             node("Conv", ["m1", "W2"], ["h2"], pads=[1, 1, 1, 1]),
             node("BatchNormalization", ["h2", "S", "B", "M", "S"], ["n2"], epsilon=1e-3),
             node("Relu", ["n2"], ["r2"]), node("GlobalAveragePool", ["r2"], ["p"]), node("Flatten", ["p"], ["f"]),
             node("Gemm", ["f", "Wf", "bf"], ["y"], transB=1)]
    inits = dict(W1=3 * rng.normal(size=(8, 3, 3, 3)) * spread[:, None, None, None], b1=rng.normal(size=8),
                 W2=rng.normal(size=(8, 8, 3, 3)), S=spread + 0.5, B=rng.normal(size=8), M=rng.normal(size=8),
                 Wf=rng.normal(size=(4, 8)), bf=rng.normal(size=4))
    model = _ir3(make_model(nodes, [tensor_info("x", ["N", 3, 6, 6])], [tensor_info("y", ["N", 4])], inits, opset=opset))
    x = rng.normal(size=(4, 3, 6, 6)).astype(np.float32)
    before = ort_run(model, x)[0]
    cm = pathir.compile(model)
    assert cm.equalize(progress=False).units_moved > 0
    new = cm.to_onnx()
    onnx.checker.check_model(new)
    assert {t.name for t in new.graph.initializer} <= {i.name for i in new.graph.input}
    assert "Min" in {n.op_type for n in new.graph.node}
    assert rel(ort_run(new, x)[0], before) < 1e-5


def test_a_write_that_changes_onnxruntimes_function_is_refused_and_undone(monkeypatch):
    """The net under the ONNX write rules: a writer that got one tensor wrong (here made so on purpose)
    is caught by onnxruntime on a probe, and the writer's model is put back."""
    from pathir.frontends.onnx.writer import OnnxWriter

    _, shape, proto = exported("residual", "legacy")
    cm = pathir.compile(proto)
    source = cm.to_onnx().SerializeToString()
    right, right_by_rows = OnnxWriter._rescaled, OnnxWriter._rescaled_by_rows
    wrong = {"done": False}

    def one_wrong(self, name, b, sides, by_rows=False):
        new = (right_by_rows if by_rows else right)(self, name, b, sides)
        if new is not None and b.kind == "weight" and not wrong["done"]:
            wrong["done"] = True
            return 2.0 * new
        return new

    monkeypatch.setattr(OnnxWriter, "_rescaled", one_wrong)
    monkeypatch.setattr(OnnxWriter, "_rescaled_by_rows", lambda self, *a: one_wrong(self, *a, by_rows=True))
    z, _ = _random_rescaling(cm)
    with pytest.raises(PathirError, match="onnxruntime's output .* moved by"):
        cm.commit_rescaling(z)
    assert wrong["done"] and cm.to_onnx().SerializeToString() == source
    monkeypatch.setattr(OnnxWriter, "_rescaled", right)
    monkeypatch.setattr(OnnxWriter, "_rescaled_by_rows", right_by_rows)
    cm.commit_rescaling(z)  # the same rescaling, written right, passes
    x = np.random.default_rng(1).normal(size=(4, *shape)).astype(np.float32)
    assert rel(ort_run(cm.to_onnx(), x)[0], ort_run(proto, x)[0]) < 1e-5


def _conv_sub_model(constant_first: bool):
    """Conv → Sub with a per-channel constant (x − b, or b − x) → Relu → Flatten → MatMul."""
    rng = np.random.default_rng(0)
    inits = {"Wc": rng.normal(size=(3, 2, 3, 3)), "b": rng.normal(size=(3, 1, 1)), "G": rng.normal(size=(48, 2))}
    sub = node("Sub", ["b", "c"] if constant_first else ["c", "b"], ["a"])
    return make_model([node("Conv", ["x", "Wc"], ["c"], pads=[1, 1, 1, 1]), sub, node("Relu", ["a"], ["r"]),
                       node("Flatten", ["r"], ["f"]), node("MatMul", ["f", "G"], ["y"])],
                      [tensor_info("x", ["N", 2, 4, 4])], [tensor_info("y", ["N", 2])], inits)


@pytest.mark.parametrize("constant_first", [False, True])
def test_a_sub_of_a_per_channel_constant_is_a_bias_and_is_written_back(constant_first):
    """Sub(conv, b) was refused ("a fixed non-zero bias breaks the rescaling symmetry") where Add(conv, −b) is the
    conv's bias. x − b is now the bias −b (bound to b with its sign), b − x a −1 edge and the bias b."""
    proto = _conv_sub_model(constant_first)
    x = np.random.default_rng(1).normal(size=(5, 2, 4, 4)).astype(np.float32)
    before = ort_run(proto, x)[0]
    cm = pathir.compile(proto)  # the self-check compares with onnxruntime
    assert rel(cm.forward(x.astype(np.float64), backend="numpy"), before) <= 1e-5
    b = _inits(proto)["b"].reshape(-1)
    sign = 1.0 if constant_first else -1.0
    (bias,) = [p for p in cm.graph.params() if p.name == "b"]
    np.testing.assert_array_equal(bias.value, sign * b.astype(np.float64))
    report = cm.pathcond()
    assert report.max_abs_log_scale > 0.1
    new = cm.to_onnx()
    assert rel(ort_run(new, x)[0], before) <= 1e-5
    again = pathir.compile(new)
    assert again.path_norm(1) == pytest.approx(cm.path_norm(1), rel=1e-5)


def test_bias_absorption_into_a_sub_constant_writes_it_with_its_sign():
    """equalize(absorb_bias=True) shifts biases: a Sub's constant holds −bias, so it moves the other way."""
    proto = _conv_sub_model(False)
    cm = pathir.compile(proto)
    writer = cm.writer
    writer.shift_biases(cm.graph, {"b": np.array([0.5, -1.0, 2.0])})
    written = _inits(writer.to_onnx())["b"].reshape(-1)
    np.testing.assert_allclose(written, _inits(proto)["b"].reshape(-1) - np.array([0.5, -1.0, 2.0]), rtol=1e-6)


def test_a_rescaled_weight_falling_below_float32s_normal_range_is_refused_untouched():
    """Only overflows were caught before the probe: a weight of 1e-37 taken to a subnormal (or 1e-44 to 0) was
    written, and a function change that small passes onnxruntime's probe."""
    rng = np.random.default_rng(0)
    W1 = rng.normal(size=(3, 4))
    W1[0, 0], W1[1, 1] = 1e-37, 1e-44
    proto = make_model([node("MatMul", ["x", "W1"], ["h"]), node("Relu", ["h"], ["r"]), node("MatMul", ["r", "W2"], ["y"])],
                       [tensor_info("x", ["N", 3])], [tensor_info("y", ["N", 2])], {"W1": W1, "W2": rng.normal(size=(4, 2))})
    cm = pathir.compile(proto)
    before = cm.to_onnx().SerializeToString()
    with pytest.raises(PathirError, match="'W1' would leave float32's range .* fall to 0 or below its smallest normal"):
        cm.commit_rescaling(np.full(len(cm.units), -30.0))  # the first layer's weights shrink by e^15
    assert cm.to_onnx().SerializeToString() == before


def test_a_scalar_bias_made_per_channel_drops_its_recorded_shape(tmp_path):
    """torch.onnx.export(dynamo=True) records value_info for its constants: `conv(x) + 0.5` written back made the
    scalar per channel ([2, 1, 1]) under a recorded shape [] that shape inference then refused (pathir could not
    compile its own output). The written file passes onnx's full check, runs as the original and compiles."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    nodes = [node("Conv", ["x", "wa", "ba"], ["a"], pads=[1, 1, 1, 1]), node("Add", ["a", "half"], ["h"]),
             node("Relu", ["h"], ["r"]), node("Conv", ["r", "wb"], ["y"])]
    inits = {"wa": rng.normal(size=(2, 2, 3, 3)) * np.array([3.0, 0.05]).reshape(2, 1, 1, 1), "ba": rng.normal(size=2),
             "half": np.float32(0.5), "wb": rng.normal(size=(1, 2, 1, 1))}
    proto = make_model(nodes, [tensor_info("x", ["n", 2, 5, 5])], [tensor_info("y", ["n", 1, 5, 5])], inits)
    proto.graph.value_info.append(helper.make_tensor_value_info("half", TensorProto.FLOAT, []))
    source = tmp_path / "scalar.onnx"
    onnx.save(proto, source)
    cm = pathir.compile(str(source))
    report = cm.pathcond()
    assert np.abs(report.z).max() > 0.1
    out = tmp_path / "written.onnx"
    cm.save(str(out))
    written = onnx.load(out)
    onnx.checker.check_model(written, full_check=True)
    x = rng.normal(size=(3, 2, 5, 5)).astype(np.float32)
    assert rel(ort_run(written, x)[0], ort_run(proto, x)[0]) <= 1e-5
    assert pathir.compile(str(out)).path_norm(1) > 0


@pytest.mark.parametrize("clipped", [False, True])
def test_after_a_write_the_compiled_answers_for_the_file_as_written(clipped, tmp_path):
    """The written initializers are float32: the Compiled kept the float64 products (its path-norms and the equalize
    report's "after" 1e-3 dB off the file's own tensors at 16 bits). It now reads the written model again, also
    where the write rewrote a Clip as Relu and a per-channel Min: equal to a fresh compile of the saved file."""
    import torch.nn as nn

    torch.manual_seed(0)
    act = nn.ReLU6 if clipped else nn.ReLU
    net = nn.Sequential(nn.Linear(6, 8), act(), nn.Linear(8, 8), act(), nn.Linear(8, 3)).eval()
    with torch.no_grad():
        net[0].weight.mul_(torch.logspace(-2, 1.5, 8)[:, None])
    proto = export(net, (6,), "legacy")
    cm = pathir.compile(proto)
    report = cm.equalize(bits=16)
    path = tmp_path / "written.onnx"
    cm.save(str(path))
    fresh = pathir.compile(str(path))
    for q in (1, 2):
        assert cm.path_norm(q) == fresh.path_norm(q)
    inits = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in onnx.load(path).graph.initializer}
    for row in report.tensors:
        w = inits[row.name]
        step = np.abs(w).max() / (2 ** 15 - 1)
        noise = np.sum((w - np.round(w / step) * step) ** 2)
        assert row.sqnr_after == pytest.approx(10 * np.log10(np.sum(w ** 2) / noise), abs=1e-9)


def test_a_zero_rescaling_leaves_every_initializer_bit_for_bit():
    """var <- (var + eps)·1 - eps moved a running variance by 1 ulp where z = 0 (the torch writer alike)."""
    from test_write_back_probe import _KeptNorm

    torch.manual_seed(0)
    proto = export(_KeptNorm().eval(), (2, 8, 8), "legacy-nofold")
    cm = pathir.compile(proto)
    cm.commit_rescaling(np.zeros(len(cm.units)))
    before = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    after = {t.name: numpy_helper.to_array(t) for t in cm.to_onnx().graph.initializer}
    assert before.keys() <= after.keys() and all(np.array_equal(before[k], after[k]) for k in before)  # (a shared
    # initializer the exporter deduplicated is split by the write, its copy the same values)


@pytest.mark.parametrize("rows_equal", [True, False])
def test_a_bias_expanded_over_a_fixed_batch_is_one_bias_or_refused(rows_equal):
    """A file of fixed batch 2 adding a (2, 3) constant: with equal rows it is a bias (written back as one row,
    which broadcasts over the batch as before); with different rows it is refused as such. Both were refused as
    'changes its shape' (ONNX review)."""
    rng = np.random.default_rng(0)
    c = np.stack([rng.normal(size=3)] * 2) if rows_equal else rng.normal(size=(2, 3))
    model = make_model(
        [node("Gemm", ["x", "W1"], ["h"], "fc1", transB=1), node("Add", ["h", "c"], ["h2"], "add"),
         node("Relu", ["h2"], ["r"], "relu"), node("Gemm", ["r", "W2"], ["y"], "fc2", transB=1)],
        [tensor_info("x", [2, 4])], [tensor_info("y", [2, 2])],
        {"W1": rng.normal(size=(3, 4)), "c": c, "W2": rng.normal(size=(2, 3))})
    if not rows_equal:
        with pytest.raises(PathirError, match="spans the file's fixed batch of 2 with a different value per sample"):
            pathir.compile(model)
        return
    cm = pathir.compile(model)
    x = rng.normal(size=(2, 4)).astype(np.float32)
    np.testing.assert_allclose(cm.forward(x.astype(np.float64), backend="numpy"), ort_run(model, x)[0], rtol=1e-5)
    cm.writer.rescale(cm.graph, {"relu": np.log([2.0, 0.5, 4.0])})
    new = cm.to_onnx()
    onnx.checker.check_model(new)
    assert rel(ort_run(new, x)[0], ort_run(model, x)[0]) <= 1e-5


@pytest.mark.parametrize("name,exporter", [("mlp", "legacy-nofold"), ("residual", "legacy"), ("concat", "legacy")])
def test_a_weight_written_a_block_of_rows_at_a_time_is_the_whole_tensors_product(name, exporter, monkeypatch):
    """The lazy per-block write (float64 temporaries of a few rows) gives what the whole-tensor product gives,
    to float32 rounding, however many blocks a tensor is cut into."""
    import pathir.frontends.onnx.writer as writer_module
    from pathir.frontends.core.write_rules import source_factors

    _, _, proto = exported(name, exporter)
    cm = pathir.compile(proto)
    _, scales = _random_rescaling(cm, seed=3)
    w = cm.writer
    monkeypatch.setattr(writer_module, "_BLOCK_ENTRIES", 7)  # blocks of one row or a few
    blocked = 0
    for tensor, sides in source_factors(cm.graph, scales, lazy=True).items():
        sides = sides()
        b = w.bindings[tensor]
        by_rows = w._rescaled_by_rows(tensor, b, sides)
        if by_rows is None:
            continue
        blocked += 1
        whole = w._rescaled(tensor, b, sides).astype(np.float32)
        np.testing.assert_allclose(by_rows, whole, rtol=2 ** -23, atol=0, err_msg=tensor)
    assert blocked >= 2


def test_a_block_that_leaves_float32s_range_is_refused_and_nothing_changes():
    _, _, proto = exported("mlp", "legacy-nofold")
    cm = pathir.compile(proto)
    source = cm.to_onnx().SerializeToString()
    z = np.zeros(len(cm.units))
    z[0] = 200.0  # e^100 on one hidden unit's row: past float32's 3.4e38
    with pytest.raises(PathirError, match="would leave float32's range"):
        cm.commit_rescaling(z)
    assert cm.to_onnx().SerializeToString() == source


@pytest.mark.parametrize("frontend", ["onnx", "torch"])
def test_a_write_back_frees_the_graph_it_replaced(frontend):
    """After a written rescaling the Compiled holds the new graph only: no record (the units) keeps the old
    one's float64 values alive."""
    import gc
    import weakref

    if frontend == "onnx":
        _, _, model = exported("residual", "legacy")
    else:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    cm = pathir.compile(model, input_shape=None if frontend == "onnx" else (4,))
    old = weakref.ref(cm.graph)
    cm.commit_rescaling(np.random.default_rng(0).normal(size=len(cm.units)))
    cm.path_norm(1)
    gc.collect()
    assert old() is None


def _two_gemms(dtype=np.float32, trans_b: int = 1, scales=(1.0, 1.0, 1.0)):
    """Gemm → Relu → Gemm → Relu → Gemm, its weights N(0, 1) times ``scales``."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    W1, W2, W3 = (rng.normal(size=s).astype(dtype) * f for s, f in zip(((3, 3), (3, 3), (3, 2)), scales))
    kind = TensorProto.FLOAT if dtype == np.float32 else TensorProto.DOUBLE
    nodes = [helper.make_node("Gemm", ["x", "W1"], ["h1"], name="g1"), helper.make_node("Relu", ["h1"], ["r1"], name="relu1"),
             helper.make_node("Gemm", ["r1", "W2"], ["h2"], name="g2", transB=trans_b),
             helper.make_node("Relu", ["h2"], ["r2"], name="relu2"), helper.make_node("Gemm", ["r2", "W3"], ["y"], name="g3")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", kind, ["N", 3])],
                          [helper.make_tensor_value_info("y", kind, ["N", 2])],
                          [numpy_helper.from_array(w.astype(dtype), n) for w, n in ((W1, "W1"), (W2, "W2"), (W3, "W3"))])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_write_through_a_compiled_made_by_apply_is_read_by_the_original():
    """cm.apply(pass) shares cm's writer: after it writes, cm reads the model again (it describes what it saves),
    and a snapshot made before the write refuses its queries, as a torch model's watch makes them."""
    from pathir.errors import ModelChanged

    cm = pathir.compile(_two_gemms())
    snapshot = cm.rescaled(np.zeros(len(cm.units)))
    derived = cm.apply(lambda graph: graph)  # keeps every param: it may write back
    derived.commit_rescaling(np.full(len(derived.units), 3.0))
    fresh = pathir.compile(cm.to_onnx())
    for p, q in zip(cm.graph.params(), fresh.graph.params()):
        np.testing.assert_array_equal(p.value, q.value, err_msg=p.name)
    np.testing.assert_allclose(cm.diag_g()["W1"], fresh.diag_g()["W1"], rtol=1e-12)
    with pytest.raises(ModelChanged, match="snapshot"):
        snapshot.path_norm(1)


@pytest.mark.parametrize("trans_b", [0, 1])
def test_a_factor_beyond_float64_whose_product_is_not_is_written_exactly(trans_b):
    """1e-300 moved by e^720 (no float64) is 1e13: each exponential applied in turn, on either layout."""
    cm = pathir.compile(_two_gemms(np.float64, trans_b, (1e-150, 1e-300, 1e150)))
    before = {t.name: numpy_helper.to_array(t) for t in cm.to_onnx().graph.initializer}
    cm.writer.rescale(cm.graph, {"relu1": np.full(3, -360.0), "relu2": np.full(3, 360.0)})
    w2 = {t.name: numpy_helper.to_array(t) for t in cm.to_onnx().graph.initializer}["W2"]
    # relu2's unit grows by e^360 and relu1's shrinks: W2 (entering relu2, leaving relu1) moves by e^720
    np.testing.assert_allclose(w2, before["W2"] * np.exp(360.0) * np.exp(360.0), rtol=1e-12)
    assert np.all(np.isfinite(w2))


def test_a_refused_write_leaves_earlier_snapshots_answering():
    """A write refused before anything was swapped in moves no version: a snapshot made before it still answers."""
    cm = pathir.compile(_two_gemms())
    snapshot = cm.rescaled(np.zeros(len(cm.units)))
    before = snapshot.path_norm(2)
    z = np.zeros(len(cm.units))
    z[0] = 200.0  # past float32's range
    with pytest.raises(PathirError):
        cm.commit_rescaling(z)
    assert snapshot.path_norm(2) == before
