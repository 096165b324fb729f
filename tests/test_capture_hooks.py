"""Forward hooks, pre-hooks and functional calls with a mode fixed in the code."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from capture_reference import Untraceable, assert_definition, assert_forward, eval_forward
from torch.nn.utils import prune

import pathir
from pathir.errors import UnsupportedOperation


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()


def _c(m, v):
    """The constant v of a hook on module m: |v|^q in the reference network (m.q set), v ≠ 0 at q = 0."""
    q = getattr(m, "q", None)
    return v if q is None else abs(v) ** q if q else float(v != 0)


class Hooked(nn.Module):
    """conv -> ReLU -> conv -> ReLU -> linear; ``hooks`` registered on its parts (a hook doubling the
    output, one scaling it, a pre-hook scaling the input, one with kwargs, one on the model itself).
    Setting ``q`` (the reference network) sets it on every part: each constant c of a hook is |c|^q."""

    def __init__(self, hooks):
        super().__init__()
        self.a, self.b, self.fc = nn.Conv2d(2, 3, 3), nn.Conv2d(3, 3, 1), nn.Linear(3 * 4 * 4, 2)
        if "double" in hooks:
            self.a.register_forward_hook(lambda m, i, o: o + o)
        if "scale" in hooks:
            self.b.register_forward_hook(lambda m, i, o: o * _c(m, -0.5))
        if "pre" in hooks:
            self.fc.register_forward_pre_hook(lambda m, i: (i[0] * _c(m, 3.0),))
        if "kwargs" in hooks:
            self.b.register_forward_hook(lambda m, a, k, o: _c(m, 2.0) * o, with_kwargs=True)
        if "pre_kwargs" in hooks:
            self.b.register_forward_pre_hook(lambda m, a, k: ((a[0] * _c(m, -2.0),), k), with_kwargs=True)
        if "observe" in hooks:
            self.seen = []
            self.a.register_forward_hook(lambda m, i, o: self.seen.append(type(o).__name__))
        if "model" in hooks:
            self.register_forward_hook(lambda m, i, o: o * _c(m, 4.0))

    @property
    def q(self):
        return getattr(self.a, "q", None)

    @q.setter
    def q(self, q):
        for m in self.modules():
            if m is not self:
                m.q = q

    def forward(self, x):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        return self.fc(h.flatten(1))


HOOKS = {"double": ["double"], "scale": ["scale"], "pre": ["pre"], "kwargs": ["kwargs"], "pre_kwargs": ["pre_kwargs"],
         "observe": ["observe"],
         "all": ["double", "scale", "pre", "kwargs", "pre_kwargs"], "model": ["model", "double"]}


def _hooked(name):
    torch.manual_seed(0)
    return Hooked(HOOKS[name]).double().eval()


@pytest.mark.parametrize("name", list(HOOKS))
def test_homogeneous_hooks_are_traced_and_equal_the_definition(name):
    model = _hooked(name)
    cm = assert_forward(model, (2, 6, 6), tol=1e-12)
    assert_definition(cm, model, (2, 6, 6))


@pytest.mark.parametrize("name", ["all", "model"])
def test_the_export_path_runs_the_hooks_too(name):
    model = Untraceable(_hooked(name))
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(model)
    cm = assert_forward(model, (2, 6, 6), tol=1e-12)
    assert_definition(cm, model.inner, (2, 6, 6))


@pytest.mark.parametrize("name", ["all", "model"])
def test_pathcond_keeps_the_function_of_a_hooked_model(name):
    model = _hooked(name)
    cm = pathir.compile(model, input_shape=(2, 6, 6))
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    before = eval_forward(model, x)
    report = cm.pathcond()
    assert report.objective_after < report.objective_before
    assert torch.allclose(eval_forward(model, x), before, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("hook,match", [
    (lambda m, i, o: o * float(o.sum()), r"from 0 .*forward hook that cannot be traced"),
    (lambda m, i, o: torch.relu(o) if o.sum() > 0 else o, r"from 0 .*forward hook that cannot be traced"),
])
def test_a_hook_that_cannot_be_traced_is_refused_naming_the_module(hook, match):
    model = _mlp()
    model[0].register_forward_hook(hook)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedOperation, match=match):
        pathir.compile(model, input_shape=(3,))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_a_hook_outside_the_relu_model_is_refused_by_its_op():
    model = _mlp()
    model[0].register_forward_hook(lambda m, i, o: torch.tanh(o))
    with pytest.raises(UnsupportedOperation, match="tanh"):
        pathir.compile(model, input_shape=(3,))


@pytest.mark.parametrize("register", [nn.modules.module.register_module_forward_hook,
                                      nn.modules.module.register_module_forward_pre_hook])
def test_global_hooks_refused(register):
    handle = register(lambda *a: None)
    try:
        with pytest.raises(UnsupportedOperation, match="global forward"):
            pathir.compile(_mlp(), input_shape=(3,))
    finally:
        handle.remove()


def test_pruned_model_compiles_exactly():
    model = _mlp()
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    assert_forward(model, (3,))


def test_stale_pruned_weight_is_read_as_the_next_forward_computes_it():
    model = _mlp()
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    with torch.no_grad():
        model[0].weight_orig.mul_(2.0)  # the hook recomputes weight only at the next forward
    stale = model[0].weight
    cm = pathir.compile(model, input_shape=(3,))  # its self-check runs the model's own forward
    assert model[0].weight is stale  # the model's attribute is left as it was
    x = torch.randn(4, 3, dtype=torch.float64)
    with torch.no_grad():
        fresh = model(x)  # eager: the pre-hook computes weight_orig * weight_mask first
    assert torch.allclose(torch.as_tensor(cm.forward(x.numpy())), fresh, rtol=1e-12, atol=1e-12)
    assert not torch.equal(model[0].weight, stale)


def test_legacy_weight_norm_compiles_exactly():
    model = _mlp()
    torch.nn.utils.weight_norm(model[0])
    assert_forward(model, (3,))


class FixedMode(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.a, self.how = nn.Linear(3, 3), how
        self.register_buffer("rm", torch.zeros(3))
        self.register_buffer("rv", torch.ones(3))

    def forward(self, x):
        h = self.a(x)
        if self.how == "dropout_kw":
            h = F.dropout(h, 0.5, training=True)
        elif self.how == "dropout_pos":
            h = F.dropout(h, 0.3, True)
        elif self.how == "dropout_default":
            h = F.dropout(h, 0.3)  # training=True by default
        elif self.how == "alpha":
            h = F.alpha_dropout(h, 0.2, training=True)
        elif self.how == "torch_dropout":
            h = torch.dropout(h, 0.2, train=True)
        elif self.how == "bn_train":
            h = F.batch_norm(h, self.rm, self.rv, training=True)
        elif self.how == "bn_eval":
            h = F.batch_norm(h, self.rm, self.rv, self.a.weight[0] * 0 + 1, self.a.bias * 0, training=False)
        elif self.how == "dropout_self":
            h = F.dropout(h, 0.5, training=self.training)
        return torch.relu(h)


@pytest.mark.parametrize("how", ["dropout_kw", "dropout_pos", "dropout_default", "alpha", "torch_dropout",
                                 "bn_train"])
def test_fixed_training_mode_refused(how):
    with pytest.raises(UnsupportedOperation, match="random|batch statistics"):
        pathir.compile(FixedMode(how), input_shape=(3,))


def test_mode_following_self_training_compiles():
    model = FixedMode("dropout_self").double().train()
    assert_forward(model, (3,))
    assert model.training


class EvalBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.g, self.b = nn.Parameter(torch.rand(3) + 0.5), nn.Parameter(torch.randn(3))
        self.register_buffer("rm", torch.randn(3))
        self.register_buffer("rv", torch.rand(3) + 0.5)

    def forward(self, x):
        return torch.relu(F.batch_norm(self.a(x), self.rm, self.rv, self.g, self.b, training=False))


def test_functional_batch_norm_eval_supported():
    torch.manual_seed(0)
    assert_forward(EvalBatchNorm().double(), (3,))
