"""Inputs a user passes to a method that runs the graph on them (``equalize(inputs=...)``), read as the
graph's inputs: one array per graph input, float64, shape-checked."""

from __future__ import annotations

import numpy as np

from pathir.errors import InputShapeError
from pathir.ir.graph import Graph

__all__ = ["graph_inputs", "refuse_unreadable", "tensor_float64"]


def tensor_float64(t) -> np.ndarray:
    """A torch tensor's values as a float64 numpy array on the CPU (detached; a lazily negated view resolved:
    numpy would read its storage, not its values)."""
    return t.detach().cpu().double().resolve_neg().numpy()


def graph_inputs(graph: Graph, inputs) -> dict | None:
    """``inputs`` as {graph input name: float64 array}, each checked against its input's shape
    (InputShapeError, as the graph's forward raises it). Accepted: one array or tensor (a graph of one
    input), a dict by input name, or a tuple of arrays (a list, for several inputs) in the graph's input
    order, the model's argument order."""
    if inputs is None:
        return None
    names = list(graph.inputs)
    positional = (isinstance(inputs, (tuple, list)) and all(hasattr(a, "shape") for a in inputs)
                  and (isinstance(inputs, tuple) or len(names) > 1))  # a list of rows stays one array
    if isinstance(inputs, dict):
        missing = [n for n in names if n not in inputs]
        if missing:
            raise InputShapeError(f"x: the graph has inputs {names}: the dict {{input name: array}} lacks {missing}")
        feed = {n: inputs[n] for n in names}
    elif positional:
        if len(inputs) != len(names):
            raise InputShapeError(f"x: the graph has inputs {names}: pass {len(names)} arrays in that order (or a "
                                  f"dict {{input name: array}}), got {len(inputs)}")
        feed = dict(zip(names, inputs))
    elif len(names) != 1:
        raise InputShapeError(f"x: the graph has inputs {names}: pass a dict {{input name: array}} or a tuple of "
                              "arrays in that order")
    else:
        feed = {names[0]: inputs}
    out = {}
    for name, x in feed.items():
        refuse_unreadable(name, x)
        try:
            x = tensor_float64(x) if hasattr(x, "detach") else np.asarray(x, dtype=np.float64)
        except (TypeError, ValueError) as err:
            raise InputShapeError(f"x: input '{name}' is not an array of numbers ({err})") from None
        shape = graph.node(name).shape
        if x.ndim < 1 or tuple(x.shape[1:]) != tuple(shape) or x.shape[0] == 0:
            raise InputShapeError(f"x: input '{name}' expects (B, {', '.join(map(str, shape))}), got {tuple(x.shape)}"
                                  + (": an empty batch (B must be at least 1)" if x.ndim and not x.shape[0] else ""))
        if not np.isfinite(x).all():
            raise InputShapeError(f"x: input '{name}' holds NaN or infinite entries: the network's output, and any "
                                  "bound scaled by max(‖x‖∞, 1), is not a number there; pass finite inputs")
        out[name] = x
    return out


def refuse_unreadable(name: str, x, objects: bool = False) -> None:
    """InputShapeError where the array or tensor ``x`` fed to input ``name`` cannot be read as float64 exactly:
    complex (a conversion would drop its imaginary part, and the model itself refuses such an input), entries
    that are not numbers (an object or string array; ``objects=True`` lets object arrays through: the sympy
    backend's exact numbers), or numpy's extended precision (longdouble, rounded to float64 unseen; no torch
    model takes it)."""
    if not hasattr(x, "dtype"):  # a list (of lists): as numpy reads it
        try:
            x = np.asarray(x)
        except (TypeError, ValueError, RuntimeError) as err:  # (ragged; tensors that require grad)
            raise InputShapeError(f"x: input '{name}' is a list numpy cannot read as one array of numbers ({err}); "
                                  "pass one array or tensor") from None
    if getattr(x, "is_meta", False):
        raise InputShapeError(f"x: input '{name}' is a tensor on the meta device, which holds shapes and no values")
    if x.is_complex() if hasattr(x, "is_complex") else np.iscomplexobj(x):
        raise InputShapeError(f"x: input '{name}' is complex; the network's inputs are real (pass its real part if "
                              "that is what you mean)")
    dtype = x.dtype
    if not isinstance(dtype, np.dtype):
        return  # a torch tensor: its dtypes are numbers
    if dtype.kind not in ("biufO" if objects else "biuf"):
        raise InputShapeError(f"x: input '{name}' is an array of {dtype} entries (Python objects, strings, dates), not "
                              "of float64 numbers; pass a float array (np.asarray(x, dtype=np.float64) where its entries "
                              "are numbers)")
    if dtype.kind == "f" and dtype.itemsize > 8:
        raise InputShapeError(f"x: input '{name}' is {dtype} (extended precision): pathir computes in float64 and no "
                              "torch model takes it, so its entries would be rounded unseen; pass x.astype(np.float64)")
