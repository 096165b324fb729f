"""Fixed linear maps from the torch frontend, each against the definition:

- the model's own float64 eval forward;
- the path-norm computed without pathir: a deep copy with every parameter |θ|^q, ReLU -> identity
  and the fixed op replaced by its matrix read off the op on one-hot inputs, each coefficient
  c -> |c|^q; fed all ones, the sum of its outputs is sum_p |Φ_p|^q;
- the number of paths (the same with q = 0: every non-zero coefficient 1);
- the torch.export fallback (ATen ops) gives the same function and path-norms;
- PathCond keeps the model's function.
"""

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pathir
from pathir.errors import UnsupportedOperation
from pathir.frontends.torch.export import lower_exported


class Fixed(nn.Module):
    """Wraps a fixed op given as a function (traced through by fx)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class AbsPowMatrix(nn.Module):
    """The fixed op as the matrix it applies per sample, each coefficient c -> |c|^q (0 stays 0)."""

    def __init__(self, op, in_shape, q):
        super().__init__()
        n = math.prod(in_shape)
        with torch.no_grad():
            out = op(torch.eye(n, dtype=torch.float64).reshape(n, *in_shape))
        self.out_shape = tuple(out.shape[1:])
        M = out.reshape(n, -1)
        self.register_buffer("M", torch.where(M != 0, M.abs() ** q if q else torch.ones_like(M), torch.zeros_like(M)))

    def forward(self, x):
        return (x.reshape(x.shape[0], -1) @ self.M).reshape(x.shape[0], *self.out_shape)


def definition_path_norm(model: nn.Sequential, in_shape, q: float) -> float:
    """sum_p |Φ_p|^q computed by a deep copy of ``model`` (docs/math.md §3), without pathir."""
    ref = copy.deepcopy(model)
    shape = tuple(in_shape)
    layers = []
    with torch.no_grad():
        for mod in ref:
            if isinstance(mod, nn.ReLU):
                new = nn.Identity()
            elif any(True for _ in mod.parameters()):
                for p in mod.parameters():
                    p.copy_(p.abs() ** q if q else torch.ones_like(p))
                new = mod
            else:
                new = AbsPowMatrix(mod, shape, q)
            shape = tuple(new(torch.zeros(1, *shape, dtype=torch.float64)).shape[1:])
            layers.append(new)
        return float(nn.Sequential(*layers)(torch.ones(1, *in_shape, dtype=torch.float64)).sum())


def _conv(n, cin, cout, k=1):
    return getattr(nn, f"Conv{n}d")(cin, cout, k)


def build(fixed, n, size, cin=4):
    """conv(k=1) -> ReLU -> fixed -> conv -> ReLU -> conv: the fixed op between two layers."""
    torch.manual_seed(0)
    shape = (2, *([size] * n))
    first = _conv(n, 2, cin)
    with torch.no_grad():
        mid = fixed(torch.zeros(1, cin, *shape[1:]))
    model = nn.Sequential(first, nn.ReLU(), fixed, _conv(n, mid.shape[1], 3, 1), nn.ReLU(), _conv(n, 3, 2, 1))
    return model.double().eval(), shape


CASES = {
    "pad_zero_2d": (lambda: Fixed(lambda x: F.pad(x, (1, 2, 0, 1))), 2, 4),
    "pad_reflect_1d": (lambda: Fixed(lambda x: F.pad(x, (2, 1), mode="reflect")), 1, 5),
    "pad_reflect_2d": (lambda: nn.ReflectionPad2d((1, 2, 2, 1)), 2, 4),
    "pad_replicate_3d": (lambda: nn.ReplicationPad3d(1), 3, 3),
    "pad_circular_2d": (lambda: Fixed(lambda x: F.pad(x, (1, 1, 2, 0), mode="circular")), 2, 4),
    "zero_pad_module": (lambda: nn.ZeroPad2d((1, 0, 0, 1)), 2, 4),
    "constant_pad_zero": (lambda: nn.ConstantPad1d(2, 0.0), 1, 4),
    "nearest_x2": (lambda: nn.Upsample(scale_factor=2, mode="nearest"), 2, 3),
    "nearest_size": (lambda: Fixed(lambda x: F.interpolate(x, size=(5, 4))), 2, 3),
    "nearest_exact_1_5": (lambda: Fixed(lambda x: F.interpolate(x, scale_factor=1.5, mode="nearest-exact")), 2, 3),
    "linear_1d": (lambda: Fixed(lambda x: F.interpolate(x, scale_factor=2.5, mode="linear")), 1, 4),
    "bilinear": (lambda: nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False), 2, 3),
    "bilinear_align": (lambda: nn.UpsamplingBilinear2d(scale_factor=2), 2, 3),
    "bilinear_size": (lambda: Fixed(lambda x: F.interpolate(x, size=(5, 7), mode="bilinear")), 2, 3),
    "bilinear_down": (lambda: Fixed(lambda x: F.interpolate(x, scale_factor=0.5, mode="bilinear")), 2, 5),
    "bilinear_recompute": (lambda: Fixed(lambda x: F.interpolate(
        x, scale_factor=1.7, mode="bilinear", recompute_scale_factor=True)), 2, 3),
    "bilinear_antialias": (lambda: Fixed(lambda x: F.interpolate(
        x, scale_factor=0.5, mode="bilinear", antialias=True)), 2, 6),
    "trilinear": (lambda: nn.Upsample(scale_factor=2, mode="trilinear", align_corners=True), 3, 2),
    "bicubic": (lambda: Fixed(lambda x: F.interpolate(x, scale_factor=2, mode="bicubic")), 2, 3),
    "bicubic_antialias": (lambda: Fixed(lambda x: F.interpolate(
        x, size=(3, 4), mode="bicubic", antialias=True)), 2, 7),
    "bicubic_align": (lambda: Fixed(lambda x: F.interpolate(x, size=(5, 4), mode="bicubic", align_corners=True)), 2, 3),
    "area": (lambda: Fixed(lambda x: F.interpolate(x, size=(3, 2), mode="area")), 2, 5),
    "pixel_shuffle": (lambda: nn.PixelShuffle(2), 2, 2),
    "pixel_unshuffle": (lambda: nn.PixelUnshuffle(2), 2, 4),
    "literal_add": (lambda: Fixed(lambda x: 0 + (x + 0) * 1), 2, 3),
    "constant_factor": (lambda: Fixed(lambda x: 0.17 * x * -2.0), 2, 3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fixed_op_matches_forward_path_norms_and_path_count(case):
    make, n, size = CASES[case]
    model, shape = build(make(), n, size)
    cm = pathir.compile(model, input_shape=shape)
    x = torch.randn(3, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
    got = torch.as_tensor(cm.forward(x.numpy(), backend="numpy"))
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-12
    for q in (1, 2, 0.5):
        assert math.isclose(cm.path_norm(q) ** q, definition_path_norm(model, shape, q), rel_tol=1e-10), q
    assert math.isclose(cm.num_paths(), definition_path_norm(model, shape, 0), rel_tol=1e-12)


@pytest.mark.parametrize("case", ["pad_reflect_2d", "pad_circular_2d", "bilinear", "bicubic", "nearest_size",
                                  "nearest_exact_1_5", "pixel_shuffle", "literal_add", "area", "bilinear_antialias",
                                  "bicubic_antialias"])
def test_export_fallback_lowers_the_aten_ops_to_the_same_function(case):
    make, n, size = CASES[case]
    model, shape = build(make(), n, size)
    cm = pathir.compile(model, input_shape=shape)
    ex = pathir.compile(lower_exported(model, shape, "exported"))
    x = torch.randn(2, *shape, dtype=torch.float64)
    assert torch.allclose(torch.as_tensor(ex.forward(x.numpy(), backend="numpy")),
                          torch.as_tensor(cm.forward(x.numpy(), backend="numpy")), rtol=1e-12, atol=1e-12)
    assert math.isclose(ex.path_norm(2), cm.path_norm(2), rel_tol=1e-12)
    assert sorted(e.map.describe() for node in ex.graph.nodes for e in node.edges) == sorted(
        e.map.describe() for node in cm.graph.nodes for e in node.edges)


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_conv_padding_modes_are_pad_then_conv(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, padding_mode=mode), nn.ReLU(),
                          nn.Conv2d(3, 2, 3, padding=(2, 1), padding_mode=mode)).double().eval()
    cm = pathir.compile(model, input_shape=(2, 5, 4))
    x = torch.randn(2, 2, 5, 4, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(torch.as_tensor(cm.forward(x.numpy(), backend="numpy")), model(x), atol=1e-12)


class Blur(nn.Module):
    """Anti-aliased downsampling's filter: a depthwise binomial kernel held as a buffer
    (after a reflect pad, its own layer of identity neurons)."""

    def __init__(self, channels):
        super().__init__()
        f = torch.tensor([1.0, 2.0, 1.0])
        self.register_buffer("filt", (f[:, None] * f[None, :] / 16).repeat(channels, 1, 1, 1))
        self.channels = channels

    def forward(self, x):
        return F.conv2d(x, self.filt, stride=2, groups=self.channels)


def test_fixed_buffer_filter_is_a_resample_never_rescaled():
    model, shape = build(Blur(4), 2, 6)
    model.insert(2, nn.ReflectionPad2d(1))
    cm = pathir.compile(model, input_shape=shape)
    assert "fixed_filter" in str(cm.graph)
    assert not any("filt" in p.name for p in cm.graph.params())
    x = torch.randn(2, *shape, dtype=torch.float64)
    with torch.no_grad():
        before = model(x)
        assert torch.allclose(torch.as_tensor(cm.forward(x.numpy(), backend="numpy")), before, atol=1e-12)
    for q in (1, 2):
        assert math.isclose(cm.path_norm(q) ** q, definition_path_norm(model, shape, q), rel_tol=1e-10)
    filt = model[3].filt.clone()
    cm.pathcond()
    with torch.no_grad():
        assert float((model(x) - before).abs().max() / before.abs().max()) <= 1e-10
    assert torch.equal(model[3].filt, filt)


@pytest.mark.parametrize("case", ["bilinear", "bicubic", "pixel_shuffle", "pad_reflect_2d", "pixel_unshuffle"])
def test_pathcond_keeps_the_function(case):
    make, n, size = CASES[case]
    model, shape = build(make(), n, size)
    x = torch.randn(2, *shape, dtype=torch.float64)
    with torch.no_grad():
        before = model(x)
    pathir.compile(model, input_shape=shape).pathcond()
    with torch.no_grad():
        assert float((model(x) - before).abs().max() / before.abs().max()) <= 1e-10


@pytest.mark.parametrize("fn, words", [
    (lambda x: F.pad(x, (1, 1), value=1.0), "constant 1.0"),
    (lambda x: x + 1, "constant 1"),
    (lambda x: 2 + x, "constant 2"),
])
def test_non_zero_constants_are_refused_as_a_bias_no_parameter_carries(fn, words):
    model, shape = build(Fixed(lambda x: x), 1, 4)
    model[2] = Fixed(fn)
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(UnsupportedOperation, match="a fixed non-zero bias no parameter carries") as err:
        pathir.compile(model, input_shape=shape)
    assert words in str(err.value)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("case", ["pad_reflect_2d", "pad_zero_2d", "pad_replicate_3d", "nearest_size", "bilinear",
                                  "pixel_shuffle"])
def test_decomposed_aten_graphs_lower_to_the_same_function(case):
    """After run_decompositions: constant_pad_nd, index with constant indices (reflect /
    replicate padding, nearest), the explicit-size upsample overloads. (Decomposed bicubic is
    arithmetic on activations the frontend does not read back; the default export keeps
    upsample_bicubic2d.)"""
    from pathir.frontends.torch.export import _ExportInterpreter

    make, n, size = CASES[case]
    model, shape = build(make(), n, size)
    program = torch.export.export(model, (torch.zeros(2, *shape, dtype=torch.float64),)).run_decompositions()
    sig = program.graph_signature
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    lifted = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    graph = _ExportInterpreter(model, program.graph_module.graph, "decomposed", lifted, tensors).run(shape)
    cm, ref = pathir.compile(graph), pathir.compile(model, input_shape=shape)
    x = torch.randn(2, *shape, dtype=torch.float64)
    with torch.no_grad():
        want = model(x)
    assert float((torch.as_tensor(cm.forward(x.numpy(), backend="numpy")) - want).abs().max()) <= 1e-12
    assert math.isclose(cm.path_norm(2), ref.path_norm(2), rel_tol=1e-12)


@pytest.mark.parametrize("fixed, n, size", [
    (lambda: nn.ReflectionPad1d((1, 2)), 1, 3),
    (lambda: nn.Upsample(scale_factor=2, mode="linear"), 1, 3),
    (lambda: Fixed(lambda x: F.interpolate(x, scale_factor=2, mode="bicubic")), 2, 2),
    (lambda: nn.PixelShuffle(2), 2, 2),
    (lambda: nn.PixelUnshuffle(2), 2, 2),
])
def test_symbolic_checks_pass_on_tiny_models_with_each_op(fixed, n, size):
    """Φ is invariant under the units pathir reports (sympy, exact), the lifting identity
    and the path-norm pass agree with the enumeration."""
    torch.manual_seed(0)
    op = fixed()
    cin = 4 if isinstance(op, nn.PixelShuffle) else 1
    with torch.no_grad():
        mid = op(torch.zeros(1, cin, *([size] * n)))
    model = nn.Sequential(_conv(n, 1, cin), nn.ReLU(), op, nn.ReLU(), _conv(n, mid.shape[1], 1)).double().eval()
    cm = pathir.compile(model, input_shape=(1, *([size] * n)))
    report = cm.verify_symbolic()
    assert report.passed, str(report)
