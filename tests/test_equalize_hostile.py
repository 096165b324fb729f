"""Equalization on models written the way users write them: every one is equalized with its function
kept (checked against the model's own forward before the write-back) or refused with the model left
bit for bit as it was.

Each model's weight rows are spread over several decades first, so that equalization has something to
move: a model that accepts is also checked to have changed (else "function kept" would say nothing).
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.prune as prune
from torch.nn.utils import parametrizations

import pathir


def _mlp():
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


class _Residual(nn.Module):
    """In-place ReLUs, a residual add, a circularly padded conv, a batch-norm, a pooled head."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular")
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        y = F.relu(self.bn(self.c1(x)), inplace=True)
        y = F.relu_(y + self.c2(y))
        return self.fc(F.adaptive_avg_pool2d(y, 1).flatten(1))


class _Hooked(nn.Module):
    """A forward hook that scales a layer's output: part of the function pathir must keep."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 2)
        self.a.register_forward_hook(lambda module, args, out: out * 3)

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


class _PoolGrouped(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 6, 3), nn.Conv2d(6, 6, 3, groups=3)
        self.fc = nn.Linear(6 * 2 * 2, 3)

    def forward(self, x):
        return self.fc(F.max_pool2d(F.relu(self.c2(F.relu(self.c1(x)))), 2).flatten(1))


class _CatChunk(nn.Module):
    """A concatenation of two branches, then a chunk read by two heads that are added."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 5), nn.Linear(6, 3)
        self.c, self.d = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        h = torch.cat([F.relu(self.a(x)), F.relu(self.b(x))], 1)
        u, v = h.chunk(2, 1)
        return self.c(u) + self.d(v)


class _SharedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(F.relu(self.a(F.relu(self.a(x)))))


class _Leaky(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.b(F.leaky_relu(self.a(x), 0.1))


class _ScaledInCode(nn.Module):
    """A parameter used through arithmetic in forward (``w * 2``): outside the linear layers."""

    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(8, 6)), nn.Linear(8, 2)

    def forward(self, x):
        return self.b(F.relu(F.linear(x, self.w * 2)))


class _ClipInCode(nn.Module):
    """A clipped ReLU whose threshold is a number in the code: a rescaled per-channel threshold cannot be
    written back, so its channels are held."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.c(F.relu(self.b(F.hardtanh(self.a(x), 0.0, 0.5))))


def _mlp_with(edit):
    """A factory of `_mlp`s with ``edit(model)`` applied (a parametrization, a pruning, a module swapped)."""
    def make():
        m = _mlp()
        edit(m)
        return m
    return make


_with_weight_norm = _mlp_with(lambda m: parametrizations.weight_norm(m[2]))
_pruned = _mlp_with(lambda m: prune.l1_unstructured(m[2], "weight", 0.3))
_spectral = _mlp_with(lambda m: parametrizations.spectral_norm(m[2]))
_gelu = _mlp_with(lambda m: m.__setitem__(1, nn.GELU()))
_inplace_relu = _mlp_with(lambda m: [m.__setitem__(i, nn.ReLU(inplace=True)) for i in (1, 3)])


# name: (model factory, input shape, dtype, relative tolerance of the kept function)
KEPT = {
    "residual, in-place, circular padding, batch-norm": (lambda: _Residual().eval(), (4, 6, 6), torch.float32, 1e-5),
    "forward hook": (_Hooked, (6,), torch.float32, 1e-5),
    "max-pool, grouped conv": (_PoolGrouped, (3, 8, 8), torch.float32, 1e-5),
    "concatenation, chunk": (_CatChunk, (6,), torch.float32, 1e-5),
    "in-place ReLU modules": (_inplace_relu, (6,), torch.float32, 1e-5),
    "weight_norm": (_with_weight_norm, (6,), torch.float32, 1e-5),
    "pruned (mask kept)": (_pruned, (6,), torch.float32, 1e-5),
    "float64": (lambda: _mlp().double(), (6,), torch.float64, 1e-12),
    "float16": (lambda: _mlp().half(), (6,), torch.float16, 1e-2),
    "bfloat16": (lambda: _mlp().bfloat16(), (6,), torch.bfloat16, 5e-2),
}

REFUSED = {
    "leaky_relu": (_Leaky, (6,), "leaky_relu"),
    "GELU": (_gelu, (6,), "GELU"),
    "parameter through arithmetic": (_ScaledInCode, (6,), "mul"),
    "spectral_norm": (_spectral, (6,), "spectral"),
}


def _spread_rows(model: nn.Module, seed: int = 0) -> None:
    """Multiply each output row of every weight matrix by e^{N(0, σ²)} (the function changes; its
    ranges now span decades, as batch-norm folding leaves them). σ = 2, and 0.5 in float16 and
    bfloat16: the default bound keeps every written entry normal with a margin, for all units at once
    (`pathir.rescaling.bounds`), and a wider spread leaves float16 no room, so nothing would move."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and "parametrizations" not in name:
                sigma = 0.5 if p.dtype in (torch.float16, torch.bfloat16) else 2.0
                factor = torch.exp(sigma * torch.randn(p.shape[0], *[1] * (p.dim() - 1), generator=gen))
                p.mul_(factor.to(p.dtype))


def _state(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", list(KEPT))
def test_equalize_keeps_the_function_of_a_hostile_model(name):
    make, shape, dtype, tol = KEPT[name]
    torch.manual_seed(1)
    model = make()
    _spread_rows(model)
    x = torch.randn(16, *shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        before_out = model(x).double()
    before = _state(model)
    pathir.equalize(model, input_shape=shape, bits=6, progress=False)
    with torch.no_grad():
        after_out = model(x).double()
    assert not _same_state(before, _state(model)), "nothing was rescaled: the check below would say nothing"
    scale = before_out.abs().max().item()
    assert (after_out - before_out).abs().max().item() <= tol * scale


def test_equalize_keeps_a_module_called_twice():
    """A layer applied twice: its units are tied to themselves; whatever equalization moves, the
    function stays."""
    torch.manual_seed(1)
    model = _SharedTwice()
    _spread_rows(model)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(x)
    pathir.equalize(model, input_shape=(8,), bits=6, progress=False)
    with torch.no_grad():
        assert torch.allclose(model(x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("name", list(REFUSED))
def test_equalize_refuses_and_leaves_the_model_untouched(name):
    make, shape, named = REFUSED[name]
    torch.manual_seed(1)
    model = make()
    _spread_rows(model)
    before = _state(model)
    modules = copy.copy(dict(model.named_modules()))
    with pytest.raises(pathir.PathirError) as err:
        pathir.equalize(model, input_shape=shape, bits=6, progress=False)
    assert named in str(err.value)
    assert _same_state(before, _state(model))
    assert dict(model.named_modules()) == modules  # no submodule swapped in (a clipped ReLU's writer does)


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.o = nn.Linear(4, 6), nn.Linear(3, 6), nn.Linear(6, 2)

    def forward(self, x, y):
        return self.o(F.relu(self.a(x)) + F.relu(self.b(y)))


def test_equalize_takes_a_tuple_of_inputs_of_different_shapes():
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    report = pathir.compile(_TwoInputs(), input_shape=[(4,), (3,)]).equalize(inputs=(x, y), progress=False)
    assert report.observed_before is not None


@pytest.mark.parametrize("kwargs, match", [
    ({"inputs": torch.randn(0, 6)}, "empty batch"),
    ({"inputs": "abc"}, "not of float64 numbers"),
    ({"inputs": torch.randn(4, 6, dtype=torch.complex64)}, "complex"),
    ({"max_log_scale": "3"}, "max_log_scale must be a number"),
    ({"absorb_bias": "no"}, "absorb_bias must be True or False"),
    ({"certify": "yes"}, "certify must be True or False"),
    ({"write_back": "no"}, "write_back must be True or False"),
])
def test_bad_equalize_arguments_are_refused_before_anything_runs(kwargs, match):
    model = _mlp()
    before = _state(model)
    with pytest.raises(pathir.PathirError, match=match):
        pathir.compile(model, input_shape=(6,)).equalize(progress=False, **kwargs)
    assert _same_state(before, _state(model))


@pytest.mark.parametrize("method", ["pathcond", "enorm", "normalize", "equalize"])
def test_a_write_back_flag_that_is_no_bool_is_refused_not_read_as_true(method):
    """write_back="no" is truthy: every rescaling method wrote the model with it (review)."""
    model = _mlp()
    before = _state(model)
    with pytest.raises(pathir.errors.ArgumentError, match="write_back must be True or False, got 'no'"):
        getattr(pathir.compile(model, input_shape=(6,)), method)(write_back="no", progress=False)
    assert _same_state(before, _state(model))


def test_parameters_made_under_inference_mode_are_refused_with_the_way_out():
    with torch.inference_mode():
        model = _mlp()
    with pytest.raises(pathir.PathirError, match="inference_mode") as err:
        pathir.compile(model, input_shape=(6,))
    assert "assign=True" in str(err.value)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    pathir.equalize(model, input_shape=(6,), progress=False)


def test_relu6_relu_blames_a_hook_that_reads_the_clipped_relu_not_the_input_shape():
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU6(), nn.Conv2d(6, 2, 3))
    model[1].register_forward_hook(lambda mod, i, o: o / 6.0 * mod.max_val)
    before = _state(model)
    with pytest.raises(pathir.PathirError, match="relu6='relu'.*max_val") as err:
        pathir.equalize(model, input_shape=(3, 8, 8), relu6="relu", progress=False)
    assert "input_shape" not in str(err.value).split("(")[0]
    assert isinstance(model[1], nn.ReLU6) and _same_state(before, _state(model))


@pytest.mark.parametrize("objective", ["range", "noise", "path-metric"])
def test_a_model_whose_every_weight_is_zero_is_left_as_it_is(objective):
    """No nonzero weight to quantize: the range objective's LP was built over no cell (a raw ValueError from
    numpy); every objective now returns z = 0, the model untouched."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    cm = pathir.compile(model, input_shape=(3,))
    report = cm.equalize(objective=objective)
    assert report.units_moved == 0
    assert all(bool((p == 0).all()) for p in model.parameters())


def test_a_clip_threshold_written_in_the_code_is_held_and_the_rest_equalized():
    """F.hardtanh(h, 0, 3) holds its threshold as one number in the code: solved, then refused at write-back. Its
    channels are now no unit (held where they are), the other layers are equalized, the function is kept, and
    relu6='relu', which cannot replace a call, says so."""
    torch.manual_seed(1)
    model = _ClipInCode()
    _spread_rows(model)
    x = torch.randn(16, 6, dtype=next(model.parameters()).dtype)
    before = model(x)
    modules = dict(model.named_modules())
    report = pathir.equalize(model, input_shape=(6,), bits=6, progress=False)
    assert report.written and dict(model.named_modules()) == modules
    assert report.units == 8 and report.units_moved > 0  # b's channels; a's (the clip's) are held
    assert torch.allclose(model(x), before, rtol=1e-5, atol=1e-6 * float(before.abs().max()))
    state = _state(model)
    with pytest.raises(pathir.PathirError, match="relu6='relu'.*hardtanh.*no registered"):
        pathir.equalize(model, input_shape=(6,), bits=6, relu6="relu", progress=False)
    assert _same_state(state, _state(model))

