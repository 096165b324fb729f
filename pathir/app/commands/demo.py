"""pathir demo: PathCond at initialisation and pruning under rescaling, on digits."""

from __future__ import annotations

import os

from pathir.errors import ArgumentError

from .common import emit_json

HELP = ("run the demo: PathCond vs ENorm vs baseline on a digits autoencoder, pruning under rescaling, path "
        "activations, and equalization before quantization")


def add_arguments(parser):
    parser.add_argument("--out", default="pathir-demo", help="folder for results.json and the PNG plots")
    parser.add_argument("--quick", action="store_true", help="one seed, fewer epochs (a smoke run)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    from pathir.app.demo import DemoConfig, run_demo  # lazy: imports torch

    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ArgumentError(f"--out names a file, not a folder: {args.out} (the demo writes results.json and its "
                            "plots into a folder)")
    try:
        os.makedirs(args.out, exist_ok=True)  # (before the minutes of training: a folder it cannot make fails now)
    except OSError as err:
        raise ArgumentError(f"--out: cannot make the folder {args.out} ({err.strerror})") from None
    cfg = DemoConfig(out=args.out)
    if args.quick:
        cfg.seeds, cfg.epochs, cfg.compressions, cfg.cnn_epochs, cfg.amounts = (0,), 4, (8,), 2, (0.6,)
        cfg.equalize_epochs = 1
    results = run_demo(cfg, progress=False if args.json or args.quiet else None)
    if args.json:
        emit_json({k: v for k, v in results.items() if k not in ("text", "curves")})
        return 0
    print(results["text"])
    print(f"\n{results['seconds']:.0f} s; plots and results.json in {os.path.abspath(cfg.out)}/")
    return 0
