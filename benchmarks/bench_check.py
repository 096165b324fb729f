"""Cost of ``pathir check`` and of the progress bars, against the model's own float64 forward+backward.

    python benchmarks/bench_check.py [resnet18] [--input-shape 3,224,224] [--repeat 3]

For each model (torchvision, random init, eval): the median time of one float64
forward+backward of the model at batch 1 (the baseline, measured in the same
process), of ``pathir.app.checks.check`` (compile with its self-check, a random
rescaling on the IR and written into a float64 copy, coverage), and of
``cm.pathcond(write_back=False)`` with the progress bar drawn (to a discarded
stream) and not drawn, interleaved so that the machine's load hits both alike.
Prints one JSON line per model with the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import statistics
import sys

import torch
from bench_path_norm import median_time  # run as a script: benchmarks/ is on sys.path

import pathir
import pathir.app.checks
from pathir.app import zoo


def forward_backward_f64(model, shape) -> float:
    twin = copy.deepcopy(model).double()
    x = torch.randn(1, *shape, dtype=torch.float64)

    def step():
        twin.zero_grad(set_to_none=True)
        twin(x).sum().backward()

    return median_time(step, 3)


def bench(name: str, shape, repeat: int) -> dict:
    torch.manual_seed(0)
    model = zoo.build(name).eval()
    shape = shape or zoo.input_shape(name)
    base = forward_backward_f64(model, shape)
    check_s = median_time(lambda: pathir.app.checks.check(model, input_shape=shape, progress=False), repeat, warm_up=False)
    cm = pathir.compile(model, input_shape=shape, progress=False)
    cm.pathcond(write_back=False, progress=False)  # warm-up: units, row keys, backend copies
    drawn, silent = [], []
    for k in range(2 * repeat):  # interleaved, the order alternating: the machine's load hits both alike
        if (k % 2 == 0) == (k // 2 % 2 == 0):
            with contextlib.redirect_stderr(io.StringIO()):
                drawn.append(median_time(lambda: cm.pathcond(write_back=False, progress=True), 1, warm_up=False))
        else:
            silent.append(median_time(lambda: cm.pathcond(write_back=False, progress=False), 1, warm_up=False))
    drawn_s, silent_s = statistics.median(drawn), statistics.median(silent)
    return {"model": name, "input": list(shape), "forward_backward_f64_s": round(base, 4),
            "check_s": round(check_s, 3), "check_over_fb": round(check_s / base, 1),
            "pathcond_bar_s": round(drawn_s, 3), "pathcond_no_bar_s": round(silent_s, 3),
            "bar_over_no_bar": round(drawn_s / silent_s, 3)}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="?", default="resnet18")
    parser.add_argument("--input-shape", default=None, help="e.g. 3,64,64 (default: the model's usual)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    shape = tuple(int(s) for s in args.input_shape.split(",")) if args.input_shape else None
    rows = [bench(name, shape, args.repeat) for name in args.models.split(",")]
    for row in rows:
        print(json.dumps(row))
    sys.stdout.flush()
    return rows


if __name__ == "__main__":
    main()
