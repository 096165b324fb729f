"""``pathir demo``: the two experiments a newcomer runs first, on scikit-learn's digits.

1. PathCond at initialisation (the PathCond paper's §5.3 setting, scaled down):
   an MLP autoencoder 64-48-b-48-64 at several compression factors 64/b,
   trained with plain SGD at a small learning rate from the same initialisation
   left as is (baseline), rescaled by ENorm, or rescaled by PathCond; 3 seeds.
   Reported: final training loss (mean ± std over seeds) and, per seed, the
   first epoch at or below the baseline's mean final loss (None: never);
   plotted: the loss curves, mean ± 1 std over seeds.
2. Pruning under rescaling (the path-metric paper's Table 4, in miniature): a
   small CNN trained on digits, then randomly rescaled by an element of the
   rescaling group (same function), then pruned at 40/60/80% by weight
   magnitude and by path-magnitude. Reported: test accuracy.
3. Path activations on the digits test set (``pathir.app.demo_activations``).
4. Equalization before quantization (``pathir.app.demo_equalize``): a depthwise-separable residual
   CNN with batch-norms, folded, quantized per tensor at 8/6/4 bits as it is, after Brevitas's
   equalization (where installed) and after ``pathir.equalize``. Reported: test accuracy.

No download, CPU only; about 50 s of CPU time (``pathir demo``; ``--quick`` for a smoke run).
What the figures and tables show is written on them; docs/demo.md explains them.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import textwrap
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
from tqdm import tqdm

import pathir
from pathir.app.demo_activations import format_activations, part_activations
from pathir.app.demo_equalize import format_equalize, part_equalize
from pathir.support.progress import enabled

__all__ = ["run_demo", "DemoConfig"]

PATHCOND_PNG = "pathcond_autoencoder.png"
PRUNING_PNG = "pruning_under_rescaling.png"


@dataclass
class DemoConfig:
    out: str = "pathir-demo"
    seeds: tuple[int, ...] = (0, 1, 2)
    compressions: tuple[int, ...] = (4, 8, 16)
    epochs: int = 40
    lr: float = 0.02
    batch: int = 64
    cnn_epochs: int = 15
    amounts: tuple[float, ...] = (0.4, 0.6, 0.8)
    rescale_spread: float = 3.0
    methods: tuple[str, ...] = ("baseline", "enorm", "pathcond")
    activation_amounts: tuple[float, ...] = (0.05, 0.4, 0.6, 0.8)  # pathir.app.demo_activations
    equalize_epochs: int = 6  # pathir.app.demo_equalize
    equalize_bits: tuple[int, ...] = (8, 6, 4)
    results: dict = field(default_factory=dict)


def _digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    X = (data.data / 16.0).astype(np.float32)
    return train_test_split(X, data.target, test_size=0.3, random_state=0, stratify=data.target)


# ------------------------------------------------------------------ part 1


def autoencoder(bottleneck: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, bottleneck), nn.ReLU(),
        nn.Linear(bottleneck, 48), nn.ReLU(), nn.Linear(48, 64),
    )


def _prepare(model: nn.Module, method: str) -> dict:
    """Rescale ``model`` in place by ``method``; returns what the rescaling reported."""
    if method == "baseline":
        return {}
    cm = pathir.compile(model, input_shape=(64,), progress=False)  # the demo draws its own bar
    report = cm.pathcond(progress=False) if method == "pathcond" else cm.enorm(progress=False)
    return {"objective_before": getattr(report, "objective_before", None),
            "objective_after": getattr(report, "objective_after", None)}


def train_autoencoder(model: nn.Module, X: np.ndarray, epochs: int, lr: float, batch: int, seed: int) -> list[float]:
    """Plain SGD on the reconstruction MSE; returns the full-data loss after each epoch (and before)."""
    data = torch.from_numpy(X)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    losses = [_mse(model, data)]
    for _ in range(epochs):
        for idx in torch.randperm(len(data), generator=gen).split(batch):
            opt.zero_grad()
            loss = ((model(data[idx]) - data[idx]) ** 2).mean()
            loss.backward()
            opt.step()
        losses.append(_mse(model, data))
    return losses


def _mse(model, data) -> float:
    with torch.no_grad():
        return float(((model(data) - data) ** 2).mean())


def epochs_to_reach(curve: list[float], target: float) -> int | None:
    for epoch, loss in enumerate(curve):
        if loss <= target:
            return epoch
    return None


def part_pathcond(cfg: DemoConfig, X: np.ndarray, bar) -> dict:
    curves: dict = {}
    for cf in cfg.compressions:
        for method in cfg.methods:
            for seed in cfg.seeds:
                model = autoencoder(64 // cf, seed)
                _prepare(model, method)
                curves[(cf, method, seed)] = train_autoencoder(model, X, cfg.epochs, cfg.lr, cfg.batch, seed)
                bar.update(1)
    table = {}
    for cf in cfg.compressions:
        base_final = float(np.mean([curves[(cf, "baseline", s)][-1] for s in cfg.seeds]))
        row = {}
        for method in cfg.methods:
            finals = [curves[(cf, method, s)][-1] for s in cfg.seeds]
            reach = [epochs_to_reach(curves[(cf, method, s)], base_final) for s in cfg.seeds]
            row[method] = {
                "final_loss_mean": float(np.mean(finals)),
                "final_loss_std": float(np.std(finals)),
                "epochs_to_baseline_final": [r for r in reach],
            }
        table[f"compression_{cf}"] = row
    return {"curves": {f"{cf}/{m}/{s}": c for (cf, m, s), c in curves.items()}, "table": table}


# ------------------------------------------------------------------ part 2


class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 2 * 2, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def train_cnn(X, y, epochs: int, seed: int) -> DigitsCNN:
    torch.manual_seed(seed)
    model = DigitsCNN()
    data, target = torch.from_numpy(X).reshape(-1, 1, 8, 8), torch.from_numpy(y).long()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(len(data), generator=gen).split(32):
            opt.zero_grad()
            nn.functional.cross_entropy(model(data[idx]), target[idx]).backward()
            opt.step()
    return model


def accuracy(model, X, y) -> float:
    with torch.no_grad():
        pred = model(torch.from_numpy(X).reshape(-1, 1, 8, 8)).argmax(1).numpy()
    return float((pred == y).mean())


def random_rescaling(model: nn.Module, spread: float, seed: int) -> None:
    """Rescale ``model`` in place by a random element of its rescaling group (same function)."""
    cm = pathir.compile(model, input_shape=(1, 8, 8), progress=False)
    cm.commit_rescaling(np.random.default_rng(seed).uniform(-spread, spread, size=len(cm.units)))


def part_pruning(cfg: DemoConfig, data, bar) -> dict:
    X_train, X_test, y_train, y_test = data
    model = train_cnn(X_train, y_train, cfg.cnn_epochs, seed=0)
    dense_acc = accuracy(model, X_test, y_test)
    rescaled = copy.deepcopy(model)
    random_rescaling(rescaled, cfg.rescale_spread, seed=0)
    rescaled_acc = accuracy(rescaled, X_test, y_test)
    rows = {}
    for amount in cfg.amounts:
        row = {}
        for label, base, criterion in [
            ("magnitude (original)", model, "magnitude"),
            ("magnitude (rescaled)", rescaled, "magnitude"),
            ("path-magnitude (original)", model, "path-magnitude"),
            ("path-magnitude (rescaled)", rescaled, "path-magnitude"),
        ]:
            pruned = copy.deepcopy(base)
            cm_pruned = pathir.compile(pruned, input_shape=(1, 8, 8), progress=False)
            cm_pruned.prune(amount, criterion=criterion, scope="global", progress=False)
            row[label] = accuracy(pruned, X_test, y_test)
            bar.update(1)
        rows[f"{int(amount * 100)}%"] = row
    return {"dense_accuracy": dense_acc, "rescaled_dense_accuracy": rescaled_acc, "table": rows,
            "model": model}  # the trained CNN, for the activations part (run_demo pops it)


# ------------------------------------------------------------------ output


def _seeds(cfg: DemoConfig) -> str:
    return f"{len(cfg.seeds)} seed{'s' if len(cfg.seeds) != 1 else ''}"


def _plot_curves(cfg: DemoConfig, part1: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    n = len(cfg.compressions)
    width = max(4.5 * n, 9.0)  # room for the legend and the caption with a single panel too
    fig, axes = plt.subplots(1, n, figsize=(width, 4.2), squeeze=False)
    colors = {"baseline": "tab:gray", "enorm": "tab:blue", "pathcond": "tab:red"}
    for ax, cf in zip(axes[0], cfg.compressions):
        for method in cfg.methods:
            runs = np.array([part1["curves"][f"{cf}/{method}/{s}"] for s in cfg.seeds])
            mean, std = runs.mean(0), runs.std(0)
            epochs = np.arange(len(mean))
            ax.plot(epochs, mean, label=f"{method} (mean)", color=colors.get(method))
            ax.fill_between(epochs, mean - std, mean + std, color=colors.get(method), alpha=0.2, lw=0)
        target = part1["table"][f"compression_{cf}"]["baseline"]["final_loss_mean"]
        ax.axhline(target, color="k", lw=0.8, ls=":", label="baseline's mean final loss")
        ax.set_yscale("log")
        ax.set_title(f"compression {cf} (64-48-{64 // cf}-48-64)")
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("training MSE (log scale)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), frameon=False, bbox_to_anchor=(0.5, 1.0))
    caption = [f"MLP autoencoder on digits, plain SGD (lr={cfg.lr}, batch {cfg.batch}) from one initialisation per seed: "
               "as is (baseline), or rescaled by ENorm or by PathCond first (same function).",
               f"Lines: mean over {_seeds(cfg)}; shaded bands: mean ± 1 standard deviation over the seeds. "
               "Dotted: the target of the table's 'epochs to baseline final' column."]
    caption = "\n".join(textwrap.fill(line, int(width * 17)) for line in caption)
    fig.text(0.5, 0.01, caption, ha="center", va="bottom", fontsize=8)
    fig.tight_layout(rect=(0, 0.015 + 0.035 * (caption.count("\n") + 1), 1, 0.92))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_pruning(cfg: DemoConfig, part2: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    amounts = list(part2["table"])
    labels = list(next(iter(part2["table"].values())))
    fig, ax = plt.subplots(figsize=(9.5, 4.2))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        heights = [part2["table"][a][label] for a in amounts]
        bars = ax.bar(np.arange(len(amounts)) + i * width, heights, width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=-10, color="white")
    ax.axhline(part2["dense_accuracy"], color="k", lw=0.8, ls="--", label=f"not pruned ({part2['dense_accuracy']:.2f})")
    ax.set_xticks(np.arange(len(amounts)) + 0.4 - width / 2, amounts)
    ax.set_ylim(0, 1.08)
    ax.set_xlabel("fraction of conv and linear weights pruned (one global ranking)")
    ax.set_ylabel("test accuracy")
    ax.set_title("pruning a CNN and a randomly rescaled copy of it (digits)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.text(0.01, 0.01, "original: the trained CNN; rescaled: the same function after a random rescaling "
             f"(log-scale per unit uniform in [-{cfg.rescale_spread:g}, {cfg.rescale_spread:g}]). "
             "Test accuracy on the held-out 30% of digits.", ha="left", va="bottom", fontsize=8, wrap=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_tables(cfg: DemoConfig, part1: dict, part2: dict) -> str:
    seeds = ("seed " if len(cfg.seeds) == 1 else "seeds ") + ", ".join(str(s) for s in cfg.seeds)
    lines = [f"PathCond at initialisation: MLP autoencoder on digits, plain SGD (lr={cfg.lr}), "
             f"{cfg.epochs} epochs, {_seeds(cfg)}", ""]
    head = f"{'compression':>11}  {'method':<9}  {'final training MSE':>18}  {f'epochs to baseline final ({seeds})':>26}"
    lines += [head, "-" * len(head)]
    for key, row in part1["table"].items():
        for method, r in row.items():
            reach = ", ".join("-" if e is None else str(e) for e in r["epochs_to_baseline_final"])
            lines.append(f"{key.split('_')[1]:>11}  {method:<9}  {r['final_loss_mean']:.5f} ± {r['final_loss_std']:.5f}  "
                         f"{reach:>{len(head) - 45}}")
    lines += ["", f"final training MSE: mean ± standard deviation over the {_seeds(cfg)}, after {cfg.epochs} epochs.",
              "epochs to baseline final: for each seed, the first epoch whose training MSE is at or below the baseline's",
              f"mean final MSE; '-' = never reached in {cfg.epochs} epochs. Plot: {PATHCOND_PNG} (shaded: ± 1 std).",
              "", f"Pruning under rescaling: CNN on digits (dense test accuracy {part2['dense_accuracy']:.3f}, "
              f"after a random rescaling {part2['rescaled_dense_accuracy']:.3f})", ""]
    labels = list(next(iter(part2["table"].values())))
    head = f"{'pruned':>6}  " + "  ".join(f"{lab:>26}" for lab in labels)
    lines += [head, "-" * len(head)]
    for amount, row in part2["table"].items():
        lines.append(f"{amount:>6}  " + "  ".join(f"{row[lab]:>26.3f}" for lab in labels))
    lines += ["", "test accuracy after pruning that fraction of the conv and linear weights (one global ranking); original:",
              "the trained CNN; rescaled: the same function after a random rescaling (log-scale per unit uniform in",
              f"[-{cfg.rescale_spread:g}, {cfg.rescale_spread:g}]). Plot: {PRUNING_PNG}."]
    return "\n".join(lines)


def run_demo(cfg: DemoConfig | None = None, progress: bool | None = True) -> dict:
    """Run both experiments; write tables (results.json) and plots (PNG) into ``cfg.out``."""
    cfg = cfg or DemoConfig()
    os.makedirs(cfg.out, exist_ok=True)
    torch.set_num_threads(1)  # tiny models: a second thread only adds synchronisation
    data = _digits()
    total = len(cfg.compressions) * len(cfg.methods) * len(cfg.seeds) + 4 * len(cfg.amounts)
    start = time.perf_counter()
    with tqdm(total=total, desc="pathir demo", disable=not enabled(progress), unit="run", file=sys.stderr) as bar:
        part1 = part_pathcond(cfg, data[0], bar)
        part2 = part_pruning(cfg, data, bar)
    _plot_curves(cfg, part1, os.path.join(cfg.out, PATHCOND_PNG))
    _plot_pruning(cfg, part2, os.path.join(cfg.out, PRUNING_PNG))

    part3 = part_activations(part2.pop("model"), data[1], cfg.activation_amounts, cfg.out)  # part 2's CNN, unpruned
    part4 = part_equalize(data, cfg.out, cfg.equalize_epochs, cfg.equalize_bits)
    part4.pop("models")
    results = {"seconds": time.perf_counter() - start, "pathcond": part1["table"], "pruning": part2,
               "curves": part1["curves"], "activations": part3, "equalize": part4}
    with open(os.path.join(cfg.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    results["text"] = format_tables(cfg, part1, part2) + "\n\n" + format_activations(part3) + "\n\n" + \
        format_equalize(part4)
    return results
