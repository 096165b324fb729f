"""Write-back through a derived weight: the tensors the module really computes with.

A module attribute such as ``weight`` may not be a stored tensor but a value
computed before each forward: by a parametrization
(``torch.nn.utils.parametrize``), by the legacy ``weight_norm`` /
``spectral_norm`` pre-hooks, or by pruning (``weight = weight_orig * mask``,
handled by the writer itself). Writing into ``module.weight`` then writes into
a temporary, and the next forward recomputes the old weight.

:func:`derived` says how ``module.<attr>`` is computed; :func:`weight_norm_update`
returns the new (g, v) of a weight-normalized weight w = g · v / ‖v‖ (norm over
every axis but ``dim``) rescaled entrywise by a factor F: v' = v ⊙ F and
g' = g · ‖v ⊙ F‖ / ‖v‖ per slice, so that g' · v'/‖v'‖ = w ⊙ F exactly (a factor
constant on each slice, e.g. per output channel, only changes g). Any other
derived weight (spectral_norm keeps σ = 1, which no rescaling survives; a
user's parametrization has no known inverse) is refused before anything is
written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pathir.errors import PathirError

__all__ = ["Derived", "derived", "weight_norm_update", "per_slice_factor"]


@dataclass
class Derived:
    """How ``module.<attr>`` is computed: kind 'weight_norm' (g, v, dim, legacy hook
    or None) or 'refused' (why)."""

    kind: str
    g: torch.Tensor | None = None
    v: torch.Tensor | None = None
    dim: int = 0
    hook: object = None
    why: str = ""


def derived(module, attr: str, name: str) -> Derived | None:
    """None when ``module.<attr>`` is stored (or pruned, which the writer handles)."""
    from torch.nn.utils import parametrize
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    if parametrize.is_parametrized(module, attr):
        plist = module.parametrizations[attr]
        kinds = [type(p).__name__ for p in plist]
        if kinds == ["_WeightNorm"]:
            return Derived("weight_norm", plist.original0, plist.original1, plist[0].dim)
        if "_SpectralNorm" in kinds:
            return Derived("refused", why=_spectral(name))
        return Derived("refused", why=(
            f"'{name}' is computed by the parametrization(s) {', '.join(kinds)} of module "
            f"'{type(module).__name__}': pathir cannot invert it to write a rescaled value; remove it "
            "(torch.nn.utils.parametrize.remove_parametrizations) before the write-back"))
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, WeightNorm) and hook.name == attr:
            return Derived("weight_norm", getattr(module, attr + "_g"), getattr(module, attr + "_v"), hook.dim, hook)
        if isinstance(hook, SpectralNorm) and hook.name == attr:
            return Derived("refused", why=_spectral(name))
    return None


def _spectral(name: str) -> str:
    return (f"'{name}' is spectral-normalized (σ = 1 is enforced): a rescaled weight cannot be written through "
            "spectral_norm; remove it before the write-back")


def weight_norm_update(d: Derived, factor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(g, new g), (v, new v)] so that the recomputed weight is the old one times ``factor``."""
    v = d.v.detach().to("cpu", torch.float64)
    g = d.g.detach().to("cpu", torch.float64)
    f = torch.as_tensor(factor, dtype=torch.float64).reshape(v.shape)
    dim = d.dim if d.dim is not None else -1
    per_slice = per_slice_factor(f, dim)
    if per_slice is not None:  # one factor per slice: only g moves
        new_v, new_g = v, g * per_slice.reshape(g.shape)
    else:
        new_v = v * f
        old_norm, new_norm = torch.norm_except_dim(v, 2, dim), torch.norm_except_dim(new_v, 2, dim)
        safe = torch.where(old_norm > 0, old_norm, torch.ones_like(old_norm))
        new_g = g * torch.where(old_norm > 0, new_norm / safe, torch.ones_like(old_norm)).reshape(g.shape)
    if not (torch.isfinite(new_g).all() and torch.isfinite(new_v).all()):
        raise PathirError("a weight-norm rescaling produced a non-finite g or v")
    return [(d.g, new_g.to(d.g.dtype).to(d.g.device)), (d.v, new_v.to(d.v.dtype).to(d.v.device))]


def per_slice_factor(f: torch.Tensor, dim: int) -> torch.Tensor | None:
    """The factor of each slice the norm runs over (shaped like norm_except_dim's
    output) when the factor is one number per slice, else None."""
    if dim == -1 or f.dim() <= 1:
        if dim == -1:
            return f.reshape(-1)[:1] if bool((f == f.reshape(-1)[0]).all()) else None
        return f
    others = [a for a in range(f.dim()) if a != dim]
    hi, lo = f.amax(dim=others, keepdim=True), f.amin(dim=others, keepdim=True)
    return hi if bool((hi == lo).all()) else None


def refresh(module, attr: str, d: Derived) -> None:
    """Recompute a legacy weight_norm's plain attribute from the new g and v, as its hook does."""
    if d.hook is not None:
        setattr(module, attr, d.hook.compute_weight(module))
