"""Equalization on a graph: group the quantized tensors by unit pair, solve, report, commit.

The rescaling is found over the graph's whole unit group (residual streams, concatenations,
depthwise and grouped convolutions, fixed maps and all), and written through ``commit`` in one
transaction, so the model computes the same function; only its quantization changes.
"""

from __future__ import annotations

import math
import numbers
import time

import numpy as np

from pathir.equalization.absorb import absorb, measure
from pathir.equalization.objective import Objective
from pathir.equalization.report import EqualizeReport, TensorRow
from pathir.equalization.sensitivity import output_sensitivity
from pathir.equalization.solver import solve
from pathir.equalization.tensors import channel_ranges, quantize_graph, quantized_params, quantized_sqnr_db, tensor_pairs
from pathir.errors import PathirError
from pathir.lifting.diag_g import diag_g_log_parts
from pathir.lifting.path_metric import path_metric
from pathir.lifting.pruning import score_log_parts
from pathir.lifting.walk import forward
from pathir.rescaling.apply import rescale_graph
from pathir.support.progress import Phases, warn_not_converged
from pathir.support.threads import one_blas_thread

__all__ = ["equalize", "PHASES", "OBJECTIVES"]

PHASES = ("pairs", "solve", "report", "write")
#: objectives solved as another kind on other weights: output-noise is the noise objective weighted by F, not G
KIND = {"output-noise": "noise"}
#: every objective ``equalize`` takes
OBJECTIVES = ("noise", "output-noise", "range", "path-metric")


def _path_weights(graph, backend) -> dict[int, tuple]:
    """{id(quantized param): (m, L)} with m·e^L = S_i / |θ_i|, S the path-magnitude scores (docs/math.md
    §4): the first-order sensitivity of ‖Φ‖₁ to |θ_i|, 0 where θ_i = 0 (Q(0) = 0 moves nothing)."""
    wanted = {id(p) for p in quantized_params(graph)}
    out = {}
    for p, (m, L) in zip(graph.params(), score_log_parts(graph, backend)):
        if id(p) in wanted:
            with np.errstate(divide="ignore", invalid="ignore"):
                logs = np.where(m > 0, np.log(m) + L - np.log(np.abs(p.value)), -np.inf)
            top = float(np.max(logs)) if np.any(np.isfinite(logs)) else 0.0
            out[id(p)] = (np.exp(logs - top), top)
    return out


def _noise_weights(graph, backend) -> dict[int, tuple]:
    """{id(quantized param): (m, L)} with m·e^L = G_ii = Σ_{p∋i} (Φ_p/θ_i)², the path-lifting's
    sensitivity to θ_i (diag G, docs/math.md §6): independent rounding errors δ_i move Φ by
    Σ_i δ_i² G_ii in squared ℓ2 (docs/math.md §12)."""
    wanted = {id(p) for p in quantized_params(graph)}
    return {id(p): parts for p, parts in zip(graph.params(), diag_g_log_parts(graph, backend)) if id(p) in wanted}


def _spread(value: np.ndarray) -> float:
    r = channel_ranges(value)
    r = r[r > 0]
    return float(r.max() / r.min()) if r.size else 1.0


def _observed(graph, quantized, backend, inputs) -> float | None:
    """max over the samples of ‖R_θ(x) − R_Q(θ)(x)‖₁ (every output summed)."""
    if inputs is None:
        return None
    a, b = forward(graph, backend, inputs), forward(quantized, backend, inputs)
    total = 0.0
    for name in graph.outputs:  # an output the model returns twice is counted twice, as the bound counts it
        diff = np.abs(backend.to_numpy(a[name]) - backend.to_numpy(b[name]))
        total = total + diff.reshape(diff.shape[0], -1).sum(axis=1)
    return float(np.max(total))


def _input_scale(inputs) -> float:
    """max(‖x‖∞, 1) over the inputs given (1 without inputs: the bound per unit of input)."""
    if inputs is None:
        return 1.0
    arrays = inputs.values() if isinstance(inputs, dict) else [inputs]
    return max(1.0, *(float(np.max(np.abs(np.asarray(a, dtype=np.float64)))) for a in arrays))


def equalize(facts, backend, bits: int = 8, objective: str = "noise", max_log_scale: float = math.inf,
             commit=None, inputs=None, name: str = "", progress: bool | None = None,
             callback=None, certify: bool | None = None, lower: np.ndarray | None = None,
             read_source=None, read_back=None) -> EqualizeReport:
    """Find the rescaling z minimising ``objective`` over |z_h| ≤ ``max_log_scale`` and, with a
    ``commit`` callback, write it (the function is kept); returns an EqualizeReport.

    ``objective`` (docs/math.md §12): "noise" (the rounding noise per-tensor quantization adds to the
    path-lifting, Σ_T Δ_T² Σ_{i∈T} G_ii), "output-noise" (the same noise in the outputs on the batch
    ``inputs``, Σ_T Δ_T² Σ_{i∈T} F_ii: :mod:`pathir.equalization.sensitivity`), "range" (Σ_T log of tensor T's per-tensor quantization step
    over the geometric mean of its weights; Nagel's criterion on a chain) or "path-metric" (the
    first-order bound on ‖Φ(θ) − Φ(Q(θ))‖₁). ``inputs``: a batch (array, or {input: array}) on which
    the report measures the real output change of quantizing at ``bits``, and whose ‖x‖∞ scales the
    certified bound. ``certify``: compute the certified bound before and after (two path-metric walks;
    default: only for the path-metric objective). ``lower``: per unit, a further lower bound on z_h.
    ``read_source`` (name -> array of the model's tensor): then bias absorption after
    the rescaling (:mod:`pathir.equalization.absorb`), written in the same transaction. ``read_back`` (after the
    commit: the graph of the model as written): the report's "after" then describes the model's own rounded
    tensors rather than the float64 products.
    """
    if objective not in OBJECTIVES:
        raise PathirError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if objective == "output-noise" and inputs is None:
        raise PathirError("objective='output-noise' weighs each weight's rounding by what it costs in the outputs on "
                          "a calibration batch: pass inputs=... (a batch of the data the model will see), or use "
                          "objective='noise', which reads no inputs")
    if isinstance(bits, bool) or not (isinstance(bits, numbers.Integral) and 2 <= bits <= 16):
        raise PathirError(f"bits must be an integer from 2 to 16, got {bits!r}")
    bits = int(bits)
    start = time.perf_counter()
    graph, units = facts.graph, facts.units
    bar = Phases(PHASES if commit is not None else PHASES[:-1], desc=f"equalize {name}".strip(), progress=progress)
    bar.phase("pairs")
    params = quantized_params(graph)
    if not params:
        raise PathirError("the graph has no dense or convolution weight to quantize: nothing to equalize")
    weights = _path_weights(graph, backend) if objective == "path-metric" else \
        _noise_weights(graph, backend) if objective == "noise" else \
        output_sensitivity(graph, inputs, backend) if objective == "output-noise" else None
    pairs = tensor_pairs(graph, units, facts.row_ends, weights)  # (which empties ``weights``)
    if read_source is not None:  # bias absorption: refuse an unwritable shift before solving
        absorb(graph, units, None, read_source)
    bar.phase("solve")
    result = solve(Objective(pairs, KIND.get(objective, objective)), max_log_scale, callback=callback, lower=lower)
    del pairs  # (its grids: two float64 copies of the quantized weights, freed before the rescaled graph is made)
    z = result.z
    bar.phase("report")
    notes = []
    absorbed, absorption, planned = _planned(graph, units, z, backend, inputs, read_source)
    described = None
    if objective == "path-metric" and (certify is None or bool(certify)):  # the guard reads the bound it leads to
        described = _describe(graph, planned, params, backend, bits, objective, inputs, certify)
        bound_before, bound_after = described[1], described[2]
        if bound_after > bound_before:
            # the objective is first order: at coarse widths the rescaling can raise the bound it estimates
            notes.append(f"the rescaling found raises the certified bound ({bound_before:.4g} -> {bound_after:.4g}, "
                         "the objective is its first-order estimate): none is written (z = 0)")
            z, result.z, result.value_after, result.at_bound = np.zeros_like(z), np.zeros_like(z), result.value_before, 0
            absorbed, absorption, planned = _planned(graph, units, z, backend, inputs, read_source)
            described = _describe(graph, planned, params, backend, bits, objective, inputs, certify)
    rescales = bool(np.any(z)) or absorbed is not None  # (z = 0 and no absorbed bias: nothing to write)
    if commit is not None and not rescales:
        notes.append("nothing to write: the rescaling is z = 0, so the model is left as it is")
    if commit is not None and rescales:
        bar.phase("write")
        if absorbed is None:
            commit(z)
        else:
            commit(z, bias_shifts=absorbed.shifts)
        written = _as_written(graph, read_back, params)
        if written is not None:  # "after" describes the model as written, its tensors rounded to its dtype
            described = _describe(graph, written, params, backend, bits, objective, inputs, certify)
    if described is None:
        described = _describe(graph, planned, params, backend, bits, objective, inputs, certify)
    rows, bound_before, bound_after, observed, scale = described
    bar.close()
    if not result.converged:
        warn_not_converged("equalize", name, sum(result.iterations), "raise max_iter")
    return EqualizeReport(
        name=name, objective=objective, bits=bits, units=len(units), tensors=rows,
        objective_before=result.value_before, objective_after=result.value_after,
        bound_before=bound_before, bound_after=bound_after, observed_before=observed[0], observed_after=observed[1],
        units_moved=int(np.count_nonzero(z)), units_at_bound=result.at_bound, max_log_scale=float(max_log_scale),
        iterations=result.iterations, converged=result.converged, seconds=time.perf_counter() - start,
        written=commit is not None and rescales, write_back=commit is not None, z=z, absorption=absorption, input_scale=scale, inputs_given=inputs is not None,
        notes=notes)


def _planned(graph, units, z, backend, inputs, read_source):
    """(the bias absorption and its report, or None and None; the graph the write is to leave, in float64): the
    rescaling z of ``graph``, its absorbed biases included (``read_source`` given), with their measured change."""
    rescaled = rescale_graph(graph, units, z)
    if read_source is None:
        return None, None, rescaled
    absorbed = absorb(graph, units, z, read_source)
    return absorbed, measure(rescaled, absorbed, backend, inputs), absorbed.graph


def _describe(graph, written, params, backend, bits, objective, inputs, certify):
    """(tensor rows, certified bounds before and after or None, observed output changes, input scale) of the
    model ``graph`` and the model ``written`` (its params named as ``graph``'s)."""
    after = {p.name: p for p in quantized_params(written)}
    with one_blas_thread():  # threaded dot products spin 2-15x slower on a busy machine
        rows = [TensorRow(p.source_name, _spread(p.value), _spread(after[p.name].value),
                          quantized_sqnr_db(p.value, bits), quantized_sqnr_db(after[p.name].value, bits))
                for p in params]
    scale = _input_scale(inputs)
    bound_before = bound_after = None
    observed = (None, None)
    certified = objective == "path-metric" if certify is None else bool(certify)
    if certified or inputs is not None:
        q_before, q_after = quantize_graph(graph, bits), quantize_graph(written, bits)  # only where read
        if certified:
            bound_before = scale * path_metric(graph, q_before, backend).upper
            bound_after = scale * path_metric(written, q_after, backend).upper
        observed = (_observed(graph, q_before, backend, inputs), _observed(written, q_after, backend, inputs))
    return rows, bound_before, bound_after, observed, scale


def _as_written(graph, read_back, params):
    """The graph of the model as the write left it (its tensors rounded to the model's dtype), where
    ``read_back`` gives one whose quantized params carry the same names and shapes; else None."""
    if read_back is None:
        return None
    written = read_back()
    ours = {p.name: np.shape(p.value) for p in params}
    theirs = {p.name: np.shape(p.value) for p in quantized_params(written)}
    return written if written is not graph and ours == theirs else None
