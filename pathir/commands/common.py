"""Helpers shared by the CLI commands: loading a MODEL argument, JSON output."""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile

__all__ = ["add_model_arguments", "load_model", "compile_model", "emit_json", "parse_shape"]


def parse_shape(text: str | None):
    if not text:
        return None
    try:
        return tuple(int(s) for s in text.replace("x", ",").split(",") if s.strip())
    except ValueError:
        raise ValueError(f"--input-shape must look like 3,224,224, got '{text}'") from None


def add_model_arguments(parser):
    parser.add_argument("model", help="a torchvision model name (resnet18), a path module:factory, or an .onnx file")
    parser.add_argument("--input-shape", default=None, help="input shape without batch, e.g. 3,224,224")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--backend", default=None, choices=["torch", "numpy"], help="computation backend")


def default_input_shape(name: str):
    """The usual input size of a torchvision classification model."""
    if name.startswith("inception") or name.startswith("googlenet_"):
        return (3, 299, 299)
    return (3, 224, 224)


def load_model(spec: str):
    """(model, name) for a torchvision name, ``package.module:factory`` or an .onnx path."""
    if spec.endswith(".onnx") or os.path.exists(spec):
        if not os.path.exists(spec):
            raise FileNotFoundError(f"no such file: {spec}")
        return spec, os.path.basename(spec)
    if ":" in spec:
        mod_name, _, attr = spec.partition(":")
        sys.path.insert(0, os.getcwd())
        try:
            factory = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"cannot load '{spec}': {err}") from None
        model = factory() if callable(factory) and not hasattr(factory, "forward") else factory
        return model, spec
    import torchvision

    try:
        builder = torchvision.models.get_model_builder(spec)
    except ValueError:
        raise ValueError(f"'{spec}' is neither a torchvision model name, a module:factory path nor an .onnx file") from None
    return builder(weights=None), spec


def compile_model(args):
    import pathir

    model, name = load_model(args.model)
    shape = parse_shape(args.input_shape)
    if shape is None and not isinstance(model, str):
        shape = default_input_shape(name)
    cm = pathir.compile(model, input_shape=shape, backend=args.backend)
    cm.name = name
    return cm


def emit_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, default=float)
    sys.stdout.write("\n")


def check_output_path(path: str, onnx_model: bool) -> None:
    want = ".onnx" if onnx_model else ".pt"
    if not path.endswith(want) and not (not onnx_model and path.endswith(".pth")):
        raise ValueError(f"output for {'an ONNX' if onnx_model else 'a torch'} model must be a {want} file, got '{path}'")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"output folder does not exist: {folder}")


def save_state_dict(model, path: str) -> None:
    import torch
    from torch.nn.utils import prune as torch_prune

    for module in model.modules():  # make the masks permanent: plain tensors with zeros
        for hook in list(module._forward_pre_hooks.values()):
            if isinstance(hook, torch_prune.BasePruningMethod):
                torch_prune.remove(module, hook._tensor_name)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(model.state_dict(), f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
