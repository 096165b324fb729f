"""The write-back rules both writers (torch, ONNX) follow: which source tensor
takes which factor of a rescaling, and which tensor a mask goes to.

A param on edge u -> v changes entry [o, i] by e^{s_v}[o] · e^{-s_u}[i]
(``Map.weight_channels``), a bias of v by e^{s_v}; a VALUE tensor takes the
in-factor unless the param has IN_STATS sources and the out-factor unless it
has OUT_SCALE ones; OUT_SCALE tensors (batch-norm scale and bias) take
e^{s_v}; IN_STATS tensors take the input factor λ = e^{s_u}, which each writer
applies as mean ← λ·mean, var ← λ²(var + eps) − eps. A CLIP_THRESHOLD source (the
threshold t of a clipped ReLU, the param being −t, the bias of its ReLU(ReLU(x) − t)
neuron) takes e^{s_v} per channel, like a bias: each writer writes it where its
frontend found it (a buffer, a module to replace, an initializer, a Clip node to
rewrite) or refuses it.
"""

from __future__ import annotations

import functools
from typing import Mapping

import numpy as np

from pathir.errors import PathirError
from pathir.ir import Graph, Param, Role, SourceRef
from pathir.rescaling.apply import checked_param_factors
from pathir.rescaling.shared_sources import check_batch_norm_uses

__all__ = ["source_factors", "EntryFactor", "mask_ref", "mask_plan", "clip_threshold_names", "check_variance"]

_SAME = dict(rtol=1e-9, atol=1e-300)


class EntryFactor:
    """The entrywise factor e^{a + b} of a VALUE source tensor, in its layout, computed from the
    param's broadcast log-factors a (in) and b (out) on demand, as e^a e^b (exponentials of the
    compact logs only): whole (``np.asarray``) or a block of the tensor's leading rows at a time
    (:meth:`rows`), so that a writer never holds a full float64 factor of a large tensor."""

    def __init__(self, log_in, log_out, ref: SourceRef, param_shape: tuple[int, ...]):
        self.log_in, self.log_out, self.ref, self.param_shape = log_in, log_out, ref, param_shape
        self._compact = None  # (e^a, e^b) on the logs' own (unbroadcast) shapes, once computed
        self._by_axis = None  # the same reshaped to the param's number of axes (None: not yet; (): impossible)

    @functools.cached_property
    def shape(self) -> tuple[int, ...]:
        """The source tensor's shape."""
        return self.ref.to_source(np.broadcast_to(np.zeros(()), self.param_shape)).shape

    @property
    def by_rows(self) -> bool:
        """Whether :meth:`rows` slices without building the whole factor (no kernel re-layout)."""
        return self.ref.layout is None and len(self.param_shape) >= (2 if self.ref.transposed else 1)

    def _exponentials(self) -> tuple:
        """(e^a, e^b) on the logs' own (unbroadcast) shapes, or () where one side passes e^600 (then
        e^{a+b} is formed from the sum)."""
        if self._compact is None:
            a, b = (_unbroadcast(np.asarray(x, dtype=np.float64)) for x in (self.log_in, self.log_out))
            big = max(float(np.max(np.abs(a), initial=0.0)), float(np.max(np.abs(b), initial=0.0)))
            self._compact = (np.exp(a), np.exp(b)) if big < 600.0 else ()
        return self._compact

    def _by_axes(self) -> tuple:
        """The compact exponentials (e^a, e^b), each with the param's number of axes, or () where the factor has no
        row blocks or no compact form (a re-laid-out kernel, exponentials past e^600)."""
        if self._by_axis is None:
            ndim = len(self.param_shape)
            sides = [x.reshape((1,) * (ndim - x.ndim) + x.shape) for x in self._exponentials()] if self.by_rows else []
            self._by_axis = tuple(sides) if sides and all(x.ndim == ndim for x in sides) else ()
        return self._by_axis

    def scale_rows(self, block: np.ndarray, start: int, stop: int) -> bool:
        """``block`` (rows start:stop of the tensor, float64) ← block · e^a · e^b, the compact exponentials
        broadcast onto it (no block of the factor formed); False, block untouched, where the factor has no
        such rows (a re-laid-out kernel, a transposed one, exponentials past e^600)."""
        if self.ref.transposed or not self._by_axes():
            return False
        for x in self._by_axes():
            block *= x if x.shape[0] == 1 else x[start:stop]
        return True

    def scale_block(self, block: np.ndarray, start: int, stop: int) -> None:
        """``block`` (rows start:stop of the tensor, float64) ← block · factor, each compact exponential applied in
        turn where there are any (a weight of 1e-300 moved by e^720 is 1e13, though e^720 itself is no float64),
        and by the rows of the factor formed otherwise."""
        if self.scale_rows(block, start, stop):
            return
        if self.ref.transposed and self._by_axes():  # the param's columns are the tensor's rows
            for x in self._by_axes():
                block *= np.broadcast_to(x, self.param_shape)[:, start:stop].T
            return
        block *= self.rows(start, stop)

    def _exp(self, index) -> np.ndarray:
        if self._exponentials():
            ea, eb = (np.broadcast_to(x, self.param_shape)[index] for x in self._compact)
            return ea * eb
        a, b = (np.broadcast_to(x, self.param_shape)[index] for x in (self.log_in, self.log_out))
        return np.exp(a + b)

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows start:stop (along the source tensor's first axis) of the factor."""
        if not self.by_rows:
            return np.asarray(self)[start:stop]
        if self.ref.transposed:
            return self._exp((slice(None), slice(start, stop))).T
        return self._exp(slice(start, stop))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        f = self.ref.to_source(self._exp(...))
        return f if dtype is None else f.astype(dtype, copy=False)


def _unbroadcast(x: np.ndarray) -> np.ndarray:
    """``x`` without its broadcast axes (stride 0): the same values, each stored once."""
    index = tuple(slice(0, 1) if step == 0 and n > 1 else slice(None) for step, n in zip(x.strides, x.shape))
    return x[index]


def source_factors(graph: Graph, log_scales: Mapping[str, np.ndarray], lazy: bool = False) -> dict:
    """{source tensor name: {role: factor}} of a rescaling.

    VALUE factors are in the source tensor's layout (``SourceRef.to_source`` of the
    param-shaped factor: a transpose, a transposed convolution's kernel layout),
    OUT_SCALE and IN_STATS ones one entry per channel (IN_STATS: λ, the factor of the batch-norm's input). One
    (tensor, role) reached through several params must get one factor.

    ``lazy=True``: {name: a function returning that tensor's {role: factor}}, VALUE factors as
    :class:`EntryFactor` (computed when the writer reaches the tensor: the factors of a whole model
    never sit in memory at once); a tensor given different factors through two params raises then."""

    check_batch_norm_uses(graph)
    s, factors_of = checked_param_factors(graph, log_scales)
    uses: dict[tuple[str, Role], list] = {}  # (tensor, role) -> the params that reach it, in order
    for p, fo, fi, v, u in factors_of.values():
        if not p.sources:
            raise PathirError(f"param '{p.name}' has no source tensor to write the rescaling to")
        roles = {r.role for r in p.sources}
        for ref in p.sources:
            if ref.role is Role.IN_STATS and u is None:
                raise PathirError(f"bias '{p.name}' lists running statistics '{ref.name}', which only an edge can feed")
            if ref.role is Role.CLIP_THRESHOLD and u is not None:
                raise PathirError(f"edge weight '{p.name}' lists the clip threshold '{ref.name}', which only a bias holds")
            uses.setdefault((ref.name, ref.role), []).append((p, ref, roles, fo, fi, v))
    tensors: dict[str, list[Role]] = {}
    for name, role in uses:
        tensors.setdefault(name, []).append(role)

    def factors(name: str) -> dict[Role, np.ndarray]:
        return {role: _one_factor(uses[(name, role)], s, lazy) for role in tensors[name]}

    if lazy:
        return {name: (lambda name=name: factors(name)) for name in tensors}
    return {name: factors(name) for name in tensors}


def _one_factor(uses, s, lazy: bool):
    """The factor of one (tensor, role), checked equal across the params that reach it."""
    first = via = None
    for p, ref, roles, fo, fi, v in uses:
        if ref.role is Role.VALUE:
            f = EntryFactor(0.0 if Role.IN_STATS in roles else fi, 0.0 if Role.OUT_SCALE in roles else fo, ref,
                            p.shape)
            f = f if lazy and len(uses) == 1 else np.asarray(f)
        elif ref.role in (Role.OUT_SCALE, Role.CLIP_THRESHOLD):
            f = np.exp(s[v.name])
        else:
            f = np.exp(-np.asarray(fi))
        if first is None:
            first, via = f, p.name
        elif first.shape != f.shape or not (np.array_equal(first, f) or np.allclose(first, f, **_SAME)):
            raise PathirError(
                f"source tensor '{ref.name}' ({ref.role.value}) would be rescaled differently "
                f"through params '{via}' and '{p.name}'"
            )
    return first


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


def clip_threshold_names(graph: Graph) -> list[str]:
    """The source names of the graph's clipped-ReLU thresholds (``Role.CLIP_THRESHOLD``), in param order."""
    return list(dict.fromkeys(r.name for p in graph.params() for r in p.sources if r.role is Role.CLIP_THRESHOLD))


def check_variance(where: str, eps: float, exact: np.ndarray, stored: np.ndarray, untouched: str,
                   precision: float | None = None, dtype_name: str | None = None) -> None:
    """A batch-norm divides by sqrt(var + eps): the running variance as stored (``stored``, in its dtype, or its
    values in float64 with that dtype's machine epsilon ``precision`` and name: bfloat16, which numpy lacks) must
    keep var + eps (= λ²(var_old + eps) > 0, ``exact`` + eps) to that dtype's precision, which fails when a
    rescaling shrinks the batch-norm's input so far that eps dominates (var' = λ²(var + eps) − eps cancels);
    refused (PathirError) before anything is written."""
    want = np.asarray(exact, dtype=np.float64) + eps
    got = np.asarray(stored, dtype=np.float64) + eps
    tol = 1e3 * (float(np.finfo(np.asarray(stored).dtype).eps) if precision is None else precision)
    bad = ~(got > 0) | (np.abs(got - want) > tol * np.abs(want))
    if bad.any():
        raise PathirError(
            f"the rescaling shrinks the input of the batch-norm {where} so far that its running variance cannot "
            f"keep var + eps in {dtype_name or np.asarray(stored).dtype} ({int(bad.sum())} channels; var + eps should be "
            f"{float(want[bad].min()):.3g}): eps dominates. Use a smaller rescaling (|z| bounded) or a float64 "
            f"model; {untouched}")
