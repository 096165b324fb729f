"""benchmarks/bench_equalize.py: its folding and quantization model, its clean skip without Brevitas (and
without pathir.equalize), and one tiny Brevitas run where Brevitas is installed."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_equalize as bench  # noqa: E402
import equalize_models as em  # noqa: E402

TINY = ["--models", "resnet18", "--size", "32", "--bits", "8", "--batch", "2", "--calib-batches", "1",
        "--threads", "1", "--eq-iters", "2"]


@pytest.fixture(scope="module")
def resnet():
    model = em.build("resnet18", size=32, calib_batches=1)
    return model, em.eval_inputs(32, 2)


def test_batch_norms_look_trained_and_fold_exactly(resnet):
    model, x = resnet
    gammas = torch.cat([m.weight for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)])
    assert gammas.max() / gammas.min() > 20  # log-normal spread, not the init's ones
    folded, n, left = em.fold_bn(model)
    assert (n, left) == (20, 0) and not any(isinstance(m, torch.nn.BatchNorm2d) for m in folded.modules())
    with torch.no_grad():
        assert em.relative_error(model(x), folded(x)) < 1e-5
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())  # the input is left as it was


def test_quantization_model():
    w = torch.tensor([[1.0, -0.5, 0.26], [0.01, 0.02, -0.03]])
    q = em._quantize(w, 3, False)  # Δ = 1/3: every entry a multiple of it
    assert torch.allclose(q / (1 / 3), torch.round(q / (1 / 3))) and q[1].abs().max() == 0
    qc = em._quantize(w, 3, True)  # one Δ per row: the small row survives
    assert torch.allclose(qc[1], w[1], atol=1e-7)  # Δ = 0.01: exact
    lin = torch.nn.Linear(3, 2)
    with torch.no_grad():
        lin.weight.copy_(w)
    qlin = em.quantize_weights(lin, 3, per_channel=False)
    assert torch.equal(qlin.weight, q) and torch.equal(qlin.bias, lin.bias) and torch.equal(lin.weight, w)
    assert not torch.equal(em.quantize_weights(lin, 3, quant_bias=True).bias, lin.bias)
    y = torch.randn(100)
    assert em.sqnr_db(y, y) == math.inf and abs(em.sqnr_db(y, 0.9 * y) - 20) < 1e-4


def test_per_channel_is_the_ceiling(resnet):
    folded, _, _ = em.fold_bn(resnet[0])
    x = resnet[1]
    with torch.no_grad():
        y = folded(x)
        tensor, channel = (em.sqnr_db(y, em.quantize_weights(folded, 6, pc)(x)) for pc in (False, True))
    assert channel > tensor


def test_skips_cleanly_without_brevitas_and_pathir_equalize(monkeypatch, capsys):
    for name in ["brevitas", "brevitas.graph", "brevitas.graph.equalize", "brevitas.graph.quantize"]:
        monkeypatch.setitem(sys.modules, name, None)  # importing brevitas fails, even after an earlier import
    import pathir

    if hasattr(pathir, "equalize"):
        monkeypatch.delattr(pathir, "equalize")
    assert bench.main(TINY + ["--sides", "brevitas,pathir"]) == []
    out = capsys.readouterr().out
    assert "brevitas: skipped, brevitas is not installed" in out and "pathir.equalize does not exist" in out
    assert "nothing to compare, skipped" in out and "|" not in out


def test_table_shows_why_a_side_is_missing():
    row = {"model": "m", "bits": 6, "sqnr_none": -1.23, "sqnr_per_channel": 10.0, "weight_layers": 5,
           "brevitas_error": "RuntimeError: a | b", "sqnr_pathir": 9.0, "pathir_s": 0.5, "pathir_float_ok": False,
           "pathir_float_rel_err": 0.02}
    line = bench.table([row], ["brevitas", "pathir"]).splitlines()[2]
    assert line == "| m | 6 | -1.2 | 10.0 | RuntimeError: a \\| b | – | – | 9.0 (float ✗ 2e-02) | 0.50 |"


def test_brevitas_side_keeps_the_float_function(capsys):
    pytest.importorskip("brevitas")
    (row,) = bench.main(TINY + ["--sides", "brevitas"])
    assert row["brevitas_float_ok"] and row["brevitas_regions"] > 0 and row["brevitas_bn_merged"] == 0
    assert row["brevitas_layers_changed"] == row["weight_layers"] == 21 and 1 <= row["brevitas_iterations"] <= 2
    assert row["sqnr_brevitas"] > row["sqnr_none"]  # equalization helps per-tensor quantization here
    assert "| resnet18 | 8 |" in capsys.readouterr().out


def test_median_image_sqnr_is_not_decided_by_one_image():
    y = torch.ones(5, 4)
    y_q = y.clone()
    y_q[:4] *= 0.9  # four images at 20 dB
    y_q[4] = -3.0  # one image far off: it dominates the pooled figure
    assert abs(em.median_image_sqnr_db(y, y_q) - 20) < 1e-4  # 0.9 in float32
    assert em.sqnr_db(y, y_q) < 0
    assert em.median_image_sqnr_db(y, y) == math.inf


def test_seed_summary_takes_medians_and_counts_pathir_at_least_brevitas():
    rows = [{"model": "m", "bits": 6, "seed": k, "sqnr_none": 0.0, "sqnr_none_image_median": 1.0,
             "sqnr_brevitas": b, "sqnr_brevitas_image_median": b + 1, "sqnr_pathir": p, "sqnr_pathir_image_median": p + 1}
            for k, (b, p) in enumerate([(1.0, 2.0), (3.0, 2.5), (-5.0, 9.0)])]
    lines = bench.seed_summary(rows, ["brevitas", "pathir"]).splitlines()
    assert lines[0].split(" | ")[-1] == "pathir ≥ Brevitas (seeds) |"
    assert lines[2] == "| m | 6 | 0,1,2 | 0.0 | 1.0 | 1.0 | 2.0 | 2.5 | 3.5 | 2 of 3 |"


def test_sensitivity_bench_moves_keep_the_function_and_redraw_the_rounding():
    """bench_equalize_sensitivity.py: a move of σ = 0 scores exactly as the equalized model does, and 1 %
    moves (rescalings: the float function kept by commit_rescaling) draw other roundings, other scores."""
    import bench_equalize_sensitivity as sens

    model = em.build("resnet18", size=32, calib_batches=1)
    folded, _, _ = em.fold_bn(model)
    x = em.eval_inputs(32, 4)
    with torch.no_grad():
        y = folded(x)
    still = sens.moved_scores(folded, (3, 32, 32), [x], y, [4], moves=1, sigma=0.0, seed=0)
    assert still[4][0] == still[4][1]
    moved = sens.moved_scores(folded, (3, 32, 32), [x], y, [4], moves=2, sigma=0.01, seed=0)
    assert moved[4][0] == still[4][0] and len(set(moved[4])) == 3
    rows = sens.main(["--models", "resnet18", "--seeds", "0", "--bits", "8", "--sides", "pathir", "--moves", "1",
                      "--size", "32", "--batch", "2"])
    assert [(r["side"], r["bits"], len(r["moved"])) for r in rows] == [("pathir", 8, 1)]


def test_sensitivity_bench_dithered_score_is_the_mean_squared_error_of_one_step_noise():
    """--dither: the SQNR of the squared output error averaged over draws of uniform noise of one per-tensor
    step: the noise is linear in the step to first order, so two bits finer is 12 dB more (to within the draws'
    spread and the second-order terms)."""
    import bench_equalize_sensitivity as sens

    model = em.build("resnet18", size=32, calib_batches=1)
    folded, _, _ = em.fold_bn(model)
    x = em.eval_inputs(32, 4)
    with torch.no_grad():
        y = folded(x)
    scores = {bits: sens.dithered_sqnr(folded, [x], y, bits, draws=4, seed=0) for bits in (6, 8, 10)}
    assert 10 < scores[8] - scores[6] < 14 and 10 < scores[10] - scores[8] < 14
