"""The models and the quantization model of benchmarks/bench_equalize.py: torchvision networks with batch-norm
statistics as training leaves them, batch-norm folding, per-tensor / per-channel weight quantization, SQNR.

Every side of the benchmark starts from the same folded float model (``fold_bn``) and is scored with the same
``quantize_weights``, so that the sides differ only in the equalization they apply in between.
"""

from __future__ import annotations

import copy
import math
import warnings

import torch
from torch import nn

MODELS = ("vgg11_bn", "resnet18", "mnasnet0_5", "densenet121", "regnet_x_400mf", "shufflenet_v2_x1_0")
WEIGHT_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
_BN = nn.modules.batchnorm._BatchNorm


def images(n: int, size: int, gen: torch.Generator, channels: int = 3) -> torch.Tensor:
    """``n`` structured random images: Gaussian noise at 1/8 of the size, upsampled bilinearly (smooth regions
    and edges, correlated colours), plus a little white noise."""
    coarse = torch.randn(n, channels, max(size // 8, 1), max(size // 8, 1), generator=gen)
    coarse = coarse + 0.5 * torch.randn(n, 1, 1, 1, generator=gen)  # a per-image brightness
    smooth = nn.functional.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    return smooth + 0.1 * torch.randn(n, channels, size, size, generator=gen)


def build(name: str, size: int = 64, seed: int = 0, gamma_sigma: float = 1.0, beta_std: float = 0.5,
          calib_batches: int = 4, calib_batch: int = 16) -> nn.Module:
    """A randomly initialised torchvision model in eval mode whose batch norms look trained: every
    gamma = exp(N(0, gamma_sigma)) and beta = N(0, beta_std), then the running statistics measured in train mode
    (cumulative average: momentum=None) over ``calib_batches`` batches of ``images``. Random init alone leaves
    every channel's range alike and gives equalization nothing to do."""
    import torchvision

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torchvision.models.get_model(name, weights=None)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _BN):
                m.weight.copy_(torch.exp(gamma_sigma * torch.randn(m.num_features, generator=gen)))
                m.bias.copy_(beta_std * torch.randn(m.num_features, generator=gen))
                m.reset_running_stats()
                m.momentum = None
        model.train()
        for _ in range(calib_batches):
            model(images(calib_batch, size, gen))
    return model.eval()


def calibration_inputs(size: int = 64, batch: int = 32, seed: int = 0) -> torch.Tensor:
    """A calibration batch for data-aware equalization: drawn apart from the batch-norm statistics' batches and
    from the scoring batch."""
    return images(batch, size, torch.Generator().manual_seed(seed + 20_000))


def eval_inputs(size: int = 64, batch: int = 16, seed: int = 0) -> torch.Tensor:
    """The fixed batch that every side is scored on (not one of the calibration batches)."""
    return images(batch, size, torch.Generator().manual_seed(seed + 10_000))


def bn_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """(layer, batch norm) names of every batch norm that directly follows a conv/linear used nowhere else
    (torch.fx trace): the batch norms that fold into their layer. Batch norms after a concat, an add or an
    activation (densenet's norm1 and norm5) are left out: they stay float affine maps on every side."""
    import torch.fx

    graph = torch.fx.symbolic_trace(model).graph
    modules = dict(model.named_modules())
    pairs = []
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(modules[node.target], _BN):
            continue
        prev = node.args[0]
        if (isinstance(prev, torch.fx.Node) and prev.op == "call_module"
                and isinstance(modules[prev.target], WEIGHT_LAYERS) and len(prev.users) == 1):
            pairs.append((prev.target, node.target))
    return pairs


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


@torch.no_grad()
def fold_bn(model: nn.Module) -> tuple[nn.Module, int, int]:
    """(a copy of ``model`` with every foldable batch norm folded into its layer and replaced by nn.Identity,
    how many were folded, how many are left). Folding in float64: W' = W·s, b' = (b − μ)·s + β with
    s = γ / sqrt(σ² + ε) per output channel."""
    folded = copy.deepcopy(model).eval()
    modules = dict(folded.named_modules())
    pairs = bn_pairs(folded)
    for layer_name, bn_name in pairs:
        layer, bn = modules[layer_name], modules[bn_name]
        s = bn.weight.double() / torch.sqrt(bn.running_var.double() + bn.eps)
        w = layer.weight.double() * s.reshape(-1, *([1] * (layer.weight.dim() - 1)))
        b = layer.bias.double() if layer.bias is not None else torch.zeros_like(s)
        layer.weight.copy_(w.to(layer.weight.dtype))
        new_bias = ((b - bn.running_mean.double()) * s + bn.bias.double()).to(layer.weight.dtype)
        if layer.bias is None:
            layer.bias = nn.Parameter(new_bias)
        else:
            layer.bias.copy_(new_bias)
        _set_module(folded, bn_name, nn.Identity())
    left = sum(isinstance(m, _BN) for m in folded.modules())
    return folded, len(pairs), left


def weight_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, WEIGHT_LAYERS)}


def quantization_step(t: torch.Tensor, bits: int, per_channel: bool = False) -> torch.Tensor:
    """Δ = max|t| / (2^(b−1) − 1), symmetric: one for the tensor, or one per output channel (dim 0, broadcastable
    to t); 0 where the maximum is 0."""
    if per_channel and t.dim() > 1:
        top = t.abs().reshape(t.shape[0], -1).amax(dim=1).reshape(-1, *([1] * (t.dim() - 1)))
    else:
        top = t.abs().amax()
    return top / (2 ** (bits - 1) - 1)


def _quantize(t: torch.Tensor, bits: int, per_channel: bool) -> torch.Tensor:
    """Δ·round(t/Δ) with Δ the :func:`quantization_step` (t itself where Δ = 0)."""
    delta = quantization_step(t, bits, per_channel)
    delta = torch.where(delta > 0, delta, torch.ones_like(delta))
    return delta * torch.round(t / delta)


@torch.no_grad()
def quantize_weights(model: nn.Module, bits: int, per_channel: bool = False, quant_bias: bool = False) -> nn.Module:
    """A copy of ``model`` with every conv/linear weight quantized, symmetric, at ``bits`` bits (per tensor, or
    per output channel); biases stay float unless ``quant_bias`` (then per tensor at ``bits`` bits, with their
    own Δ, in both modes: a per-channel Δ would leave a bias exact). Activations stay float."""
    out = copy.deepcopy(model)
    for layer in weight_layers(out).values():
        layer.weight.copy_(_quantize(layer.weight, bits, per_channel))
        if quant_bias and layer.bias is not None:
            layer.bias.copy_(_quantize(layer.bias, bits, False))
    return out


def sqnr_db(y: torch.Tensor, y_q: torch.Tensor) -> float:
    """10·log10(Σ y² / Σ (y − y_q)²) in float64 (inf when exact)."""
    y, y_q = y.double(), y_q.double()
    noise = float(((y - y_q) ** 2).sum())
    return math.inf if noise == 0 else 10 * math.log10(float((y ** 2).sum()) / noise)


def median_image_sqnr_db(y: torch.Tensor, y_q: torch.Tensor) -> float:
    """The median over the images (rows) of each image's own SQNR in dB: unlike the pooled figure,
    not decided by the one image whose rounding blows up (shufflenet_v2 at 6 bits)."""
    y, y_q = y.double().flatten(1), y_q.double().flatten(1)
    noise, signal = ((y - y_q) ** 2).sum(dim=1), (y ** 2).sum(dim=1)
    per_image = torch.where(noise == 0, torch.full_like(noise, math.inf), 10 * torch.log10(signal / noise))
    return float(per_image.median())


def relative_error(y: torch.Tensor, z: torch.Tensor) -> float:
    """max |y − z| / max |y|."""
    y, z = y.detach().double(), z.detach().double()
    return float((y - z).abs().max() / y.abs().max())


def changed_layers(before: nn.Module, after: nn.Module, tol: float = 1e-6) -> int:
    """How many conv/linear layers of ``before`` have a different weight in ``after`` (matched by name; an fx
    GraphModule keeps its modules' qualified names)."""
    theirs = weight_layers(after)
    n = 0
    for name, layer in weight_layers(before).items():
        other = theirs.get(name)
        if other is None or other.weight.shape != layer.weight.shape:
            n += 1
        elif relative_error(layer.weight, other.weight) > tol:
            n += 1
    return n
