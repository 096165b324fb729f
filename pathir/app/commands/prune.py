"""pathir prune MODEL --amount A [-o OUT]: path-magnitude (or magnitude) pruning.

``--amount`` is a fraction 0 < A < 1 of the candidate weights or a whole number
A ≥ 1 of entries; the report says which was understood. Without ``-o`` only the
report is printed. A torch model is written as its state_dict (.pt, pruning made
permanent: plain ``weight`` tensors with zeros, loadable into a fresh instance of
the model); an ONNX model as an .onnx file. The output is written through a
temporary file beside it, so nothing is left behind on failure.
"""

from __future__ import annotations

from pathir.errors import ArgumentError

from .common import add_model_arguments, compile_model, emit_json, model_info, progress
from .pathcond import check_output, module_tree, write_output

HELP = "prune a model by path-magnitude scores (rescaling-invariant) or by magnitude"

AMOUNT_FORMS = "a fraction 0 < A < 1 of the candidate weights (0.5) or a whole number A >= 1 of entries (50)"


def add_arguments(parser):
    add_model_arguments(parser)
    parser.add_argument("--amount", required=True, help=f"how much to prune: {AMOUNT_FORMS}")
    parser.add_argument("-o", "--output", default=None,
                        help="output file: .pt state_dict (torch models) or .onnx; omit to only print the report")
    parser.add_argument("--criterion", default="path-magnitude", choices=["path-magnitude", "magnitude"],
                        help="path-magnitude (default): the l1 mass of the paths through a weight, unchanged by "
                             "rescalings; magnitude: |weight|")
    parser.add_argument("--scope", default="global", choices=["global", "local"],
                        help="global: smallest scores over all weights; local: the amount in each tensor")
    parser.add_argument("--include-biases", action="store_true", help="biases are candidates too")


def parse_amount(text: str):
    """(amount, what was understood): a float fraction in (0, 1) or an int count ≥ 1.

    >>> parse_amount("0.25"), parse_amount("50"), parse_amount("1e2")
    ((0.25, 'a fraction 0.25 of the candidates'), (50, '50 entries (a count)'), (100, '100 entries (a count)'))
    """
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if 0.0 < value < 1.0:
        return value, f"a fraction {value:g} of the candidates"
    if 1.0 <= value < 2**63 and value == int(value):  # (int(inf) would raise OverflowError)
        return int(value), f"{int(value):,} entries (a count)"
    raise ArgumentError(f"--amount must be {AMOUNT_FORMS}; got '{text}'")


def run(args) -> int:
    amount, understood = parse_amount(args.amount)
    check_output(args)
    cm = compile_model(args)
    tree = module_tree(cm.model)
    report = cm.prune(amount, criterion=args.criterion, scope=args.scope, include_biases=args.include_biases,
                      progress=progress(args))
    write_output(cm, args, tree)  # pruning replaces no module: a state_dict
    if args.json:
        emit_json({"model": cm.name, **model_info(args), "output": args.output, "amount_understood": understood,
                   **report.to_dict()})
        return 0
    print(f"{'model':<24}  {cm.name}")
    print(f"{'amount':<24}  {understood}")
    print(report)
    print(f"{'model pruned':<24}  " + (f"yes, written to {args.output}" if args.output else "no (report only)"))
    return 0
