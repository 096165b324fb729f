"""Re-reading a lowered torch model's values into its graph, without tracing it again.

Every Param of the raw graph is made by a *recipe*: a pure function of named model
tensors returning a fresh float64 array (``f64(w)``; a batch-norm's
``gamma / sqrt(var + eps)``). The lowering computes each value by calling its recipe,
so calling it again on the model's current tensors gives, bit for bit, what a fresh
lowering would. :class:`Reread` keeps the raw graph's structure (params without
values: zero-size broadcasts) and the recipes; ``graph(model)`` is the raw graph of the
model as it is now, and the compile pipeline run on it is a fresh compile's graph.

It covers a change only where that is provably so (:meth:`Reread.covers`): every raw
param has a recipe whose inputs are the model's own named tensors, and every tensor
that moved is a recipe input and was never read any other way (a buffer the traced
program reads directly may be a fixed constant of the graph). Anything else (a moved
buffer no recipe reads, such as ``num_batches_tracked`` in train mode; a pruned or
hooked weight) is left to a full re-lowering.

A recipe that widens one tensor (``Lowering.widened``) is re-read into an array of the
lowering's :class:`ArrayPool`: the memory of the values two re-reads ago (or the compile's),
once nothing holds them, instead of fresh memory (a page fault per 4 KiB).
"""

from __future__ import annotations

import numpy as np

from pathir.errors import ModelChanged
from pathir.frontends.core.lowering import Recipe
from pathir.ir import Graph, Param

__all__ = ["Recipe", "Reread", "named_tensors"]


def named_tensors(model) -> dict:
    """Every parameter and buffer of ``model`` by name (shared ones under each name)."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


class Reread:
    """The raw graph's structure and one recipe per param: the model's values without tracing."""

    def __init__(self, raw: Graph, recipes: dict[str, Recipe], inputs: frozenset[str], pool=None):
        self.recipes, self.inputs = recipes, inputs
        self.pool = pool  # the lowering's ArrayPool the recipes widen into (its free blocks: ``drop_free``)
        # one read-only zero broadcast to each shape: a view of a writable base would be copied by Param (a whole
        # float64 copy of the model's parameters, all zeros, held by every live Compiled: memory review)
        zero = np.zeros(())
        zero.flags.writeable = False
        self.skeleton = raw.map_params(lambda p: Param(p.name, np.broadcast_to(zero, p.shape), p.sources, p.how))

    @classmethod
    def of(cls, model, raw: Graph, recipes: dict[str, Recipe], read: dict, direct_reads: set[str], pool=None):
        """The record of a lowering, or None where a param has no recipe or a recipe read a tensor
        that is not the model's own named tensor (a hook's or a parametrization's product).
        ``read``: name -> the tensor the lowering read; ``direct_reads``: tensors the traced program
        read by attribute (which may become fixed constants): these must never move."""
        named = named_tensors(model)
        if any(p.name not in recipes for p in raw.params()):
            return None
        inputs = {n for p in raw.params() for n in recipes[p.name].inputs}
        if any(named.get(n) is not read[n] for n in inputs):
            return None
        parameters = dict(model.named_parameters(remove_duplicate=False))
        loose = {n for n in direct_reads if n not in parameters}
        return cls(raw, recipes, frozenset(inputs - loose), pool)

    def covers(self, moved: set[str] | None) -> bool:
        """Whether the tensors that ``moved`` (None: unknown) are all recipe inputs."""
        return moved is not None and moved <= self.inputs

    def graph(self, model) -> Graph | None:
        """The raw graph of ``model``'s current tensors (same structure as at lowering); None if a
        recipe's tensor is gone (a weight reparametrized by pruning since: lower it again)."""
        named = named_tensors(model)
        if any(n not in named for r in self.recipes.values() for n in r.inputs):
            return None

        def value(p: Param) -> Param:
            r = self.recipes[p.name]
            v = r.make(*(named[n] for n in r.inputs))  # a widening recipe writes into the lowering's pool
            if v.shape != p.shape:
                raise ModelChanged(f"param '{p.name}': the model's tensors now give shape {v.shape}, expected "
                                   f"{p.shape}: compile it again with pathir.compile")
            return Param.adopt(p.name, v, p.sources, p.how)

        return self.skeleton.map_params(value)
