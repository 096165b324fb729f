"""Write-back of rescalings and masks into real torch models (frontends/torch/writer.py)."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from torch_models import ResidualBlock  # noqa: E402
from torch_models import randomize_bn as _randomize_bn

import pathir  # noqa: E402
from pathir.errors import PathirError  # noqa: E402
from pathir.frontends.torch.writer import TorchWriter  # noqa: E402
from pathir.ir import MapKind, Role  # noqa: E402
from pathir.rescaling.apply import log_scales  # noqa: E402


def _z(cm, seed=0, size=1.0):
    return np.random.default_rng(seed).uniform(-size, size, len(cm.units))


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _rescale_and_compare(model, input_shape, train=False, seed=0, tol=1e-10):
    """Rescale ``model`` through write-back; the forward must not change."""
    torch.manual_seed(seed)
    model = model.double().train(train)
    cm = pathir.compile(model, input_shape=input_shape)
    x = torch.randn(4, *input_shape, dtype=torch.float64)
    reference = copy.deepcopy(model)  # train-mode forwards update running stats: compare on twins
    z = _z(cm, seed)
    expected = cm.rescaled(z).graph
    cm.writer.rescale(cm.graph, log_scales(cm.graph, cm.units, z))
    written = copy.deepcopy(model)  # as written, before a train-mode forward moves its running statistics
    with torch.no_grad():
        before, after = reference(x), model(x)
    assert _rel(after, before) <= tol
    # the model itself holds the rescaled values (an untouched model would keep its output too)
    again = pathir.compile(written, input_shape=input_shape, self_check=False).graph
    for p, q in zip(again.params(), expected.params()):
        assert p.name == q.name and np.allclose(p.value, q.value, rtol=1e-10, atol=1e-14)
    return cm, z


def _mlp():
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 2))


def _cnn():
    return _randomize_bn(nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 5, 3), nn.BatchNorm2d(5), nn.ReLU(), nn.Flatten(), nn.Linear(5 * 2 * 2, 3),
    ))


def _resnet_like():
    return _randomize_bn(nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), ResidualBlock(3), ResidualBlock(3),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 2),
    ))


def _unfolded_bn():
    """A batch-norm after a ReLU cannot fold: a Scale edge whose input factor lands on the running stats."""
    return _randomize_bn(nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.ReLU(), nn.BatchNorm2d(3), nn.Conv2d(3, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8, 2),
    ))


# --------------------------------------------------------------- rescaling keeps the function


def test_mlp():
    _rescale_and_compare(_mlp(), (4,))


@pytest.mark.parametrize("train", [False, True])
def test_cnn_with_batchnorm_in_eval_and_train_mode(train):
    _rescale_and_compare(_cnn(), (3, 8, 8), train=train)


@pytest.mark.parametrize("train", [False, True])
def test_resnet_like_block(train):
    cm, _ = _rescale_and_compare(_resnet_like(), (2, 4, 4), train=train)
    assert sum(n.startswith("stream:") for n in cm.units.names) == 3


def test_unfolded_batchnorm_moves_its_running_statistics():
    model = _unfolded_bn().double().eval()
    cm = pathir.compile(model, input_shape=(2, 6, 6))
    (v, edge), = [(n, e) for n in cm.graph.nodes for e in n.edges if e.map.kind is MapKind.SCALE]
    assert Role.IN_STATS in {r.role for r in edge.map.W.sources}
    bn = model[2]
    mean, var, gamma = bn.running_mean.clone(), bn.running_var.clone(), bn.weight.clone()
    s = log_scales(cm.graph, cm.units, _z(cm, seed=3))
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        before = model(x)
    cm.writer.rescale(cm.graph, s)
    with torch.no_grad():
        assert _rel(model(x), before) <= 1e-10
    lam, out = torch.as_tensor(np.exp(s[edge.source])), torch.as_tensor(np.exp(s[v.name]))
    assert (lam - 1).abs().min() > 1e-3 and (out - 1).abs().min() > 1e-3  # both sides really move
    assert torch.allclose(bn.running_mean, lam * mean, rtol=1e-12)
    assert torch.allclose(bn.running_var + bn.eps, lam**2 * (var + bn.eps), rtol=1e-12)
    assert torch.allclose(bn.weight, out * gamma, rtol=1e-12)


def test_written_model_compiles_to_the_rescaled_graph():
    model = _cnn().double().eval()
    cm = pathir.compile(model, input_shape=(3, 8, 8))
    z = _z(cm, seed=5)
    expected = cm.rescaled(z).graph
    cm.writer.rescale(cm.graph, log_scales(cm.graph, cm.units, z))
    again = pathir.compile(model, input_shape=(3, 8, 8)).graph
    for p, q in zip(again.params(), expected.params()):
        assert p.name == q.name and np.allclose(p.value, q.value, rtol=1e-10, atol=1e-14)


def test_float32_model_keeps_dtype():
    model = _cnn().float().eval()
    cm = pathir.compile(model, input_shape=(3, 8, 8))
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        before = model(x)
    cm.writer.rescale(cm.graph, log_scales(cm.graph, cm.units, _z(cm, size=0.5)))
    assert all(t.dtype == torch.float32 for t in model.state_dict().values() if t.is_floating_point())
    with torch.no_grad():
        assert _rel(model(x), before) <= 1e-5


@pytest.mark.parametrize("name", ["resnet18", "densenet121"])
def test_torchvision_models(name):
    torchvision = pytest.importorskip("torchvision")
    model = _randomize_bn(getattr(torchvision.models, name)())
    _rescale_and_compare(model, (3, 32, 32))


# --------------------------------------------------------------- all or nothing


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same_state(model, state):
    now = model.state_dict()
    return now.keys() == state.keys() and all(torch.equal(now[k], state[k]) for k in state)


def test_error_midway_leaves_the_model_untouched(monkeypatch):
    model = _resnet_like().double().eval()
    cm = pathir.compile(model, input_shape=(2, 4, 4))
    state = _state(model)
    calls = []
    original = TorchWriter._new_value

    def failing(name, *args):
        calls.append(name)
        if len(calls) == 5:
            raise RuntimeError("injected failure")
        return original(name, *args)

    monkeypatch.setattr(TorchWriter, "_new_value", staticmethod(failing))
    with pytest.raises(RuntimeError, match="injected failure"):
        cm.writer.rescale(cm.graph, log_scales(cm.graph, cm.units, _z(cm)))
    assert len(calls) == 5 and _same_state(model, state)


def test_conflicting_factors_are_refused_before_writing():
    from dataclasses import replace

    model = _mlp().double()
    cm = pathir.compile(model, input_shape=(4,))
    # bind the second layer's bias to the first layer's bias tensor: two params, two factors, one tensor
    graph = cm.graph.map_params(lambda p: replace(p, sources=cm.graph.params()[1].sources) if p.name == "2.bias" else p)
    state = _state(model)
    with pytest.raises(PathirError, match="'0.bias' .* rescaled differently"):
        TorchWriter(model).rescale(graph, log_scales(graph, cm.units, _z(cm)))
    assert _same_state(model, state)


def test_log_scales_that_are_no_rescaling_are_refused():
    model = _resnet_like().double()
    cm = pathir.compile(model, input_shape=(2, 4, 4))
    s = log_scales(cm.graph, cm.units, _z(cm))
    out = cm.graph.outputs[0]
    state = _state(model)
    with pytest.raises(PathirError, match="pinned"):
        cm.writer.rescale(cm.graph, dict(s, **{out: np.ones(2)}))
    assert _same_state(model, state)


def test_compiled_from_a_graph_has_nothing_to_write_into():
    cm = pathir.compile(pathir.compile(_mlp(), input_shape=(4,)).graph)
    assert cm.writer is None
    before = [p.value.copy() for p in cm.graph.params()]
    cm.commit_rescaling(np.full(len(cm.units), 1.0))  # only the graph moves
    assert any(not np.array_equal(a, p.value) for a, p in zip(before, cm.graph.params()))


# --------------------------------------------------------------- masks


def _masked_graph(graph, masks):
    return graph.map_params(lambda p: p.with_value(p.value * masks[p.name]) if p.name in masks else p)


def test_masks_prune_through_torch_and_match_the_masked_graph():
    from pathir.backends.numpy import NumpyBackend
    from pathir.lifting.walk import forward

    model = _cnn().double().eval()
    cm = pathir.compile(model, input_shape=(3, 8, 8))
    rng = np.random.default_rng(0)
    masks = {p.name: rng.random(p.shape) > 0.4 for p in cm.graph.params() if p.name.endswith("weight")}
    TorchWriter(model).mask(cm.graph, masks)
    assert torch.equal(model[0].weight == 0, torch.as_tensor(~masks["0.weight"]))
    assert hasattr(model[0], "weight_orig") and hasattr(model[8], "weight_mask")
    x = np.random.default_rng(1).normal(size=(3, 3, 8, 8))
    expected = forward(_masked_graph(cm.graph, masks), NumpyBackend(), x)[cm.graph.outputs[0]]
    with torch.no_grad():
        got = model(torch.as_tensor(x)).numpy()
    assert np.allclose(got, expected, rtol=1e-10, atol=1e-12)


def test_rescaling_a_pruned_model_keeps_mask_and_function():
    model = _cnn().double().eval()
    cm = pathir.compile(model, input_shape=(3, 8, 8))
    mask = np.random.default_rng(2).random((4, 3, 3, 3)) > 0.5
    TorchWriter(model).mask(cm.graph, {"0.weight": mask})
    cm = pathir.compile(model, input_shape=(3, 8, 8))
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        before = model(x)
    cm.writer.rescale(cm.graph, log_scales(cm.graph, cm.units, _z(cm)))
    assert torch.equal(model[0].weight == 0, torch.as_tensor(~mask))
    with torch.no_grad():
        assert _rel(model(x), before) <= 1e-10


def test_masks_that_cannot_be_exact_are_refused_and_nothing_is_pruned():
    model = _unfolded_bn().double()
    cm = pathir.compile(model, input_shape=(2, 6, 6))
    names = [p.name for p in cm.graph.params()]
    good = {"0.weight": np.ones((3, 2, 3, 3), bool)}
    for bad in ("2.weight", "2.bias"):  # the unfolded batch-norm's scale and shift
        assert bad in names
        with pytest.raises(PathirError, match=f"param '{bad}' = .* masking that tensor would not zero the param"):
            TorchWriter(model).mask(cm.graph, {**good, bad: np.ones(3, bool)})
        assert not hasattr(model[0], "weight_orig")
    with pytest.raises(PathirError, match="has shape"):
        TorchWriter(model).mask(cm.graph, {"0.weight": np.ones(3, bool)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_variance_eps_would_swallow_is_refused_and_the_model_untouched(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.BatchNorm1d(4),
                                torch.nn.Linear(4, 2)).to(dtype).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    cm = pathir.compile(model, input_shape=(3,))
    z = np.full(len(cm.units), -60.0)  # the batch-norm's input shrinks by e^-30: var + eps ~ 1e-26 << eps
    with pytest.raises(PathirError, match="eps dominates"):
        cm.commit_rescaling(z)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    x = torch.randn(5, 3, dtype=dtype)
    with torch.no_grad():
        before = model(x)
        cm.commit_rescaling(np.full(len(cm.units), -2.0))  # a moderate rescaling is still written
        assert torch.allclose(model(x), before, rtol=1e-4 if dtype == torch.float32 else 1e-10, atol=1e-5)


def test_pruning_a_tied_weight_is_refused_untouched():
    """One Parameter under two module names: pathir scores and masks each use on its own, so a prune
    would zero the two uses differently (the model no longer the original with the reported entries
    zeroed in one tensor): refused, nothing written."""

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.c = torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False)
            self.c.weight = self.a.weight
            self.b = torch.nn.Linear(3, 1, bias=False)

        def forward(self, x):
            return self.b(torch.relu(self.c(torch.relu(self.a(x)))))

    torch.manual_seed(0)
    model = Tied().double()
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(PathirError, match="tied weights"):
        pathir.compile(model, input_shape=(3,)).prune(0.5)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert model.a.weight is model.c.weight and not list(model.named_buffers())


def test_a_tied_weight_one_of_whose_layers_is_pruned_is_refused_naming_every_holder():
    """c.weight is b.weight_orig once b is pruned: the message named 'b.weight' and 'b.weight_orig' only."""
    import torch.nn.utils.prune as prune

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c, self.d = (torch.nn.Linear(5, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 6),
                                              torch.nn.Linear(6, 3))
            self.c.weight = self.b.weight

        def forward(self, x):
            return self.d(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))

    torch.manual_seed(0)
    model = Tied().double()
    prune.l1_unstructured(model.b, "weight", 0.3)
    cm = pathir.compile(model, input_shape=(5,))
    state = _state(model)
    with pytest.raises(PathirError, match="'b.weight_orig', 'c.weight': tied weights"):
        cm.pathcond()
    assert _same_state(model, state)
