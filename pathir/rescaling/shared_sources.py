"""Source tensors a rescaling cannot write consistently: one batch-norm applied at two places,
folded into a layer at one and kept as a per-channel scale at the other.

A folded batch-norm's param (w·γ/σ on the layer's edge) takes the unit's factor through γ and β
(``Role.OUT_SCALE``) and keeps the running statistics as they are, so it lists none of them; a
kept one's scale param (γ/σ on its own edge) takes its input's factor through the statistics
(``Role.IN_STATS``: σ ← λσ). Where one γ serves both, the statistics the kept one moves change the
folded param too, which no per-role check sees (the folded param does not list them): the
write-back would change the function. Bias params are exempt: a kept batch-norm's bias
β − μγ/σ takes its factor through γ and β with μ and σ moving together (λ cancels).
"""

from __future__ import annotations

from pathir.errors import PathirError
from pathir.ir import Graph, Role

__all__ = ["check_batch_norm_uses"]


def check_batch_norm_uses(graph: Graph) -> None:
    """Raise PathirError if one ``OUT_SCALE`` source tensor (a batch-norm's γ or β) is reached by edge
    params that list different running statistics (``IN_STATS``): a batch-norm folded at one place
    and kept at another. Nothing is written either way."""
    on_edges = {id(e.map.weight) for n in graph.nodes for e in n.edges if e.map.weight is not None}
    seen: dict[str, dict[frozenset, str]] = {}
    for p in graph.params():
        if id(p) not in on_edges:
            continue
        stats = frozenset(r.name for r in p.sources if r.role is Role.IN_STATS)
        for r in p.sources:
            if r.role is Role.OUT_SCALE:
                seen.setdefault(r.name, {}).setdefault(stats, p.name)
    for name, uses in seen.items():
        if len(uses) > 1:
            folded = next(p for s, p in uses.items() if not s) if frozenset() in uses else None
            kept = next(p for s, p in uses.items() if s)
            where = f"folded into '{folded}' and kept as the scale '{kept}'" if folded else \
                f"kept at two places with different statistics ('{kept}', ...)"
            raise PathirError(
                f"write-back refused: batch-norm tensor '{name}' is used at two places, {where}: a rescaling "
                "moves the running statistics of the kept one, which the folded one also reads, so no written "
                "value keeps the function. Give each place its own batch-norm module (or tensors); the model is "
                "untouched")
