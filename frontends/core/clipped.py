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

import numpy as np

from pathir.frontends.core.fixed_factors import fixed_scale
from pathir.frontends.core.values import Value
from pathir.ir import Identity, NodeKind, Param, Role

__all__ = ["clipped_relu", "threshold_vector"]


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


def clipped_relu(low, v: Value, threshold: Param) -> Value:
    """min(max(v, 0), t) as A = ReLU(v), B = ReLU(A − t), out = A − B; ``threshold`` is the param −t
    (shape (C,), entries ≤ 0) with a ``Role.CLIP_THRESHOLD`` source. Nodes are named after the op:
    ``<label>.relu`` (A, unless v already is a ReLU node), ``<label>.excess`` (B) and ``<label>``
    (out, the op's output)."""
    v = low.value(v)
    c = v.shape[0]
    if threshold.shape != (c,):
        low.unsupported(f"threshold '{threshold.name}' of shape {list(threshold.shape)} for {c} channels")
    if not any(r.role is Role.CLIP_THRESHOLD for r in threshold.sources):
        raise ValueError(f"threshold param '{threshold.name}' has no clip_threshold source")
    label, where = low.label, low.where
    # a permutation of a node (a token-wise layer's output): its ReLU in the node's layout first, as a ReLU then a
    # minimum lowers (pathir.nn.ClippedReLU on the torch.export path, ONNX Relu then Min): one graph for both forms
    v = low.relu(v, f"{label}.relu_unpermuted") if v.node is None and low.is_permutation(v) else v
    if v.node is not None and low.b.kind(v.node) is NodeKind.RELU:
        a = v.node  # min(relu(relu(x)), t): the ReLU is there already
    else:
        a = low.b.relu(f"{label}.relu", v.terms, v.bias, origin=_origin(where, "ReLU(x) of a clipped ReLU"), shape=v.shape)
    b = low.b.relu(f"{label}.excess", [(a, Identity())], threshold, origin=_origin(where, "ReLU(ReLU(x) - t) of a clipped ReLU"),
                   shape=v.shape)
    minus = fixed_scale(low, Value.of_node(b, v.shape), -1.0)
    out = low.b.identity(label, [(a, Identity()), *minus.terms], origin=where, shape=v.shape)
    return Value.of_node(out, v.shape)


def _origin(where: str, part: str) -> str:
    """A clipped ReLU's inner node's origin: the op's own (a module path, a line), then which part it is."""
    return f"{where} ({part})" if where.strip() else part
