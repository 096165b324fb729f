"""Every torchvision classification model in the ReLU DAG model compiles and
reproduces its own forward; the others are refused, untouched."""

import pytest
import torch
import written

import pathir
from pathir.app import zoo

# the figures of docs/math.md §11 (PathCond paper, Appendix I)
FACTS = {
    "resnet18": (11_689_512, 4_800),
    "resnet34": (21_797_672, 8_512),
    "resnet50": (25_557_032, 26_560),
    "alexnet": (61_100_840, 9_344),
    "vgg16": (138_357_544, 12_416),
}

HEAVY = {"vgg19_bn", "vgg19", "resnext101_64x4d", "resnext101_32x8d", "wide_resnet101_2", "resnet152",
         "densenet161", "densenet201", "vgg13_bn", "vgg13", "regnet_x_3_2gf", "shufflenet_v2_x2_0",
         "mnasnet1_3", "densenet169", "resnet101"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n for n in zoo.SUPPORTED]
)
def test_zoo_model_reproduces_its_forward(name):
    result = zoo.check_model(name)
    assert result["status"] == "supported", result
    assert result["max_rel_error"] <= 1e-9, result
    if name in FACTS:
        assert (result["params"], result["hidden_channels"]) == FACTS[name]


@pytest.mark.parametrize("name", ["mnasnet0_5", "densenet121", "shufflenet_v2_x1_0", "googlenet"])
def test_every_weight_is_read_by_one_edge(name):
    """No torchvision model calls a weighted module twice: a param read by two
    edges would mean a value lowered twice (duplicated neurons)."""
    cm = pathir.compile(zoo.build(name), input_shape=(3, 64, 64))
    reads = [id(e.map.weight) for n in cm.graph for e in n.edges if e.map.weight is not None]
    reads += [id(n.bias) for n in cm.graph if n.bias is not None]
    assert len(reads) == len(set(reads))


@pytest.mark.parametrize("name", sorted(zoo.REJECTED))
def test_zoo_model_rejected_untouched(name):
    model = zoo.build(name).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(pathir.UnsupportedOperation) as info:
        pathir.compile(model, input_shape=zoo.input_shape(name))
    assert info.value.op == zoo.REJECTED[name]
    assert info.value.node and info.value.why
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_resnet50_compiles_fast_enough_to_be_interactive():
    # not a timing assertion: the structure that makes compile cheap (no per-neuron work)
    cm = pathir.compile(zoo.build("resnet50"), input_shape=(3, 224, 224))
    assert len(cm.graph) < 100


def _small_shape(name):
    """Inputs just big enough for each model, so every zoo model runs here in float64."""
    return (3, 96, 96) if name == "inception_v3" else (3, 64, 64)


# over 60M parameters each: ~10 GB of float64 copies at the peak of write-back, so one at a time
LARGEST = {"alexnet", "vgg11", "vgg11_bn", "vgg13", "vgg13_bn", "vgg16", "vgg16_bn", "vgg19", "vgg19_bn",
           "wide_resnet50_2", "wide_resnet101_2", "resnext101_32x8d", "resnext101_64x4d"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n for n in zoo.SUPPORTED if n not in LARGEST]
)
def test_zoo_model_keeps_its_output_under_random_rescaling(name):
    _check_random_rescaling(name)


@pytest.mark.slow
def test_largest_zoo_models_keep_their_output_under_random_rescaling():
    for name in sorted(LARGEST & set(zoo.SUPPORTED)):
        _check_random_rescaling(name)


def _check_random_rescaling(name):
    """θ ← θ ⊙ exp(-Bz/2) for random log-scales z, written back into the torch model itself (batch-norm
    affines and running statistics included), leaves its float64 output unchanged; the row keys the
    solvers read are B's (every row up to 30M parameters, a sample of rows beyond, for memory)."""
    import numpy as np

    from pathir.analyses.unit_rows import column_balance, keys_for, matrix_row_keys

    # aux heads run only in train mode: write-back refuses them (tests/test_capture_train_branches.py)
    aux = {"aux_logits": False} if name in ("googlenet", "inception_v3") else {}
    model = zoo.build(name, **aux).double().eval()
    shape = _small_shape(name)
    cm = pathir.compile(model, input_shape=shape)
    B, _ = cm.incidence()
    rows = cm.row_keys()
    if B.shape[0] <= 30_000_000:
        assert np.array_equal(rows.key, matrix_row_keys(B)[0]) and np.array_equal(rows.balance, column_balance(B))
    else:
        keys_for(B, rows)  # raises unless the keys match B on a sample of rows
    del B
    x = torch.randn(2, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(x)
    graph, kept = cm.graph, written.state(model)
    z = np.random.default_rng(0).normal(scale=0.5, size=len(cm.units))
    cm.commit_rescaling(z)
    with torch.no_grad():
        after = model(x)
    moved = max(float(np.abs(q.value - p.value).max() / np.abs(p.value).max())
                for p, q in zip(graph.params(), cm.graph.params()))
    assert moved > 0.1, name  # the graph's parameters really moved
    assert written.moved(model, kept) > 0.1, name  # and so did the model's own tensors
    assert float((after - before).abs().max() / before.abs().max()) <= 1e-10, name
