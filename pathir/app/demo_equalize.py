"""The equalization part of ``pathir demo``: a real accuracy number for equalization before quantization.

A depthwise-separable residual ReLU CNN with batch-norms (``SeparableNet``) is trained once on
scikit-learn's digits. Its batch-norms are folded into the convolutions before them (``fold_batch_norms``,
the model a deployment flow quantizes); that folded float model is then quantized per tensor, symmetric,
weights only (biases and activations float) at each bit width (``quantize_weights``, Q(w) = Δ·round(w/Δ),
Δ = max|w| / (2^{b−1} − 1)), as it is, after Brevitas's cross-layer equalization (only where ``brevitas``
is importable: an optional benchmark extra, never a dependency of pathir) and after ``pathir.equalize``.
Reported: test accuracy of each; plotted into ``equalize_digits.png``. Every number is computed here.
"""

from __future__ import annotations

import copy
import os
import warnings

import numpy as np
import torch
import torch.nn as nn

import pathir

__all__ = ["SeparableNet", "train_separable", "fold_batch_norms", "quantize_weights", "accuracy_on",
           "equalized_models", "part_equalize", "format_equalize", "EQUALIZE_PNG", "SIDES"]

EQUALIZE_PNG = "equalize_digits.png"
SIDES = ("none", "brevitas", "pathir", "pathir-range")


class SeparableBlock(nn.Module):
    """Depthwise 3×3 conv → BN → ReLU → pointwise 1×1 conv → BN, plus the input, then ReLU."""

    def __init__(self, channels: int):
        super().__init__()
        self.dw = nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu1 = nn.ReLU()
        self.pw = nn.Conv2d(channels, channels, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu2 = nn.ReLU()

    def forward(self, x):
        return self.relu2(self.bn2(self.pw(self.relu1(self.bn1(self.dw(x))))) + x)


class SeparableNet(nn.Module):
    """A stem conv → BN → ReLU, two separable residual blocks, a max-pool, two more, global average, linear."""

    def __init__(self, channels: int = 24, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.Sequential(SeparableBlock(channels), SeparableBlock(channels), nn.MaxPool2d(2),
                                    SeparableBlock(channels), SeparableBlock(channels))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        return self.head(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


def train_separable(X, y, epochs: int, seed: int = 0) -> SeparableNet:
    """Adam (lr 5e-3) on the cross-entropy, batch 64; returned in eval mode."""
    torch.manual_seed(seed)
    model = SeparableNet()
    data, target = torch.from_numpy(X).reshape(-1, 1, 8, 8), torch.from_numpy(y).long()
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(data), generator=gen).split(64):
            opt.zero_grad()
            nn.functional.cross_entropy(model(data[idx]), target[idx]).backward()
            opt.step()
    return model.eval()


def fold_batch_norms(model: nn.Module) -> nn.Module:
    """A copy of ``model`` (eval mode) with every batch-norm that follows a convolution folded into it:
    W ← W·γ/σ per output channel, b ← β + (b − μ)·γ/σ, the batch-norm replaced by an identity."""
    model = copy.deepcopy(model).eval()
    for module in model.modules():
        names = list(module._modules)
        for a, b in zip(names, names[1:]):
            conv, bn = module._modules[a], module._modules[b]
            if isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d):
                with torch.no_grad():
                    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
                    bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
                    conv.weight.mul_(scale.reshape(-1, 1, 1, 1))
                    conv.bias = nn.Parameter(bn.bias + (bias - bn.running_mean) * scale)
                module._modules[b] = nn.Identity()
    return model


def quantize_weights(model: nn.Module, bits: int) -> nn.Module:
    """A copy of ``model`` with every conv and linear weight quantized per tensor, symmetric, at ``bits``:
    Q(w) = Δ·round(w/Δ), Δ = max|w| / (2^{bits−1} − 1); biases float."""
    model = copy.deepcopy(model)
    levels = 2 ** (bits - 1) - 1
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                step = m.weight.abs().max() / levels
                if step > 0:
                    m.weight.copy_(torch.round(m.weight / step) * step)
    return model


def accuracy_on(model: nn.Module, X, y) -> float:
    with torch.no_grad():
        pred = model(torch.from_numpy(X).reshape(-1, 1, 8, 8)).argmax(1).numpy()
    return float((pred == y).mean())


def _brevitas(model: nn.Module) -> nn.Module:
    """Brevitas's cross-layer equalization (``preprocess_for_quantize``: fx-trace, EqualizeGraph over its
    regions, 20 iterations, biases not merged into the ranges: ours stay float); ImportError without it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from brevitas.graph.quantize import preprocess_for_quantize  # lazy: optional, the benchmark extra

        out = preprocess_for_quantize(copy.deepcopy(model), trace_model=True, relu6_to_relu=False, equalize_iters=20,
                                      equalize_merge_bias=False, merge_bn=True, channel_splitting_ratio=0.0)
    return out.eval()


def equalized_models(folded: nn.Module, brevitas: bool = True) -> tuple[dict[str, nn.Module], list[str]]:
    """{side: float model} for the folded model as it is, Brevitas's equalization of it (when ``brevitas``
    and importable) and pathir's with the default objective (``noise``) and with ``range`` (Nagel's); and
    the notes on sides skipped."""
    models, notes = {"none": folded}, []
    if brevitas:
        try:
            models["brevitas"] = _brevitas(folded)
        except ImportError as err:
            notes.append(f"Brevitas skipped: not installed ({err.name or err}; it is an optional benchmark extra)")
    else:
        notes.append("Brevitas skipped (not asked for)")
    for side, objective in (("pathir", "noise"), ("pathir-range", "range")):
        ours = copy.deepcopy(folded)
        pathir.equalize(ours, input_shape=(1, 8, 8), bits=6, objective=objective, progress=False)
        models[side] = ours
    return models, notes


def part_equalize(data, out: str | None, epochs: int = 6, bits=(8, 6, 4), brevitas: bool = True,
                  seed: int = 0, model: nn.Module | None = None) -> dict:
    """Train (seeded; or take the trained ``model``), fold, equalize, quantize; the test accuracies
    {side: {float, W8, ...}} (and the plot in ``out``)."""
    X_train, X_test, y_train, y_test = data
    model = train_separable(X_train, y_train, epochs, seed) if model is None else model
    folded = fold_batch_norms(model)
    models, notes = equalized_models(folded, brevitas)
    table = {side: {"float": accuracy_on(m, X_test, y_test),
                    **{f"W{b}": accuracy_on(quantize_weights(m, b), X_test, y_test) for b in bits}}
             for side, m in models.items()}
    result = {"trained_accuracy": accuracy_on(model, X_test, y_test), "epochs": epochs, "bits": list(bits),
              "table": table, "notes": notes, "spread": {side: _spread(m) for side, m in models.items()}}
    if out is not None:
        _plot(result, os.path.join(out, EQUALIZE_PNG))
    result["models"] = models  # the float models, for checks (run_demo pops it)
    return result


def _spread(model: nn.Module) -> float:
    """The median over conv/linear weights of max/min output-channel range: how unequal the channels are."""
    spreads = []
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            r = m.weight.detach().abs().reshape(m.weight.shape[0], -1).amax(1)
            spreads.append(float(r.max() / r.min()) if float(r.min()) > 0 else float("inf"))
    return float(np.median(spreads))


TITLES = {"none": "not equalized", "brevitas": "Brevitas CLE", "pathir": "pathir (noise)",
          "pathir-range": "pathir (range)"}


def format_equalize(result: dict) -> str:
    bits = result["bits"]
    lines = [f"Equalization before quantization: separable residual CNN on digits (batch-norms folded; float test "
             f"accuracy {result['table']['none']['float']:.3f})", ""]
    head = f"{'equalization':<21} {'float':>7} " + " ".join(f"{f'W{b}':>7}" for b in bits) + f" {'spread':>8}"
    lines += [head, "-" * len(head)]
    for side, row in result["table"].items():
        lines.append(f"{TITLES[side]:<21} {row['float']:>7.3f} " + " ".join(f"{row[f'W{b}']:>7.3f}" for b in bits)
                     + f" {result['spread'][side]:>8.3g}")
    lines += ["", "test accuracy with every conv/linear weight quantized per tensor, symmetric, at that many bits",
              "(biases and activations float); spread: median over the weight tensors of max/min output-channel range.",
              *result["notes"], f"Plot: {EQUALIZE_PNG}."]
    return "\n".join(lines)


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides, bits = list(result["table"]), result["bits"]
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    width = 0.8 / len(sides)
    for i, side in enumerate(sides):
        heights = [result["table"][side][f"W{b}"] for b in bits]
        bars = ax.bar(np.arange(len(bits)) + i * width, heights, width, label=TITLES[side])
        ax.bar_label(bars, fmt="%.3f", fontsize=6, padding=2)
    ax.axhline(result["table"]["none"]["float"], color="k", lw=0.8, ls="--",
               label=f"float ({result['table']['none']['float']:.3f})")
    ax.set_xticks(np.arange(len(bits)) + 0.4 - width / 2, [f"W{b}" for b in bits])
    low = min(min(row.values()) for row in result["table"].values())
    ax.set_ylim(max(0.0, low - 0.1), 1.01)
    ax.set_xlabel("weight bits (per-tensor symmetric; biases and activations float)")
    ax.set_ylabel("test accuracy")
    ax.set_title("quantizing a separable residual CNN trained on digits, after equalization")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    if result["notes"]:
        fig.text(0.01, 0.01, "; ".join(result["notes"]), ha="left", va="bottom", fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
