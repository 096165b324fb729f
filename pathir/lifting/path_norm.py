"""Path-norms and path counts (docs/math.md §3) through the log-scaled path walk."""

from __future__ import annotations

import math
import numbers
from typing import Iterable

import numpy as np

from pathir.errors import ArgumentError, ArgumentTypeError, PathNormOverflow
from pathir.ir import Graph
from pathir.lifting.log_walk import log_forward, log_grand_total
from pathir.lifting.ones_walk import ones_forward, ones_forwards, ones_log_total
from pathir.lifting.scaled import Certifier, Uncertified, robust_log_path_sum
from pathir.lifting.walk import log_total, path_forward
from pathir.passes import maxpool_to_sum, path_view

__all__ = ["log_path_sum", "log_max_path", "path_norm", "num_paths", "check_q"]


def log_path_sum(graph: Graph, q: float, backend) -> float:
    """Natural log of sum_p |Phi_p(theta)|^q (q = 0: of the number of paths); -inf if zero.

    The fast walk on |w|^q, certified node by node (on a backend that can gather, with feature
    maps stored along their constant runs: pathir.lifting.ones_walk); where it cannot be (|w|^q or a node's
    channels beyond float64), the walk with per-channel log-scales (pathir.lifting.scaled)."""
    try:
        if hasattr(backend, "power_view"):  # the path view, lazily on the backend's device
            view = backend.power_view(q)
            if hasattr(view, "take"):  # feature maps stored along their constant runs
                return ones_log_total(view, ones_forward(graph, view, linearize=True, keep="outputs"), graph.outputs)
            return log_total(backend, path_forward(graph, view, linearize=True), graph.outputs)
        with np.errstate(over="ignore", under="ignore"):  # out of range: the walk refuses to certify
            view = path_view(maxpool_to_sum(graph), q)
        return log_total(backend, path_forward(view, backend, certify=Certifier(graph, q == 0, backend)), view.outputs)
    except Uncertified:
        return robust_log_path_sum(graph, backend, q)


def log_max_path(graph: Graph) -> float:
    """log max_p |Φ_p(θ)| (-inf if every path is 0): the longest path in log|θ|, a max-pool read
    as the sum of its window, exactly (pathir.lifting.log_walk with max-plus steps)."""

    return log_grand_total(log_forward(graph, math.inf), graph.outputs, math.inf)


def check_q(q, what: str = "path_norm") -> float:
    """``q`` as a float if it is a number > 0 (math.inf included), else ArgumentError naming it."""
    if isinstance(q, bool) or not isinstance(q, numbers.Real):
        raise ArgumentTypeError(f"{what}: q must be a number > 0 (math.inf for the max over paths), got {q!r}")
    if not q > 0:  # NaN too
        raise ArgumentError(f"{what}: q must be > 0 (math.inf for the max over paths), got {q!r}")
    return float(q)


def _finish(log_value: float, log10: bool, what: str) -> float:
    if log10:
        return log_value / math.log(10)
    if log_value > math.log(1.7976931348623157e308):
        raise PathNormOverflow(f"{what} is about 10^{log_value / math.log(10):.1f}, beyond float64: ask for log10=True")
    return math.exp(log_value)


def path_norm(graph: Graph, q: float, backend, log10: bool = False) -> float:
    """||Phi(theta)||_q = (sum_p |Phi_p|^q)^(1/q), q > 0; q = inf: max_p |Phi_p| (docs/math.md §3);
    its log10 with ``log10``. Exact in log scale for every q and every representative of θ."""
    q = check_q(q)
    if q == math.inf:
        return _finish(log_max_path(graph), log10, "the l-inf path-norm")
    return _finish(log_path_sum(graph, q, backend) / q, log10, f"the l{q:g} path-norm")


#: below this, the count from the float walk is rounded to the exact integer
EXACT_COUNT_LIMIT = 1e12


def num_paths(graph: Graph, backend, log10: bool = False) -> float:
    """Number of paths of the DAG (docs/math.md §2: every input-to-output path and every bias path).

    Below 1e12 the result is the exact integer (the walk's relative error is ~1e-15)."""
    value = _finish(log_path_sum(graph, 0, backend), log10, "the number of paths")
    return float(round(value)) if not log10 and value < EXACT_COUNT_LIMIT else value


def _log_path_sums(graph: Graph, qs: list[float], backend) -> dict[float, float]:
    """{q: log_path_sum(graph, q)} of the all-ones walks of every q in step (a large dense weight
    read once for all); {} where the backend has no such walk or one q cannot be certified (each
    q then walks on its own, with its fallbacks)."""
    if len(qs) < 2 or not hasattr(backend, "power_view"):
        return {}
    views = [backend.power_view(q) for q in qs]
    if not all(hasattr(v, "take") for v in views):
        return {}
    try:
        walks = ones_forwards(graph, views, linearize=True, keep="outputs")
    except Uncertified:
        return {}
    return {q: ones_log_total(v, w, graph.outputs) for q, v, w in zip(qs, views, walks)}


def path_norms(graph: Graph, qs: Iterable[float], backend, log10: bool = False) -> dict[float, float]:
    """{q: path_norm(graph, q)} for each q in ``qs`` (each checked first), the finite ones walked in step."""
    qs = list(qs)
    finite = sorted({check_q(q) for q in qs} - {math.inf})
    logs = _log_path_sums(graph, finite, backend)
    return {q: _finish(logs[float(q)] / float(q), log10, f"the l{float(q):g} path-norm") if float(q) in logs
            else path_norm(graph, q, backend, log10) for q in qs}
