"""Backends: numpy (reference), torch (CPU/CUDA fast path), sympy (symbolic checks)."""

from __future__ import annotations

from pathir.errors import ArgumentError

from .base import Backend
from .numpy import NumpyBackend

__all__ = ["get_backend", "available_backends"]


def available_backends() -> list[str]:
    out = ["numpy"]
    try:
        import torch  # noqa: F401

        out.insert(0, "torch")
    except ImportError:
        pass
    return out


def get_backend(name=None, device=None):
    """A backend by name ("torch", "numpy", "sympy"), or an already built Backend.
    Default: torch when importable (on ``device``, CPU by default), else numpy."""

    if isinstance(name, Backend):
        return name
    if name is None:
        name = available_backends()[0]
    if name == "numpy":
        return NumpyBackend()
    if name == "torch":
        from .torch import TorchBackend  # lazy: imports torch

        return TorchBackend(device=device)
    if name == "sympy":  # exact, slow, small graphs: never the default
        from .sympy import SympyBackend  # lazy: imports sympy

        return SympyBackend()
    raise ArgumentError(f"backend={name!r} is unknown; available: {available_backends()}")
