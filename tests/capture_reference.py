"""Definitions the capture tests compare against, computed without pathir.

- :func:`eval_forward`: the model's own forward, eval mode, float64 input,
  training flags restored.
- :class:`Untraceable`: a wrapper torch.fx cannot trace (control flow on a shape), so
  pathir falls back to torch.export: the same model through the other capture path;
- :func:`assert_definition`: path-norms (and path counts) against :func:`path_norm_q`;
- :func:`path_norm_q`: Σ_p |Φ_p|^q by docs/math.md §3 run on a deep copy of the
  model: every parameter θ -> |θ|^q, ReLU -> identity, max -> sum over the
  window (max-pool k = 1), input all ones, sum of the outputs. Fixed weights
  written in the code (x * 0.5, a - b) are raised to |c|^q by the caller's
  model (``fixed``) since no patch can see them.
"""

import contextlib
import copy

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import pathir


def eval_forward(model, *xs):
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            out = model(*xs)
    finally:
        for m, f in flags:
            m.training = f
    return out


def assert_forward(model, input_shape, tol=1e-10, batch=3, **kw):
    """Compile ``model`` (float64) and compare the IR forward with its eval forward."""
    cm = pathir.compile(model, input_shape=input_shape, **kw)
    torch.manual_seed(1)
    x = torch.randn(batch, *input_shape, dtype=torch.float64)
    ref = eval_forward(model, x).numpy()
    out = np.asarray(cm.forward(x.numpy(), backend="numpy"))
    err = np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-300)
    assert err <= tol, f"relative error {err:.3g}"
    return cm


def _identity(x, *a, **k):
    return x


def _window_sum(dims):
    """max_pool{dims}d -> the sum over each window's real elements (padding and the windows' overhang
    in ceil mode hold none): an avg-pool with divisor 1; 1-d through a 2-d pool of height 1."""

    def pool(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
        assert dilation in (1, (1,) * dims) and not return_indices
        k = (kernel_size,) * dims if isinstance(kernel_size, int) else tuple(kernel_size)
        s = k if not stride else ((stride,) * dims if isinstance(stride, int) else tuple(stride))
        p = (padding,) * dims if isinstance(padding, int) else tuple(padding)
        if dims == 1:
            out = F.avg_pool2d(x.unsqueeze(-2), (1, *k), (1, *s), (0, *p), ceil_mode=ceil_mode, divisor_override=1)
            return out.squeeze(-2)
        return F.avg_pool2d(x, k, s, p, ceil_mode=ceil_mode, divisor_override=1)

    return pool


def _max2(a, b=None, *rest, **kw):
    if isinstance(b, torch.Tensor):
        return a + b
    raise AssertionError("reference: only the two-tensor max is patched")


@contextlib.contextmanager
def linearized():
    """ReLU -> identity, max-pool -> window sum, max(a, b) -> a + b (eager torch, patched)."""
    patches = [(torch, "relu"), (torch, "relu_"), (F, "relu"), (F, "relu_"), (torch.Tensor, "relu"),
               (torch.Tensor, "relu_"), (torch, "clamp_min"), (torch.Tensor, "clamp_min")]
    saved = [(o, n, getattr(o, n)) for o, n in patches]
    saved += [(F, "max_pool1d", F.max_pool1d), (F, "max_pool2d", F.max_pool2d), (torch, "maximum", torch.maximum),
              (torch, "max", torch.max), (nn.ReLU, "forward", nn.ReLU.forward)]
    try:
        for o, n in patches:
            setattr(o, n, _identity)
        nn.ReLU.forward = lambda self, x: x
        F.max_pool1d = _window_sum(1)
        F.max_pool2d = _window_sum(2)
        torch.maximum = _max2
        torch.max = _max2
        yield
    finally:
        for o, n, v in saved:
            setattr(o, n, v)


def path_norm_q(model, input_shapes, q=1.0):
    """Σ_p |Φ_p(θ)|^q computed on the model itself (see the module docstring); a model
    with a ``q`` attribute gets it set to q (its fixed constants c become |c|^q)."""
    m = copy.deepcopy(model).double().eval()
    if hasattr(m, "q"):
        m.q = q
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.abs() ** q)
    xs = [torch.ones(1, *s, dtype=torch.float64) for s in input_shapes]
    with linearized(), torch.no_grad():
        out = m(*xs)
    return float(out.sum())


class Untraceable(nn.Module):
    """Python control flow on a shape: torch.fx fails, pathir falls back to torch.export (ATen)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if x.shape[-1] > 100:
            raise ValueError("too wide")
        return self.inner(x)


def assert_definition(cm, model, input_shape, counts=True):
    """cm's path-norms for q = ½, 1, 2 (and path count) equal the model run as its path-norm network."""
    import pytest

    for q in (0.5, 1.0, 2.0):
        assert cm.path_norm(q) ** q == pytest.approx(path_norm_q(model, [input_shape], q), rel=1e-10)
    if counts:
        assert cm.num_paths() == pytest.approx(path_norm_q(model, [input_shape], 0.0), rel=1e-12)
