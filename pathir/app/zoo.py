"""The torchvision classification zoo as pathir sees it.

``SUPPORTED`` compile and reproduce the model's own forward; ``REJECTED`` raise
``pathir.UnsupportedOperation`` (name -> the op that stops them). ``check_model``
runs one model end to end; ``benchmarks/zoo_table.py`` writes docs/zoo.md from it.
"""

from __future__ import annotations

import time

import pathir

__all__ = ["SUPPORTED", "REJECTED", "input_shape", "build", "check_model"]

SUPPORTED = [
    "alexnet",
    "vgg11", "vgg11_bn", "vgg13", "vgg13_bn", "vgg16", "vgg16_bn", "vgg19", "vgg19_bn",
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "resnext50_32x4d", "resnext101_32x8d", "resnext101_64x4d", "wide_resnet50_2", "wide_resnet101_2",
    "squeezenet1_0", "squeezenet1_1",
    "densenet121", "densenet161", "densenet169", "densenet201",
    "googlenet", "inception_v3",
    "shufflenet_v2_x0_5", "shufflenet_v2_x1_0", "shufflenet_v2_x1_5", "shufflenet_v2_x2_0",
    "mnasnet0_5", "mnasnet0_75", "mnasnet1_0", "mnasnet1_3",
    "mobilenet_v2",
    "regnet_x_400mf", "regnet_x_800mf", "regnet_x_1_6gf", "regnet_x_3_2gf",
]

REJECTED = {
    "mobilenet_v3_small": "Hardswish",
    "mobilenet_v3_large": "Hardswish",
    "efficientnet_b0": "SiLU",
    "efficientnet_v2_s": "SiLU",
    "regnet_y_400mf": "Sigmoid",
    "vit_b_16": "expand",
    "convnext_tiny": "layer_norm",
    "swin_t": "LayerNorm",
    "maxvit_t": "GELU",
}


def input_shape(name: str) -> tuple[int, int, int]:
    """The usual input size: 299x299 for inception_v3, 224x224 otherwise."""
    return (3, 299, 299) if name == "inception_v3" else (3, 224, 224)


def build(name: str, seed: int = 0, **overrides):
    """A randomly initialised torchvision model with non-trivial batch-norm statistics;
    ``overrides`` go to the torchvision builder (e.g. ``aux_logits=False`` for googlenet
    and inception_v3, whose aux heads run only in train mode: compiled in eval mode, pathir
    refuses a rescaling write-back; in train mode they are extra outputs of the graph)."""
    import warnings

    import torch
    import torchvision

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = {"init_weights": True} if name in ("googlenet", "inception_v3") else {}
        kwargs.update(overrides)
        model = torchvision.models.get_model(name, weights=None, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
    return model.eval()


def check_model(name: str, batch: int = 1, backend: str = "torch", forward: bool = True) -> dict:
    """Compile ``name``, compare the IR forward with the model's float64 forward
    (skipped with ``forward=False``: max_rel_error is then None)."""
    import copy

    import numpy as np
    import torch


    model = build(name)
    shape = input_shape(name)
    start = time.perf_counter()
    try:
        # with forward=True this function is the self-check (float64, 1e-9): compile's own is skipped
        cm = pathir.compile(model, input_shape=shape, self_check=not forward)
    except pathir.UnsupportedOperation as err:
        return {"model": name, "status": "rejected", "op": err.op, "node": err.node, "where": err.where, "why": err.why}
    seconds = time.perf_counter() - start
    facts = {"model": name, "status": "supported", "input": "x".join(map(str, shape)), "nodes": len(cm.graph),
             "params": cm.source_num_params, "hidden_channels": cm.hidden_channels(), "units": len(cm.units),
             "compile_seconds": seconds, "max_rel_error": None}
    if not forward:
        return facts
    x = torch.randn(batch, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = copy.deepcopy(model).double()(x).numpy()
    out = cm.forward(x, backend=backend)
    out = out.cpu().numpy() if hasattr(out, "cpu") else np.asarray(out)
    return {**facts, "max_rel_error": float(np.abs(out - reference).max() / np.abs(reference).max())}
