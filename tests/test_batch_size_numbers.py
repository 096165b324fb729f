"""A forward that computes with its batch size is refused while lowering, with ``self_check=False`` too; one that
uses the batch size only to shape a tensor's batch axis compiles exactly.

With ``self_check=False`` these models compiled, each wrong at every batch size but the trace's (2): ``h / x.size(0)``
off by 0.08 of max|output| at batch 3, ``h * len(x)`` by 0.69, ``torch.ones(x.shape[0], 4).sum()`` by 1.5. Judged
against the model's own float64 forward at batches 1, 3 and 5.
"""

import contextlib

import pytest
import torch
import torch.nn as nn
from torch_programs import export_path

import pathir
from pathir.errors import UnsupportedOperation


class _Uses(nn.Module):
    def __init__(self, use):
        super().__init__()
        self.a, self.b, self.use = nn.Linear(4, 4), nn.Linear(4, 2), use

    def forward(self, x):
        return self.b(self.use(torch.relu(self.a(x)), x))


#: (the forward's use of the batch size, on the fx path: the node the refusal names, or None where fx cannot
#: trace it and torch.export's eager run at batch 1 and 2 refuses it)
REFUSED = {
    "divide": (lambda h, x: h / x.size(0), "truediv"),
    "times shape": (lambda h, x: h * x.shape[0], "mul"),
    "computed": (lambda h, x: h.reshape(x.size(0), -1) * (x.size(0) / 2), "mul"),
    "arange": (lambda h, x: h * torch.arange(x.shape[0]).to(h)[:, None], "arange"),
    "full": (lambda h, x: h * torch.full((x.shape[0], 1), 2.0, dtype=h.dtype).sum(), "full"),
    "len": (lambda h, x: h * len(x), None),
    "ones sum": (lambda h, x: h * torch.ones(x.shape[0], 4, dtype=h.dtype).sum(), None),
    "tensor": (lambda h, x: h * torch.tensor(x.shape[0], dtype=h.dtype), None),
    "numel": (lambda h, x: h / x.numel() * 4, "truediv"),
    # the same at batches 1, 2 and 3 (the trace's and the self-check's), not at 4: compiled, 0.64 off at batch 4
    "floor division": (lambda h, x: h * (1 + x.size(0) // 4), "mul"),
    "comparison": (lambda h, x: h * ((x.size(0) > 3) + 1), "mul"),
    "shape numel": (lambda h, x: h / x.shape.numel(), "truediv"),
    # the batch size as the first entry of some other tuple, or twice in one index: compiled, off by up to 2.7
    "roll": (lambda h, x: torch.roll(h, shifts=(x.size(0),), dims=(1,)), "roll"),
    "slice of features": (lambda h, x: _slice_twice(h, x.size(0)), "getitem"),
}


def _slice_twice(h, n):
    return h[:n, :n].sum(1, keepdim=True).expand(-1, 4)  # the first n features


@pytest.mark.parametrize("self_check", [False, True])
@pytest.mark.parametrize("path", ["fx", "export"])
@pytest.mark.parametrize("use", sorted(REFUSED))
def test_a_number_computed_from_the_batch_size_is_refused(use, path, self_check):
    """fx names the node; torch.export, where the batch size is a literal, compares the eager forward at batches 1 and
    5 with the one at 2."""
    fn, node = REFUSED[use]
    torch.manual_seed(0)
    model = _Uses(fn).double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with export_path() if path == "export" else contextlib.nullcontext():
        with pytest.raises(pathir.PathirError, match="batch size|varies over the batch") as err:
            pathir.compile(model, input_shape=(4,), self_check=self_check)
    if path == "fx" and node is not None:
        assert isinstance(err.value, UnsupportedOperation) and err.value.node == node
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


#: uses that only shape the batch axis, each the same function at every batch size
KEPT = {
    "view": lambda h, x: h.view(x.size(0), -1),
    "reshape of a shape": lambda h, x: h.reshape(*x.shape[:1], 2, 2).flatten(1),
    "n + 0": lambda h, x: h.reshape(x.size(0) + 0, 4),
    "zeros block": lambda h, x: torch.cat([h, torch.zeros(x.shape[0], 2, dtype=h.dtype)], 1)[:, :4],
    "new_zeros": lambda h, x: h + h.new_zeros(x.size(0), 4),
    "slice": lambda h, x: h[: x.size(0)],
    "shape whole": lambda h, x: h.reshape(x.shape[:1] + (2, 2)).reshape(x.size()),
    "max of sizes": lambda h, x: h.view(max(x.size(0), x.size(0)), -1),
    "shapes by keyword": lambda h, x: torch.reshape(h, shape=(x.size(0), -1)) + torch.zeros(size=(x.size(0), 4),
                                                                                          dtype=h.dtype),
    "new_zeros by keyword": lambda h, x: h + h.new_zeros(size=(x.size(0), 4)),
}


@pytest.mark.parametrize("path", ["fx", "export"])
@pytest.mark.parametrize("use", sorted(KEPT))
def test_the_batch_size_as_a_shape_compiles_exactly(use, path):
    torch.manual_seed(0)
    model = _Uses(KEPT[use]).double()
    with export_path() if path == "export" else contextlib.nullcontext():
        cm = pathir.compile(model, input_shape=(4,), self_check=False)
    for batch in (1, 3, 5):
        x = torch.randn(batch, 4, dtype=torch.float64)
        assert torch.allclose(torch.as_tensor(cm.forward(x)), model(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("path", ["fx", "export"])
def test_a_number_computed_from_the_batch_size_that_is_the_same_at_every_batch_size_is_a_constant(path):
    """x.numel() // x.size(0) (one sample's size) and n // n are the same at every batch size pathir tries (1 to a
    million): constants, exact on both paths."""
    torch.manual_seed(0)
    model = _Uses(lambda h, x: h.view(x.size(0), h.numel() // h.size(0)) * (x.size(0) // x.size(0))).double()
    with export_path() if path == "export" else contextlib.nullcontext():
        cm = pathir.compile(model, input_shape=(4,), self_check=False)
    for batch in (1, 3):
        x = torch.randn(batch, 4, dtype=torch.float64)
        assert torch.allclose(torch.as_tensor(cm.forward(x)), model(x), rtol=1e-12, atol=1e-12)
