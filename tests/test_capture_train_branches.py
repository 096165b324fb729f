"""Train-mode-only branches (aux classifiers): compiled in eval mode, or in train mode when they
cannot be lowered as extra outputs (tests/test_aux_heads.py), a rescaling write-back is refused
naming them (and why), the model untouched; without them the function is kept."""

import pytest
import torch
import torch.nn as nn

import pathir
from pathir.app import zoo
from pathir.errors import PathirError


class WithAux(nn.Module):
    """A hand-written aux head: runs only in train mode, reads a hidden layer."""

    def __init__(self, aux=True):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)
        self.aux = nn.Linear(4, 2) if aux else None

    def forward(self, x):
        h = torch.relu(self.a(x))
        out = self.b(h)
        if self.training and self.aux is not None:
            return out, self.aux(h)
        return out


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_hand_written_aux_head_refused_untouched_in_eval_mode():
    model = WithAux().double().eval()
    cm = pathir.compile(model, input_shape=(3,))
    state = _state(model)
    with pytest.raises(PathirError, match=r"module\(s\) aux run only in train mode"):
        cm.pathcond()
    assert _same(state, model.state_dict()) and not model.training


class SigmoidAux(WithAux):
    """An aux head outside the ReLU DAG model: it cannot be an output of the graph."""

    def forward(self, x):
        h = torch.relu(self.a(x))
        out = self.b(h)
        return (out, torch.sigmoid(self.aux(h))) if self.training else out


def test_aux_head_outside_the_ir_warned_and_refused_in_train_mode():
    model = SigmoidAux().double().train()
    with pytest.warns(UserWarning, match=r"heads aux .* could not be lowered as extra outputs .*sigmoid"):
        cm = pathir.compile(model, input_shape=(3,))
    assert len(cm.graph.outputs) == 1 and cm.writer.train_paths == []
    state = _state(model)
    with pytest.raises(PathirError, match=r"aux run only in train mode.*lowering them as extra outputs failed"):
        cm.pathcond()
    assert _same(state, model.state_dict()) and model.training


def test_dropped_aux_head_rescales_and_keeps_function():
    torch.manual_seed(0)
    model = WithAux().double()
    model.aux = None
    cm = pathir.compile(model, input_shape=(3,))
    x = torch.randn(4, 3, dtype=torch.float64)
    before = model(x)
    cm.pathcond()
    assert torch.allclose(model(x), before, rtol=1e-10, atol=1e-12)


class UnusedHead(nn.Module):
    """A parameterized module no forward ever calls: not a train-mode branch."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.spare = nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_unused_module_does_not_block_write_back():
    cm = pathir.compile(UnusedHead().double(), input_shape=(3,))
    assert cm.writer.train_only == []
    cm.pathcond()


@pytest.mark.parametrize("name, shape, aux, train", [
    ("googlenet", (3, 64, 64), "aux1, aux2", False),
    pytest.param("inception_v3", (3, 96, 96), "AuxLogits", False, marks=pytest.mark.slow),
    # in train mode its aux head fails on 96x96 (its 5x5 conv needs 299x299): the eval graph stays
    pytest.param("inception_v3", (3, 96, 96), "AuxLogits", True, marks=pytest.mark.slow),
])
def test_zoo_model_with_aux_logits_refused_untouched(name, shape, aux, train):
    model = zoo.build(name).double().train(train)
    with pytest.warns(UserWarning) if train else _nothing():
        cm = pathir.compile(model, input_shape=shape)
    x = torch.randn(2, *shape, dtype=torch.float64)
    state = _state(model)
    with pytest.raises(PathirError, match=aux + r" runs? only in train mode"):
        cm.pathcond()
    assert _same(state, model.state_dict()) and model.training == train
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(x)).all()


def test_googlenet_without_aux_keeps_function_in_train_mode_with_frozen_batch_norms():
    """Train-mode forward (dropout off, batch-norms in eval: their batch statistics would be
    input-dependent) before and after a random rescaling written back (what pathcond commits)."""
    model = zoo.build("googlenet", aux_logits=False).double().eval()
    cm = pathir.compile(model, input_shape=(3, 64, 64))
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    model.train()
    for m in model.modules():
        if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.Dropout)):
            m.eval()
    import numpy as np


    with torch.no_grad():
        before = model(x)
        cm.commit_rescaling(np.random.default_rng(0).normal(scale=0.5, size=len(cm.units)))
        after = model(x)
    assert torch.allclose(after, before, rtol=1e-9, atol=1e-9 * float(before.abs().max()))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class GatedAux(nn.Module):
    """An aux head gated by an argument pathir does not feed (``forward(x, skip_aux=None)``), as a model written to
    switch its aux head off at call sites does."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.aux = nn.Linear(4, 5), nn.Linear(5, 2), nn.Linear(5, 2)

    def forward(self, x, skip_aux=None):
        h = torch.relu(self.a(x))
        if self.training and skip_aux is None:
            return self.b(h), self.aux(h)
        return self.b(h)


def test_an_aux_head_gated_by_a_default_argument_is_found_and_kept():
    """The train-branch traces made the argument a Proxy (the aux branch unseen): in train mode the write moved the
    aux output by 0.067; compiled in eval mode it was not refused."""
    import numpy as np

    torch.manual_seed(0)
    model = GatedAux().double().train()
    x = torch.randn(6, 4, dtype=torch.float64)
    before = [t.detach().clone() for t in model(x)]
    cm = pathir.compile(model, input_shape=(4,))
    assert cm.graph.outputs == ("b", "aux")
    cm.commit_rescaling(np.random.default_rng(0).normal(size=len(cm.units)))
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(model(x), before))
    with pytest.raises(PathirError, match="aux"):
        pathir.compile(GatedAux().double().eval(), input_shape=(4,)).pathcond()


@pytest.mark.parametrize("outer_train", [True, False])
def test_the_train_mode_batch_norm_warning_follows_the_batch_norms_own_flags(outer_train):
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2))

        def forward(self, x):
            return self.m(x)

    model = Outer().double()
    model.training, model.m[1].training = outer_train, not outer_train
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pathir.compile(model, input_shape=(4,))
    warned = any("batch-norms with their running" in str(w.message) for w in seen)
    assert warned == (not outer_train)  # the batch-norm in train mode, whatever the root's flag
