"""pathir prune MODEL --amount 0.5 -o OUT: path-magnitude (or magnitude) pruning.

A torch model is written as its state_dict (.pt, pruning made permanent: plain
``weight`` tensors with zeros, loadable into a fresh instance of the model); an
ONNX model as an .onnx file. The output is written through a temporary file
beside it, so nothing is left behind on failure.
"""

from __future__ import annotations

import os

from pathir.errors import PathirError

from .common import add_model_arguments, check_output_path, compile_model, emit_json, save_state_dict

HELP = "prune a model by path-magnitude scores (rescaling-invariant) or by magnitude"


def add_arguments(parser):
    add_model_arguments(parser)
    parser.add_argument("--amount", type=float, required=True, help="fraction of the candidate weights to prune, in [0, 1]")
    parser.add_argument("-o", "--output", required=True, help="output file: .pt state_dict (torch models) or .onnx")
    parser.add_argument("--criterion", default="path-magnitude", choices=["path-magnitude", "magnitude"])
    parser.add_argument("--scope", default="global", choices=["global", "local"],
                        help="global: smallest scores over all weights; local: the fraction of each tensor")
    parser.add_argument("--include-biases", action="store_true", help="biases are candidates too")


def run(args) -> int:
    onnx_model = args.model.endswith(".onnx") or os.path.isfile(args.model)
    check_output_path(args.output, onnx_model)
    cm = compile_model(args)
    report = cm.prune(args.amount, criterion=args.criterion, scope=args.scope, include_biases=args.include_biases)
    if onnx_model:
        cm.save(args.output)
    elif cm.model is not None and hasattr(cm.model, "state_dict"):
        save_state_dict(cm.model, args.output)
    else:
        raise PathirError(f"cannot write the pruned model of type {type(cm.model).__name__}")
    if args.json:
        emit_json({"model": cm.name, "output": args.output, **report.to_dict()})
    else:
        print(report)
        print(f"written to {args.output}")
    return 0
