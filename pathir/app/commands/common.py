"""Helpers shared by the CLI commands: loading a MODEL argument (with --weights / --seed), JSON output."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import tempfile

import numpy as np

import pathir
from pathir.errors import ArgumentError, PathirError
from pathir.support.files import same_file, write_atomic

from .weights import load_weights

__all__ = ["add_model_arguments", "load_model", "compile_model", "emit_json", "parse_shape", "progress",
           "note", "model_info"]


def parse_shape(text: str | None):
    if text is None:
        return None
    parts = text.strip().rstrip(",").replace("x", ",").split(",")  # (a trailing comma: "4," is (4,))
    try:  # every part a size: "4,x" and "x" (an empty part after the separator) are not shapes
        shape = tuple(int(s) for s in parts)
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise ArgumentError(f"--input-shape must look like 3,224,224 or 3x224x224 (positive sizes), got '{text}'")
    return shape


def _number(text: str, convert, accept, expected: str):
    """argparse type: ``convert(text)`` where ``accept`` takes it, else the error naming what was expected."""
    try:
        value = convert(text)
    except (ValueError, OverflowError):
        value = None
    if value is None or not accept(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got '{text}'")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "a whole number >= 1")


def positive_float(text: str) -> float:
    return _number(text, float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")


def seed(text: str) -> int:
    """A torch seed: 0 <= seed < 2**63."""
    return _number(text, int, lambda v: 0 <= v < 2**63, "a whole number from 0 to 2**63 - 1")


def file_path(text: str) -> str:
    """argparse type: a path, not empty (an unset shell variable, ``--weights "$CKPT"``, would load nothing)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a file path, got an empty one (an unset variable?)")
    return text


def add_model_arguments(parser):
    parser.add_argument("model", help="a torchvision model name (resnet18), package.module:factory (imported and "
                                      "called with no arguments), or an .onnx file")
    parser.add_argument("--weights", metavar="PATH", default=None, type=file_path,
                        help="a state_dict or checkpoint (.pt/.pth; a dict holding 'state_dict' or 'model' is "
                             "understood) loaded into the torch model before anything runs")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="read --weights with weights_only=False, which also loads a whole pickled nn.Module; "
                             "unpickling runs code: only for files you trust")
    parser.add_argument("--seed", type=seed, default=0,
                        help="torch seed of the model's random init when no --weights are given (default 0)")
    parser.add_argument("--input-shape", default=None, help="input shape without batch, e.g. 3,224,224")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--backend", default=None, choices=["torch", "numpy"], help="computation backend")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars and no notes on stderr")


def progress(args):
    """The ``progress`` argument of the library calls: off with --quiet, else on when stderr is a terminal."""
    return False if getattr(args, "quiet", False) else None


def note(args, text: str) -> None:
    """One line on stderr, unless --quiet."""
    if not getattr(args, "quiet", False):
        print(f"pathir {args.command}: {text}", file=sys.stderr)


def model_info(args) -> dict:
    """Where the weights came from, for the JSON output: the --weights file, or the seed of a random init."""
    if is_onnx_spec(args.model):
        return {"weights": args.model, "seed": None}
    return {"weights": args.weights, "seed": None if args.weights else args.seed}


def is_onnx_spec(spec: str) -> bool:
    """An .onnx path, or an existing file with another suffix (not a .py file: a module is MODULE:FACTORY; and
    not a bare name, which a stray file of that name would take from torchvision's model of that name)."""
    if spec.endswith(".py"):
        raise ArgumentError(f"'{spec}' is a Python file: MODEL takes its module and factory, "
                            f"{os.path.splitext(os.path.basename(spec))[0]}:FACTORY (run from its folder)")
    return spec.endswith(".onnx") or (os.path.isfile(spec) and os.path.splitext(spec)[1] != "")


def default_input_shape(name: str):
    """The usual input size of a torchvision classification model."""
    if name.startswith("inception") or name.startswith("googlenet_"):
        return (3, 299, 299)
    return (3, 224, 224)


def load_model(spec: str, seed: int = 0):
    """(model, name) for a torchvision name, ``package.module:factory`` or an .onnx path; a torch
    model is built under ``torch.manual_seed(seed)`` (its random init is reproducible) and put in eval mode."""
    if is_onnx_spec(spec):
        if not os.path.exists(spec):
            raise FileNotFoundError(f"no such file: {spec}")
        return spec, os.path.basename(spec)
    import torch

    with torch.random.fork_rng(devices=[]):  # the caller's own random stream is left where it was
        torch.manual_seed(seed)
        model, name = _build(spec)
    if hasattr(model, "eval"):
        model.eval()  # pathir analyses the eval-mode function; this silences the train-mode batch-norm warning
    return model, name


def _build(spec: str):
    if ":" in spec:
        mod_name, _, attr = spec.partition(":")
        if mod_name.endswith(".py"):  # (imported as the module 'X.py', it would run X's top level first, then fail)
            module_of = os.path.splitext(os.path.basename(mod_name))[0]
            raise ArgumentError(f"'{spec}': MODEL takes a module, not a file: {module_of}:{attr} (run from the folder "
                                f"of {os.path.basename(mod_name)}, or give its dotted package path)")
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(mod_name)
        except Exception as err:  # a SyntaxError in it, an import it makes, what its top level raises
            raise ArgumentError(f"cannot import '{mod_name}' for '{spec}': {type(err).__name__}: {err}") from None
        try:
            factory = getattr(module, attr)
        except AttributeError as err:
            raise ArgumentError(f"cannot load '{spec}': {err}") from None
        import torch

        try:
            model = factory if isinstance(factory, torch.nn.Module) else factory() if callable(factory) else factory
        except Exception as err:  # a class that needs arguments, a factory that raises
            raise ArgumentError(f"'{spec}': calling {attr}() with no arguments raised {type(err).__name__}: {err} "
                                "(MODEL names a factory or a class pathir calls with none)") from None
        if not isinstance(model, torch.nn.Module):
            raise ArgumentError(f"'{spec}' gave a {type(model).__name__}, not a torch.nn.Module")
        return model, spec
    import torchvision

    try:
        builder = torchvision.models.get_model_builder(spec)
    except ValueError:
        raise ArgumentError(f"'{spec}' is neither a torchvision model name, a module:factory path nor an .onnx file") from None
    return builder(weights=None), spec


def prepare_model(args, default_shape=None):
    """(model, name, input shape): the MODEL argument built, --weights loaded (or the random init
    announced once on stderr), the input shape from --input-shape, else ``default_shape``, else the
    model's usual one (None for an .onnx file without --input-shape: it carries its own)."""

    model, name = load_model(args.model, args.seed)
    if isinstance(model, str):
        if args.weights:
            raise ArgumentError("--weights applies to torch models; an .onnx file carries its own weights")
        if getattr(args, "trust_pickle", False):
            raise ArgumentError("--trust-pickle applies to --weights of a torch model; an .onnx file is no pickle")
    elif args.weights:
        load_weights(model, args.weights, getattr(args, "trust_pickle", False))
    elif ":" in args.model:
        note(args, f"no --weights given: the weights are those {name} made under torch.manual_seed({args.seed}) "
                   "(--seed N picks another seed, --weights PATH loads a checkpoint)")
    else:
        note(args, f"no --weights given: {name} has random initial weights (seed {args.seed}; --seed N picks "
                   "another, --weights PATH loads a checkpoint)")
    shape = parse_shape(args.input_shape)
    if shape is None and default_shape is not None:
        shape = tuple(default_shape)
    if shape is None and not isinstance(model, str):
        shape = default_input_shape(name)
    return model, name, shape


def compile_model(args):
    model, name, shape = prepare_model(args)
    cm = pathir.compile(model, input_shape=shape, backend=args.backend, progress=progress(args))
    cm.name = name
    return cm


def emit_json(obj) -> None:
    """``obj`` as strict JSON on stdout: a float beyond float64 or not a number is written as the string
    "inf", "-inf" or "nan" (JSON has no such numbers; Python's ``Infinity`` breaks other readers)."""
    json.dump(_strict(obj), sys.stdout, indent=2, allow_nan=False)
    sys.stdout.write("\n")


def _strict(value):
    if hasattr(value, "tolist"):  # numpy arrays and scalars, torch tensors
        value = value.tolist()
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return float(value)


def check_output_path(path: str, onnx_model: bool, inputs=()) -> None:
    """ArgumentError (or FileNotFoundError) for an output path the command cannot or must not write: the
    wrong suffix, a folder, a missing or read-only folder, or one of ``inputs`` (the model file, the
    --weights file: pathir never writes over what it read)."""
    want = ".onnx" if onnx_model else ".pt"
    if os.path.isdir(path):
        raise ArgumentError(f"output path is a folder: '{path}' (name the file to write)")
    if not path.endswith(want) and not (not onnx_model and path.endswith(".pth")):
        raise ArgumentError(f"output for {'an ONNX' if onnx_model else 'a torch'} model must be a {want} file, got '{path}'")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"output folder does not exist: {folder}")
    try:  # a file made and removed: the permission bits alone pass for root where the file system refuses
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".pathir-probe.")
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        raise ArgumentError(f"output folder is not writable: {folder} ({err.strerror})") from None
    for source in inputs:
        if source and same_file(path, source):
            raise ArgumentError(f"output '{path}' is the input file '{source}': pathir never writes over what it read; "
                                "name another file")


def save_state_dict(model, path: str) -> None:
    import torch
    from torch.nn.utils import prune as torch_prune


    for module in model.modules():  # make the masks permanent: plain tensors with zeros
        for hook in list(module._forward_pre_hooks.values()):
            if isinstance(hook, torch_prune.BasePruningMethod):
                torch_prune.remove(module, hook._tensor_name)
    state = model.state_dict()
    write_atomic(path, lambda f: torch.save(state, f))


def save_module(model, path: str) -> None:
    """``torch.save(model)``, the whole module (classes by reference, read back with
    ``torch.load(path, weights_only=False)``); PathirError, nothing written, if it cannot be pickled."""
    import pickle

    import torch

    try:
        write_atomic(path, lambda f: torch.save(model, f))
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise PathirError(f"the model cannot be pickled whole ({type(err).__name__}: {err}), and a state_dict would "
                          "not load into a fresh instance (pathir replaced some of its modules): rescale it with the "
                          "Python API (docs/equalize.md) and save it your way. Nothing was written") from None


def read_inputs(path: str, mmap: bool, keyed: bool = False):
    """The samples array of --inputs (.npy, or an .npz holding one array; with ``keyed``, an .npz of several arrays
    is {input name: array}); ArgumentError for anything else."""
    try:
        x = np.load(path, mmap_mode="r" if mmap else None)
    except (OSError, ValueError, EOFError) as err:
        raise ArgumentError(f"--inputs {path}: not a .npy array numpy can read ({type(err).__name__}: {err})") from None
    if isinstance(x, np.lib.npyio.NpzFile):
        if keyed and len(x.files) > 1:
            return {name: x[name] for name in x.files}
        if len(x.files) != 1:
            raise ArgumentError(f"--inputs {path}: an .npz of {len(x.files)} arrays ({', '.join(x.files)}); pass a .npy "
                                "or an .npz holding one array")
        x = x[x.files[0]]
    return x
