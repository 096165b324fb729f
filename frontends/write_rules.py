"""The write-back rules both writers (torch, ONNX) follow: which source tensor
takes which factor of a rescaling, and which tensor a mask goes to.

A param on edge u -> v changes entry [o, i] by e^{s_v}[o] · e^{-s_u}[i]
(``Map.weight_channels``), a bias of v by e^{s_v}; a VALUE tensor takes the
in-factor unless the param has IN_STATS sources and the out-factor unless it
has OUT_SCALE ones; OUT_SCALE tensors (batch-norm scale and bias) take
e^{s_v}; IN_STATS tensors take the input factor λ = e^{s_u}, which each writer
applies as mean ← λ·mean, var ← λ²(var + eps) − eps.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from pathir.errors import PathirError
from pathir.ir import Graph, Param, Role, SourceRef

__all__ = ["source_factors", "mask_ref", "mask_plan"]

_SAME = dict(rtol=1e-9, atol=1e-300)


def source_factors(graph: Graph, log_scales: Mapping[str, np.ndarray]) -> dict[str, dict[Role, np.ndarray]]:
    """{source tensor name: {role: factor}} of a rescaling.

    VALUE factors are in the source tensor's layout (``SourceRef.to_source`` of the
    param-shaped factor: a transpose, a transposed convolution's kernel layout),
    OUT_SCALE and IN_STATS ones one entry per channel (IN_STATS: λ, the factor of the batch-norm's input). One
    (tensor, role) reached through several params must get one factor."""
    from pathir.rescaling.apply import check_log_scales, param_factors

    s = check_log_scales(graph, log_scales)
    plan: dict[tuple[str, Role], tuple[np.ndarray, str]] = {}
    for p, fo, fi, v, u in param_factors(graph, s).values():
        if not p.sources:
            raise PathirError(f"param '{p.name}' has no source tensor to write the rescaling to")
        roles = {r.role for r in p.sources}
        for ref in p.sources:
            if ref.role is Role.VALUE:
                f = np.exp((0.0 if Role.IN_STATS in roles else fi) + (0.0 if Role.OUT_SCALE in roles else fo))
                f = ref.to_source(np.broadcast_to(f, p.shape))
            elif ref.role is Role.OUT_SCALE:
                f = np.exp(s[v.name])
            else:
                if u is None:
                    raise PathirError(f"bias '{p.name}' lists running statistics '{ref.name}', which only an edge can feed")
                f = np.exp(-np.asarray(fi))
            key = (ref.name, ref.role)
            if key in plan:
                old, via = plan[key]
                if old.shape != f.shape or not np.allclose(old, f, **_SAME):
                    raise PathirError(
                        f"source tensor '{ref.name}' ({ref.role.value}) would be rescaled differently "
                        f"through params '{via}' and '{p.name}'"
                    )
                continue
            plan[key] = (np.array(f, dtype=np.float64), p.name)
    out: dict[str, dict[Role, np.ndarray]] = {}
    for (name, role), (f, _) in plan.items():
        out.setdefault(name, {})[role] = f
    return out


def mask_ref(p: Param, is_bias: bool) -> SourceRef:
    """The source tensor a mask on ``p`` goes to; refuses a param that is not that
    tensor up to per-channel factors (zeroing the tensor would not zero the param)."""
    roles = {r.role for r in p.sources}
    refs = [r for r in p.sources if r.role is Role.VALUE]
    if not refs:
        raise PathirError(f"param '{p.name}' has no VALUE source tensor to mask")
    if Role.IN_STATS in roles or (is_bias and roles != {Role.VALUE}):
        raise PathirError(
            f"param '{p.name}' = {p.how or p.name} is not its source tensor '{refs[0].name}' up to per-channel "
            "factors: masking that tensor would not zero the param"
        )
    return refs[0]


def mask_plan(graph: Graph, masks: Mapping[str, np.ndarray]) -> list[tuple[Param, np.ndarray, SourceRef]]:
    """[(param, bool mask of the param's shape, its VALUE source)] for ``masks``
    keyed by param name or source name; refuses unknown names, wrong shapes and
    params whose zeros are not their source tensor's (see :func:`mask_ref`)."""
    params = graph.params()
    by_name = {p.name: p for p in params}
    by_name.update({p.source_name: p for p in params if p.source_name not in by_name})
    biases = {id(n.bias) for n in graph.nodes if n.bias is not None}
    plan = []
    for key, m in masks.items():
        p = by_name.get(key)
        if p is None:
            raise PathirError(f"mask for '{key}': no such param in the graph")
        m = np.asarray(m).astype(bool)
        if m.shape != p.shape:
            raise PathirError(f"mask for '{p.name}' has shape {m.shape}, the param {p.shape}")
        plan.append((p, m, mask_ref(p, id(p) in biases)))
    return plan
