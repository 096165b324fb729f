"""``--weights PATH``: a state_dict or a checkpoint loaded into the CLI's torch model.

Understood: a state_dict (a mapping of names to tensors); a checkpoint dict holding
one under ``state_dict`` or ``model`` (training scripts' usual layouts); a whole
pickled nn.Module, only with ``trust_pickle`` (unpickling runs code). Without
``trust_pickle`` the file is read with ``torch.load(weights_only=True)``. Keys
saved from ``nn.DataParallel`` (every key starting with ``module.``) are matched
without that prefix. Missing or unexpected keys and shape mismatches raise
:class:`WeightsError` naming them; the model is loaded only when all match.
"""

from __future__ import annotations

import os
import re

from pathir.errors import ArgumentError, MissingFile, PathirError

__all__ = ["WeightsError", "load_weights", "read_state_dict"]


class WeightsError(PathirError, ValueError):
    """A --weights file that cannot be read or does not fit the model."""


def _names(keys, limit: int = 6) -> str:
    keys = sorted(keys)
    more = f", ... ({len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _unreadable(path: str, message: str, trust_pickle: bool) -> str:
    """Why torch.load could not read ``path``, from its error ``message``: a pickled object beyond tensors
    (its class named, --trust-pickle offered), or not a file torch.save wrote."""
    pickled = re.search(r"Unsupported global: GLOBAL (\S+)", message)
    if pickled and not trust_pickle:
        return (f"{path} pickles objects beyond tensors (the first: {pickled.group(1)}); if it is a model from a "
                "source you trust, --trust-pickle loads it (unpickling runs code)")
    reason = re.sub(r"\x1b\[[0-9;]*m", "", message).strip()
    unpickler = re.search(r"WeightsUnpickler error:\s*(.+)", reason)
    reason = unpickler.group(1).strip().splitlines()[0] if unpickler else (reason.splitlines() or [""])[0]
    return f"cannot read {path} as a file torch.save wrote ({reason})" if reason else ""


def read_state_dict(path: str, trust_pickle: bool = False) -> dict:
    """The state_dict held by the file at ``path`` (see the module docstring)."""
    import torch

    if os.path.isdir(path):
        raise ArgumentError(f"--weights names a folder, not a file: {path} (name the checkpoint file in it)")
    if not os.path.isfile(path):
        raise MissingFile(f"no such weights file: {path}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except Exception as err:
        message = str(err) if not isinstance(err, KeyError) else ""  # (a KeyError's text is a bare key: "101")
        raise WeightsError(_unreadable(path, message, trust_pickle) or f"cannot read {path} as a file torch.save wrote "
                           f"({type(err).__name__} in torch.load: not a pickle or zip archive of tensors)") from None
    if isinstance(obj, torch.nn.Module):
        return obj.state_dict()
    if isinstance(obj, dict):
        for key in ("state_dict", "model"):
            inner = obj.get(key)
            if isinstance(inner, torch.nn.Module):
                return inner.state_dict()
            if isinstance(inner, dict):
                obj = inner
                break
        if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            return dict(obj)
    raise WeightsError(f"{path} holds a {type(obj).__name__} that is neither a state_dict, a checkpoint dict with "
                       "'state_dict' or 'model', nor an nn.Module")


def load_weights(model, path: str, trust_pickle: bool = False) -> None:
    """Load the weights at ``path`` into ``model`` (all keys must match; nothing loaded otherwise)."""
    state = read_state_dict(path, trust_pickle)
    expected = model.state_dict()
    if all(k.startswith("module.") for k in state) and not any(k.startswith("module.") for k in expected):
        state = {k[len("module."):]: v for k, v in state.items()}
    missing, unexpected = set(expected) - set(state), set(state) - set(expected)
    # a batch-norm loads a state_dict without its step counter (older checkpoints) as torch does: counted from 0
    missing = {k for k in missing if not (k.endswith(".num_batches_tracked") or k == "num_batches_tracked")}
    if missing or unexpected:
        parts = [f"missing keys: {_names(missing)}" if missing else "",
                 f"unexpected keys: {_names(unexpected)}" if unexpected else ""]
        raise WeightsError(f"{path} does not fit {type(model).__name__}: " + "; ".join(p for p in parts if p))
    wrong = [f"{k} {tuple(v.shape)} (model {tuple(expected[k].shape)})" for k, v in state.items()
             if tuple(v.shape) != tuple(expected[k].shape)]
    if wrong:
        raise WeightsError(f"{path} does not fit {type(model).__name__}: shapes differ for {_names(wrong, 4)}")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:  # (a step counter the checkpoint's own version says it should hold)
        raise WeightsError(f"{path} does not fit {type(model).__name__}: {err}") from None
