"""Clipped ReLUs as ReLU DAGs (docs/ir.md, "Clipped ReLUs"; docs/math.md §1), for every frontend.

    min(max(x, 0), t) = A − ReLU(A − t),   A = ReLU(x),   for every real x and every t ≥ 0

(A ≤ t: ReLU(A − t) = 0; A > t: A − (A − t) = t). One clipped ReLU channel becomes the ReLU
neuron A, the ReLU neuron B = ReLU(A − t) whose bias is the *param* −t (one entry per channel,
bound to the clipped ReLU as its source, ``Role.CLIP_THRESHOLD``), and the identity neuron
out = A − B (fixed edges +1 and −1). The fixed edges A → B, A → out, B → out tie A, B and out
into one unit per channel, whose incoming side holds x's weights and bias *and* −t: a rescaling
e^s of the unit moves t ← e^s t exactly as it moves a bias, ReLU6(e^s x) / e^s = min(ReLU(x), 6 e^{-s}).

The lowering core builds the three nodes (:func:`clipped_relu`); each frontend makes the threshold
param, bound to what the model holds it in, with :func:`threshold_vector`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pathir.frontends.core.fixed_factors import fixed_scale
from pathir.frontends.core.values import Value
from pathir.ir import Identity, NodeKind, Param, Role

__all__ = ["clipped_relu", "threshold_vector", "ClipLayout", "clip_layout"]


@dataclass(frozen=True)
class ClipLayout:
    """Where a clipped ReLU of an activation keeps its thresholds: one per channel of the node its neurons are
    built on, ``channels`` of them. That node is the activation's own (its channels along axis 0 of the
    per-sample shape), or, where the activation is a permutation of a node (a token-wise layer's output, a
    channels-last view), that node: its channels are the features, as a ReLU there has them. ``channel``: per
    element of the activation's per-sample shape, its channel (None for the activation's own layout); ``axis``:
    the axis of the per-sample shape along which the channels lie in order (0 for the own layout), None where no
    single axis does (then no threshold tensor of the model's broadcasts to them: a write-back holds them);
    ``moved``: (the node, the gather map that permutes it into the activation) of a permuted layout."""

    channels: int
    axis: int | None
    channel: np.ndarray | None = None
    moved: tuple | None = None

    @property
    def permuted(self) -> bool:
        return self.channel is not None

    @staticmethod
    def own(shape) -> "ClipLayout":
        """The activation's own layout: its channels along axis 0 of the per-sample ``shape``."""
        return ClipLayout(shape[0], 0)

    def trailing(self, ndim: int) -> int | None:
        """The axes after the channels' in an activation of ``ndim`` per-sample axes (what a threshold of shape
        (C, 1, ..., 1) broadcasts against), None where no axis holds them."""
        return None if self.axis is None else ndim - 1 - self.axis

    def holds(self, shape, ndim: int) -> bool:
        """Whether a tensor of ``shape``, broadcast against an activation (N, ...) of ``ndim`` per-sample axes, lies
        along the channels' axis (its one axis of more than one entry) or holds one number: then a per-channel
        vector of thresholds written in its place (reshaped along that axis) broadcasts as it does."""
        wide = [ndim + 1 - len(shape) + k for k, n in enumerate(shape) if n != 1]  # its axes in (N, *per-sample)
        return not wide or self.axis is not None and wide == [self.axis + 1]

    def per_channel(self, t: np.ndarray) -> np.ndarray | None:
        """``t`` (of the activation's per-sample shape) as one value per channel, None where it varies within one
        (a permuted layout only)."""
        first = np.empty(self.channels)
        first[self.channel.reshape(-1)] = t.reshape(-1)  # (each channel's last entry)
        return first if np.array_equal(first[self.channel], t) else None


def clip_layout(low, v: Value) -> ClipLayout:
    """The :class:`ClipLayout` of a clipped ReLU of ``v``: its source node's where v permutes one, else v's own."""
    v = low.value(v)
    moved = None if v.node is not None else low.permutation_of(v)
    if moved is None:
        return ClipLayout.own(v.shape)
    src, m = moved
    shape = low.b.shape(src)
    channel = (np.asarray(m.index) // (math.prod(shape) // shape[0])).reshape(v.shape)
    axis = next((k for k, n in enumerate(v.shape) if n == shape[0] and np.array_equal(
        channel, np.broadcast_to(np.arange(n).reshape([n if j == k else 1 for j in range(len(v.shape))]), v.shape))),
        None)
    return ClipLayout(shape[0], axis, channel, moved)


def threshold_vector(low, t, channels: int, what: str) -> np.ndarray:
    """−t as one float64 entry per channel: ``t`` a number or an array that broadcasts to one
    value per channel (shape (), (1,) or (C,)). Refuses (naming ``what``) a threshold that is not
    finite or is negative."""
    t = np.asarray(t, dtype=np.float64)
    if t.ndim > 1 or t.size not in (1, channels):
        low.unsupported(f"{what}: a threshold of shape {list(t.shape)} for {channels} channels: one value, or "
                        "one per channel")
    if not np.all(np.isfinite(t)):
        low.unsupported(f"{what}: a non-finite threshold")
    if np.any(t < 0):
        low.unsupported(f"{what}: a negative threshold {float(t.min()):g} makes the output a constant "
                        "(clamp(x, 0, t) with t < 0 is t everywhere), a bias no parameter carries")
    return -np.broadcast_to(t.reshape(-1), (channels,)).astype(np.float64)


def clipped_relu(low, v: Value, threshold: Param, layout: ClipLayout | None = None) -> Value:
    """min(max(v, 0), t) as A = ReLU(v), B = ReLU(A − t), out = A − B; ``threshold`` is the param −t
    (shape (C,), entries ≤ 0) with a ``Role.CLIP_THRESHOLD`` source, one per channel of ``layout`` (default
    :func:`clip_layout`). Nodes are named after the op: ``<label>.relu`` (A, unless v already is a ReLU node),
    ``<label>.excess`` (B) and ``<label>`` (out, the op's output).

    Where ``v`` permutes a node (a token-wise layer's output, a channels-last view) and ``layout`` is that node's,
    the three nodes are built in the node's layout, one threshold per its channel (the features: each its own
    unit, as under a ReLU there), and their output is permuted as v is. With ``layout`` v's own (a threshold per
    token, say), they are built in v's layout after a ReLU in the node's: exact, its features tied by the threshold."""
    v = low.value(v)
    layout = clip_layout(low, v) if layout is None else layout
    moved = layout.moved
    src, permutation = moved if moved is not None else (None, None)
    shape = v.shape if moved is None else low.b.shape(src)
    c = shape[0]
    if threshold.shape != (c,):
        low.unsupported(f"threshold '{threshold.name}' of shape {list(threshold.shape)} for {c} channels")
    if not any(r.role is Role.CLIP_THRESHOLD for r in threshold.sources):
        raise ValueError(f"threshold param '{threshold.name}' has no clip_threshold source")
    label, where = low.label, low.where
    if moved is None and v.node is None and low.is_permutation(v):
        # v's own layout on a permutation: its ReLU in the node's layout first, as a ReLU then a minimum lowers
        # (pathir.nn.ClippedReLU on the torch.export path, ONNX Relu then Min): one graph for both forms
        v = low.relu(v, f"{label}.relu_unpermuted")
    terms, bias, node = (v.terms, v.bias, v.node) if moved is None else ([(src, Identity())], None, src)
    if node is not None and low.b.kind(node) is NodeKind.RELU:
        a = node  # min(relu(relu(x)), t): the ReLU is there already
    else:
        a = low.b.relu(f"{label}.relu", terms, bias, origin=_origin(where, "ReLU(x) of a clipped ReLU"), shape=shape)
    b = low.b.relu(f"{label}.excess", [(a, Identity())], threshold, origin=_origin(where, "ReLU(ReLU(x) - t) of a clipped ReLU"),
                   shape=shape)
    minus = fixed_scale(low, Value.of_node(b, shape), -1.0)
    out = low.b.identity(label, [(a, Identity()), *minus.terms], origin=where, shape=shape)
    return Value.of_node(out, v.shape) if moved is None else Value([(out, permutation)], v.shape, None, out)


def _origin(where: str, part: str) -> str:
    """A clipped ReLU's inner node's origin: the op's own (a module path, a line), then which part it is."""
    return f"{where} ({part})" if where.strip() else part
