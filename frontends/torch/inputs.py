"""What the torch frontend checks about the model and its input before lowering.

- :func:`input_shapes`: ``input_shape`` is one sample's shape without the batch
  axis: a tuple of ints, an int (a 1-d input, ``4`` is ``(4,)``), or a list of
  such shapes for a model with several tensor inputs; ``example_input`` is a
  batched tensor or a tuple of them.
- :func:`check_model`: uninitialized lazy modules and models on the meta device
  have no values to analyse.
- :func:`warn_train_batchnorm`: a model in train mode with batch-norm is analysed
  with the running statistics (inference), which a warning says.
- :func:`explain`: when lowering fails, run the model itself on zeros of the given
  shape; if the model rejects it too, the input shape is wrong and the error says so.

Every error is an ``InputShapeError`` / ``PathirError`` raised before the model
is touched.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import warnings
from typing import Sequence

import torch
import torch.nn as nn

from pathir.errors import InputShapeError, PathirError

__all__ = ["TOLERANCE", "input_shapes", "check_model", "warn_train_batchnorm", "explain", "model_dtype_device", "eval_forward", "hook_attrs",
           "output_tensors"]

#: how far (relative to max|output|) two forwards of one model on the same samples may differ by rounding alone,
#: by dtype name: the self-check's tolerance against the IR, and the eager batch probe's (frontends/torch/eager_writes.py)
TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}

_FORM = "input_shape is one sample's shape without the batch axis, e.g. (3, 224, 224) or (784,)"


def _size(d) -> int:
    """An integer size (int, numpy integer, a torch.Size entry); never a float, a bool or a string."""
    if isinstance(d, bool):
        raise TypeError(d)
    return operator.index(d)


def _shape(s) -> tuple[int, ...]:
    if isinstance(s, bool):
        raise InputShapeError(f"input_shape={s!r}: {_FORM}")
    try:
        shape = (_size(s),) if not hasattr(s, "__iter__") else tuple(_size(d) for d in s)
    except TypeError:
        raise InputShapeError(f"input_shape={s!r} is not a shape of integer sizes: {_FORM}") from None
    if not shape or any(d <= 0 for d in shape):
        raise InputShapeError(f"input_shape={s!r} has no or non-positive sizes: {_FORM}")
    return shape


def input_shapes(input_shape, example_input) -> list[tuple[int, ...]]:
    """One per-sample shape per tensor input."""
    if example_input is not None:
        xs = example_input if isinstance(example_input, (tuple, list)) else [example_input]
        if not xs or not all(isinstance(x, torch.Tensor) and x.dim() >= 2 for x in xs):
            raise InputShapeError("example_input must be a batched tensor (batch axis first) or a tuple of them")
        return [tuple(x.shape[1:]) for x in xs]
    if input_shape is None:
        raise InputShapeError("pathir.compile needs input_shape=(C, H, W) or example_input= for a torch model")
    if isinstance(input_shape, (list, tuple)) and input_shape and all(
            isinstance(s, (list, tuple, torch.Size)) for s in input_shape):
        return [_shape(s) for s in input_shape]
    return [_shape(input_shape)]


def check_model(model: nn.Module) -> None:
    """Refuse models whose tensors hold no values (lazy, meta) or no version counter (made under
    torch.inference_mode()) and TorchScript modules (their forward is TorchScript, which neither
    torch.fx nor torch.export reads)."""
    from torch.nn.modules.lazy import LazyModuleMixin

    for path, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule):
            raise PathirError(f"module '{path or type(model).__name__}' is a TorchScript module ({type(m).__name__}): "
                              "pathir captures Python nn.Modules; pass the module before torch.jit.script / "
                              "torch.jit.trace, or export it to ONNX and compile the ONNX file")

    from torch.export._unlift import _StatefulGraphModule

    if isinstance(model, _StatefulGraphModule):  # its train() and eval() raise: pathir switches modes to trace
        raise PathirError(f"{type(model).__name__} is a module made by torch.export(...).module(), which cannot "
                          "switch between train and eval mode: pass the original nn.Module")
    for path, m in model.named_modules():
        if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params():
            raise PathirError(f"module '{path or type(model).__name__}' ({type(m).__name__}) has uninitialized "
                              "parameters: run one forward pass on a sample input before pathir.compile")
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_meta:
            raise PathirError(f"tensor '{name}' is on the meta device (no values): materialize the model first, "
                              "e.g. model.to_empty(device='cpu') then load_state_dict(...)")
        if t.is_inference():
            raise PathirError(f"tensor '{name}' was made under torch.inference_mode(): such tensors keep no version "
                              "counter, so pathir can neither follow the model's changes nor write it back safely; "
                              "build or load the model outside inference_mode (torch.no_grad() is fine), or, outside it, "
                              "model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, "
                              "assign=True)")


def warn_train_batchnorm(model: nn.Module) -> None:
    """Warn where a batch-norm of the model is in train mode (its own flag, whatever the root's): pathir reads it
    on its running statistics, as in eval mode."""
    norms = [(path, m) for path, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    training = [path for path, m in norms if m.training]
    if training:
        name = type(model).__name__
        head = f"{name} is in train mode" if model.training and len(training) == len(norms) else \
            f"{len(training)} of {name}'s {len(norms)} batch-norms are in train mode (e.g. '{training[0]}')"
        warnings.warn(f"{head}: pathir analyses its batch-norms with their running (inference statistics), as in "
                      "eval mode; call model.eval() to silence this",
                      UserWarning, stacklevel=5)  # warn <- lower <- compile <- keeps_model <- caller


def explain(model: nn.Module, shapes, err: Exception, batch: int = 2, train: Sequence[str] = ()) -> None:
    """Raise InputShapeError if the model itself fails on zeros of ``shapes`` (``batch`` samples, the modules
    at ``train`` in train mode as in ``eval_forward``)."""
    dtype, device = model_dtype_device(model)
    try:
        with eval_forward(model, train), torch.no_grad():
            model(*[torch.zeros((batch, *s), dtype=dtype, device=device) for s in shapes])
    except Exception as model_err:  # the model's own verdict on this input
        first = str(model_err).strip().splitlines()[0] if str(model_err).strip() else type(model_err).__name__
        shown = shapes[0] if len(shapes) == 1 else shapes
        dtypes = sorted({str(t.dtype).replace("torch.", "") for t in list(model.parameters()) + list(model.buffers())
                         if t.is_floating_point()})
        hint = (f"its tensors are in {' and '.join(dtypes)}, and pathir feeds it {str(dtype).replace('torch.', '')}: "
                "run the whole model in one dtype" if len(dtypes) > 1 and _about_dtypes(first) else
                "an in-place op of its forward reads a view of the memory it writes (h[:, :-1] += h[:, 1:]), which "
                "torch refuses at this shape: write from a copy (.clone() the value)" if "single memory location" in first
                else _ARGUMENTS if _about_arguments(first) else f"where the shape is wrong, {_FORM}")
        raise InputShapeError(f"{type(model).__name__} itself fails on a batch of input_shape={shown} "
                              f"({type(model_err).__name__}: {first}): {hint}") from err


_ARGUMENTS = ("pathir calls forward with one tensor per entry of input_shape (forward(x), forward(x, y)); a forward "
              "that takes a dict or a tuple of tensors (batch['a'], x, y = batch) is compiled through a wrapper whose "
              "forward takes the tensors themselves: def forward(self, a, b): return model({'a': a, 'b': b})")


def _about_arguments(message: str) -> bool:
    """Whether torch's or Python's error ``message`` says the forward was called with other arguments than it
    reads (a count of positional arguments; a string key into a tensor; a tensor unpacked into names)."""
    return any(words in message for words in ("positional argument", "invalid data type 'str'", "values to unpack",
                                               "only integers, slices"))


def _about_dtypes(message: str) -> bool:
    """Whether torch's error ``message`` is about mixed dtypes ("Input type (float) and bias type (c10::Half)",
    "mat1 and mat2 must have the same dtype"), not about shapes."""
    return any(w in message for w in ("dtype", " type ", "type (", "scalar type", "Half", "BFloat16", "Double"))


def model_dtype_device(model):
    """The dtype and device of the model's first floating tensor (float32 on the CPU if none)."""
    for t in itertools.chain(model.parameters(), model.buffers()):  # (stops at the first)
        if t.is_floating_point():
            return t.dtype, t.device
    return torch.float32, torch.device("cpu")


@contextlib.contextmanager
def eval_forward(model, train: Sequence[str] = ()):
    """Eval mode for one forward, except that the modules at the paths ``train`` ("" the model
    itself) keep ``training = True`` (the ancestors of aux heads: train_branches.head_modes);
    afterwards every training flag is restored and so is
    every attribute a forward pre-hook assigns (pruning and weight/spectral-norm hooks
    recompute ``module.weight`` as a new tensor object: the same one stays in place)."""
    flags = [(m, m.training) for m in model.modules()]
    kept = [(m, name, getattr(m, name)) for m in model.modules() for name in hook_attrs(m) if hasattr(m, name)]
    try:
        model.train(False)
        for path in train:
            model.get_submodule(path).training = True
        yield
    finally:
        for m, flag in flags:
            m.training = flag
        for m, name, value in kept:
            setattr(m, name, value)


def hook_attrs(module) -> list[str]:
    names = []
    for hook in module._forward_pre_hooks.values():
        name = getattr(hook, "_tensor_name", None) or getattr(hook, "name", None)
        if isinstance(name, str):
            names.append(name)
    return names


def output_tensors(out) -> list:
    """The tensors of a model's output, in order: a tensor, or tuples, lists and dicts of them (other
    values skipped)."""
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in output_tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in output_tensors(o)]
    return []
