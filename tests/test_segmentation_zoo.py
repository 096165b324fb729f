"""torchvision's segmentation models on ReLU backbones (FCN, DeepLabV3 with a ResNet-50):
bilinear upsampling, ASPP's pooling branch (AdaptiveAvgPool2d(1), then bilinear back up) and
a dict of outputs {"out", "aux"}, every one an output of the DAG; a rescaling written back keeps
both outputs' function."""

import numpy as np
import pytest
import torch
import written

import pathir

segmentation = pytest.importorskip("torchvision.models.segmentation")

SHAPE = (3, 32, 32)


def _build(name):
    torch.manual_seed(0)
    model = getattr(segmentation, name)(weights=None, weights_backbone=None, aux_loss=True)
    with torch.no_grad():  # non-trivial batch-norm statistics and affines
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model.double().eval()


def _rel(a, b) -> float:
    return float((torch.as_tensor(a) - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", ["fcn_resnet50", "deeplabv3_resnet50"])
def test_segmentation_model_compiles_exactly_and_keeps_both_outputs_under_rescaling(name):
    model = _build(name)
    cm = pathir.compile(model, input_shape=SHAPE)
    assert len(cm.graph.outputs) == 2
    x = torch.randn(2, *SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(x)
    got = cm.forward(x)
    assert isinstance(got, dict) and list(got) == list(cm.graph.outputs)
    for key, out in zip(before, cm.graph.outputs):  # the DAG's outputs in the dict's order
        assert tuple(got[out].shape) == tuple(before[key].shape)
        assert _rel(got[out], before[key]) <= 1e-10, key
    assert np.isfinite(cm.path_norm(1)) and cm.path_norm(1) > 0
    z, kept = np.random.default_rng(0).normal(scale=0.5, size=len(cm.units)), written.state(model)
    cm.commit_rescaling(z)
    with torch.no_grad():
        after = model(x)
    for key in ("out", "aux"):
        assert _rel(after[key], before[key]) <= 1e-10, key
    assert written.moved(model, kept) > 0.1  # written into the model's own tensors (an untouched one keeps its outputs)
