"""Forward hooks, pre-hooks and functional calls with a mode fixed in the code."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from capture_reference import assert_forward
from torch.nn.utils import prune

import pathir
from pathir.errors import UnsupportedOperation


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()


def test_forward_hook_refused_naming_the_module():
    model = _mlp()
    model[0].register_forward_hook(lambda m, i, o: o * 2)
    with pytest.raises(UnsupportedOperation, match=r"from 0 .*forward hook"):
        pathir.compile(model, input_shape=(3,))


def test_forward_hook_with_kwargs_refused():
    model = _mlp()
    model[2].register_forward_hook(lambda m, a, k, o: o, with_kwargs=True)
    with pytest.raises(UnsupportedOperation, match=r"from 2 .*forward hook"):
        pathir.compile(model, input_shape=(3,))


def test_forward_pre_hook_refused():
    model = _mlp()
    model[2].register_forward_pre_hook(lambda m, i: (i[0] * 3,))
    with pytest.raises(UnsupportedOperation, match=r"from 2 .*pre-hook"):
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
