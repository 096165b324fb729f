"""A Compiled follows its torch model: after in-place changes every query reflects the current
tensors (checked against a fresh compile), and a change it cannot follow raises ModelChanged."""

import numpy as np
import pytest
import torch
import torch.nn as nn

import pathir
from pathir import ModelChanged

SHAPE = (3, 8, 8)


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 5, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(5, 3),
    ).double()


def _fresh(model, q=2.0):
    return pathir.compile(model, input_shape=SHAPE).path_norm(q)


def _train_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, *SHAPE, generator=g, dtype=torch.float64)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_path_norm_after_every_sgd_step_equals_a_fresh_compile():
    model = _net()  # train mode: the batch-norm's running statistics move too
    cm = pathir.compile(model, input_shape=SHAPE)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    seen = [cm.path_norm(2)]
    for step in range(6):
        _train_step(model, opt, step)
        assert cm.path_norm(2) == pytest.approx(_fresh(model), rel=1e-13)
        seen.append(cm.path_norm(2))
    assert len(set(seen)) == len(seen)  # it did move each step


def test_adam_steps_and_diag_g_and_forward_follow():
    model = _net(1).eval()
    cm = pathir.compile(model, input_shape=SHAPE)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(2, *SHAPE, dtype=torch.float64)
    for step in range(3):
        _train_step(model, opt, step)
        fresh = pathir.compile(model, input_shape=SHAPE)
        for name, g in cm.diag_g().items():
            np.testing.assert_allclose(g, fresh.diag_g()[name], rtol=1e-12)
        with torch.no_grad():
            np.testing.assert_allclose(np.asarray(cm.forward(x.numpy())), model(x).numpy(), rtol=1e-10, atol=1e-12)


def test_load_state_dict_and_an_edit_under_no_grad_are_followed():
    model, other = _net(0).eval(), _net(7).eval()
    cm = pathir.compile(model, input_shape=SHAPE)
    model.load_state_dict(other.state_dict())
    assert cm.path_norm(1) == pytest.approx(_fresh(other, 1), rel=1e-13)
    with torch.no_grad():
        model[4].weight.mul_(3.0)
    assert cm.path_norm(1) == pytest.approx(_fresh(model, 1), rel=1e-13)


def test_an_edit_through_data_needs_refresh():
    model = _net().eval()
    cm = pathir.compile(model, input_shape=SHAPE)
    model[8].weight.data.mul_(2.0)  # .data bypasses autograd's version counter (documented)
    cm.refresh()
    assert cm.path_norm(2) == pytest.approx(_fresh(model), rel=1e-13)


def test_write_back_then_training_is_followed_without_a_spurious_reload():
    model = _net().eval()
    cm = pathir.compile(model, input_shape=SHAPE)
    cm.pathcond()
    graph = cm.graph
    assert cm.graph is graph  # the write-back itself is not a change to follow
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _train_step(model, opt, 0)
    assert cm.path_norm(2) == pytest.approx(_fresh(model), rel=1e-13)


def test_pruned_model_keeps_being_followed():
    model = _net().eval()
    cm = pathir.compile(model, input_shape=SHAPE)
    cm.prune(0.3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _train_step(model, opt, 0)
    assert cm.path_norm(1) == pytest.approx(_fresh(model, 1), rel=1e-13)


@pytest.mark.parametrize("change", ["module", "shape", "hook"])
def test_a_changed_structure_raises_model_changed(change):
    model = _net().eval()
    cm = pathir.compile(model, input_shape=SHAPE)
    if change == "module":
        model[4] = nn.Conv2d(4, 5, 3, padding=1).double()
        match = "'4' .* was replaced"
    elif change == "shape":
        model[8].weight = nn.Parameter(torch.zeros(3, 6, dtype=torch.float64))
        match = "'8.weight' changed shape from \\[3, 5\\]"
    else:
        model[2].register_forward_hook(lambda m, i, o: o * 2)
        match = "hooks were added"
    with pytest.raises(ModelChanged, match=match):
        cm.path_norm()


def test_a_derived_compiled_is_a_snapshot_that_refuses_once_the_model_moves():
    model = _net().eval()
    cm = pathir.compile(model, input_shape=SHAPE)
    rescaled = cm.rescaled(np.full(len(cm.units), 0.3))
    before = rescaled.path_norm(2)
    assert before == pytest.approx(cm.path_norm(2), rel=1e-12)
    with torch.no_grad():
        model[0].weight.mul_(2.0)
    with pytest.raises(ModelChanged, match="snapshot"):
        rescaled.path_norm(2)
    assert cm.path_norm(2) == pytest.approx(_fresh(model), rel=1e-13)
