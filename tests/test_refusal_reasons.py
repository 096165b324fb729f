"""What users write that has no place in a ReLU DAG is refused with the reason, naming the op
(never the generic "outside the model" when pathir knows why), and the model is left untouched."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pathir
from pathir.errors import UnsupportedOperation


class After(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.a, self.o, self.op = nn.Linear(4, 4), nn.Linear(4, 2), op
        self.t, self.W = nn.Parameter(torch.tensor(2.0)), nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return self.o(self.op(self, torch.relu(self.a(x))))


CASES = {
    "clamp(0.5, 6)": (lambda m, h: torch.clamp(h, 0.5, 6.0), "clamp.*lower bound other than 0"),
    "hardtanh(-1, 1)": (lambda m, h: F.hardtanh(h, -1.0, 1.0), "hardtanh.*clips below"),
    "abs": (lambda m, h: h.abs(), "abs.*not one of pathir's neurons"),
    "pow": (lambda m, h: h**2, "pow.*power of an activation"),
    "sort": (lambda m, h: h.sort(1).values, "sort.*orders by value"),
    "cumsum": (lambda m, h: h.cumsum(1), "cumsum.*cumulative sum"),
    "einsum": (lambda m, h: torch.einsum("bi,ij->bj", h, m.W), "einsum.*Linear"),
    "cast": (lambda m, h: h.to(torch.float32).double(), "casts an activation"),
    "zeros_like": (lambda m, h: h + torch.zeros_like(h), "zeros_like.*new tensor of an activation's shape"),
    "compare": (lambda m, h: h * (h > 0.5), "compares an activation"),
    "gate": (lambda m, h: h * h, "multiplicative gate"),
    "learnable divisor": (lambda m, h: h / m.t, "divides an activation by the learnable parameter 't'"),
    "scalar parameter": (lambda m, h: h * m.t, "parameter 't' of shape \\[\\]"),
    "softmax": (lambda m, h: F.softmax(h, 1), "softmax"),
    "constant": (lambda m, h: h + 1, "constant 1"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_refused_with_its_reason_and_the_model_untouched(name):
    op, why = CASES[name]
    torch.manual_seed(0)
    model = After(op).double().eval()
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(UnsupportedOperation, match=why):
        pathir.compile(model, input_shape=(4,))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
