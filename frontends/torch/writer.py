"""Write-back into a torch nn.Module: rescalings and masks, all at once.

A rescaling arrives as per-channel log-scales s (``{node name: (channels,)}``,
see :func:`pathir.rescaling.apply.log_scales`). A param on edge u -> v changes entry
[o, i] by out[o] · in[i], out = e^{s_v}[target channel], in = e^{-s_u}[source
channel] (``Map.weight_channels``); a bias of v by out = e^{s_v}. Each source
tensor of the param (``Param.sources``) takes its share by role:

- VALUE      the in-factor unless the param has IN_STATS sources, and the
             out-factor unless it has OUT_SCALE sources;
- OUT_SCALE  the out-factor e^{s_v} (batch-norm gamma and beta: a folded
             batch-norm's output scales with them, in train and eval mode);
- IN_STATS   the batch-norm's input is multiplied by λ = e^{s_u}: running_mean
             ← λ·mean, running_var ← λ²(var + eps) − eps (exact in eval mode;
             in train mode batch statistics scale with the input, only eps does not).

- CLIP_THRESHOLD  the threshold of a clipped ReLU (a bias of its unit: e^{s_v}),
             written where the lowering found it (frontends/torch/clipped.py): a
             threshold buffer in place; an nn.ReLU6 / nn.Hardtanh module replaced
             by a per-channel ``pathir.nn.ClippedReLU`` when its channels move
             (a factor exactly 1 everywhere keeps it); a functional call refused
             when it moves.

One (tensor, role) reached through several params must get one factor (checked);
each is applied once. Every new tensor is computed first (float64, then cast to
the tensor's own dtype and device) and assigned only when all succeeded, so on
any error the model is untouched.

Masks go through ``torch.nn.utils.prune.custom_from_mask`` on the VALUE tensor,
for params whose zeros are exactly its zeros.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Mapping

import numpy as np

from pathir.errors import PathirError, StaleReference
from pathir.frontends.core.param_write import derived, per_slice_factor, refresh, weight_norm_update
from pathir.frontends.core.values import f64
from pathir.frontends.core.write_rules import EntryFactor, check_variance, clip_threshold_names, mask_plan, source_factors
from pathir.frontends.torch.clipped import plan_clips
from pathir.frontends.torch.function_kept import Probe
from pathir.frontends.torch.shared_memory import overlaps, registered_names, self_overlapping
from pathir.ir import Graph, Role
from pathir.rescaling.commit import pruned_attributes
from pathir.support.threads import one_torch_thread

__all__ = ["TorchWriter"]


def _with_paths(method):
    """Run ``method`` with the model's modules looked up once by path (a write locates each tensor's
    module several times: ``get_submodule`` walks the path every time)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self._paths is not None:  # called from another public method
            return method(self, *args, **kwargs)
        self._paths = dict(self.model.named_modules(remove_duplicate=False))
        try:
            return method(self, *args, **kwargs)
        finally:
            self._paths = None

    return wrapper


class TorchWriter:
    """Write-back handle of a torch model (``cm.writer`` of a compiled nn.Module).

    Examples
    --------
    >>> import numpy as np, torch, pathir
    >>> from pathir.rescaling.apply import log_scales
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1)).double()
    >>> cm = pathir.compile(net, input_shape=(2,))
    >>> x = torch.randn(4, 2, dtype=torch.float64)
    >>> before = net(x)
    >>> TorchWriter(net).rescale(cm.graph, log_scales(cm.graph, cm.units, [1.0, -2.0, 0.5]))
    >>> bool(torch.allclose(net(x), before, rtol=1e-12, atol=0))
    True
    """

    def __init__(self, model, train_only=(), clips=None, train_paths=(), why_not=""):
        self.model = model
        self.train_only = list(train_only)  # modules only the train-mode forward runs (train_branches)
        self.train_paths = list(train_paths)  # modules in train mode in the forward the graph computes
        self.why_not = why_not  # why the heads forward could not be lowered ("" if not tried or lowered)
        self.clips = dict(clips or {})  # threshold param -> ClipSite (frontends/torch/clipped.py)
        self._paths = None  # path -> module while one public call runs (`_with_paths`)
        self._written = None  # the probe of the last rescale, until check_written() reads it
        self._shared: list = []  # (written, other) tensors over one memory in the last rescale (shared_memory)
        self.reference = None  # the model's outputs on a probe, recorded with its stamp (function_kept.Reference)
        self._checked = None  # a weak reference to the last graph check_rescalable passed

    # ------------------------------------------------------------ helpers
    def _locate(self, name: str):
        """(module, attribute) of a tensor name such as ``layer1.0.bn1.running_var``."""
        path, _, attr = name.rpartition(".")
        if self._paths is not None and path in self._paths:
            return self._paths[path], attr
        try:
            module = self.model.get_submodule(path) if path else self.model
        except AttributeError as err:
            raise PathirError(f"source tensor '{name}' not found in the model: {err}") from None
        return module, attr

    def _tensor(self, name: str):
        """The stored tensor behind ``name`` (``<attr>_orig`` when torch.nn.utils.prune pruned it: a pruning
        hook for ``attr`` exists; a tensor the user happened to name ``<attr>_orig`` is not it)."""
        import torch

        module, attr = self._locate(name)
        orig = getattr(module, attr + "_orig", None) if torch_pruned(module, attr) else None
        t = orig if isinstance(orig, torch.Tensor) else getattr(module, attr, None)
        if not isinstance(t, torch.Tensor):
            hint = (" (torch.export made it a constant: a tensor outside the model's parameters and buffers, such as "
                    "one of a module held in a plain list; register that module to have it rescaled)"
                    if attr.startswith("lifted_tensor") else "")
            raise PathirError(f"source tensor '{name}' not found in the model{hint}; the model is untouched")
        return module, attr, t

    def source_shape(self, name: str) -> tuple | None:
        """The shape the model holds tensor ``name`` in (a pruned one's, a parametrization's output's), or None where
        the model holds no such tensor."""
        import torch

        try:
            module, attr = self._locate(name)
        except PathirError:
            return None
        t = getattr(module, attr, None)
        return tuple(t.shape) if isinstance(t, torch.Tensor) else None

    # ------------------------------------------------------------ rescaling
    @_with_paths
    def rescale(self, graph: Graph, log_scales: Mapping[str, np.ndarray]) -> None:
        """Apply the rescaling given by per-channel ``log_scales`` to the model.

        ``graph`` is the compiled graph whose params name the model's tensors.
        Raises PathirError (model untouched) if the log-scales are not a
        rescaling of the graph, a tensor is missing, or one tensor would get
        two different factors.
        """
        import torch
        from torch.nn.utils import parametrize

        if getattr(parametrize, "_cache_enabled", 0):
            raise PathirError("write-back refused inside torch.nn.utils.parametrize.cached(): a parametrized layer "
                              "would keep the weight it cached before the write while its neighbours are rescaled; "
                              "write outside the context. The model is untouched")
        self.check_rescalable(graph)
        # each tensor's factors are computed when it is reached and dropped once its new value is
        # (lazy: a large layer's factor is applied a block of rows at a time, never held whole)
        by_tensor = source_factors(graph, log_scales, lazy=True)
        clips = plan_clips(self.model, graph, self.clips,
                           {n: by_tensor.pop(n)() for n in clip_threshold_names(graph) if n in by_tensor})
        by_tensor.update({name: (lambda sides=sides: sides) for name, sides in clips.tensors.items()})
        updates = []  # (tensor, new value) computed before anything is written
        seen: dict[int, tuple[str, object]] = {}
        for name, sides_of in by_tensor.items():
            for t, new_t, module, attr in self._updates(name, sides_of()):
                if id(t) in seen:  # one tensor under two names (tied weights)
                    other, other_new = seen[id(t)]
                    if not torch.allclose(other_new.double(), new_t.double(), rtol=1e-9, atol=0):
                        held = [n for n, x in self.model.named_parameters(remove_duplicate=False) if x is t]
                        raise PathirError(f"tensors '{other}' and '{name}' are one tensor (the model holds it as "
                                          f"{', '.join(repr(n) for n in held) or 'a buffer'}: tied weights) but "
                                          "would be rescaled differently: the layers reading it do not share their "
                                          "units. Untie them (a copy per layer) to rescale; the model is untouched")
                    continue
                seen[id(t)] = (name, new_t)
                updates.append((t, new_t, module, attr))
        names = {ident: name for ident, (name, _) in seen.items()}
        for t, _, _, _ in updates:
            if self_overlapping(t):
                raise PathirError(f"write-back refused: entries of '{names[id(t)]}' share one memory location (an "
                                  "expanded tensor, stride 0), which a rescaling would give different factors; give it "
                                  "its own memory (nn.Parameter(w.detach().clone())). The model is untouched")
        shared = overlaps(self.model, [(names[id(t)], t) for t, _, _, _ in updates])
        # the function before the write, compared after it (check_written): on every write, not only where it
        # reaches past what the graph sees (a buffer, shared memory, a replaced module): a tensor taken for the
        # wrong one (a user's own 'weight_orig' read as torch prune's) changed the function of a model of
        # parameters only, unseen. Its "before" is mostly a forward already run (the self-check's, the last write's)
        probe = Probe(self.model, graph, self.train_paths, self.reference) if updates or clips.replace.entries else None
        with torch.no_grad():
            for t, new_t, _, _ in updates:
                t.copy_(new_t)
            if shared:  # a later write may have overwritten an earlier one: each must hold what it was given
                for t, new_t, _, _ in updates:
                    if not torch.equal(t, new_t):
                        pairs = ", ".join(f"'{a}' and '{b}'" for a, b in shared)
                        raise PathirError(
                            f"write-back refused: {pairs} are different tensors over the same memory (e.g. "
                            "nn.Parameter(other.weight.data), register_buffer(..., p.data)), which the rescaling "
                            f"gives different values: '{names[id(t)]}' would not hold its own. Give each its own "
                            "memory (.detach().clone()), or use one tensor under both names. The model is untouched")
        self._shared = shared
        clips.apply()  # clipped ReLU modules whose thresholds moved: per-channel ClippedReLUs
        if clips.replace.entries:  # (a reference outside the module tree would keep calling the old one)
            clips.replace.check_unused(self.model, tuple(probe.inputs))
        for _, _, module, attr in updates:
            _refresh_pruned(module, attr)
            _refresh_derived(module, attr)
        self._written = probe

    def check_written(self) -> None:
        """Refuse (PathirError) the last :meth:`rescale` if the model's function moved on its probe
        (``pathir.frontends.torch.function_kept``); ``commit_rescaling`` calls it after the dtype range
        check and before any bias absorption, inside the transaction that puts the model back."""
        probe, self._written = self._written, None
        if probe is not None:
            self.reference = None
            try:
                probe.check()
            except StaleReference:
                raise
            except PathirError as err:
                if not self._shared:
                    raise
                pairs = ", ".join(f"'{a}' shares memory with '{b}'" for a, b in self._shared)
                raise PathirError(f"{err} ({pairs}: a tensor made from another's .data, which the rescaling writes "
                                  "through; give it its own memory with .detach().clone())") from err
            self.reference = probe.after  # the written model's outputs: the next write's "before"

    @_with_paths
    def shift_biases(self, graph: Graph, shifts: Mapping[str, np.ndarray]) -> None:
        """Add ``shifts[name]`` (the param's layout) to the tensor behind each named bias param of ``graph``:
        the param's one VALUE tensor, which enters it with coefficient 1 (a plain bias, or a batch-norm β;
        ``pathir.equalization.absorb.writable_bias_ref``). All computed before any is written."""
        import torch

        updates = []
        for p in graph.params():
            if p.name not in shifts:
                continue
            (ref,) = [r for r in p.sources if r.role is Role.VALUE]
            module, attr = self._locate(ref.name)
            if derived(module, attr, ref.name) is not None:
                raise PathirError(f"'{ref.name}' is computed from other tensors (a parametrization or a hook): a "
                                  "constant cannot be added to it; the model is untouched")
            module, attr, t = self._tensor(ref.name)
            delta = np.asarray(shifts[p.name], dtype=np.float64).reshape(tuple(t.shape))
            new = t.detach().to("cpu", torch.float64) + torch.from_numpy(delta)
            updates.append((t, new.to(dtype=t.dtype, device=t.device)))
        with torch.no_grad():
            for t, new in updates:
                t.copy_(new)

    @_with_paths
    def param_factors(self, graph: Graph, log_scales: Mapping[str, np.ndarray]) -> list[tuple[object, object]]:
        """[(stored tensor, factor)] for every stored tensor the rescaling multiplies entrywise
        (running statistics excepted): factor is a float64 array of the tensor's shape, the one
        :meth:`rescale` multiplies it by, or a str saying why the tensor's change is no entrywise
        factor (a weight_norm g whose rescaling also moves v non-uniformly). Nothing is written."""
        out, seen = [], set()
        for name, sides in source_factors(graph, log_scales).items():
            if Role.IN_STATS in sides or Role.CLIP_THRESHOLD in sides:  # no optimizer state: not parameters
                continue
            module, attr = self._locate(name)
            d = derived(module, attr, name)
            if d is None:
                module, attr, t = self._tensor(name)
                pairs = [(t, self._new_value(name, module, attr, np.ones(tuple(t.shape)), sides))]
            elif d.kind == "weight_norm":
                pairs = _weight_norm_factors(name, d, self._new_value(name, module, attr, np.ones(tuple(d.v.shape)),
                                                                      sides))
            else:
                raise PathirError(d.why)
            for t, f in pairs:
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append((t, f))
        return out

    @_with_paths
    def check_rescalable(self, graph: Graph) -> None:
        """Raise PathirError if a rescaling of ``graph`` cannot be written exactly: modules that only
        the train-mode forward runs (train_branches), or a source tensor computed by a spectral norm
        or an unknown parametrization (param_write). Nothing is written either way. A graph checked
        already (the early check before a solver, then the write) is not checked again."""
        if self._checked is not None and self._checked() is graph:
            return
        if self.train_only:
            how = (f"lowering them as extra outputs failed ({self.why_not}); " if self.why_not else
                   "compile the model in train mode (model.train()) to have them as extra outputs of the graph, "
                   "which a rescaling then keeps, or ")
            raise PathirError(
                f"write-back refused: module(s) {', '.join(self.train_only)} run only in train mode (the eval graph "
                "pathir analyses does not contain them) and read channels a rescaling changes, so their train-mode "
                f"output would change; {how}build the model without them (e.g. aux_logits=False) or drop them "
                "(model.<name> = None) before rescaling. The model is untouched")
        names = dict.fromkeys(ref.name for p in graph.params() for ref in p.sources
                              if ref.role is not Role.CLIP_THRESHOLD)  # (a module, buffer or call: clipped.py)
        for name in names:  # each tensor once (a batch-norm's γ is a source of its conv's weight and bias)
            module, attr = self._locate(name)
            d = derived(module, attr, name)
            if d is not None and d.kind == "refused":
                raise PathirError(d.why)
            if d is None:
                self._tensor(name)  # a tensor the model holds (not a constant export lifted)
        self._checked = weakref.ref(graph)

    def _updates(self, name, sides):
        """[(stored tensor, its new value, module, attribute)] for source tensor ``name``;
        a derived weight (weight_norm) is written through its g and v; other derived
        weights (spectral_norm, unknown parametrizations) are refused."""
        import torch

        module, attr = self._locate(name)
        d = derived(module, attr, name)
        if d is None:
            module, attr, t = self._tensor(name)
            if Role.IN_STATS not in sides and t.dim() and all(_by_rows(f, t) for f in sides.values()):
                return [(t, self._new_value_by_rows(name, module, attr, t, sides), module, attr)]
            old = f64(t)  # this call's own copy: the product below is computed in place
            new = self._new_value(name, module, attr, old, sides)
            new_t = torch.as_tensor(new, dtype=torch.float64).to(dtype=t.dtype, device=t.device)
            if attr == "running_var" and Role.IN_STATS in sides:
                check_variance(f"'{name.rpartition('.')[0]}'", float(getattr(module, "eps")), new,
                               new_t.detach().to("cpu", torch.float64).numpy(), "the model is untouched",
                               torch.finfo(t.dtype).eps, str(t.dtype).replace("torch.", ""))
            return [(t, new_t, module, attr)]
        if d.kind != "weight_norm" or Role.IN_STATS in sides:
            raise PathirError(d.why or f"'{name}' is weight-normalized and cannot hold running statistics")
        old = f64(getattr(module, attr))
        factor = self._new_value(name, module, attr, np.ones_like(old), sides)
        return [(t, new_t, module, attr) for t, new_t in weight_norm_update(d, factor)]

    def _new_value_by_rows(self, name, module, attr, t, sides: dict[Role, object]):
        """:meth:`_new_value` of tensor ``t`` (no running statistics) a block of its leading rows at a
        time, cast to t's dtype and device: the same float64 products entry by entry, without a
        float64 copy of a large tensor, or of its factor, ever held whole."""
        import torch

        shape = tuple(t.shape)
        factors = {role: f if isinstance(f, EntryFactor) else np.asarray(f).reshape(shape) for role, f in sides.items()}
        source = t.detach()
        step = max(1, _BLOCK // max(1, math.prod(shape[1:])))
        if step >= shape[0]:  # one block: the product converted back whole (most tensors of a model)
            block = source.to("cpu", torch.float64, copy=True).numpy()
            rows = {role: f.rows(0, shape[0]) if isinstance(f, EntryFactor) else f for role, f in factors.items()
                    if not (isinstance(f, EntryFactor) and f.scale_rows(block, 0, shape[0]))}
            return torch.from_numpy(self._new_value(name, module, attr, block, rows)).to(dtype=t.dtype, device=t.device)
        new = torch.empty(shape, dtype=t.dtype)
        with one_torch_thread():  # a loop of cache-sized conversions (`pathir.support.threads`)
            for i in range(0, shape[0], step):
                j = min(i + step, shape[0])
                block = source[i:j].to("cpu", torch.float64, copy=True).numpy()
                rows = {role: f.rows(i, j) if isinstance(f, EntryFactor) else f[i:j] for role, f in factors.items()
                        if not (isinstance(f, EntryFactor) and f.scale_rows(block, i, j))}  # (else scaled already)
                new[i:j] = torch.from_numpy(self._new_value(name, module, attr, block, rows))
        return new.to(device=t.device)

    @staticmethod
    def _new_value(name, module, attr, old: np.ndarray, sides: dict[Role, np.ndarray]) -> np.ndarray:
        """The new value of a tensor from ``old``, a float64 copy this writer owns (overwritten)."""
        def fit(f):
            f = np.asarray(f)
            if f.size != old.size:
                raise PathirError(f"source tensor '{name}' has {old.size} entries, its rescaling factor {f.size}")
            return f.reshape(old.shape)

        if Role.IN_STATS in sides:
            if len(sides) > 1:
                raise PathirError(f"source tensor '{name}' is both running statistics and a rescaled value")
            lam = fit(sides[Role.IN_STATS])
            if attr == "running_mean":
                return lam * old
            if attr == "running_var":
                eps = float(getattr(module, "eps"))
                return np.where(lam == 1.0, old, lam**2 * (old + eps) - eps)  # (λ = 1: old, no ulp moved)
            raise PathirError(f"source tensor '{name}' has role in_stats but is neither running_mean nor running_var")
        for f in sides.values():  # ``old`` is this call's own float64 copy: scaled in place
            old *= fit(f)
        return old

    # ------------------------------------------------------------ masks
    @_with_paths
    def mask(self, graph: Graph, masks: Mapping[str, np.ndarray]) -> None:
        """Prune the model: ``masks`` maps a param name (or its source name) to a
        bool array of the param's shape (True: keep). Applied with
        ``torch.nn.utils.prune.custom_from_mask`` on the VALUE tensor, all at once.

        Raises PathirError (model untouched) for a param whose value is not its
        source tensor up to per-channel factors (an unfolded batch-norm, a folded
        batch-norm bias): zeroing that tensor would not zero the param."""
        import torch
        from torch.nn.utils import prune

        plan, targets, tensors = [], set(), {}
        names_of = registered_names(self.model)  # tensor -> every name the model registers it under
        for p, m, ref in mask_plan(graph, masks):
            m = ref.to_source(m)
            module, attr = self._locate(ref.name)
            if derived(module, attr, ref.name) is not None:
                raise PathirError(f"'{ref.name}' is computed from other tensors (a parametrization or a "
                                  "weight/spectral-norm hook): it cannot be pruned by a mask")
            module, attr, t = self._tensor(ref.name)
            pruned = torch_pruned(module, attr)
            if not isinstance(module._parameters.get(attr + "_orig" if pruned else attr), torch.nn.Parameter):
                raise PathirError(f"'{ref.name}' is not a parameter of the model: it cannot be pruned")
            taken = [n for n in (attr + "_orig", attr + "_mask") if not pruned and hasattr(module, n)]
            if taken:
                raise PathirError(f"'{ref.name}' cannot be pruned: its module already has an attribute "
                                  f"'{taken[0]}', the name torch.nn.utils.prune gives the original or the mask; "
                                  "rename it. The model is untouched")
            if m.size != t.numel():
                raise PathirError(f"mask for '{p.name}' has {m.size} entries, tensor '{ref.name}' {t.numel()}")
            if (id(module), attr) in targets:
                raise PathirError(f"two masks for the tensor '{ref.name}'")
            held = names_of.get(id(t), [])
            if id(t) in tensors or len(held) > 1:  # one tensor under two names
                other = tensors.get(id(t)) or next(n for n in held if n != ref.name)
                raise PathirError(
                    f"'{other}' and '{ref.name}' are one tensor (tied weights): torch.nn.utils.prune reparametrizes "
                    "each module on its own, which would untie them and mask one use only; pruning tied weights is "
                    "not offered. The model is untouched")
            targets.add((id(module), attr))
            tensors[id(t)] = ref.name
            # (a copy: a transposed convolution's mask is a flipped view, which torch cannot take)
            plan.append((module, attr, torch.as_tensor(np.ascontiguousarray(m.reshape(tuple(t.shape))), device=t.device)))
        saved = [(module, attr, dict(module._parameters), dict(module._buffers), dict(module._forward_pre_hooks),
                  module.__dict__.get(attr, _MISSING)) for module, attr, _ in plan]
        try:
            for module, attr, mask in plan:
                prune.custom_from_mask(module, name=attr, mask=mask)
        except BaseException:  # all or nothing: every module as it was (tables restored, not re-derived)
            for module, attr, params, buffers, hooks, value in saved:
                for table, old in ((module._parameters, params), (module._buffers, buffers),
                                   (module._forward_pre_hooks, hooks)):
                    table.clear()
                    table.update(old)
                if value is _MISSING:
                    module.__dict__.pop(attr, None)
                else:
                    module.__dict__[attr] = value
            raise


_MISSING = object()


def torch_pruned(module, attr: str) -> bool:
    """Whether torch.nn.utils.prune reparametrized ``module.attr`` (a pruning hook for it: the tensor then
    lives in ``attr + "_orig"``)."""
    return attr in pruned_attributes(module)


#: entries of a tensor rescaled at once in float64 by ``TorchWriter._new_value_by_rows`` (2 MiB: the block,
#: its factor and its cast stay in cache; on alexnet 1 << 21 was 1.4-1.6x slower, 1 << 16 1.1-1.2x)
_BLOCK = 1 << 18


def _by_rows(f, t) -> bool:
    """Whether factor ``f`` can be applied to tensor ``t`` a block of its leading rows at a time."""
    if isinstance(f, EntryFactor):
        return f.by_rows and f.shape == tuple(t.shape)
    return np.size(f) == t.numel()




def _weight_norm_factors(name: str, d, factor: np.ndarray) -> list[tuple[object, object]]:
    """[(g, factor), (v, factor)] of a weight-normalized weight rescaled by ``factor``: a factor
    constant on each slice moves g alone (linearly, v untouched); any other moves v and g by a
    ratio of norms, a change whose gradients are no entrywise rescaling of the old ones."""
    import torch

    dim = d.dim if d.dim is not None else -1
    per_slice = per_slice_factor(torch.as_tensor(factor, dtype=torch.float64), dim)
    if per_slice is not None:
        return [(d.g, per_slice.reshape(tuple(d.g.shape)).numpy()), (d.v, np.ones(tuple(d.v.shape)))]
    why = (f"'{name}' is weight-normalized (w = g v/|v|) and the rescaling is not constant on its norm slices: "
           "g and v move by a ratio of norms, so their gradients, and any optimizer state built from them, do not "
           "rescale entrywise")
    return [(d.g, why), (d.v, why)]


def _refresh_pruned(module, attr: str) -> None:
    """Recompute a pruned tensor (orig * mask) after its orig changed, as the prune hook does."""
    from torch.nn.utils.prune import BasePruningMethod

    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, BasePruningMethod) and hook._tensor_name == attr:
            setattr(module, attr, hook.apply_mask(module))


def _refresh_derived(module, attr: str) -> None:
    """Recompute a legacy weight_norm weight after its g and v changed, as its hook does."""
    d = derived(module, attr, attr)
    if d is not None and d.kind == "weight_norm":
        refresh(module, attr, d)


