"""A model that returns one tensor twice (``return y, y``): its output vector holds y twice, so each path ending
at y counts twice, in pathir's walks, in the enumeration (the definition) and in the symbolic checks alike."""

import math

import numpy as np
import pytest
import torch

import pathir
from pathir.neurons.paths import enumerate_num_paths, enumerate_path_norm


class Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(2, 3), torch.nn.Linear(3, 2)

    def forward(self, x):
        y = self.b(torch.relu(self.a(x)))
        return y, y


@pytest.fixture
def cm():
    torch.manual_seed(0)
    return pathir.compile(Twice().double(), input_shape=(2,))


def test_walks_and_enumeration_count_a_twice_returned_output_twice(cm):
    """Enumeration gave 4 paths and Σ|W| where the walks gave 8 and twice it; verify_symbolic failed a plain model."""
    once = pathir.compile(torch.nn.Sequential(cm.model.a, torch.nn.ReLU(), cm.model.b), input_shape=(2,))
    assert cm.graph.outputs[0] == cm.graph.outputs[1]
    assert enumerate_num_paths(cm.graph) == cm.num_paths() == 2 * once.num_paths()
    for q in (1.0, 2.0, math.inf):
        factor = 1.0 if q == math.inf else 2.0 ** (1.0 / q)
        assert enumerate_path_norm(cm.graph, q) == pytest.approx(cm.path_norm(q), rel=1e-12)
        assert cm.path_norm(q) == pytest.approx(factor * once.path_norm(q), rel=1e-12)
    assert cm.verify_symbolic().passed


def test_the_bound_holds_for_the_returned_vector(cm):
    x = torch.randn(4, 2, dtype=torch.float64)
    x2 = x + 0.1 * torch.randn(4, 2, dtype=torch.float64)
    y, _ = cm.model(x)
    y2, _ = cm.model(x2)
    change = 2 * (y - y2).abs().sum(dim=1).max()  # ‖(y, y) − (y', y')‖₁
    assert float(change) <= cm.path_norm(1) * float((x - x2).abs().max()) * (1 + 1e-12)


def test_its_local_jacobian_is_counted_once():
    """slope and vjp of the twice-returned output gave 2·J (the seed applied once per occurrence) while jvp gave
    J v: per output name there is one Jacobian, torch's own of y."""
    torch.manual_seed(0)
    net = Twice().double()
    cm = pathir.compile(net, input_shape=(2,))
    (out,) = set(cm.graph.outputs)
    x = np.array([[0.3, -1.2], [1.0, 0.5]])
    piece = cm.local_affine(x)
    for i in range(2):
        J = torch.autograd.functional.jacobian(lambda z: net(z[None])[0][0], torch.tensor(x[i])).numpy()
        np.testing.assert_allclose(piece.slope(output=out)[i], J, rtol=1e-12, atol=1e-14)
        u = np.array([[1.5, -2.0]])
        np.testing.assert_allclose(piece.vjp({out: u})[cm.graph.inputs[0]][i], u[0] @ J, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(piece.jvp(np.ones((1, 2)))[out][i], J.sum(axis=1), rtol=1e-12, atol=1e-14)
