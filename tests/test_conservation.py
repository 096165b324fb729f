"""Conservation laws under plain gradient descent on scikit-learn's digits (docs/math.md §9).

Along gradient flow every H_h is constant. One step of gradient descent with
step η changes it by exactly η² gᵀ diag(−B_h) g (the first-order term is
DΦ·(B_h ⊙ θ) = 0), so over a fixed horizon T = η·steps the drift per step
shrinks like η², and the total drift like η (the flow limit conserves H_h),
while quantities that are not conserved keep drifting by O(1).
"""

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("sklearn.datasets")

import pathir  # noqa: E402

HORIZON = 10.0
ETAS = (0.5, 0.25, 0.125, 0.0625)


@contextlib.contextmanager
def one_thread():
    """Full-batch steps of a tiny MLP: extra threads only contend on a busy machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture(scope="module")
def digits():
    X, y = datasets.load_digits(return_X_y=True)
    return torch.tensor(X / 16.0, dtype=torch.float64), torch.tensor(y)


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10),
    ).double()


def loss_and_grads(model, X, y):
    model.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(X), y)
    loss.backward()
    return loss.item()


def gd(model, X, y, eta, steps):
    for _ in range(steps):
        loss_and_grads(model, X, y)
        with torch.no_grad():
            for p in model.parameters():
                p -= eta * p.grad


def laws_and_incoming(model):
    """(H_h for every unit, Σ_{in_h} θ_i²: a non-conserved control) from a fresh compile."""
    cm = pathir.compile(model, input_shape=(64,))
    B, layout = cm.incidence()
    incoming = (-B).maximum(0).T @ layout.theta() ** 2
    return np.array(list(cm.conservation_laws().values())), incoming


def test_units_of_the_mlp_are_its_hidden_neurons():
    cm = pathir.compile(mlp(), input_shape=(64,))
    assert len(cm.units) == 32
    assert list(cm.conservation_laws())[:2] == ["0:c0", "0:c1"]


def test_drift_per_step_shrinks_like_eta_squared(digits):
    X, y = digits
    drift, control, steps, losses = [], [], [], []
    with one_thread():
        for eta in ETAS:
            model = mlp()
            h0, c0 = laws_and_incoming(model)
            n = int(round(HORIZON / eta))
            gd(model, X, y, eta, n)
            h1, c1 = laws_and_incoming(model)
            drift.append(np.abs(h1 - h0).max())
            control.append(np.abs(c1 - c0).max())
            steps.append(n)
            losses.append(loss_and_grads(model, X, y))
    drift, control, etas = np.array(drift), np.array(control), np.array(ETAS)
    per_step = drift / np.array(steps)
    slope = np.polyfit(np.log(etas), np.log(per_step), 1)[0]
    ratios = per_step[:-1] / per_step[1:]
    msg = f"drift {drift}, per step {per_step}, ratios {ratios}, slope {slope:.3f}, control {control}, losses {losses}"
    assert 1.7 <= slope <= 2.3, msg
    assert np.all((ratios > 3.0) & (ratios < 5.0)), msg  # ≈ 4 per halving of η
    total_slope = np.polyfit(np.log(etas), np.log(drift), 1)[0]
    assert 0.7 <= total_slope <= 1.3, msg  # the flow itself conserves H_h
    # the same run moves what is not conserved by O(1), whatever η
    assert control.min() > 0.5 * control.max() and control[-1] > 50 * drift[-1], msg
    assert losses[-1] < np.log(10) - 0.05, msg  # it did train


def test_one_step_changes_h_by_eta_squared_g_diag_g(digits):
    """H(θ − ηg) − H(θ) = η² Σ_i (−B[i,h]) g_i², because Σ_i B[i,h] θ_i g_i = 0."""
    X, y = digits
    model = mlp()
    cm = pathir.compile(model, input_shape=(64,))
    B, layout = cm.incidence()
    with one_thread():
        loss_and_grads(model, X, y)
    g = np.concatenate([model.get_parameter(p.name).grad.numpy().ravel() for p in layout.params])
    theta = layout.theta()
    first_order = B.T @ (theta * g)
    assert np.abs(first_order).max() <= 1e-12 * (abs(B).T @ np.abs(theta * g)).max()
    eta = 0.3
    h0 = np.array(list(cm.conservation_laws().values()))
    from pathir.neurons.symbolic import conservation_laws

    h1 = np.array(list(conservation_laws(cm.graph, cm.units, theta - eta * g).values()))
    want = eta**2 * (-(B.T @ g**2))
    assert np.allclose(h1 - h0, want, rtol=1e-9, atol=1e-15)
    assert np.abs(want).max() > 0
