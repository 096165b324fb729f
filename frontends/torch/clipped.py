"""Clipped ReLUs of a torch model: where each threshold lives, how a rescaling is written to it,
and how to trade every clipped ReLU for a plain ReLU.

A clipped ReLU min(max(x, 0), t) is lowered with its threshold as the param −t of a unit
(docs/ir.md, "Clipped ReLUs"); a rescaling moves it per channel (t ← e^s t). The lowering records
for each threshold param a :class:`ClipSite`, what holds the threshold in the model:

- ``module``: an ``nn.ReLU6`` / ``nn.Hardtanh(0, t)`` module (exactly those classes), called as a
  module (torch.fx) or the module an ATen op runs in (torch.export). A rescaling that moves its
  channels replaces it by a :class:`pathir.nn.ClippedReLU` with the per-channel thresholds
  (``setattr`` on its parent, under every name the module is registered under); a factor exactly 1
  on every channel keeps it;
- ``buffer``: a threshold buffer (``pathir.nn.ClippedReLU.threshold``, or any buffer in
  ``torch.minimum(relu(x), buf)``), rescaled in place like any tensor;
- ``call``: a functional call (``F.relu6(x)``, ``torch.clamp(x, 0, t)``) whose threshold is a
  number in the code: a rescaling that moves it cannot be written and is refused, naming the call.

:func:`clipped_to_relu` is the other way out (the ``relu6="relu"`` option of equalization, as AIMET
and Quark do): every clipped ReLU module becomes ``nn.ReLU``, and the output change is reported.

A replacement stands in for its module (:func:`stand_in`): one new module per old one, set at every
name the old one is registered under (an alias stays an alias), with the old one's train/eval flag and
its hook tables (the same dict objects: the forward hooks were traced as part of the function, and a
handle the user holds still removes its hook). A hook bound to the module itself (a state_dict hook) is
refused before anything changes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
import torch.nn as nn

from pathir.errors import PathirError
from pathir.frontends.core.values import f64
from pathir.frontends.torch.inputs import eval_forward, model_dtype_device
from pathir.ir import Role
from pathir.nn import ClippedReLU

__all__ = ["ClipSite", "WRITABLE", "CARRIED_HOOKS", "module_threshold", "stand_in", "ModuleSwap", "swap_everywhere",
           "ClipPlan", "plan_clips", "ReluSwap", "relu_swap", "measure_swap", "clipped_to_relu"]

#: the module classes a clipped ReLU is written back into by replacement (a subclass may do more)
WRITABLE = (nn.ReLU6, nn.Hardtanh)

#: the hook tables of an nn.Module a replacement takes over as they are: forward (pre-)hooks (traced
#: with the module, so part of the function), their with-kwargs and always-called flags, backward hooks
CARRIED_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
                 "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


@dataclass(frozen=True)
class ClipSite:
    """What holds one threshold param in the model: ``kind`` module / buffer / call; ``target`` the
    module path, the buffer name, or a description of the call; ``trailing``: the axes after the channels'
    in the activation it clips (what a :class:`pathir.nn.ClippedReLU` written there broadcasts its thresholds
    against, ``spatial_dims``; a buffer: its one axis of more than one entry is the channels'), None where no
    threshold tensor of that shape holds one value per channel (the channels of a permuted layout along no single
    axis; a buffer along another axis): a rescaling there cannot be written, and holds them."""

    kind: str
    target: str
    trailing: int | None = 0


def module_threshold(module, channels: int) -> np.ndarray:
    """The threshold of a clipped ReLU module as one float64 entry per channel (a copy)."""
    if isinstance(module, ClippedReLU):
        t = f64(module.threshold).reshape(-1)
    elif isinstance(module, nn.Hardtanh):
        t = np.full(channels, float(module.max_val))
    else:
        raise PathirError(f"{type(module).__name__} holds no clipped-ReLU threshold")
    if t.size != channels:
        raise PathirError(f"a clipped ReLU of {t.size} thresholds reads {channels} channels")
    return t


def stand_in(path: str, old: nn.Module, new: nn.Module) -> nn.Module:
    """``new`` made ready to take the place of ``old`` (at ``path``): ``old``'s train/eval flag and its
    hook tables (:data:`CARRIED_HOOKS`, the same dict objects, so a user's handle still removes its hook).
    ``old`` is not changed. PathirError for a hook no replacement can carry (nothing changed)."""
    for attr, table in vars(old).items():
        if "hook" in attr and isinstance(table, dict) and table and attr not in CARRIED_HOOKS:
            raise PathirError(
                f"the clipped ReLU '{path}' ({type(old).__name__}) has hooks in {attr}, which are bound to the module "
                f"itself: pathir cannot move them to the {type(new).__name__} that replaces it; remove them (forward "
                "and backward hooks are carried over). The model is untouched")
    for attr in CARRIED_HOOKS:
        setattr(new, attr, getattr(old, attr))
    new._is_full_backward_hook = old._is_full_backward_hook
    new.training = old.training
    return new


@dataclass
class ModuleSwap:
    """Module replacements, one entry per name a replaced module is registered under:
    [(parent, attribute, old module, new module)]. ``apply`` sets every new one, ``undo`` every old one."""

    entries: list
    names: dict = field(default_factory=dict)  # id(old module) -> its first name in the model

    def apply(self) -> None:
        for parent, attr, _, new in self.entries:
            setattr(parent, attr, new)

    def undo(self) -> None:
        for parent, attr, old, _ in self.entries:
            setattr(parent, attr, old)

    def check_unused(self, model: nn.Module, args: tuple) -> None:
        """Run ``model`` once on ``args`` (eval mode, no gradients; the swap applied) with every replaced
        module marked: PathirError naming it where the forward still calls one. Such a module is held
        outside the module tree (a plain list, a closure), where no replacement reaches it, and would
        keep the old behaviour (its old threshold) under the rescaled weights. The marks are removed."""
        called, saved = [], []
        for _, _, old, _ in self.entries:
            if any(o is old for o, _ in saved):
                continue
            own = vars(old).get("forward", _NO_FORWARD)
            saved.append((old, own))
            bound = own if own is not _NO_FORWARD else type(old).forward.__get__(old)
            where = f"{self.names.get(id(old), '?')}' ({type(old).__name__}"
            object.__setattr__(old, "forward", partial(_marked, called, where, bound))
        try:
            with eval_forward(model), torch.no_grad():
                model(*args)
        except Exception as err:
            raise PathirError(f"write-back refused: running the model to check that no replaced module is still "
                              f"called failed ({type(err).__name__}: {err}); the model is untouched") from err
        finally:
            for old, own in saved:
                if own is _NO_FORWARD:
                    object.__delattr__(old, "forward")
                else:
                    object.__setattr__(old, "forward", own)
        if called:
            raise PathirError(
                f"write-back refused: the forward still calls the module '{called[0]}) "
                "through a reference outside the module tree (a plain list, dict or closure), where its replacement "
                "cannot reach; register it as a submodule (nn.ModuleList, nn.ModuleDict, an attribute). The model "
                "is untouched")


_NO_FORWARD = object()


def _marked(called: list, name: str, forward, *args, **kwargs):
    """A replaced module's forward while :meth:`ModuleSwap.check_unused` runs: noted, then run."""
    called.append(name)
    return forward(*args, **kwargs)


def swap_everywhere(model: nn.Module, pairs) -> ModuleSwap:
    """The swap of each (old, new) of ``pairs`` at every name ``old`` has in ``model``, so that every call
    of ``old``, through any of its names, reaches ``new`` (one object: modules shared stay shared)."""
    new_of = {id(old): new for old, new in pairs}
    entries, names = [], {}
    for path, m in model.named_modules(remove_duplicate=False):
        if id(m) in new_of:
            if not path:
                raise PathirError(f"the model itself is the clipped ReLU {type(m).__name__}: pathir replaces a "
                                  "submodule only; the model is untouched")
            parent, _, attr = path.rpartition(".")
            entries.append((model.get_submodule(parent), attr, m, new_of[id(m)]))
            names.setdefault(id(m), path)
    return ModuleSwap(entries, names)


@dataclass
class ClipPlan:
    """A write-back's clipped-ReLU part, computed before anything is written: buffers to rescale as
    tensors (``{buffer name: {role: factor}}``) and the module replacements (a :class:`ModuleSwap`)."""

    tensors: dict
    replace: ModuleSwap

    def apply(self) -> None:
        self.replace.apply()


def pin_unwritable(model, graph, sites: dict):
    """``graph`` with the clipped ReLU thresholds no write-back can move marked ``fixed`` (find_units then pins
    their channels, and every rescaling pathir finds leaves them where they are): a functional call's number, a
    module pathir does not write into, one module called on tensors of several widths or ranks, and a buffer
    holding one value for several channels. :func:`plan_clips` refuses a move of each of them. The params of one
    module called on one width (torch.export names each call's) become one, as the fx path makes it."""
    users: dict[str, list] = {}
    for n in graph.nodes:
        if n.bias is not None:
            users.setdefault(n.bias.name, []).append(n)
    widths = {p.name: p.shape[0] for p in graph.params() if p.name in sites}
    by_module: dict = {}  # id(module), or a buffer's name -> the params read from it
    fixed = set()
    for name, site in sites.items():
        if name not in widths:
            continue
        if site.kind == "call":
            fixed.add(name)
        elif site.kind == "buffer":
            numel = model.get_buffer(site.target).numel()
            if (numel not in (widths[name], 0) or site.trailing is None and numel > 1) and widths[name] > 1:
                fixed.add(name)
            by_module.setdefault(site.target, []).append(name)  # (one buffer read on several widths: held)
        else:
            module = model.get_submodule(site.target)
            if not isinstance(module, ClippedReLU) and type(module) not in WRITABLE or site.trailing is None:
                fixed.add(name)
            by_module.setdefault(id(module), []).append(name)
    shared = {}  # param name -> the name of the one param every call of its module reads (torch.export names each)
    for names in by_module.values():
        names = list(dict.fromkeys(names))
        ranks = {len(n.shape) for name in names for n in users.get(name, ())}
        layouts = {sites[name].trailing for name in names}
        if len({widths[name] for name in names}) > 1 or len(ranks) > 1 or len(layouts) > 1:
            fixed.update(names)
        elif len(names) > 1 and not fixed.intersection(names):
            shared.update((name, names[0]) for name in names[1:])
    if not fixed and not shared:
        return graph
    params = {p.name: p for p in graph.params()}

    def pinned(p):
        if p.name in shared:  # one module called twice on one width: one param, its channels tied as on the fx path
            return pinned(params[shared[p.name]])
        if p.name not in fixed:
            return p
        return dataclasses.replace(p, sources=tuple(dataclasses.replace(r, fixed=True) if r.role is Role.CLIP_THRESHOLD
                                                    else r for r in p.sources))

    return graph.map_params(pinned)


def plan_clips(model, graph, sites: dict, sides: dict) -> ClipPlan:
    """The plan for the threshold sources ``sides`` ({source name: {Role.CLIP_THRESHOLD: factor (C,)}}).

    Refuses (PathirError, nothing written) a moved threshold of a functional call, a module called
    at several places whose thresholds would move apart, a threshold its dtype cannot hold, and a
    module with a hook its replacement cannot carry (:func:`stand_in`). A module is grouped by
    identity, whatever name its calls were lowered under, and replaced under every name."""
    users: dict[int, list] = {}  # id(threshold param) -> the nodes it is the bias of (one per call)
    for n in graph.nodes:
        if n.bias is not None:
            users.setdefault(id(n.bias), []).append(n)
    params = {p.name: p for p in graph.params()}
    tensors, by_module = {}, {}
    for name, roles in sides.items():
        f = np.asarray(next(iter(roles.values())), dtype=np.float64).reshape(-1)
        site = sites.get(name)
        if site is None:
            raise PathirError(f"clip threshold '{name}' is not one this model was lowered with")
        moved = bool(np.any(f != 1.0))
        if site.kind == "call":
            if moved:
                raise PathirError(
                    f"write-back refused: the rescaling moves the threshold of the clipped ReLU {site.target} per "
                    "channel, and a functional call holds one number in the code (F.relu6, F.hardtanh, clamp, or the "
                    "forward of a subclass of nn.ReLU6 / nn.Hardtanh, which torch.fx traces through to that call); use "
                    "a plain nn.ReLU6 / nn.Hardtanh module there (pathir writes it back as a per-channel pathir.nn.ClippedReLU), or "
                    "pathir.frontends.torch.clipped.clipped_to_relu. Analyses stay exact; the model is untouched")
            continue
        if site.kind == "buffer" or isinstance(model.get_submodule(site.target), ClippedReLU):
            buffer = site.target if site.kind == "buffer" else f"{site.target}.threshold"
            if moved:
                held = model.get_buffer(buffer).numel()
                if held != f.size:
                    raise PathirError(
                        f"write-back refused: the buffer '{buffer}' holds {held} threshold(s) for the {f.size} channels "
                        "of its clipped ReLU, which the rescaling moves apart; give it one value per channel "
                        "(shape (C, 1, ..., 1)). The model is untouched")
                tensors[buffer] = roles
            continue
        module = model.get_submodule(site.target)
        by_module.setdefault(id(module), (site.target, module, []))[2].append(
            (name, f, moved, users.get(id(params[name]), []), site.trailing))
    dtype, device = model_dtype_device(model)
    replace = []
    for path, module, uses in by_module.values():
        if not any(use[2] for use in uses):
            continue
        if type(module) not in WRITABLE:
            raise PathirError(f"the clipped ReLU '{path}' is a {type(module).__name__}: pathir writes thresholds "
                              "into nn.ReLU6, nn.Hardtanh or pathir.nn.ClippedReLU only; the model is untouched")
        new = [module_threshold(module, use[1].size) * use[1] for use in uses]
        if any(t.shape != new[0].shape or not np.array_equal(t, new[0]) for t in new[1:]):
            raise PathirError(
                f"write-back refused: the module '{path}' is called at {len(uses)} places whose thresholds the "
                "rescaling moves apart; one module holds one threshold per channel: give each call its own "
                f"{type(module).__name__}. The model is untouched")
        ranks = {trailing for *_, trailing in uses}  # (the axes after the channels: of one rank, one layout)
        if len(ranks) != 1 or None in ranks:
            raise PathirError(
                f"write-back refused: the module '{path}' is called on tensors of {len(ranks) or 'unknown'} different "
                "ranks or layouts, and one ClippedReLU broadcasts its per-channel thresholds against one: give each "
                f"call its own {type(module).__name__}. The model is untouched")
        spatial = ranks.pop()
        t = torch.as_tensor(new[0], dtype=torch.float64).to(dtype=dtype, device=device)
        back = t.double().cpu().numpy()
        if not (np.all(np.isfinite(back)) and np.array_equal(back == 0, new[0] == 0)):
            raise PathirError(f"the rescaled thresholds of '{path}' do not fit {dtype}; the model is untouched")
        replace.append((module, stand_in(path, module, ClippedReLU(t, spatial_dims=spatial,
                                                                   inplace=getattr(module, "inplace", False)))))
    return ClipPlan(tensors, swap_everywhere(model, replace))


# ---------------------------------------------------------------- relu6="relu"


@dataclass
class ReluSwap:
    """What :func:`clipped_to_relu` did: the module paths replaced by ``nn.ReLU``, and the largest
    change of the model's output on the given inputs (absolute, and relative to max |output|)."""

    replaced: list
    max_abs_change: float
    max_rel_change: float


def relu_swap(model: nn.Module) -> tuple[list[str], ModuleSwap]:
    """(the path of each clipped ReLU module of ``model``, the swap that replaces each by an
    ``nn.ReLU`` stand-in at every name): nothing is changed yet. PathirError if a hook cannot be carried."""
    paths, pairs = [], []
    for path, m in model.named_modules():  # each module once, under its first name
        if isinstance(m, ClippedReLU) or (type(m) in WRITABLE and float(m.min_val) == 0.0):
            paths.append(path)
            pairs.append((m, stand_in(path, m, nn.ReLU(inplace=bool(getattr(m, "inplace", False))))))
    return paths, swap_everywhere(model, pairs)


def measure_swap(model: nn.Module, swap: ModuleSwap, args: tuple) -> tuple[float, float]:
    """(max |change|, relative to max |output|) of the model's output on ``args`` that the (applied)
    ``swap`` made, both outputs in eval mode without gradients. Leaves the swap applied and every
    module's train/eval flag as it was. PathirError first where the forward still calls a replaced
    module (:meth:`ModuleSwap.check_unused`): the change would then not be the swap's."""
    swap.check_unused(model, args)
    after = _eval_output(model, args)
    swap.undo()
    try:
        before = _eval_output(model, args)
    finally:
        swap.apply()
    diff = float((after - before).abs().max()) if before.numel() else 0.0
    scale = float(before.abs().max()) if before.numel() else 0.0
    return diff, diff / scale if scale > 0 else diff


def _eval_output(model: nn.Module, args: tuple) -> torch.Tensor:
    """The model's output on ``args`` in eval mode, flattened (every module's own flag restored after)."""
    with eval_forward(model), torch.no_grad():
        return _flat(model(*args))


def clipped_to_relu(model: nn.Module, inputs) -> ReluSwap:
    """Replace every clipped ReLU module of ``model`` (``nn.ReLU6``, ``nn.Hardtanh(0, t)``,
    ``pathir.nn.ClippedReLU``) by ``nn.ReLU``, in place, and report the output change on ``inputs``
    (a tensor, or a tuple of the model's inputs), measured in eval mode without gradients.

    This *changes the function* wherever an activation exceeded its threshold: the report says by how
    much. Functional clips in a forward (``F.relu6(x)``) cannot be swapped and stay as they are. A
    module registered under several names is replaced under each (by one ReLU); its hooks and its
    train/eval flag go to the ReLU, and every module's train/eval flag is kept. On an error the model
    is left as it was.

    >>> import torch, torch.nn as nn
    >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU6(), nn.Linear(3, 1))
    >>> swap = clipped_to_relu(net, torch.randn(4, 2))
    >>> swap.replaced, type(net[1]).__name__
    (['1'], 'ReLU')
    """
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    paths, swap = relu_swap(model)
    swap.apply()
    try:
        diff, rel = measure_swap(model, swap, args)
    except BaseException:
        swap.undo()
        raise
    return ReluSwap(paths, diff, rel)


def _flat(out) -> torch.Tensor:
    """Every tensor of a model's output, float64, flattened into one vector."""
    if isinstance(out, torch.Tensor):
        return out.detach().double().reshape(-1)
    parts = list(out.values()) if isinstance(out, dict) else list(out)
    return torch.cat([_flat(p) for p in parts]) if parts else torch.zeros(0, dtype=torch.float64)
