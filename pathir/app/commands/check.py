"""pathir check MODEL: what a user runs before trusting a number (``pathir.app.checks.check``).

Prints what was analysed and each check; exit status 0 when all hold, 1 when one
failed (named in the last line), 2 when pathir refuses the model.
"""

from __future__ import annotations

from pathir.app.checks import check

from .common import add_model_arguments, emit_json, model_info, positive_int, prepare_model, progress

HELP = "compile with the self-check and verify the rescaling units (and, on small graphs, the exact symbolic checks)"


def add_arguments(parser):
    add_model_arguments(parser)
    parser.add_argument("--max-paths", type=positive_int, default=None,
                        help="run the exact symbolic checks on graphs with at most this many paths (default 2000)")


def run(args) -> int:
    model, name, shape = prepare_model(args)
    report = check(model, input_shape=shape, seed=args.seed, max_paths=args.max_paths, backend=args.backend,
                   progress=progress(args))
    if args.json:
        emit_json({**report.to_dict(), "model": name, **model_info(args)})
    else:
        print(str(report).replace(f"model       {report.model}", f"model       {name}", 1))
    return 0 if report.passed else 1
