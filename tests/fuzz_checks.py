"""Checks the frontend fuzzers share (tests/test_fuzz_frontends.py, tests/test_fuzz_onnx_graphs.py)."""

import contextlib

import pathir
from pathir.errors import PathirError


def equalized(cm) -> bool:
    """Equalize ``cm`` at 6 bits in place (its model written back); False where the graph has no dense
    or conv weight to quantize, the one refusal a graph pathir compiled may meet here."""
    try:
        with contextlib.suppress(pathir.NotConvergedWarning):
            cm.equalize(bits=6, progress=False)
    except PathirError as err:
        if "nothing to equalize" not in str(err):
            raise
        return False
    return True
