"""Cost of compile's self-check against one forward of the model (issue 11: one forward of each).

    python benchmarks/bench_self_check.py [resnet18,resnet50] [--repeat 3]

For each model (float32, eval, 3x224x224): the median compile time without the
self-check, the median time of the self-check as compile runs it (the first one on
a Compiled, which also builds the IR's parameters for the torch backend) and
of a second one, the median time of one forward of the torch model on the
self-check's batch (2 samples, torch.no_grad), and the ratio (self-check) / (model forward).
The self-check runs the model once and the IR once (torch backend, float32 for a
float32 model), so the ratio is about 1 + (IR forward / model forward).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from bench_path_norm import median_time  # run as a script: benchmarks/ is on sys.path

import pathir
from pathir.app import zoo
from pathir.self_check import BATCH, self_check


def bench(name: str, repeat: int) -> dict:
    model = zoo.build(name).eval()
    shape = zoo.input_shape(name)
    pathir.compile(model, input_shape=shape, self_check=False)  # warm-up (imports, allocator)
    compile_s = median_time(lambda: pathir.compile(model, input_shape=shape, self_check=False), repeat, warm_up=False)
    first, steady, forward = [], [], []
    x = torch.randn(BATCH, *shape)
    for _ in range(repeat):  # interleaved, so that the machine's load hits all three alike
        cm = pathir.compile(model, input_shape=shape, self_check=False)
        first.append(median_time(lambda: self_check(cm, model, "torch"), 1, warm_up=False))  # builds the IR's float64 params
        steady.append(median_time(lambda: self_check(cm, model, "torch"), 1, warm_up=False))
        with torch.no_grad():
            forward.append(median_time(lambda: model(x), 1, warm_up=False))
    first_s, steady_s, forward_s = (statistics.median(t) for t in (first, steady, forward))
    return {"model": name, "compile_s": round(compile_s, 3), "self_check_s": round(first_s, 3),
            "self_check_steady_s": round(steady_s, 3), "model_forward_s": round(forward_s, 3),
            "self_check_over_forward": round(first_s / forward_s, 2)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="?", default="resnet18,resnet50")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    for name in args.models.split(","):
        print(json.dumps(bench(name, args.repeat)))


if __name__ == "__main__":
    main()
