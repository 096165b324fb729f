"""Cost of a U-Net's transposed convolutions: path-norm and diag G against one float64 forward.

    python benchmarks/bench_conv_transpose.py [--size 128] [--width 32] [--repeat 3]

A U-Net (3 levels: conv blocks, max-pool down, ConvTranspose2d(stride 2) up, concat skips) in
eval mode. pathir lowers each transposed convolution as a zero-stuffing Gather and a stride-1
Conv, so its convolution runs over the stuffed tensor (about stride² times the input's
positions). Reported: compile time; the median time of the model's own float64 forward at
batch 1 (the baseline); the median time of cm.path_norm(q) (q = 1, 2) and cm.diag_g() on the
torch backend; their ratios to the baseline.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_path_norm import median_time  # noqa: E402

import pathir  # noqa: E402


def _block(c_in, c_out):
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(), nn.Conv2d(c_out, c_out, 3, padding=1), nn.ReLU())


class UNet(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        w = width
        self.e1, self.e2, self.mid = _block(3, w), _block(w, 2 * w), _block(2 * w, 4 * w)
        self.pool = nn.MaxPool2d(2)
        self.u2, self.d2 = nn.ConvTranspose2d(4 * w, 2 * w, 2, stride=2), _block(4 * w, 2 * w)
        self.u1, self.d1 = nn.ConvTranspose2d(2 * w, w, 2, stride=2), _block(2 * w, w)
        self.head = nn.Conv2d(w, 2, 1)

    def forward(self, x):
        e1 = self.e1(x)
        e2 = self.e2(self.pool(e1))
        m = self.mid(self.pool(e2))
        d2 = self.d2(torch.cat([torch.relu(self.u2(m)), e2], 1))
        d1 = self.d1(torch.cat([torch.relu(self.u1(d2)), e1], 1))
        return self.head(d1)


def bench(size: int, width: int, repeat: int) -> dict:
    torch.manual_seed(0)
    model, shape = UNet(width).double().eval(), (3, size, size)
    start = time.perf_counter()
    cm = pathir.compile(model, input_shape=shape, backend="torch")
    compile_s = time.perf_counter() - start
    x = torch.randn(1, *shape, dtype=torch.float64)
    with torch.no_grad():
        forward_s = median_time(lambda: model(x), repeat)
    out = {"model": f"unet(width={width})", "input": list(shape), "compile_s": compile_s, "forward_f64_s": forward_s}
    for q in (1, 2):
        t = median_time(lambda q=q: cm.path_norm(q), repeat)
        out[f"path_norm_q{q}_s"], out[f"path_norm_q{q}_ratio"] = t, t / forward_s
    t = median_time(cm.diag_g, repeat)
    out["diag_g_s"], out["diag_g_ratio"] = t, t / forward_s
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(json.dumps(bench(args.size, args.width, args.repeat), indent=2))


if __name__ == "__main__":
    main()
