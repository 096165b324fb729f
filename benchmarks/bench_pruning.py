"""Structured pruning side by side with Torch-Pruning's own importances, on a residual CNN trained on digits.

Each seed trains the same small residual CNN with batch-norms (scikit-learn's digits, 8x8 images, 1,197
train / 600 test) and prunes its channels with Torch-Pruning's ``MetaPruner`` (the same ratio in every
layer, the head kept), scored by each importance:

- ``random``, ``l1``, ``l2`` (``MagnitudeImportance(p)``: the group's weights' norm), ``bn-scale``
  (|γ|, network slimming), ``lamp``, ``taylor`` (|w · ∂loss/∂w| on one training batch) and ``fpgm``:
  Torch-Pruning's;
- ``path-magnitude``: pathir's ``PathMagnitudeImportance`` (the path-magnitude its removal deletes).

Every pruned model's test accuracy is reported without fine-tuning (what the score alone chose) and,
with ``--finetune N``, after N epochs of Adam. Then the same trained model is rescaled by a random element
of its rescaling group (``--spread`` nats per unit: the same function, the same accuracy) and pruned again:
a score that is not rescaling-invariant chooses other channels there. pathir's does not. The last column
is the importance's time per ``pruner.step()`` (the pruning included), median over the seeds.

    pip install -e ".[pruning]"
    python benchmarks/bench_pruning.py [--seeds 3] [--ratios 0.25,0.5,0.75] [--finetune 0] [--spread 2]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import numpy as np
import torch
import torch.nn as nn

import pathir

IMPORTANCES = ("random", "l1", "l2", "bn-scale", "lamp", "taylor", "fpgm", "path-magnitude")


class ResidualCNN(nn.Module):
    """conv-bn-relu stem (16), a basic residual block (16), a strided conv-bn-relu (32), a residual block (32),
    global average pool, linear head (10 classes)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.block1 = _block(16)
        self.down = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.block2 = _block(32)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        h = self.stem(x)
        h = torch.relu(self.block1(h) + h)
        h = self.down(h)
        h = torch.relu(self.block2(h) + h)
        return self.head(h.mean((2, 3)))


def _block(c: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                         nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))


def digits(seed: int):
    """(x_train, y_train, x_test, y_test): images (N, 1, 8, 8) standardised on the train split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xa, xb, ya, yb = train_test_split(x, y, test_size=600, random_state=seed, stratify=y)
    mu, sd = xa.mean(), xa.std()
    f = lambda a: torch.tensor((a - mu) / sd, dtype=torch.float32).reshape(-1, 1, 8, 8)  # noqa: E731
    return f(xa), torch.tensor(ya), f(xb), torch.tensor(yb)


def train(model: nn.Module, x, y, epochs: int, seed: int, lr: float = 3e-3) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=gen).split(32):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.eval()


def accuracy(model: nn.Module, x, y) -> float:
    with torch.no_grad():
        return float((model.eval()(x).argmax(1) == y).float().mean())


def rescaled(model: nn.Module, spread: float, seed: int) -> nn.Module:
    """A copy of ``model`` rescaled by a random element of its rescaling group (the same function)."""
    out = copy.deepcopy(model)
    cm = pathir.compile(out, input_shape=(1, 8, 8), progress=False)
    cm.commit_rescaling(np.random.default_rng(seed).uniform(-spread, spread, size=len(cm.units)))
    return out


def importance(name: str, model: nn.Module):
    import torch_pruning as tp

    from pathir.integrations.pruning_adapter import PathMagnitudeImportance

    return {"random": lambda: tp.importance.RandomImportance(),
            "l1": lambda: tp.importance.MagnitudeImportance(p=1),
            "l2": lambda: tp.importance.MagnitudeImportance(p=2),
            "bn-scale": lambda: tp.importance.BNScaleImportance(),
            "lamp": lambda: tp.importance.LAMPImportance(p=2),
            "taylor": lambda: tp.importance.TaylorImportance(),
            "fpgm": lambda: tp.importance.FPGMImportance(),
            "path-magnitude": lambda: PathMagnitudeImportance(model, input_shape=(1, 8, 8))}[name]()


def prune(model: nn.Module, name: str, ratio: float, data, seed: int) -> tuple[nn.Module, float]:
    """(a pruned copy of ``model``, seconds of the pruner's step): ``ratio`` of every layer's channels (the head's
    outputs kept), chosen by importance ``name``."""
    import torch_pruning as tp

    net = copy.deepcopy(model).eval()
    x, y = data[0], data[1]
    torch.manual_seed(seed)  # (the random importance's draw)
    pruner = tp.pruner.MetaPruner(net, x[:1], importance=importance(name, net), pruning_ratio=ratio,
                                  ignored_layers=[net.head])
    start = time.perf_counter()
    if name == "taylor":  # its gradients: one training batch's loss
        net.zero_grad()
        nn.functional.cross_entropy(net(x[:128]), y[:128]).backward()
    pruner.step()
    return net, time.perf_counter() - start


def run(args) -> list[dict]:
    rows = []
    for seed in args.seeds:
        data = digits(seed)
        torch.manual_seed(seed)
        model = train(ResidualCNN(), data[0], data[1], args.epochs, seed)
        twin = rescaled(model, args.spread, seed)
        dense, dense_twin = accuracy(model, data[2], data[3]), accuracy(twin, data[2], data[3])
        for ratio in args.ratios:
            for name in args.importances:
                row = {"seed": seed, "ratio": ratio, "importance": name, "dense": dense, "dense_rescaled": dense_twin}
                for key, base in (("", model), ("_rescaled", twin)):
                    net, seconds = prune(base, name, ratio, data, seed)
                    row[f"acc{key}"] = accuracy(net, data[2], data[3])
                    row[f"params{key}"] = sum(p.numel() for p in net.parameters())
                    if args.finetune:
                        row[f"acc_finetuned{key}"] = accuracy(train(net, data[0], data[1], args.finetune, seed, 1e-3),
                                                              data[2], data[3])
                    if not key:
                        row["seconds"] = seconds
                rows.append(row)
                print(f"seed {seed} ratio {ratio:g} {name:>14}: {row['acc']:.3f} (rescaled first: "
                      f"{row['acc_rescaled']:.3f})", flush=True)
    return rows


def table(rows: list[dict], args) -> str:
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    dense = med(rows, "dense")
    cols = ["acc", "acc_rescaled"] + (["acc_finetuned", "acc_finetuned_rescaled"] if args.finetune else [])
    titles = ["accuracy", "rescaled first"] + ([f"fine-tuned {args.finetune} ep.", "rescaled, fine-tuned"]
                                                if args.finetune else [])
    lines = [f"dense accuracy {dense:.3f} (rescaled: {med(rows, 'dense_rescaled'):.3f}); medians over "
             f"{len(args.seeds)} seed(s)", "",
             "| ratio | importance | params | " + " | ".join(titles) + " | step (ms) |",
             "|---|---|---|" + "---|" * len(titles) + "---|"]
    for ratio in args.ratios:
        for name in args.importances:
            rs = [r for r in rows if r["ratio"] == ratio and r["importance"] == name]
            cells = [f"{med(rs, c):.3f}" for c in cols]
            lines.append(f"| {ratio:g} | {name} | {int(med(rs, 'params'))} | " + " | ".join(cells) +
                         f" | {1e3 * med(rs, 'seconds'):.0f} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--ratios", default="0.25,0.5,0.75")
    ap.add_argument("--importances", default=",".join(IMPORTANCES))
    ap.add_argument("--epochs", type=int, default=15, help="training epochs of the dense model")
    ap.add_argument("--finetune", type=int, default=0, help="fine-tuning epochs after pruning (0: none)")
    ap.add_argument("--spread", type=float, default=2.0, help="the random rescaling's log-scales, uniform in ±spread")
    ap.add_argument("--threads", type=int, default=2)
    return ap


def main(argv=None) -> list[dict]:
    args = parser().parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.ratios = [float(r) for r in args.ratios.split(",")]
    args.importances = [n for n in args.importances.split(",") if n]
    unknown = sorted(set(args.importances) - set(IMPORTANCES))
    if unknown:
        raise SystemExit(f"unknown importances {unknown}; choose from {', '.join(IMPORTANCES)}")
    try:
        import torch_pruning  # noqa: F401
    except ImportError:
        print("torch_pruning is not installed (pip install -e '.[pruning]'): nothing to compare, skipped")
        return []
    torch.set_num_threads(args.threads)
    rows = run(args)
    print()
    print(table(rows, args))
    return rows


if __name__ == "__main__":
    main()
