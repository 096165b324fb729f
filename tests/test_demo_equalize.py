"""The equalization part of ``pathir demo`` (pathir/app/demo_equalize.py), against definitions: batch-norm
folding keeps the model's own forward, every equalized float model keeps the float predictions, and each
quantized accuracy is what an independent per-tensor quantizer (numpy, written here) gives."""

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from pathir.app import demo_equalize as de
from pathir.app.demo import _digits


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    torch.set_num_threads(1)
    data = _digits()
    out = tmp_path_factory.mktemp("demo_eq")
    return data, de.part_equalize(data, str(out), epochs=1), out


def _numpy_quantized(model: nn.Module, bits: int) -> nn.Module:
    """Every Conv2d / Linear weight w replaced by Δ·round(w/Δ), Δ = max|w| / (2^(bits−1) − 1), in numpy."""
    model = copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            w = m.weight.detach().numpy().astype(np.float64)
            step = np.abs(w).max() / (2 ** (bits - 1) - 1)
            q = np.round(w / step) * step if step > 0 else w
            m.weight.data = torch.from_numpy(q.astype(np.float32))
    return model


def _predictions(model, X):
    with torch.no_grad():
        return model(torch.from_numpy(X).reshape(-1, 1, 8, 8)).argmax(1).numpy()


def test_every_equalized_float_model_keeps_the_float_accuracy(run):
    (_, X_test, _, y_test), result, out = run
    models, table = result["models"], result["table"]
    assert set(models) >= {"none", "pathir", "pathir-range"}
    reference = _predictions(models["none"], X_test)
    for side, model in models.items():
        assert np.array_equal(_predictions(model, X_test), reference), side
        assert table[side]["float"] == table["none"]["float"] == float((reference == y_test).mean())
    assert (out / de.EQUALIZE_PNG).stat().st_size > 0
    assert ("brevitas" in models) != any("Brevitas skipped" in n for n in result["notes"])


def test_quantized_accuracies_are_an_independent_per_tensor_quantizers(run):
    (_, X_test, _, y_test), result, _ = run
    for side, model in result["models"].items():
        for bits in result["bits"]:
            accuracy = float((_predictions(_numpy_quantized(model, bits), X_test) == y_test).mean())
            assert result["table"][side][f"W{bits}"] == accuracy, (side, bits)


def test_folding_keeps_the_models_forward():
    torch.manual_seed(0)
    model = de.SeparableNet(channels=6)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.2, 3.0)
                m.bias.uniform_(-1, 1)
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.1, 4.0)
    model = model.double().eval()
    x = torch.randn(8, 1, 8, 8, dtype=torch.float64)
    folded = de.fold_batch_norms(model)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in folded.modules())
    torch.testing.assert_close(folded(x), model(x), rtol=1e-10, atol=1e-10)


@settings(max_examples=30, deadline=None)
@given(arrays(np.float32, (3, 4), elements=st.floats(-10, 10, width=32)), st.integers(2, 8))
def test_quantize_weights_is_a_per_tensor_grid(w, bits):
    layer = nn.Linear(4, 3)
    layer.weight.data = torch.from_numpy(w.copy())
    q = de.quantize_weights(nn.Sequential(layer), bits)[0].weight.detach().numpy().astype(np.float64)
    levels = 2 ** (bits - 1) - 1
    step = float(np.abs(w.astype(np.float64)).max()) / levels
    if step == 0:
        assert not np.any(q)
        return
    k = q / step
    assert np.allclose(k, np.round(k), atol=1e-3) and np.abs(np.round(k)).max() <= levels
    assert np.abs(q - w).max() <= step / 2 * (1 + 1e-5) + 1e-6
