"""Analyses of a Graph: what a rescaling acts on (docs/math.md §5).

The rescaling units by union-find over the ties (:mod:`.find_units`), the
incidence matrix B and its rows as keys (:mod:`.incidence`, :mod:`.unit_rows`),
and the per-graph record of all of them, built on first use (:mod:`.facts`).
Each takes a Graph and returns its by-product; none changes the graph.
"""

from pathir.analyses.facts import GraphFacts
from pathir.analyses.unit_rows import RowKeys, canonical, keys_for

__all__ = ["GraphFacts", "RowKeys", "canonical", "keys_for"]
