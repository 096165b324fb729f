"""The output-noise objective's weights: how much rounding each quantized entry costs in the model's
outputs on a calibration batch (docs/math.md §12).

To first order, independent rounding errors δ_i move the outputs on a batch X by Σ_i δ_i ∂R/∂θ_i, whose
expected squared norm is Σ_i E δ_i² · F_ii with

    F_ii = Σ_{x ∈ X} ‖∂R_θ(x)/∂θ_i‖²,

the sum over every sample and every output of the squared derivative (the noise objective's G_ii with
the inputs the model really sees: a path counts only where its ReLUs let it through, weighted by the
activations it carries). Under a rescaling, F_ii moves as G_ii does (e^{z_l(i) − z_e(i)}).

F is estimated without one backward pass per output and sample (Hutchinson): for v with independent
entries ±1 (one per output entry of every sample), E_v (∂⟨v, R_θ(X)⟩/∂θ_i)² = F_ii, each backward pass
one draw; the estimate is the mean of ``draws`` of them, per walk of samples (a smaller walk: fewer
cross terms between samples). Seeded: the same inputs give the same weights.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING

import numpy as np

from pathir.equalization.tensors import quantized_params
from pathir.errors import PathirError
from pathir.ir import Graph, MapKind, NodeKind
from pathir.lifting.active import chunks, walk_size
from pathir.lifting.walk import forward

if TYPE_CHECKING:
    import torch

__all__ = ["output_sensitivity", "CHUNK", "PASSES"]

#: the estimate's cost is about samples · draws backward passes of one sample, and its relative error per entry
#: grows with the cross terms of a walk's samples and outputs (about √(2 · chunk / (samples · draws)) where the
#: samples weigh alike, more where a few dominate an entry, as behind ReLUs: 20-50 % measured at 32 samples,
#: while the objective it leads to lands within 2 % of the one with F exact). One sample per walk is the most
#: accurate for the time (mnasnet0_5 at 64×64, 32 samples: 1.8 s; 4 samples per walk drawn 4 times: 2.8 s,
#: no more accurate). Each sample is drawn ``ceil(PASSES / samples)`` times.
CHUNK, PASSES = 1, 32


def _autograd_backend(backend):
    """A fresh torch backend (float64) on ``backend``'s device where it is a torch one, else on the CPU: its cache
    is filled with leaves that record gradients, so it is never the caller's."""
    from pathir.backends.torch import TorchBackend  # lazy: imports torch

    device = backend.device if isinstance(backend, TorchBackend) else None
    return TorchBackend(device=device)


def output_sensitivity(graph: Graph, inputs, backend=None, draws: int | None = None, seed: int = 0,
                       chunk: int = CHUNK) -> dict[int, tuple]:
    """{id(quantized param): (m, L)} with m·e^L the estimate of F_ii = Σ_x ‖∂R_θ(x)/∂θ_i‖² on the batch
    ``inputs`` (array or {input: array}): ``draws`` Rademacher backward passes (default: enough for ``PASSES``
    sample-passes in all) per walk of at most ``chunk`` samples (fewer where the walks' memory bound says
    so). max m = 1 per param; m = 0, L = -inf where no output reads the param on the batch. The weights are
    read, never written (the leaves share the params' memory on the CPU). Runs under a caller's
    ``torch.no_grad()`` or ``torch.inference_mode()`` alike."""
    import torch  # lazy: ``import pathir`` loads no torch

    with torch.inference_mode(False), torch.enable_grad():
        return _sensitivity(graph, inputs, backend, draws, seed, chunk)


def _sensitivity(graph, inputs, backend, draws, seed, chunk):
    import torch  # lazy: ``import pathir`` loads no torch

    params = quantized_params(graph)
    walks = list(chunks(graph, inputs, walk_size(graph)))
    samples = sum(int(next(iter(part.values())).shape[0]) for part in walks)
    if not samples:
        raise PathirError("objective='output-noise' reads the outputs on a calibration batch: inputs holds no sample")
    if draws is None:
        draws = -(-PASSES // samples)
    gen = torch.Generator().manual_seed(seed)
    layers = _single_edge(graph, params)
    total = _layer_pass(graph, backend, walks, layers, draws, gen) if layers else {}
    del walks
    rest = [p for p in params if id(p) not in layers]
    if rest:
        total.update(_weight_pass(graph, backend, chunks(graph, inputs, min(chunk, walk_size(graph))), rest, draws, gen))
    if not any(bool(torch.any(acc > 0)) for acc in total.values()):
        raise PathirError("objective='output-noise': no quantized weight moves any output on the inputs given (every "
                          "path to the outputs is cut by ReLUs that are off on every sample, or by zeros): there is "
                          "nothing to weigh. Pass inputs like the data the model will see, or use objective='noise', "
                          "which reads no inputs. Nothing was changed")
    weights = {}
    for p in params:
        acc = total.pop(id(p), None)
        f = np.zeros(p.shape) if acc is None else acc.detach().cpu().numpy() / draws  # the mean of the draws
        if not np.all(np.isfinite(f)):
            raise PathirError(f"objective='output-noise': the output's derivatives by {p.source_name} overflow float64 "
                              "on the inputs given (use objective='noise', which reads no inputs)")
        top = float(f.max())
        weights[id(p)] = (f / top, math.log(top)) if top > 0 else (np.zeros_like(f), -math.inf)
    return weights


def _signed_read(outputs, gen):
    """⟨v, outputs⟩ for v with independent entries ±1 (one draw)."""
    import torch  # lazy: ``import pathir`` loads no torch

    return sum((y * (torch.randint(0, 2, y.shape, generator=gen) * 2 - 1).to(y)).sum() for y in outputs)


def _single_edge(graph: Graph, params) -> dict[int, tuple]:
    """{id(param): (param, source node, target node, map)} of the quantized params that weigh exactly one dense or
    convolution edge into an identity or ReLU node: each sample's gradient by them is the weight-gradient of that
    edge's map at the sample's source activation and its gradient at the target (:func:`_layer_pass`), with no
    backward pass per sample."""
    uses: dict[int, list] = {}
    for node in graph.nodes:
        for e in node.edges:
            if e.map.weight is not None:
                uses.setdefault(id(e.map.weight), []).append((e, node))
    found = {}
    for p in params:
        edges = uses.get(id(p), [])
        if len(edges) == 1:
            e, node = edges[0]
            if e.map.kind in (MapKind.DENSE, MapKind.CONV) and node.kind in (NodeKind.RELU, NodeKind.IDENTITY):
                found[id(p)] = (p, e.source, node.name, e.map)
    return found


def _layer_pass(graph, backend, walks, layers, draws, gen) -> dict[int, torch.Tensor]:
    """F·draws of the ``layers`` params: per draw, one backward pass of a whole walk to their layers' outputs (each
    sample's gradient there is its own: samples never mix), then per sample the squared weight-gradient of the
    edge, summed: for a dense layer Σ_x δ_t(x)² ⊗ a_s(x)² as one product, for a convolution the samples'
    weight-gradients a few at a time (``torch.func.vmap`` of the backend's own)."""
    import torch  # lazy: ``import pathir`` loads no torch

    be = _autograd_backend(backend)
    targets = sorted({t for _, _, t, _ in layers.values()})
    total = {pid: torch.zeros(p.shape, dtype=torch.float64, device=be.device) for pid, (p, _, _, _) in layers.items()}
    for part in walks:
        x = {name: be.asarray(value).detach().requires_grad_(True) for name, value in part.items()}
        acts = forward(graph, be, x, all_nodes=True)
        outputs = [acts[name] for name in graph.outputs]  # an output returned twice is read twice
        reached = [t for t in targets if acts[t].requires_grad]
        squares = {s: acts[s].detach().reshape(acts[s].shape[0], -1).square()
                   for _, s, _, m in layers.values() if m.kind is MapKind.DENSE}
        for draw in range(draws):
            read = _signed_read(outputs, gen)
            if not read.requires_grad or not reached:
                break
            grads = torch.autograd.grad(read, [acts[t] for t in reached], retain_graph=draw < draws - 1,
                                        allow_unused=True)
            delta = {}
            for t, g in zip(reached, grads):
                if g is not None:
                    if graph.node(t).kind is NodeKind.RELU:  # at the pre-activation: through the ReLU's gate
                        g = g * (acts[t] > 0)
                    delta[t] = g
            for pid, (p, source, target, m) in layers.items():
                if target not in delta:
                    continue
                g = delta[target]
                if m.kind is MapKind.DENSE:
                    total[pid].addmm_(g.reshape(g.shape[0], -1).square().T, squares[source])
                else:
                    total[pid] += _per_sample_squares(be, m, acts[source].detach(), g, graph.node(source).shape)
        del acts, outputs, squares
    return total


#: entries of per-sample weight-gradients formed at once (32 MiB in float64)
_PER_SAMPLE = 1 << 22


def _per_sample_squares(be, m, a, g, source_shape) -> torch.Tensor:
    """Σ_x (weight-gradient of map ``m`` at source activation a(x) and output gradient g(x))², a few samples at a
    time, each sample's gradient the backend's own ``weight_grad`` of a batch of one."""
    from torch.func import vmap  # lazy: ``import pathir`` loads no torch

    one = vmap(lambda ai, gi: be.weight_grad(m, ai[None], gi[None], source_shape))
    step = max(1, _PER_SAMPLE // max(1, m.weight.size))
    total = None
    for i in range(0, a.shape[0], step):
        part = one(a[i:i + step], g[i:i + step]).square().sum(0)
        total = part if total is None else total.add_(part)
    return total


def _weight_pass(graph, backend, walks, params, draws, gen) -> dict[int, torch.Tensor]:
    """F·draws of ``params``: per draw, one backward pass per walk (of one sample by default) to the params
    themselves, their squared gradients summed."""
    import torch  # lazy: ``import pathir`` loads no torch

    be = _autograd_backend(backend)
    leaves = []
    for p in params:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only array: never written here
            leaf = be.constant(p.value).detach().requires_grad_(True)
        be.cached(p, lambda leaf=leaf: leaf)
        leaves.append(leaf)
    total = [torch.zeros_like(leaf) for leaf in leaves]
    for part in walks:
        out = forward(graph, be, part)
        outputs = [out[name] for name in graph.outputs]  # an output returned twice is read twice
        for draw in range(draws):
            read = _signed_read(outputs, gen)
            if not read.requires_grad:
                break  # no output depends on a quantized weight
            grads = torch.autograd.grad(read, leaves, retain_graph=draw < draws - 1, allow_unused=True)
            for acc, g in zip(total, grads):
                if g is not None:
                    acc.addcmul_(g, g)
        del out, outputs
    return {id(p): acc for p, acc in zip(params, total)}
