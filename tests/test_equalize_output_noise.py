"""The output-noise objective (docs/math.md §12, docs/equalize.md): its weights F_ii = Σ_x ‖∂R_θ(x)/∂θ_i‖²
against the definition, per sample and per output through the torch model's own autograd (not pathir's
walk), their rescaling law, and the objective end to end (function kept, refusals untouched, ONNX, CLI)."""

import json
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

import pathir
from pathir.app.cli import main
from pathir.equalization.sensitivity import output_sensitivity
from pathir.equalization.tensors import quantized_params
from pathir.errors import PathirError
from pathir.ir import Role


class Residual(nn.Module):
    """conv → ReLU → max-pool, a residual pair of convs, then a linear head with ``outputs`` outputs."""

    def __init__(self, outputs: int):
        super().__init__()
        self.stem, self.pool = nn.Conv2d(2, 4, 3, padding=1), nn.MaxPool2d(2)
        self.a, self.b = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1)
        self.head = nn.Linear(4 * 3 * 3, outputs)

    def forward(self, x):
        h = self.pool(torch.relu(self.stem(x)))
        h = torch.relu(h + self.b(torch.relu(self.a(h))))
        return self.head(h.flatten(1))


def _model(outputs: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Residual(outputs).double().eval()


def _definition(model: nn.Module, x: torch.Tensor) -> dict[str, np.ndarray]:
    """{weight name: Σ_b Σ_k (∂y_k(x_b)/∂W)²}, one backward pass per sample and output of the model itself."""
    weights = {n: p for n, p in model.named_parameters() if n.endswith("weight")}
    total = {n: torch.zeros_like(p) for n, p in weights.items()}
    for b in range(x.shape[0]):
        y = model(x[b:b + 1]).reshape(-1)
        for k in range(y.numel()):
            grads = torch.autograd.grad(y[k], list(weights.values()), retain_graph=True)
            for n, g in zip(weights, grads):
                total[n] += g * g
    return {n: t.numpy() for n, t in total.items()}


def _estimate(cm, x, **kwargs) -> dict[str, np.ndarray]:
    """{weight name: the estimate}, each in its tensor's own layout (a transposed convolution's kernel)."""
    parts = output_sensitivity(cm.graph, x, **kwargs)
    return {p.source_name: _as_source(p, parts[id(p)][0] * np.exp(parts[id(p)][1])) for p in quantized_params(cm.graph)}


def _as_source(p, a: np.ndarray) -> np.ndarray:
    (ref,) = [r for r in p.sources if r.role is Role.VALUE]
    return np.asarray(ref.to_source(a))


def test_one_output_one_sample_per_walk_is_the_definition_exactly():
    """With one output and one sample per walk, every draw is ±g: the estimate is F itself, for any seed."""
    model = _model(1)
    x = torch.randn(5, 2, 6, 6, dtype=torch.float64)
    cm = pathir.compile(model, input_shape=(2, 6, 6))
    want = _definition(model, x)
    for seed in (0, 1):
        got = _estimate(cm, x.numpy(), chunk=1, draws=1, seed=seed)
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-14 * want[name].max())


def test_many_outputs_and_samples_average_to_the_definition():
    """The Rademacher estimate is unbiased: many draws land within a few percent of the definition."""
    model = _model(3, seed=1)
    x = torch.randn(6, 2, 6, 6, dtype=torch.float64)
    cm = pathir.compile(model, input_shape=(2, 6, 6))
    want = _definition(model, x)
    got = _estimate(cm, x.numpy(), draws=800, chunk=3)
    for name in want:
        scale = want[name].max()
        assert np.abs(got[name] - want[name]).max() <= 0.1 * scale, name
        assert abs(got[name].sum() / want[name].sum() - 1) < 0.05, name


def test_weights_move_as_g_under_a_rescaling():
    """θ_i → θ_i e^{(z_e − z_l)/2} keeps the function and moves F_ii by e^{z_l − z_e}: hidden unit h of a
    two-layer net grown by λ multiplies F of its incoming row by 1/λ² and of its outgoing column by λ²."""
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 1)).double()
    x = torch.randn(7, 3, dtype=torch.float64)
    before = _estimate(pathir.compile(net, input_shape=(3,)), x.numpy(), chunk=1, draws=1)
    lam = torch.tensor([1.0, 4.0, 0.25, 2.0, 1.0], dtype=torch.float64)
    with torch.no_grad():
        net[0].weight.mul_(lam[:, None])
        net[0].bias.mul_(lam)
        net[2].weight.div_(lam[None, :])
    after = _estimate(pathir.compile(net, input_shape=(3,)), x.numpy(), chunk=1, draws=1)
    l2 = (lam ** 2).numpy()
    np.testing.assert_allclose(after["0.weight"], before["0.weight"] / l2[:, None], rtol=1e-9)
    np.testing.assert_allclose(after["2.weight"], before["2.weight"] * l2[None, :], rtol=1e-9)


def test_the_estimate_reads_the_weights_and_writes_nothing():
    model = _model(2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    cm = pathir.compile(model, input_shape=(2, 6, 6))
    values = [p.value.copy() for p in cm.graph.params()]
    _estimate(cm, np.random.default_rng(0).normal(size=(4, 2, 6, 6)))
    assert all(np.array_equal(a, p.value) for a, p in zip(values, cm.graph.params()))
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert cm.path_norm(1) > 0  # the Compiled's own backend still walks the weights as they are


def _spread(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                m.weight.mul_(torch.exp(2 * torch.randn(m.weight.shape[0], generator=g)).reshape(-1, *[1] * (m.weight.dim() - 1)).to(m.weight))
    return model


def test_equalize_with_output_noise_keeps_the_function_and_lowers_its_objective():
    model = _spread(_model(3)).float()
    x = torch.randn(16, 2, 6, 6)
    before = model(x)
    report = pathir.equalize(model, input_shape=(2, 6, 6), bits=6, objective="output-noise", inputs=x.numpy())
    assert report.objective == "output-noise" and report.written
    assert report.objective_after < report.objective_before
    assert report.observed_after is not None
    torch.testing.assert_close(model(x), before, rtol=1e-4, atol=1e-4 * float(before.abs().max()))


def test_output_noise_without_inputs_is_refused_and_nothing_changes():
    model = _spread(_model(2))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PathirError, match="pass inputs="):
        pathir.equalize(model, input_shape=(2, 6, 6), objective="output-noise")
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_an_onnx_file_equalized_on_its_outputs_matches_onnxruntime(tmp_path):
    import onnxruntime as ort

    model = _spread(_model(3)).float()
    path, out = tmp_path / "m.onnx", tmp_path / "eq.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(1, 2, 6, 6),), str(path), dynamo=False, input_names=["x"],
                          dynamic_axes={"x": {0: "batch"}})
    cm = pathir.compile(str(path))
    x = np.random.default_rng(0).normal(size=(8, 2, 6, 6)).astype(np.float32)
    assert cm.equalize(bits=6, objective="output-noise", inputs=x).written
    cm.save(str(out))
    a = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    b = ort.InferenceSession(str(out)).run(None, {"x": x})[0]
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * float(np.abs(a).max()))


def test_cli_reads_the_calibration_batch(tmp_path, capsys, monkeypatch):
    (tmp_path / "eq_cal.py").write_text(
        "import torch\nfrom torch import nn\n\n\ndef small():\n    torch.manual_seed(0)\n"
        "    m = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))\n"
        "    with torch.no_grad():\n        m[0].weight.mul_(torch.logspace(-2, 1, 6).reshape(6, 1))\n"
        "    return m.eval()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "cal.npy"
    np.save(data, np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32))
    assert main(["equalize", "eq_cal:small", "--input-shape", "4", "--objective", "output-noise"]) == 2
    assert "pass --inputs X.npy" in capsys.readouterr().err
    out = tmp_path / "eq.pt"
    code = main(["equalize", "eq_cal:small", "--input-shape", "4", "--objective", "output-noise", "--inputs", str(data),
                 "-o", str(out), "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert code == 0 and printed["objective"] == "output-noise" and printed["written"]
    assert printed["observed_before"] is not None and printed["objective_after"] < printed["objective_before"]
    import eq_cal

    fresh = eq_cal.small()
    x = torch.randn(7, 4)
    before = fresh(x)
    fresh.load_state_dict(torch.load(out))
    torch.testing.assert_close(fresh(x), before, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_callers_no_grad_or_inference_mode_changes_nothing(mode):
    model = _model(2)
    cm = pathir.compile(model, input_shape=(2, 6, 6))
    x = np.random.default_rng(1).normal(size=(3, 2, 6, 6))
    want = _estimate(cm, x)
    with mode():
        got = _estimate(cm, x)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_an_empty_calibration_batch_is_refused():
    cm = pathir.compile(_model(2), input_shape=(2, 6, 6))
    with pytest.raises(PathirError):
        cm.equalize(objective="output-noise", inputs=np.zeros((0, 2, 6, 6)), write_back=False)


def test_a_batch_on_which_no_weight_moves_an_output_is_refused_and_nothing_changes():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    with torch.no_grad():
        net[2].bias.fill_(-100.0)  # layer 2's ReLUs off on every sample
    state = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(PathirError, match="no quantized weight moves any output"):
        pathir.equalize(net, input_shape=(4,), objective="output-noise", inputs=torch.randn(6, 4))
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())


def test_cli_reads_one_array_per_input_of_a_two_input_model(tmp_path, capsys):
    import onnxruntime as ort

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.o = nn.Linear(4, 5), nn.Linear(3, 5), nn.Linear(5, 2)
            with torch.no_grad():
                self.a.weight.mul_(torch.logspace(-2, 1, 5).reshape(5, 1))

        def forward(self, x, z):
            return self.o(torch.relu(self.a(x)) + torch.relu(self.b(z)))

    torch.manual_seed(0)
    path, out = tmp_path / "two.onnx", tmp_path / "eq.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Two().eval(), (torch.randn(1, 4), torch.randn(1, 3)), str(path), dynamo=False,
                          input_names=["x", "z"], dynamic_axes={"x": {0: "b"}, "z": {0: "b"}})
    rng = np.random.default_rng(0)
    one, keyed = tmp_path / "x.npy", tmp_path / "xz.npz"
    np.save(one, rng.normal(size=(8, 4)).astype(np.float32))
    feeds = {"x": rng.normal(size=(8, 4)).astype(np.float32), "z": rng.normal(size=(8, 3)).astype(np.float32)}
    np.savez(keyed, **feeds)
    assert main(["equalize", str(path), "--objective", "output-noise", "--inputs", str(one), "-o", str(out)]) == 2
    assert "keyed by input name" in capsys.readouterr().err
    assert main(["equalize", str(path), "--objective", "output-noise", "--inputs", str(keyed), "-o", str(out)]) == 0
    a = ort.InferenceSession(str(path)).run(None, feeds)[0]
    b = ort.InferenceSession(str(out)).run(None, feeds)[0]
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * float(np.abs(a).max()))


class _TiedMLP(nn.Module):
    """Dense layers only, one of them used twice (its gradient sums two uses: no outer product of one)."""

    def __init__(self):
        super().__init__()
        self.a, self.shared, self.head = nn.Linear(3, 5), nn.Linear(5, 5), nn.Linear(5, 1)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = torch.relu(self.shared(h))
        return self.head(torch.relu(self.shared(h)))


@pytest.mark.parametrize("tied", [False, True])
def test_dense_layers_one_output_is_the_definition_exactly(tied):
    """Dense layers used once take the outer-product pass (δ² ⊗ a² per sample), a tied one the per-sample weight
    pass: with one output both are exact for any seed and any number of samples per walk."""
    torch.manual_seed(3)
    model = (_TiedMLP() if tied else nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 4), nn.ReLU(),
                                                    nn.Linear(4, 1))).double()
    x = torch.randn(9, 3, dtype=torch.float64)
    cm = pathir.compile(model, input_shape=(3,))
    want = _definition(model, x)
    got = _estimate(cm, x.numpy(), chunk=1, draws=1, seed=5)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-14 * want[name].max(), err_msg=name)


class _Convs(nn.Module):
    """Convolutions of every kind the per-sample pass meets: a strided one, a depthwise one, a grouped one with
    dilation, a 1-d one, a transposed one; a residual add reads one of them twice."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.dw = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.g = nn.Conv2d(4, 4, 3, padding=2, dilation=2, groups=2)
        self.up = nn.ConvTranspose2d(4, 2, 2, stride=2)
        self.line = nn.Conv1d(2, 3, 3)
        self.head = nn.Linear(3 * 62, 1)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = torch.relu(h + self.g(torch.relu(self.dw(h))))
        h = torch.relu(self.up(h))
        return self.head(torch.relu(self.line(h.flatten(2))).flatten(1))


def test_convolutions_one_output_are_the_definition_exactly_with_many_samples_per_walk():
    """Each convolution used once takes the per-sample pass (its samples' weight-gradients formed from one
    backward of the whole walk, squared one by one): with one output it is exact for any seed and any number of
    samples per walk, so no cross term between samples enters."""
    torch.manual_seed(4)
    model = _Convs().double().eval()
    x = torch.randn(7, 2, 8, 8, dtype=torch.float64)
    cm = pathir.compile(model, input_shape=(2, 8, 8))
    want = _definition(model, x)
    for seed in (0, 3):
        got = _estimate(cm, x.numpy(), chunk=7, draws=1, seed=seed)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-14 * want[name].max(), err_msg=name)
