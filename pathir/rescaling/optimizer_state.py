"""Moving a torch optimizer's per-parameter state with a rescaling of its parameters.

A rescaling multiplies a parameter entrywise, θ' = s ⊙ θ (s > 0), and leaves the
function unchanged, so the loss in the new coordinates is L'(θ') = L(θ' / s) and
its gradient is ∇L' = ∇L / s. An optimizer's state built from gradients moves
the same way: a running sum of gradients (SGD's momentum buffer, Adam's first
moment) is scaled by 1/s, a running sum of squared gradients (Adam's second
moment, RMSprop's square average, Adagrad's sum) by 1/s², and a running sum of
gradients over their root mean square (RMSprop's momentum buffer) not at all
(up to its eps). Then, right after the rescaling, state ⊙ θ and (second moment)
⊙ θ² are what they were: each entry is the state the optimizer would hold had it
run on the rescaled model's gradients. Step counters
and hyper-parameters are untouched; foreach/fused/capturable flags do not change
the state's layout.

Known optimizers (exact type, :data:`STATE_POWERS`): SGD (with or without
momentum, nesterov), Adam, AdamW, RMSprop, Adagrad. Refused with a PathirError
before anything is written: any other optimizer that holds per-parameter state,
a state entry whose scaling is unknown or whose shape is not its parameter's, a
parameter whose change is no entrywise factor (a weight_norm g and v moved by a
ratio of norms), and a state value that would overflow or underflow its dtype.
An optimizer with no state yet, and parameters it does not hold, need nothing.

:func:`plan_transport` computes every new state tensor first; :meth:`Transport.write`
copies them in place (the tensors keep their identity) and :meth:`Transport.undo`
puts the old values back, so ``pathir.rescaling.commit`` writes the optimizer after
the model and restores both on any failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pathir.errors import PathirError
from pathir.support.tensor_memory import extent, share_bytes

__all__ = ["STATE_POWERS", "Transport", "check_transportable", "plan_transport", "plan_grads", "check_private"]

_ADAM = {"step": 0, "exp_avg": 1, "exp_avg_sq": 2, "max_exp_avg_sq": 2}

#: optimizer class name -> {state key: k}: the entry is multiplied by s^-k (k = 0: untouched)
STATE_POWERS: dict[str, dict[str, int]] = {
    "SGD": {"momentum_buffer": 1},
    "Adam": _ADAM,
    "AdamW": _ADAM,
    # RMSprop's momentum buffer sums g / (√square_avg + eps): g/s over √square_avg/s, unchanged (but for eps)
    "RMSprop": {"step": 0, "square_avg": 2, "momentum_buffer": 0, "grad_avg": 1},
    "Adagrad": {"step": 0, "sum": 2},
}


def _rules(optimizer) -> dict[str, int] | None:
    """The state rules of ``optimizer``'s exact class (a subclass may change what its state means)."""
    import torch

    cls = type(optimizer)
    known = getattr(torch.optim, cls.__name__, None)
    return STATE_POWERS.get(cls.__name__) if known is cls else None


def _held_state(optimizer) -> dict:
    return {p: st for p, st in optimizer.state.items() if st}


def check_transportable(optimizer) -> None:
    """Refuse (PathirError) an optimizer whose state pathir cannot move: not a torch optimizer,
    an unknown class holding state, or a state key of unknown scaling. Nothing is read from the model."""
    import torch

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise PathirError(f"optimizer= takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
    rules = _rules(optimizer)
    held = _held_state(optimizer)
    if rules is None:
        if held:
            raise PathirError(
                f"pathir does not know how the state of the optimizer {type(optimizer).__name__} moves with a "
                f"rescaling (known: {', '.join(f'torch.optim.{k}' for k in STATE_POWERS)}); it holds state for "
                f"{len(held)} parameters. Nothing was changed")
        return
    for st in held.values():
        unknown = sorted(k for k in st if k not in rules)
        if unknown:
            raise PathirError(
                f"the {type(optimizer).__name__} state entry {unknown[0]!r} has no known scaling under a rescaling "
                f"(known: {', '.join(rules)}); nothing was changed")


@dataclass
class Transport:
    """New values for optimizer state tensors, computed and checked, not yet written."""

    updates: list = field(default_factory=list)  # (state dict, key, tensor, new tensor)
    _written: list = field(default_factory=list)  # (state dict, key, tensor, old value)

    def write(self) -> None:
        """Copy every new value into its state tensor, in place."""
        import torch

        with torch.no_grad():
            for st, key, t, new in self.updates:
                self._written.append((st, key, t, t.detach().clone()))  # before the copy: one that writes, then
                t.copy_(new)  # raises, is put back too

    def undo(self) -> None:
        """Put back the old values of what :meth:`write` wrote."""
        import torch

        failed = None
        with torch.no_grad():
            for _, _, t, old in reversed(self._written):
                try:  # every entry is tried: one that cannot be put back stops none of the others
                    t.copy_(old)
                except Exception as e:  # noqa: BLE001 (reported after the others are back)
                    failed = failed or e
        self._written.clear()
        if failed is not None:
            raise failed


def plan_transport(optimizer, factors, names=None) -> Transport:
    """The state changes of ``optimizer`` for parameters rescaled by ``factors``.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
    factors : [(parameter tensor, float64 array s of its shape, or a str saying why its change is
        no entrywise factor)], e.g. ``TorchWriter.param_factors``.
    names : {id(parameter): its name in the model}, for the refusals (None: a parameter is told by its shape).

    Returns a :class:`Transport`; raises PathirError (nothing written) where the state cannot move exactly.
    """
    import torch

    check_transportable(optimizer)
    rules = _rules(optimizer) or {}
    held = _held_state(optimizer)
    plan = Transport()
    for p, s in factors:
        st = held.get(p)
        if st is None or not any(rules[key] and value is not None for key, value in st.items()):
            continue  # nothing that scales: only step counters, or entries still None
        if isinstance(s, str):
            raise PathirError(f"the optimizer's state of a rescaled parameter cannot be moved exactly: {s}; "
                              "nothing was changed")
        s = np.asarray(s, dtype=np.float64)
        if np.all(s == 1.0):
            continue
        for key, value in st.items():
            k = rules[key]
            if k == 0 or value is None:
                continue
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(p.shape):
                raise PathirError(f"the {type(optimizer).__name__} state {key!r} of a parameter of shape "
                                  f"{tuple(p.shape)} is not a tensor of that shape; nothing was changed")
            _check_writable(value, f"the {type(optimizer).__name__} state {key!r} of a parameter of shape "
                                   f"{tuple(p.shape)}")
            plan.updates.append((st, key, value, _scaled(value, s, k, key, _owner(p, names))))
    return plan


def plan_grads(factors, plan: Transport | None = None, names=None) -> Transport:
    """The parameters' ``.grad`` moved like a first moment (∇L' = ∇L / s) where the change is entrywise, added
    to ``plan`` (a new Transport without one): each is then the gradient of the same loss at the rescaled
    model, as a backward there gives it. A weight-normalized weight moved non-uniformly (no
    entrywise factor) keeps its grad."""
    plan = Transport() if plan is None else plan
    for p, s in factors:
        g = getattr(p, "grad", None)
        if g is None or isinstance(s, str) or tuple(g.shape) != tuple(p.shape):
            continue
        s = np.asarray(s, dtype=np.float64)
        if not np.all(s == 1.0):
            _check_writable(g, f"the .grad of a parameter of shape {tuple(p.shape)}")
            plan.updates.append((None, "grad", g, _scaled(g, s, 1, "grad", _owner(p, names))))
    return plan


def check_private(plan: Transport, optimizer, model) -> None:
    """Refuse (nothing written yet) a plan that writes a tensor whose memory another tensor also reads: the
    optimizer's state of another parameter (or under another key), a ``.grad``, a parameter or buffer of the
    model (``optimizer.state[q]['momentum_buffer'] = other_buffer[:3]``, grads as views of one flat buffer
    that overlap). Writing it in place would change the other one, which no rescaling moved so."""
    tensors = [(f"the {type(optimizer).__name__} state {key!r} of a parameter of shape {tuple(p.shape)}", v)
               for p, st in ([] if optimizer is None else optimizer.state.items()) for key, v in st.items()]
    params = [] if not hasattr(model, "parameters") else list(model.parameters())
    tensors += [(f"the .grad of a parameter of shape {tuple(p.shape)}", p.grad) for p in params]
    if hasattr(model, "named_buffers"):
        tensors += [(f"the model's tensor '{n}'", t) for n, t in (*model.named_parameters(), *model.named_buffers())]
    by_storage: dict[int, list] = {}
    for what, t in tensors:
        if (e := extent(t)) is not None:  # (sparse tensors hold no strided memory: they are refused if moved)
            by_storage.setdefault(e[0], []).append((what, t))
    for _, key, t, _ in plan.updates:
        mine, moved = extent(t), "gradient" if key == "grad" else f"state {key!r}"
        near = by_storage.get(mine[0], []) if mine is not None else []
        held = [what for what, other in near if other is t]
        if len(held) > 1:
            raise PathirError(f"one tensor is {held[0]} and {held[1]}, which the rescaling moves by different "
                              "factors; give each its own tensor (.clone()). Nothing was changed")
        for what, other in near:
            if other is not t and share_bytes(t, other):
                raise PathirError(f"{what} shares memory with a {moved} the rescaling moves, which would change it "
                                  "too (a view of another state tensor or of one flat buffer); give it its own memory "
                                  "(.clone()). Nothing was changed")


def _check_writable(t, what: str) -> None:
    """Refuse (nothing written yet) a tensor a rescaling cannot write in place entry by entry: one made under
    torch.inference_mode(), a sparse one, or an expanded one (many entries on one memory location)."""
    import torch

    why = ("was made under torch.inference_mode(): it cannot be written in place outside it" if t.is_inference()
           else f"is a {t.layout} tensor, whose entries pathir does not rescale in place" if t.layout != torch.strided
           else "is an expanded tensor (several entries share one memory location), which cannot be rescaled in "
                "place entry by entry" if any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride()))
           else None)
    if why is not None:
        raise PathirError(f"{what} {why}; nothing was changed")


def _owner(p, names) -> str:
    """How a refusal names parameter ``p``: by its name in the model where known, else by its shape."""
    name = None if names is None else names.get(id(p))
    return f"'{name}'" if name else f"a parameter of shape {tuple(p.shape)}"


def _scaled(value, s: np.ndarray, k: int, key: str, owner: str = "a parameter"):
    """value ⊙ s^-k in float64, cast back; refused if a finite entry leaves the dtype's range, a nonzero one
    becomes 0, or a normal one subnormal (a few digits left: the written model's own tensors are refused so too)."""
    import torch

    old = value.detach().to("cpu", torch.float64)
    exact = old * torch.as_tensor(s, dtype=torch.float64).reshape(old.shape) ** (-k)
    new = exact.to(value.dtype)
    tiny = torch.finfo(value.dtype).tiny if value.is_floating_point() else 0.0
    broke = (~new.isfinite() & old.isfinite()) | ((new == 0) & (old != 0)) | ((new.abs() < tiny) & (old.abs() >= tiny))
    if bool(broke.any()):
        raise PathirError(f"the rescaled {'gradient' if key == 'grad' else f'optimizer state {key!r}'} of {owner} does not fit "
                          f"{value.dtype}: {int(broke.sum())} "
                          "entries overflow or underflow (fall below its smallest normal number); nothing was changed")
    return new.to(value.device)
