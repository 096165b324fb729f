"""Path-norms and path counts (docs/math.md §3) through the log-scaled path walk."""

from __future__ import annotations

import math
from typing import Iterable

from pathir.errors import PathNormOverflow
from pathir.ir import Graph
from pathir.lifting.walk import log_total, path_forward
from pathir.passes import maxpool_to_sum, path_view

__all__ = ["log_path_sum", "path_norm", "num_paths"]


def log_path_sum(graph: Graph, q: float, backend) -> float:
    """Natural log of sum_p |Phi_p(theta)|^q (q = 0: of the number of paths); -inf if zero."""
    if hasattr(backend, "power_view"):  # the path view, lazily on the backend's device
        return log_total(backend, path_forward(graph, backend.power_view(q), linearize=True), graph.outputs)

    view = path_view(maxpool_to_sum(graph), q)
    return log_total(backend, path_forward(view, backend), view.outputs)


def _finish(log_value: float, log10: bool, what: str) -> float:
    if log10:
        return log_value / math.log(10)
    if log_value > math.log(1.7976931348623157e308):
        raise PathNormOverflow(f"{what} is about 10^{log_value / math.log(10):.1f}, beyond float64: ask for log10=True")
    return math.exp(log_value)


def path_norm(graph: Graph, q: float, backend, log10: bool = False) -> float:
    """||Phi(theta)||_q = (sum_p |Phi_p|^q)^(1/q), q > 0; its log10 with ``log10``."""
    if not q > 0:
        raise ValueError(f"path_norm needs q > 0, got {q}")
    return _finish(log_path_sum(graph, q, backend) / q, log10, f"the l{q:g} path-norm")


#: below this, the count from the float walk is rounded to the exact integer
EXACT_COUNT_LIMIT = 1e12


def num_paths(graph: Graph, backend, log10: bool = False) -> float:
    """Number of paths of the DAG (docs/math.md §2: every input-to-output path and every bias path).

    Below 1e12 the result is the exact integer (the walk's relative error is ~1e-15)."""
    value = _finish(log_path_sum(graph, 0, backend), log10, "the number of paths")
    return float(round(value)) if not log10 and value < EXACT_COUNT_LIMIT else value


def path_norms(graph: Graph, qs: Iterable[float], backend, log10: bool = False) -> dict[float, float]:
    return {q: path_norm(graph, q, backend, log10) for q in qs}
