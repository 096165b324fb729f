"""Activation-filtered observables on real models: zoo models against autograd, the linear
regime against the global path-norm, the ONNX frontend against the torch frontend."""

import copy

import numpy as np
import pytest
import torch
from onnx_cases import exported

import pathir
from pathir.app import zoo


def _jvp(model, x, v):
    model = copy.deepcopy(model).double().eval()
    _, out = torch.func.jvp(model, (torch.tensor(x),), (torch.tensor(v),))
    return out.detach().numpy()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "densenet121", "squeezenet1_0", "googlenet"])
def test_local_affine_equals_autograd_on_zoo_models(name):
    model = zoo.build(name, **({"aux_logits": False} if name == "googlenet" else {})).eval()
    shape = (3, 32, 32) if name == "resnet18" else (3, 64, 64)
    cm = pathir.compile(model, input_shape=shape)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, *shape))
    piece = cm.local_affine(x)
    ref = copy.deepcopy(model).double()(torch.tensor(x)).detach().numpy()
    out = cm.graph.outputs[0]
    assert np.allclose(piece.values[out], ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())
    for _ in range(2):
        v = rng.normal(size=x.shape)
        want = _jvp(model, x, v)
        assert np.allclose(piece.jvp(v)[out], want, rtol=1e-8, atol=1e-9 * np.abs(want).max())
    # f(x) = J x + c
    assert np.allclose(piece.jvp(x)[out] + piece.intercept[out], ref, rtol=1e-8, atol=1e-9 * np.abs(ref).max())
    # uᵀ J against the JVP: <u, J v> = <Jᵀ u, v>
    u = rng.normal(size=ref.shape)
    lhs = (u * piece.jvp(v)[out]).sum(axis=1)
    rhs = (piece.vjp(u)[cm.graph.inputs[0]] * v).reshape(2, -1).sum(axis=1)
    assert np.allclose(lhs, rhs, rtol=1e-8)
    active = cm.active_path_norm(x, log10=True)
    assert np.all(active <= cm.path_norm(log10=True) + 1e-12)
    assert np.all(cm.active_path_counts(x) <= cm.num_paths(log10=True) + 1e-12)


def _no_maxpool_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.AvgPool2d(2),
        torch.nn.Conv2d(4, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4, 5), torch.nn.ReLU(),
        torch.nn.Linear(5, 3)).eval()


def test_linear_regime_every_path_is_active():
    """Non-negative weights, biases and inputs: every ReLU is on, a = 1, the active
    path-norms and counts are the global ones (and rescaling-invariant on the way)."""
    model = _no_maxpool_net()
    with torch.no_grad():
        for p in model.parameters():
            p.abs_().add_(0.01)
        model[1].running_mean.zero_()
    cm = pathir.compile(model, input_shape=(3, 6, 6))
    x = np.random.default_rng(0).uniform(0.1, 1.0, size=(3, 3, 6, 6))
    for q in (1, 2):
        assert np.allclose(cm.active_path_norm(x, q=q), cm.path_norm(q), rtol=1e-12)
    assert np.allclose(cm.active_path_counts(x, log10=False), cm.num_paths(), rtol=1e-12)
    x[0] = -x[0]  # the first conv sees negative inputs: some paths switch off
    assert cm.active_path_norm(x)[0] < cm.path_norm()


@pytest.mark.parametrize("name", ["residual", "pools_include_pad", "mlp", "concat"])
def test_onnx_frontend_gives_the_torch_numbers(name):
    model, shape, proto = exported(name, "legacy-nofold")
    co, ct = pathir.compile(proto), pathir.compile(model, input_shape=shape)
    x = np.random.default_rng(1).normal(size=(4, *shape))
    for q in (1, 2):
        assert np.allclose(co.active_path_norm(x, q=q), ct.active_path_norm(x, q=q), rtol=1e-9)
    assert np.allclose(co.active_path_counts(x), ct.active_path_counts(x), rtol=1e-12)
    po, pt = co.local_affine(x), ct.local_affine(x)
    assert np.allclose(po.intercept[co.graph.outputs[0]], pt.intercept[ct.graph.outputs[0]], rtol=1e-9, atol=1e-12)
    v = np.random.default_rng(2).normal(size=x.shape)
    assert np.allclose(po.jvp(v)[co.graph.outputs[0]], pt.jvp(v)[ct.graph.outputs[0]], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["residual", "pools_exclude_pad", "concat"])
def test_local_affine_equals_autograd_on_small_cnns(name):
    model, shape, _ = exported(name, "legacy-nofold")
    cm = pathir.compile(model, input_shape=shape)
    rng = np.random.default_rng(0)
    x, v = rng.normal(size=(3, *shape)), rng.normal(size=(3, *shape))
    piece, out = cm.local_affine(x), cm.graph.outputs[0]
    want = _jvp(model, x, v).reshape(3, -1)
    assert np.allclose(piece.jvp(v)[out].reshape(3, -1), want, rtol=1e-9, atol=1e-10 * np.abs(want).max())
    J = piece.slope().reshape(3, want.shape[1], -1)
    assert np.allclose(np.einsum("boi,bi->bo", J, v.reshape(3, -1)), want, rtol=1e-9, atol=1e-10 * np.abs(want).max())


@pytest.mark.slow
def test_active_path_metric_on_a_pruned_zoo_model():
    """Pruning by path-magnitude: the local bound holds where the pattern is kept and is
    at most the global one; exact brackets (pruning only shrinks |θ|)."""
    model = zoo.build("resnet18").eval()
    cm = pathir.compile(model, input_shape=(3, 32, 32))
    pruned = pathir.compile(copy.deepcopy(model), input_shape=(3, 32, 32))
    pruned.prune(0.01)
    x = np.random.default_rng(0).normal(size=(2, 3, 32, 32))
    m = pathir.active_path_metric(cm, pruned, x)
    glob = pathir.path_metric(cm, pruned)
    assert m.exact and np.all(m.upper <= glob.upper * (1 + 1e-9))
    change = np.abs(cm.forward(x).numpy() - pruned.forward(x).numpy()).sum(axis=1)
    assert np.all(change <= m.upper * m.x_scale * (1 + 1e-9)) or not m.shared.all()
    assert np.all(change[m.shared] <= m.bound[m.shared] * (1 + 1e-9))
