"""pathir enorm MODEL [-o OUT]: ENorm rescaling (docs/math.md §8), function preserved.

Same inputs and outputs as ``pathir pathcond``; ``-p`` chooses the norm.
"""

from __future__ import annotations

from pathir.enorm.normalize import check_p

from .common import add_model_arguments, compile_model, progress
from .pathcond import add_output_arguments, check_output, module_tree, report_and_exit, write_output

HELP = "rescale a model by ENorm (minimises the l_p norm of the weights; the function is unchanged)"


def add_arguments(parser):
    add_model_arguments(parser)
    add_output_arguments(parser)
    parser.add_argument("-p", type=float, default=2.0, help="the norm's exponent (default 2)")
    parser.add_argument("--solver", default="newton", choices=["newton", "block", "coordinate"],
                        help="newton: projected Newton-CG (default); block: all units of an independent set at once; "
                             "coordinate: one at a time")
    parser.add_argument("--max-log-scale", type=float, default=None,
                        help="bound on every |z_h| (inf: none); default: the largest the model's dtype holds")


def run(args) -> int:
    check_p(args.p)  # before the model is built
    check_output(args)
    cm = compile_model(args)
    tree = module_tree(cm.model)
    report = cm.enorm(p=args.p, max_sweeps=args.max_sweeps, tol=args.tol, solver=args.solver,
                      write_back=args.output is not None, max_log_scale=args.max_log_scale,
                      progress=progress(args))
    return report_and_exit(cm, report, args, write_output(cm, args, tree))
