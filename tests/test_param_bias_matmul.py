"""Layers written by hand with raw parameters: ``x @ self.W`` (W of shape (in, out): a dense edge
whose matrix is Wᵀ) and ``h + self.b`` (b one learnable entry per channel: the bias of h's
neurons). Against the definition on both capture paths: the model's float64 eval forward,
path-norms and path counts of the model run on |θ|^q; write-back reaches W and b themselves
(PathCond keeps the function, the live Compiled re-reads them after an SGD step); a bias that is
not one learnable entry per channel is refused, naming it, with the model untouched."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from capture_reference import Untraceable, assert_forward, eval_forward, path_norm_q

import pathir
from pathir.errors import UnsupportedOperation


class RawMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.W1, self.b1 = nn.Parameter(torch.randn(5, 7)), nn.Parameter(torch.randn(7))
        self.W2 = nn.Parameter(torch.randn(7, 3))
        self.out = nn.Linear(3, 2)

    def forward(self, x):
        h = torch.relu(x @ self.W1 + self.b1)
        h = torch.relu(torch.matmul(h, self.W2))
        return self.out(h)


class ConvPlusBias(nn.Module):
    """A conv without bias, a (1, C, 1, 1) learnable shift, and a second one on a value that
    already carries the conv's bias (a node in between)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 4, 3, bias=False)
        self.shift = nn.Parameter(torch.randn(1, 4, 1, 1))
        self.b = nn.Conv2d(4, 3, 3)
        self.shift2 = nn.Parameter(torch.randn(3, 1, 1))
        self.head = nn.Linear(27, 2)

    def forward(self, x):
        h = torch.relu(self.a(x) + self.shift)
        h = torch.relu(self.shift2 + self.b(h))
        return self.head(h.flatten(1))



CASES = {"raw_mlp": (RawMLP, (5,)), "conv_plus_bias": (ConvPlusBias, (2, 7, 7))}


def _model(name, export=False):
    torch.manual_seed(0)
    make, shape = CASES[name]
    model = make().double().eval()
    return (Untraceable(model) if export else model), model, shape


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
@pytest.mark.parametrize("name", list(CASES))
def test_forward_path_norms_and_counts_equal_the_definition(name, export):
    model, inner, shape = _model(name, export)
    cm = assert_forward(model, shape, tol=1e-12)
    for q in (0.5, 1.0, 2.0):
        assert cm.path_norm(q) ** q == pytest.approx(path_norm_q(inner, [shape], q), rel=1e-10)
    assert cm.num_paths() == pytest.approx(path_norm_q(inner, [shape], 0.0), rel=1e-12)
    assert cm.source_num_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(CASES))
def test_pathcond_rescales_the_raw_parameters_and_keeps_the_function(name):
    model, _, shape = _model(name)
    cm = pathir.compile(model, input_shape=shape)
    x = torch.randn(4, *shape, dtype=torch.float64)
    before, params = eval_forward(model, x), copy.deepcopy(dict(model.named_parameters()))
    cm.pathcond()
    assert torch.allclose(eval_forward(model, x), before, rtol=1e-10, atol=1e-12)
    moved = [n for n, p in model.named_parameters() if not torch.allclose(p, params[n])]
    assert any(n.startswith(("W", "b1", "shift")) for n in moved), moved


def test_live_compiled_follows_an_sgd_step_on_raw_parameters():
    model, _, shape = _model("raw_mlp")
    cm = pathir.compile(model, input_shape=shape)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, *shape, dtype=torch.float64)).square().sum().backward()
    opt.step()
    fresh = pathir.compile(model, input_shape=shape)
    assert cm.path_norm(1) == pytest.approx(fresh.path_norm(1), rel=1e-12)
    assert cm.path_norm(1) == pytest.approx(path_norm_q(model, [shape], 1.0), rel=1e-10)


class BadBias(nn.Module):
    def __init__(self, bias_shape, buffer=False):
        super().__init__()
        self.a = nn.Linear(4, 6)
        t = torch.randn(bias_shape)
        if buffer:
            self.register_buffer("c", t)
        else:
            self.c = nn.Parameter(t)

    def forward(self, x):
        return torch.relu(self.a(x) + self.c)


@pytest.mark.parametrize("bias_shape, buffer, why", [
    ((1,), False, r"parameter 'c' of shape \[1\]"),  # one number shared by every channel
    ((2, 6), False, r"parameter 'c' of shape \[2, 6\]"),  # varies over the batch
    ((6,), True, "'c', a tensor that is not a learnable parameter"),  # a fixed bias
])
def test_a_bias_that_is_not_one_learnable_entry_per_channel_is_refused(bias_shape, buffer, why):
    model = BadBias(bias_shape, buffer).double().eval()
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(UnsupportedOperation, match=why):
        pathir.compile(model, input_shape=(4,))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


class ComputedWeight(nn.Module):
    def __init__(self, spell):
        super().__init__()
        self.W, self.spell = nn.Parameter(torch.randn(3, 4)), spell

    def forward(self, x):
        return torch.relu(self.spell(self, x))


@pytest.mark.parametrize("spell, why", [
    (lambda m, x: x + m.W.T[:, 0], "transposes the parameter 'W'"),  # (x @ W.T and W.T @ x: lowered)
    (lambda m, x: F.linear(x, 2 * m.W), "computes with the model's tensor 'W'"),
    (lambda m, x: x @ m.W.detach().T, "computes with the model's tensor 'W'"),
])
def test_a_weight_computed_in_the_forward_is_refused_naming_the_parameter(spell, why):
    model = ComputedWeight(spell).double().eval()
    with pytest.raises(UnsupportedOperation, match=why):
        pathir.compile(model, input_shape=(4,))


@pytest.mark.parametrize("exporter", ["legacy-nofold", "dynamo-noopt"])
@pytest.mark.parametrize("name", list(CASES))
def test_onnx_export_gives_the_torch_frontends_path_norms(name, exporter):
    import numpy as np
    from onnx_cases import export, ort_run

    _, model, shape = _model(name)
    ct = pathir.compile(model, input_shape=shape)
    proto = export(model.float(), shape, exporter, batch=1)
    cm = pathir.compile(proto)
    for q in (1.0, 2.0):
        assert cm.path_norm(q) == pytest.approx(ct.path_norm(q), rel=1e-12)
    x = np.random.default_rng(0).normal(size=(2, *shape)).astype(np.float32)
    assert np.allclose(cm.forward(x.astype(np.float64), backend="numpy"), ort_run(proto, x)[0], rtol=1e-5, atol=1e-5)
