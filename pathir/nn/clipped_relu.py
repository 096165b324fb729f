"""ClippedReLU: min(max(x, 0), t) with a threshold per channel."""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["ClippedReLU"]


class ClippedReLU(nn.Module):
    """``min(max(x, 0), t[c])`` on channel c (axis 1 of the input, or the axis ``spatial_dims`` from the end):
    a ReLU6 whose threshold differs per channel.

    pathir writes it in place of an ``nn.ReLU6`` / ``nn.Hardtanh(0, t)`` module when a rescaling moves
    the channels' thresholds apart (a unit scaled by e^s has its threshold scaled by e^s, as a bias:
    ReLU6(e^s x) / e^s = min(ReLU(x), 6 e^{-s})). The threshold is the buffer ``threshold`` (it follows
    ``.to()`` / ``.double()`` and is saved in the ``state_dict``), held in the shape
    ``(C, 1, ..., 1)`` (``spatial_dims`` ones) that broadcasts against an input ``(N, C, *spatial)``,
    so that the forward is one ReLU and one ``torch.minimum``. pathir lowers it as it lowers ReLU6
    (docs/ir.md): compiling a rescaled model gives the same function and the same path-norms.

    Parameters
    ----------
    threshold : tensor of shape (C,), finite and ≥ 0 (kept in its dtype: give the model's)
    spatial_dims : the number of axes after the channel axis (2 for images, 0 for (N, C) vectors, and for
        a layout whose channels are the last axis: a token-wise MLP's (N, T, F), a channels-last (N, H, W, C))
    inplace : clip the input tensor itself and return it, as ``nn.ReLU6(inplace=True)`` does (pathir keeps
        the flag of the module it replaces: a later read of that input sees the clipped values)

    >>> import torch
    >>> from pathir.nn import ClippedReLU
    >>> act = ClippedReLU(torch.tensor([6.0, 1.0]), spatial_dims=0)
    >>> act(torch.tensor([[-1.0, 3.0], [8.0, 0.5]]))
    tensor([[0.0000, 1.0000],
            [6.0000, 0.5000]])
    >>> act
    ClippedReLU(channels=2, spatial_dims=0)
    """

    def __init__(self, threshold, spatial_dims: int = 2, inplace: bool = False):
        super().__init__()
        t = torch.as_tensor(threshold).detach()
        if not t.is_floating_point():
            t = t.to(torch.get_default_dtype())
        if t.dim() != 1 or t.numel() == 0:
            raise ValueError(f"ClippedReLU: threshold must have shape (C,), got {list(t.shape)}")
        if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
            raise ValueError("ClippedReLU: every threshold must be finite and >= 0")
        if int(spatial_dims) < 0:
            raise ValueError(f"ClippedReLU: spatial_dims must be >= 0, got {spatial_dims}")
        self.spatial_dims, self.inplace = int(spatial_dims), bool(inplace)
        self.register_buffer("threshold", t.clone().reshape(-1, *(1,) * self.spatial_dims))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            return x.clamp_(min=0).clamp_(max=self.threshold)
        t = self.threshold if self.threshold.dtype == x.dtype else self.threshold.to(x.dtype)  # as nn.ReLU6: x's dtype
        return torch.minimum(torch.relu(x), t)

    def extra_repr(self) -> str:
        return f"channels={self.threshold.shape[0]}, spatial_dims={self.spatial_dims}" + (
            ", inplace=True" if self.inplace else "")
