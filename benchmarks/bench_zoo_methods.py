"""Every rescaling-free and rescaling method on the torchvision zoo, against the model's own float64 forward+backward.

For each model (``pathir.app.zoo.build``, random init; googlenet and inception_v3 without their
train-only aux heads), in one process:

1. the reference: one forward+backward of the model in float64 at batch 1 (best of
   ``--repeat`` after a warm-up);
2. each method on a freshly compiled model (compile not timed, with ``self_check=False``; the
   units, B and everything else a first call builds are timed): ``cm.diag_g()``,
   ``cm.path_magnitude_scores()``, ``cm.prune(0.5)``, ``cm.normalize()``, ``cm.enorm()``,
   ``cm.pathcond()``, each with its write-back where it has one.

Prints one Markdown row per model: seconds and the ratio to the reference per method, and
whether ENorm and PathCond met their stopping rule. The issue's goals: pathcond and enorm
<= 10x, normalize and prune <= 5x, diag_g and path_magnitude_scores <= 3x.
Timings are noisy on a shared machine: compare the ratios of one run.

Run:  python benchmarks/bench_zoo_methods.py [--models resnet18 googlenet ...|all] [--repeat 2]
"""

from __future__ import annotations

import argparse
import gc
import time
import warnings

import torch
from bench_zoo_pathcond import build, forward_backward_seconds  # run as a script: benchmarks/ is on sys.path

import pathir
from pathir.app import zoo

DEFAULT_MODELS = ["resnet18", "resnet50", "googlenet", "densenet121", "mnasnet1_0", "squeezenet1_0",
                  "shufflenet_v2_x1_0", "regnet_x_400mf", "inception_v3", "alexnet", "vgg11_bn"]
METHODS = {
    "diag_g": lambda cm: cm.diag_g(),
    "scores": lambda cm: cm.path_magnitude_scores(),
    "prune": lambda cm: cm.prune(0.5),
    "normalize": lambda cm: cm.normalize(),
    "enorm": lambda cm: cm.enorm(),
    "pathcond": lambda cm: cm.pathcond(),
}
GOALS = {"diag_g": 3, "scores": 3, "prune": 5, "normalize": 5, "enorm": 10, "pathcond": 10}


def method_seconds(name, method):
    cm = pathir.compile(build(name), input_shape=zoo.input_shape(name), self_check=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.perf_counter()
        result = METHODS[method](cm)
        seconds = time.perf_counter() - t
    converged = getattr(result, "converged", None)
    del cm, result
    gc.collect()
    return seconds, converged


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS, help="zoo names, or 'all' (zoo.SUPPORTED)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = zoo.SUPPORTED if args.models == ["all"] else args.models
    methods = args.methods.split(",")
    print(f"torch threads: {torch.get_num_threads()}; goals (x fwd+bwd): "
          + ", ".join(f"{m} <= {GOALS[m]}" for m in methods))
    print("| model | fwd+bwd f64 (s) | " + " | ".join(methods) + " |")
    print("|---|---|" + "---|" * len(methods))
    for name in names:
        base = forward_backward_seconds(name, args.repeat)
        cells = []
        for method in methods:
            try:
                seconds, converged = method_seconds(name, method)
            except pathir.PathirError as err:  # e.g. normalize on a residual stream with no canonical representative
                cells.append(f"refused ({str(err).split(':')[0][:60]})")
                continue
            mark = "" if seconds / base <= GOALS[method] else " (over)"
            mark += " NOT converged" if converged is False else ""
            cells.append(f"{seconds:.2f} s, {seconds / base:.1f}x{mark}")
        print(f"| {name} | {base:.3f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
