"""Clipped ReLUs min(max(x, 0), t) are lowered exactly (ReLU(x) − ReLU(ReLU(x) − t), the threshold −t a
bias of the unit) and written back per channel. Every check is against the definition: the model's own
float64 forward (fx and export paths), onnxruntime, path enumeration, and the path-lifting of the
clipped network written out by hand below (the threshold as a bias path)."""

from __future__ import annotations

import contextlib
import copy
import io
import math
import warnings
from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pathir
from pathir.backends import get_backend
from pathir.errors import PathirError, UnsupportedOperation
from pathir.frontends.torch.clipped import clipped_to_relu
from pathir.frontends.torch.export import lower_exported
from pathir.lifting.walk import forward
from pathir.neurons.paths import enumerate_num_paths, enumerate_path_norm, lifted_output
from pathir.nn import ClippedReLU

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def _x(*shape, scale=3.0, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def _eager(model, x):
    with torch.no_grad():
        return model(x).numpy()


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


# ====================================================================== the models


class Functional(nn.Module):
    """Every spelling of a clipped ReLU a forward may use, after conv layers."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        self.c1, self.c2 = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 5 * 5, 2)
        self.register_buffer("t", torch.tensor([0.5, 1.0, 2.0]).reshape(3, 1, 1))

    def forward(self, x):
        h = self.op(self, self.c1(x))
        return self.fc(torch.flatten(self.op(self, self.c2(h)), 1))


SPELLINGS = {
    "F.relu6": lambda m, h: F.relu6(h),
    "F.hardtanh(0, t)": lambda m, h: F.hardtanh(h, 0.0, 1.5),
    "torch.clamp(x, 0, t)": lambda m, h: torch.clamp(h, 0, 2.5),
    "clamp(min=0, max=t)": lambda m, h: h.clamp(min=0.0, max=0.8),
    "minimum(relu, buffer)": lambda m, h: torch.minimum(torch.relu(h), m.t),
}


def _modules_net(act):
    return nn.Sequential(OrderedDict(
        c1=nn.Conv2d(2, 4, 3, padding=1), bn=nn.BatchNorm2d(4), a1=act(4), c2=nn.Conv2d(4, 3, 3), a2=act(3),
        flat=nn.Flatten(), fc=nn.Linear(3 * 3 * 3, 2)))


ACTS = {
    "nn.ReLU6": lambda c: nn.ReLU6(),
    "nn.Hardtanh(0, t)": lambda c: nn.Hardtanh(0.0, 1.5),
    "ClippedReLU": lambda c: ClippedReLU(torch.linspace(0.5, 2.0, c)),
}


def _randomized(model, seed=0):
    torch.manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return model.double().eval()


# ====================================================================== forward: the definition


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_functional_spellings_match_eager_on_both_capture_paths(name):
    torch.manual_seed(0)
    model = Functional(SPELLINGS[name]).double().eval()
    x = _x(4, 2, 5, 5)
    ref = _eager(model, x)
    assert np.abs(ref).max() > 0
    cm = pathir.compile(model, input_shape=(2, 5, 5))
    assert _rel(cm.forward(x.numpy(), backend="numpy"), ref) <= 1e-12
    assert sum(n.name.endswith(".excess") for n in cm.graph.nodes) == 2
    graph = lower_exported(model, (2, 5, 5), "export")
    assert _rel(forward(graph, get_backend("numpy"), x.numpy())[graph.outputs[0]], ref) <= 1e-12


@pytest.mark.parametrize("name", list(ACTS))
def test_modules_match_eager_and_saturate(name):
    torch.manual_seed(1)
    model = _randomized(_modules_net(ACTS[name]))
    x = _x(4, 2, 5, 5, scale=5.0)
    with torch.no_grad():
        pre = model.bn(model.c1(x))
        assert float(model.a1(pre).amax()) < float(pre.amax())  # some activations clip
    ref = _eager(model, x)
    cm = pathir.compile(model, input_shape=(2, 5, 5))
    assert _rel(cm.forward(x.numpy(), backend="numpy"), ref) <= 1e-12
    graph = lower_exported(model, (2, 5, 5), "export")
    assert _rel(forward(graph, get_backend("numpy"), x.numpy())[graph.outputs[0]], ref) <= 1e-12


def test_the_ir_shape_of_a_clipped_relu():
    torch.manual_seed(0)
    net = nn.Sequential(OrderedDict(fc1=nn.Linear(2, 3), act=nn.ReLU6(), fc2=nn.Linear(3, 1))).double()
    cm = pathir.compile(net, input_shape=(2,))
    lines = str(cm.graph).splitlines()[2:]
    assert lines[0].split(": ")[1] == "relu[3] = dense(fc1.weight)(input_1) + bias(fc1.bias)"
    assert lines[1].split(": ")[1] == "relu[3] = identity(act.relu) + bias(act.threshold)"
    assert lines[2].startswith("  3  act: identity[3] = identity(act.relu) + ")  # + a fixed −1 edge from act.excess
    p = cm.graph.node("act.excess").bias
    assert p.value.tolist() == [-6.0, -6.0, -6.0]
    assert [(r.name, r.role.value) for r in p.sources] == [("act.threshold", "clip_threshold")]
    # one unit per channel: fc1's row, its bias and the threshold in, fc2's column out
    assert len(cm.units) == 3 and sorted(n for n, _ in cm.units.members[0]) == ["act", "act.excess", "act.relu"]
    assert {p.name: idx.size for p, idx in cm.units[0].incoming} == {"fc1.weight": 2, "fc1.bias": 1, "act.threshold": 1}
    # not a model parameter
    assert cm.source_num_params == sum(p.numel() for p in net.parameters()) == cm.graph.num_params() - 3


def test_onnx_clip_and_min_match_onnxruntime():
    from onnx_cases import export, ort_run, rel

    torch.manual_seed(0)
    net = _randomized(_modules_net(ACTS["nn.ReLU6"])).float()
    mixed = nn.Sequential(nn.Conv2d(2, 3, 3), ClippedReLU(torch.tensor([0.2, 0.4, 0.6])), nn.Flatten(),
                          nn.Linear(27, 2)).eval()
    x = (np.random.default_rng(0).normal(size=(4, 2, 5, 5)) * 4).astype(np.float32)
    for model in (net, mixed):
        for exporter in ("legacy", "dynamo"):
            proto = export(model, (2, 5, 5), exporter)
            ops = {n.op_type for n in proto.graph.node}
            assert ("Clip" in ops) if model is net else ("Min" in ops)
            cm = pathir.compile(proto)
            assert rel(cm.forward(x, backend="numpy"), ort_run(proto, x)[0]) <= 1e-5
            assert rel(ort_run(proto, x)[0], model(torch.from_numpy(x)).detach().numpy()) <= 1e-5


# ====================================================================== path-lifting: the definition


def _reference_lq(W1, b1, t, W2, b2, q):
    """Σ_p |Φ_p|^q of Linear -> min(max(·, 0), t) -> Linear written as the ReLU DAG A = ReLU(W1 x + b1),
    B = ReLU(A − t), out = A − B: each input and each bias of A reaches out through A (+1) and through B
    (−1); B's bias −t reaches out through −1; then W2, then b2."""
    a2 = np.abs(W2) ** q  # (o, h)
    return (2 * np.sum(a2 @ (np.abs(W1) ** q)) + 2 * np.sum(a2 * np.abs(b1) ** q) + np.sum(a2 * np.abs(t) ** q)
            + np.sum(np.abs(b2) ** q))


@pytest.mark.parametrize("act", ["relu6", "per-channel"])
def test_path_norms_count_and_diag_g_equal_the_definition(act):
    torch.manual_seed(3)
    d, h, o = 3, 4, 2
    t = np.full(h, 6.0) if act == "relu6" else np.array([0.5, 1.0, 1.5, 2.0])
    layer = nn.ReLU6() if act == "relu6" else ClippedReLU(torch.tensor(t), spatial_dims=0)
    net = nn.Sequential(OrderedDict(fc1=nn.Linear(d, h), act=layer, fc2=nn.Linear(h, o))).double()
    W1, b1 = net.fc1.weight.detach().numpy(), net.fc1.bias.detach().numpy()
    W2, b2 = net.fc2.weight.detach().numpy(), net.fc2.bias.detach().numpy()
    cm = pathir.compile(net, input_shape=(d,))
    for q in (1, 2, 0.5):
        ref = _reference_lq(W1, b1, t, W2, b2, q) ** (1 / q)
        assert cm.path_norm(q) == pytest.approx(ref, rel=1e-12)
        assert enumerate_path_norm(cm.graph, q) == pytest.approx(ref, rel=1e-12)
    count = 2 * o * h * d + 2 * o * h + o * h + o
    assert cm.num_paths() == count == enumerate_num_paths(cm.graph)
    # diag G by definition: g_i = Σ_{p ∋ i} (Φ_p / θ_i)², the other factors of each path squared
    col = (W2**2).sum(0)  # Σ_k W2[k, j]²
    g = cm.diag_g()
    np.testing.assert_allclose(g["fc1.weight"], np.repeat(2 * col[:, None], d, 1), rtol=1e-12)
    np.testing.assert_allclose(g["fc1.bias"], 2 * col, rtol=1e-12)
    np.testing.assert_allclose(g["act.threshold"], col, rtol=1e-12)  # one path per output: B's bias, −1, W2
    np.testing.assert_allclose(g["fc2.weight"], np.broadcast_to(2 * (W1**2).sum(1) + 2 * b1**2 + t**2, (o, h)),
                               rtol=1e-12)
    np.testing.assert_allclose(g["fc2.bias"], np.ones(o), rtol=1e-12)
    # path-magnitude scores: S(threshold j) = Σ_k |W2[k, j]| t_j
    np.testing.assert_allclose(cm.path_magnitude_scores()["act.threshold"], np.abs(W2).sum(0) * t, rtol=1e-12)


def test_lifting_identity_and_enumeration_on_a_conv_net():
    torch.manual_seed(2)
    net = nn.Sequential(nn.Conv2d(1, 2, 2), nn.ReLU6(), nn.Conv2d(2, 2, 2), nn.Hardtanh(0.0, 0.7), nn.Flatten(),
                        nn.Linear(2, 1)).double().eval()
    with torch.no_grad():
        net[0].weight.mul_(8)
    cm = pathir.compile(net, input_shape=(1, 3, 3))
    x = _x(6, 1, 3, 3, scale=2.0)
    ref = _eager(net, x)
    assert np.allclose(lifted_output(cm.graph, x.numpy())[cm.graph.outputs[0]], ref, rtol=1e-12, atol=1e-12)
    for q in (1, 2):
        assert cm.path_norm(q) == pytest.approx(enumerate_path_norm(cm.graph, q), rel=1e-12)
    assert cm.num_paths() == enumerate_num_paths(cm.graph)


# ====================================================================== write-back (torch)


def _check_rewritten(model, cm, x, before, shape):
    after = _eager(model, x)
    assert _rel(after, before) <= 1e-9
    clipped = [m for m in model.modules() if isinstance(m, ClippedReLU)]
    assert clipped and not any(type(m) in (nn.ReLU6, nn.Hardtanh) for m in model.modules())
    assert any(len(set(m.threshold.reshape(-1).tolist())) > 1 for m in clipped)  # per channel
    again = pathir.compile(model, input_shape=shape, self_check=False)  # checked against eager below
    assert _rel(again.forward(x.numpy(), backend="numpy"), after) <= 1e-12
    for q in (1, 2):
        assert again.path_norm(q) == pytest.approx(cm.path_norm(q), rel=1e-10)
    return again


@pytest.mark.parametrize("name", list(ACTS))
def test_pathcond_writes_per_channel_thresholds_and_keeps_the_function(name):
    torch.manual_seed(4)
    model = _randomized(_modules_net(ACTS[name]))
    x = _x(4, 2, 5, 5, scale=5.0)
    before = _eager(model, x)
    cm = pathir.compile(model, input_shape=(2, 5, 5))
    norms = [cm.path_norm(q) for q in (1, 2)]
    cm.pathcond()
    assert [cm.path_norm(q) for q in (1, 2)] == pytest.approx(norms, rel=1e-10)  # Φ is rescaling-invariant
    _check_rewritten(model, cm, x, before, (2, 5, 5))
    # the Compiled follows the rewritten model: a weight edited in place is re-read
    with torch.no_grad():
        model.c1.weight.mul_(1.5)
    assert cm.path_norm(1) == pytest.approx(pathir.compile(model, input_shape=(2, 5, 5)).path_norm(1), rel=1e-12)


def test_a_factor_of_one_keeps_the_module_and_a_uniform_one_too_replaces_it():
    torch.manual_seed(5)
    model = _randomized(_modules_net(ACTS["nn.ReLU6"]))
    cm = pathir.compile(model, input_shape=(2, 5, 5))
    cm.commit_rescaling(np.zeros(len(cm.units)))
    assert isinstance(model.a1, nn.ReLU6) and isinstance(model.a2, nn.ReLU6)
    x = _x(3, 2, 5, 5)
    before = _eager(model, x)
    z = np.zeros(len(cm.units))
    z[[cm.units.channel_units["a2"][c] for c in range(3)]] = math.log(3.0)
    cm.commit_rescaling(z)
    assert isinstance(model.a1, nn.ReLU6) and isinstance(model.a2, ClippedReLU)
    assert model.a2.threshold.reshape(-1).tolist() == pytest.approx([6 * math.sqrt(3.0)] * 3, rel=1e-12)
    assert _rel(_eager(model, x), before) <= 1e-12


def test_export_path_writes_back_too():
    class Shapes(nn.Module):  # Python control flow on a shape: torch.fx cannot trace it
        def __init__(self):
            super().__init__()
            self.c, self.act, self.fc = nn.Conv2d(2, 3, 3), nn.ReLU6(), nn.Linear(27, 2)

        def forward(self, x):
            h = self.act(self.c(x) * 3)
            if h.shape[-1] > 2:
                h = h.flatten(1)
            return self.fc(h)

    torch.manual_seed(6)
    model = Shapes().double().eval()
    x = _x(3, 2, 5, 5)
    before = _eager(model, x)
    cm = pathir.compile(model, input_shape=(2, 5, 5))
    assert "act.threshold" in cm.diag_g()
    cm.commit_rescaling(np.random.default_rng(0).normal(size=len(cm.units)))
    assert isinstance(model.act, ClippedReLU) and _rel(_eager(model, x), before) <= 1e-12


def test_a_module_called_twice_shares_its_threshold_and_ties_its_units():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.act, self.fc = nn.Linear(3, 4), nn.Linear(4, 4), nn.ReLU6(), nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(self.act(self.b(self.act(self.a(x) * 4)) * 4))

    torch.manual_seed(7)
    model = Twice().double().eval()
    x = _x(8, 3)
    before = _eager(model, x)
    cm = pathir.compile(model, input_shape=(3,))
    assert [p.name for p in cm.graph.params()].count("act.threshold") == 1
    assert len(cm.units) == 4  # channel c of both calls is one unit: one threshold per channel
    cm.pathcond()
    assert isinstance(model.act, ClippedReLU) and _rel(_eager(model, x), before) <= 1e-12


class _Reused(nn.Module):
    """One nn.ReLU6 after a conv (4-d) and after a linear layer of ``width`` features (2-d)."""

    def __init__(self, width):
        super().__init__()
        self.c, self.act = nn.Conv2d(1, 3, 3), nn.ReLU6()
        self.fc, self.out = nn.Linear(27, width), nn.Linear(width, 2)

    def forward(self, x):
        return self.out(self.act(self.fc(self.act(self.c(x) * 4).flatten(1)) * 4))


@pytest.mark.parametrize("width", [3, 5])
def test_a_module_called_on_tensors_of_several_ranks_or_widths_is_held(width):
    """One module holds one threshold per channel for one rank: called after a conv (4-d, 3 channels) and a linear
    layer (2-d, 3 or 5 features), no per-channel write fits both calls. PathCond solved, then was refused at
    write-back; those channels are now no unit (held), so every rescaling pathir finds is written."""
    torch.manual_seed(14)
    model = _Reused(width).double().eval()
    x = _x(4, 1, 5, 5)
    before = _eager(model, x)
    cm = pathir.compile(model, input_shape=(1, 5, 5))
    assert _rel(cm.forward(x.numpy(), backend="numpy"), before) <= 1e-12
    assert len(cm.units) == 0  # the conv's and the linear layer's channels are those the module clips
    cm.pathcond()
    assert type(model.act) is nn.ReLU6 and _rel(_eager(model, x), before) <= 1e-12


def test_a_functional_clip_is_held_where_it_is():
    """F.relu6 holds 6 in the code: a rescaled per-channel threshold has nowhere to go. PathCond solved, then was
    refused at write-back; the clip's channels are now no unit (both hidden layers here: nothing moves)."""
    torch.manual_seed(8)
    model = Functional(SPELLINGS["F.relu6"]).double().eval()
    plain = Functional(SPELLINGS["F.relu6"]).double().eval()
    plain.load_state_dict(model.state_dict())
    x = _x(4, 2, 5, 5)
    before = _eager(model, x)
    cm = pathir.compile(model, input_shape=(2, 5, 5))
    norm = cm.path_norm(1)
    assert len(cm.units) == 0
    cm.pathcond()
    assert _rel(_eager(model, x), before) <= 1e-12
    assert "relu6.threshold" in cm.diag_g()  # analyses stay exact
    assert pathir.compile(plain, input_shape=(2, 5, 5)).path_norm(1) == pytest.approx(norm, rel=1e-12)


def test_a_failed_transaction_puts_the_replaced_modules_back(monkeypatch):
    from pathir.rescaling import commit

    torch.manual_seed(9)
    model = _randomized(_modules_net(ACTS["nn.ReLU6"]))
    cm = pathir.compile(model, input_shape=(2, 5, 5))
    state = copy.deepcopy(model.state_dict())
    a1 = model.a1

    def broken(*args):
        assert isinstance(model.a1, ClippedReLU)  # the writer replaced it, then something failed
        raise PathirError("a value broke")

    monkeypatch.setattr(commit, "_check_values", broken)
    with pytest.raises(PathirError, match="a value broke"):
        cm.commit_rescaling(np.random.default_rng(1).normal(size=len(cm.units)))
    assert model.a1 is a1 and set(model.state_dict()) == set(state)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_refusals_keep_their_reasons():
    torch.manual_seed(10)
    for op, match in [(lambda m, h: torch.clamp(h, 0.5, 6.0), r"clamp.*lower bound other than 0"),
                      (lambda m, h: F.hardtanh(h, -1.0, 1.0), r"hardtanh.*clips below"),
                      (lambda m, h: torch.clamp(h, 0.0, -1.0), r"negative threshold"),
                      (lambda m, h: torch.minimum(h, m.t), r"minimum.*min\(ReLU\(x\), t\)")]:
        with pytest.raises(UnsupportedOperation, match=match):
            pathir.compile(Functional(op).double(), input_shape=(2, 5, 5))


def test_thresholds_are_no_pruning_candidates_and_pathsgd_steps():
    torch.manual_seed(11)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU6(), nn.Linear(4, 2)).double()
    cm = pathir.compile(net, input_shape=(3,))
    report = cm.prune(0.5, include_biases=True)
    assert report.candidates == 26 and "1.threshold" not in report.per_tensor  # 12 + 4 + 8 + 2: no threshold
    assert isinstance(net[1], nn.ReLU6)
    opt = pathir.optim.PathSGD(net.parameters(), compiled=cm, lr=0.01)
    net(_x(8, 3)).pow(2).sum().backward()
    opt.step()


def test_clipped_to_relu_reports_the_change():
    torch.manual_seed(12)
    model = _randomized(_modules_net(ACTS["nn.ReLU6"]))
    small, large = _x(4, 2, 5, 5, scale=1e-3), _x(4, 2, 5, 5, scale=50.0)
    twin = copy.deepcopy(model)
    swap = clipped_to_relu(model, small)
    assert swap.replaced == ["a1", "a2"] and swap.max_abs_change == 0.0
    assert all(type(m) is nn.ReLU for m in (model.a1, model.a2))
    assert clipped_to_relu(twin, large).max_rel_change > 0.01
    assert not model.training


# ====================================================================== replacing a module: names, hooks, flags


class _Aliased(nn.Module):
    """One nn.ReLU6 registered as ``act`` and as ``body[1]``; the forward calls it as ``body[1]``."""

    def __init__(self, act):
        super().__init__()
        self.act = act
        self.body = nn.Sequential(nn.Linear(6, 8), self.act, nn.Linear(8, 2))

    def forward(self, x):
        return self.body(x)


def _spread_rows(model, first):
    """Rows of ``first``'s weight over 2.5 decades: equalization moves every channel, activations pass 6."""
    with torch.no_grad():
        first.weight.mul_(torch.logspace(-1, 1.5, first.weight.shape[0], dtype=torch.float64).reshape(-1, 1))
    return model


def _relu_twin(model):
    """The definition of relu6="relu": a deep copy with every clipped ReLU module, under every name,
    one nn.ReLU (the copy keeps the aliasing; no pathir code involved)."""
    twin = copy.deepcopy(model)
    relus = {}
    for path, m in list(twin.named_modules(remove_duplicate=False)):
        if type(m) in (nn.ReLU6, nn.Hardtanh):
            parent, _, attr = path.rpartition(".")
            setattr(twin.get_submodule(parent), attr, relus.setdefault(id(m), nn.ReLU()))
    return twin


@pytest.mark.parametrize("relu6", ["clip", "relu"])
def test_a_module_under_two_names_is_replaced_under_both(relu6):
    torch.manual_seed(0)
    model = _Aliased(nn.ReLU6()).double()
    _spread_rows(model, model.body[0])
    x = _x(64, 6)
    definition = copy.deepcopy(model) if relu6 == "clip" else _relu_twin(model)
    original = _eager(copy.deepcopy(model), x)
    report = pathir.equalize(model, input_shape=(6,), relu6=relu6, progress=False, inputs=x)
    assert model.act is model.body[1]  # still one module under two names
    assert type(model.act) is (ClippedReLU if relu6 == "clip" else nn.ReLU)
    assert _rel(_eager(model, x), _eager(definition, x)) <= 1e-9
    if relu6 == "relu":  # the change reported is the swap's, measured on the inputs
        assert report.relu_change == pytest.approx(_rel(_eager(definition, x), original), rel=1e-6)
        assert report.relu_change > 0.1


HOOKS = {
    "forward": lambda m: m.register_forward_hook(lambda mod, args, out: out * 2.0),
    "forward with kwargs": lambda m: m.register_forward_hook(lambda mod, args, kw, out: out * 2.0, with_kwargs=True),
    "forward always called": lambda m: m.register_forward_hook(lambda mod, args, out: out * 2.0, always_call=True),
    "pre": lambda m: m.register_forward_pre_hook(lambda mod, args: (args[0] * 0.5,)),
    "pre with kwargs": lambda m: m.register_forward_pre_hook(lambda mod, args, kw: ((args[0] * 0.5,), kw),
                                                             with_kwargs=True),
    "backward": lambda m: m.register_full_backward_hook(lambda mod, gin, gout: (gin[0] * 2.0,)),
    "backward pre": lambda m: m.register_full_backward_pre_hook(lambda mod, gout: (gout[0] * 2.0,)),
}


def _value_and_grad(model, x):
    x = x.clone().requires_grad_(True)
    y = model(x)
    y.sum().backward()
    return y.detach().numpy(), x.grad.numpy()


@pytest.mark.parametrize("relu6", ["clip", "relu"])
@pytest.mark.parametrize("kind", list(HOOKS))
def test_hooks_of_a_replaced_module_are_carried_and_their_handles_still_work(kind, relu6):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU6(), nn.Linear(8, 2)).double().eval()
    _spread_rows(model, model[0])
    bare = copy.deepcopy(model) if relu6 == "clip" else _relu_twin(model)
    handle = HOOKS[kind](model[1])
    definition = copy.deepcopy(bare)
    HOOKS[kind](definition[1])  # the same hook on the definition's own module
    x = _x(64, 6)
    pathir.equalize(model, input_shape=(6,), relu6=relu6, progress=False)
    assert type(model[1]) is (ClippedReLU if relu6 == "clip" else nn.ReLU)
    (y, g), (y_def, g_def) = _value_and_grad(model, x), _value_and_grad(definition, x)
    assert _rel(y, y_def) <= 1e-9 and _rel(g, g_def) <= 1e-9  # the hook runs on the replacement
    handle.remove()  # the user's handle removes it from the replacement
    (y, g), (y_bare, g_bare) = _value_and_grad(model, x), _value_and_grad(bare, x)
    assert _rel(y, y_bare) <= 1e-9 and _rel(g, g_bare) <= 1e-9


def test_a_hook_bound_to_the_module_is_refused_and_nothing_changes():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU6(), nn.Linear(8, 2)).double().eval()
    _spread_rows(model, model[0])
    model[1].register_state_dict_post_hook(lambda mod, state, prefix, meta: None)
    act, state = model[1], copy.deepcopy(model.state_dict())
    for relu6 in ("clip", "relu"):
        with pytest.raises(PathirError, match=r"'1' \(ReLU6\) has hooks in _state_dict_hooks"):
            pathir.equalize(model, input_shape=(6,), relu6=relu6, progress=False)
        assert model[1] is act and all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def _flags(model):
    return {path: m.training for path, m in model.named_modules()}


@pytest.mark.parametrize("relu6", ["clip", "relu"])
def test_every_train_eval_flag_is_kept_on_success_and_on_refusal(relu6):
    torch.manual_seed(3)
    ok = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU6(), nn.Linear(8, 2), nn.ReLU6(), nn.Linear(2, 2))
    refused = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU6(), nn.Linear(8, 2), nn.Sigmoid())
    for model in (ok, refused):
        _spread_rows(model.double(), model[0])
        model.train()
        model[1].eval()
        model[2].eval()  # the replaced module's own flag goes to its replacement
    before = _flags(ok)
    x = _x(32, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # train mode with a batch-norm: analysed with its running statistics
        definition = _relu_twin(ok) if relu6 == "relu" else copy.deepcopy(ok)
        pathir.equalize(ok, input_shape=(6,), relu6=relu6, progress=False)
        assert _flags(ok) == before
        ok.eval(), definition.eval()
        assert _rel(_eager(ok, x), _eager(definition, x)) <= 1e-9
        before, state = _flags(refused), copy.deepcopy(refused.state_dict())
        with pytest.raises(PathirError):
            pathir.equalize(refused, input_shape=(6,), relu6=relu6, progress=False)
    assert _flags(refused) == before and type(refused[2]) is nn.ReLU6
    assert all(torch.equal(v, state[k]) for k, v in refused.state_dict().items())


# ====================================================================== write-back (ONNX)


def _onnx_export(model, shape, opset=17):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f = io.BytesIO()
        torch.onnx.export(model.eval(), (torch.randn(2, *shape),), f, dynamo=False, opset_version=opset,
                          input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    return onnx.load_from_string(f.getvalue())


def _ort(proto, x):
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def _check_onnx_round_trip(model, shape, batch=4):
    proto = _onnx_export(model.float(), shape)
    x = (np.random.default_rng(0).normal(size=(batch, *shape)) * 3).astype(np.float32)
    ref = _ort(proto, x)
    cm = pathir.compile(proto)
    norms = [cm.path_norm(q) for q in (1, 2)]
    cm.pathcond()
    new = cm.to_onnx()
    ops = [n.op_type for n in new.graph.node]
    assert "Clip" not in ops and ops.count("Min") == [n.op_type for n in proto.graph.node].count("Clip")
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in new.graph.initializer}
    for n in new.graph.node:
        if n.op_type == "Min":
            t = inits[n.input[1]]
            assert t.ndim == 4 and t.shape[0] == 1 and t.shape[2:] == (1, 1) and len(np.unique(t)) > 1
    assert _rel(_ort(new, x), ref) <= 1e-5
    again = pathir.compile(new)
    assert _rel(again.forward(x, backend="numpy"), ref) <= 1e-5
    assert [again.path_norm(q) for q in (1, 2)] == pytest.approx(norms, rel=1e-5)
    return cm


def test_onnx_pathcond_writes_relu_then_min_and_keeps_the_function():
    torch.manual_seed(13)
    cm = _check_onnx_round_trip(_randomized(_modules_net(ACTS["nn.ReLU6"])), (2, 5, 5))
    assert any(k.endswith(".threshold") for k in cm.diag_g())
    cm.pathcond()  # a second write-back rescales the Min constants
    assert "Clip" not in {n.op_type for n in cm.to_onnx().graph.node}


def test_onnx_clip_of_an_old_opset_is_lowered_but_its_rewrite_refused():
    from onnx_cases import make_model, node, tensor_info

    rng = np.random.default_rng(0)
    nodes = [node("MatMul", ["x", "W"], ["h"], name="fc"), node("Clip", ["h"], ["r"], name="clip", min=0.0, max=1.0),
             node("MatMul", ["r", "W2"], ["y"], name="out")]
    proto = make_model(nodes, [tensor_info("x", [2, 3])], [tensor_info("y", [2, 2])],
                       {"W": rng.normal(size=(3, 4)) * 3, "W2": rng.normal(size=(4, 2))}, opset=6)
    cm = pathir.compile(proto)
    x = rng.normal(size=(2, 3)).astype(np.float32)
    assert _rel(cm.forward(x, backend="numpy"), _ort(proto, x)) <= 1e-6
    with pytest.raises(PathirError, match="opset 6 has no broadcasting Min"):
        cm.commit_rescaling(np.ones(len(cm.units)))
    assert [n.op_type for n in cm.to_onnx().graph.node] == ["MatMul", "Clip", "MatMul"]


# ====================================================================== mobilenet_v2


@pytest.fixture(scope="module")
def mobilenet():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    return _randomized(torchvision.models.mobilenet_v2(weights=None), seed=0)


def test_mobilenet_v2_pathcond_keeps_its_function(mobilenet):
    model = copy.deepcopy(mobilenet)
    x = _x(2, 3, 64, 64, scale=1.0)
    before = _eager(model, x)
    cm = pathir.compile(model, input_shape=(3, 64, 64))
    n_relu6 = sum(isinstance(m, nn.ReLU6) for m in mobilenet.modules())
    assert n_relu6 == 35 and sum(k.endswith(".threshold") for k in cm.diag_g()) == n_relu6
    cm.pathcond()
    _check_rewritten(model, cm, x, before, (3, 64, 64))
    assert sum(isinstance(m, ClippedReLU) for m in model.modules()) == n_relu6


@pytest.mark.slow
def test_mobilenet_v2_onnx_round_trip(mobilenet):
    _check_onnx_round_trip(copy.deepcopy(mobilenet), (3, 64, 64), batch=2)


class _ListHeld(nn.Module):
    """A ReLU6 reached through a plain list (``registered``: also an attribute, so a submodule)."""

    def __init__(self, registered: bool):
        super().__init__()
        act = nn.ReLU6()
        if registered:
            self.act = act
        self.hidden = [act]
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 2)
        with torch.no_grad():
            self.a.weight.mul_(torch.logspace(-1, 1.5, 8).reshape(8, 1))

    def forward(self, x):
        return self.b(self.hidden[0](self.a(x)))


@pytest.mark.parametrize("relu6", ["clip", "relu"])
@pytest.mark.parametrize("registered", [True, False])
def test_a_clipped_relu_called_through_a_plain_list_is_refused_untouched(registered, relu6):
    """The writer replaces modules at their registered names only; one the forward reaches through a
    plain list would keep its old threshold under the rescaled weights (the function changed by 64 %):
    refused, with the model as it was (its tensors, its module tree, the list's module)."""
    torch.manual_seed(0)
    net = _ListHeld(registered)
    held = net.hidden[0]
    state = copy.deepcopy(net.state_dict())
    modules = [(n, id(m)) for n, m in net.named_modules(remove_duplicate=False)]
    x = torch.randn(5, 6) * 3
    y = net(x)
    if registered or relu6 == "relu":
        with pytest.raises(PathirError, match="outside the module tree|functional call|not a registered"):
            pathir.equalize(net, input_shape=(6,), relu6=relu6, progress=False)
        assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())
    else:  # fx traces the list's module as the call it makes: held where it is, the rest equalized
        pathir.equalize(net, input_shape=(6,), relu6=relu6, progress=False)
        assert torch.allclose(net(x), y, rtol=1e-5, atol=1e-5)
    assert net.hidden[0] is held and "forward" not in vars(held)
    assert [(n, id(m)) for n, m in net.named_modules(remove_duplicate=False)] == modules


def test_a_stateless_module_made_in_forward_is_traced_through_and_one_with_tensors_is_not_written():
    class Made(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.b(nn.ReLU()(self.a(x)))

    class Held(Made):
        def __init__(self):
            super().__init__()
            self.extra = [nn.Linear(2, 2)]

        def forward(self, x):
            return self.extra[0](super().forward(x))

    torch.manual_seed(0)
    made = Made().double()
    twin = nn.Sequential(made.a, nn.ReLU(), made.b)
    assert pathir.compile(made, input_shape=(3,)).path_norm(1) == pytest.approx(
        pathir.compile(twin, input_shape=(3,)).path_norm(1), rel=1e-14)
    held = Held().double()
    held.extra[0].double()  # (not a submodule: .double() does not reach it)
    # its list's Linear is lowered as constants (torch.export): analysed exactly,
    cm = pathir.compile(held, input_shape=(3,))  # but not written
    assert cm.path_norm(1) == pytest.approx(
        pathir.compile(nn.Sequential(held.a, nn.ReLU(), held.b, held.extra[0]), input_shape=(3,)).path_norm(1), rel=1e-14)
    state, weight = copy.deepcopy(held.state_dict()), held.extra[0].weight.clone()
    with pytest.raises(PathirError, match="plain list"):
        cm.pathcond(progress=False)
    assert all(torch.equal(state[k], v) for k, v in held.state_dict().items())
    assert torch.equal(weight, held.extra[0].weight)


def test_a_threshold_tensor_made_in_forward_is_refused_as_what_it_is():
    class Made(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.b(torch.minimum(torch.relu(self.a(x)), torch.tensor(0.3)))

    with pytest.raises(PathirError, match=r"computed in the forward, neither a parameter nor a buffer"):
        pathir.compile(Made(), input_shape=(3,))


def test_a_threshold_computed_from_a_buffer_is_refused_naming_that_case():
    class Doubled(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)
            self.register_buffer("t", torch.full((4,), 1.5))

        def forward(self, x):
            return self.b(torch.minimum(torch.relu(self.a(x)), self.t * 2))

    with pytest.raises(PathirError, match=r"computed from a buffer \(self.t \* 2.*register the threshold itself"):
        pathir.compile(Doubled(), input_shape=(3,))


class _InplaceReread(nn.Module):
    """An in-place clipped ReLU whose input is read again: eager z + y is 2·clip(y) (y was written)."""

    def __init__(self, act):
        super().__init__()
        self.c1, self.act, self.c2 = nn.Conv2d(2, 4, 3, padding=1), act, nn.Conv2d(4, 3, 1)

    def forward(self, x):
        y = F.relu(self.c1(x))
        z = self.act(y)
        return self.c2(z + y)


@pytest.mark.parametrize("act", [lambda: nn.ReLU6(inplace=True), lambda: nn.Hardtanh(0.0, 2.0, inplace=True)],
                         ids=["relu6", "hardtanh"])
def test_an_in_place_clipped_relu_stays_in_place_when_rewritten(act):
    """The rewrite put an out-of-place ClippedReLU where an in-place module stood: y was no longer clipped and
    the written model computed clip(y) + y (1.69 relative off where activations pass the threshold), while the
    one-sample probe, below the thresholds, let it through."""
    torch.manual_seed(0)
    model = _InplaceReread(act()).double().eval()
    with torch.no_grad():
        model.c1.weight.mul_(torch.logspace(-1, 1, 4, dtype=torch.float64)[:, None, None, None])
    x = _x(8, 2, 5, 5, scale=20.0)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        y = torch.clamp(F.relu(ref.c1(x)), 0, 6.0 if isinstance(ref.act, nn.ReLU6) else 2.0)
        want = ref.c2(y + y)  # the definition of eager in-place semantics
        assert torch.allclose(ref(x), want, rtol=1e-12, atol=1e-12) and bool((F.relu(ref.c1(x)) > 6).any())
    cm = pathir.compile(model, input_shape=(2, 5, 5))
    cm.pathcond(progress=False)
    assert isinstance(model.act, ClippedReLU) and model.act.inplace
    with torch.no_grad():
        assert torch.allclose(model(x), want, rtol=1e-9, atol=1e-9)
    again = pathir.compile(model, input_shape=(2, 5, 5))  # the written module lowers as the in-place op it is
    np.testing.assert_allclose(again.forward(x.numpy()), want.numpy(), rtol=1e-9, atol=1e-9)


def test_a_subclass_of_relu6_is_held_as_the_call_fx_traces_it_to():
    """Its write-back was refused (the message told the user, who wrote a module, to use a module instead of a
    functional call); its channels are now held."""

    class MyReLU6(nn.ReLU6):
        pass

    torch.manual_seed(8)
    model = _InplaceReread(MyReLU6()).double().eval()
    with torch.no_grad():
        model.c1.weight.mul_(torch.logspace(-1, 1, 4, dtype=torch.float64)[:, None, None, None])
    x = _x(4, 2, 5, 5)
    before = _eager(model, x)
    cm = pathir.compile(model, input_shape=(2, 5, 5))
    assert len(cm.units) == 0  # its channels are held: fx traces through to F.hardtanh, a number in the code
    cm.pathcond(progress=False)
    assert type(model.act) is MyReLU6 and _rel(_eager(model, x), before) <= 1e-12


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_written_clipped_relu_keeps_its_inputs_dtype_under_autocast(inplace, dtype):
    """The out-of-place form returned float32 where the ReLU6 it replaced (and the in-place form) kept bf16/fp16."""
    from pathir.nn import ClippedReLU

    act = ClippedReLU(torch.tensor([6.0, 3.0, 1.5]), spatial_dims=2, inplace=inplace)
    x = (torch.randn(2, 3, 4, 4) * 4).to(dtype)
    y = act(x.clone())
    assert y.dtype == dtype == nn.ReLU6()(x).dtype
    want = torch.minimum(torch.relu(x.double()), torch.tensor([6.0, 3.0, 1.5], dtype=torch.float64).view(3, 1, 1))
    assert torch.equal(y.double(), want)


class _SharedBlocks(nn.Module):
    """One nn.ReLU6 object registered in two blocks (b1.act, b2.act), called on one width in each."""

    def __init__(self):
        super().__init__()
        act = nn.ReLU6()
        self.b1, self.b2, self.c = nn.Sequential(nn.Linear(4, 6), act), nn.Sequential(nn.Linear(6, 6), act), nn.Linear(6, 3)

    def forward(self, x):
        return self.c(self.b2(self.b1(x)))


@pytest.mark.parametrize("path", ["fx", "export"])
def test_one_module_called_twice_on_one_width_is_one_threshold_on_both_paths(path):
    """torch.export names each call's threshold, so the module's two params were held (0 units) where fx ties its
    calls' channels (6 units); they are one param now, on both paths, and the write keeps the function."""
    from torch_programs import export_path

    torch.manual_seed(0)
    model = _SharedBlocks().double().eval()
    with torch.no_grad():
        model.b1[0].weight.mul_(4.0)
    x = _x(8, 4)
    before = _eager(model, x)
    with export_path() if path == "export" else contextlib.nullcontext():
        cm = pathir.compile(model, input_shape=(4,))
    assert len(cm.units) == 6 and [p.name for p in cm.graph.params()].count("b1.1.threshold") == 1
    cm.pathcond(progress=False)
    assert isinstance(model.b1[1], ClippedReLU) and model.b1[1] is model.b2[1]
    assert _rel(_eager(model, x), before) <= 1e-12


def test_one_threshold_buffer_read_on_two_widths_is_held():
    """torch.minimum(relu(.), self.t) after layers of widths 4 and 1, t of shape (1,): refused, naming the shape of
    the first call's param ([4]) as the buffer's. Each call has its own param now, both held (one buffer holds them)."""

    class BufferShared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(4, 1), nn.Linear(1, 2)
            self.register_buffer("t", torch.tensor([2.0]))

        def forward(self, x):
            return self.c(torch.minimum(torch.relu(self.b(torch.minimum(torch.relu(self.a(x)), self.t))), self.t))

    torch.manual_seed(0)
    model = BufferShared().double().eval()
    x = _x(8, 3)
    before = _eager(model, x)
    cm = pathir.compile(model, input_shape=(3,))
    assert _rel(cm.forward(x.numpy(), backend="numpy"), before) <= 1e-12 and len(cm.units) == 0
    cm.pathcond(progress=False)
    assert torch.equal(model.t, torch.tensor([2.0], dtype=torch.float64)) and _rel(_eager(model, x), before) <= 1e-12


class _TokenClip(nn.Module):
    """A conv's (N, 4, 5) output through a token-wise Linear (over the last axis), then a clipped ReLU of
    threshold 6 spelled three ways: an nn.ReLU6 module (one threshold per feature, the Linear's channels), and a
    pathir ClippedReLU and min(relu(h), buffer) with one threshold per position of axis 1."""

    def __init__(self, spelling):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.tok, self.conv2, self.out = nn.Conv1d(3, 4, 1), nn.Linear(5, 5), nn.Conv1d(4, 4, 1), nn.Linear(20, 3)
        self.spelling = spelling
        self.act = nn.ReLU6() if spelling == "relu6" else ClippedReLU(torch.full((4,), 6.0), spatial_dims=1)
        self.register_buffer("t", torch.full((4, 1), 6.0))

    def forward(self, x):
        h = self.tok(self.conv(x))
        h = torch.minimum(torch.relu(h), self.t) if self.spelling == "minimum" else self.act(h)
        return self.out(self.conv2(h).flatten(1))


@pytest.mark.parametrize("path", ["fx", "export"])
def test_a_clip_of_a_token_wise_layer_lowers_alike_in_every_spelling(path):
    """min(relu(h), t) of a token-wise layer's output (a ReLU lowered in the layer's layout, then permuted) was
    refused, and on the torch.export path a ClippedReLU there is that: every spelling now compiles to the
    model's forward and to the same path-norms."""
    from torch_programs import export_path

    x, norms = _x(6, 3, 5), []
    for spelling in ("relu6", "clipped", "minimum"):
        model = _TokenClip(spelling).double().eval()
        with export_path() if path == "export" else contextlib.nullcontext():
            cm = pathir.compile(model, input_shape=(3, 5))
        assert _rel(cm.forward(x.numpy()), _eager(model, x)) <= 1e-13
        norms.append([cm.path_norm(q) for q in (1, 2)])
    assert np.allclose(norms, norms[0], rtol=1e-13)


def test_a_relu6_module_written_per_channel_on_a_token_wise_layer_is_followed_on_the_export_path():
    """nn.ReLU6 after a conv and after a token-wise Linear: PathCond writes ClippedReLUs (per channel along
    axis 1, and per feature along the last axis), which the torch.export path lowers as relu then minimum; the
    Compiled kept follows the next weight change (it refused, "no longer lowers to the same graph", and so did a
    fresh compile of the written model)."""
    from torch_programs import export_path

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.conv, self.tok, self.act, self.act2 = nn.Conv1d(3, 4, 1), nn.Linear(5, 5), nn.ReLU6(), nn.ReLU6()
            self.conv2, self.out = nn.Conv1d(4, 4, 1), nn.Linear(20, 3)

        def forward(self, x):
            return self.out(self.conv2(self.act2(self.tok(self.act(self.conv(x))))).flatten(1))

    model, x = Mixed().double().eval(), _x(6, 3, 5)
    before = _eager(model, x)
    with export_path():
        cm = pathir.compile(model, input_shape=(3, 5))
        cm.pathcond(progress=False)
        assert isinstance(model.act, ClippedReLU) and model.act.threshold.shape == (4, 1)
        assert isinstance(model.act2, ClippedReLU) and model.act2.threshold.shape == (5,)  # the features: last axis
        assert _rel(_eager(model, x), before) <= 1e-13
        with torch.no_grad():
            model.conv.weight.mul_(1.1)
        fresh = pathir.compile(model, input_shape=(3, 5))
        assert cm.path_norm(1) == pytest.approx(fresh.path_norm(1), rel=1e-13)
        assert _rel(cm.forward(x.numpy()), _eager(model, x)) <= 1e-13


class _TokenMLP(nn.Module):
    """Linear -> a clipped ReLU -> Linear on (tokens, features): ``act`` a module, or "buffer" for
    torch.minimum(relu(h), t) with ``t`` a buffer (one per feature, (F,); one per token, (T, 1))."""

    def __init__(self, act, t=None, d=3, h=5, o=2):
        super().__init__()
        self.a, self.c = nn.Linear(d, h), nn.Linear(h, o)
        with torch.no_grad():
            self.a.weight.mul_(torch.logspace(-1, 1, h)[:, None])
        self.act = act
        if t is not None:
            self.register_buffer("t", torch.as_tensor(t))

    def forward(self, x):
        h = self.a(x)
        return self.c(torch.minimum(torch.relu(h), self.t) if self.act == "buffer" else self.act(h))


_TOKEN_ACTS = {"relu6": (lambda: nn.ReLU6(), None), "hardtanh": (lambda: nn.Hardtanh(0.0, 1.5), None),
               "clipped": (lambda: ClippedReLU(torch.linspace(0.5, 3.0, 5), spatial_dims=0), None),
               "buffer": (lambda: "buffer", torch.linspace(0.5, 3.0, 5))}


@pytest.mark.parametrize("path", ["fx", "export"])
@pytest.mark.parametrize("act", list(_TOKEN_ACTS))
def test_a_clipped_relu_on_a_token_layout_has_a_threshold_and_a_unit_per_feature(act, path):
    """A token-wise MLP's clipped ReLU (nn.ReLU6, a per-feature threshold) is lowered in the layer's layout, as
    its ReLU is: one threshold and one unit per feature (it tied every feature into one unit, and a per-feature
    buffer was refused); path-norms are T times those of one token's network (the definition), PathCond writes
    per-feature thresholds along the last axis, the function kept."""
    from torch_programs import export_path

    torch.manual_seed(0)
    make, t = _TOKEN_ACTS[act]
    model, T = _TokenMLP(make(), t).double().eval(), 4
    x = _x(6, T, 3)
    before = _eager(model, x)
    with export_path() if path == "export" else contextlib.nullcontext():
        cm = pathir.compile(model, input_shape=(T, 3))
        assert _rel(cm.forward(x.numpy()), before) <= 1e-13
        assert len(cm.units) == 5
        thresholds = {"relu6": np.full(5, 6.0), "hardtanh": np.full(5, 1.5)}.get(act, np.linspace(0.5, 3.0, 5))
        W1, b1, W2, b2 = (p.detach().numpy() for p in (model.a.weight, model.a.bias, model.c.weight, model.c.bias))
        for q in (1, 2, 0.5):
            ref = (T * _reference_lq(W1, b1, thresholds, W2, b2, q)) ** (1 / q)
            assert cm.path_norm(q) == pytest.approx(ref, rel=1e-12)
        cm.pathcond(progress=False)
        assert _rel(_eager(model, x), before) <= 1e-13
        held = model.t if act == "buffer" else model.act.threshold
        assert held.shape == (5,) and not torch.equal(held, torch.as_tensor(thresholds))  # per feature, moved
        assert pathir.compile(model, input_shape=(T, 3)).path_norm(2) == pytest.approx(cm.path_norm(2), rel=1e-12)


def test_a_threshold_per_token_is_exact_and_ties_the_features():
    """torch.minimum(relu(h), t) with t of shape (T, 1), one number per token: exact, in the tokens' layout (the
    features tied by it); PathCond keeps the function."""
    torch.manual_seed(0)
    T, t = 4, torch.tensor([[0.5], [1.0], [2.0], [3.0]])
    model, x = _TokenMLP("buffer", t).double().eval(), _x(6, 4, 3)
    before = _eager(model, x)
    cm = pathir.compile(model, input_shape=(T, 3))
    assert _rel(cm.forward(x.numpy()), before) <= 1e-13
    W1, b1, W2, b2 = (p.detach().numpy() for p in (model.a.weight, model.a.bias, model.c.weight, model.c.bias))
    ref = sum(_reference_lq(W1, b1, np.full(5, float(tk)), W2, b2, 1.0) for tk in t.flatten())
    assert cm.path_norm(1) == pytest.approx(ref, rel=1e-12)
    cm.pathcond(progress=False)
    assert _rel(_eager(model, x), before) <= 1e-13


def test_one_module_at_two_layouts_is_held():
    """One nn.ReLU6 after a conv (channels along axis 1) and after a token-wise Linear (features along the last
    axis): no per-channel threshold fits both calls, so its channels are held; PathCond rescales the rest."""

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.conv, self.tok, self.act = nn.Conv1d(3, 4, 1), nn.Linear(5, 5), nn.ReLU6()
            self.conv2, self.out = nn.Conv1d(4, 4, 1), nn.Linear(20, 3)

        def forward(self, x):
            return self.out(self.conv2(self.act(self.tok(self.act(self.conv(x))))).flatten(1))

    model, x = Shared().double().eval(), _x(6, 3, 5)
    before = _eager(model, x)
    cm = pathir.compile(model, input_shape=(3, 5))
    held = {p.name for p in cm.graph.params() if any(r.fixed for r in p.sources)}
    assert held and all(name.startswith("act") for name in held)
    cm.pathcond(progress=False)
    assert type(model.act) is nn.ReLU6 and _rel(_eager(model, x), before) <= 1e-13


@pytest.mark.parametrize("path", ["fx", "export"])
def test_one_module_at_two_layouts_of_one_width_is_held(path):
    """One nn.ReLU6 on a conv output (B, 4, 4) (channels along axis 1) and on a token-wise output (B, 6, 4)
    (features last): both calls had one param, the last call's layout was recorded, and a write-back gave the conv
    call thresholds along its length (5.8 % output change, unseen: 4 == 4 broadcasts; clip review). Held."""
    from torch_programs import export_path

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.c2 = nn.Conv1d(2, 4, 3), nn.Conv1d(4, 2, 1)
            self.l1, self.l2 = nn.Linear(2, 4), nn.Linear(4, 2)
            self.act = nn.ReLU6()

        def forward(self, x):
            a = self.c2(self.act(self.c(x))).sum(2)
            return a + self.l2(self.act(self.l1(x.transpose(1, 2)))).sum(1)

    torch.manual_seed(0)
    model, x = Shared().double().eval(), _x(8, 2, 6)
    with torch.no_grad():
        model.l1.weight.mul_(torch.tensor([[0.01], [10.0], [1.0], [0.1]], dtype=torch.float64))
    before = _eager(model, x)
    with export_path() if path == "export" else contextlib.nullcontext():
        cm = pathir.compile(model, input_shape=(2, 6))
        assert len(cm.units) == 0
        cm.pathcond(progress=False)
    assert type(model.act) is nn.ReLU6 and _rel(_eager(model, x), before) <= 1e-13


def test_a_buffer_along_another_axis_than_the_channels_is_held():
    """A threshold buffer of shape (W,), one number repeated, read against (C, H, W) with W = C: it holds one
    value per channel only as the number it repeats, and scaling it per channel would scale it along W. Its
    channels are held, and equalization writes the rest (it wrote it, and the function check refused the
    write, blaming a tensor read elsewhere)."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.d = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 2, 3)
            self.register_buffer("t", torch.full((4,), 0.7))
            with torch.no_grad():
                self.c.weight.mul_(torch.logspace(-2, 1, 4)[:, None, None, None])

        def forward(self, x):
            return self.d(torch.minimum(torch.relu(self.c(x)), self.t))

    torch.manual_seed(0)
    model, x = Net().double().eval(), _x(8, 3, 4, 4, scale=5.0)
    before, t = _eager(model, x), model.t.clone()
    report = pathir.equalize(model, input_shape=(3, 4, 4), bits=6)
    assert report.units_moved == 0 and torch.equal(model.t, t)
    assert _rel(_eager(model, x), before) <= 1e-13


def test_an_in_place_clip_refused_on_the_export_path_says_why():
    """An in-place ClippedReLU whose threshold lies along another axis (spatial_dims=0 on (B, C, L)): the export
    path refused its ATen clamp_ as "outside the ReLU DAG model", the table's miss for an in-place op, where the
    functional retry knew why (clip review); the in-place op is named, with that reason."""
    from torch_programs import export_path

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 4, 1), ClippedReLU(torch.linspace(0.5, 3.0, 4), spatial_dims=0, inplace=True),
                          nn.Conv1d(4, 2, 1)).double().eval()
    with export_path(), pytest.raises(UnsupportedOperation, match=r"clamp_.*not one value per channel") as err:
        pathir.compile(model, input_shape=(2, 4))
    assert "outside the ReLU DAG model" not in str(err.value)
