"""After a rescaling is written into an ONNX model: onnxruntime computes with the new model what it
computed with the one before, on one seeded probe (the torch side: ``frontends/torch/function_kept.py``).

The ONNX write rules bind every initializer slot to the param that reads it, so a tensor shared with
a reader the graph does not see is rebound apart; this probe is the net under those rules, as the
torch writer's is under its own."""

from __future__ import annotations

import numpy as np

from pathir.errors import PathirError

__all__ = ["check_onnx_function", "probe_feeds"]

#: onnxruntime's input types the probe feeds
ORT_TYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16}
#: the largest output change a write may make, relative to max |output|: ten times the compile
#: self-check's tolerance per dtype
KEPT = {np.float64: 1e-8, np.float32: 1e-3, np.float16: 1e-1}


def probe_feeds(session, graph, batch: int = 1) -> dict | None:
    """{input: seeded random array} for every input of an onnxruntime ``session`` (``batch`` samples
    unless the model fixes its batch), shaped by ``graph``'s input nodes; None where an input is not
    one of the graph's or not a float type."""
    rng = np.random.default_rng(0)
    feeds = {}
    for inp in session.get_inputs():
        dtype = ORT_TYPES.get(inp.type)
        if inp.name not in graph.inputs or dtype is None:
            return None
        n = inp.shape[0] if isinstance(inp.shape[0], int) and inp.shape[0] > 0 else batch
        feeds[inp.name] = rng.normal(size=(n, *graph.node(inp.name).shape)).astype(dtype)
    return feeds


def check_onnx_function(before, after, graph) -> None:
    """PathirError where onnxruntime's outputs of model ``after`` moved from those of ``before`` (ModelProtos)
    by more than the dtype's tolerance on a seeded probe. Nothing is checked where onnxruntime cannot load
    or run the model (the compile self-check skipped it too)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return
    outputs = []
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_prepacking", "1")  # (no third copy of the weights)
    for model in (before, after):  # one session at a time: each holds a copy of the model's weights
        try:
            session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
            feeds = probe_feeds(session, graph)
            if feeds is None:
                return
            outputs.append([np.asarray(o, dtype=np.float64) for o in session.run(None, feeds)])
        except Exception:  # a model onnxruntime cannot run is not checked here (nor by the self-check)
            return
        finally:
            session = None
    tolerance = KEPT.get(next(iter(feeds.values())).dtype.type, 1e-3)
    for k, (a, b) in enumerate(zip(*outputs)):
        if a.shape != b.shape or not np.isfinite(a).all() or not a.size:
            continue
        moved = float(np.abs(b - a).max() / max(float(np.abs(a).max()), 1e-30)) if np.isfinite(b).all() else np.inf
        if not moved <= tolerance:
            raise PathirError(
                f"write-back refused: onnxruntime's output {k} of the written model moved by {moved:.3g} (relative to "
                f"its max; at most {tolerance:g} is rounding) on a random probe: the write did not keep the function; "
                "nothing was changed")
