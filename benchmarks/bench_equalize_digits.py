"""A real accuracy number for equalization before quantization: the demo's depthwise-separable residual CNN
(pathir/app/demo_equalize.py) trained on scikit-learn's digits, batch-norms folded, every conv/linear weight
quantized per tensor, symmetric, at 8/6/4 bits (biases and activations float), as it is, after Brevitas's
cross-layer equalization and after ``pathir.equalize`` (range and path-metric objectives). Test accuracy,
per training seed and mean ± std over the seeds.

    python benchmarks/bench_equalize_digits.py [--seeds 0,1,2,3,4] [--epochs 6] [--bits 8,6,4] [--json out.json]

Brevitas is the optional ``bench-equalize`` extra; without it its column says skipped. The tables this prints
are pasted into docs/equalize.md.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from rows_out import measured, save_json

from pathir.app.demo import _digits
from pathir.app.demo_equalize import TITLES, part_equalize


def rows(seeds, epochs: int, bits) -> list[dict]:
    data = _digits()
    for seed in seeds:
        torch.manual_seed(seed)
        result = part_equalize(data, None, epochs=epochs, bits=bits, seed=seed)
        for side, row in result["table"].items():
            yield {"seed": seed, "side": side, **row, "spread": result["spread"][side], "notes": result["notes"]}


def table(measured_rows: list[dict], bits) -> str:
    sides = list(dict.fromkeys(r["side"] for r in measured_rows))
    seeds = sorted({r["seed"] for r in measured_rows})
    cols = ["float", *(f"W{b}" for b in bits)]
    out = [f"test accuracy, mean ± std over {len(seeds)} seeds ({', '.join(map(str, seeds))})", "",
           "| equalization | " + " | ".join(cols) + " | median channel-range spread |", "|---" * (len(cols) + 2) + "|"]
    for side in sides:
        mine = [r for r in measured_rows if r["side"] == side]
        cells = [f"{np.mean([r[c] for r in mine]):.3f} ± {np.std([r[c] for r in mine]):.3f}" for c in cols]
        out.append(f"| {TITLES[side]} | " + " | ".join(cells) + f" | {np.median([r['spread'] for r in mine]):.2f} |")
    out += ["", "per seed, " + " / ".join(cols[1:]) + ":", ""]
    for seed in seeds:
        cells = [f"{TITLES[r['side']]}: " + " / ".join(f"{r[c]:.3f}" for c in cols[1:])
                 for r in measured_rows if r["seed"] == seed]
        out.append(f"seed {seed}: " + "; ".join(cells))
    notes = sorted({n for r in measured_rows for n in r["notes"]})
    return "\n".join(out + notes)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2,3,4", help="training seeds, comma-separated")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--bits", default="8,6,4")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    bits = tuple(int(b) for b in args.bits.split(","))
    out = measured(rows([int(s) for s in args.seeds.split(",")], args.epochs, bits))
    print(table(out, bits))
    save_json(out, args.json)
    return out


if __name__ == "__main__":
    main()
