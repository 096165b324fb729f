"""The pass manager: run Graph -> Graph functions in order, verifying between them."""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from pathir.errors import GraphVerificationError
from pathir.ir import Graph, verify

from .fold_batchnorm import fold_batchnorm
from .maxpool_to_sum import maxpool_to_sum
from .path_view import path_view

__all__ = ["Pass", "PASSES", "run_passes", "DEFAULT_PIPELINE"]

Pass = Callable[[Graph], Graph]

#: Every built-in pass, by name (the registry users extend with their own).
PASSES: dict[str, Pass] = {
    "fold_batchnorm": fold_batchnorm,
    "maxpool_to_sum": maxpool_to_sum,
    "path_view": path_view,
}

#: What pathir.compile runs after lowering:
#:   fold_batchnorm  - inference batch-norms into the conv/linear before them (units = conv channels)
DEFAULT_PIPELINE: tuple[Pass, ...] = (fold_batchnorm,)


def _name(p: Pass) -> str:
    return getattr(p, "__name__", repr(p))


def run_passes(graph: Graph, passes: Iterable[Pass], check: bool = True) -> Graph:
    """Apply each pass in order; with ``check``, verify after each one and name
    the failing pass and those before it."""
    done: list[str] = []
    for p in passes:
        out = p(graph)
        if not isinstance(out, Graph):
            raise TypeError(f"pass '{_name(p)}' returned {type(out).__name__}, not a Graph")
        if check:
            try:
                verify(out)
            except GraphVerificationError as err:
                raise GraphVerificationError(f"in pass '{_name(p)}' after {done}: {err}") from None
        done.append(_name(p))
        graph = out
    return graph
