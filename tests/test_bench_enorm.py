"""benchmarks/bench_enorm.py still runs its pieces (tiny sizes; the figures it prints are not checked here)."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_reference_pass_and_table():
    import bench_enorm as bench

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))
    assert bench.forward_backward_f64(net, (3, 8, 8), repeat=2) > 0
    assert next(net.parameters()).dtype == torch.float32  # the reference runs on a copy
    row = {"model": "m", "units": 1234, "reference_s": 0.5, "enorm_s": 1.0, "enorm_ratio": 2.0, "sweeps": 7,
           "converged": True, "normalize_s": 0.25, "normalize_ratio": 0.5}
    table = bench.markdown([row]).splitlines()
    assert len(table) == 3 and table[2] == "| m | 1,234 | 0.500 | 1.00 | 2.0× | 7 | yes | 0.25 | 0.5× |"
