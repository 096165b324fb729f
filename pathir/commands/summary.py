"""pathir summary MODEL: parameters, neurons, channels, #paths and path-norms."""

from __future__ import annotations

from .common import add_model_arguments, compile_model, emit_json

HELP = "parameters, hidden neurons/channels, log10 #paths and l1/l2/l4 path-norms of a model"


def add_arguments(parser):
    add_model_arguments(parser)


def run(args) -> int:
    summary = compile_model(args).summary()
    if args.json:
        emit_json(summary.to_dict())
    else:
        print(summary)
    return 0
