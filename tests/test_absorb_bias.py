"""Bias absorption (DFQ §4.2, docs/equalize.md "Bias absorption"), against definitions: the deviation
the report states is the model's own eager output change, c is max(0, β − 3|γ|) of the batch-norm as
written before, the written model is what a fresh compile reads, a model whose pre-activations stay
above c keeps its function, the activation ranges are the eager ReLU outputs' maxima, and refusals
leave the model bit-identical."""

import copy
import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import pathir
from pathir.app.cli import main
from pathir.errors import PathirError
from pathir.frontends.onnx.writer import OnnxWriter
from pathir.frontends.torch.writer import TorchWriter


class Block(nn.Module):
    """Depthwise conv → BN → ReLU → pointwise conv → BN, a residual add, ReLU."""

    def __init__(self, c, pad):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 3, padding=pad, groups=c, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.pw = nn.Conv2d(c, c, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.pad = pad

    def forward(self, x):
        y = self.bn2(self.pw(torch.relu(self.bn1(self.dw(x)))))
        return torch.relu(y + (x if self.pad else x[:, :, 1:-1, 1:-1]))


class Concat(nn.Module):
    """Two conv → BN → ReLU branches concatenated, then an average pool and a linear layer (through a sum and
    a pooling with no bias of their own, the absorbed constants reach the linear layer's bias)."""

    def __init__(self, c=4):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(2, c, 3), nn.BatchNorm2d(c), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(2, c, 1), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(3, 1))
        self.head = nn.Linear(2 * c * 4, 3)

    def forward(self, x):
        y = torch.cat([self.a(x), self.b(x)], 1)
        return self.head(torch.flatten(nn.functional.avg_pool2d(y, 2), 1))


def _net(c=4, pad=1, pool="max"):
    if pool == "cat":
        return Concat(c).double()
    return nn.Sequential(nn.Conv2d(2, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), Block(c, pad),
                         nn.MaxPool2d(2) if pool == "max" else nn.AvgPool2d(2), nn.Flatten(),
                         nn.Linear(c * (3 if pad else 2) ** 2, 3)).double()


def _trained_bn(model, seed, beta=2.0, gamma=0.5):
    """β and γ of every batch-norm drawn so that c = max(0, β − 3|γ|) is positive on some channels."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(gamma * torch.exp(torch.randn(m.weight.shape, generator=g, dtype=torch.float64)))
                m.bias.copy_(beta * torch.rand(m.bias.shape, generator=g, dtype=torch.float64))
                m.running_mean.copy_(0.2 * torch.randn(m.running_mean.shape, generator=g, dtype=torch.float64))
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g, dtype=torch.float64) + 0.5)
    return model.eval()


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(model, state):
    return all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def _relu_maxima(model, x):
    """max of every ReLU's output (the stem's and the block's first), by forward hooks."""
    out = {}
    hooks = [model[2].register_forward_hook(lambda m, i, o: out.__setitem__("stem", float(o.detach().max())))]
    block = model[3]
    hooks.append(block.bn1.register_forward_hook(lambda m, i, o: out.__setitem__("dw", float(torch.relu(o).detach().max()))))
    model(x)
    for h in hooks:
        h.remove()
    return out


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 2**16), st.sampled_from([0, 1]), st.sampled_from(["max", "avg", "cat"]), st.booleans())
def test_reported_deviation_is_the_models_own_output_change(seed, pad, pool, given_inputs):
    torch.manual_seed(seed)
    model = _trained_bn(_net(pad=pad, pool=pool), seed)
    x = torch.randn(12, 2, 6, 6, dtype=torch.float64)
    probe = x if given_inputs else torch.as_tensor(np.random.default_rng(0).standard_normal((32, 2, 6, 6)))
    before = model(probe).detach()
    stem = model.a[1] if pool == "cat" else model[1]
    stem_gamma, stem_beta = stem.weight.detach().clone(), stem.bias.detach().clone()
    report = pathir.equalize(model, input_shape=(2, 6, 6), bits=6, inputs=x if given_inputs else None, absorb_bias=True)
    after = model(probe).detach()
    a = report.absorption
    change = float((after - before).abs().max())
    assert a.max_abs_deviation == pytest.approx(change, rel=1e-9, abs=1e-12)
    assert a.rel_deviation == pytest.approx(change / float(before.abs().max()), rel=1e-9, abs=1e-12)
    # the stem's ReLU reads only its batch-norm and nothing shifts into it: β/γ became min(β/γ, 3 sign γ) there
    # (the rescaling multiplies β and γ alike)
    ratio_before = (stem_beta / stem_gamma).numpy()
    ratio_after = (stem.bias / stem.weight).detach().numpy()
    c = np.maximum(0.0, stem_beta.numpy() - 3 * np.abs(stem_gamma.numpy()))
    expected = np.where(c > 0, (stem_beta.numpy() - c) / stem_gamma.numpy(), ratio_before)
    np.testing.assert_allclose(ratio_after, expected, rtol=1e-9, atol=1e-12)
    # what was written is what a fresh compile of the model reads, and the Compiled follows it
    cm = pathir.compile(model, input_shape=(2, 6, 6))
    fresh = pathir.compile(model, input_shape=(2, 6, 6))
    for p, q in zip(cm.graph.params(), fresh.graph.params()):
        np.testing.assert_allclose(p.value, q.value, rtol=1e-12, atol=1e-12)


class _ChannelsLast(nn.Module):
    """conv -> batch-norm -> (permute to channels-last) -> ReLU -> Linear over the channels: the ReLU reads the
    batch-norm through the permutation (``after=True``) or before it."""

    def __init__(self, after: bool):
        super().__init__()
        self.after = after
        self.c, self.bn, self.l = nn.Conv2d(2, 6, 3, bias=False), nn.BatchNorm2d(6), nn.Linear(6, 3)

    def forward(self, x):
        h = self.bn(self.c(x))
        return self.l(torch.relu(h.permute(0, 2, 3, 1)) if self.after else torch.relu(h).permute(0, 2, 3, 1))


@pytest.mark.parametrize("after", [False, True], ids=["relu-then-permute", "permute-then-relu"])
def test_a_batch_norm_relu_read_through_a_permutation_is_absorbed_as_the_model_computes(after):
    """A ReLU of a channels-last view of a batch-norm's output (built in the batch-norm's layout, reading it
    alone) was not found; it is absorbed like the same ReLU before the permute, and the reported change is the
    model's own (clip review)."""
    torch.manual_seed(0)
    model = _ChannelsLast(after).double().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
        model.bn.bias.uniform_(-5, 5)
        model.bn.weight.uniform_(0.2, 1)
    x = torch.randn(16, 2, 4, 5, dtype=torch.float64)
    before = model(x).detach()
    report = pathir.equalize(model, input_shape=(2, 4, 5), bits=6, inputs=x, absorb_bias=True)
    a = report.absorption
    assert a.found == 1 and a.channels > 0
    change = float((model(x).detach() - before).abs().max())
    assert a.max_abs_deviation == pytest.approx(change, rel=1e-9, abs=1e-12)


def test_activation_ranges_are_the_eager_relu_maxima():
    torch.manual_seed(1)
    model = _trained_bn(_net(), 1, beta=4.0, gamma=0.3)
    x = torch.randn(16, 2, 6, 6, dtype=torch.float64)
    twin = copy.deepcopy(model)
    cm = pathir.compile(model, input_shape=(2, 6, 6))
    report = cm.equalize(bits=6, inputs=x, absorb_bias=True)
    after = _relu_maxima(model, x)
    ranges = report.absorption.activation_ranges
    assert len(ranges) == 2  # the stem's ReLU and the depthwise one: the block's last ReLU reads the residual too
    # the equalization rescales each channel, so a node's range is compared in the rescaled model: the eager maxima
    # of the model before absorption are those of the equalized one without it, computed here by a second model
    twin_report = pathir.equalize(twin, input_shape=(2, 6, 6), bits=6, inputs=x)
    np.testing.assert_allclose(twin_report.z, report.z, rtol=0, atol=0)
    twin_max = _relu_maxima(twin, x)
    np.testing.assert_allclose(sorted(r.after for r in ranges), sorted([after["stem"], after["dw"]]), rtol=1e-9)
    np.testing.assert_allclose(sorted(r.before for r in ranges), sorted([twin_max["stem"], twin_max["dw"]]), rtol=1e-9)
    assert sum(r.after for r in ranges) < sum(r.before for r in ranges)


def _above_c_model():
    """Linear → BN → ReLU → Linear with β = 5, γ = 0.1 and a running variance so large that |x̂| < 3 on
    inputs in [−1, 1]: every pre-activation stays above c = β − 3γ."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2)).double()
    with torch.no_grad():
        model[0].weight.uniform_(-0.5, 0.5)
        model[0].bias.zero_()
        model[1].weight.fill_(0.1)
        model[1].bias.fill_(5.0)
        model[1].running_var.fill_(4.0)  # |W x| ≤ 2 on [−1, 1]⁴: |x̂| ≤ 1
    return model.eval()


def test_pre_activations_above_c_keep_the_function():
    model = _above_c_model()
    x = torch.rand(64, 4, dtype=torch.float64) * 2 - 1
    before = model(x).detach()
    report = pathir.equalize(model, input_shape=(4,), inputs=x, absorb_bias=True)
    assert report.absorption.channels == 6
    np.testing.assert_allclose(model(x).detach().numpy(), before.numpy(), rtol=1e-12, atol=1e-12)
    assert report.absorption.max_abs_deviation < 1e-12
    r = report.absorption.activation_ranges[0]
    assert r.after < 0.2 * r.before  # the ReLU's outputs sat near β = 5: after absorption near 3γ


def test_off_by_default():
    model = _above_c_model()
    report = pathir.equalize(model, input_shape=(4,))
    assert report.absorption is None
    ratio = (model[1].bias / model[1].weight).detach()
    np.testing.assert_allclose(ratio.numpy(), 50.0, rtol=1e-12)


def test_a_consumer_without_bias_is_refused_and_the_model_untouched():
    model = _above_c_model()
    model[3] = nn.Linear(6, 2, bias=False).double()
    state = _state(model)
    with pytest.raises(PathirError, match="no bias") as err:
        pathir.equalize(model, input_shape=(4,), absorb_bias=True)
    assert "3" in str(err.value)
    assert _same(model, state)


def test_a_clipped_relu_reader_is_refused_and_relu6_relu_absorbs():
    model = _above_c_model()
    model[2] = nn.ReLU6()
    state = _state(model)
    with pytest.raises(PathirError, match="clipped ReLU"):
        pathir.equalize(model, input_shape=(4,), absorb_bias=True)
    assert _same(model, state) and isinstance(model[2], nn.ReLU6)
    report = pathir.equalize(model, input_shape=(4,), absorb_bias=True, relu6="relu")
    assert report.absorption.channels == 6 and isinstance(model[2], nn.ReLU)


def test_a_map_whose_image_of_a_constant_varies_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3), nn.ReLU(), nn.AvgPool2d(3, 1, padding=1),
                          nn.Flatten(), nn.Linear(3 * 4 * 4, 2)).double()
    _trained_bn(model, 0, beta=4.0, gamma=0.3)  # zero padding counted in the average: the borders see less of c
    state = _state(model)
    with pytest.raises(PathirError, match="not constant per channel"):
        pathir.equalize(model, input_shape=(2, 4, 4), absorb_bias=True)
    assert _same(model, state)


def test_a_failed_bias_write_restores_the_rescaled_model(monkeypatch):
    model = _trained_bn(_net(), 3, beta=4.0, gamma=0.3)
    state = _state(model)

    def broken(self, graph, shifts):
        with torch.no_grad():
            self.model[1].bias.add_(1.0)
        raise PathirError("a write failed")

    monkeypatch.setattr(TorchWriter, "shift_biases", broken)
    with pytest.raises(PathirError, match="a write failed"):
        pathir.equalize(model, input_shape=(2, 6, 6), absorb_bias=True)
    assert _same(model, state)


def _onnx(model, x, fold: bool):
    """``model`` exported in float32 with its batch-norms kept as BatchNormalization nodes (or folded)."""
    f = io.BytesIO()
    torch.onnx.export(model.float(), x[:1].float(), f, dynamo=False, do_constant_folding=fold, input_names=["x"],
                      dynamic_axes={"x": {0: "N"}})
    return onnx.load_from_string(f.getvalue())


def _ort(model, x):
    return ort.InferenceSession(model.SerializeToString()).run(None, {"x": x.float().numpy()})[0].astype(np.float64)


@pytest.mark.parametrize("pool", ["max", "cat"])
def test_onnx_absorbs_into_its_initializers_as_torch_does(pool):
    model = _trained_bn(_net(pad=1, pool=pool), 3, beta=4.0, gamma=0.3)
    x = torch.randn(8, 2, 6, 6, dtype=torch.float64)
    source = _onnx(copy.deepcopy(model), x, fold=False)
    before = source.SerializeToString()
    assert "BatchNormalization" in {n.op_type for n in source.graph.node}
    cm = pathir.compile(source)
    report = cm.equalize(inputs=x.numpy(), absorb_bias=True)
    assert report.absorption.channels > 0
    assert source.SerializeToString() == before  # the source proto is never written
    y0, y1 = _ort(source, x), _ort(cm.to_onnx(), x)
    # onnxruntime's own output change is the one the report states (float32 evaluation)
    assert abs(np.abs(y1 - y0).max() - report.absorption.max_abs_deviation) <= 1e-4 * np.abs(y0).max()
    # an absorbed model's function does not depend on the rescaling: it is the torch model absorbed
    pathir.equalize(model, input_shape=(2, 6, 6), inputs=x, absorb_bias=True)
    with torch.no_grad():
        assert np.abs(y1 - model(x).numpy()).max() <= 1e-4 * np.abs(y0).max()


def test_onnx_with_folded_batch_norms_has_nothing_to_absorb():
    model = _trained_bn(_net(), 3, beta=4.0, gamma=0.3)
    x = torch.randn(4, 2, 6, 6, dtype=torch.float64)
    cm = pathir.compile(_onnx(model, x, fold=True))
    report = cm.equalize(absorb_bias=True)
    assert report.absorption.channels == 0 and "nothing to absorb" in str(report)


def test_unfolded_batch_norms_with_no_channel_to_absorb_say_so():
    # batch-norm ReLUs found (unfolded), but β ≤ 3|γ| on every channel: c = 0, and the note says why (it blamed
    # folding, which had not happened)
    model = _trained_bn(_net(), 3, beta=0.0, gamma=0.3)
    report = pathir.equalize(model, input_shape=(2, 6, 6), absorb_bias=True, write_back=False)
    assert report.absorption.channels == 0 and report.absorption.found > 0
    text = str(report)
    assert f"of {report.absorption.found} found" in text and "has β > 3|γ|" in text and "folded" not in text


def test_a_failed_onnx_bias_write_restores_the_model(monkeypatch):
    model = _trained_bn(_net(), 3, beta=4.0, gamma=0.3)
    x = torch.randn(4, 2, 6, 6, dtype=torch.float64)
    cm = pathir.compile(_onnx(model, x, fold=False))
    before, graph = cm.to_onnx().SerializeToString(), cm.graph

    def broken(self, graph, shifts):
        self._commit({name: b.value * 0 for name, b in self.bindings.items() if b.kind == "bias"})
        raise PathirError("a write failed")

    monkeypatch.setattr(OnnxWriter, "shift_biases", broken)
    with pytest.raises(PathirError, match="a write failed"):
        cm.equalize(absorb_bias=True)
    assert cm.to_onnx().SerializeToString() == before and cm.graph is graph


def test_cli_absorb_bias(tmp_path, capsys, monkeypatch):
    (tmp_path / "absorb_models.py").write_text(
        "import torch.nn as nn\n"
        "def net():\n"
        "    m = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))\n"
        "    m[1].bias.data.fill_(5.0); m[1].weight.data.fill_(0.1)\n"
        "    return m.eval()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "eq.pt"
    assert main(["equalize", "absorb_models:net", "--input-shape", "4", "--absorb-bias", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "bias absorption: 6 channels" in printed
    state = torch.load(out)
    np.testing.assert_allclose((state["1.bias"] / state["1.weight"]).numpy(), 3.0, rtol=1e-6)


def test_an_absorbed_relu_that_is_the_output_is_refused():
    model = nn.Sequential(*list(_above_c_model())[:3])  # Linear, BatchNorm, ReLU: the ReLU is the output
    x = torch.rand(32, 4, dtype=torch.float64) * 2 - 1
    state = _state(model)
    with pytest.raises(PathirError, match="is an output of the model"):
        pathir.equalize(model, input_shape=(4,), inputs=x, absorb_bias=True)
    assert _same(model, state)


def test_the_after_bound_and_change_describe_the_written_model_absorbed_biases_included():
    """The bound and observed change 'after' were those of the rescaled graph before absorption: the model
    written differs. Now: the written model against its own per-tensor quantization, recomputed here."""
    from pathir.equalization.tensors import quantize_graph

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2)).double().eval()
    with torch.no_grad():
        net[1].bias.fill_(2.0), net[1].weight.fill_(0.2), net[1].running_var.fill_(1e-2)
    x = torch.rand(64, 4, dtype=torch.float64) * 2 - 1
    rep = pathir.equalize(net, input_shape=(4,), inputs=x, absorb_bias=True, certify=True, bits=8, progress=False)
    written = pathir.compile(net, input_shape=(4,))
    with torch.no_grad():
        y = net(x).numpy()
    yq = np.asarray(pathir.compile(quantize_graph(written.graph, 8)).forward(x.numpy(), backend="numpy"))
    change = float(np.abs(y - yq).sum(1).max())
    assert rep.observed_after == pytest.approx(change, rel=1e-9)
    assert rep.observed_after <= rep.bound_after
    assert rep.input_scale == pytest.approx(max(1.0, float(x.abs().max())))
    assert "for inputs with ‖x‖∞ ≤" in str(rep)


def test_inputs_with_nan_or_inf_are_refused_by_equalize():
    """A NaN made max(1, ‖x‖∞) read 1: a 'certified' bound 50 times too small, with no error."""
    for bad in (float("nan"), float("inf")):
        net = _net()
        state = _state(net)
        x = torch.randn(4, 2, 6, 6, dtype=torch.float64) * 50
        x[1, 0, 0, 0] = bad
        with pytest.raises(pathir.InputShapeError, match="NaN or infinite"):
            pathir.equalize(net, input_shape=(2, 6, 6), inputs=x, certify=True, progress=False)
        assert _same(net, state)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_a_padded_conv_on_a_map_smaller_than_its_kernel_absorbs_its_interior_value(size):
    """At 2×2 under a 3×3 zero-padded conv every output position is on the border: the interior value,
    the unpadded conv's, was taken on an empty output (a raw ValueError; resnet18's last stage at 64×64)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 2, 3, padding=1)).double()
    _trained_bn(model, 0, beta=5.0, gamma=0.5)
    c = np.maximum(0.0, model[1].bias.detach().numpy() - 3 * np.abs(model[1].weight.detach().numpy()))
    assert np.any(c > 0)
    x = torch.randn(16, 3, size, size, dtype=torch.float64)
    before, bias = model(x).detach(), model[3].bias.detach().clone()
    report = pathir.equalize(model, input_shape=(3, size, size), bits=8, inputs=x, absorb_bias=True, max_log_scale=0.0)
    # by definition: the next bias takes W summed over the kernel times c (the image of c at an interior position);
    # on a 1×1 map only the centre tap ever sees c: the image is constant, and exact
    W = model[3].weight.detach().numpy()
    interior = np.einsum("oi,i->o", W[:, :, 1, 1], c) if size == 1 else np.einsum("oikl,i->o", W, c)
    np.testing.assert_allclose(model[3].bias.detach().numpy() - bias.numpy(), interior, rtol=1e-9, atol=1e-12)
    assert report.absorption.max_abs_deviation == pytest.approx(float((model(x).detach() - before).abs().max()),
                                                               rel=1e-9, abs=1e-12)


def test_a_permuted_absorbed_relu_that_is_the_output_is_refused_as_such():
    """conv -> batch-norm -> permute -> ReLU returned: refused because the output would stay lowered, as the same
    ReLU returned without the permute is (it blamed the permutation's 'not constant per channel'; absorb review)."""

    class Out(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.bn = nn.Conv2d(2, 6, 3, bias=False), nn.BatchNorm2d(6)

        def forward(self, x):
            return torch.relu(self.bn(self.c(x)).permute(0, 2, 3, 1))

    torch.manual_seed(0)
    model = Out().double().eval()
    with torch.no_grad():
        model.bn.bias.uniform_(1, 5)
        model.bn.weight.uniform_(0.2, 1)
    state = _state(model)
    with pytest.raises(PathirError, match="output .* whose output absorption lowers.* no later bias to give it back"):
        pathir.equalize(model, input_shape=(2, 4, 5), absorb_bias=True)
    assert _same(model, state)


def test_onnx_absorbs_a_batch_norm_relu_read_through_a_transpose():
    """The channels-last batch-norm ReLU of an ONNX file (BatchNormalization, Transpose, Relu): absorbed into the
    BatchNormalization's bias, the change onnxruntime measures the one reported."""
    torch.manual_seed(0)
    model = _ChannelsLast(True).eval()
    with torch.no_grad():
        model.bn.running_var.uniform_(0.5, 2)
        model.bn.bias.uniform_(1, 5)
        model.bn.weight.uniform_(0.2, 1)
    x = torch.randn(4, 2, 4, 5)
    cm = pathir.compile(_onnx(model, x, fold=False))
    report = cm.equalize(absorb_bias=True, inputs=x.numpy())
    assert report.absorption.found == 1 and report.absorption.channels > 0
    y0, y1 = _ort(_onnx(model, x, fold=False), x), _ort(cm.to_onnx(), x)
    assert abs(np.abs(y1 - y0).max() - report.absorption.max_abs_deviation) <= 1e-4 * np.abs(y0).max()
