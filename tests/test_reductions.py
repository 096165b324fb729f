"""Reductions over non-batch axes and ReLU spellings, against the definition on both torch capture
paths and through ONNX: ``sum`` / ``mean`` over any axes (fixed edges of weight 1 / 1/R), ``amax``,
``max(dim).values`` and an adaptive max-pool whose size divides the input (max-pool neurons), a
constant ``masked_fill(mask, 0)`` (a fixed 0 / 1 factor), ``hardtanh(0, inf)`` (a ReLU). The
reference is the model's own float64 forward and, for path-norms, the same model written as the
path-norm network (|θ|^q, ReLU -> identity, max -> sum over the window, fixed weights c -> |c|^q)."""

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from capture_reference import Untraceable, assert_definition, assert_forward, eval_forward, path_norm_q
from hypothesis import given, settings
from hypothesis import strategies as st

import pathir
from pathir.errors import UnsupportedOperation


class Reductions(nn.Module):
    q = None  # set by path_norm_q: the forward is then the path-norm network

    def __init__(self):
        super().__init__()
        self.a, self.b, self.o = nn.Conv2d(2, 4, 3), nn.Conv2d(4, 3, 1), nn.Linear(4 + 3 + 4 + 6 + 4 + 4, 2)
        self.register_buffer("mask", torch.rand(4, 4, 4, generator=torch.Generator().manual_seed(3)) > 0.5)

    def forward(self, x):
        lin = self.q is not None
        h = torch.relu(self.a(x))  # (4, 4, 4)
        g = torch.relu(self.b(h))  # (3, 4, 4)
        a = h.sum((2, 3))
        b = g.sum((2, 3)) if lin else torch.amax(g, dim=(2, 3))
        c = (h.sum(2) if lin else h.max(dim=2).values).sum(-1)
        d = (F.adaptive_avg_pool2d(g, (2, 1)) * 8 if lin else F.adaptive_max_pool2d(g, (2, 1))).flatten(1)
        masked = h.masked_fill(self.mask, 0.0)
        e = (masked if lin else F.hardtanh(masked, 0.0, float("inf"))).mean(dim=1, keepdim=True) if not lin else \
            masked.sum(1, keepdim=True) * 0.25**self.q
        f = h.sum(axis=1).amax(-1) if not lin else h.sum((1, 3))  # numpy's spelling of dim
        return self.o(torch.cat([a, b, c, d, e.sum(-1).flatten(1), f], 1))


class GlobalMax(nn.Module):
    """Global max pooling spelled two ways (nn.AdaptiveMaxPool2d(1), amax) after nn.Hardtanh(0, inf),
    and torch.where between the two by a constant mask."""

    q = None

    def __init__(self):
        super().__init__()
        self.a, self.pool, self.act, self.o = nn.Conv2d(2, 3, 3), nn.AdaptiveMaxPool2d(1), nn.Hardtanh(0, float("inf")), nn.Linear(9, 2)
        self.register_buffer("pick", torch.tensor([True, False, True]))

    def forward(self, x):
        h = self.act(self.a(x)) if self.q is None else self.a(x)
        p = self.pool(h).flatten(1) if self.q is None else h.sum((2, 3))
        m = h.amax((-2, -1)) if self.q is None else h.sum((2, 3))
        w = torch.where(self.pick, p, m) if self.q is None else p * self.pick + m * ~self.pick
        return self.o(torch.cat([p, m, w], 1))


CASES = {"reductions": (Reductions, (2, 6, 6)), "global_max": (GlobalMax, (2, 5, 5))}


def _model(name):
    torch.manual_seed(0)
    cls, shape = CASES[name]
    return cls().double().eval(), shape




@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_path_norms_equal_the_definition(name):
    model, shape = _model(name)
    assert_definition(assert_forward(model, shape, tol=1e-12), model, shape, counts=False)


@pytest.mark.parametrize("name", list(CASES))
def test_export_path_gives_the_definition_too(name):
    model, shape = _model(name)
    wrapped = Untraceable(model)
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(wrapped)
    assert_definition(assert_forward(wrapped, shape, tol=1e-12), model, shape, counts=False)


@pytest.mark.parametrize("name", list(CASES))
def test_pathcond_keeps_the_function(name):
    model, shape = _model(name)
    x = torch.randn(4, *shape, dtype=torch.float64)
    before = eval_forward(model, x)
    pathir.compile(model, input_shape=shape).pathcond()
    assert torch.allclose(eval_forward(model, x), before, rtol=1e-9, atol=1e-12)


class OneReduction(nn.Module):
    """conv -> relu -> one reduction over ``axes`` -> relu -> linear; with ``q`` set, the path-norm
    network (max -> sum, the mean's 1/R -> (1/R)^q)."""

    q = None

    def __init__(self, kind, axes, keepdim):
        super().__init__()
        self.kind, self.axes, self.keepdim = kind, axes, keepdim
        self.a = nn.Conv2d(1, 3, 2)
        out = self._reduce(torch.zeros(1, 3, 4, 5))
        self.o = nn.Linear(out[0].numel(), 2)

    def _reduce(self, h):
        if self.q is not None and self.kind != "sum":
            r = math.prod(h.shape[a] for a in self.axes)
            c = 1.0 if self.kind == "amax" else (1.0 / r) ** self.q
            return h.sum(self.axes, keepdim=self.keepdim) * c
        return getattr(h, self.kind)(self.axes, keepdim=self.keepdim)

    def forward(self, x):
        return self.o(torch.relu(self._reduce(torch.relu(self.a(x)))).flatten(1))


@settings(max_examples=30)
@given(st.sampled_from(["sum", "mean", "amax"]), st.sets(st.sampled_from([1, 2, 3]), min_size=1, max_size=3),
       st.booleans())
def test_random_reductions_equal_the_definition(kind, axes, keepdim):
    axes = tuple(sorted(axes))
    if not keepdim and axes == (1, 2, 3):
        keepdim = True  # one number per sample is refused (tested above)
    torch.manual_seed(0)
    model = OneReduction(kind, axes, keepdim).double().eval()
    cm = assert_forward(model, (1, 5, 6), tol=1e-12)
    for q in (1.0, 2.0):
        assert cm.path_norm(q) ** q == pytest.approx(path_norm_q(model, [(1, 5, 6)], q), rel=1e-10)


class Head(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.a, self.op = nn.Conv2d(2, 3, 3), op

    def forward(self, x):
        return self.op(torch.relu(self.a(x)))


@pytest.mark.parametrize("op,match", [
    (lambda h: h.sum(), "batch"), (lambda h: h.sum(0), "batch"), (lambda h: h.amax(0), "batch"),
    (lambda h: h.flatten(1).sum(1), "one number per sample"),
    (lambda h: F.adaptive_max_pool2d(h, 3), "windows of 2 positions overlap"),
    (lambda h: h.masked_fill(h > 0, 0.0), "compares an activation"),
    (lambda h: h.masked_fill(torch.ones(3, 4, 4, dtype=torch.bool), 1.0), "non-zero constant"),
    (lambda h: F.hardtanh(h, -1.0, 6.0), "clips below|homogeneous"),
])
def test_reductions_outside_the_model_are_refused_with_the_reason(op, match):
    with pytest.raises(UnsupportedOperation, match=match):
        pathir.compile(Head(op).double(), input_shape=(2, 6, 6))


onnx_cases = pytest.importorskip("onnx_cases")


@pytest.mark.parametrize("exporter", ["legacy-nofold", "dynamo-noopt"])
@pytest.mark.parametrize("name", list(CASES))
def test_onnx_export_gives_the_torch_frontends_numbers(name, exporter):
    model, shape = _model(name)
    model = model.float()
    proto = onnx_cases.export(model, shape, exporter)
    cm, ct = onnx_cases.assert_export_matches(proto, model, shape, counts=False)


def _clip_proto(opset, clip_inputs, inits, **attrs):
    from onnx_cases import make_model, node, tensor_info

    rng = np.random.default_rng(0)
    nodes = [node("MatMul", ["x", "W"], ["h"], name="fc"), node("Clip", ["h", *clip_inputs], ["r"], **attrs),
             node("MatMul", ["r", "W2"], ["y"], name="out")]
    return make_model(nodes, [tensor_info("x", [2, 3])], [tensor_info("y", [2, 2])],
                      {"W": rng.normal(size=(3, 4)), "W2": rng.normal(size=(4, 2)), **inits}, opset=opset)


@pytest.mark.parametrize("opset,clip_inputs,inits,attrs", [
    (6, [], {}, {"min": 0.0, "max": float("inf")}),  # bounds as attributes (opset < 11)
    (13, ["lo"], {"lo": np.array(0.0)}, {}),  # no max input
    (13, ["lo", ""], {"lo": np.array(0.0)}, {}),  # an empty max input
    (13, ["lo", "hi"], {"lo": np.array(0.0), "hi": np.array(np.inf)}, {}),
])
def test_onnx_clip_at_zero_without_an_upper_bound_is_a_relu(opset, clip_inputs, inits, attrs):
    proto = _clip_proto(opset, clip_inputs, inits, **attrs)
    cm = pathir.compile(proto)
    assert [n.kind.value for n in cm.graph.nodes].count("relu") == 1
    x = np.random.default_rng(1).normal(size=(2, 3)).astype(np.float32)
    assert onnx_cases.rel(cm.forward(x, backend="numpy"), onnx_cases.ort_run(proto, x)[0]) <= 1e-6


def test_onnx_clip_below_a_bound_other_than_zero_is_refused():
    proto = _clip_proto(13, ["lo", "hi"], {"lo": np.array(-1.0), "hi": np.array(6.0)})
    with pytest.raises(UnsupportedOperation, match="clips below at a bound other than 0"):
        pathir.compile(proto)
