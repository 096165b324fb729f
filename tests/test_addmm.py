"""``torch.addmm(b, x, W, beta=, alpha=)`` (and ``b.addmm(x, W)``, ATen's addmm on the export path): a dense
layer, alpha a fixed factor on it, plus b. Checked against the model's own forward (compile's self-check and here)
and against the path-norm written out for a one-hidden-layer network; a beta other than 0 or 1 on a parameter is
refused, naming it."""

import numpy as np
import pytest
import torch
import torch.nn as nn

import pathir
from pathir.errors import UnsupportedOperation


class AddmmNet(nn.Module):
    """x -> addmm(b1, x, W1, alpha=a) -> ReLU -> addmm(b2, h, W2): W stored (in, out) as ``x @ W`` reads it."""

    def __init__(self, form="function", alpha=1.0, beta=1.0, branch_on_shape=False):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.W1 = nn.Parameter(torch.randn(3, 5, generator=gen, dtype=torch.float64))
        self.b1 = nn.Parameter(torch.randn(5, generator=gen, dtype=torch.float64))
        self.W2 = nn.Parameter(torch.randn(5, 2, generator=gen, dtype=torch.float64))
        self.b2 = nn.Parameter(torch.randn(2, generator=gen, dtype=torch.float64))
        self.form, self.alpha, self.beta, self.branch_on_shape = form, alpha, beta, branch_on_shape

    def forward(self, x):
        if self.branch_on_shape and x.shape[1] != 3:  # Python control flow on a shape: fx cannot trace it
            raise ValueError("three features")
        if self.form == "method":
            h = self.b1.addmm(x, self.W1, alpha=self.alpha)
        else:
            h = torch.addmm(self.b1, x, self.W1, beta=self.beta, alpha=self.alpha)
        return torch.addmm(self.b2, torch.relu(h), self.W2)


def _l1_path_norm(net) -> float:
    """Σ over paths of |product of weights|: input -> hidden -> output paths (alpha on the first layer's
    weights), hidden biases -> output, output biases; beta 0 drops b1."""
    W1, W2 = abs(net.alpha) * net.W1.detach().abs().numpy(), net.W2.detach().abs().numpy()
    b1 = net.b1.detach().abs().numpy() * (0.0 if net.beta == 0 else 1.0)
    return float((W1 @ W2).sum() + b1 @ W2.sum(axis=1) + net.b2.detach().abs().sum())


@pytest.mark.parametrize("form, alpha, beta", [("function", 1.0, 1.0), ("function", 2.5, 1.0), ("method", 1.0, 1.0),
                                                ("function", 1.0, 0.0), ("function", -0.5, 1.0)])
def test_addmm_is_a_dense_layer_plus_its_bias(form, alpha, beta):
    net = AddmmNet(form, alpha, beta)
    cm = pathir.compile(net, input_shape=(3,))
    x = torch.randn(7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    np.testing.assert_allclose(np.asarray(cm.forward(x.numpy())), net(x).detach().numpy(), rtol=1e-12, atol=1e-12)
    assert cm.path_norm(1) == pytest.approx(_l1_path_norm(net), rel=1e-12)


def test_addmm_on_the_export_path_reads_aten_addmm():
    net = AddmmNet("function", 2.0, 1.0, branch_on_shape=True)
    program = torch.export.export(net, (torch.randn(2, 3, dtype=torch.float64),))
    assert any("addmm" in str(n.target) for n in program.graph.nodes)  # what the fallback reads
    cm = pathir.compile(net, input_shape=(3,))
    assert cm.path_norm(1) == pytest.approx(_l1_path_norm(net), rel=1e-12)


def test_a_scaled_bias_parameter_is_refused_by_name():
    with pytest.raises(UnsupportedOperation, match="beta = 0.5 on .*b1"):
        pathir.compile(AddmmNet("function", 1.0, 0.5), input_shape=(3,))


def test_rescaling_keeps_the_function_of_an_addmm_model():
    net = AddmmNet("function", 2.0, 1.0)
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    before = net(x).detach().clone()
    pathir.compile(net, input_shape=(3,)).pathcond()
    torch.testing.assert_close(net(x).detach(), before, rtol=1e-10, atol=1e-12)
