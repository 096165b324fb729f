"""torch modules pathir writes into a model (imported on first use: ``import pathir.nn`` loads torch).

``ClippedReLU``: min(max(x, 0), t) with one threshold per channel, what an ``nn.ReLU6`` or
``nn.Hardtanh(0, t)`` becomes when a rescaling gives its channels different thresholds
(docs/capture.md, "Clipped ReLUs").
"""

from pathir.nn.clipped_relu import ClippedReLU

__all__ = ["ClippedReLU"]
