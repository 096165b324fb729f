"""In-place writes through a view that a later op reads (``c[:, :2].relu_(); conv(c)``, ``c[:, 1] = 0``):
a traced graph would read the value before the write, so the torch frontend lowers torch.export's
functionalized graph (``slice_scatter``, ``select_scatter``), which has eager semantics. Checked
against the model's own float64 forward and the path-norm network, on both capture paths; a
PathCond write-back keeps the function. ``c[:, [0, 2]] = 0`` and ``c[:, mask] = y`` (``index_put``)
likewise. A write of a constant other than 0, into some samples of a batch, or accumulating, stays
refused, naming the op."""

import copy

import pytest
import torch
import torch.nn as nn
from capture_reference import Untraceable, assert_definition, assert_forward, eval_forward

import pathir
from pathir.errors import UnsupportedOperation


class Writes(nn.Module):
    """With ``q`` set (the path-norm network), a constant factor c is |c|^q."""

    q = None

    def __init__(self, how):
        super().__init__()
        self.a, self.o, self.how = nn.Conv2d(2, 4, 3), nn.Conv2d(4, 2, 1), how

    def forward(self, x):
        c = self.a(x)
        if self.how == "relu_ on a slice":
            c[:, :2].relu_()
        elif self.how == "setitem 0":
            c = torch.relu(c)
            c[:, 1] = 0
        elif self.how == "strided relu_ and a scaled channel":
            c[:, ::2].relu_()
            c[:, 1, 1:].mul_(-2.0 if self.q is None else 2.0**self.q if self.q else 1.0)
        elif self.how == "setitem an activation":
            c[:, :2] = torch.relu(c[:, 2:])
        elif self.how == "zero_ and fill_":
            c = torch.relu(c)
            c[:, 0].zero_()
            c[:, 3, :, 1].fill_(0.0)
        elif self.how == "setitem 1":
            c[:, 1] = 1.0
        elif self.how == "setitem a list 0":  # index_put_: the channels zeroed
            c = torch.relu(c)
            c[:, [0, 2]] = 0
        elif self.how == "setitem a mask an activation, a list 0 through a view":
            c[:, torch.tensor([False, True, False, True])] = torch.relu(c[:, [0, 2]])
            v = c[:, 1:]
            v[:, [0]] = 0  # read later through c: functionalized, index_put and slice_scatter
        elif self.how == "setitem a list 1":
            c[:, [0, 2]] = 1.0
        elif self.how == "setitem the batch axis 0":
            c[[0]] = 0
        elif self.how == "index_put_ accumulate":
            torch.ops.aten.index_put_.default(c, [None, torch.tensor([1])], torch.relu(c[:, [0]]), True)
        return self.o(torch.relu(c) if self.how != "relu_ on a slice" else c)


HOW = ["relu_ on a slice", "setitem 0", "strided relu_ and a scaled channel", "setitem an activation",
       "zero_ and fill_", "setitem a list 0", "setitem a mask an activation, a list 0 through a view"]


def _model(how):
    torch.manual_seed(0)
    return Writes(how).double().eval()


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("wrap", [False, True], ids=["fx", "export"])
def test_writes_through_views_have_eager_semantics(how, wrap):
    model = _model(how)
    cm = assert_forward(Untraceable(model) if wrap else model, (2, 6, 6), tol=1e-12)
    assert_definition(cm, model, (2, 6, 6))


@pytest.mark.parametrize("how", HOW)
def test_pathcond_keeps_the_function(how):
    model = _model(how)
    cm = pathir.compile(model, input_shape=(2, 6, 6))
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    before = eval_forward(model, x)
    cm.pathcond()
    assert torch.allclose(eval_forward(model, x), before, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("how, op, why", [
    ("setitem 1", "fill_", "a fixed value no parameter carries"),
    ("setitem a list 1", "index_put_", "a fixed value no parameter carries"),
    ("setitem the batch axis 0", "index_put_", "writes some samples of a batch and not others"),
    ("index_put_ accumulate", "index_put_", "adds into the indexed elements"),
])
def test_writing_a_non_zero_constant_is_refused_and_the_model_untouched(how, op, why):
    model = _model(how)
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(UnsupportedOperation, match=why) as err:
        pathir.compile(model, input_shape=(2, 6, 6))
    assert err.value.op.startswith(op), err.value
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


class WritesWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 4, 3)

    def forward(self, x):
        self.a.weight[:2].relu_()
        return self.a(x)


def test_an_in_place_write_to_a_parameter_stays_refused():
    model = WritesWeight().double()
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(UnsupportedOperation):
        pathir.compile(model, input_shape=(2, 6, 6))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
