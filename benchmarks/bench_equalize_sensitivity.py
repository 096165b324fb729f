"""How much of an equalized model's quantized score is its rescaling, and how much the luck of its rounding.

    python benchmarks/bench_equalize_sensitivity.py [--models shufflenet_v2_x1_0,mnasnet0_5] [--seeds 0,1]
                                                    [--bits 8,6] [--moves 8] [--sigma 0.01] [--dither 8]
                                                    [--json out.json]

The model, its folding and its scoring batch are bench_equalize.py's (``equalize_models``). Each side's
equalized model (Brevitas's ``preprocess_for_quantize`` and ``pathir.equalize``, as there) is then moved
``--moves`` times by a random function-preserving rescaling of its hidden units, e^{z_h} with
z_h ~ N(0, ``--sigma``²) (written by ``commit_rescaling``), re-quantized per tensor at each width and scored
(pooled output SQNR, dB). At σ = 0.01 every channel's scale moves by about 1 %: no per-tensor range, and no
equalization objective, moves by more than a few hundredths of a dB, but every weight's rounding is drawn
again. The spread of the moved scores is how far one equalized model's score can be read.

``--dither N`` adds a score no draw decides: each weight tensor perturbed by independent uniform noise of one
quantization step, U(−Δ/2, Δ/2) per entry (Δ = max|w| / (2^(b−1) − 1), per tensor), ``N`` times, and the output
SQNR of the mean squared error over the draws: the expected noise of rounding as the noise objective models
it. It overstates rounding where a channel sits far below its tensor's range (rounding moves a weight
w with |w| < Δ/2 by |w|, the noise by up to Δ/2), so it reads equalized models, not unequalized ones.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics

import bench_equalize as be  # run as a script: benchmarks/ is on sys.path
import equalize_models as em
import numpy as np
import torch
from rows_out import measured, save_json

import pathir


def moved_scores(eq, shape, x_chunks, y, bits_list, moves: int, sigma: float, seed: int) -> dict[int, list[float]]:
    """{bits: [pooled SQNR of ``eq`` moved by each random rescaling]} (the first entry: ``eq`` as it is)."""
    rng = np.random.default_rng(seed)
    out = {bits: [] for bits in bits_list}
    for k in range(moves + 1):
        m = copy.deepcopy(eq)
        if k:
            cm = pathir.compile(m, input_shape=shape, self_check=False)
            cm.commit_rescaling(rng.normal(scale=sigma, size=len(cm.units)))
            del cm
        with torch.no_grad():
            for bits in bits_list:
                q = em.quantize_weights(m, bits)
                out[bits].append(em.sqnr_db(y, torch.cat([q(c) for c in x_chunks])))
    return out


def dithered_sqnr(eq, x_chunks, y, bits: int, draws: int, seed: int) -> float:
    """Output SQNR (dB) of ``eq`` with every conv/linear weight perturbed by uniform noise of one per-tensor
    quantization step, the squared error averaged over ``draws`` draws."""
    gen = torch.Generator().manual_seed(seed)
    errors = []
    for _ in range(draws):
        noisy = copy.deepcopy(eq)
        with torch.no_grad():
            for layer in em.weight_layers(noisy).values():
                w = layer.weight
                w.add_((torch.rand(w.shape, generator=gen, dtype=w.dtype) - 0.5) * em.quantization_step(w, bits))
            y_n = torch.cat([noisy(c) for c in x_chunks])
        errors.append(float(((y_n - y) ** 2).sum()))
    return 10 * math.log10(float((y ** 2).sum()) / statistics.fmean(errors))


def bench(name: str, seed: int, args) -> list[dict]:
    shape = (3, args.size, args.size)
    model = em.build(name, size=args.size, seed=seed)
    side_args = be.parser().parse_args([])  # each side with bench_equalize.py's default settings
    side_args.seed = seed  # (pathir_data's calibration batch is drawn per seed, apart from the scoring batch)
    chunks = em.eval_inputs(args.size, args.batch, seed).split(side_args.chunk)
    folded, _, _ = em.fold_bn(model)
    with torch.no_grad():
        y = torch.cat([folded(c) for c in chunks])
    rows = []
    for side in args.sides:
        eq, _ = be.SIDES[side](copy.deepcopy(folded), shape, side_args)
        eq.eval()
        for bits, scores in moved_scores(eq, shape, chunks, y, args.bits, args.moves, args.sigma, seed).items():
            moved = scores[1:]
            rows.append({"model": name, "seed": seed, "side": side, "bits": bits, "sigma": args.sigma,
                         "sqnr": scores[0], "moved_min": min(moved, default=None),
                         "moved_median": statistics.median(moved) if moved else None,
                         "moved_max": max(moved, default=None), "moved": moved})
            if args.dither:
                rows[-1]["dithered"] = dithered_sqnr(eq, chunks, y, bits, args.dither, seed)
    return rows


def table(rows: list[dict]) -> str:
    dither = any("dithered" in r for r in rows)
    lines = ["| model (seed) | W bits | side | as equalized (dB) | moved: min / median / max (dB) |"
             + (" dithered (dB) |" if dither else ""), "|---|---|---|---|---|" + ("---|" if dither else "")]
    for r in rows:
        lines.append(f"| {r['model']} ({r['seed']}) | {r['bits']} | {be.TITLES[r['side']]} | {r['sqnr']:.1f} | "
                     + (f"{r['moved_min']:.1f} / {r['moved_median']:.1f} / {r['moved_max']:.1f} |" if r["moved"] else
                        "– |")
                     + (f" {r['dithered']:.1f} |" if dither else ""))
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="shufflenet_v2_x1_0,mnasnet0_5")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--bits", default="8,6")
    ap.add_argument("--sides", default="brevitas,pathir")
    ap.add_argument("--moves", type=int, default=8, help="random rescalings per equalized model")
    ap.add_argument("--sigma", type=float, default=0.01, help="their log-scale standard deviation")
    ap.add_argument("--dither", type=int, default=0, help="draws of uniform one-step weight noise (0: none)")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    args.bits = [int(b) for b in args.bits.split(",")]
    args.sides, notes = be.available([s for s in args.sides.split(",") if s])
    for note in notes:
        print(note)
    if not args.sides:
        print("no equalizer to run: nothing to compare, skipped")
        return []
    torch.set_num_threads(2)
    rows = measured(row for name in args.models.split(",") for seed in map(int, args.seeds.split(","))
                    for row in bench(name, seed, args))
    print(table(rows))
    save_json(rows, args.json)
    return rows


if __name__ == "__main__":
    main()
