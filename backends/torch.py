"""The torch backend: the numpy backend's rules on torch tensors, CPU or CUDA.

Same contract as :mod:`pathir.backends.numpy` (the definition): batched
tensors ``(B, *shape)``, one rule triple (apply, adjoint, weight_grad) per
``MapKind``, float64 by default. Rules take the backend first so that they
read weights through its device cache: each Param (and each fixed map's
constant array) is converted once per backend and kept while the object lives.

Window geometry. A map's padding is (before, after) per axis and a ceil-mode
pool adds ``extra_right_padding``; every window then lives in the *frame*
``[0, (o-1)*s + d*(k-1) + 1)`` of padded coordinates (o outputs). Apply pads
(zeros, or -inf for a max) and cuts the padded input to the frame, so torch's
own floor-mode ops give exactly ``out_shape``; adjoints compute the gradient on
the frame and crop it back to the input ``[before, before + L)``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import warnings
import weakref

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn import grad as nn_grad

from pathir.errors import BackendError
from pathir.ir import MapKind, Node
from pathir.support.threads import one_torch_thread

from . import depthwise
from .base import Backend, RuleTable
from .numpy import window_slices

__all__ = ["TorchBackend"]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_CONV_INPUT = {1: nn_grad.conv1d_input, 2: nn_grad.conv2d_input, 3: nn_grad.conv3d_input}
_CONV_WEIGHT = {1: nn_grad.conv1d_weight, 2: nn_grad.conv2d_weight, 3: nn_grad.conv3d_weight}
_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


def _table(table, n, what):
    if n not in table:
        raise BackendError(f"backend torch has no rule for {n}-d {what} (1-d to 3-d only)")
    return table[n]


# ------------------------------------------------------------ window helpers


def _pad(x, pads, value=0.0):
    """Pad the spatial axes by (before, after) pairs (F.pad wants the last axis first)."""
    if all(a == 0 and b == 0 for a, b in pads):
        return x
    flat = [p for a_b in reversed(pads) for p in a_b]
    return F.pad(x, flat, value=value)


def _symmetric(pads):
    """The per-axis padding if every axis pads equally on both sides, else None."""
    return tuple(a for a, _ in pads) if all(a == b for a, b in pads) else None


def _frame_sizes(m, kernel, out):
    return [(o - 1) * s + d * (k - 1) + 1 for o, k, s, d in zip(out, kernel, m.stride, m.dilation)]


def _pool_pads(m, in_shape):
    extra = m.extra_right_padding(in_shape)
    return [(p[0], p[1] + e) for p, e in zip(m.padding, extra)]


def _to_frame(x, m, in_shape, out, fill):
    """The padded input cut to the windows' frame: floor-mode windows give ``out`` positions."""
    xp = _pad(x, _pool_pads(m, in_shape), fill)
    cut = tuple(slice(0, f) for f in _frame_sizes(m, m.kernel, out))
    return xp[(slice(None), slice(None)) + cut]


def _crop(gx, pads, spatial):
    """From a gradient on padded coordinates (starting at 0) keep the input's [before, before + L)."""
    short = [max(0, a + L - f) for (a, _), L, f in zip(pads, spatial, gx.shape[2:])]
    gx = _pad(gx, [(0, r) for r in short])
    crop = tuple(slice(a, a + L) for (a, _), L in zip(pads, spatial))
    return gx[(slice(None), slice(None)) + crop]


def _window_sum(xf, m):
    """Sum over every window of a framed input (floor mode, no padding)."""
    n = xf.ndim - 2
    if all(d == 1 for d in m.dilation) and n in (1, 2, 3):
        if n == 3:
            return F.avg_pool3d(xf, m.kernel, m.stride, 0, False, True, 1)
        if n == 2:
            return F.avg_pool2d(xf, m.kernel, m.stride, 0, False, True, 1)
        y = F.avg_pool2d(xf.unsqueeze(2), (1, *m.kernel), (1, *m.stride), 0, False, True, 1)
        return y.squeeze(2)
    C = xf.shape[1]
    ones = xf.new_ones((C, 1, *m.kernel))
    return _table(_CONV, n, "pool")(xf, ones, None, m.stride, 0, m.dilation, C)


def _window_sum_adjoint(g, m, frame):
    """Adjoint of :func:`_window_sum`: scatter each output's gradient over its window, on the frame."""
    n = g.ndim - 2
    B, C = g.shape[:2]
    if all(d == 1 for d in m.dilation) and n in (1, 2, 3):
        if n == 1:
            shape = g.new_empty(1).expand(B, C, 1, *frame)
            gx = torch.ops.aten.avg_pool2d_backward(
                g.unsqueeze(2), shape, [1, *m.kernel], [1, *m.stride], [0, 0], False, True, 1
            )
            return gx.squeeze(2)
        back = torch.ops.aten.avg_pool2d_backward if n == 2 else torch.ops.aten.avg_pool3d_backward
        shape = g.new_empty(1).expand(B, C, *frame)
        return back(g, shape, list(m.kernel), list(m.stride), [0] * n, False, True, 1)
    ones = g.new_ones((C, 1, *m.kernel))
    return _table(_CONV_T, n, "pool")(g, ones, None, m.stride, 0, 0, C, m.dilation)


def _window_views(xf, m, out):
    """A framed input seen at each kernel offset (itertools.product order): views (B, C, *out)."""
    for off in itertools.product(*(range(k) for k in m.kernel)):
        yield xf[(slice(None), slice(None)) + window_slices(off, m.dilation, m.stride, out)]


# ------------------------------------------------------------------ rules
# Every rule is rule(backend, map, ...); TorchBackend binds the backend.


def _identity_apply(be, m, x, s):
    return x


def _identity_adjoint(be, m, g, s):
    return g


def _reshape_apply(be, m, x, s):
    return x.reshape(x.shape[0], *m.shape)


def _reshape_adjoint(be, m, g, s):
    return g.reshape(g.shape[0], *s)


def _index_parts(be, m, index):
    """(safe index, mask of kept targets or None, kept target positions, their sources), cached per map."""

    def make():
        idx = (m.index_array if index is getattr(m, "index", None) and hasattr(m, "index_array")
               else np.asarray(index, dtype=np.int64)).reshape(-1)  # a channel map's array, made once per map
        keep = idx >= 0
        dev = be.device
        safe = torch.as_tensor(np.where(keep, idx, 0), device=dev)
        mask = None if keep.all() else torch.as_tensor(keep, device=dev)
        pos = torch.as_tensor(np.flatnonzero(keep), device=dev)
        return safe, mask, pos, torch.as_tensor(idx[keep], device=dev)

    return be.cached(m, make)


_BLOCKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _channel_block(be, m):
    """(start, k) where channel map ``m`` places source channels 0..k-1, in order, at targets start..start+k-1
    and reads nothing else (a concat operand), else None; once per map."""
    try:
        return _BLOCKS[m]
    except KeyError:
        idx = m.index_array
        kept = np.flatnonzero(idx >= 0)
        run = kept.size and kept[-1] - kept[0] + 1 == kept.size and np.array_equal(idx[kept], np.arange(kept.size))
        block = _BLOCKS[m] = (int(kept[0]), int(kept.size)) if run else None
        return block


def _channel_apply(be, m, x, s):
    safe, mask, pos, src = _index_parts(be, m, m.index)
    if mask is None:
        return x[:, safe]
    # only the kept targets are read (a concat slice keeps few of many): zeros, then those channels copied in
    out = x.new_zeros((x.shape[0], safe.numel(), *x.shape[2:]))
    block = _channel_block(be, m)
    if block is not None and block[1] == x.shape[1]:
        out.narrow(1, *block).copy_(x)
        return out
    return out.index_copy_(1, pos, x.index_select(1, src))


def _channel_adjoint(be, m, g, s):
    block = _channel_block(be, m)
    if block is not None and block[1] == s[0]:  # a concat operand's gradient: its slice of the concat's (a view;
        return g.narrow(1, *block)  # adjoints are read, never written in place)
    _, _, pos, src = _index_parts(be, m, m.index)
    out = g.new_zeros((g.shape[0], *s))
    return out.index_add_(1, src, g[:, pos])


def _pool_apply(be, m, x, s):
    out = m.out_shape(s)[1:]
    if 0 in out:
        return x.new_zeros((x.shape[0], s[0], *out))
    y = _window_sum(_to_frame(x, m, s, out, 0.0), m)
    return y if m.mult is None else y * be.cached(m, lambda: be.constant(m.mult))


def _pool_adjoint(be, m, g, s):
    out = tuple(g.shape[2:])
    if 0 in out:
        return g.new_zeros((g.shape[0], *s))
    if m.mult is not None:
        g = g * be.cached(m, lambda: be.constant(m.mult))
    gx = _window_sum_adjoint(g, m, _frame_sizes(m, m.kernel, out))
    return _crop(gx, _pool_pads(m, s), s[1:])


def _spatial_apply(be, m, x, s):
    B, C = x.shape[:2]
    M = be.cached(m, lambda: be.constant(m.matrix))
    return (x.reshape(B, C, -1) @ M.T).reshape(B, C, *m.out_spatial)


def _spatial_adjoint(be, m, g, s):
    B, C = g.shape[:2]
    M = be.cached(m, lambda: be.constant(m.matrix))
    return (g.reshape(B, C, -1) @ M).reshape(B, *s)


def _per_axis(x, mats):
    """Apply mats[d] along spatial axis d of x (B, C, *spatial), one small matmul per axis."""
    for d, a in enumerate(mats):
        x = (x.movedim(2 + d, -1) @ a.T).movedim(-1, 2 + d)
    return x


def _resample_mats(be, m):
    return be.cached(m, lambda: [be.constant(a) for a in m.matrices])


def _resample_apply(be, m, x, s):
    return _per_axis(x, _resample_mats(be, m))


def _resample_adjoint(be, m, g, s):
    return _per_axis(g, [a.T for a in _resample_mats(be, m)])


def _gather_apply(be, m, x, s):
    safe, mask, _, _ = _index_parts(be, m, m.index)
    y = x.reshape(x.shape[0], -1)[:, safe]
    if mask is not None:
        y = torch.where(mask, y, y.new_zeros(()))
    return y.reshape(x.shape[0], *m.shape)


def _gather_adjoint(be, m, g, s):
    _, _, pos, src = _index_parts(be, m, m.index)
    out = g.new_zeros((g.shape[0], math.prod(s)))
    out.index_add_(1, src, g.reshape(g.shape[0], -1)[:, pos])
    return out.reshape(g.shape[0], *s)


def _dense_apply(be, m, x, s):
    return x.reshape(x.shape[0], -1) @ be.param(m.W).T


def _dense_adjoint(be, m, g, s):
    return (g @ be.param(m.W)).reshape(g.shape[0], *s)


def _dense_wgrad(be, m, x, g, s):
    return g.T @ x.reshape(x.shape[0], -1)


def _kernel(be, m):
    """A Conv's weight (a Param), or a FixedConv's constant kernel (zeros stay no edge)."""
    if m.kind is MapKind.FIXED_CONV:
        return be.cached(m, lambda: be.constant(m.kernel))
    return be.param(m.W)


def _pointwise(m, w_shape) -> bool:
    """Whether conv map ``m`` is a 1 x 1 (x 1) kernel at stride 1, unpadded and ungrouped: a matrix product over the
    channels at every position, which a matmul computes without torch's float64 im2col path (2x faster there)."""
    return (m.groups == 1 and all(k == 1 for k in w_shape[2:]) and all(st == 1 for st in m.stride)
            and all(a == 0 and b == 0 for a, b in m.padding))


def _conv_apply(be, m, x, s):
    n = len(s) - 1
    conv = _table(_CONV, n, "conv")
    W = _kernel(be, m)
    if _pointwise(m, W.shape):
        return (W.reshape(W.shape[0], W.shape[1]) @ x.reshape(x.shape[0], x.shape[1], -1)).reshape(
            x.shape[0], W.shape[0], *x.shape[2:])
    if depthwise.is_depthwise(s[0], W.shape, m.groups, W):  # torch: one call per channel in float64
        return depthwise.conv(x, W, m.stride, m.padding, m.dilation)
    sym = _symmetric(m.padding)
    if sym is None:
        x, sym = _pad(x, m.padding), 0
    return conv(x, W, None, m.stride, sym, m.dilation, m.groups)


def _conv_adjoint(be, m, g, s):
    n = len(s) - 1
    conv_input = _table(_CONV_INPUT, n, "conv")
    W = _kernel(be, m)
    if _pointwise(m, W.shape):
        return (W.reshape(W.shape[0], W.shape[1]).T @ g.reshape(g.shape[0], g.shape[1], -1)).reshape(g.shape[0], *s)
    if depthwise.is_depthwise(s[0], W.shape, m.groups, W):
        return depthwise.conv_input((g.shape[0], *s), W, g, m.stride, m.padding, m.dilation)
    sym = _symmetric(m.padding)
    if sym is not None:
        return conv_input((g.shape[0], *s), W, g, m.stride, sym, m.dilation, m.groups)
    padded = [L + a + b for L, (a, b) in zip(s[1:], m.padding)]
    gx = conv_input((g.shape[0], s[0], *padded), W, g, m.stride, 0, m.dilation, m.groups)
    return _crop(gx, m.padding, s[1:])


def _conv_wgrad(be, m, x, g, s):
    n = len(s) - 1
    conv_weight = _table(_CONV_WEIGHT, n, "conv")
    if _pointwise(m, m.W.shape):  # Σ over samples and positions of g xᵀ
        gm, xm = g.reshape(g.shape[0], g.shape[1], -1), x.reshape(x.shape[0], x.shape[1], -1)
        out = gm[0] @ xm[0].T if g.shape[0] == 1 else (gm.transpose(0, 1).reshape(g.shape[1], -1)
                                                       @ xm.transpose(0, 1).reshape(x.shape[1], -1).T)
        return out.reshape(m.W.shape)
    if depthwise.is_depthwise(s[0], m.W.shape, m.groups, g):
        return depthwise.conv_weight(x, m.W.shape, g, m.stride, m.padding, m.dilation)
    sym = _symmetric(m.padding)
    if sym is None:
        x, sym = _pad(x, m.padding), 0
    return conv_weight(x, m.W.shape, g, m.stride, sym, m.dilation, m.groups)


def bcast(v, ndim):
    return v.reshape(1, -1, *([1] * (ndim - 2)))


def _scale_apply(be, m, x, s):
    return x * bcast(be.param(m.W), x.ndim)


def _scale_adjoint(be, m, g, s):
    return g * bcast(be.param(m.W), g.ndim)


def _scale_wgrad(be, m, x, g, s):
    return (x * g).reshape(x.shape[0], x.shape[1], -1).sum(dim=(0, 2))


RULES: RuleTable = {
    MapKind.IDENTITY: (_identity_apply, _identity_adjoint, None),
    MapKind.RESHAPE: (_reshape_apply, _reshape_adjoint, None),
    MapKind.CHANNEL_MAP: (_channel_apply, _channel_adjoint, None),
    MapKind.POOL: (_pool_apply, _pool_adjoint, None),
    MapKind.SPATIAL_MATRIX: (_spatial_apply, _spatial_adjoint, None),
    MapKind.RESAMPLE: (_resample_apply, _resample_adjoint, None),
    MapKind.GATHER: (_gather_apply, _gather_adjoint, None),
    MapKind.FIXED_CONV: (_conv_apply, _conv_adjoint, None),
    MapKind.DENSE: (_dense_apply, _dense_adjoint, _dense_wgrad),
    MapKind.CONV: (_conv_apply, _conv_adjoint, _conv_wgrad),
    MapKind.SCALE: (_scale_apply, _scale_adjoint, _scale_wgrad),
}


def flushing_denormals() -> bool:
    """Whether torch's CPU arithmetic flushes subnormals to 0 now (``torch.set_flush_denormal``). The subnormal
    is made from its bits: a float literal such as 1e-310 is itself read as 0 under flushing, and Python keeps
    what it read in the module's compiled constants."""
    smallest = torch.ones(1, dtype=torch.int64).view(torch.float64)  # 4.9e-324, the smallest subnormal
    return bool((smallest * 1.0).item() == 0.0)


class TorchBackend(Backend):
    """The fast backend: torch tensors on ``device`` (CPU by default, "cuda"), in ``dtype``.

    Parameters
    ----------
    device : torch device or str, optional
        Where every tensor lives; None means CPU.
    dtype : torch.dtype
        float64 by default (path quantities need it; see docs/backends.md).

    >>> import numpy as np
    >>> from pathir.ir import Dense, Param
    >>> be = TorchBackend()
    >>> m = Dense(Param("w", np.array([[1.0, 2.0], [3.0, 4.0]])))
    >>> be.to_numpy(be.apply(m, be.asarray(np.ones((1, 2))), (2,)))
    array([[3., 7.]])
    """

    name = "torch"

    def __init__(self, device=None, dtype: torch.dtype = torch.float64):
        self.device = torch.device("cpu" if device is None else device)
        self.dtype = dtype
        # Param / fixed map -> its tensors on this device; dies with the object.
        self._cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    #: each rule takes the backend first; it is bound at the call. Rules bound once on the instance
    #: would make each backend a reference cycle, and a dropped one (a power view made per path-norm)
    #: would keep its cached tensors until the cyclic collector ran.
    rules = RULES

    def _rule(self, m, which: int):
        return functools.partial(super()._rule(m, which), self)

    def __repr__(self) -> str:
        return f"TorchBackend(device='{self.device}', dtype={self.dtype})"

    # ---------------------------------------------------------- device cache
    def cached(self, owner, make):
        """``make()``'s result for ``owner`` (a Param or a fixed map), computed once while it lives."""
        try:
            return self._cache[owner]
        except KeyError:
            value = self._cache[owner] = make()
            return value

    def forget(self, owner) -> None:
        """Drop ``owner``'s cached tensor (computed again if asked for): a walk's last use of a weight
        frees it, so a walk holds one layer's converted weights at a time, not the model's."""
        self._cache.pop(owner, None)

    def constant(self, array) -> torch.Tensor:
        """A numpy array on this backend's device and dtype, read-only by contract:
        float64 arrays on the CPU are shared, not copied (rules never write weights)."""
        arr = np.asarray(array)
        if self.device.type == "cpu" and arr.dtype == np.float64 and self.dtype == torch.float64:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "not writable": we never write it
                return torch.from_numpy(np.ascontiguousarray(arr))
        return torch.tensor(arr, dtype=self.dtype, device=self.device)

    def param(self, p) -> torch.Tensor:
        """The device tensor of Param ``p`` (converted on first use, then cached)."""
        return self.cached(p, lambda: self.constant(p.value))

    @contextlib.contextmanager
    def flush_denormals(self):
        """Subnormals (|x| < 2.2e-308) count as 0 inside the path walks: x86 arithmetic
        on them is ~100x slower, and a walk's values are relative to a mantissa
        of at least 1e-100 anyway (CPU only; a no-op where unsupported). The caller's own setting (torch
        has no getter: read off a subnormal product) is put back after."""
        was = flushing_denormals()
        torch.set_flush_denormal(True)
        try:
            yield
        finally:
            torch.set_flush_denormal(was)

    def power_view(self, q: float) -> "TorchBackend":
        """This backend seeing every weight, bias and fixed constant w as |w|^q
        (q = 0: every weight and existing bias is 1; a zero fixed entry stays 0).

        With the walks' ``linearize=True`` this is the ``path_view(q)`` pass done
        lazily on the device, from the already converted tensors."""
        return _PowerView(self, q)

    # ------------------------------------------------------------ array ops
    def asarray(self, value):
        if isinstance(value, torch.Tensor):
            return value.to(device=self.device, dtype=self.dtype)
        arr = np.asarray(value)
        if not arr.flags.writeable:  # torch refuses to share read-only memory
            return self.constant(arr)
        return torch.as_tensor(arr, dtype=self.dtype, device=self.device)

    def to_numpy(self, x):
        if isinstance(x, torch.Tensor):
            return x.detach().cpu().numpy()
        return np.asarray(x)

    def ones(self, shape):
        return torch.ones(tuple(shape), dtype=self.dtype, device=self.device)

    def placed(self, m, x, in_shape):
        """``(values, positions, channels)`` where map ``m`` applied to x keeps only some target channels
        (a concat operand): its output is zero but at ``positions`` (along axis 1, of ``channels``: an index
        tensor, or a slice for one run), which hold ``values`` (x itself where that is all of it, in order); None where it is a plain map (the walk then adds ``apply``'s output)."""
        if m.kind is not MapKind.CHANNEL_MAP:
            return None
        block = _channel_block(self, m)
        if block is not None and block[1] == x.shape[1] < len(m.index):  # all of x, in order, into one run
            return x, slice(block[0], block[0] + block[1]), len(m.index)
        _, mask, pos, src = _index_parts(self, m, m.index)
        if mask is None:
            return None
        return x.index_select(1, src), pos, len(m.index)

    def zeros(self, shape):
        return torch.zeros(tuple(shape), dtype=self.dtype, device=self.device)

    def take(self, x, axis: int, index):
        """``x``'s entries at ``index`` (a numpy int array) along ``axis``."""
        return x.index_select(axis, torch.as_tensor(index, dtype=torch.long, device=x.device))

    def pieces(self, x, axis: int, pieces):
        """``x`` along ``axis`` as ``pieces`` ``(start, length, repeated)`` end to end: ``length`` slices from
        ``start``, or (repeated) the slice ``start`` ``length`` times; one concatenation of views."""
        parts = []
        for start, length, repeated in pieces:
            if repeated:
                sizes = [-1] * x.ndim
                sizes[axis] = length
                parts.append(x.narrow(axis, start, 1).expand(*sizes))
            else:
                parts.append(x.narrow(axis, start, length))
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=axis)

    def bias(self, node: Node, ndim: int):
        return bcast(self.param(node.bias), ndim)

    def relu(self, x):
        return torch.relu(x)

    def kth_max_pool(self, node: Node, x, in_shape):
        m = node.edges[0].map
        in_shape = tuple(in_shape)
        out = m.out_shape(in_shape)[1:]
        n = len(out)
        if 0 in out:
            return x.new_zeros((x.shape[0], in_shape[0], *out))
        xf = _to_frame(x, m, in_shape, out, -math.inf)
        if node.k == 1:
            return _table(_MAX_POOL, n, "max-pool")(xf, m.kernel, m.stride, 0, m.dilation)
        for axis, (k, s, d) in enumerate(zip(m.kernel, m.stride, m.dilation)):
            xf = xf.unfold(2 + axis, d * (k - 1) + 1, s)
        windows = xf[(Ellipsis,) + tuple(slice(None, None, d) for d in m.dilation)]
        windows = windows.reshape(*windows.shape[: 2 + n], -1)
        return windows.topk(node.k, dim=-1).values[..., -1]

    def amax(self, x) -> float:
        if not x.numel():
            return 0.0
        lo, hi = torch.aminmax(x)  # no |x| temporary
        return max(float(hi), -float(lo))

    def total(self, x) -> float:
        return float(x.sum())

    def extrema(self, x) -> tuple[float, float]:
        if not x.numel():
            return 0.0, 0.0
        lo, hi = torch.aminmax(x)
        return float(lo), float(hi)

    def channel_amax(self, x):
        v = x.reshape(x.shape[0], x.shape[1], -1)
        if not v.numel():
            return np.zeros(tuple(v.shape[:2]))
        lo, hi = torch.aminmax(v, dim=2)  # no |x| temporary
        return torch.maximum(hi, -lo).cpu().numpy()

    def channel_sum(self, g):
        return g.reshape(g.shape[0], g.shape[1], -1).sum(dim=(0, 2))

    # ---------------------------------------------- activation patterns at data
    def pool_choice(self, node: Node, x, in_shape, kth=None):
        m, in_shape = node.edges[0].map, tuple(in_shape)
        out = m.out_shape(in_shape)[1:]
        kth = self.kth_max_pool(node, x, in_shape) if kth is None else kth
        views = list(_window_views(_to_frame(x, m, in_shape, out, -math.inf), m, out))
        choice = torch.zeros(kth.shape, dtype=torch.long, device=kth.device)
        for i in reversed(range(len(views))):  # the first offset attaining the k-th largest wins
            choice = torch.where(views[i] == kth, i, choice)
        return choice

    def _select_index(self, m, choice, frame):
        """Flat index, in the (C-flattened) frame, of each output's selected window entry."""
        out = choice.shape[2:]
        base = torch.zeros(out, dtype=torch.long, device=choice.device)
        offsets = torch.zeros(int(np.prod(m.kernel)), dtype=torch.long, device=choice.device)
        grid = list(itertools.product(*(range(k) for k in m.kernel)))
        stride = 1
        for axis in reversed(range(len(out))):
            pos = torch.arange(out[axis], device=choice.device) * m.stride[axis] * stride
            base = base + pos.reshape([-1 if a == axis else 1 for a in range(len(out))])
            offsets += torch.tensor([off[axis] * m.dilation[axis] * stride for off in grid], device=choice.device)
            stride *= frame[axis]
        return (base + offsets[choice]).reshape(*choice.shape[:2], -1)

    def select_apply(self, node: Node, choice, x, in_shape):
        m, in_shape = node.edges[0].map, tuple(in_shape)
        out = m.out_shape(in_shape)[1:]
        xf = _to_frame(x, m, in_shape, out, 0.0)
        xf = xf.expand(choice.shape[0], *xf.shape[1:]).reshape(choice.shape[0], xf.shape[1], -1)
        index = self._select_index(m, choice, _frame_sizes(m, m.kernel, out))
        return xf.gather(2, index).reshape(choice.shape)

    def select_adjoint(self, node: Node, choice, g, in_shape):
        m, in_shape = node.edges[0].map, tuple(in_shape)
        out = tuple(choice.shape[2:])
        frame = _frame_sizes(m, m.kernel, out)
        g = g.expand(*torch.broadcast_shapes(g.shape, choice.shape))
        gx = g.new_zeros((g.shape[0], in_shape[0], int(np.prod(frame))))
        gx.scatter_add_(2, self._select_index(m, choice, frame), g.reshape(g.shape[0], g.shape[1], -1))
        return _crop(gx.reshape(g.shape[0], in_shape[0], *frame), _pool_pads(m, in_shape), in_shape[1:])

    def row_amax(self, x):
        lo, hi = torch.aminmax(x.reshape(x.shape[0], -1), dim=1)  # no |x| temporary
        return torch.maximum(hi, -lo).cpu().numpy()

    def row_total(self, x):
        return x.reshape(x.shape[0], -1).sum(dim=1).cpu().numpy()


#: a dense weight larger than this is taken to the power q a block of rows at a
#: time, so |W|^q is never written out whole (VGG's classifier: 0.8 GB in float64)
_BLOCK_BYTES = 1 << 22


def _power_into(src: torch.Tensor, out: torch.Tensor, q: float) -> None:
    """out ← |src|^q (q = 0: 1 everywhere, a dense weight's every entry counted)."""
    if q == 0:
        out.fill_(1.0)
    elif q in (2, 4):  # multiplications: far cheaper than pow
        torch.mul(src, src, out=out)
        if q == 4:
            out.mul_(out)
    else:
        torch.abs(src, out=out)
        if q != 1:
            out.pow_(q)


class _PowerView(TorchBackend):
    """A TorchBackend whose weights are |w|^q of a base backend's (see power_view)."""

    def __init__(self, base: TorchBackend, q: float):
        super().__init__(base.device, base.dtype)
        self.base, self.q = base, float(q)

    def _power(self, t: torch.Tensor, keep_zeros: bool) -> torch.Tensor:
        if self.q == 0:
            return (t != 0).to(t.dtype) if keep_zeros else torch.ones_like(t)
        if self.q == 1:
            return t.abs()
        if self.q in (2, 4):  # multiplications: far cheaper than pow
            out = torch.square(t)
            return out.square_() if self.q == 4 else out
        return t.abs().pow_(self.q)

    def _row_blocks(self, p):
        """(first row, |W[rows]|^q) blocks of a large dense weight, computed into one
        reused buffer (fresh allocations would cost a page fault per 4 KiB); None if small."""
        W = self.base.param(p)
        if W.numel() * W.element_size() <= _BLOCK_BYTES:
            return None
        rows = max(1, _BLOCK_BYTES // (W.shape[1] * W.element_size()))
        buf = torch.empty((rows, W.shape[1]), dtype=W.dtype, device=W.device)

        def blocks():
            for i in range(0, W.shape[0], rows):
                out = buf[: min(rows, W.shape[0] - i)]
                _power_into(W[i:i + rows], out, self.q)
                yield i, out

        return blocks()

    def dense_powers(self, m, xs, views):
        """``[x @ (|W|^q).T for each view's q]`` of a large dense map read once, a block of rows at a
        time, every q's block computed from it while it is in cache (several path-norms at once);
        None where W is small (each view's own apply is then as cheap)."""
        W = self.base.param(m.W)
        if W.numel() * W.element_size() <= _BLOCK_BYTES:
            return None
        rows = max(1, _BLOCK_BYTES // (W.shape[1] * W.element_size()))
        buf = torch.empty((rows, W.shape[1]), dtype=W.dtype, device=W.device)
        xs = [x.reshape(x.shape[0], -1) for x in xs]
        outs = [x.new_empty((x.shape[0], W.shape[0])) for x in xs]
        for i in range(0, W.shape[0], rows):
            src, block = W[i:i + rows], buf[: min(rows, W.shape[0] - i)]
            for x, out, view in zip(xs, outs, views):
                _power_into(src, block, view.q)
                out[:, i:i + block.shape[0]] = x @ block.T
        return outs

    def _dense_apply(self, m, x, s):
        x = x.reshape(x.shape[0], -1)
        blocks = self._row_blocks(m.W)
        if blocks is None:
            return x @ self.param(m.W).T
        out = x.new_empty((x.shape[0], m.W.shape[0]))
        with one_torch_thread():  # cache-sized, memory-bound ops: `pathir.support.threads`
            for i, block in blocks:
                out[:, i:i + block.shape[0]] = x @ block.T
        return out

    def _dense_adjoint(self, m, g, s):
        blocks = self._row_blocks(m.W)
        if blocks is None:
            return (g @ self.param(m.W)).reshape(g.shape[0], *s)
        out = g.new_zeros((g.shape[0], m.W.shape[1]))
        with one_torch_thread():
            for i, block in blocks:
                out += g[:, i:i + block.shape[0]] @ block
        return out.reshape(g.shape[0], *s)

    rules = {**RULES, MapKind.DENSE: (_dense_apply, _dense_adjoint, RULES[MapKind.DENSE][2])}

    def constant(self, array) -> torch.Tensor:
        return self._power(self.base.constant(array), keep_zeros=True)

    def param(self, p) -> torch.Tensor:
        return self.cached(p, lambda: self._power(self.base.param(p), keep_zeros=False))

