"""A real accuracy number for equalization before quantization: the demo's depthwise-separable residual CNN
(pathir/app/demo_equalize.py) trained on scikit-learn's digits, batch-norms folded, every conv/linear weight
quantized per tensor, symmetric, at 8/6/4 bits (biases and activations float), as it is, after Brevitas's
cross-layer equalization and after ``pathir.equalize`` (noise and range objectives; output-noise calibrated on 64
training images; and noise with bias absorption, applied to the model with its batch-norms before folding). Test accuracy, per training seed
and mean ± std over the seeds.

    python benchmarks/bench_equalize_digits.py [--seeds 0,1,2,3,4] [--epochs 6] [--bits 8,6,4] [--json out.json]

Brevitas is the optional ``bench-equalize`` extra; without it its column says skipped. The tables this prints
are pasted into docs/equalize.md.
"""

from __future__ import annotations

import argparse
import copy

import numpy as np
import torch
from rows_out import measured, save_json

import pathir
from pathir.app.demo import _digits
from pathir.app.demo_equalize import (
    TITLES,
    _spread,
    accuracy_on,
    fold_batch_norms,
    part_equalize,
    quantize_weights,
    train_separable,
)

TITLES = {**TITLES, "pathir-absorb": "pathir (noise) + bias absorption",
          "pathir-output": "pathir (output-noise, 64 training images)"}
#: training images the output-noise side calibrates on (never a test image)
CALIBRATION = 64


def output_noise(folded, data, bits) -> dict:
    """pathir's output-noise equalization of the folded model, calibrated on the first ``CALIBRATION`` training
    images, then quantized as the other sides."""
    X_train, X_test, y_test = data[0], data[1], data[3]
    model = copy.deepcopy(folded)
    x = torch.from_numpy(X_train[:CALIBRATION]).reshape(-1, 1, 8, 8)
    pathir.equalize(model, input_shape=(1, 8, 8), bits=6, objective="output-noise", inputs=x, progress=False)
    return {"float": accuracy_on(model, X_test, y_test),
            **{f"W{b}": accuracy_on(quantize_weights(model, b), X_test, y_test) for b in bits},
            "spread": _spread(model)}


def absorbed(model, data, bits) -> dict:
    """pathir's equalization with bias absorption, on the model with its batch-norms (absorption reads γ and
    β), then folded and quantized as the other sides: the float accuracy changes (absorption is not exact)."""
    X_test, y_test = data[1], data[3]
    model = copy.deepcopy(model)
    x = torch.from_numpy(X_test).reshape(-1, 1, 8, 8)
    report = pathir.equalize(model, input_shape=(1, 8, 8), bits=6, absorb_bias=True, inputs=x, progress=False)
    folded = fold_batch_norms(model)
    a = report.absorption
    return {"float": accuracy_on(folded, X_test, y_test),
            **{f"W{b}": accuracy_on(quantize_weights(folded, b), X_test, y_test) for b in bits},
            "absorbed_channels": a.channels, "output_change_rel": a.rel_deviation,
            "activation_range_before": sum(r.before for r in a.activation_ranges),
            "activation_range_after": sum(r.after for r in a.activation_ranges)}


def rows(seeds, epochs: int, bits) -> list[dict]:
    data = _digits()
    for seed in seeds:
        model = train_separable(data[0], data[2], epochs, seed)
        result = part_equalize(data, None, epochs=epochs, bits=bits, seed=seed, model=model)
        for side, row in result["table"].items():
            yield {"seed": seed, "side": side, **row, "spread": result["spread"][side], "notes": result["notes"]}
        yield {"seed": seed, "side": "pathir-output", **output_noise(result["models"]["none"], data, bits), "notes": []}
        yield {"seed": seed, "side": "pathir-absorb", **absorbed(model, data, bits), "notes": []}


def table(measured_rows: list[dict], bits) -> str:
    sides = [s for s in dict.fromkeys(r["side"] for r in measured_rows) if s != "pathir-absorb"]
    seeds = sorted({r["seed"] for r in measured_rows})
    cols = ["float", *(f"W{b}" for b in bits)]
    out = [f"test accuracy, mean ± std over {len(seeds)} seeds ({', '.join(map(str, seeds))})", "",
           "| equalization | " + " | ".join(cols) + " | median channel-range spread |", "|---" * (len(cols) + 2) + "|"]
    for side in sides:
        mine = [r for r in measured_rows if r["side"] == side]
        cells = [f"{np.mean([r[c] for r in mine]):.3f} ± {np.std([r[c] for r in mine]):.3f}" for c in cols]
        spread = [r["spread"] for r in mine if "spread" in r]
        out.append(f"| {TITLES[side]} | " + " | ".join(cells) + f" | {f'{np.median(spread):.2f}' if spread else '–'} |")
    out += ["", "per seed, " + " / ".join(cols[1:]) + ":", ""]
    for seed in seeds:
        cells = [f"{TITLES[r['side']]}: " + " / ".join(f"{r[c]:.3f}" for c in cols[1:])
                 for r in measured_rows if r["seed"] == seed and r["side"] in sides]
        out.append(f"seed {seed}: " + "; ".join(cells))
    absorb = [r for r in measured_rows if r["side"] == "pathir-absorb"]
    if absorb:
        out += ["", "pathir (noise) + bias absorption on the model before folding, per seed: channels absorbed (c > 0); "
                "largest output change over the largest output on the test images; sum over the absorbed ReLUs of "
                "their activation range (max), before -> after; test accuracy float / " + " / ".join(cols[1:]) + ":", ""]
        out += [f"seed {r['seed']}: {r['absorbed_channels']} channels; output change {r['output_change_rel']:.3g}; "
                f"activation ranges {r['activation_range_before']:.4g} -> {r['activation_range_after']:.4g}; "
                + " / ".join(f"{r[c]:.3f}" for c in cols) for r in absorb]
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
