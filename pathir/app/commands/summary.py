"""pathir summary MODEL: parameters, neurons, channels, #paths and path-norms."""

from __future__ import annotations

from .common import add_model_arguments, compile_model, emit_json, model_info

HELP = "parameters, hidden neurons/channels, log10 #paths and l1/l2/l4 path-norms of a model"


def add_arguments(parser):
    add_model_arguments(parser)


def run(args) -> int:
    summary = compile_model(args).summary()
    info = model_info(args)
    summary.extra["weights"] = info["weights"] if info["seed"] is None else f"random init (seed {info['seed']})"
    if args.json:
        report = summary.to_dict()
        emit_json({"model": report.get("name"), **report, **info})
    else:
        print(summary)
    return 0
