"""A float computed by pathir made a torch scalar whose gradient autograd carries to the model.

pathir computes a quantity f of the graph's params θ_graph and its exact gradient ∂f/∂θ_graph
(for the path-norm: ``pathir.lifting.path_norm_grad``, in log scale). ``attach`` returns f as a
torch scalar whose backward pulls ∂f/∂θ_graph back to the model's own parameters with autograd,
through each graph param's recipe (``Coordinates``: the batch-norm folding, the layout, a pruning
mask) and each tensor's read (a dtype cast, a parametrization): their ``.grad`` is exactly
∂f/∂θ_model = (∂θ_graph/∂θ_model)ᵀ ∂f/∂θ_graph.

Between the forward and the backward only ∂f/∂θ_graph is held (one float64 copy of the graph's
params), with the buffers the recipes read (a train-mode forward moves running statistics in place
before the backward) and the parametrizations' reads: the recipes run again in the backward, one
param at a time, on the parameters themselves, which torch's version check (an in-place step), the
fused-step count and a fingerprint (an edit through ``.data``) guarantee unchanged. A first
derivative only: a backward that builds a graph of the gradient (``create_graph=True``, for a
second derivative) is refused with a PathirError, since the gradient given here would carry no
second-order term.
"""

from __future__ import annotations

import zlib
from collections import Counter

import numpy as np
import torch

from pathir.errors import PathirError
from pathir.frontends.torch.coordinates import float64_copy, narrowed
from pathir.frontends.torch.live import fused_steps

__all__ = ["attach", "eagerly"]


#: bytes per call of the checksum (a CUDA tensor is brought to the host this much at a time)
_CHUNK = 1 << 24


def _fingerprint(t: torch.Tensor) -> tuple:
    """Where ``t`` lives and a checksum (CRC-32) of its bytes: an edit through ``.data`` (which bumps no version),
    a swap of two entries included, moves one or the other."""
    with torch.no_grad():
        flat = t.detach().reshape(-1)
        raw = (flat if flat.is_contiguous() else flat.contiguous()).view(torch.uint8)
        crc = 0
        for i in range(0, raw.numel(), _CHUNK):
            crc = zlib.crc32(raw[i:i + _CHUNK].cpu().numpy(), crc)
        return t.data_ptr(), crc


class _Chain:
    """∂f/∂θ_graph (``grads``, ``graph.params()`` order) and what is needed to pull it back to the model's
    parameters in the backward (module docstring): ``params``, the model's parameters that get a gradient;
    ``watched``, every model tensor the backward reads again (frozen parameters and pruning masks too), whose
    versions and checksums must not move in between."""

    def __init__(self, coords, grads: list[np.ndarray]):
        self.coords, self.grads = coords, list(grads)
        model = coords.model
        reads = {n: leaf.watched(model) for n, leaf in coords.leaves.items()}  # the parameters each tensor reads
        self.targets = {n: [p for p in ps if p.requires_grad] for n, ps in reads.items()}
        # a buffer's value now (running statistics a train-mode forward moves in place, bumping no version); a
        # parametrized tensor's live read, its graph kept for the backward (the parametrization's own state kept)
        self.fixed = {n: leaf.read(model, live=bool(self.targets[n])) for n, leaf in coords.leaves.items()
                      if leaf.param_name is None}
        self.params = list({id(p): p for ps in self.targets.values() for p in ps}.values())
        watched: dict[str, torch.Tensor] = {}
        for n, leaf in coords.leaves.items():
            for i, p in enumerate(reads[n]):
                watched[f"{n} ({i})" if leaf.computed else n] = p
            if leaf.mask:
                watched[leaf.mask] = model.get_buffer(leaf.mask)
        self.watched = watched
        self.marks = {n: _fingerprint(t) for n, t in watched.items()}

    def pull_back(self, grad_output: torch.Tensor) -> dict[int, torch.Tensor]:
        """{id(model parameter): grad_output · (∂θ_graph/∂θ_model)ᵀ ∂f/∂θ_graph}, one graph param at a time: a param
        that is one tensor laid out anew by its layout's adjoint, any other by its recipe's own autograd on float64
        reads of its tensors; a tensor read by several params (a batch-norm's γ) gets their sum before its read's
        derivative (the cast to its dtype, its mask, its parametrization), as one autograd graph over all of them
        would."""
        coords = self.coords
        moved = [n for n, t in self.watched.items() if _fingerprint(t) != self.marks[n]]
        if moved:
            raise PathirError(f"'{moved[0]}' was changed between the differentiable path-norm's forward and its "
                              "backward where torch's version counter does not see it (an edit through .data, a "
                              "tensor assigned to .data, a pruning mask replaced): its gradient is for the values the "
                              "forward read. Compute the path-norm again after the edit (and call cm.refresh() after "
                              "an edit through .data: docs/live.md)")
        users = Counter(n for r in coords.recipes for n in set(r.leaves) if self.targets[n])
        pending: dict[str, torch.Tensor] = {}
        out: dict[int, torch.Tensor] = {}
        for r, g in zip(coords.recipes, self.grads):
            wanted = [n for n in dict.fromkeys(r.leaves) if self.targets[n]]
            if not wanted:
                continue
            parts = self._recipe_grads(r, wanted, g, grad_output)
            for n, part in zip(wanted, parts):
                if part is not None:
                    pending[n] = pending[n] + part if n in pending else part
                users[n] -= 1
                if not users[n] and n in pending:
                    self._through_read(n, pending.pop(n), out)
        return out

    def _recipe_grads(self, r, wanted: list[str], g: np.ndarray, grad_output: torch.Tensor) -> list:
        """grad_output · g pulled back through recipe ``r`` to the float64 reads of its ``wanted`` tensors."""
        device = self._read_device(wanted[0])
        seed = torch.as_tensor(np.ascontiguousarray(g)).to(device)
        if float(grad_output) != 1.0:  # (1: the gradient given, no float64 copy of it made)
            seed = grad_output.to(device) * seed
        if r.source is not None:  # one tensor laid out anew: the layout's adjoint, no value read
            return [r.adjoint(seed, self._read_shape(wanted[0]))]
        xs = {n: self._read(n) for n in r.leaves}
        for n in wanted:
            xs[n] = xs[n].requires_grad_(True)
        with torch.enable_grad():
            return list(torch.autograd.grad(r.fn(xs), [xs[n] for n in wanted], seed, allow_unused=True))

    def _read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` in float64 as the forward read it (detached, its own copy): from the tensors the forward
        saw (a Parameter or a pruning mask since swapped for another in the module is not read)."""
        if name in self.fixed:
            return self.fixed[name].detach()
        mask = self.coords.leaves[name].mask
        return float64_copy(self.watched[name], self.watched[mask] if mask else None)

    def _read_device(self, name: str) -> torch.device:
        return self.fixed[name].device if name in self.fixed else self.targets[name][0].device

    def _read_shape(self, name: str) -> tuple:
        return tuple((self.fixed[name] if name in self.fixed else self.targets[name][0]).shape)

    def _through_read(self, name: str, grad: torch.Tensor, out: dict) -> None:
        """Add the gradient by tensor ``name``'s float64 read to its parameters' entries of ``out``: a plain
        parameter's is the cast back to its dtype (times its pruning mask), a parametrized tensor's by autograd
        through the read the forward made."""
        leaf, targets = self.coords.leaves[name], self.targets[name]
        if name in self.fixed:
            with torch.enable_grad():  # (kept: a second backward of a graph retained reads it again)
                parts = torch.autograd.grad(self.fixed[name], targets, grad, allow_unused=True, retain_graph=True)
        else:
            (p,) = targets
            if leaf.mask:
                grad = grad * self.watched[leaf.mask].to(grad.device, torch.float64)
            elif p.dtype == torch.float64:  # its own tensor: a layout's adjoint is a view of the given gradient,
                grad = grad.clone()  # which autograd would make the .grad that zero_grad or clipping edits in place
            parts = [narrowed(grad, p.dtype, name)]
        for p, part in zip(targets, parts):
            if part is not None:
                out[id(p)] = out[id(p)] + part if id(p) in out else part


class _GivenGradient(torch.autograd.Function):
    """``forward(value, chain, *params) = value``; backward: ``chain.pull_back`` to ``params``."""

    @staticmethod
    def forward(ctx, value, chain, *params):
        ctx.chain, ctx.ids = chain, [id(p) for p in params]
        watched = tuple(chain.watched.values())
        ctx.save_for_backward(*watched)  # what the backward reads: an in-place step before it is refused by torch
        ctx.fused = fused_steps(watched)  # ... and a fused optimizer's step, which bumps no version, by pathir
        return value.clone()

    @staticmethod
    def backward(ctx, grad_output):
        """The chain rule to the model's parameters, constants: refused where autograd records the backward
        (``create_graph=True``), which would differentiate them as if f had no second derivative."""
        if torch.is_grad_enabled():  # autograd runs a backward with grad mode on only under create_graph=True
            raise PathirError("the differentiable path-norm gives a first derivative only: a backward with "
                              "create_graph=True (a second derivative, a gradient penalty) would silently drop its "
                              "second-order term; take the path-norm's term out of the loss you differentiate twice")
        watched = ctx.saved_tensors  # torch's version check: the gradient is for the values the forward read
        if fused_steps(watched) != ctx.fused:
            raise PathirError("a parameter the differentiable path-norm read was modified in place by a fused "
                              "optimizer step (fused=True, which torch's inplace check does not see) between the "
                              "path-norm's forward and its backward: its gradient is for the values it read. Call "
                              "backward before optimizer.step(), or compute the path-norm again after it")
        grads = ctx.chain.pull_back(grad_output)  # (again on a second backward of a graph retained)
        return (None, None, *(grads.get(i) for i in ctx.ids))


def attach(value: float, coords, grads: list[np.ndarray]) -> torch.Tensor:
    """``value`` as a float64 scalar whose backward gives the model's parameters
    (∂θ_graph/∂θ_model)ᵀ ``grads``: ``grads[j]`` is ∂f/∂θ_j for ``coords.graph``'s params, and
    ``coords`` (a ``Coordinates`` of the model) rebuilds them from the model. A backward after one
    of the parameters was changed in place (an optimizer step between the forward and the backward)
    raises torch's own "modified by an inplace operation" error, as for any torch function of them,
    instead of giving the old point's gradient; a fused optimizer's step, which bumps no version, or
    an edit through ``.data``, raises a PathirError."""
    chain = _Chain(coords, grads)
    device = chain.params[0].device if chain.params else torch.device("cpu")
    out = torch.tensor(value, dtype=torch.float64, device=device)
    if not chain.params:
        return out
    return _GivenGradient.apply(out, chain, *chain.params)


@torch.compiler.disable
def eagerly(fn, *args):
    """``fn(*args)`` run by Python itself, also when called from a function being compiled by torch.compile
    (a graph break: pathir reads the live model and numpy arrays, which no compiled graph can hold); and
    PathirError inside a torch.func transform (grad, vmap, jacrev), whose function arguments are not the
    model's own parameters that the path-norm reads."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        raise PathirError("the differentiable path-norm reads the model's own parameters, so it has no gradient "
                          "inside a torch.func transform (grad, vmap, jacrev with functional_call): compute it outside "
                          "and use loss.backward() or torch.autograd.grad")
    return fn(*args)
