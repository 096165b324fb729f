"""pathir: ReLU networks with their rescaling symmetries factored out."""

from .errors import (
    BackendError,
    GraphTooLarge,
    GraphVerificationError,
    PathirError,
    PathNormOverflow,
    UnsupportedOperation,
)

__version__ = "0.1.0"
from .api import compile
from .compiled import Compiled, Summary
from .ir import Graph, GraphBuilder, verify

__all__ = [
    "compile", "Compiled", "Summary", "Graph", "GraphBuilder", "verify",
    "PathirError", "UnsupportedOperation", "GraphVerificationError", "GraphTooLarge",
    "PathNormOverflow", "BackendError",
]
