"""What a graph's rescaling structure costs to find, found once per graph.

A :class:`GraphFacts` is the record a Compiled keeps for its current graph: the
units (``find_units``), B with the parameter layout (``incidence``), B's row
keys (``row_keys``) and its compact row ends (``row_ends``), each built on first use. The record belongs to one graph
object: a new graph gets a new record (:meth:`GraphFacts.with_values` carries the
structure over to a graph that differs only in its params' values: a rescaling, a re-read model).
"""

from __future__ import annotations

import dataclasses
from functools import cached_property

import numpy as np

from pathir.analyses.find_units import find_units
from pathir.analyses.incidence import ParamLayout, incidence, row_ends, row_keys
from pathir.errors import PathirError
from pathir.ir import Graph

__all__ = ["GraphFacts"]


def _normal_or_zero(value: np.ndarray, tiny: float, chunk: int = 1 << 20) -> bool:
    """Every entry finite and either 0 or of magnitude >= ``tiny``: a block of ``chunk`` entries at a time, into one
    reused buffer (no temporary of the param's size: on a 100M-entry layer, 4x faster than whole-array masks)."""
    flat = value.reshape(-1)
    buffer = np.empty(min(chunk, flat.size))
    for i in range(0, flat.size, chunk):
        part = buffer[:min(chunk, flat.size - i)]
        np.abs(flat[i:i + chunk], out=part)
        if not part.max() < np.inf:  # NaN or ±inf
            return False
        if np.count_nonzero(part < tiny) != np.count_nonzero(part == 0):  # a subnormal
            return False
    return True


class GraphFacts:
    """Units, B and row keys of one graph, each computed at most once.

    >>> from pathir.ir import GraphBuilder, Dense
    >>> b = GraphBuilder()
    >>> x = b.input("x", (2,))
    >>> h = b.relu("h", [(x, Dense(b.param("w1", [[1.0, 2.0]])))])
    >>> facts = GraphFacts(b.build(outputs=[b.identity("y", [(h, Dense(b.param("w2", [[3.0]])))])]))
    >>> len(facts.units), facts.incidence[0].shape, facts.row_keys.key.tolist()
    (1, (3, 1), [1, 1, 2])
    """

    def __init__(self, graph: Graph):
        self.graph = graph
        self._finite = False  # every param checked finite (check_finite)

    def check_finite(self, passes: tuple[str, ...] = ()) -> None:
        """PathirError naming the first param of the graph with a NaN or infinite entry (a NaN bias was dropped
        by some walks: a finite, wrong path-norm), or a subnormal one (0 < |θ| < 2.2e-308: the walks count
        subnormals as 0, and a product with one keeps few of its digits); checked once per graph. ``passes``:
        the user passes that changed the params (run unverified, they may have written the entry)."""

        if self._finite:
            return
        tiny = np.finfo(np.float64).tiny
        for p in self.graph.params():
            value = np.asarray(p.value)
            if _normal_or_zero(value, tiny):
                continue
            magnitude = np.abs(value)  # (a param with a bad entry: found and described whole)
            bad = ~(magnitude < np.inf)  # NaN or ±inf
            if bad.any():
                k = int(np.flatnonzero(bad.reshape(-1))[0])
                made = f"made as {p.how}" if p.how else f"from {p.source_name}"
                raise PathirError(f"param '{p.name}' ({made}) has {int(bad.sum())} NaN or infinite "
                                  f"entries (the first: {value.reshape(-1)[k]} at flat index {k}): no path-norm, "
                                  "rescaling or bound is a number there; fix the model's tensors" + (
                                      f", or the pass that wrote them ({', '.join(map(repr, passes))} changed the "
                                      "params, unverified)" if passes else ""))
            small = (magnitude < tiny) & (magnitude > 0)
            if small.any():
                k = int(np.flatnonzero(small.reshape(-1))[0])
                raise PathirError(f"param '{p.name}' (from {p.source_name}) has {int(small.sum())} subnormal float64 "
                                  f"entries (the first: {value.reshape(-1)[k]:.3g} at flat index {k}; below 2.2e-308, "
                                  "where float64 keeps only some of a number's digits): pathir's walks, which count "
                                  "them as 0, would drop their paths. Set them to 0, or scale the layer (and the next "
                                  "one inversely) into float64's normal range")
        self._finite = True

    @cached_property
    def units(self):
        """``pathir.analyses.find_units.Units`` of the graph (docs/math.md §5)."""

        return find_units(self.graph)[1]

    @cached_property
    def incidence(self):
        """(B, layout): the sparse n × H matrix B and the ParamLayout of θ (do not modify B)."""

        return incidence(self.graph, self.units)

    @cached_property
    def row_keys(self):
        """B's rows as a ``pathir.analyses.unit_rows.RowKeys``, read from the units (no B built)."""

        return row_keys(self.units)

    @cached_property
    def row_ends(self):
        """B's rows as a ``pathir.analyses.unit_rows.CompactRows`` (the units' compact row ends per
        param): what the newton and block solvers read, far smaller than the row keys."""

        return row_ends(self.units)

    def with_values(self, graph: Graph) -> "GraphFacts":
        """The record of ``graph``, this graph with new param values (same structure, same
        param names and shapes): what was built here carries over, nothing new is built."""

        new = GraphFacts(graph)
        if "units" in self.__dict__:
            params = tuple(graph.params())
            new.units = dataclasses.replace(self.units, params=params, graph=graph)  # (not the old graph's values)
            if "names" in self.units.__dict__:  # made already: the same structure, the same names
                new.units.__dict__["names"] = self.units.names
            if "incidence" in self.__dict__:
                new.incidence = (self.incidence[0], ParamLayout(params))
        for name in ("row_keys", "row_ends"):
            if name in self.__dict__:
                setattr(new, name, getattr(self, name))
        return new

    def built(self) -> tuple[str, ...]:
        """The names of what this record holds so far (for ``release`` and tests)."""
        return tuple(k for k in ("units", "incidence", "row_keys", "row_ends") if k in self.__dict__)
