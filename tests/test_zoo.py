"""Every torchvision classification model in the ReLU DAG model compiles and
reproduces its own forward; the others are refused, untouched."""

import pytest
import torch

import pathir
from pathir import zoo

# the figures of MATH.md §11 (PathCond paper, Appendix I)
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
