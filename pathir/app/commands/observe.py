"""pathir observe MODEL --inputs X.npy: activation-filtered path observables on data.

Prints the quantiles over the samples of the active path-norms, active path counts
and active-neuron fractions (and, with ``--compare W2``, of the active path-metric,
the local and global output bounds and the real output change), or every sample
with ``--csv`` / ``--json``. ``--weights W`` loads a state_dict (.pt) into a torch
model first. Under ``torchrun --nproc_per_node N pathir observe ...`` each rank walks
its shard of the samples and rank 0 alone prints the whole table.
"""

from __future__ import annotations

import argparse
import copy

import pathir
from pathir.errors import ArgumentError
from pathir.support.distributed import group, join_launcher_group, leave_group

from .common import add_model_arguments, emit_json, file_path, model_info, prepare_model, progress, read_inputs
from .weights import load_weights

HELP = "active path-norms, active path counts and local bounds of a model on the samples of X.npy"


def add_arguments(parser):
    add_model_arguments(parser)
    parser.add_argument("--inputs", required=True, help="a .npy array (N, *input shape) of samples")
    if not any("--weights" in a.option_strings for a in parser._actions):
        parser.add_argument("--weights", default=None, type=file_path,
                            help="a state_dict (.pt) loaded into the torch model first")
    parser.add_argument("--compare", default=None, metavar="W2", type=file_path,
                        help="a state_dict of the same model (pruned, quantized): adds the active path-metric columns")
    parser.add_argument("--q", type=float, nargs="+", default=[1.0], help="the q of the active l_q path-norms")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="samples per walk (default: by the model's size, at most 32; docs/activations.md)")
    parser.add_argument("--csv", action="store_true", help="print one CSV row per sample")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar on stderr (default: on a terminal only)")


def _load_weights(model, path: str, trust_pickle: bool = False):
    """``model`` with the state_dict at ``path`` loaded, through the reader --weights uses everywhere (a file
    that does not fit is refused naming its keys)."""
    if isinstance(model, str):
        raise ArgumentError("--weights/--compare load a state_dict into a torch model; an .onnx file carries its own")
    load_weights(model, path, trust_pickle)
    return model


def _compile(model, name, shape, backend, args):
    cm = pathir.compile(model, input_shape=shape, backend=backend, progress=progress(args))
    cm.name = name
    return cm


def run(args) -> int:
    joined = join_launcher_group()
    try:
        return _run(args)
    finally:
        if joined:
            leave_group()


def _run(args) -> int:
    if args.csv and args.json:
        raise ArgumentError("--csv and --json each choose what is printed: give one")
    grp = group()
    x = read_inputs(args.inputs, grp is not None)  # a rank reads only its shard
    if x.ndim < 2:
        raise ArgumentError(f"--inputs must hold an array (N, *input shape), got shape {x.shape}")
    if grp is not None and grp.rank != 0:
        args.quiet = True  # rank 0 alone says where the weights came from
    model, name, shape = prepare_model(args, default_shape=x.shape[1:])  # --seed, --weights, the random-init note
    other = None
    if args.compare:
        other = _compile(_load_weights(copy.deepcopy(model), args.compare, getattr(args, "trust_pickle", False)),
                         name, shape, args.backend, args)
    cm = _compile(model, name, shape, args.backend, args)
    bar = progress(args) if args.progress is None else args.progress  # -q: no bar (unless --progress asks)
    obs = pathir.observe(cm, x, qs=args.q, compare=other, batch_size=args.batch_size, progress=bar)
    if grp is not None and grp.rank != 0:
        return 0  # every rank holds the whole table; rank 0 prints it
    if args.json:
        emit_json({"model": name, **model_info(args), "inputs": args.inputs, **obs.to_dict()})
    elif args.csv:
        print(obs.to_csv(), end="")
    else:
        print(f"model {name} on {args.inputs}")
        print(obs)
    return 0
