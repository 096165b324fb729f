"""pathir equalize MODEL [-o OUT]: equalization for quantization (docs/math.md §12), function preserved.

Same inputs and outputs as ``pathir pathcond``: a torch model is written as its state_dict (.pt), or
whole (``torch.save(model)``) where the write-back replaced modules (a ReLU6 made a per-channel
``pathir.nn.ClippedReLU``), an ONNX model as an .onnx file; without ``-o`` only the report is printed.
``--relu6 relu`` replaces a torch model's clipped ReLU modules by ReLUs first (``pathir.equalize(..., relu6="relu")``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pathir
from pathir.equalization.run import OBJECTIVES
from pathir.errors import ArgumentError

from .common import (
    add_model_arguments,
    check_output_path,
    compile_model,
    emit_json,
    file_path,
    is_onnx_spec,
    model_info,
    prepare_model,
    progress,
    read_inputs,
)
from .pathcond import module_tree, write_output, written_line

HELP = ("rescale a model so that per-tensor quantization of its weights is as fine as possible "
        "(cross-layer equalization over every unit; the function is unchanged)")


def add_arguments(parser):
    add_model_arguments(parser)
    parser.add_argument("-o", "--output", default=None,
                        help="output file: .pt state_dict (torch models; the whole model where the write-back "
                             "replaced modules) or .onnx; omit to only print the report")
    parser.add_argument("--bits", type=int, default=8, help="the weights' bit width the report measures (default 8)")
    parser.add_argument("--objective", default="noise", choices=list(OBJECTIVES),
                        help="noise: the rounding noise per-tensor quantization adds to the network (default); "
                             "output-noise: that noise in the outputs on the samples of --inputs (a calibration "
                             "batch); "
                             "range: per-tensor quantization steps over the weights' geometric means (Nagel's "
                             "criterion); path-metric: a first-order estimate of the certified bound on the output change "
                             "quantizing causes (the bound itself is reported; where the rescaling found would raise "
                             "it, none is written)")
    parser.add_argument("--inputs", default=None, type=file_path,
                        help="a .npy array (N, *input shape) of samples (a model with several inputs: an .npz of one "
                             "array per input, keyed by input name): the calibration batch output-noise reads, and "
                             "the report's observed output change is measured on it")
    parser.add_argument("--certify", action="store_true",
                        help="also compute the certified bound on the output change (always with path-metric)")
    parser.add_argument("--absorb-bias", action="store_true",
                        help="then absorb batch-norm biases into the next layers (DFQ bias absorption; not exact: "
                             "the report gives the output change on a seeded random batch)")
    parser.add_argument("--relu6", default="clip", choices=["clip", "relu"],
                        help="clip: clipped ReLUs kept exact, a moved one written as a per-channel clip (default); "
                             "relu: each clipped ReLU module of a torch model replaced by a ReLU first, as AIMET and "
                             "Quark do (the function changes: the report says by how much)")
    parser.add_argument("--max-log-scale", type=float, default=None,
                        help="bound on every |z_h| (inf: none); default: the largest the model's dtype holds")


def run(args) -> int:
    if args.output is not None:
        check_output_path(args.output, is_onnx_spec(args.model), (args.model, getattr(args, "weights", None)))
    if args.relu6 == "relu" and is_onnx_spec(args.model):
        raise ArgumentError("--relu6 relu replaces clipped ReLU modules of a torch model; an ONNX Clip stays a clip "
                            "(re-export the model with Relu to quantize it so)")
    if args.objective == "output-noise" and args.inputs is None:
        raise ArgumentError("--objective output-noise reads a calibration batch: pass --inputs X.npy (N samples of the "
                            "model's input shape)")
    inputs = None if args.inputs is None else read_inputs(args.inputs, False, keyed=True)
    options = dict(bits=args.bits, objective=args.objective, inputs=inputs, write_back=args.output is not None,
                   max_log_scale=args.max_log_scale, progress=progress(args), certify=True if args.certify else None,
                   absorb_bias=args.absorb_bias)
    if args.relu6 == "relu":  # the swap comes before compile: pathir.equalize's one-call form
        model, name, shape = prepare_model(args)
        tree = module_tree(model)
        report = pathir.equalize(model, input_shape=shape, relu6="relu", backend=args.backend, **options)
        report.name, source = name, SimpleNamespace(model=model)
    else:
        source = compile_model(args)
        names = source.graph.inputs
        if inputs is not None and not isinstance(inputs, dict) and len(names) > 1:
            raise ArgumentError(f"--inputs {args.inputs}: the model has inputs {list(names)}: pass an .npz holding one "
                                "array per input, keyed by input name (np.savez(path, **{name: array}))")
        tree = module_tree(source.model)
        report = source.equalize(**options)
    written = write_output(source, args, tree)
    if args.json:
        emit_json({"model": report.name, **model_info(args), "output": args.output, **written, **report.to_dict()})
    else:
        print(report)
        if args.output is not None:
            print(written_line(args, written))
    return 0
