"""pathir pathcond MODEL [-o OUT]: PathCond rescaling (docs/math.md §7), function preserved.

A torch model (torchvision name or ``module:factory``) is written as its
state_dict (.pt), loadable into a fresh instance of the model; where the write-back
replaced modules (a clipped ReLU made per-channel), a state_dict would not load into a
fresh instance, so the whole model is saved instead (``torch.save(model)``), which the
output line and the JSON's ``output_format`` say; an ONNX model as an .onnx file. Without ``-o`` only the report is printed. The output is
written through a temporary file beside it: nothing is left behind on failure.
"""

from __future__ import annotations

from pathir.errors import PathirError

from .common import (
    add_model_arguments,
    check_output_path,
    compile_model,
    emit_json,
    is_onnx_spec,
    model_info,
    positive_float,
    positive_int,
    progress,
    save_module,
    save_state_dict,
)

HELP = "rescale a model by PathCond (balances diag G; the function is unchanged)"


def add_output_arguments(parser) -> None:
    parser.add_argument("-o", "--output", default=None,
                        help="output file: .pt state_dict (torch models; the whole model where the write-back "
                             "replaced modules) or .onnx; omit to only print the report")
    parser.add_argument("--max-sweeps", type=positive_int, default=1000, help="sweeps of the solver at most")
    parser.add_argument("--tol", type=positive_float, default=1e-10,
                        help="pathcond: stop when a sweep changes F by at most tol*max(1,|F|) or moves no z_h by more "
                             "than tol; enorm: when no unit's update would move it by more than tol")
    parser.add_argument("--history", action="store_true", help="with --json: add the objective after every sweep")


def add_arguments(parser):
    add_model_arguments(parser)
    add_output_arguments(parser)
    parser.add_argument("--solver", default="newton", choices=["newton", "block", "coordinate"],
                        help="newton: projected Newton-CG from a coarse start (default); block: exact block updates; "
                             "coordinate: the published cyclic coordinate descent")
    parser.add_argument("--max-log-scale", type=float, default=None,
                        help="bound on every |z_h| (inf: none); default: the largest the model's dtype holds")


def module_tree(model) -> tuple | None:
    """Every (path, class) of the model's module tree, under every name: a fresh instance has the tree the
    model had before the command (None for a model that is not a torch module)."""
    if not hasattr(model, "named_modules"):
        return None
    return tuple((path, type(m)) for path, m in model.named_modules(remove_duplicate=False))


def write_output(cm, args, tree) -> dict:
    """Write the rescaled model to ``args.output`` (checked before any work by ``check_output``) and
    return what the report says of it: ``{"output_format": "state_dict" | "module" | "onnx" | None,
    "replaced_modules": [...]}``. ``tree``: :func:`module_tree` of the model before the rescaling; where
    the write-back replaced modules it differs, a state_dict would not load into a fresh instance, and the
    whole model is saved (``torch.save(model)``)."""

    if args.output is None:
        return {"output_format": None, "replaced_modules": []}
    if is_onnx_spec(args.model):
        cm.save(args.output)
        return {"output_format": "onnx", "replaced_modules": []}
    if cm.model is None or not hasattr(cm.model, "state_dict"):
        raise PathirError(f"cannot write a model of type {type(cm.model).__name__}")
    if module_tree(cm.model) == tree:
        save_state_dict(cm.model, args.output)
        return {"output_format": "state_dict", "replaced_modules": []}
    before = dict(tree)
    replaced = sorted({path for path, kind in module_tree(cm.model) if before.get(path) is not kind})
    save_module(cm.model, args.output)
    return {"output_format": "module", "replaced_modules": replaced}


def written_line(args, written: dict) -> str:
    """The report's line about the output file."""
    if written["output_format"] != "module":
        return f"written to {args.output}"
    where = ", ".join(f"'{p}'" for p in written["replaced_modules"])
    made = ("each clipped ReLU made a ReLU: --relu6 relu" if getattr(args, "relu6", "clip") == "relu"
            else "a clipped ReLU made a per-channel pathir.nn.ClippedReLU")
    return (f"written to {args.output} as the whole model (torch.save(model)), not as a state_dict: the write-back "
            f"replaced the module(s) at {where} ({made}), which a "
            f"fresh instance lacks; load it with torch.load({args.output!r}, weights_only=False) (this unpickles "
            "code: the model's own module and pathir must be importable)")


def check_output(args) -> None:
    """Refuse, before any work, an output path that cannot be written and --history without --json."""
    if getattr(args, "history", False) and not args.json:
        raise PathirError("--history adds the per-sweep values to the JSON report: it needs --json")
    if args.output is not None:
        check_output_path(args.output, is_onnx_spec(args.model), (args.model, getattr(args, "weights", None)))


def report_and_exit(cm, report, args, written: dict) -> int:
    if args.json:
        out = {"model": cm.name, **model_info(args), "output": args.output, **written, **report.to_dict()}
        if not args.history:
            out.pop("history", None)
        emit_json(out)
    else:
        print(report)
        if args.output is not None:
            print(written_line(args, written))
    return 0


def run(args) -> int:
    check_output(args)
    cm = compile_model(args)
    tree = module_tree(cm.model)
    report = cm.pathcond(solver=args.solver, max_sweeps=args.max_sweeps, tol=args.tol,
                         write_back=args.output is not None, max_log_scale=args.max_log_scale,
                         progress=progress(args))
    return report_and_exit(cm, report, args, write_output(cm, args, tree))
