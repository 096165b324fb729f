"""The op-table corpus: small models, one or a few table rows each, that tests/test_op_tables.py
lowers and checks against their definition (the model's own float64 forward; onnxruntime for ONNX).

torch: :func:`case` registers ``Op(fn, shape)``, a model ``x -> pre(x) -> fn -> ReLU -> flatten ->
Linear``: the op under test sits between a convolution (or a linear layer) and a dense layer, inside
a ReLU DAG. ``fn(m, a)`` (or ``fn(m, a, b)`` with a second pre-layer branch ``b``) is the op; ``m``
is the model, holding what ``mods()`` returns (submodules, parameters, buffers).

ATen overloads that torch.export never produces from a module in this torch version are reached by
hand-built fx graphs (:func:`aten_case`): ``pre -> op -> post``, interpreted by the export
interpreter and compared with the GraphModule run in float64.

Rows whose rule refuses every call (flipud flips the batch axis; ``aten.sub.Scalar``) are in
``REFUSALS``: there is nothing exact to compare, the test checks they are reached and refused.

ONNX: :func:`onnx_case` registers a graph ``x -> Conv/Gemm -> op nodes -> Relu -> Flatten -> Gemm``
built with onnx.helper, compared with onnxruntime.

A new row gets a case here: a ``case(...)`` (torch), ``aten_case(...)`` (an ATen overload torch.export
does not make from a module) or ``onnx_case(...)``; tests/test_op_tables.py fails for a row no case
reaches.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import operator
from typing import Callable

import numpy as np
import onnxruntime as ort
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from onnx_cases import make_model, node, tensor_info
from torch_models import randomize_bn

import pathir
from pathir.frontends.torch.export import _ExportInterpreter, lower_exported
from pathir.nn import ClippedReLU

aten = torch.ops.aten
INF = math.inf

# ====================================================================== torch models


def _pre(shape) -> nn.Module:
    """A layer that keeps the per-sample shape: Linear for vectors and 5-d inputs (on the last axis),
    a padded Conv1d / Conv2d otherwise."""
    if len(shape) in (1, 4):
        return nn.Linear(shape[-1], shape[-1])
    conv = {2: nn.Conv1d, 3: nn.Conv2d}[len(shape)]
    return conv(shape[0], shape[0], 3, padding=1)


class Op(nn.Module):
    """``post(relu(fn(m, pre(x)[, pre2(x)])).flatten(1))``."""

    def __init__(self, fn, shape, mods=None):
        super().__init__()
        self.fn = fn
        self.two = len(inspect.signature(fn).parameters) == 3
        self.pre = _pre(shape)
        self.pre2 = _pre(shape) if self.two else None
        for k, v in (mods() if mods else {}).items():
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter):
                self.register_buffer(k, v)
            else:
                setattr(self, k, v)
        with torch.no_grad():
            out = self.body(torch.randn(2, *shape))
        self.post = nn.Linear(out[0].numel(), 2)

    def body(self, x):
        if self.two:
            return self.fn(self, self.pre(x), self.pre2(x))
        return self.fn(self, self.pre(x))

    def forward(self, x):
        return self.post(torch.relu(self.body(x)).flatten(1))


@dataclasses.dataclass
class TorchCase:
    name: str
    make: Callable[[], nn.Module]  # a float64 model in eval mode (seeded)
    shape: tuple
    paths: tuple = ("fx", "export")
    xfail: str | None = None  # a known defect: the case fails, its failure naming ``expect``
    expect: str | None = None


TORCH: dict[str, TorchCase] = {}


def _register(name, shape, make, paths, xfail=None, expect=None):
    assert name not in TORCH, name
    TORCH[name] = TorchCase(name, make, tuple(shape), paths, xfail, expect)


def case(name, shape, fn, mods=None, paths=("fx", "export"), export_xfail=None, fx_xfail=None, expect=None,
         export_gap=None, fx_gap=None):
    """Register ``Op(fn, shape, mods)``. A known defect on one capture path (``export_xfail`` /
    ``fx_xfail``: why, ``expect``: what its failure says; ``export_gap`` / ``fx_gap``: the target
    torch.export / torch.fx makes of the op, which has no row): the case runs on the other path, and
    a strict xfail case on the failing one."""
    if export_gap:
        export_xfail = (f"torch.export makes {export_gap} of it, which has no row in frontends/torch/table.py "
                        "(its torch spelling has one): the export path refuses what the fx path lowers")
        expect = f"(op {export_gap.removeprefix('aten.')})"
    if fx_gap:
        fx_xfail = (f"torch.fx traces it as {fx_gap}, which has no row in frontends/torch/table.py (its ATen "
                    "twin has one): the fx path refuses what the export path lowers")
        expect = f"(op {fx_gap.removeprefix('Tensor.')})"

    def make():
        torch.manual_seed(sum(map(ord, name)))
        return randomize_bn(Op(fn, shape, mods), seed=1).double().eval()

    if export_xfail:
        _register(name, shape, make, ("fx",))
        _register(f"{name} [export]", shape, make, ("export",), export_xfail, expect)
    elif fx_xfail:
        _register(name, shape, make, ("export",))
        _register(f"{name} [fx]", shape, make, ("fx",), fx_xfail, expect)
    else:
        _register(name, shape, make, paths)


def P(*shape):
    """A learnable parameter (drawn from the case's seed)."""
    return nn.Parameter(torch.randn(*shape) * 0.5)


#: per-sample input shapes: a vector, and 1-d, 2-d, 3-d feature maps (channels first)
V, C1, C2, C3 = (6,), (3, 8), (3, 6, 6), (2, 3, 4, 4)

# ---------------------------------------------------------------- layers
case("linear", V, lambda m, a: F.linear(torch.relu(m.lin(a)), m.w, m.b),
     lambda: {"lin": nn.Linear(6, 5), "w": P(4, 5), "b": P(4)})
case("conv fns", C2, lambda m, a: F.conv2d(F.conv1d(a.flatten(2), m.w1, m.b1, padding=1).unflatten(2, (6, 6)), m.w2,
                                           None, padding=1),
     lambda: {"w1": P(3, 3, 3), "b1": P(3), "w2": P(4, 3, 3, 3)})
case("conv padding same", C2, lambda m, a: F.conv2d(F.conv1d(a.flatten(2), m.w1, padding="same").unflatten(2, (6, 6)),
                                                    m.w2, m.b2, padding="same"),
     lambda: {"w1": P(3, 3, 3), "w2": P(4, 3, 3, 3), "b2": P(4)})
case("conv3d fn", C3, lambda m, a: F.conv3d(a, m.w, m.b, padding=1), lambda: {"w": P(3, 2, 3, 3, 3), "b": P(3)})
case("conv3d padding same", C3, lambda m, a: F.conv3d(a, m.w, m.b, padding="same"),
     lambda: {"w": P(3, 2, 3, 3, 3), "b": P(3)})
case("conv modules", C2, lambda m, a: m.c2(m.c1(a.flatten(2)).unflatten(2, (6, 6))),
     lambda: {"c1": nn.Conv1d(3, 3, 3, padding=1), "c2": nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")})
case("conv3d module", C3, lambda m, a: m.c(a), lambda: {"c": nn.Conv3d(2, 3, 3, padding=1, padding_mode="circular")})
case("conv fixed kernel", C2, lambda m, a: F.conv2d(a, m.k, padding=1, groups=3),
     lambda: {"k": torch.outer(torch.tensor([1.0, 2, 1]), torch.tensor([1.0, 3, 1])).repeat(3, 1, 1, 1)})
case("conv_transpose fns", C1, lambda m, a: F.conv_transpose2d(
    F.conv_transpose1d(a, m.w1, m.b1, stride=2).unsqueeze(-1), m.w2, None, stride=(2, 1), padding=1),
     lambda: {"w1": P(3, 2, 3), "b1": P(2), "w2": P(2, 3, 3, 3)})
case("conv_transpose3d fn", C3, lambda m, a: F.conv_transpose3d(a, m.w, m.b, stride=2),
     lambda: {"w": P(2, 2, 2, 2, 2), "b": P(2)})
case("conv_transpose modules", C1, lambda m, a: m.t2(m.t1(a, output_size=(18,)).unsqueeze(-1)),
     lambda: {"t1": nn.ConvTranspose1d(3, 2, 3, stride=2), "t2": nn.ConvTranspose2d(2, 2, (3, 1), padding=(1, 0))})
case("conv_transpose3d module", C3, lambda m, a: m.t(a), lambda: {"t": nn.ConvTranspose3d(2, 2, (1, 2, 1), stride=(1, 2, 1))})
case("batch_norm fn", C2, lambda m, a: F.batch_norm(a, m.rm, m.rv, m.w, m.b, eps=1e-3),
     lambda: {"rm": torch.randn(3), "rv": torch.rand(3) + 0.5, "w": P(3), "b": P(3)})
case("batch_norm modules", C2, lambda m, a: m.bn3(m.bn1(m.bn2(a).flatten(2)).unsqueeze(2).unsqueeze(2)),
     lambda: {"bn1": nn.BatchNorm1d(3), "bn2": nn.BatchNorm2d(3), "bn3": nn.BatchNorm3d(3)})
case("matmul spellings", V, lambda m, a: torch.mm(torch.matmul(torch.relu(a) @ m.w1, m.w2).relu(), m.w3),
     lambda: {"w1": P(6, 5), "w2": P(5, 5), "w3": P(5, 4)})
case("matmul methods", V, lambda m, a: a.matmul(m.w1).relu().mm(m.w2), lambda: {"w1": P(6, 5), "w2": P(5, 4)})
case("addmm", V, lambda m, a: torch.addmm(m.b2, torch.addmm(m.b1, a, m.w1, alpha=2.0).relu(), m.w2, beta=0),
     lambda: {"w1": P(6, 5), "b1": P(5), "w2": P(5, 4), "b2": P(4)})
case("addmm method", V, lambda m, a: m.b.addmm(a, m.w, alpha=0.5), lambda: {"w": P(6, 4), "b": P(4)})

# ---------------------------------------------------------------- ReLU spellings and the identity
case("relu fns", V, lambda m, a, b: F.relu(a) + torch.relu(b) + torch.relu_(a * 2) + F.relu_(b * 3))
case("relu methods", V, lambda m, a, b: a.relu() + (b * 2).relu_() + m.r(a - b), lambda: {"r": nn.ReLU()})
case("leaky_relu", V, lambda m, a, b: F.leaky_relu(a, 0.0) + m.r(b), lambda: {"r": nn.LeakyReLU(0.0)})
case("clamp", V, lambda m, a, b: torch.clamp(a, min=0) + b.clamp(0.0))
case("clip", V, lambda m, a, b: torch.clip(a, 0) + b.clip(min=0))
case("clamp_min", V, lambda m, a, b: torch.clamp_min(a, 0) + b.clamp_min(0.0))
case("clamps in place", V, lambda m, a, b: torch.clamp_(a * 2, min=0) + (b * 3).clamp_(0.0) + (a * 4).clip_(0)
     + torch.clip_(b * 5, 0) + torch.clamp_min_(a * 6, 0) + (b * 7).clamp_min_(0.0) + F.threshold_(a * 8, 0.0, 0.0)
     + F.leaky_relu_(b * 9, 0.0))
case("threshold", V, lambda m, a, b: F.threshold(a, 0.0, 0.0) + torch.threshold(b, 0, 0) + m.t(a - b),
     lambda: {"t": nn.Threshold(0.0, 0.0)})
case("hardtanh", V, lambda m, a, b: F.hardtanh(a, 0.0, INF) + F.hardtanh_(b * 2, 0.0, INF) + m.h(a - b),
     lambda: {"h": nn.Hardtanh(0.0, INF)})
case("relu6", V, lambda m, a, b: F.relu6(a) + F.relu6(b * 2, inplace=True) + m.r(a - b), lambda: {"r": nn.ReLU6()})
case("clipped hardtanh and clamp", C2, lambda m, a, b: F.hardtanh(a, 0.0, 0.5) + F.hardtanh_(b * 2, 0.0, 0.7)
     + m.h(a - b) + torch.clamp(a, 0, 0.4) + b.clamp(min=0.0, max=0.3), lambda: {"h": nn.Hardtanh(0.0, 0.6)})
case("ClippedReLU module", C2, lambda m, a: m.c(a), lambda: {"c": ClippedReLU(torch.tensor([0.2, 0.5, 0.9]))})
case("clamp by a buffer", C2, lambda m, a, b: torch.clamp(torch.relu(a), max=m.t) + torch.relu(b).clamp(max=m.u)
     + torch.relu(a - b).clamp_(max=m.t), lambda: {"t": torch.tensor([0.2, 0.5, 0.3]).reshape(3, 1, 1),
                                                    "u": torch.full((1, 3, 1, 1), 0.4)})
case("ClippedReLU module in place", C2, lambda m, a: m.c(a * 1.0),
     lambda: {"c": ClippedReLU(torch.tensor([0.2, 0.5, 0.9]), inplace=True)})
case("minimum", C2, lambda m, a, b: torch.minimum(torch.relu(a), m.t) + torch.relu(b).minimum(m.u),
     lambda: {"t": torch.tensor([0.2, 0.5, 0.3]).reshape(3, 1, 1), "u": torch.full((1, 3, 1, 1), 0.4)})
case("dropout fns", C2, lambda m, a: F.dropout2d(F.dropout1d(F.dropout(a, 0.5, m.training).flatten(2), 0.5,
                                                             m.training).unflatten(2, (6, 6)), 0.5, m.training))
case("alpha_dropout fn", C2, lambda m, a: F.alpha_dropout(a, 0.5, m.training))
case("feature_alpha_dropout fn", C2, lambda m, a: F.feature_alpha_dropout(a, 0.5, m.training))
case("identity methods", C2, lambda m, a: a.transpose(2, 3).contiguous().clone().detach())
case("detach_", C2, lambda m, a: (a * 1.0).detach_())
case("copy_", C2, lambda m, a, b: (a * 1.0).copy_(b) + (b * 2.0).copy_(a[:, :1].clone()))
case("dropout modules", C2, lambda m, a: m.i(m.d2(m.d1(m.d(a).flatten(2)).unflatten(2, (6, 6)))),
     lambda: {"d": nn.Dropout(0.3), "d1": nn.Dropout1d(0.3), "d2": nn.Dropout2d(0.3), "i": nn.Identity()})
case("alpha_dropout module", C2, lambda m, a: m.d(a), lambda: {"d": nn.AlphaDropout(0.3)})
case("dropout3d fn and module", C3, lambda m, a: m.d(F.dropout3d(a, 0.5, m.training)), lambda: {"d": nn.Dropout3d(0.3)})
case("feature_alpha_dropout module", C2, lambda m, a: m.d(a), lambda: {"d": nn.FeatureAlphaDropout(0.3)})

# ---------------------------------------------------------------- sums, differences, constant factors


def _adds(m, a, b):
    h = a + b
    h = torch.add(h, a, alpha=2)
    h = h.add(b) + 0
    h.add_(a)
    h += b
    return h


def _subs(m, a, b):
    h = a - b
    h = torch.sub(h, a, alpha=0.5).sub(a)
    h.sub_(b)
    h -= a
    return h


def _inplace_mul(h, gamma):
    h.mul_(2.0)
    h *= 0.5
    h = 3 * h
    return h * gamma


def _inplace_div(h):
    h.div_(2.0)
    h /= 4
    return h


case("add", C2, _adds)
case("sub", C2, _subs)
case("subtract", C2, lambda m, a, b: torch.subtract(a, b).subtract(b))
case("rsub", V, lambda m, a, b: torch.rsub(a, b) + torch.Tensor.__rsub__(b, a))
case("neg", V, lambda m, a: -torch.neg(a).neg())
case("negative", V, lambda m, a: torch.negative(a).negative())
case("mul", C2, lambda m, a: torch.mul(a * 2.0, 0.5).mul(3).mul(m.c).mul(m.pos),
     lambda: {"c": torch.tensor(1.5), "pos": torch.rand(1, 6, 6) + 0.5})
case("multiply", C2, lambda m, a: torch.multiply(a, 0.5).multiply(m.c), lambda: {"c": torch.rand(3, 1, 1) + 0.5})
case("mul in place", C2, lambda m, a: _inplace_mul(a * 1.0, m.gamma), lambda: {"gamma": P(3, 1, 1)})
case("div", C2, lambda m, a: torch.div(a / 2.0, 4).div(m.c).div(m.pos), lambda: {"c": torch.tensor(-2.0),
                                                                                  "pos": torch.rand(3, 1, 1) + 0.5})
case("divide", C2, lambda m, a: torch.divide(a, 4).divide(m.c), lambda: {"c": torch.tensor(-2.0)})
case("true_divide", C2, lambda m, a: torch.true_divide(a, 4).true_divide(m.c), lambda: {"c": torch.tensor(-2.0)})
case("div in place", C2, lambda m, a: _inplace_div(a * 1.0))
case("maximum", C2, lambda m, a, b: torch.maximum(a, b).maximum(b * 2))
case("fmax", C2, lambda m, a, b: torch.fmax(a, b).fmax(a - b))
case("maximum with 0", C2, lambda m, a, b: torch.maximum(a, torch.zeros_like(a)) + torch.max(m.z, b)
     + torch.fmax(a - b, torch.tensor(0.0)) + torch.max(b, a.new_zeros(())), lambda: {"z": torch.zeros(3, 1, 1)})

# ---------------------------------------------------------------- pools and reductions
case("max_pool fns", C2, lambda m, a: torch.max_pool2d(F.max_pool2d(a, 2, 1, padding=1), 2).flatten(2) +
     F.max_pool1d(torch.max_pool1d(a.flatten(2), 3, 1, 1), 4, 4, 1)[..., :9])
case("max_pool3d fn", C3, lambda m, a: F.max_pool3d(a, 2, ceil_mode=True))
case("max_pool fns with indices", C2, lambda m, a: F.max_pool2d(a, 2, return_indices=True)[0].flatten(2) +
     F.max_pool1d(a.flatten(2), 4, return_indices=True)[0])
case("max_pool3d fn with indices", C3, lambda m, a: F.max_pool3d(a, 2, return_indices=True)[0])
case("max_pool modules", C2, lambda m, a: m.p1(m.p2(a).flatten(2)), lambda: {"p1": nn.MaxPool1d(2),
                                                                             "p2": nn.MaxPool2d(3, 1, 1)})
case("max_pool3d module", C3, lambda m, a: m.p(a), lambda: {"p": nn.MaxPool3d((1, 2, 1))})
case("avg_pool fns", C2, lambda m, a: F.avg_pool2d(a, 3, 2, 1, count_include_pad=False).flatten(2) +
     F.avg_pool1d(a.flatten(2), 4, 4)[..., :9])
case("avg_pool modules", C2, lambda m, a: m.p1(m.p2(a).flatten(2)),
     lambda: {"p1": nn.AvgPool1d(2), "p2": nn.AvgPool2d(2, ceil_mode=True, divisor_override=3)})
case("adaptive_avg_pool fns", C2, lambda m, a: F.adaptive_avg_pool2d(a, (3, 4)).flatten(2) +
     F.adaptive_avg_pool1d(a.flatten(2), 12))
case("adaptive_avg_pool modules", C2, lambda m, a: m.p1(m.p2(a).flatten(2)),
     lambda: {"p1": nn.AdaptiveAvgPool1d(5), "p2": nn.AdaptiveAvgPool2d((4, None))})
case("adaptive_max_pool fns", C2, lambda m, a: F.adaptive_max_pool2d(a, (3, 2)).flatten(2) +
     F.adaptive_max_pool1d(a.flatten(2), 6))
case("adaptive_max_pool modules", C2, lambda m, a: m.p1(m.p2(a).flatten(2)),
     lambda: {"p1": nn.AdaptiveMaxPool1d(3), "p2": nn.AdaptiveMaxPool2d(3)})
case("avg_pool3d fn", C3, lambda m, a: F.avg_pool3d(a, 2, 1, 1, divisor_override=3))
case("avg_pool3d module", C3, lambda m, a: m.p(a),
     lambda: {"p": nn.AvgPool3d((2, 2, 3), stride=(1, 2, 1), padding=(0, 1, 1), count_include_pad=False, ceil_mode=True)})
case("adaptive_avg_pool3d fn", C3, lambda m, a: F.adaptive_avg_pool3d(a, (2, 3, 3)))
case("adaptive_avg_pool3d module", C3, lambda m, a: m.p(a), lambda: {"p": nn.AdaptiveAvgPool3d((3, 2, None))})
case("adaptive_max_pool3d fn", C3, lambda m, a: F.adaptive_max_pool3d(a, (3, 2, 2)))
case("casts to the model's own dtype", C2, lambda m, a: a.double() + a.to(torch.float64) + a.to("cpu") +
     a.to("cpu", torch.float64) + a.type(torch.float64) + a.type("torch.DoubleTensor"))
case("adaptive_max_pool fns with indices", C2, lambda m, a: F.adaptive_max_pool2d(a, (3, 2), return_indices=True)[0]
     .flatten(2) + F.adaptive_max_pool1d(a.flatten(2), 6, return_indices=True)[0])
case("adaptive_max_pool3d fn with indices", C3, lambda m, a: F.adaptive_max_pool3d(a, (3, 2, 2), True)[0])
case("adaptive_max_pool3d module", C3, lambda m, a: m.p(a), lambda: {"p": nn.AdaptiveMaxPool3d((1, 4, 2))})
case("mean", C2, lambda m, a: torch.mean(a, (2, 3), keepdim=True) + a.mean(dim=2, keepdim=True).mean(-1, True))
case("mean over channels", C2, lambda m, a: torch.mean(a, 1)[:, 0] + a.mean((1, 3)))
case("sum", C2, lambda m, a: torch.sum(a, 1) + a.sum(dim=(1,)))
case("amax", C2, lambda m, a: torch.amax(a, (1, 3)) + a.amax(dim=1).amax(-1))
case("max over a dim", C2, lambda m, a: torch.max(a, 1)[0] + a.max(dim=1).values + torch.max(a, 1, keepdim=True).values
     .squeeze(1))
case("max of two", C2, lambda m, a, b: torch.max(a, b) + a.max(b))
case("where", C2, lambda m, a, b: torch.where(m.mask, a, b), lambda: {"mask": torch.rand(1, 6, 6) > 0.5})
case("where with 0", C2, lambda m, a: torch.where(m.mask, a, 0.0) + a.where(m.mask, 0.0),
     lambda: {"mask": torch.rand(1, 6, 6) > 0.5})
case("where 0 with", C2, lambda m, a: torch.where(m.mask, 0.0, a), lambda: {"mask": torch.rand(1, 6, 6) > 0.5})
case("masked_fill", C2, lambda m, a: _masked_fill(a * 1.0, m.m1, m.m2),
     lambda: {"m1": torch.rand(3, 1, 6) > 0.5, "m2": torch.rand(6, 1) > 0.5})


def _masked_fill(h, m1, m2):
    h.masked_fill_(m1, 0.0)
    return torch.masked_fill(h, m2, 0).masked_fill(m1, 0.0)


case("slice_scatter", C2, lambda m, a: torch.slice_scatter(a, torch.relu(a[:, :2]), 1, 0, 2))
case("select_scatter", C2, lambda m, a: torch.select_scatter(a, torch.relu(a[:, 1]), 1, 1))
# an in-place write through a view that a later op reads: the fx path hands it to torch.export's
# functionalized graph (tests/test_functional_writes.py), so only the export path is a case here
case("relu_ on a slice, the base read later", C2, lambda m, a: _write_slices(a * 1.0), paths=("export",))
case("setitem 0 and fill_ on a channel", C2, lambda m, a: _zero_channels(a * 1.0), paths=("export",))


# torch.export writes x[:, idx] = src as index_put_ (index_put once functionalized); the torch spelling
# indexes the leading axes, the batch axis first, so it has no row: only ATen's index_put takes None
case("index_put_: a list, a mask, an activation", C2, lambda m, a: _index_put(a * 1.0, m.idx, m.mask, m.src),
     lambda: {"idx": torch.tensor([0, 2]), "mask": torch.tensor([False, True, False]), "src": torch.tensor([2])},
     paths=("export",))
case("index_put through a view read later", C2, lambda m, a: _index_put_view(a * 1.0, m.idx),
     lambda: {"idx": torch.tensor([1])}, paths=("export",))


def _index_put(h, idx, mask, src):
    h[:, mask] = torch.relu(h[:, src])  # channel 1 reads channel 2
    h[:, idx] = 0  # zeroes channels 0 and 2
    return h


def _index_put_view(h, idx):
    v = h[:, 1:]
    v[:, idx] = 0  # through a view: functionalized as index_put, slice_scatter
    return h


def _write_slices(h):
    h[:, :2].relu_()  # functionalized: relu, slice_scatter
    h[:, 2].mul_(-0.5)  # mul, select_scatter
    h[:, :1] = torch.relu(h[:, 1:2])  # copy, slice_scatter
    return h


def _zero_channels(h):
    h[:, 1] = 0  # functionalized: fill.Tensor, select_scatter
    h[:, 0, :2].fill_(0.0)  # fill.Scalar, slice_scatter
    h[:, 2, 1].zero_()  # zero, select_scatter
    return h


# ---------------------------------------------------------------- fixed linear maps
case("pad fn", C2, lambda m, a: F.pad(F.pad(F.pad(F.pad(a, (1, 2)), (1, 1, 2, 0), mode="reflect"), (1, 1, 1, 1),
                                            mode="replicate"), (2, 1, 0, 1), mode="circular"))
case("pad fn 1d", C1, lambda m, a: F.pad(F.pad(F.pad(a, (2, 1), mode="reflect"), (1, 3), mode="replicate"), (1, 1),
                                        mode="circular"))
case("pad fn 3d", C3, lambda m, a: F.pad(F.pad(a, (1, 1, 1, 1, 1, 1), mode="replicate"), (1, 0, 0, 1, 1, 1),
                                        mode="reflect"))
case("pad modules 1d", C1, lambda m, a: m.p5(m.p4(m.p3(m.p2(m.p1(a))))),
     lambda: {"p1": nn.ZeroPad1d(1), "p2": nn.ConstantPad1d((1, 2), 0.0), "p3": nn.ReflectionPad1d(2),
              "p4": nn.ReplicationPad1d((0, 1)), "p5": nn.CircularPad1d(1)})
case("pad modules 2d", C2, lambda m, a: m.p5(m.p4(m.p3(m.p2(m.p1(a))))),
     lambda: {"p1": nn.ZeroPad2d((1, 0, 1, 0)), "p2": nn.ConstantPad2d(1, 0.0), "p3": nn.ReflectionPad2d((1, 2, 0, 1)),
              "p4": nn.ReplicationPad2d(1), "p5": nn.CircularPad2d((1, 1, 2, 0))})
case("pad modules 3d", C3, lambda m, a: m.p5(m.p4(m.p3(m.p2(m.p1(a))))),
     lambda: {"p1": nn.ZeroPad3d(1), "p2": nn.ConstantPad3d((0, 1, 0, 0, 1, 0), 0.0), "p3": nn.ReflectionPad3d(1),
              "p4": nn.ReplicationPad3d((1, 0, 0, 1, 0, 0)), "p5": nn.CircularPad3d(1)})
case("interpolate", C2, lambda m, a: F.interpolate(a, scale_factor=2, mode="bilinear", align_corners=False) +
     F.interpolate(a, size=(12, 12), mode="nearest") + F.interpolate(a, scale_factor=2, mode="bicubic", align_corners=True)
     + F.interpolate(a, size=(12, 12), mode="nearest-exact"))
case("interpolate 1d", C1, lambda m, a: F.interpolate(a, size=11, mode="linear", align_corners=True) +
     F.interpolate(a, scale_factor=1.5, mode="nearest-exact")[..., :11].flip(2) +
     F.interpolate(a, size=11, mode="nearest"))
case("interpolate 3d", C3, lambda m, a: F.interpolate(a, scale_factor=(1, 2, 1.5), mode="trilinear") +
     F.interpolate(a, size=(3, 8, 6), mode="nearest") + F.interpolate(a, size=(3, 8, 6), mode="nearest-exact"))
case("upsample modules", C2, lambda m, a: m.u1(a) + m.u2(a) + m.u3(a),
     lambda: {"u1": nn.Upsample(scale_factor=2), "u2": nn.UpsamplingBilinear2d(size=(12, 12)),
              "u3": nn.UpsamplingNearest2d(scale_factor=2)})
case("pixel_shuffle", (4, 4, 4), lambda m, a: F.pixel_unshuffle(F.pixel_shuffle(a, 2), 2))
case("pixel_shuffle modules", (4, 4, 4), lambda m, a: m.u(m.s(a)),
     lambda: {"s": nn.PixelShuffle(2), "u": nn.PixelUnshuffle(2)})

# ---------------------------------------------------------------- element moves (functions)
case("flatten reshape", C2, lambda m, a: torch.reshape(torch.flatten(a, 2), (-1, 3, 6, 6)).flatten(1))
case("transpose permute", C2, lambda m, a: torch.permute(torch.transpose(a, 1, 3), (0, 2, 1, 3)))
case("chunk split", C2, lambda m, a: torch.cat(torch.chunk(a, 3, 1)[::-1], 1) + torch.cat(torch.split(a, [2, 4], 2)[::-1],
                                                                                          2) +
     torch.cat(torch.split(a, 2, 3), 3))
case("squeeze unsqueeze", C2, lambda m, a: torch.cat([torch.squeeze(torch.unsqueeze(a, 2), 2),
                                                      torch.unsqueeze(torch.squeeze(a[:, :1], 1), 1),
                                                      a[:, :1, None].squeeze((2,))], 1))
case("squeeze all", C2, lambda m, a: torch.squeeze(a[:, :, :1]) + a[:, :, :1].squeeze())
case("getitem", C2, lambda m, a: a[:, 1:, ::2, 3:] + a[:, :2, 1::2, -3:][:, :, None, ..., 0, :].squeeze(2)
     .unsqueeze(3).expand(-1, -1, -1, 3))
case("getitem by a list", C2, lambda m, a: a[:, :, :, [0, 2, 5]] + a[..., [1, 1, 4]])
case("stack hstack", V, lambda m, a, b: torch.hstack([torch.stack([a, b], 1), torch.stack((b, a), dim=1)]))
case("flips", C2, lambda m, a: torch.flip(a, (2, 3)) + torch.fliplr(a))
case("roll rot90", C2, lambda m, a: torch.roll(a, 2, 3) + torch.rot90(a, 1, (2, 3)) + torch.roll(a, (1, -1), (2, 3)))
case("tile", V, lambda m, a: torch.tile(a, (2,)))
case("movedim family", C2, lambda m, a: torch.swapdims(torch.swapaxes(torch.moveaxis(torch.movedim(a, 1, 3), 2, 1),
                                                                       1, 2), 2, 3) + torch.movedim(a, (1, 2), (2, 1)))
case("unbind select narrow", C2, lambda m, a: torch.unbind(a, 1)[2] + torch.select(a, 1, 0) +
     torch.narrow(a, 1, 1, 1).squeeze(1))
case("index_select", C2, lambda m, a: torch.index_select(a, 3, m.idx), lambda: {"idx": torch.tensor([5, 0, 0, 2])})
case("repeat_interleave", V, lambda m, a: torch.repeat_interleave(a, 2, dim=1))
case("repeat_interleave by a tensor", V, lambda m, a: torch.repeat_interleave(a, m.reps, dim=1),
     lambda: {"reps": torch.tensor([1, 0, 3, 2, 1, 1])})
case("tensor_split", C2, lambda m, a: torch.cat(torch.tensor_split(a, 2, 2)[::-1], 2) +
     torch.cat(torch.tensor_split(a, [1, 3], 3)[::-1], 3))
case("channel_shuffle", (4, 3, 3), lambda m, a: torch.channel_shuffle(a, 2))
case("cat", C2, lambda m, a, b: torch.cat([a, b], 1) + torch.cat((b, a), dim=1))
case("concat", C2, lambda m, a, b: torch.concat([a, b], 1))
case("cat elementwise", C2, lambda m, a, b: torch.cat([a, b[:, :, :2]], 2))
case("zeros blocks and type_as", C2, lambda m, a: torch.cat(
    [a, torch.zeros_like(a[:, :1]), a.new_zeros(a[:, :2].shape)], 1).type_as(a))
case("unflatten", (12,), lambda m, a: torch.unflatten(a, 1, (3, 4)) + a.unflatten(1, (3, 4)) + m.u(a),
     lambda: {"u": nn.Unflatten(1, (3, 4))})
case("flatten module", C2, lambda m, a: m.f(a), lambda: {"f": nn.Flatten(2)})
case("channel_shuffle module", (4, 3, 3), lambda m, a: m.s(a), lambda: {"s": nn.ChannelShuffle(2)})
case("shape queries", C2, lambda m, a: a.view(a.size(0), a.shape[1], -1).reshape(a.size()[0], a.dim() * 3,
                                                                                       a.ndim + 5))
case("numel", C2, lambda m, a: a.view(a.size(0), a.numel() // a.size(0)) + a.reshape(-1, torch.numel(a) // a.shape[0]))

# ---------------------------------------------------------------- element moves (methods)
case("view methods", C2, lambda m, a: a.view(-1, 3, 36).reshape(-1, 108).flatten(1).unflatten(1, (3, 6, 6)))
case("view_as", C2, lambda m, a, b: a.flatten(1).view_as(b))
case("reshape_as", C2, lambda m, a, b: a.flatten(1).reshape_as(b))
case("transpose methods", C2, lambda m, a: a.transpose(1, 2).permute(0, 3, 2, 1).movedim(1, 2).moveaxis(2, 3)
     .swapaxes(1, 2).swapdims(1, 3))
case("matrix transposes", C2, lambda m, a: a.mT + a.mH + torch.adjoint(a) + a.adjoint())
case("chunk split methods", C2, lambda m, a: torch.cat(a.chunk(2, 3)[::-1], 3) + torch.cat(a.split(2, 2)[::-1], 2) +
     torch.cat(a.split_with_sizes([1, 5], 2)[::-1], 2) + torch.cat(a.tensor_split(3, dim=3)[::-1], 3))
case("squeeze methods", C2, lambda m, a: a.unsqueeze(1).squeeze(1).narrow(2, 1, 4).select(1, 0).unsqueeze(1) +
     a.unbind(1)[1][:, 1:5].unsqueeze(1))
case("flip methods", C2, lambda m, a: a.flip(3).roll(1, 2).rot90(1, (2, 3)) + a.fliplr())
case("repeat methods", V, lambda m, a: a.repeat(1, 2).tile((1,)).repeat_interleave(2, 1)[:, ::2] +
     a.unsqueeze(1).expand(-1, 2, -1).flatten(1))
case("expand_as", V, lambda m, a, b: a[:, :1].expand_as(b))
case("index_select unfold methods", C1, lambda m, a: a.index_select(2, m.idx).unfold(2, 3, 2).flatten(2),
     lambda: {"idx": torch.tensor([7, 1, 2, 2, 3])})

# ====================================================================== hand-built ATen graphs

#: the ATen call of each pre-layer kind (what torch.export makes of it)
_PRE_ATEN = {1: (aten.linear.default, ()), 4: (aten.linear.default, ()), 2: (aten.conv1d.default, ([1], [1])),
             3: (aten.conv2d.default, ([1, 1], [1, 1]))}


class _Builder:
    """Adds nodes to an fx Graph: ``c(op, *args)`` a call_function node, ``c.get(name)`` a get_attr node."""

    def __init__(self, graph):
        self.graph = graph

    def __call__(self, op, *args, **kwargs):
        return self.graph.call_function(op, args, kwargs)

    def get(self, name):
        return self.graph.get_attr(name)

    def item(self, node, k=0):
        return self.graph.call_function(operator.getitem, (node, k))


@dataclasses.dataclass
class AtenCase:
    name: str
    make: Callable[[], torch.fx.GraphModule]  # float64, seeded
    shape: tuple
    xfail: str | None = None
    expect: str | None = None


ATEN: dict[str, AtenCase] = {}


def aten_case(name, shape, op, mods=None, xfail=None, expect=None, table=None):
    """``x -> pre -> op(c, h) -> relu -> flatten -> linear`` as an fx graph of ATen calls; ``op`` adds
    the op's nodes through the builder ``c`` and returns its output node."""

    def graph_module(root, post: bool):
        g = torch.fx.Graph()
        c = _Builder(g)
        pre, extra = _PRE_ATEN[len(shape)]
        h = c(pre, g.placeholder("x"), c.get("pre.weight"), c.get("pre.bias"), *extra)
        y = op(c, h)
        if post:
            y = c(aten.linear.default, c(aten.flatten.using_ints, c(aten.relu.default, y), 1), c.get("post.weight"),
                  c.get("post.bias"))
        g.output(y)
        return torch.fx.GraphModule(root, g, "AtenGraph")

    def make():
        torch.manual_seed(sum(map(ord, name)))
        root = nn.Module()
        root.pre = _pre(shape)
        for k, v in (mods() if mods else {}).items():
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter):
                root.register_buffer(k, v)
            else:
                setattr(root, k, v)
        with torch.no_grad():
            out = graph_module(root, False)(torch.randn(2, *shape))
        root.post = nn.Linear(out[0].numel(), 2)
        return graph_module(root, True).double().eval()

    table = ATEN if table is None else table
    assert name not in table, name
    table[name] = AtenCase(name, make, tuple(shape), xfail, expect)


def _arange(c, *args):
    return c(aten.arange.start_step, *args, dtype=torch.int64)


aten_case("convolution", C2, lambda c, h: c(aten.convolution.default, c(aten.convolution.default, h, c.get("w"), c.get("b"),
                                                                        [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
                                            c.get("wt"), None, [2, 2], [1, 1], [1, 1], True, [1, 1], 1),
          lambda: {"w": P(4, 3, 3, 3), "b": P(4), "wt": P(4, 2, 3, 3)})
aten_case("_native_batch_norm_legit_no_training", C2, lambda c, h: c.item(c(
    aten._native_batch_norm_legit_no_training.default, h, c.get("w"), c.get("b"), c.get("rm"), c.get("rv"), 0.1, 1e-5)),
          lambda: {"w": P(3), "b": P(3), "rm": torch.randn(3), "rv": torch.rand(3) + 0.5})
aten_case("max_pool2d_with_indices", C2, lambda c, h: c.item(c(aten.max_pool2d_with_indices.default, h, [3, 3], [2, 2],
                                                                [1, 1], [1, 1], True)))
aten_case("max_pool3d_with_indices", C3, lambda c, h: c.item(c(aten.max_pool3d_with_indices.default, h, [2, 2, 2],
                                                                [2, 2, 2], [0, 0, 0], [1, 1, 1], False)))
aten_case("_adaptive_avg_pool2d", C2, lambda c, h: c(aten._adaptive_avg_pool2d.default, h, [4, 3]))
aten_case("_adaptive_avg_pool3d", C3, lambda c, h: c(aten._adaptive_avg_pool3d.default, h, [2, 3, 3]))
aten_case("adaptive_avg_pool3d", C3, lambda c, h: c(aten.adaptive_avg_pool3d.default, h, [3, 2, 2]))
aten_case("avg_pool3d", C3, lambda c, h: c(aten.avg_pool3d.default, h, [2, 2, 2], [1, 1, 1], [1, 1, 1]))
aten_case("adaptive_max_pool3d", C3, lambda c, h: c.item(c(aten.adaptive_max_pool3d.default, h, [3, 2, 2])))
aten_case("scalar arithmetic", C2, lambda c, h: c(aten.div.Scalar, c(aten.mul.Scalar, c(aten.add.Scalar, h, 0, alpha=2),
                                                                     -1.5), 4))
aten_case("_unsafe_view", C2, lambda c, h: c(aten._unsafe_view.default, h, [-1, 3, 36]))
aten_case("sym_size", C2, lambda c, h: c(aten.view.default, h, [c(aten.sym_size.int, h, 0), c(aten.sym_size.int, h, 1),
                                                               -1]))
aten_case("_to_copy", C2, lambda c, h: c(aten._to_copy.default, h, dtype=torch.float64))
aten_case("index", C2, lambda c, h: c(aten.index.Tensor, h, [None, None, _arange(c, 5, -1, -2), None]))
aten_case("_unsafe_index", C2, lambda c, h: c(aten._unsafe_index.Tensor, h, [None, None, None, _arange(c, 0, 6, 2)]))
aten_case("identity ops", C2, lambda c, h: c(aten.lift_fresh_copy.default, c(aten.alias.default, c(
    aten.contiguous.default, c(aten.transpose.int, h, 2, 3)))))
aten_case("constant_pad_nd", C2, lambda c, h: c(aten.constant_pad_nd.default, c(aten.constant_pad_nd.default, h, [1, 2, 0, 1]),
                                                [1, 1], 0.0))
aten_case("pads 1d", C1, lambda c, h: c(aten.replication_pad1d.default, c(aten.reflection_pad1d.default, h, [2, 1]), [1, 3]))
aten_case("pads 2d", C2, lambda c, h: c(aten.replication_pad2d.default, c(aten.reflection_pad2d.default, h, [2, 1, 0, 3]),
                                        [1, 0, 2, 1]))
aten_case("pads 3d", C3, lambda c, h: c(aten.replication_pad3d.default, c(aten.reflection_pad3d.default, h,
                                                                          [1, 1, 0, 2, 1, 0]), [0, 1, 1, 0, 2, 1]))
aten_case("upsample nearest 1d", C1, lambda c, h: c(aten.add.Tensor, c(aten.upsample_nearest1d.default, h, [12]),
                                                   c(aten._upsample_nearest_exact1d.default, h, [12], 1.5)))
aten_case("upsample_linear1d", C1, lambda c, h: c(aten.upsample_linear1d.default, h, [12], True))
aten_case("upsample nearest 2d", C2, lambda c, h: c(aten.add.Tensor, c(aten.upsample_nearest2d.default, h, [12, 9]),
                                                   c(aten._upsample_nearest_exact2d.default, h, [12, 9], 2.0, 1.5)))
aten_case("upsample_bilinear2d", C2, lambda c, h: c(aten.upsample_bilinear2d.default, h, [12, 9], False))
aten_case("upsample_bicubic2d", C2, lambda c, h: c(aten.upsample_bicubic2d.default, h, [12, 9], True, None, 1.5))
aten_case("antialiased upsampling", C2, lambda c, h: c(aten.add.Tensor, c(aten.add.Tensor, c(
    aten._upsample_bilinear2d_aa.vec, h, [4, 3], False, None), c(aten._upsample_bicubic2d_aa.vec, h, None, True, [0.7, 0.5])),
    c(aten.add.Tensor, c(aten._upsample_bilinear2d_aa.default, h, [4, 3], True), c(
        aten._upsample_bicubic2d_aa.default, h, [4, 3], False, 0.7, 0.5))))
aten_case("upsample 3d", C3, lambda c, h: c(aten.add.Tensor, c(aten.add.Tensor, c(
    aten.upsample_nearest3d.default, h, [3, 8, 6]), c(aten._upsample_nearest_exact3d.default, h, [3, 8, 6])), c(
    aten.upsample_trilinear3d.default, h, [3, 8, 6], False, None, 2.0, 1.5)))

# ====================================================================== rows that refuse every call


@dataclasses.dataclass
class Refusal:
    """Rows whose rule refuses whatever the arguments: ``lower()`` reaches them and is refused."""

    rows: tuple
    lower: Callable[[], object]
    why: str


def _fx(fn, shape):
    def lower():
        return pathir.compile(Op(fn, shape).double().eval(), input_shape=shape)
    return lower


def _export(fn, shape):
    def lower():
        return lower_exported(Op(fn, shape).double().eval(), shape, "Op")
    return lower


def _aten(name):
    def lower():
        gm = ATEN_REFUSED[name].make()
        return _ExportInterpreter(gm, gm.graph, name, {}, {}).run([ATEN_REFUSED[name].shape])
    return lower


ATEN_REFUSED: dict[str, AtenCase] = {}
aten_case("sub.Scalar", C2, lambda c, h: c(aten.sub.Scalar, h, 1.0), table=ATEN_REFUSED)

_BATCH_FLIP = "flipud reverses axis 0, the batch axis: it mixes the samples of a batch"
_BATCH_PAD = "pads or crops the batch axis"
_BATCH_MOVE = "moves the batch axis"
_CONSTANT = "a difference with a non-zero constant operand: a fixed bias no parameter carries"
_CAST = "casts an activation to {} in a float64 model"
REFUSALS = {
    "float": Refusal(("float",), _fx(lambda m, a: a.float().double(), C2), _CAST.format("float32")),
    "half": Refusal(("half",), _fx(lambda m, a: a.half().double(), C2), _CAST.format("float16")),
    "bfloat16": Refusal(("bfloat16",), _fx(lambda m, a: a.bfloat16().double(), C2), _CAST.format("bfloat16")),
    "aten.rsub.Scalar": Refusal((aten.rsub.Scalar,), _export(lambda m, a: 1 - a, C2), _CONSTANT),
    "aten.sub.Scalar": Refusal((aten.sub.Scalar,), _aten("sub.Scalar"), _CONSTANT),
    "pad batch axis": Refusal((F.pad,), _fx(lambda m, a: F.pad(a, (0, 0, 0, 0, 0, 0, 1, 0)), C2), _BATCH_PAD),
    "aten.pad batch axis": Refusal((aten.pad.default,),
                                   _export(lambda m, a: F.pad(a, (0, 0, 0, 0, 0, 0, 0, -1)), C2), _BATCH_PAD),
    # (a 2-d transpose of a (batch, features) activation: always across the batch axis)
    "torch.t": Refusal((torch.t,), _fx(lambda m, a: torch.t(torch.t(a)), V), _BATCH_MOVE),
    "t": Refusal(("t",), _fx(lambda m, a: a.t().t(), V), _BATCH_MOVE),
    "aten.t": Refusal((aten.t.default,), _export(lambda m, a: a.t().t(), V), _BATCH_MOVE),
    "aten.numpy_T": Refusal((aten.numpy_T.default,), _export(lambda m, a: a.T.T, V), _BATCH_MOVE),
    "aten.matrix_H": Refusal((aten.matrix_H.default,), _export(lambda m, a: a.H.H, V), _BATCH_MOVE),
    "aten.clamp.Tensor": Refusal((aten.clamp.Tensor,), _export(lambda m, a: torch.clamp(a, torch.zeros(()), torch.full((3, 1, 1), 6.0)), C2),
                                 "clamps with a tensor bound"),
}


# ====================================================================== ONNX graphs


@dataclasses.dataclass
class OnnxCase:
    name: str
    make: Callable[[], object]  # an onnx.ModelProto (seeded)
    shape: tuple
    xfail: str | None = None
    expect: str | None = None


ONNX: dict[str, OnnxCase] = {}


def _onnx_pre(shape, out: str, rng) -> tuple[list, dict]:
    """A Gemm (vectors) or a padded Conv that keeps the per-sample shape."""
    c = shape[0]
    if len(shape) == 1:
        inits = {f"{out}_w": rng.normal(size=(c, c)), f"{out}_b": rng.normal(size=c)}
        return [node("Gemm", ["x", f"{out}_w", f"{out}_b"], [out], transB=1)], inits
    k = (3,) * (len(shape) - 1)
    inits = {f"{out}_w": rng.normal(size=(c, c, *k)) * 0.5, f"{out}_b": rng.normal(size=c)}
    return [node("Conv", ["x", f"{out}_w", f"{out}_b"], [out], pads=[1] * (2 * len(k)))], inits


def onnx_case(name, shape, op, opset=17, xfail=None):
    """``x -> pre -> op -> Relu -> Flatten -> Gemm``; ``op(h)`` (or ``op(h, g)`` with a second pre-layer
    branch ``g``) returns (nodes, {initializer: array, or a function of the case's seeded rng making
    one}, output name)."""

    def make():
        rng = np.random.default_rng(sum(map(ord, name)))
        nodes, inits = _onnx_pre(shape, "h", rng)
        names = ["h"]
        if len(inspect.signature(op).parameters) == 2:
            more, more_inits = _onnx_pre(shape, "g", rng)
            nodes, inits, names = nodes + more, {**inits, **more_inits}, ["h", "g"]
        op_nodes, op_inits, y = op(*names)
        nodes, inits = nodes + op_nodes, {**inits, **{k: v(rng) if callable(v) else v for k, v in op_inits.items()}}
        x_info = tensor_info("x", ["N", *shape])
        size = ort_output(_unchecked(nodes, x_info, y, inits, opset), np.zeros((2, *shape), np.float32)).reshape(2, -1).shape[1]
        post = [node("Relu", [y], ["post_relu"]), node("Flatten", ["post_relu"], ["post_flat"], axis=1),
                node("Gemm", ["post_flat", "post_w", "post_b"], ["out"], transB=1)]
        inits.update(post_w=rng.normal(size=(2, size)) / np.sqrt(size), post_b=rng.normal(size=2))
        return make_model(nodes + post, [x_info], [tensor_info("out", ["N", 2])], inits, opset)

    assert name not in ONNX, name
    ONNX[name] = OnnxCase(name, make, tuple(shape), xfail)


def _unchecked(nodes, x_info, y, inits, opset):
    """The graph up to ``y`` (its output shape left unknown): a probe of the op's output size."""
    tensors = [numpy_helper.from_array(v if v.dtype == np.int64 else v.astype(np.float32), k)
               for k, v in ((k, np.asarray(v)) for k, v in inits.items())]
    graph = helper.make_graph(nodes, "probe", [x_info], [helper.make_tensor_value_info(y, TensorProto.FLOAT, None)],
                              tensors)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


def ort_output(proto, x):
    """onnxruntime's (float32) output of ``proto`` on the batch ``x``."""
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _i64(*v):
    return np.asarray(v, dtype=np.int64)


def _rand(*shape):
    return lambda rng: rng.normal(size=shape)


def _positive(*shape):
    return lambda rng: rng.uniform(0.5, 2.0, size=shape)


def one(op, inputs=("h",), inits=None, **attrs):
    """A case of one node ``op`` on ``inputs`` (output "y")."""
    return [node(op, list(inputs), ["y"], **attrs)], inits or {}, "y"


# ---------------------------------------------------------------- layers
onnx_case("Gemm", V, lambda h: one("Gemm", ["h", "w", "b"], {"w": _rand(6, 4), "b": _rand(4)}, alpha=0.5, beta=2.0))
onnx_case("MatMul", V, lambda h: one("MatMul", ["h", "w"], {"w": _rand(6, 4)}))
onnx_case("Conv", C2, lambda h: one("Conv", ["h", "w", "b"], {"w": _rand(6, 1, 3, 3), "b": _rand(6)}, group=3,
                                    strides=[2, 1], pads=[1, 0, 1, 2]))
onnx_case("ConvTranspose", C1, lambda h: one("ConvTranspose", ["h", "w", "b"], {"w": _rand(3, 2, 3), "b": _rand(2)},
                                             strides=[2], pads=[1, 0]))
onnx_case("BatchNormalization", C2, lambda h: one("BatchNormalization", ["h", "s", "b", "m", "v"],
                                                  {"s": _rand(3), "b": _rand(3), "m": _rand(3), "v": _positive(3)},
                                                  epsilon=1e-3))
onnx_case("MaxPool", C2, lambda h: one("MaxPool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1))
onnx_case("GlobalMaxPool", C2, lambda h: one("GlobalMaxPool"))
onnx_case("AveragePool", C2, lambda h: one("AveragePool", kernel_shape=[3, 2], strides=[2, 1], pads=[1, 0, 1, 1],
                                           count_include_pad=0))
onnx_case("GlobalAveragePool", C2, lambda h: one("GlobalAveragePool"))

# ---------------------------------------------------------------- ReLU spellings, the identity, sums
onnx_case("Relu", V, lambda h: one("Relu"))
onnx_case("LeakyRelu", V, lambda h: one("LeakyRelu", alpha=0.0))
onnx_case("ThresholdedRelu", V, lambda h: one("ThresholdedRelu", alpha=0.0))
onnx_case("Clip", V, lambda h: one("Clip", ["h", "lo"], {"lo": np.zeros((), np.float32)}))
onnx_case("Min of a Relu", C2, lambda h: ([node("Relu", ["h"], ["r"]), node("Min", ["r", "t"], ["y"])],
                                          {"t": np.array([0.2, 0.5, 0.9], np.float32).reshape(1, 3, 1, 1)}, "y"))
onnx_case("identities", C2, lambda h: ([node("Identity", ["h"], ["i"]), node("Dropout", ["i"], ["d"]),
                                        node("Cast", ["d"], ["c"], to=TensorProto.FLOAT),
                                        node("CastLike", ["c", "i"], ["y"])], {}, "y"))
onnx_case("Shape Size", C2, lambda h: ([node("Shape", ["h"], ["s"], end=1), node("Size", ["h"], ["n"]),
                                        node("Div", ["n", "s"], ["k"]), node("Concat", ["s", "k"], ["t"], axis=0),
                                        node("Reshape", ["h", "t"], ["y"])], {}, "y"))
onnx_case("Add", C2, lambda h, g: ([node("Add", ["h", "g"], ["s"]), node("Add", ["bias", "s"], ["y"])],
                                   {"bias": _rand(3, 1, 1)}, "y"))
onnx_case("Sum Mean", C2, lambda h, g: ([node("Sum", ["h", "g", "h"], ["s"]), node("Sum", ["s"], ["s1"]),
                                        node("Mean", ["s1", "g"], ["y"])], {}, "y"))

# ---------------------------------------------------------------- constant factors, differences, maxima, masks
onnx_case("Sub", C2, lambda h, g: one("Sub", ["h", "g"]))
onnx_case("Neg", V, lambda h: one("Neg"))
onnx_case("Mul", C2, lambda h: ([node("Mul", ["h", "c"], ["m"]), node("Mul", ["per", "m"], ["y"])],
                                {"c": np.asarray(-1.5, np.float32), "per": _rand(3, 1, 6)}, "y"))
onnx_case("Div", C2, lambda h: ([node("Div", ["h", "c"], ["m"]), node("Div", ["m", "per"], ["y"])],
                                {"c": np.asarray(4.0, np.float32), "per": _positive(1, 6, 1)}, "y"))
onnx_case("Max", C2, lambda h, g: one("Max", ["h", "g"]))
onnx_case("Where", C2, lambda h, g: ([node("Cast", ["mask01"], ["mask"], to=TensorProto.BOOL),
                                     node("Where", ["mask", "h", "g"], ["y"])],
                                    {"mask01": lambda rng: rng.random((1, 6, 6)) > 0.5}, "y"))
onnx_case("ReduceSum", C2, lambda h: one("ReduceSum", ["h", "axes"], {"axes": _i64(1)}, keepdims=0))
onnx_case("ReduceMean", C2, lambda h: ([node("ReduceMean", ["h"], ["a"], axes=[2, 3], keepdims=1),
                                        node("ReduceMean", ["h"], ["b3"], axes=[3], keepdims=1),
                                        node("ReduceMean", ["b3"], ["b"], axes=[2], keepdims=1),
                                        node("Add", ["a", "b"], ["y"])], {}, "y"))
onnx_case("ReduceMax", C2, lambda h: one("ReduceMax", axes=[1, 3], keepdims=0))

# ---------------------------------------------------------------- resampling
onnx_case("Resize", C2, lambda h: ([node("Resize", ["h", "", "s1"], ["a"], mode="linear"),
                                    node("Shape", ["h"], ["nc"], end=2), node("Concat", ["nc", "hw"], ["s2"], axis=0),
                                    node("Resize", ["h", "", "", "s2"], ["b"], mode="nearest",
                                         coordinate_transformation_mode="asymmetric"),
                                    node("Resize", ["h", "", "s1"], ["c"], mode="cubic",
                                         coordinate_transformation_mode="align_corners"),
                                    node("Add", ["a", "b"], ["ab"]),
                                    node("Add", ["ab", "c"], ["y"])],
                                   {"s1": np.asarray([1, 1, 2, 1.5], np.float32), "hw": _i64(12, 9)}, "y"))
onnx_case("Upsample", C2, lambda h: one("Upsample", ["h", "s"], {"s": np.asarray([1, 1, 2, 3], np.float32)},
                                        mode="nearest"), opset=9)

# ---------------------------------------------------------------- element moves and sequences
onnx_case("Concat", C2, lambda h, g: ([node("Concat", ["h", "g"], ["c"], axis=1), node("Concat", ["h", "g"], ["d"], axis=3),
                                       node("Reshape", ["d", "shape"], ["e"]), node("Add", ["c", "e"], ["y"])],
                                      {"shape": _i64(0, 6, 6, 6)}, "y"))
onnx_case("Pad", C2, lambda h: ([node("Pad", ["h", "p1"], ["a"]), node("Pad", ["a", "p2"], ["y"], mode="reflect")],
                                {"p1": _i64(0, 0, 1, 0, 0, 0, 0, 2), "p2": _i64(0, 0, 0, 1, 0, 0, 2, 1)}, "y"))
onnx_case("Reshape Flatten", C2, lambda h: ([node("Reshape", ["h", "s"], ["a"]), node("Flatten", ["a"], ["y"], axis=1)],
                                            {"s": _i64(0, 6, 3, 6)}, "y"))
onnx_case("Transpose", C2, lambda h: one("Transpose", perm=[0, 3, 1, 2]))
onnx_case("Squeeze Unsqueeze", C2, lambda h: ([node("Unsqueeze", ["h", "ax"], ["u"]), node("Squeeze", ["u", "ax"], ["y"])],
                                              {"ax": _i64(2)}, "y"))
onnx_case("Split", C2, lambda h: ([node("Split", ["h", "sp"], ["a", "b"], axis=2), node("Concat", ["b", "a"], ["y"], axis=2)],
                                  {"sp": _i64(2, 4)}, "y"))
onnx_case("Slice", C2, lambda h: one("Slice", ["h", "st", "en", "ax", "stp"], {"st": _i64(5, 1), "en": _i64(-7, 6),
                                                                               "ax": _i64(3, 2), "stp": _i64(-2, 2)}))
onnx_case("Gather", C2, lambda h: one("Gather", ["h", "idx"], {"idx": _i64(4, 0, 0, 2)}, axis=3))
onnx_case("GatherElements", C2, lambda h: (  # torch.gather(x, 3, idx.expand(N, -1, -1, -1)): repeats, drops
    [node("Shape", ["h"], ["n"], end=1), node("Concat", ["n", "rest"], ["s"], axis=0), node("Expand", ["idx", "s"], ["i"]),
     node("GatherElements", ["h", "i"], ["y"], axis=3)],
    {"rest": _i64(3, 6, 4), "idx": lambda rng: rng.integers(0, 6, size=(1, 3, 6, 4))}, "y"))
onnx_case("Expand Tile", C2, lambda h: ([node("ReduceMax", ["h"], ["m"], axes=[2], keepdims=1),
                                         node("Expand", ["m", "s"], ["e"]), node("Tile", ["h", "r"], ["t"]),
                                         node("Slice", ["t", "st", "en", "ax"], ["u"]), node("Add", ["e", "u"], ["y"])],
                                        {"s": _i64(1, 1, 6, 1), "r": _i64(1, 1, 1, 2), "st": _i64(3), "en": _i64(9),
                                         "ax": _i64(3)}, "y"))
onnx_case("ScatterND", C2, lambda h: (  # as the dynamo exporter writes x[:, 1:3] = x[:, :1]; x[:, 0] = 0
    [node("Transpose", ["h"], ["t"], perm=[1, 0, 2, 3]), node("Gather", ["t", "i0"], ["g"], axis=0),
     node("ScatterND", ["t", "idx", "g"], ["s"]), node("Gather", ["t", "i1g"], ["g1"], axis=0),
     node("Shape", ["g1"], ["gs"]), node("ConstantOfShape", ["gs"], ["z"]),
     node("ScatterND", ["s", "i1", "z"], ["s2"]), node("Transpose", ["s2"], ["y"], perm=[1, 0, 2, 3])],
    {"i0": _i64(0, 0), "idx": np.array([[1], [2]], dtype=np.int64), "i1": np.array([[0]], dtype=np.int64),
     "i1g": _i64(0)}, "y"))
onnx_case("ScatterElements", C2, lambda h: (  # x[:, 1] = x[:, 0]; x[:, 2] = 0 with per-element indices
    [node("Slice", ["h", "c0", "c1", "ax"], ["u"]), node("Shape", ["u"], ["us"]),
     node("Expand", ["one", "us"], ["i"]), node("ScatterElements", ["h", "i", "u"], ["s"], axis=1),
     node("ConstantOfShape", ["us"], ["z"]), node("Expand", ["two", "us"], ["j"]),
     node("ScatterElements", ["s", "j", "z"], ["y"], axis=1)],
    {"c0": _i64(0), "c1": _i64(1), "ax": _i64(1), "one": _i64(1), "two": _i64(2)}, "y"))
onnx_case("DepthToSpace SpaceToDepth", (4, 4, 4), lambda h: (
    [node("DepthToSpace", ["h"], ["d"], blocksize=2, mode="CRD"), node("SpaceToDepth", ["d"], ["y"], blocksize=2)], {}, "y"))
onnx_case("SplitToSequence SequenceAt", C2, lambda h: (
    [node("SplitToSequence", ["h", "sp"], ["s"], axis=1), node("SequenceAt", ["s", "i"], ["a"]),
     node("SequenceAt", ["s", "j"], ["b"]), node("Concat", ["b", "a"], ["y"], axis=1)],
    {"sp": _i64(1, 2), "i": _i64(0), "j": _i64(1)}, "y"))
