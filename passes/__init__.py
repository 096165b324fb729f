"""Built-in passes: plain Graph -> Graph functions, and the pass manager."""

from pathir.enorm.normalize import normalize

from .fold_batchnorm import fold_batchnorm
from .manager import DEFAULT_PIPELINE, PASSES, Pass, register, run_passes
from .maxpool_to_sum import maxpool_to_sum
from .path_view import path_view
from .remove_dead import remove_dead

__all__ = [
    "fold_batchnorm", "maxpool_to_sum", "normalize", "path_view", "remove_dead",
    "run_passes", "register", "PASSES", "DEFAULT_PIPELINE", "Pass",
]
