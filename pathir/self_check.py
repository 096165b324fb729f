"""Compile's self-check: the IR computes what the model computes.

After lowering and the default passes, :func:`self_check` runs the IR's own
forward (torch backend when torch is installed, else numpy; float64 for a float64
model, float32 otherwise: the check is about structure) and the
model's own forward once each, on a seeded random batch of 3 (:data:`BATCH`: not the frontends' trace
batch, 2, so that a forward that uses its batch size as a number is caught; cast to the
model's dtype and device, the same values fed to both), and compares them
relative to max|model output|, with a tolerance fitted to the model's dtype
(:data:`TOLERANCE`). A torch model runs in eval mode under ``torch.no_grad``
(its training flags are restored, nothing is copied; a model compiled with its aux heads runs
its heads forward, and each output of its eval forward must be one of the heads); an ONNX model runs in
onnxruntime (skipped when onnxruntime is not installed).

A mismatch raises :class:`pathir.SelfCheckFailed` with the deviation and the
first IR node that disagrees with the output of the module it came from
(torch: module outputs recorded with temporary forward hooks, compared only
on failure), else the first disagreeing output. Opt out with
``pathir.compile(..., self_check=False)``.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import torch

from pathir.backends.torch import TorchBackend
from pathir.errors import SelfCheckFailed
from pathir.frontends.core.values import BATCH as TRACE_BATCH
from pathir.frontends.onnx.function_kept import probe_feeds
from pathir.frontends.onnx.load import load
from pathir.frontends.torch.function_kept import Reference
from pathir.frontends.torch.inputs import TOLERANCE, eval_forward, explain, model_dtype_device, output_tensors
from pathir.ir.inputs import tensor_float64
from pathir.lifting.walk import forward

__all__ = ["self_check", "TOLERANCE", "BATCH"]

#: the self-check's batch: not the batch the frontends trace at (`values.BATCH`, 2), so that a graph the
#: trace specialised to its batch size (x.size(0) in arithmetic or a branch) does not pass it
BATCH = 3


def _backend(cm, dtype: str):
    """The torch backend, in float64 for a float64 model and in float32
    otherwise: the check is about structure, and float32 convolutions are several times faster."""
    return TorchBackend(dtype=torch.float64 if dtype == "float64" else torch.float32)


def _numpy(a) -> np.ndarray:
    return tensor_float64(a) if hasattr(a, "detach") else np.asarray(a, dtype=np.float64)


def _ir_forward(cm, inputs: dict, dtype: str, all_nodes=False) -> dict:
    backend = _backend(cm, dtype)
    return {k: _numpy(v) for k, v in forward(cm.graph, backend, inputs, all_nodes=all_nodes).items()}


def _deviation(out: np.ndarray, ref: np.ndarray) -> float:
    if out.shape != ref.shape:
        return float("inf")
    return float(np.abs(out - ref).max() / max(float(np.abs(ref).max()), 1e-30)) if ref.size else 0.0


def self_check(cm, model, kind: str) -> None:
    """Raise SelfCheckFailed unless the IR of ``cm`` computes what ``model`` computes."""
    if kind == "torch":
        _check_torch(cm, model)
    elif kind == "onnx":
        _check_onnx(cm, model)


def _compare(cm, outs: dict, refs: list, dtype: str, where) -> None:
    tol = TOLERANCE.get(dtype, 1e-4)
    names = list(cm.graph.outputs)
    if len(refs) != len(names):
        raise SelfCheckFailed(f"self-check: the model returns {len(refs)} tensors, the IR {len(names)} outputs "
                              "(pass self_check=False to skip)")
    for name, ref in zip(names, refs):
        if not np.isfinite(ref).all():
            warnings.warn(f"self-check skipped: the model's output '{name}' is not finite on a random input",
                          stacklevel=4)
            return
        out = outs[name]
        if out.shape != ref.shape and out.size == ref.size and ref.ndim == 2:
            out = out.reshape(ref.shape[::-1]).T if out.shape[::-1] == ref.shape else out
        err = _deviation(out, ref)
        if err > tol:
            passes = getattr(cm, "passes_run", ())
            why = (f"compile ran your passes {list(passes)} before this check: a pass that changes what the graph "
                   "computes (rounding weights, dropping a branch) makes it differ from the model by design; compile "
                   "with self_check=False for such a pass" if passes else
                   "This is a pathir bug or an uncaptured construct: please report it (self_check=False skips the check)")
            if out.shape != ref.shape:  # (no node to look for: the IR computes another shape)
                raise SelfCheckFailed(f"self-check: the IR's output '{name}' has shape {list(out.shape)} on the check's "
                                      f"batch, the model's {list(ref.shape)}. {why}")
            first = where() or f"output '{name}'"
            raise SelfCheckFailed(
                f"self-check: the IR's forward deviates from the model's by {err:.3g} (relative to max|output|, "
                f"tolerance {tol:g} for {dtype}); first disagreement at {first}. {why}")


# ---------------------------------------------------------------- torch


_tensors = output_tensors


def torch_inputs(cm, model):
    """The seeded random batch of the self-check: [(float64 numpy, model-dtype tensor)] per graph input."""
    import torch

    dtype, device = model_dtype_device(model)
    gen = torch.Generator().manual_seed(0)
    xs = []
    for name in cm.graph.inputs:
        x = torch.randn(BATCH, *cm.graph.node(name).shape, generator=gen, dtype=torch.float64).to(dtype)
        xs.append((name, x.double().numpy().copy(), x.to(device)))  # a model may write its input in place
    return xs


def train_paths(cm) -> list[str]:
    """The modules in train mode in the forward the graph computes (the heads forward of a model with
    aux heads, frontends/torch/train_branches.py); [] for the eval forward."""
    return list(getattr(cm.writer, "train_paths", ()))


def _check_torch(cm, model) -> None:
    import torch

    xs = torch_inputs(cm, model)
    other_dtype: dict = {}
    try:
        with eval_forward(model, train_paths(cm)), torch.no_grad(), _dtypes_seen(model, other_dtype):
            refs = [_numpy(t) for t in _tensors(model(*[x.clone() for _, _, x in xs]))]
    except Exception as err:  # where it runs at the trace's batch (else: its own error), it fixes its batch size
        explain(model, [cm.graph.node(name).shape for name in cm.graph.inputs], err, batch=TRACE_BATCH, train=train_paths(cm))
        raise SelfCheckFailed(
            f"self-check: the model's forward fails at batch {BATCH} ({type(err).__name__}: {err}) after pathir "
            f"traced it at batch {TRACE_BATCH}: it fixes its batch size (x.view({TRACE_BATCH}, -1), a batch-sized "
            "buffer), and pathir's graph is per sample. Write the forward for any batch size") from None
    for path, other in other_dtype.items():  # the first in call order: refused however small its rounding
        model_dtype = str(model_dtype_device(model)[0]).replace("torch.", "")
        raise SelfCheckFailed(
            f"self-check: module '{path}' returns {str(other).replace('torch.', '')} in a {model_dtype} model: its "
            "forward computes in another dtype (torch.autocast, or a cast), which pathir's graph, in the model's dtype "
            "throughout, does not follow; its numbers would be those of the weights as stored, not as the model "
            "computes with them. Remove the autocast block or the cast (or run the whole model in one dtype)")
    _check_compiled_code(cm, model, xs, refs)
    if hasattr(cm.writer, "reference"):  # the first write-back's "before" (frontends/torch/function_kept.py)
        cm.writer.reference = Reference.of_batch(model, train_paths(cm), [x for _, _, x in xs], refs)
    dtype = str(model_dtype_device(model)[0]).replace("torch.", "")
    outs = _ir_forward(cm, {n: a for n, a, _ in xs}, dtype)
    try:
        _compare(cm, outs, refs, dtype, lambda: _first_torch(cm, model, xs, dtype))
    except SelfCheckFailed as err:
        _refuse_if_batch_sized(cm, model, xs, dtype, err)
        raise
    _check_batch_of_one(cm, model, xs, outs, dtype)
    if train_paths(cm):
        _check_eval_among_heads(cm, model, xs, outs, dtype)


def _compiled_modules(model) -> list[str]:
    """The paths of the modules of ``model`` (the root "" included) that ``torch.compile`` runs: its wrappers
    (``OptimizedModule``) and the modules compiled in place (``module.compile()``)."""
    return [path for path, m in model.named_modules()
            if type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None]


def _check_compiled_code(cm, model, xs, refs: list) -> None:
    """Where the model holds ``torch.compile`` wrappers, run it once more as dynamo runs it (the check's forward
    runs under pathir's dispatch mode, where dynamo falls back to the Python forward) and refuse a difference:
    the graph is the Python forward's, and dynamo's cached code can differ from it (a hook added to a module
    after an identical one was compiled is skipped). A compiled forward that cannot run here is warned about."""
    paths = _compiled_modules(model)
    if not paths:
        return
    from torch.utils._python_dispatch import _disable_current_modes  # lazy: torch internals, only for this case

    dtype = str(model_dtype_device(model)[0]).replace("torch.", "")
    where = ", ".join(repr(p or "the model") for p in paths[:3])
    try:
        with _disable_current_modes(), eval_forward(model, train_paths(cm)), torch.no_grad():
            ran = [_numpy(t) for t in _tensors(model(*[x.clone() for _, _, x in xs]))]
    except Exception as err:  # (no C compiler for inductor, a backend that fails): the Python forward only
        warnings.warn(f"self-check: the torch.compile'd {where} did not run as compiled here ({type(err).__name__}: "
                      f"{err}); pathir's graph is checked against its Python forward only", stacklevel=4)
        return
    tol = TOLERANCE.get(dtype, 1e-4)
    worst = max((_deviation(a, b) for a, b in zip(ran, refs)), default=0.0) if len(ran) == len(refs) else float("inf")
    if worst > tol:
        raise SelfCheckFailed(
            f"self-check: the torch.compile'd {where} computes other numbers than its Python forward (deviation "
            f"{worst:.3g} relative to max|output|, tolerance {tol:g} for {dtype}): pathir's graph is the Python "
            "forward's, and the code dynamo runs differs from it (its cache can skip a hook added after an "
            "identical module was compiled). Call torch._dynamo.reset() and compile the model again, or pass the "
            "module itself (model._orig_mod)")


@contextlib.contextmanager
def _dtypes_seen(model, other: dict):
    """Within the block, ``other`` records {module path: dtype} for each module whose floating output is not in the
    model's dtype (first in call order)."""
    import torch

    model_dtype = model_dtype_device(model)[0]

    def hook(path):
        def record(m, i, o):
            if isinstance(o, torch.Tensor) and o.is_floating_point() and o.dtype != model_dtype:
                other.setdefault(path or "the model", o.dtype)
        return record

    handles = [mod.register_forward_hook(hook(path)) for path, mod in model.named_modules()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _refuse_if_batch_sized(cm, model, xs, dtype: str, err: SelfCheckFailed) -> None:
    """Raise SelfCheckFailed naming the batch size where the IR matches the model on the first
    ``TRACE_BATCH`` samples (the batch the frontends trace at) but not on all ``BATCH``: the traced
    forward used its batch size as a number (``h / x.size(0)``, ``if x.shape[0] > 2``)."""
    import torch

    head = [(n, a[:TRACE_BATCH], x[:TRACE_BATCH]) for n, a, x in xs]
    try:
        with eval_forward(model, train_paths(cm)), torch.no_grad():
            refs = [_numpy(t) for t in _tensors(model(*[x.clone() for _, _, x in head]))]
        _compare(cm, _ir_forward(cm, {n: a for n, a, _ in head}, dtype), refs, dtype, lambda: "")
    except Exception:
        return  # it deviates at the trace's batch too: not (only) the batch size
    raise SelfCheckFailed(
        f"self-check: the model's forward depends on its batch size: the IR pathir traced at batch {TRACE_BATCH} "
        f"matches it at batch {TRACE_BATCH} but not at batch {BATCH} ({err}). The forward uses x.size(0) or "
        "x.shape[0] as a number (a division by the batch size, a branch on it) or fixes it (x.view(2, -1)); "
        "pathir's graph is per sample. Write the forward without it") from None


def _check_batch_of_one(cm, model, xs, outs: dict, dtype: str) -> None:
    """SelfCheckFailed where the model, run on the first sample alone, does not compute what the IR does for
    it: a forward that treats a batch of one apart (``if x.shape[0] == 1``, ``torch.cond(x.shape[0] > 1, ...)``),
    which neither the trace's batch nor the check's sees. A model that fails on one sample is not refused: the
    graph is the function it computes on the batches it runs on."""
    import torch

    try:
        with eval_forward(model, train_paths(cm)), torch.no_grad():
            refs = [_numpy(t) for t in _tensors(model(*[x[:1].clone() for _, _, x in xs]))]
    except Exception:  # the model does not run on one sample (torch.squeeze(h) then flatten(1)): nothing to compare
        return
    try:
        ones = {k: v[:1] for k, v in outs.items()}
        # one sample's values in any layout of the same size (x.squeeze() drops the batch axis of one)
        refs = [r.reshape(ones[n].shape) if n in ones and r.size == ones[n].size else r
                for n, r in zip(cm.graph.outputs, refs)]
        _compare(cm, ones, refs, dtype, lambda: "")
    except Exception as err:
        raise SelfCheckFailed(
            f"self-check: the model's forward depends on its batch size: the IR pathir traced at batch {TRACE_BATCH} "
            f"matches it at batch {BATCH} but not on one sample alone ({type(err).__name__}: {err}). The forward "
            "treats a batch of one apart (if x.shape[0] == 1, a squeeze of the batch axis) and pathir's graph is per "
            "sample; write the forward alike for every batch size") from None


def _check_eval_among_heads(cm, model, xs, outs: dict, dtype: str) -> None:
    """Every output of the eval forward is one of the heads forward's outputs: a rescaling that keeps
    every head keeps the eval function."""
    import torch

    with eval_forward(model), torch.no_grad():
        evals = [_numpy(t) for t in _tensors(model(*[x.clone() for _, _, x in xs]))]
    tol = TOLERANCE.get(dtype, 1e-4)
    for k, ref in enumerate(evals):
        if np.isfinite(ref).all() and not any(_deviation(o, ref) <= tol for o in outs.values()):
            raise SelfCheckFailed(f"self-check: the eval forward's output {k} is none of the outputs of the heads "
                                  f"forward pathir lowered (modules {train_paths(cm)} in train mode), so a rescaling "
                                  "keeping the heads might not keep the eval function; compile the model in eval "
                                  "mode (pass self_check=False to skip)")


def _first_torch(cm, model, xs, dtype: str) -> str:
    """The first IR node (graph order) whose value differs from its module's recorded output (a module whose
    output is in another dtype was refused before any comparison: `_dtypes_seen`)."""
    import torch

    recorded, handles = {}, []
    for path, mod in model.named_modules():
        def hook(m, i, o, path=path):
            if isinstance(o, torch.Tensor):
                recorded[path] = _numpy(o.clone())
        handles.append(mod.register_forward_hook(hook))
    try:
        with eval_forward(model, train_paths(cm)), torch.no_grad():
            model(*[x.clone() for _, _, x in xs])
    finally:
        for h in handles:
            h.remove()
    acts = _ir_forward(cm, {n: a for n, a, _ in xs}, dtype, all_nodes=True)
    tol = TOLERANCE.get(dtype, 1e-4)
    first = ""
    for node in cm.graph.nodes:
        ref = recorded.get(node.origin)
        if ref is not None and ref.shape == acts[node.name].shape and _deviation(acts[node.name], ref) > tol:
            first = f"node '{node.name}' (module '{node.origin}', relative deviation " \
                    f"{_deviation(acts[node.name], ref):.3g})"
            break
    return first


# ---------------------------------------------------------------- onnx

def _check_onnx(cm, model) -> None:
    try:
        import onnxruntime as ort
    except ImportError:
        return

    proto = load(model).proto
    try:
        sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as err:  # a model onnxruntime cannot run is not pathir's to judge
        warnings.warn(f"self-check skipped: onnxruntime cannot load the model ({type(err).__name__}): pathir's numbers "
                      "follow the ONNX operator specification as pathir reads it, unchecked against any runtime",
                      stacklevel=3)
        return
    feeds = probe_feeds(sess, cm.graph, batch=BATCH)
    if feeds is None:  # an input the graph does not have, or not a float type
        return
    inputs = {name: x.astype(np.float64) for name, x in feeds.items()}
    try:
        ran = sess.run(None, feeds)
    except Exception as err:  # loaded but refused at run time (an attribute combination it does not implement)
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        warnings.warn(f"self-check skipped: onnxruntime cannot run the model ({type(err).__name__}: {first}): "
                      "pathir's numbers follow the ONNX operator specification as pathir reads it, unchecked against "
                      "any runtime", stacklevel=3)
        return
    refs = [np.asarray(r, dtype=np.float64) for r in ran]
    # an output holding its batch on axis 1 (W @ x) is the IR's batch-first output transposed: by the lowering's
    # record, not by its shape (a square output, batch and features both 3, reads either way)
    axis1 = {name for name, (_, flag) in getattr(cm.writer, "outputs", {}).items() if flag}
    refs = [r.T if name in axis1 and r.ndim == 2 else r for name, r in zip((o.name for o in sess.get_outputs()), refs)]
    dtype = np.dtype(next(iter(feeds.values())).dtype).name
    outs = _ir_forward(cm, inputs, dtype)
    _compare(cm, outs, refs, dtype, lambda: "")
