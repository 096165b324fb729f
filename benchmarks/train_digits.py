"""Training recipes on scikit-learn's digits: plain SGD, PathCond at init, ENorm every k steps, Path-SGD.

Each recipe trains the same MLP (64-128-128-128-10, ReLU, float32, cross-entropy, batch 32) from the same
seed-controlled initialisation on the same split (1,197 train / 600 test images) and reports the test
accuracy and train loss after the last epoch, mean ± std over the seeds, the l2 path-norm per epoch (read
from the one live Compiled), and the wall time relative to plain SGD measured in the same process.

    python benchmarks/train_digits.py [--seeds 5] [--epochs 20] [--k 10] [--rescale-init 3]
    python benchmarks/train_digits.py --recipes sgd enorm-every-k enorm-state-not-moved

The second form compares rescaling mid-training with and without ``optimizer=`` (the momentum buffers
moved with the rescaling, or left in the old coordinates); ``pathcond-each-epoch[-state-not-moved]``
does the same with a full PathCond after every epoch. The tables this prints are pasted into
docs/training.md.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import pathir

WIDTHS = (64, 128, 128, 128, 10)


def digits(seed: int = 0, validation: bool = False):
    """(x_train, y_train, x_test, y_test) as float32 / int64 tensors, standardised on the train split;
    ``validation=True``: the test part is 300 images held out of the train split (for choosing lr)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xa, xb, ya, yb = train_test_split(x, y, test_size=600, random_state=seed, stratify=y)
    if validation:
        xa, xb, ya, yb = train_test_split(xa, ya, test_size=300, random_state=seed, stratify=ya)
    mu, sd = xa.mean(0), xa.std(0) + 1e-6
    f = lambda a: torch.tensor((a - mu) / sd, dtype=torch.float32)  # noqa: E731
    return f(xa), torch.tensor(ya), f(xb), torch.tensor(yb)


def mlp(seed: int, widths=WIDTHS) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train(recipe: str, seed: int, epochs: int, k: int, data, lr: float, batch: int = 32, rescale_init: float = 0.0):
    """Train one model; returns (test accuracy, final train loss, l2 path-norm per epoch, seconds).

    ``rescale_init`` = a > 0: the initial network is first moved along its rescaling orbit (same function),
    every hidden neuron by a log-scale drawn from U(-a, a). A diverged run (non-finite loss) stops there."""
    xa, ya, xb, yb = data
    model = mlp(seed)
    cm = pathir.compile(model, input_shape=(WIDTHS[0],))
    if rescale_init > 0:
        cm.commit_rescaling(np.random.default_rng(seed).uniform(-rescale_init, rescale_init, len(cm.units)))
    if recipe == "pathcond-init":
        cm.pathcond()
    if recipe == "path-sgd":
        opt = pathir.optim.PathSGD(model.parameters(), compiled=cm, lr=lr, k=k, momentum=0.9)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    loss_fn, norms, step = torch.nn.CrossEntropyLoss(), [], 0
    start = time.perf_counter()
    diverged = False
    for _ in range(epochs):
        for idx in torch.randperm(len(xa), generator=gen).split(batch):
            opt.zero_grad()
            loss = loss_fn(model(xa[idx]), ya[idx])
            if not torch.isfinite(loss):
                diverged = True
                break
            loss.backward()
            opt.step()
            step += 1
            if recipe == "enorm-every-k" and step % k == 0:
                cm.enorm(max_sweeps=1, optimizer=opt)  # one sweep, as the ENorm paper does after its steps
            if recipe == "enorm-state-not-moved" and step % k == 0:
                cm.enorm(max_sweeps=1)  # for comparison: the momentum buffers stay in the old coordinates
        if recipe.startswith("pathcond-each-epoch") and not diverged:  # a large rescaling mid-training
            cm.pathcond(optimizer=None if recipe.endswith("state-not-moved") else opt)
        norms.append(float("nan") if diverged else cm.path_norm(q=2))
        if diverged:
            norms += [float("nan")] * (epochs - len(norms))
            break
    seconds = time.perf_counter() - start
    with torch.no_grad():
        train_loss = float(loss_fn(model(xa), ya))
    return accuracy(model, xb, yb), train_loss, norms, seconds


#: name: learning rate, each chosen on a validation split (300 train images held out, seeds 0-1, 20 epochs,
#: default init) among {0.003, 0.01, 0.03, 0.1} (Path-SGD: {0.0003, 0.001, 0.003}); ties go to the smaller
RECIPES = {
    "sgd": 0.01,
    "pathcond-init": 0.01,
    "enorm-every-k": 0.03,
    "path-sgd": 0.001,
    # for comparison, run with --recipes sgd enorm-every-k enorm-state-not-moved pathcond-each-epoch ...
    "enorm-state-not-moved": 0.03,
    "pathcond-each-epoch": 0.01,
    "pathcond-each-epoch-state-not-moved": 0.01,
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--k", type=int, default=10, help="ENorm every k steps; Path-SGD refreshes diag G every k steps")
    ap.add_argument("--recipes", nargs="*", default=list(RECIPES)[:4], choices=list(RECIPES))
    ap.add_argument("--lr", type=float, default=None, help="one learning rate for every recipe")
    ap.add_argument("--validation", action="store_true", help="test on 300 images held out of the train split")
    ap.add_argument("--rescale-init", type=float, default=0.0,
                    help="move the initial network along its rescaling orbit: log-scales U(-a, a) per hidden neuron")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    data = digits(validation=args.validation)
    rows = []
    for recipe in args.recipes:
        lr = args.lr if args.lr is not None else RECIPES[recipe]
        runs = [train(recipe, s, args.epochs, args.k, data, lr, rescale_init=args.rescale_init)
                for s in range(args.seeds)]
        acc, loss, norms, secs = (np.array([r[i] for r in runs]) for i in range(4))
        rows.append((recipe, lr, acc, loss, norms, secs))
    base = rows[0][5].mean()
    init = f"init rescaled by U(-{args.rescale_init:g}, {args.rescale_init:g})" if args.rescale_init else "default init"
    print(f"digits, MLP {'-'.join(map(str, WIDTHS))}, {init}, momentum 0.9, batch 32, {args.epochs} epochs, k = {args.k}, "
          f"{args.seeds} seeds (mean ± std); time relative to '{rows[0][0]}' in this process "
          f"({base:.2f} s per run), one thread, on a shared machine\n")
    print("| recipe | lr | test accuracy | final train loss | l2 path-norm, epoch 1 → last | time |")
    print("|---|---|---|---|---|---|")
    for recipe, lr, acc, loss, norms, secs in rows:
        print(f"| {recipe} | {lr:g} | {acc.mean():.4f} ± {acc.std():.4f} | {loss.mean():.4f} ± {loss.std():.4f} | "
              f"{np.median(norms[:, 0]):.3g} → {np.median(norms[:, -1]):.3g} | {secs.mean() / base:.2f}× |"
              + (f" ({int(np.isnan(norms[:, -1]).sum())} diverged)" if np.isnan(norms[:, -1]).any() else ""))


if __name__ == "__main__":
    main()
