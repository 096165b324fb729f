"""Cost of the activation-filtered observables against the model's own float64 forward on the same batch.

    python benchmarks/bench_activations.py [resnet18,resnet50] [--batch 64] [--size 224] [--repeat 3]

Issue 14's targets: ``cm.active_path_norm(x)`` on a batch of 64 at 3x224x224 costs at most 3x the
model's own float64 forward on that batch; ``pathir.active_path_metric(a, b, x)`` (b: a pruned
copy, 40 % by path-magnitude) at most 6x. Every time is a median in this process, the ratios are
against the baseline measured here (the machine may be shared: ratios, not seconds, compare).
The whole batch is walked at once (``chunk`` = batch) unless ``--chunk`` says otherwise.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
from bench_path_norm import median_time

import pathir
from pathir.app import zoo
from pathir.lifting.active import active_path_norm
from pathir.lifting.active_metric import active_path_metric


def bench(name: str, batch: int, size: int, repeat: int, chunk: int | None = None) -> dict:
    model = zoo.build(name).eval()
    shape = (3, size, size)
    cm = pathir.compile(model, input_shape=shape, backend="torch")
    pruned = pathir.compile(copy.deepcopy(model), input_shape=shape, backend="torch")
    pruned.prune(0.4)
    twin = copy.deepcopy(model).double().eval()
    x = torch.randn(batch, *shape, dtype=torch.float64)
    chunk = chunk or batch
    be = cm.get_backend()

    def model_forward():
        with torch.no_grad():
            twin(x)

    start = time.perf_counter()
    forward_s = median_time(model_forward, repeat)
    norm_s = median_time(lambda: active_path_norm(cm.graph, be, x, chunk=chunk), repeat)
    metric_s = median_time(lambda: active_path_metric(cm, pruned, x, chunk=chunk), repeat)
    return {
        "model": name, "batch": batch, "input": list(shape), "chunk": chunk, "threads": torch.get_num_threads(),
        "model_forward_s": forward_s, "active_path_norm_s": norm_s, "active_path_metric_s": metric_s,
        "ratio_active_path_norm": norm_s / forward_s, "ratio_active_path_metric": metric_s / forward_s,
        "bench_s": time.perf_counter() - start,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="?", default="resnet18,resnet50")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=None)
    args = parser.parse_args()
    for name in args.models.split(","):
        print(json.dumps(bench(name, args.batch, args.size, args.repeat, args.chunk)), flush=True)


if __name__ == "__main__":
    main()
