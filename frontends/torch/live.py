"""Following a torch model after compile: has a tensor changed, has the structure?

A :class:`ModelWatch` remembers, at compile and after every write-back, two
things about the model: its *modules* (by path and identity, with their number
of hooks and their plain settings: eps, stride, padding, inplace, ...) and its *tensors* (by name: identity, shape, dtype, device, storage
pointer and strides, which ``.data = ...`` replaces, and autograd's version counter, bumped
by every in-place change: an optimizer step, ``load_state_dict``, an edit under
``torch.no_grad()``). Reading both costs about a millisecond on resnet50.

An in-place edit through ``tensor.data`` bypasses the version counter; call
``cm.refresh()`` after one. So do torch's fused optimizers (``fused=True``): their steps are
counted per parameter by a global optimizer step hook, registered with the first watch.
"""

from __future__ import annotations

import torch.nn as nn
from torch.nn.utils.prune import BasePruningMethod

__all__ = ["ModelWatch", "tensor_versions", "named_tensors", "fused_steps"]


#: id(parameter) -> the steps of fused optimizers that wrote it (those do not bump ``_version``)
_FUSED_STEPS: dict[int, int] = {}
_COUNTING: list = []  # the global hook's handle, once registered


def _count_fused_step(optimizer, args, kwargs) -> None:
    """After every optimizer step: count it on each parameter of a fused param group."""
    for group in optimizer.param_groups:
        if group.get("fused"):
            for p in group["params"]:
                _FUSED_STEPS[id(p)] = _FUSED_STEPS.get(id(p), 0) + 1


def fused_steps(tensors) -> tuple[int, ...]:
    """How many fused optimizer steps wrote each of ``tensors`` so far (counted once a watch registered the hook)."""
    _count_fused_steps()
    return tuple(_FUSED_STEPS.get(id(t), 0) for t in tensors)


def _count_fused_steps() -> None:
    """Register :func:`_count_fused_step` as a global optimizer step post-hook, once per process."""
    if not _COUNTING:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _COUNTING.append(register_optimizer_step_post_hook(_count_fused_step))


def named_tensors(model: nn.Module) -> list:
    """[(name, tensor)]: every parameter, then every buffer, as ``named_parameters(remove_duplicate=False)``
    then ``named_buffers(remove_duplicate=False)`` list them, read in one walk of the module tree."""
    params, buffers = [], []
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        params += [(dot + k, v) for k, v in module._parameters.items() if v is not None]
        buffers += [(dot + k, v) for k, v in module._buffers.items() if v is not None]
    return params + buffers


def tensor_versions(model: nn.Module) -> tuple:
    """What an in-place change moves: each parameter's and buffer's name, identity, version (a fused
    optimizer's steps counted in), storage, layout in it (strides and offset: ``w.data = w.data.t()`` keeps the
    pointer and the version), dtype, device and shape (last: ``changed`` reads it there)."""
    tensors = named_tensors(model)
    return tuple((name, id(t), (t._version, _FUSED_STEPS.get(id(t), 0)), t.data_ptr(), t.stride(), t.storage_offset(),
                  t.dtype, t.device, tuple(t.shape)) for name, t in tensors)


class ModelWatch:
    """The modules and tensor versions of ``model`` as last marked."""

    def __init__(self, model: nn.Module):
        self.model = model
        _count_fused_steps()
        self.mark()

    def modules(self) -> tuple:
        """Every module: (path, identity, type, hooks other than pruning's, settings, a forward set on the
        instance), then the global module hooks as one entry."""
        return (*((name, id(m), type(m).__name__, _hooks(m), _settings(m), id(m.__dict__.get("forward")))
                  for name, m in self.model.named_modules(remove_duplicate=False)), _global_hooks())

    def versions(self) -> tuple:
        return tensor_versions(self.model)

    def mark(self) -> None:
        """Take the model as it is now as the reference."""
        self._modules, self._versions = self.modules(), self.versions()

    def fresh(self) -> "ModelWatch":
        """A watch of the same model, marked now."""
        return type(self)(self.model)

    def moved(self) -> set[str] | None:
        """The names of the tensors that changed since :meth:`mark` (None if a name came or went)."""
        old, new = ({v[0]: v[1:] for v in vs} for vs in (self._versions, self.versions()))
        if old.keys() != new.keys():
            return None
        return {name for name, v in new.items() if old[name] != v}

    def changed(self) -> str | None:
        """None if nothing changed since :meth:`mark`; "values" if what changed can be re-read into
        the same graph (values, dtypes, devices, a tensor renamed by pruning's reparametrization);
        otherwise a sentence naming the first structural change (a module replaced, a hook added
        or removed, a tensor's shape)."""
        old_modules, modules, versions = self._modules, self.modules(), self.versions()
        if modules == old_modules and versions == self._versions:
            return None
        if modules[-1] != old_modules[-1]:
            return "a global module hook (torch.nn.modules.module.register_module_forward_hook, ...) was added or removed"
        old_modules, modules = old_modules[:-1], modules[:-1]
        old_paths, paths = [a[0] for a in old_modules], [b[0] for b in modules]
        if old_paths != paths:  # named by path: a position-wise compare would call the first shifted one replaced
            added = [p for p in paths if p not in set(old_paths)]
            removed = [p for p in old_paths if p not in set(paths)]
            if added:
                return f"modules were added: {', '.join(repr(p) for p in added[:3])} (a parametrization, a submodule)"
            if removed:
                return f"modules were removed: {', '.join(repr(p) for p in removed[:3])}"
        for a, b in zip(old_modules, modules):
            if a[0] == b[0] and a[1] == b[1] and a[2] != b[2]:
                return f"the class of '{a[0] or 'the model'}' changed from {a[2]} to {b[2]}"
            if a[0] != b[0] or a[1] != b[1]:
                return f"the module '{a[0] or 'the model'}' ({a[2]}) was replaced by '{b[0] or 'the model'}' ({b[2]})"
            if a[3] != b[3]:
                return f"hooks were added to or removed from '{a[0] or 'the model'}'"
            if a[5] != b[5]:
                return f"the forward of '{a[0] or 'the model'}' ({a[2]}) was replaced on the instance"
            if a[4] != b[4]:
                old, new = dict(a[4]), dict(b[4])
                key = next(k for k in sorted(old.keys() | new.keys()) if k not in old or k not in new or old[k] != new[k])
                was, now = (repr(d[key]) if key in d else "unset" for d in (old, new))
                return f"the setting '{key}' of '{a[0] or 'the model'}' ({a[2]}) changed from {was} to {now}"
        if len(old_modules) != len(modules):
            return f"modules were {'added' if len(modules) > len(old_modules) else 'removed'}"
        old_shapes, shapes = ({v[0]: v[-1] for v in vs} for vs in (self._versions, versions))
        for name in old_shapes.keys() & shapes.keys():
            if old_shapes[name] != shapes[name]:
                return f"'{name}' changed shape from {list(old_shapes[name])} to {list(shapes[name])}"
        before = set(self._versions)
        swapped = {v[0] for v in versions if v not in before}  # the tensors that moved
        for name, t in named_tensors(self.model):
            if name in swapped and t.is_inference():  # no version counter: its later edits would go unseen
                return (f"'{name}' is now a tensor made under torch.inference_mode(), which keeps no version "
                        "counter: pathir could not see its later edits (make it outside inference_mode)")
            if name in swapped and t.is_meta:
                return f"'{name}' is now a tensor on the meta device, which holds no values (materialize it first)"
        return "values"


_SIMPLE = frozenset({int, float, bool, str, type(None)})
_IGNORED = frozenset({"training", "momentum"})  # the mode is read per query; momentum only acts in training


def _simple(v) -> bool:
    t = type(v)
    return t in _SIMPLE or t is tuple and all(_simple(x) for x in v)


def _settings(module: nn.Module) -> tuple:
    """A torch.nn layer's plain settings (eps, stride, padding, inplace, negative_slope, ...): its
    public attributes that are numbers, strings, None or tuples of them, by name.
    A user's own module gives none: its attributes may be counters its forward moves, and one its
    forward reads as a constant is baked into the graph at compile (docs/live.md)."""
    if not type(module).__module__.startswith("torch.nn."):
        return ()
    return tuple(sorted((k, v) for k, v in module.__dict__.items() if k[0] != "_" and k not in _IGNORED and _simple(v)))


def _global_hooks() -> tuple:
    """The ids of the hooks registered for every module (torch.nn.modules.module's global tables)."""
    from torch.nn.modules import module as M

    tables = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
              "_global_backward_pre_hooks", "_global_forward_hooks_always_called")
    return tuple(tuple(getattr(M, t, {}).keys()) for t in tables)


def _hooks(module: nn.Module) -> tuple:
    """The handles' ids of the forward hooks and pre-hooks, not torch.nn.utils.prune's (the pruned weight is read
    again): a hook removed and another registered is a change (a count saw none)."""
    pre = tuple(k for k, h in module._forward_pre_hooks.items() if not isinstance(h, BasePruningMethod))
    return tuple(module._forward_hooks), pre
