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


@pytest.mark.parametrize("view", ["t", "flip"])
def test_a_weight_set_to_a_view_of_its_own_storage_is_followed(view):
    """``w.data = w.data.t()`` keeps the pointer, the version and (square) the shape: only the strides move. The
    Compiled answered the old model's path-norm and forward (live review). ``flip`` copies: a new pointer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2)).double()
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, 0, 0], [5, 1, 0], [0, 0, 1]]))
    cm = pathir.compile(model, input_shape=(3,))
    w = model[0].weight
    w.data = w.data.t() if view == "t" else w.data.flip(0)
    assert cm.path_norm(1) == pytest.approx(pathir.compile(model, input_shape=(3,)).path_norm(1), rel=1e-13)
    x = torch.eye(3, dtype=torch.float64)
    np.testing.assert_allclose(cm.forward(x.numpy()), model(x).detach().numpy(), rtol=1e-13, atol=1e-13)


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


@pytest.mark.parametrize("change", ["module", "shape", "hook", "setting"])
def test_a_changed_structure_raises_model_changed(change):
    model = _net().eval()
    cm = pathir.compile(model, input_shape=SHAPE)
    if change == "module":
        model[4] = nn.Conv2d(4, 5, 3, padding=1).double()
        match = "'4' .* was replaced"
    elif change == "shape":
        model[8].weight = nn.Parameter(torch.zeros(3, 6, dtype=torch.float64))
        match = "'8.weight' changed shape from \\[3, 5\\]"
    elif change == "hook":
        model[2].register_forward_hook(lambda m, i, o: o * 2)
        match = "hooks were added"
    else:  # a setting the graph was lowered with: the batch-norm's eps, a stride
        bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
        bn.eps = 0.5
        match = "the setting 'eps' of .* changed from 1e-05 to 0.5"
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


# ------------------------------------------------------------ the value-only re-read


def _lowerings(monkeypatch):
    """A counter of full lowerings (traced program interpreted again)."""
    from pathir.frontends.torch.interpreter import FxInterpreter

    calls, run = [], FxInterpreter.run
    monkeypatch.setattr(FxInterpreter, "run", lambda self, *a, **k: calls.append(1) or run(self, *a, **k))
    return calls


def _assert_same_graph(cm, model):
    """Every param of the followed graph equals a fresh compile's, bit for bit."""
    fresh = pathir.compile(model, input_shape=SHAPE, self_check=False)
    assert str(cm.graph) == str(fresh.graph)
    for p, q in zip(cm.graph.params(), fresh.graph.params(), strict=True):
        assert p.name == q.name and np.array_equal(p.value, q.value), p.name
    return fresh


def test_an_sgd_step_in_eval_mode_is_read_without_lowering_again(monkeypatch):
    model = _net().eval()
    cm = pathir.compile(model, input_shape=SHAPE)
    calls = _lowerings(monkeypatch)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        _train_step(model, opt, step)
        before = len(calls)
        value = cm.path_norm(2)
        assert len(calls) == before  # values only: no tracing, no interpretation
        fresh = _assert_same_graph(cm, model)
        assert value == fresh.path_norm(2)


def test_running_statistics_and_a_replaced_parameter_are_read_without_lowering_again(monkeypatch):
    model = _net().eval()
    cm = pathir.compile(model, input_shape=SHAPE)
    calls = _lowerings(monkeypatch)
    with torch.no_grad():
        model[1].running_var.mul_(4.0)
        model[1].running_mean.add_(0.5)
    model[8].weight = nn.Parameter(torch.randn(3, 5, dtype=torch.float64))  # same shape, new tensor
    cm.path_norm(1)
    assert calls == []
    _assert_same_graph(cm, model)


class _BufferScaled(nn.Module):
    """x * buffer: the buffer is a fixed constant of the graph, no recipe reads it."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4, 2)
        self.register_buffer("scale", torch.tensor([1.0, 2.0, 3.0, 4.0]).reshape(1, 4, 1, 1))

    def forward(self, x):
        x = torch.relu(self.conv(x)) * self.scale
        return self.fc(x.mean(dim=(2, 3)))


def test_a_moved_constant_buffer_is_lowered_again(monkeypatch):
    model = _BufferScaled().double()
    cm = pathir.compile(model, input_shape=SHAPE)
    calls = _lowerings(monkeypatch)
    with torch.no_grad():
        model.scale.mul_(3.0)
    with pytest.raises(ModelChanged, match="no longer lowers to the same graph"):
        cm.path_norm(1)  # the fixed map prints its factors: another graph (a re-read would be stale)
    assert calls


def test_train_mode_moves_num_batches_tracked_and_is_lowered_again_exactly(monkeypatch):
    model = _net()  # train mode: running stats and num_batches_tracked move
    cm = pathir.compile(model, input_shape=SHAPE)
    calls = _lowerings(monkeypatch)
    _train_step(model, torch.optim.SGD(model.parameters(), lr=0.05), 0)
    cm.path_norm(2)
    assert calls
    _assert_same_graph(cm, model)


def test_a_pruned_weight_then_a_bias_step_is_lowered_again():
    model = _net().eval()
    cm = pathir.compile(model, input_shape=SHAPE)
    cm.prune(0.3)
    with torch.no_grad():
        model[8].bias.add_(1.0)  # a recipe input moved, but '0.weight' is now pruning's weight_orig
    _assert_same_graph(cm, model)


# random models and edits: a followed Compiled is, bit for bit, a fresh compile


def _random_net(draw):
    from hypothesis import strategies as st

    torch.manual_seed(draw(st.integers(0, 2**16)))
    layers, channels = [], 3
    for _ in range(draw(st.integers(1, 3))):
        out = draw(st.integers(1, 4))
        layers.append(nn.Conv2d(channels, out, 3, padding=draw(st.integers(0, 1)), bias=draw(st.booleans())))
        if draw(st.booleans()):
            bn = nn.BatchNorm2d(out)
            with torch.no_grad():
                bn.running_mean.normal_()
                bn.running_var.uniform_(0.5, 2.0)
                bn.weight.normal_()
                bn.bias.normal_()
            layers.append(bn)
        layers.append(nn.ReLU())
        channels = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 2, bias=draw(st.booleans()))]
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    return nn.Sequential(*layers).to(dtype).eval()


def test_random_models_and_edits_follow_exactly():
    from hypothesis import given
    from hypothesis import strategies as st

    @given(st.data())
    def check(data):
        model = _random_net(data.draw)
        cm = pathir.compile(model, input_shape=SHAPE, self_check=False)
        named = dict(model.named_parameters()) | {k: v for k, v in model.named_buffers() if "running" in k}
        for _ in range(data.draw(st.integers(1, 3))):
            name = data.draw(st.sampled_from(sorted(named)))
            kind = data.draw(st.sampled_from(["scale", "noise", "replace", "sgd"]))
            t = dict(model.named_parameters()).get(name, named[name])
            with torch.no_grad():
                if kind == "scale":
                    t.mul_(data.draw(st.floats(0.1, 3.0)))
                elif kind == "noise" or "running" in name:
                    t.add_(torch.rand_like(t))
                elif kind == "replace":
                    module, _, attr = name.rpartition(".")
                    setattr(model.get_submodule(module), attr, nn.Parameter(torch.randn_like(t)))
            if kind == "sgd":
                opt = torch.optim.SGD(model.parameters(), lr=0.01)
                model(torch.randn(2, *SHAPE, dtype=next(model.parameters()).dtype)).pow(2).mean().backward()
                opt.step()
            fresh = _assert_same_graph(cm, model)
            assert cm.path_norm(2) == pytest.approx(fresh.path_norm(2), rel=1e-12)

    check()


def test_a_rescaling_method_compares_the_model_once_and_the_next_query_sees_a_later_edit(monkeypatch):
    from pathir.frontends.torch.live import ModelWatch

    model = _net().eval()
    cm = pathir.compile(model, input_shape=SHAPE)
    looks = []
    real = ModelWatch.changed
    monkeypatch.setattr(ModelWatch, "changed", lambda self: looks.append(1) or real(self))
    cm.pathcond()
    assert len(looks) <= 2  # once at the first query, once after its own write-back
    with torch.no_grad():
        model[0].weight.mul_(3.0)  # the user's edit after the call
    assert cm.path_norm(2.0) == pytest.approx(_fresh(model), rel=1e-12)
    cm.pathcond()
    assert cm.path_norm(2.0) == pytest.approx(_fresh(model), rel=1e-12)  # the write-back is followed too


def test_a_global_module_hook_or_a_replaced_forward_after_compile_is_a_structural_change():
    """Neither was watched: the Compiled kept answering for the old model (l1 4.57 against 31.9), silently."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2)).double()
    cm = pathir.compile(net, input_shape=(4,))
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: o * 2)
    try:
        with pytest.raises(ModelChanged, match="global module hook"):
            cm.path_norm(1)
    finally:
        handle.remove()
    cm = pathir.compile(net, input_shape=(4,))
    net[2].forward = lambda x: F.linear(x, 2 * net[2].weight, net[2].bias)
    with pytest.raises(ModelChanged, match="forward of '2'"):
        cm.path_norm(1)


def test_one_parameter_held_by_two_modules_is_one_param_of_the_graph():
    """b.weight = a.weight: two names, one tensor. It was two params (8 free units), and every rescaling was
    then refused as 'one tensor rescaled differently'; now its uses tie, as for one module called twice."""
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.c(torch.relu(self.b(torch.relu(self.a(x)))))

    torch.manual_seed(0)
    net = Tied().double()
    cm = pathir.compile(net, input_shape=(4,))
    assert "b.weight" not in {p.name for p in cm.graph.params()} and len(cm.units) == 0
    x = torch.randn(5, 4, dtype=torch.float64)
    np.testing.assert_allclose(cm.forward(x.numpy()), net(x).detach().numpy(), rtol=1e-12, atol=1e-12)
    cm.pathcond()  # nothing to move, nothing refused


def test_a_structural_change_is_named_as_what_it_is():
    """A parametrization added after compile was reported as '3' (ReLU) replaced by '2.parametrizations', a
    class swap as a changed setting 'in_features' (to None)."""
    import torch.nn.utils.parametrize as P

    class Same(nn.Module):
        def forward(self, w):
            return w

    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2), nn.ReLU()).double()
    cm = pathir.compile(net, input_shape=(4,))
    P.register_parametrization(net[2], "weight", Same())
    with pytest.raises(ModelChanged, match="modules were added: '2.parametrizations'"):
        cm.path_norm(1)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).double()
    cm = pathir.compile(net, input_shape=(4,))
    net[2].__class__ = type("MyLinear", (nn.Linear,), {})
    with pytest.raises(ModelChanged, match="class of '2' changed from Linear to MyLinear"):
        cm.path_norm(1)


@pytest.mark.parametrize("swap", ["forward hook", "pre-hook for a hook", "root hook"])
def test_a_hook_removed_and_another_registered_is_a_structural_change(swap):
    """The watch counted hooks: one removed and one added looked unchanged, and forward and path-norms were
    the compile-time ones (path_norm(1) 4.06 where the model's own is 6.03)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    where = net if swap == "root hook" else net[0]
    if swap == "pre-hook for a hook":
        handle = where.register_forward_pre_hook(lambda m, i: (i[0] * 2,))
    else:
        handle = where.register_forward_hook(lambda m, i, o: o * 2)
    cm = pathir.compile(net, input_shape=(3,))
    cm.path_norm(1)
    handle.remove()
    where.register_forward_hook(lambda m, i, o: o * 3)
    with pytest.raises(ModelChanged, match="hooks were added to or removed from"):
        cm.path_norm(1)


@pytest.mark.parametrize("edit", ["new attribute None", "setting deleted and set again"])
def test_a_setting_set_again_or_a_new_plain_attribute_never_crashes_the_watch(edit):
    """A new attribute set to None (or a setting deleted and set again, which moved its place in the
    module's __dict__) made the watch's settings differ with no key that differs: a bare StopIteration."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    cm = pathir.compile(net, input_shape=(3,))
    norm = cm.path_norm(1)
    if edit == "new attribute None":
        net[0].tag = None
        with pytest.raises(ModelChanged, match="the setting 'tag' of '0' \\(Linear\\) changed from unset to None"):
            cm.path_norm(1)
    else:
        features = net[0].in_features
        del net[0].in_features
        net[0].in_features = features
        assert cm.path_norm(1) == norm


def test_after_pruning_every_write_back_leaves_the_model_as_written_for_the_next_query():
    """A pruned weight is made by its hook, so the write kept the float64 rescaled graph instead of re-reading the
    float32 model: cm.path_norm drifted from the model's by 5e-9, 2e-8, 2e-8 after normalize, pathcond, enorm."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(),
                              torch.nn.Linear(8, 3))
    cm = pathir.compile(net, input_shape=(6,))
    cm.prune(0.3)
    x = torch.randn(4, 6)
    for method in ("normalize", "pathcond", "enorm"):
        getattr(cm, method)()
        fresh = pathir.compile(net, input_shape=(6,), self_check=False)
        assert cm.path_norm(1) == fresh.path_norm(1)
        np.testing.assert_array_equal(cm.forward(x.double().numpy(), backend="numpy"),
                                      fresh.forward(x.double().numpy(), backend="numpy"))


def test_a_buffer_edited_then_a_write_back_leaves_the_compiled_on_the_model_as_it_is():
    """A buffer read as a fixed matrix, edited after compile, was followed by a full trace; a later write-back's
    re-read started from the compile-time recipe again, and the Compiled answered for the old buffer (7.41 for 22.24)."""

    class Projected(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.a = torch.nn.Linear(3, 5), torch.nn.Linear(5, 4)
            self.register_buffer("B", torch.randn(4, 2))

        def forward(self, x):
            return torch.relu(self.a(torch.relu(self.c(x)))) @ self.B

    torch.manual_seed(0)
    net = Projected()
    cm = pathir.compile(net, input_shape=(3,))
    with torch.no_grad():
        net.B.mul_(3)
    x = torch.randn(6, 3)
    for method in ("pathcond", "enorm"):
        getattr(cm, method)()
        fresh = pathir.compile(net, input_shape=(3,), self_check=False)
        assert cm.path_norm(1) == pytest.approx(fresh.path_norm(1), rel=1e-12)
        np.testing.assert_allclose(cm.forward(x.double().numpy(), backend="numpy"), net(x).detach().double().numpy(),
                                   rtol=1e-5, atol=1e-6)


def test_the_export_path_follows_its_model_after_a_write_that_made_a_clipped_relu_per_channel():
    """Found by review: after pathcond replaced an nn.ReLU6 by pathir.nn.ClippedReLU, the next weight change made
    every query raise ModelChanged on the torch.export path: the graph kept after the write names the clip's nodes
    as the first trace did (hardtanh), the model lowered again as it is now (minimum)."""
    from torch_programs import export_path

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.c, self.act = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3), torch.nn.ReLU6()

        def forward(self, x):
            return self.c(self.act(self.a(x)))

    torch.manual_seed(0)
    model = Net().double()
    with export_path():
        cm = pathir.compile(model, input_shape=(4,))
        cm.pathcond(progress=False)
        with torch.no_grad():
            model.a.weight.mul_(1.1)
        assert cm.path_norm(1) == pytest.approx(pathir.compile(model, input_shape=(4,)).path_norm(1), rel=1e-12)


def test_after_such_a_write_a_fixed_factor_changed_in_place_is_read_again():
    """Found by the review of the fix above: its first version kept the graph's fixed maps and re-read the params
    only, so a buffer used as a fixed factor (h * self.scale), changed in place after the write, kept its old value:
    path_norm(1) 13.98 where the model's is 79.35, the forward off by 0.93 of max|output| 0.80."""
    from torch_programs import export_path

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.act, self.c = torch.nn.Linear(4, 4), torch.nn.ReLU6(), torch.nn.Linear(4, 3)
            self.register_buffer("scale", torch.tensor(0.5))

        def forward(self, x):
            return self.c(self.act(self.a(x)) * self.scale)

    torch.manual_seed(0)
    model = Net().double()
    x = torch.randn(5, 4, dtype=torch.float64)
    with export_path():
        cm = pathir.compile(model, input_shape=(4,))
        cm.pathcond(progress=False)
        with torch.no_grad():
            model.scale.fill_(3.0)
        y = model(x).detach().numpy()
        assert np.allclose(cm.forward(x.numpy(), backend="numpy"), y, rtol=1e-12, atol=1e-14)
        fresh = pathir.compile(model, input_shape=(4,)).path_norm(1)
        assert cm.path_norm(1) == pytest.approx(fresh, rel=1e-12)
