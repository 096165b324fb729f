"""benchmarks/bench_pathcond_reference.py skips cleanly without the published PathCond code, and its tables
read right (the comparison itself needs a checkout of the reference and is not run here)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_pathcond_reference.py"
sys.path.insert(0, str(SCRIPT.parent))


def test_skips_without_a_reference(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PATHCOND_REFERENCE"}
    for extra in ([], ["--reference", str(tmp_path)]):  # none given; a folder that is no checkout
        done = subprocess.run([sys.executable, str(SCRIPT), "moons_demo", *extra], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr
        assert "skipped" in done.stdout and "|" not in done.stdout


def test_main_returns_nothing_without_a_reference(monkeypatch, capsys):
    import bench_pathcond_reference as bench

    monkeypatch.delenv("PATHCOND_REFERENCE", raising=False)
    assert bench.main(["--repeat", "1"]) == []
    assert "skipped" in capsys.readouterr().out


def test_divergence_and_tables():
    import bench_pathcond_reference as bench

    assert bench.divergence(np.full(5, 3.0)) == 0.0
    g = np.array([1.0, 4.0, 0.0])  # the zero is left out: n' = 2, mean 2.5
    assert np.isclose(bench.divergence(g), 2 * np.log(2.5) - np.log(4.0))
    assert np.isclose(bench.divergence(1e-300 * g), bench.divergence(g))  # scale-free
    ok = {"model": "m", "params": 1234, "tolerance": 1e-4, "reference_s": 2.0, "reference_s_all": [2.0],
          "pathir_s": 0.5, "pathir_s_all": [0.4, 0.5, 0.9], "ratio": 4.0, "divergence_before": 10.0,
          "divergence_reference": 3.0, "divergence_pathir": 2.5, "max_diff_reference": 1e-7, "max_diff_pathir": 1e-3,
          "reference_g_divergence_before": 11.0, "reference_g_divergence_reference": 4.0,
          "reference_g_divergence_pathir": 5.0}
    failed = {k: v for k, v in ok.items() if "reference" not in k and k != "ratio"}
    failed.update(model="f", reference_error="ValueError: a | b", reference_g_divergence_before=11.0,
                  reference_g_divergence_pathir=5.0)
    failed.update(train_tolerance=1e-3, train_max_diff_pathir=1e-7)  # a model with batch-norms
    lines = bench.table([ok, failed]).splitlines()
    assert len(lines) == 4
    assert lines[2] == ("| m | 1,234 | 2.00 s | 0.50 s (0.40–0.90) | 4.0× | 10 | 3 | 2.5 | 1.0e-07 ✓ / 1.0e-03 ✗ "
                        "| no batch-norm |")
    assert lines[3] == ("| f | 1,234 | failed: ValueError: a \\| b | 0.50 s (0.40–0.90) | – | 10 | – | 2.5 "
                        "| – / 1.0e-03 ✗ | – / 1.0e-07 ✓ |")
    assert bench.reference_g_table([ok, failed]).splitlines()[2:] == ["| m | 11 | 4 | 5 |", "| f | 11 | – | 5 |"]
