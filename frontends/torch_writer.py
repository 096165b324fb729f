"""Write-back into a torch nn.Module: rescalings and masks, all at once.

CONTRACT (filled in by the PathCond work):
    TorchWriter(model).rescale(graph, log_scales)   # log_scales: {node name: (channels,) array}
    TorchWriter(model).mask(graph, masks)           # masks: {param name: bool array of the param's shape}
Both compute every new tensor first and assign only when all succeeded.
"""

from __future__ import annotations

__all__ = ["TorchWriter"]


class TorchWriter:
    def __init__(self, model):
        self.model = model
