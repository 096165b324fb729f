"""pathir: ReLU networks with their rescaling symmetries factored out."""

from pathir.errors import (
    ArgumentError,
    ArgumentKeyError,
    ArgumentTypeError,
    BackendError,
    GraphTooLarge,
    GraphVerificationError,
    InputShapeError,
    MissingFile,
    ModelChanged,
    NotConvergedWarning,
    PassWroteInput,
    PathirError,
    PathirWarning,
    PathNormOverflow,
    SelfCheckFailed,
    UnsupportedOperation,
)

__version__ = "0.1.0"
from pathir.api import compile, equalize
from pathir.compiled import Compiled, Summary
from pathir.ir import Graph, GraphBuilder, verify
from pathir.lifting.active_metric import ActivePathMetric, active_path_metric
from pathir.lifting.path_metric import PathMetric, output_bound, path_metric
from pathir.observe import Observations, observe

__all__ = [
    "compile", "equalize", "Compiled", "Summary", "Graph", "GraphBuilder", "verify",
    "PathirError", "UnsupportedOperation", "GraphVerificationError", "GraphTooLarge",
    "PathNormOverflow", "BackendError", "ModelChanged", "SelfCheckFailed", "InputShapeError",
    "ArgumentError", "ArgumentTypeError", "ArgumentKeyError", "MissingFile", "PassWroteInput",
    "PathirWarning", "NotConvergedWarning",
    "path_metric", "output_bound", "PathMetric", "optim", "nn",
    "active_path_metric", "ActivePathMetric", "observe", "Observations", "PathNormPenalty",
]


def __getattr__(name):
    # pathir.integrations.optim and pathir.nn need torch: imported on first use, not with pathir
    if name in ("optim", "nn"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    if name == "PathNormPenalty":  # pathir.integrations.penalty needs torch: imported on first use
        import importlib

        return importlib.import_module(".integrations.penalty", __name__).PathNormPenalty
    raise AttributeError(f"module 'pathir' has no attribute '{name}'")
