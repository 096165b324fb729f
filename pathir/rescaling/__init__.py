"""Rescalings θ ← θ ⊙ exp(−Bz/2): applying z to a graph, committing it to the
source model, and B's rows as unit keys and unit pairs (the solvers' input)."""

from pathir.rescaling.apply import log_scales, rescale_graph
from pathir.rescaling.unit_rows import RowKeys, canonical, keys_for

__all__ = ["rescale_graph", "log_scales", "RowKeys", "canonical", "keys_for"]
