"""The benchmark scripts still run (tiny sizes; the figures they print are not checked here)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pathir.analyses.unit_rows import column_balance, matrix_row_keys  # noqa: E402
from pathir.pathcond.solvers import solve  # noqa: E402


def test_solver_benchmark_mlp_is_the_closed_form_of_a_real_mlp():
    import bench_pathcond_solvers as bench

    g, B, rows = bench.mlp([6, 5, 4, 3], seed=1)
    key, H = matrix_row_keys(B)
    assert np.array_equal(rows.key, key) and np.array_equal(rows.balance, column_balance(B))
    assert H == 9 and B.shape[0] == 6 * 5 + 5 + 5 * 4 + 4 + 4 * 3 + 3
    assert np.all(g > 0)
    # the closed-form diag G of the benchmark equals pathir's diag G of the same weights
    import torch

    import pathir
    from pathir.lifting.diag_g import diag_g_flat

    rng = np.random.default_rng(1)
    layers, widths = [], [6, 5, 4, 3]
    for d_in, d_out in zip(widths[:-1], widths[1:]):
        bound = 1 / np.sqrt(d_in)
        lin = torch.nn.Linear(d_in, d_out).double()
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(rng.uniform(-bound, bound, (d_out, d_in))))
            lin.bias.copy_(torch.from_numpy(rng.uniform(-bound, bound, d_out)))
        layers += [lin, torch.nn.ReLU()]
    cm = pathir.compile(torch.nn.Sequential(*layers[:-1]), input_shape=(6,))
    g_ref, log_top = diag_g_flat(cm.graph)
    np.testing.assert_allclose(g, g_ref * np.exp(log_top), rtol=1e-12)
    assert np.array_equal(cm.row_keys().key, rows.key)
    assert solve(g, B, row_key=rows).converged


def test_solver_benchmark_runs(capsys):
    import bench_pathcond_solvers as bench

    speedups = bench.main(["--widths", "12", "8", "8", "3", "--repeat", "1"])
    assert len(speedups) == 2 and all(s > 0 for s in speedups)
    assert "speedup" in capsys.readouterr().out


def test_check_benchmark_runs(capsys):
    import bench_check

    (row,) = bench_check.main(["resnet18", "--input-shape", "3,32,32", "--repeat", "1"])
    assert row["check_over_fb"] > 0 and row["bar_over_no_bar"] > 0
    assert '"model": "resnet18"' in capsys.readouterr().out


@pytest.mark.slow
def test_zoo_pathcond_benchmark_runs(capsys):
    import bench_zoo_pathcond as bench

    rows = bench.main(["--models", "squeezenet1_1", "--repeat", "1", "--reference", "--reference-sweeps", "50"])
    assert len(rows) == 1 and rows[0][1] > 0
    assert "| squeezenet1_1 |" in capsys.readouterr().out


def test_activations_benchmark_runs():
    import bench_activations

    row = bench_activations.bench("resnet18", batch=2, size=32, repeat=1)
    assert row["ratio_active_path_norm"] > 0 and row["ratio_active_path_metric"] > 0


def test_equalize_digits_benchmark_runs(capsys):
    import bench_equalize_digits as bench

    rows = bench.main(["--seeds", "0", "--epochs", "1", "--bits", "8"])
    sides = {r["side"] for r in rows}
    assert {"none", "pathir", "pathir-range"} <= sides
    kept = [r for r in rows if r["side"] != "pathir-absorb"]  # bias absorption is not exact
    assert all(0 <= r["W8"] <= 1 and r["float"] == rows[0]["float"] for r in kept)  # equalizing keeps the function
    assert "| not equalized |" in capsys.readouterr().out


def test_penalty_benchmark_runs(capsys):
    import bench_penalty

    bench_penalty.main(["--batch", "2", "--size", "32", "--repeat", "1"])
    out = capsys.readouterr().out
    assert "penalised training step" in out and "ratio" in out


@pytest.mark.parametrize("q", [1.0, 2.0, 4.0])
def test_toolkit_reference_is_the_path_norm(q):
    """The benchmark's float64 stand-in for the toolkit (|w|^q, batch-norms as affine maps, max-pools as
    sums, an n-entry average as weights |1/n|^q, all-ones forward) gives pathir's path-norm, which its
    own tests check by path enumeration; the model is left as it was."""
    import bench_toolkit
    import torch

    import pathir

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3, padding=1, bias=False), torch.nn.BatchNorm2d(3), torch.nn.ReLU(),
        torch.nn.MaxPool2d(3, 2, padding=1), torch.nn.Conv2d(3, 4, 1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 2)).eval()
    with torch.no_grad():
        bn = model[1]
        bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2), bn.weight.uniform_(-2, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    twin = bench_toolkit.path_norm_twin(model, q)
    ours = bench_toolkit.reference_path_norm(twin, model, (2, 8, 8), q)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert ours == pytest.approx(pathir.compile(model, input_shape=(2, 8, 8)).path_norm(q, log10=True), abs=1e-12)


def test_toolkit_benchmark_runs_without_a_checkout(capsys):
    import bench_toolkit

    (row,) = bench_toolkit.main(["squeezenet1_1", "--repeat", "1", "--steps", "1", "--threads", "1"])
    assert {"a_ratio", "a_ratio_min", "b_ratio", "c_ratio", "s_forwards"} <= set(row) and row["a_log10_gap"] < 1e-9
    assert "| squeezenet1_1 |" in capsys.readouterr().out


def test_pruning_benchmark_runs_and_pathirs_choice_ignores_a_rescaling(capsys):
    """Torch-Pruning's importances beside pathir's: the rescaled twin computes the same function, and the channels
    the path-magnitude prunes (so the pruned accuracy) do not change with the rescaling."""
    pytest.importorskip("torch_pruning")
    import bench_pruning

    rows = bench_pruning.main(["--seeds", "0", "--epochs", "1", "--ratios", "0.25",
                               "--importances", "random,l2,path-magnitude"])
    assert {r["importance"] for r in rows} == {"random", "l2", "path-magnitude"}
    assert all(r["dense"] == r["dense_rescaled"] for r in rows)
    (ours,) = [r for r in rows if r["importance"] == "path-magnitude"]
    assert ours["acc"] == ours["acc_rescaled"] and ours["params"] == ours["params_rescaled"]
    assert "| 0.25 | path-magnitude |" in capsys.readouterr().out
