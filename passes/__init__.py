"""Built-in passes: plain Graph -> Graph functions, and the pass manager."""

from .fold_batchnorm import fold_batchnorm
from .manager import DEFAULT_PIPELINE, PASSES, Pass, run_passes
from .maxpool_to_sum import maxpool_to_sum
from .path_view import path_view

__all__ = ["fold_batchnorm", "maxpool_to_sum", "path_view", "run_passes", "PASSES", "DEFAULT_PIPELINE", "Pass"]
