"""Path-norm cost against one float64 forward pass of the same model (issue: <= 1.5x).

    python benchmarks/bench_path_norm.py [resnet18,resnet50,vgg16] [--repeat 5]
    python benchmarks/bench_path_norm.py fcn_resnet50,deeplabv3_resnet50   # fixed maps: upsampling

Besides the torchvision classification zoo, the segmentation models (random
init, aux heads; bilinear upsampling and several outputs) run at 3x224x224.

For each model: compile time, the median time of one float64 forward of the
torch model (batch 1, 3x224x224: the baseline), and the median time of
cm.path_norm(q) for q = 1, 2, 4 on the torch backend; ratios = path_norm / forward.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

import pathir
from pathir.app import zoo


def median_time(fn, repeat: int, warm_up: bool = True) -> float:
    """The median wall time of ``repeat`` calls of ``fn``, after one untimed call unless ``warm_up=False``."""
    if warm_up:
        fn()  # caches, allocator
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


SEGMENTATION = ("fcn_resnet50", "deeplabv3_resnet50")


def build(name: str):
    """(model in eval mode, input shape) of a zoo or a segmentation model."""
    if name in SEGMENTATION:
        from torchvision.models import segmentation

        model = getattr(segmentation, name)(weights=None, weights_backbone=None, aux_loss=True)
        return model.eval(), (3, 224, 224)
    return zoo.build(name), zoo.input_shape(name)


def bench(name: str, repeat: int) -> dict:
    model, shape = build(name)
    start = time.perf_counter()
    cm = pathir.compile(model, input_shape=shape, backend="torch")
    compile_s = time.perf_counter() - start
    twin = copy.deepcopy(model).double().eval()
    x = torch.randn(1, *shape, dtype=torch.float64)

    def model_forward():
        with torch.no_grad():
            twin(x)

    forward_s = median_time(model_forward, repeat)
    row = {"model": name, "compile_s": compile_s, "forward_s": forward_s}
    for q in (1, 2, 4):
        t = median_time(lambda: cm.path_norm(q, log10=True), repeat)
        row[f"path_norm_l{q}_s"] = t
        row[f"ratio_l{q}"] = t / forward_s
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="?", default="resnet18,resnet50,vgg16")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [bench(n, args.repeat) for n in args.models.split(",")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'model':<18} {'compile':>8} {'forward':>8} {'l1':>8} {'l2':>8} {'l4':>8} {'l1/fwd':>7} {'l2/fwd':>7} {'l4/fwd':>7}")
    for r in rows:
        print(f"{r['model']:<18} {r['compile_s']:8.3f} {r['forward_s']:8.3f} {r['path_norm_l1_s']:8.3f} "
              f"{r['path_norm_l2_s']:8.3f} {r['path_norm_l4_s']:8.3f} {r['ratio_l1']:7.2f} {r['ratio_l2']:7.2f} {r['ratio_l4']:7.2f}")


if __name__ == "__main__":
    main()
