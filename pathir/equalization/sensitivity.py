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

import numpy as np
import torch

from pathir.equalization.tensors import quantized_params
from pathir.errors import PathirError
from pathir.ir import Graph
from pathir.lifting.active import chunks, walk_size
from pathir.lifting.walk import forward

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
    from pathir.backends.torch import TorchBackend

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
    with torch.inference_mode(False), torch.enable_grad():
        return _sensitivity(graph, inputs, backend, draws, seed, chunk)


def _sensitivity(graph, inputs, backend, draws, seed, chunk):
    be = _autograd_backend(backend)
    params = quantized_params(graph)
    leaves = []
    for p in params:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only array: never written here
            leaf = be.constant(p.value).detach().requires_grad_(True)
        be.cached(p, lambda leaf=leaf: leaf)
        leaves.append(leaf)
    parts = list(chunks(graph, inputs, min(chunk, walk_size(graph))))
    samples = sum(int(next(iter(part.values())).shape[0]) for part in parts)
    if not samples:
        raise PathirError("objective='output-noise' reads the outputs on a calibration batch: inputs holds no sample")
    if draws is None:
        draws = -(-PASSES // samples)
    total = [torch.zeros_like(leaf) for leaf in leaves]
    gen = torch.Generator().manual_seed(seed)
    for part in parts:
        out = forward(graph, be, part)
        outputs = [out[name] for name in graph.outputs]  # an output returned twice is read twice
        for draw in range(draws):
            signs = [(torch.randint(0, 2, y.shape, generator=gen) * 2 - 1).to(y) for y in outputs]
            read = sum((y * s).sum() for y, s in zip(outputs, signs))
            if not read.requires_grad:
                break  # no output depends on a quantized weight
            grads = torch.autograd.grad(read, leaves, retain_graph=draw < draws - 1, allow_unused=True)
            for acc, g in zip(total, grads):
                if g is not None:
                    acc.addcmul_(g, g)
        del out, outputs
    if not any(bool(torch.any(acc > 0)) for acc in total):
        raise PathirError("objective='output-noise': no quantized weight moves any output on the inputs given (every "
                          "path to the outputs is cut by ReLUs that are off on every sample, or by zeros): there is "
                          "nothing to weigh. Pass inputs like the data the model will see, or use objective='noise', "
                          "which reads no inputs. Nothing was changed")
    weights = {}
    for p, acc in zip(params, total):
        f = be.to_numpy(acc) / draws  # the mean of the draws
        if not np.all(np.isfinite(f)):
            raise PathirError(f"objective='output-noise': the output's derivatives by {p.source_name} overflow float64 "
                              "on the inputs given (use objective='noise', which reads no inputs)")
        top = float(f.max())
        weights[id(p)] = (f / top, math.log(top)) if top > 0 else (np.zeros_like(f), -math.inf)
    return weights
