"""benchmarks/train_digits.py still runs (one epoch, one seed; the figures it prints are not checked here),
and the property its rescaled-init table rests on holds: PathCond-at-init and Path-SGD start the same run
from any point of the initial network's rescaling orbit."""

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sklearn")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import train_digits as bench  # noqa: E402


def _small_data():
    """320 training images (10 steps an epoch) and the test split."""
    xa, ya, xb, yb = bench.digits()
    return xa[:320], ya[:320], xb, yb


@pytest.mark.parametrize("recipe", ["pathcond-init", "path-sgd"])
def test_rescaled_init_gives_the_same_run(recipe):
    data = _small_data()
    lr = bench.RECIPES[recipe]
    a = bench.train(recipe, 0, epochs=1, k=10, data=data, lr=lr)
    b = bench.train(recipe, 0, epochs=1, k=10, data=data, lr=lr, rescale_init=3.0)
    assert a[0] == b[0] and np.isclose(a[1], b[1], rtol=1e-3) and np.allclose(a[2], b[2], rtol=1e-3)


def test_enorm_every_k_runs_and_moves_the_optimizer_state():
    data = _small_data()
    acc, loss, norms, _ = bench.train("enorm-every-k", 0, epochs=1, k=5, data=data, lr=bench.RECIPES["enorm-every-k"])
    assert 0.3 < acc <= 1 and np.isfinite(loss) and len(norms) == 1 and np.isfinite(norms[0])
