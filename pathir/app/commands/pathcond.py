"""pathir pathcond MODEL [-o OUT]: PathCond rescaling (docs/math.md §7), function preserved.

A torch model (torchvision name or ``module:factory``) is written as its
state_dict (.pt), loadable into a fresh instance of the model; an ONNX model
as an .onnx file. Without ``-o`` only the report is printed. The output is
written through a temporary file beside it: nothing is left behind on failure.
"""

from __future__ import annotations

from pathir.errors import PathirError

from .common import add_model_arguments, check_output_path, compile_model, emit_json, model_info, progress, save_state_dict

HELP = "rescale a model by PathCond (balances diag G; the function is unchanged)"


def add_output_arguments(parser) -> None:
    parser.add_argument("-o", "--output", default=None,
                        help="output file: .pt state_dict (torch models) or .onnx; omit to only print the report")
    parser.add_argument("--max-sweeps", type=int, default=1000, help="sweeps of the solver at most")
    parser.add_argument("--tol", type=float, default=1e-10,
                        help="stop when a sweep changes F by at most tol*max(1,|F|)")
    parser.add_argument("--history", action="store_true", help="with --json: add the objective after every sweep")


def add_arguments(parser):
    add_model_arguments(parser)
    add_output_arguments(parser)
    parser.add_argument("--solver", default="newton", choices=["newton", "block", "coordinate"],
                        help="newton: block sweeps then projected Newton-CG (default); block: exact block updates; "
                             "coordinate: the published cyclic coordinate descent")
    parser.add_argument("--max-log-scale", type=float, default=None,
                        help="bound on every |z_h| (inf: none); default: the largest the model's dtype holds")


def write_output(cm, args) -> None:
    """Write the rescaled model to ``args.output`` (checked before any work by ``check_output``)."""

    if args.output is None:
        return
    if is_onnx(args):
        cm.save(args.output)
    elif cm.model is not None and hasattr(cm.model, "state_dict"):
        save_state_dict(cm.model, args.output)
    else:
        raise PathirError(f"cannot write a model of type {type(cm.model).__name__}")


def check_output(args) -> None:
    if args.output is not None:
        check_output_path(args.output, is_onnx(args))


def is_onnx(args) -> bool:
    import os

    return args.model.endswith(".onnx") or os.path.isfile(args.model)


def report_and_exit(cm, report, args) -> int:
    if args.json:
        out = {"model": cm.name, **model_info(args), "output": args.output, **report.to_dict()}
        if not args.history:
            out.pop("history", None)
        emit_json(out)
    else:
        print(report)
        if args.output is not None:
            print(f"written to {args.output}")
    return 0


def run(args) -> int:
    check_output(args)
    cm = compile_model(args)
    report = cm.pathcond(solver=args.solver, max_sweeps=args.max_sweeps, tol=args.tol,
                         write_back=args.output is not None, max_log_scale=args.max_log_scale,
                         progress=progress(args))
    write_output(cm, args)
    return report_and_exit(cm, report, args)
