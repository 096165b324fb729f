"""Φ-based quantities computed by walks of the graph on a backend.

The walk (:mod:`.walk`) runs the graph forward and backward with one rule per
map kind; path-norms and counts, diag G, the path-metric brackets and the
path-magnitude scores are short programs over it; at data, the same
walks run with an activation pattern frozen (:mod:`.pattern`, :mod:`.active`,
:mod:`.active_metric`). Every path walk is certified node by node; where it
cannot be (q in the hundreds, an extreme rescaling) the walk with per-channel
log-scales (:mod:`.scaled`) or the per-neuron log-space one (:mod:`.log_walk`,
also q = inf) answers instead. Everything here takes a
Graph and a backend and returns numbers; nothing touches a model.

The entry points live in their modules (``pathir.lifting.diag_g.diag_g``,
``pathir.lifting.path_metric.path_metric``, ...); this package re-exports
only names that do not shadow a module.
"""

from pathir.lifting.active import LocalAffine, active_path_counts, active_path_norm, local_affine
from pathir.lifting.active_metric import ActivePathMetric, active_path_metric
from pathir.lifting.diag_g import diag_g_flat
from pathir.lifting.path_metric import PathMetric, output_bound
from pathir.lifting.path_norm import num_paths, path_norms
from pathir.lifting.pruning import PruneReport, path_magnitude_scores, prune_graph, prune_masks
from pathir.lifting.walk import forward

__all__ = [
    "forward", "path_norms", "num_paths", "diag_g_flat",
    "PathMetric", "output_bound",
    "PruneReport", "path_magnitude_scores", "prune_masks", "prune_graph",
    "active_path_norm", "active_path_counts", "local_affine", "LocalAffine", "active_path_metric", "ActivePathMetric",
]
