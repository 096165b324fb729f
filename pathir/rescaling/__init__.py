"""Rescalings θ ← θ ⊙ exp(−Bz/2) (docs/math.md §5): applying z to a graph
(:mod:`.apply`), committing it to the source model in one transaction
(:mod:`.commit`), moving an optimizer's state with it (:mod:`.optimizer_state`),
and the largest log-scales a dtype can take (:mod:`.bounds`)."""

from pathir.rescaling.apply import log_scales, rescale_graph

__all__ = ["rescale_graph", "log_scales"]
