"""Aux heads (branches only the train-mode forward runs) as extra outputs of the graph.

A model compiled in train mode is lowered in its heads forward: every module in eval mode
(batch-norm on running statistics, dropout the identity) except the ancestors of the aux heads.
Checked against definitions, on both capture paths: the graph's forward equals the model's own float64 heads forward,
head by head; the path-norms (q = ½, 1, 2) and path counts of every head, and of the whole DAG
(the sum over outputs, docs/math.md §3), equal the model run as its path-norm network; a
PathCond or random rescaling written back keeps every head, the eval function and the real
train-mode function (batch statistics, dropout with the same random state). A model compiled
in eval mode keeps refusing the write-back, saying how to include its heads."""

import contextlib
import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import written
from capture_reference import Untraceable, linearized
from hypothesis import given, settings
from hypothesis import strategies as st

import pathir
from pathir.app import zoo
from pathir.backends import get_backend
from pathir.errors import PathirError
from pathir.ir import Graph
from pathir.lifting.path_norm import num_paths, path_norm


class WithAux(nn.Module):
    """An aux head that runs only in train mode and reads a hidden layer."""

    def __init__(self, width=4):
        super().__init__()
        self.a, self.b, self.aux = nn.Linear(3, width), nn.Linear(width, 2), nn.Linear(width, 2)

    def forward(self, x):
        h = torch.relu(self.a(x))
        out = self.b(h)
        return (out, self.aux(h)) if self.training else out


class Body(nn.Module):
    """The train-only branch is called by a submodule: its flag decides, not the model's."""

    def __init__(self, width):
        super().__init__()
        self.a, self.aux = nn.Linear(3, width), nn.Sequential(nn.Linear(width, 3), nn.ReLU(), nn.Linear(3, 2))

    def forward(self, x):
        h = torch.relu(self.a(x))
        return (h, self.aux(h)) if self.training else (h, None)


class Nested(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.body, self.b = Body(width), nn.Linear(width, 2)

    def forward(self, x):
        h, aux = self.body(x)
        out = self.b(h)
        return out if aux is None else {"out": out, "aux": aux}


@contextlib.contextmanager
def modes(model, train_paths):
    """Eval mode except ``train_paths`` (the heads forward); the flags restored afterwards."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    for path in train_paths:
        model.get_submodule(path).training = True
    try:
        yield
    finally:
        for m, f in flags:
            m.training = f


def heads(model, x, train_paths=("",)) -> list[torch.Tensor]:
    """The model's own outputs in the heads forward, in order."""
    with modes(model, train_paths), torch.no_grad():
        out = model(x)
    out = list(out.values()) if isinstance(out, dict) else out
    return list(out) if isinstance(out, (tuple, list)) else [out]


@contextlib.contextmanager
def averages_raised(q):
    """Average pools as the path-norm network sees them: each window's weight 1/n as (1/n)^q."""
    avg, adaptive = F.avg_pool2d, F.adaptive_avg_pool2d

    def avg_pool(x, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                 divisor_override=None):
        out = avg(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
        if divisor_override is not None:  # the window sum of a max-pool (linearized)
            return out
        assert count_include_pad and not ceil_mode
        n = float(np.prod((kernel_size,) * 2 if isinstance(kernel_size, int) else kernel_size))
        return out * n ** (1 - q)

    def adaptive_pool(x, size):
        size = (size, size) if isinstance(size, int) else tuple(x.shape[-2 + i] if s is None else s
                                                               for i, s in enumerate(size))
        counts = [torch.tensor([-(-(o + 1) * n // m) - o * n // m for o in range(m)], dtype=x.dtype)
                  for n, m in zip(x.shape[-2:], size)]  # window o: [floor(o n/m), ceil((o+1) n/m))
        return adaptive(x, size) * torch.outer(*counts) ** (1 - q)  # 1/n in each window: n^(1-q)

    F.avg_pool2d, F.adaptive_avg_pool2d = avg_pool, adaptive_pool
    try:
        yield
    finally:
        F.avg_pool2d, F.adaptive_avg_pool2d = avg, adaptive


def head_path_norms(model, shape, q, train_paths=("",)) -> list[float]:
    """Σ_p |Φ_p|^q over the paths ending at each head: the model (batch-norms fused into their
    convolutions) as its path-norm network (docs/math.md §3), in the heads forward."""
    m = copy.deepcopy(model).double()
    for path, mod in list(m.named_modules()):
        conv, bn = getattr(mod, "conv", None), getattr(mod, "bn", None)
        if isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d):
            mod.conv = torch.nn.utils.fusion.fuse_conv_bn_eval(conv.eval(), bn.eval())
            mod.bn = nn.Identity()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.abs() ** q)
    with linearized(), averages_raised(q):
        return [float(h.sum()) for h in heads(m, torch.ones(1, *shape, dtype=torch.float64), train_paths)]


def to_head(graph: Graph, head: str) -> Graph:
    """The sub-DAG of the nodes that reach ``head``, ``head`` its one output."""
    keep, stack = set(), [head]
    while stack:
        name = stack.pop()
        if name not in keep:
            keep.add(name)
            stack.extend(e.source for e in graph.node(name).edges)
    return graph.replace_nodes([n for n in graph.nodes if n.name in keep], outputs=[head])


def assert_heads_forward(cm, model, x, train_paths=("",)):
    refs = heads(model, x, train_paths)
    out = cm.forward(x.numpy(), backend="numpy")
    outs = [out[k] for k in cm.graph.outputs] if isinstance(out, dict) else [out]
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        np.testing.assert_allclose(o, r.numpy(), rtol=1e-10, atol=1e-10 * float(r.abs().max()))


def assert_path_norms(cm, model, shape, qs=(0.5, 1.0, 2.0), train_paths=("",), rel=1e-10, counts=True):
    """Every head's path-norms and path count, and the whole DAG's (their sum), against the definition."""
    backend = get_backend("torch")
    for q in (*qs, 0.0) if counts else qs:
        want = head_path_norms(model, shape, q, train_paths)
        got = [num_paths(to_head(cm.graph, h), backend) if q == 0 else path_norm(to_head(cm.graph, h), q, backend) ** q
               for h in cm.graph.outputs]
        assert got == pytest.approx(want, rel=rel)
        total = cm.num_paths() if q == 0 else cm.path_norm(q) ** q
        assert total == pytest.approx(sum(want), rel=rel)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("make, train_paths", [
    (WithAux, ("",)),
    (Nested, ("", "body")),
    (lambda: Untraceable(Nested()), ("", "inner", "inner.body")),  # the torch.export path
], ids=["aux", "nested", "nested-export"])
def test_heads_are_outputs_exact_and_kept_by_pathcond(make, train_paths):
    torch.manual_seed(0)
    model = make().double().train()
    cm = pathir.compile(model, input_shape=(3,))
    assert cm.writer.train_paths == list(train_paths) and cm.writer.train_only == []
    assert len(cm.graph.outputs) == 2 and model.training and model.get_submodule(train_paths[-1]).training
    x = torch.randn(5, 3, dtype=torch.float64)
    assert_heads_forward(cm, model, x, train_paths)
    assert_path_norms(cm, model, (3,), train_paths=train_paths)
    before_heads, before_eval = heads(model, x, train_paths), heads(model, x, ())
    kept = written.state(model)
    report = cm.pathcond()
    assert report.objective_after < report.objective_before and written.moved(model, kept) > 1e-3
    for a, b in zip(heads(model, x, train_paths) + heads(model, x, ()), before_heads + before_eval):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert model.training


@settings(max_examples=25, deadline=None)
@given(width=st.integers(1, 6), seed=st.integers(0, 2**16), scale=st.floats(0.1, 3.0))
def test_random_rescaling_keeps_every_head(width, seed, scale):
    torch.manual_seed(seed)
    model = Nested(width).double().train()
    cm = pathir.compile(model, input_shape=(3,))
    x = torch.randn(4, 3, dtype=torch.float64)
    before = heads(model, x, ("", "body")) + heads(model, x, ())
    z = np.random.default_rng(seed).normal(scale=scale, size=len(cm.units))
    expected = cm.rescaled(z).graph  # θ ⊙ exp(-Bz/2), computed on the graph
    cm.commit_rescaling(z)
    after = heads(model, x, ("", "body")) + heads(model, x, ())
    for a, b in zip(after, before):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    # the model's own tensors now hold exactly those values
    for p, q in zip(pathir.compile(model, input_shape=(3,)).graph.params(), expected.params()):
        assert p.name == q.name and np.allclose(p.value, q.value, rtol=1e-12, atol=1e-300)


class TrainScaled(WithAux):
    """The train-mode forward computes its main output differently: keeping the heads would not keep
    the eval function."""

    def forward(self, x):
        h = torch.relu(self.a(x))
        return (self.b(h) * 2.0, self.aux(h)) if self.training else self.b(h)


def test_eval_output_not_among_the_heads_fails_the_self_check():
    model = TrainScaled().double().train()
    state = _state(model)
    with pytest.raises(pathir.SelfCheckFailed, match="eval forward's output 0 is none of the outputs"):
        pathir.compile(model, input_shape=(3,))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items()) and model.training


def test_eval_mode_refuses_and_says_how():
    model = WithAux().double().eval()
    cm = pathir.compile(model, input_shape=(3,))
    assert len(cm.graph.outputs) == 1
    state = _state(model)
    with pytest.raises(PathirError, match=r"aux run only in train mode.*compile the model in train mode"):
        cm.pathcond()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_relowered_graph_keeps_the_heads():
    """A model compiled with its heads and then moved (here: to eval mode, a weight changed) is
    lowered again in the same heads forward: the outputs do not change meaning."""
    torch.manual_seed(0)
    model = Nested().double().train()
    cm = pathir.compile(model, input_shape=(3,))
    model.eval()
    with torch.no_grad():
        model.body.aux[0].weight.mul_(2.0)
    x = torch.randn(4, 3, dtype=torch.float64)
    assert len(cm.graph.outputs) == 2
    assert_heads_forward(cm, model, x, ("", "body"))
    assert_path_norms(cm, model, (3,), train_paths=("", "body"))


def _train_forward(model, x, seed):
    """The real train-mode forward: batch statistics, dropout drawn from ``seed``."""
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model(x)
    return list(out)


def _zoo_check(name, shape, pathcond, num_classes=10):
    """Compile the zoo model in train mode, then rescale it (PathCond, or a random rescaling
    written back the way PathCond commits it): every head, the eval and the train-mode function kept."""
    torch.manual_seed(0)
    model = zoo.build(name, num_classes=num_classes).double().train()
    with pytest.warns(UserWarning, match="train mode"):
        cm = pathir.compile(model, input_shape=shape)
    assert cm.writer.train_paths == [""] and cm.writer.train_only == []
    x = torch.randn(2, *shape, dtype=torch.float64)
    assert_heads_forward(cm, model, x)
    twin = copy.deepcopy(model)  # the model before, run in train mode beside it
    before_heads, before_eval, kept = heads(model, x), heads(model, x, ()), written.state(model)
    if pathcond:
        report = cm.pathcond(max_sweeps=5)
        assert report.objective_after < report.objective_before
    else:
        cm.commit_rescaling(np.random.default_rng(0).normal(scale=0.5, size=len(cm.units)))
    assert written.moved(model, kept) > 0.01  # written into the model's own tensors
    assert model.training
    for a, b in zip(heads(model, x) + heads(model, x, ()), before_heads + before_eval):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9 * float(b.abs().max()))
    # every batch-norm reads a convolution, whose output the rescaling does not move: the batch
    # statistics, and so the train-mode function, are kept too (dropout: the same random masks)
    for a, b in zip(_train_forward(copy.deepcopy(model), x, 1), _train_forward(twin, x, 1)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9 * float(b.abs().max()))
    return cm, model


def test_googlenet_aux_heads_exact_and_kept():
    cm, model = _zoo_check("googlenet", (3, 32, 32), pathcond=False)
    assert cm.graph.outputs == ("fc", "aux2.fc2", "aux1.fc2")
    assert_path_norms(cm, model, (3, 32, 32), qs=(1.0,), rel=1e-8, counts=False)  # the slow test counts


@pytest.mark.slow
@pytest.mark.parametrize("name, shape, heads_", [
    ("googlenet", (3, 64, 64), 3),
    ("inception_v3", (3, 299, 299), 2),  # the aux head's 5x5 conv needs 299x299
])
def test_zoo_aux_heads_kept_by_pathcond(name, shape, heads_):
    cm, model = _zoo_check(name, shape, pathcond=True)
    assert len(cm.graph.outputs) == heads_
    assert_path_norms(cm, model, shape, qs=(1.0, 2.0), rel=1e-8)


def test_checks_run_the_heads_forward():
    """``pathir.checks.check`` compares and writes back in the forward the graph computes: every
    check holds and every parameter (the heads' included) is read by the graph."""
    import pathir.checks

    torch.manual_seed(0)
    report = pathir.checks.check(Nested().double().train(), input_shape=(3,))
    assert report.passed and all(c.passed for c in report.checks) and not report.not_reached
