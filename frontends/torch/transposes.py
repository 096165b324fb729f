"""A 2-d weight read transposed in the forward (``W.t()``, ``W.T``, ``mT``, ``transpose``, ``permute``, ``swapaxes``,
``swapdims``, ``adjoint``, ``torch.t``, their ATen ops): a :class:`~..core.values.ParamTensor` marked ``transposed``,
which only the dense-layer rules read (``matmul``, ``addmm``, ``linear``: ``reads_transposed``); ``invoke`` refuses it
for every other rule, naming the parameter and the op."""

from __future__ import annotations

import torch

from pathir.frontends.core.values import ParamTensor

__all__ = ["transposed_param", "transposed", "is_transpose", "TRANSPOSE_FUNCTIONS", "TRANSPOSE_METHODS",
           "TRANSPOSE_ATTRIBUTES"]


def transposed_param(p: ParamTensor, op: str = "") -> str:
    then = f" and then {op} reads it" if op else ""
    return (f"transposes the parameter '{p.name}' in the forward{then}: a transposed weight is read only as the "
            "matrix of a dense layer (x @ W.T or W.T @ x, torch.matmul / torch.mm / torch.addmm, F.linear); elsewhere write "
            "x @ W.T as F.linear(x, W) (W of shape (out, in)), or keep W of shape (in, out) and write x @ W")


#: the torch functions and ATen ops that transpose a 2-d tensor (given the two axes, where they take any)
_aten = torch.ops.aten
TRANSPOSE_FUNCTIONS = frozenset({torch.t, torch.transpose, torch.permute, torch.swapaxes, torch.swapdims, torch.adjoint,
                                 _aten.t.default, _aten.transpose.int, _aten.permute.default, _aten.swapaxes.default,
                                 _aten.swapdims.default, _aten.numpy_T.default, _aten.mT.default, _aten.mH.default,
                                 _aten.adjoint.default, _aten.matrix_H.default})


def is_transpose(fn) -> bool:
    """Whether the function or ATen op ``fn`` is one of :data:`TRANSPOSE_FUNCTIONS`."""
    try:
        return fn in TRANSPOSE_FUNCTIONS
    except TypeError:  # (an unhashable callable)
        return False


#: the tensor methods and attributes that do
TRANSPOSE_METHODS = frozenset({"t", "transpose", "permute", "swapaxes", "swapdims", "adjoint"})
TRANSPOSE_ATTRIBUTES = frozenset({"T", "mT", "H", "mH"})


#: the keyword names of the axes a transpose takes (torch.transpose, Tensor.permute, swapaxes, swapdims)
_AXIS_KEYWORDS = ("dim0", "dim1", "axis0", "axis1", "dims")
#: the transposes that take no axes: of a 2-d tensor, its two axes swapped (t, T and numpy_T of a vector: itself)
_WHOLE = frozenset({"t", "T", "numpy_T", "mT", "H", "mH", "adjoint", "matrix_H"})


def transposed(low, p: ParamTensor, op: str, *axes, **keywords) -> ParamTensor:
    """``p`` read through the transpose ``op`` (a method, function, ATen op or attribute name; ``axes`` and
    ``keywords``: the axes it was given): a 2-d real tensor with its two axes swapped, ``p`` itself where the op
    moves nothing (``t()`` of a vector, ``permute(0, 1)``, ``transpose(1, 1)``). Anything else is refused, naming
    the parameter."""
    t, name = p.tensor, op.split(".")[0]  # (an ATen op's overload name: "t.default")
    if t.is_complex():
        low.unsupported(f"{name} of the complex parameter '{p.name}'")
    unknown = [k for k in keywords if k not in _AXIS_KEYWORDS]
    if unknown:
        low.unsupported(f"{name} of the parameter '{p.name}' with the arguments {unknown}")
    given = list(axes) + [keywords[k] for k in _AXIS_KEYWORDS if k in keywords]
    dims = [int(a) for a in (given[0] if len(given) == 1 and isinstance(given[0], (tuple, list)) else given)]
    if name in _WHOLE and not dims and t.dim() <= 1 and name in ("t", "T", "numpy_T"):
        return p
    if t.dim() != 2 or (name in _WHOLE) != (not dims) or len(dims) not in (0, 2):
        low.unsupported(f"{name}{tuple(dims) if dims else ''} of the parameter '{p.name}' of shape {list(t.shape)}: "
                        "only a 2-d weight read transposed is lowered (as the matrix of a dense layer)")
    axes_after = [1, 0] if not dims else [d % 2 for d in dims] if name == "permute" else \
        ([1, 0] if dims[0] % 2 != dims[1] % 2 else [0, 1])
    if name == "permute" and sorted(axes_after) != [0, 1]:
        low.unsupported(f"permute{tuple(dims)} of the parameter '{p.name}': not a permutation of its two axes")
    if axes_after == [0, 1]:
        return p  # the identity
    return ParamTensor(p.name, p.tensor, p.kind, not p.transposed)
