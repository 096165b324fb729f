"""Transposed convolutions against the definition, on both frontends: the model's own float64
forward, Σ_p |Φ_p|^q computed on the model itself (capture_reference.path_norm_q), diag G by
autograd in the module's own weight layout, write-back of rescalings and masks."""

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from capture_reference import assert_forward, eval_forward, linearized, path_norm_q
from hypothesis import given, settings
from hypothesis import strategies as st

import pathir
from pathir.errors import UnsupportedOperation
from pathir.ir import MapKind, TransposedConvLayout

# (dims, in, out, kernel, stride, padding, output_padding, dilation, groups, bias, input spatial)
CONFIGS = [
    (1, 3, 4, 3, 1, 0, 0, 1, 1, True, (5,)),
    (1, 4, 6, 3, 2, 1, 1, 1, 2, False, (5,)),
    (1, 2, 3, 4, 3, 2, 2, 2, 1, True, (4,)),
    (2, 3, 4, (3, 2), 1, 0, 0, 1, 1, True, (4, 5)),
    (2, 4, 6, 3, 2, 1, 1, 1, 2, True, (4, 3)),
    (2, 2, 4, (2, 3), (2, 3), (0, 2), (1, 2), (2, 1), 2, False, (3, 4)),
    (2, 3, 3, 3, 1, 3, 0, 1, 1, True, (6, 6)),  # padding > d(k-1): the stuffing crops
    (2, 4, 4, 3, 2, 1, 0, 3, 4, True, (3, 3)),  # depthwise, dilated
    (3, 2, 4, 2, 2, 0, 1, 1, 2, True, (2, 3, 2)),
]


def _module(cfg):
    n, cin, cout, k, s, p, op, d, g, bias, _ = cfg
    cls = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}[n]
    return cls(cin, cout, k, stride=s, padding=p, output_padding=op, groups=g, bias=bias, dilation=d)


class Net(nn.Module):
    """conv -> ReLU -> transposed conv -> ReLU -> linear: the transposed conv between two units."""

    def __init__(self, cfg):
        super().__init__()
        n, cin, *_ = cfg
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[n]
        self.a, self.up = conv(2, cin, 1), _module(cfg)
        with torch.no_grad():
            out = self.up(torch.zeros(1, cin, *cfg[-1]))
        self.o = nn.Linear(out.numel(), 2)

    def forward(self, x):
        return self.o(torch.relu(self.up(torch.relu(self.a(x)))).flatten(1))


def _net(cfg, seed=0):
    torch.manual_seed(seed)
    return Net(cfg).double().eval()


@pytest.mark.parametrize("cfg", CONFIGS, ids=[f"{c[0]}d-{i}" for i, c in enumerate(CONFIGS)])
def test_forward_path_norms_and_counts_equal_the_definition(cfg):
    model, shape = _net(cfg), (2, *cfg[-1])
    cm = assert_forward(model, shape, tol=1e-12)
    for q in (0.5, 1.0, 2.0):
        assert cm.path_norm(q) ** q == pytest.approx(path_norm_q(model, [shape], q), rel=1e-10)
    assert cm.num_paths() == pytest.approx(path_norm_q(model, [shape], 0.0), rel=1e-12)  # |θ|^0 = 1: a count
    assert np.asarray(cm.forward(np.ones((1, *shape)), backend="torch")) == pytest.approx(
        eval_forward(model, torch.ones(1, *shape, dtype=torch.float64)).numpy(), rel=1e-12)


def _diag_g_by_autograd(model, shape):
    """g_i = Σ_{p ∋ i} Π_{other factors} θ² = ∂/∂u_i of the q = 2 path-norm network with u = θ²."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p**2)
    with linearized():
        out = m(torch.ones(1, *shape, dtype=torch.float64)).sum()
    grads = torch.autograd.grad(out, list(m.parameters()))
    return {n: g.numpy() for (n, _), g in zip(m.named_parameters(), grads)}


@pytest.mark.parametrize("cfg", [CONFIGS[1], CONFIGS[5], CONFIGS[8]], ids=["1d", "2d", "3d"])
def test_diag_g_and_scores_are_in_the_modules_weight_layout(cfg):
    model, shape = _net(cfg), (2, *cfg[-1])
    cm = pathir.compile(model, input_shape=shape)
    want = _diag_g_by_autograd(model, shape)
    got = cm.diag_g()
    assert got["up.weight"].shape == model.up.weight.shape
    for name, g in want.items():
        np.testing.assert_allclose(got[name], g, rtol=1e-10, atol=1e-300, err_msg=name)
    scores = cm.path_magnitude_scores()
    assert scores["up.weight"].shape == model.up.weight.shape


@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.lists(st.integers(1, 3), min_size=1, max_size=3))
@settings(max_examples=40, deadline=None, derandomize=True)
def test_layout_is_the_definition_and_inverts(groups, i_g, o_g, kernel):
    T = np.random.default_rng(0).normal(size=(groups * i_g, o_g, *kernel))
    lay = TransposedConvLayout(groups)
    W = lay.from_source(T)
    assert W.shape == (groups * o_g, i_g, *kernel)
    for j in range(groups):
        for o in range(o_g):
            for i in range(i_g):
                for kappa in np.ndindex(*kernel):
                    flipped = tuple(k - 1 - x for k, x in zip(kernel, kappa))
                    assert W[(j * o_g + o, i) + kappa] == T[(j * i_g + i, o) + flipped]
    np.testing.assert_array_equal(lay.to_source(W), T)
    np.testing.assert_array_equal(lay.from_source(torch.from_numpy(T)).numpy(), W)  # torch tensors too


def _graph_has_transposed_layout(cm, name="up.weight"):
    p = next(p for p in cm.graph.params() if p.name == name)
    return p.sources[0].layout is not None


@pytest.mark.parametrize("cfg", [CONFIGS[1], CONFIGS[4], CONFIGS[5]], ids=["1d", "2d", "2d-odd"])
def test_pathcond_keeps_the_function_and_moves_the_modules_weight(cfg):
    model, shape = _net(cfg), (2, *cfg[-1])
    cm = pathir.compile(model, input_shape=shape)
    assert _graph_has_transposed_layout(cm)
    x = torch.randn(4, *shape, dtype=torch.float64)
    before, w = eval_forward(model, x), model.up.weight.detach().clone()
    cm.pathcond()
    assert not torch.allclose(model.up.weight, w)
    assert torch.allclose(eval_forward(model, x), before, rtol=1e-10, atol=1e-12)
    fresh = pathir.compile(model, input_shape=shape)
    assert fresh.path_norm(2) == pytest.approx(cm.path_norm(2), rel=1e-10)


def test_random_rescaling_written_back_keeps_the_function():
    from pathir.rescaling.apply import log_scales

    model, shape = _net(CONFIGS[5]), (2, 3, 4)
    cm = pathir.compile(model, input_shape=shape)
    x = torch.randn(3, *shape, dtype=torch.float64)
    before = eval_forward(model, x)
    z = np.random.default_rng(1).normal(size=len(cm.units))
    cm.writer.rescale(cm.graph, log_scales(cm.graph, cm.units, z))
    assert torch.allclose(eval_forward(model, x), before, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(pathir.compile(model, input_shape=shape).forward(x.numpy(), backend="numpy"),
                               cm.rescaled(z).forward(x.numpy(), backend="numpy"), rtol=1e-10)


def test_prune_zeros_the_lowest_scoring_entries_of_the_modules_weight():
    model, shape = _net(CONFIGS[4]), (2, 4, 3)
    cm = pathir.compile(model, input_shape=shape)
    scores = cm.path_magnitude_scores()["up.weight"]
    k = scores.size // 3
    cm.prune(1 / 3, scope="local")  # one third of every weight tensor
    w = model.up.weight.detach().numpy()
    zeros = w == 0
    assert zeros.sum() == k
    assert scores[zeros].max() <= scores[~zeros].min()
    fresh = pathir.compile(model, input_shape=shape)  # the pruned model, as the next forward computes it
    x = np.random.default_rng(2).normal(size=(3, *shape))
    np.testing.assert_allclose(fresh.forward(x, backend="numpy"), eval_forward(model, torch.from_numpy(x)).numpy(),
                               rtol=1e-10, atol=1e-12)


class WithBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 4, 3, padding=1)
        self.up, self.bn = nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2), nn.BatchNorm2d(6)
        self.o = nn.Conv2d(6, 1, 1)

    def forward(self, x):
        return self.o(torch.relu(self.bn(self.up(torch.relu(self.a(x))))))


def test_batch_norm_after_a_transposed_conv_is_folded_on_its_output_channels():
    from torch_models import randomize_bn

    torch.manual_seed(0)
    model, shape = randomize_bn(WithBN().double()).eval(), (2, 3, 3)
    cm = assert_forward(model, shape, tol=1e-12)
    assert not any(e.map.kind is MapKind.SCALE for n in cm.graph.nodes for e in n.edges)  # folded
    fused = copy.deepcopy(model)  # by hand: torch's fuse_conv_bn_eval(transpose=True) fails with groups
    up, bn = fused.up, fused.bn
    s = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    c_in, o_g = up.weight.shape[:2]
    out_channel = (torch.arange(c_in)[:, None] // (c_in // up.groups)) * o_g + torch.arange(o_g)[None, :]
    with torch.no_grad():
        up.weight.mul_(s[out_channel].reshape(c_in, o_g, 1, 1))
        up.bias.copy_((up.bias - bn.running_mean) * s + bn.bias)
    fused.bn = nn.Identity()
    assert torch.allclose(eval_forward(fused, torch.ones(1, *shape, dtype=torch.float64)),
                          eval_forward(model, torch.ones(1, *shape, dtype=torch.float64)), rtol=1e-12)
    for q in (1.0, 2.0):  # one merged bias path per channel (docs/ir.md, folded biases)
        assert cm.path_norm(q) ** q == pytest.approx(path_norm_q(fused, [shape], q), rel=1e-10)
    x = torch.randn(3, *shape, dtype=torch.float64)
    before, gamma = eval_forward(model, x), model.bn.weight.detach().clone()
    train_before = copy.deepcopy(model).train()(x)  # batch statistics (on a copy: train mode updates them)
    cm.pathcond()
    assert not torch.allclose(model.bn.weight, gamma)  # the out-factor lands on the batch-norm affine
    assert torch.allclose(eval_forward(model, x), before, rtol=1e-10, atol=1e-12)
    assert torch.allclose(copy.deepcopy(model).train()(x), train_before, rtol=1e-8, atol=1e-10)


class UNet(nn.Module):
    """A small U-Net: conv, max-pool, conv, transposed conv up, concat skip, conv head."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.mid = nn.Conv2d(4, 8, 3, padding=1)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.dec = nn.Conv2d(8, 4, 3, padding=1)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        e = torch.relu(self.enc(x))
        m = torch.relu(self.mid(self.pool(e)))
        u = torch.relu(self.up(m))
        return self.head(torch.relu(self.dec(torch.cat([u, e], dim=1))))


class Autoencoder(nn.Module):
    """Strided conv encoder, transposed-conv decoder with output_size, functional transposed conv."""

    def __init__(self):
        super().__init__()
        self.e1, self.e2 = nn.Conv1d(2, 4, 3, stride=2, padding=1), nn.Conv1d(4, 6, 3, stride=2, padding=1)
        self.d1 = nn.ConvTranspose1d(6, 4, 3, stride=2, padding=1)
        self.w2 = nn.Parameter(torch.randn(4, 2, 3) * 0.5)

    def forward(self, x):
        h1 = torch.relu(self.e1(x))
        h = torch.relu(self.d1(torch.relu(self.e2(h1)), output_size=h1.shape))
        return F.conv_transpose1d(h, self.w2, None, stride=2, padding=1, output_padding=1)


MODELS = {"unet": (UNet, (3, 8, 8)), "autoencoder": (Autoencoder, (2, 9))}


@pytest.mark.parametrize("name", list(MODELS))
def test_small_encoder_decoders_against_the_definition(name):
    cls, shape = MODELS[name]
    torch.manual_seed(0)
    model = cls().double().eval()
    cm = assert_forward(model, shape, tol=1e-12)
    for q in (1.0, 2.0):
        assert cm.path_norm(q) ** q == pytest.approx(path_norm_q(model, [shape], q), rel=1e-10)
    x = torch.randn(3, *shape, dtype=torch.float64)
    before = eval_forward(model, x)
    cm.enorm()
    assert torch.allclose(eval_forward(model, x), before, rtol=1e-10, atol=1e-12)
    cm.pathcond()
    assert torch.allclose(eval_forward(model, x), before, rtol=1e-10, atol=1e-12)


class Untraceable(nn.Module):
    """Python control flow on a shape: torch.fx fails, pathir falls back to torch.export."""

    def __init__(self):
        super().__init__()
        self.inner = UNet()

    def forward(self, x):
        if x.shape[-1] % 2:
            raise ValueError("even sizes only")
        return self.inner(x)


def test_export_path_lowers_conv_transpose2d_and_writes_back():
    torch.manual_seed(0)
    model, shape = Untraceable().double().eval(), (3, 8, 8)
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(model)
    cm = assert_forward(model, shape, tol=1e-12)
    ref = pathir.compile(model.inner, input_shape=shape)
    assert cm.path_norm(1) == pytest.approx(ref.path_norm(1), rel=1e-12)
    x = torch.randn(3, *shape, dtype=torch.float64)
    before = eval_forward(model, x)
    cm.pathcond()
    assert torch.allclose(eval_forward(model, x), before, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(MODELS))
def test_core_aten_convolution_with_transposed_true(name):
    """After run_decompositions the ATen graph spells it aten.convolution(transposed=True)."""
    from pathir.frontends.torch import export as torch_export

    cls, shape = MODELS[name]
    torch.manual_seed(0)
    model = cls().double().eval()
    program = torch.export.export(model, (torch.zeros(2, *shape, dtype=torch.float64),)).run_decompositions()
    targets = {n.target for n in program.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.convolution.default in targets
    sig = program.graph_signature
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers()), **dict(program.constants)}
    lifted = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    graph = torch_export._ExportInterpreter(model, program.graph_module.graph, name, lifted, tensors).run([shape])
    cm, ref = pathir.compile(graph), pathir.compile(model, input_shape=shape)
    x = np.random.default_rng(0).normal(size=(3, *shape))
    np.testing.assert_allclose(cm.forward(x, backend="numpy"), eval_forward(model, torch.from_numpy(x)).numpy(),
                               rtol=1e-12, atol=1e-13)
    assert cm.path_norm(2) == pytest.approx(ref.path_norm(2), rel=1e-12)


class TiedAutoencoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)

    def forward(self, x):
        return F.conv_transpose2d(torch.relu(self.conv(x)), self.conv.weight)


class BufferKernel(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3)
        self.register_buffer("k", torch.ones(2, 1, 2, 2))

    def forward(self, x):
        return F.conv_transpose2d(torch.relu(self.conv(x)), self.k, stride=2, groups=2)


@pytest.mark.parametrize("cls,match", [(TiedAutoencoder, "read in two ways"), (BufferKernel, "fixed \\(buffer\\) kernel")])
def test_refused_with_the_reason(cls, match):
    model = cls()
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(UnsupportedOperation, match=match):
        pathir.compile(model, input_shape=(2, 5, 5))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


# ---------------------------------------------------------------- ONNX

onnx_cases = pytest.importorskip("onnx_cases")


@pytest.mark.parametrize("exporter", ["legacy-nofold", "dynamo-noopt"])
@pytest.mark.parametrize("name", list(MODELS))
def test_onnx_export_gives_the_torch_frontends_numbers(name, exporter):
    cls, shape = MODELS[name]
    torch.manual_seed(0)
    model = cls().eval()
    proto = onnx_cases.export(model, shape, exporter)
    assert any(n.op_type == "ConvTranspose" for n in proto.graph.node)
    cm, ct = onnx_cases.assert_export_matches(proto, model, shape)
    g_onnx, g_torch = cm.diag_g(), ct.diag_g()
    for k, v in g_torch.items():
        np.testing.assert_allclose(g_onnx[k], v, rtol=1e-9, atol=1e-300, err_msg=k)


def _convt_proto(attrs, w, b, x_shape, relu_out=True, q=None):
    """x -> ConvTranspose(attrs) [-> Relu] -> y; with q, the path-norm network (|W|^q, |b|^q, no ReLU)."""
    from onnx_cases import make_model, node, tensor_info

    inits = {"W": w if q is None else np.abs(w) ** q}
    ins = ["x", "W"]
    if b is not None:
        inits["B"] = b if q is None else np.abs(b) ** q
        ins.append("B")
    nodes = [node("ConvTranspose", ins, ["c"], name="up", **attrs)]
    nodes.append(node("Relu" if relu_out and q is None else "Identity", ["c"], ["y"], name="act"))
    return make_model(nodes, [tensor_info("x", list(x_shape))], [tensor_info("y", ["b", "c", *(f"s{i}" for i in range(len(x_shape) - 2))])], inits)


ONNX_ATTRS = [
    ({}, 1, (1, 2, 4, 4), True),
    ({"strides": [2, 2], "pads": [1, 0, 0, 1], "output_padding": [1, 0]}, 1, (1, 2, 4, 3), True),
    ({"strides": [2, 3], "dilations": [2, 1], "pads": [0, 2, 1, 0]}, 2, (1, 2, 3, 4), False),
    ({"strides": [2, 2], "output_shape": [9, 8]}, 1, (1, 2, 4, 4), True),
    ({"strides": [2, 2], "output_shape": [8, 7], "auto_pad": "SAME_UPPER"}, 1, (1, 2, 4, 4), True),
    ({"strides": [2, 2], "auto_pad": "SAME_UPPER"}, 2, (1, 2, 3, 3), True),
    ({"strides": [2, 2], "auto_pad": "SAME_LOWER"}, 1, (1, 2, 3, 3), True),
    ({"strides": [3], "pads": [2, 1], "output_padding": [2]}, 2, (1, 4, 5), True),
    ({"auto_pad": "VALID", "strides": [2]}, 1, (1, 2, 5), False),
    # an output_shape past the full output (9 x 9; 15), by less than a stride: onnxruntime adds the positions at
    # the end (its bias there)
    ({"strides": [2, 2], "output_shape": [10, 10]}, 1, (1, 2, 4, 4), True),
    ({"strides": [2, 2], "output_shape": [10, 8], "auto_pad": "SAME_UPPER"}, 2, (1, 2, 4, 4), True),
    ({"strides": [3], "output_shape": [17], "auto_pad": "SAME_LOWER"}, 1, (1, 2, 5), True),
]


@pytest.mark.parametrize("attrs,group,x_shape,bias", ONNX_ATTRS, ids=[str(i) for i in range(len(ONNX_ATTRS))])
def test_onnx_conv_transpose_attributes_equal_onnxruntime_and_the_definition(attrs, group, x_shape, bias):
    rng = np.random.default_rng(0)
    attrs = {**attrs, "group": group} if group > 1 else attrs
    c_in, n = x_shape[1], len(x_shape) - 2
    w = rng.normal(size=(c_in, 3, *([3] * n))).astype(np.float32)  # C_out = 3 * group
    b = rng.normal(size=(w.shape[1] * group,)).astype(np.float32) if bias else None
    proto = _convt_proto(attrs, w, b, x_shape)
    cm = pathir.compile(proto)  # the compile-time self-check runs onnxruntime too
    x = rng.normal(size=(3, *x_shape[1:])).astype(np.float32)
    ref = onnx_cases.ort_run(_convt_proto(attrs, w, b, (3, *x_shape[1:])), x)[0]
    assert onnx_cases.rel(cm.forward(x, backend="numpy"), ref) <= 1e-6
    ones = np.ones((1, *x_shape[1:]), dtype=np.float32)
    for q in (1.0, 2.0):
        want = float(onnx_cases.ort_run(_convt_proto(attrs, w, b, x_shape, q=q), ones)[0].astype(np.float64).sum())
        assert cm.path_norm(q) ** q == pytest.approx(want, rel=1e-5)
    assert cm.graph.params()[0].sources[0].layout == TransposedConvLayout(group)


@pytest.mark.parametrize("mode", ["SAME_UPPER", "SAME_LOWER"])
@pytest.mark.parametrize("kernel", [1, 2, 3, 5])
@pytest.mark.parametrize("stride", [1, 2, 3, 4])
def test_onnx_conv_transpose_same_padding_equals_onnxruntime_for_every_kernel_and_stride(mode, kernel, stride):
    """auto_pad SAME_* asks for L·s outputs; where the full output is shorter (a kernel shorter than the stride)
    onnxruntime pads nothing and gives the full output, s·(L − 1) + k (pathir gave L·s: one row more)."""
    rng = np.random.default_rng(kernel * 10 + stride)
    x_shape = (1, 2, 5, 4)
    w = rng.normal(size=(2, 3, kernel, 2)).astype(np.float32)
    b = rng.normal(size=3).astype(np.float32)
    attrs = {"auto_pad": mode, "strides": [stride, 3]}
    cm = pathir.compile(_convt_proto(attrs, w, b, x_shape), self_check=False)
    x = rng.normal(size=(3, *x_shape[1:])).astype(np.float32)
    ref = onnx_cases.ort_run(_convt_proto(attrs, w, b, (3, *x_shape[1:])), x)[0]
    assert cm.forward(x, backend="numpy").shape == ref.shape
    assert onnx_cases.rel(cm.forward(x, backend="numpy"), ref) <= 1e-6


def test_pathcond_on_the_onnx_model_keeps_onnxruntime_outputs():
    torch.manual_seed(0)
    model, shape = UNet().eval(), (3, 8, 8)
    proto = onnx_cases.export(model, shape, "legacy-nofold")
    cm = pathir.compile(proto)
    x = np.random.default_rng(1).normal(size=(2, *shape)).astype(np.float32)
    before = onnx_cases.ort_run(proto, x)[0]
    cm.pathcond()
    new = cm.to_onnx()
    assert onnx_cases.rel(onnx_cases.ort_run(new, x)[0], before) <= 1e-5
    from onnx import numpy_helper

    up = {t.name: numpy_helper.to_array(t) for t in new.graph.initializer}["up.weight"]
    assert up.shape == tuple(model.up.weight.shape) and not np.allclose(up, model.up.weight.detach().numpy())


def test_benchmark_unet_is_exact_and_its_script_runs():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_conv_transpose as bench

    torch.manual_seed(0)
    assert_forward(bench.UNet(2).double().eval(), (3, 8, 8), tol=1e-12)
    out = bench.bench(size=8, width=2, repeat=1)
    assert out["path_norm_q1_ratio"] > 0 and out["diag_g_ratio"] > 0


def test_an_onnx_output_shape_no_input_of_its_size_gives_is_refused():
    """Past the full output by a stride or more: onnxruntime refuses it ("inconsistent with input spatial
    dimensions"); pathir names the node rather than reading the ONNX specification's negative pads."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(2, 3, 3, 3)).astype(np.float32)
    proto = _convt_proto({"strides": [2, 2], "output_shape": [11, 9]}, w, None, (1, 2, 4, 4))
    with pytest.raises(pathir.PathirError, match=r"output_shape \[11, 9\] is 2 positions past the full output"):
        pathir.compile(proto)
