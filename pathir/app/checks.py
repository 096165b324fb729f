"""``pathir.app.checks.check``: what a user runs before trusting a number pathir computes.

Each check compares pathir with something it does not control:

- **self-check**: compile's own check, the IR's forward against the model's
  (PyTorch or onnxruntime) on a seeded random batch (docs/capture.md);
- **rescaling units (IR)**: a random rescaling z (one log-scale per unit, standard
  deviation ``scale``) leaves the IR's float64 forward unchanged (docs/math.md §5);
- **rescaling write-back**: the same z written into a float64 deep copy of a torch
  model (the user's model is never touched) changes its tensors and keeps its own
  forward; for an ONNX model, into a copy run by onnxruntime;
- **symbolic**: on graphs with at most ``max_paths`` paths, the exact checks of
  ``verify_symbolic`` (docs/symbolic.md); skipped above.

The report also says what was analysed: nodes, units, the model's parameters
the graph reads and those it does not reach, with why. A check that cannot
hold on this model says why it was skipped (``passed`` is None); a refusal to
compile is not a check: the PathirError propagates.

>>> import torch, pathir.app.checks
>>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
>>> report = pathir.app.checks.check(net, input_shape=(3,))
>>> report.passed, [c.name for c in report.checks]
(True, ['self-check', 'rescaling units (IR)', 'rescaling write-back', 'symbolic'])
>>> report.covered == report.model_params == 26, report.not_reached
(True, ())
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass

import numpy as np

import pathir
from pathir.errors import GraphTooLarge, PathirError, SelfCheckFailed
from pathir.frontends.onnx.load import load
from pathir.ir import Graph
from pathir.ir.inputs import tensor_float64
from pathir.lifting.walk import forward
from pathir.rescaling.apply import rescale_graph
from pathir.support.progress import Phases

__all__ = ["check", "CheckReport", "CheckResult", "TOLERANCE"]

#: relative tolerance (to max|output|) of the rescaling checks, by dtype the model runs in
TOLERANCE = {"float64": 1e-9, "float32": 1e-4}


@dataclass(frozen=True)
class CheckResult:
    """One check: ``passed`` True / False, or None when it was skipped (``detail`` says why)."""

    name: str
    passed: bool | None
    detail: str

    def __str__(self) -> str:
        mark = {True: "ok", False: "FAILED", None: "skipped"}[self.passed]
        return f"{mark:<8}{self.name}: {self.detail}"


@dataclass(frozen=True, eq=False)
class CheckReport:
    """What :func:`check` found. ``not_reached``: (parameter name, entries, why) of the model's
    parameters the graph does not read; ``passed`` is False as soon as one check failed."""

    model: str
    nodes: int
    units: int
    graph_params: int
    model_params: int
    covered: int
    not_reached: tuple[tuple[str, int, str], ...]
    checks: tuple[CheckResult, ...]

    @property
    def passed(self) -> bool:
        return all(c.passed is not False for c in self.checks)

    @property
    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if c.passed is False]

    def to_dict(self) -> dict:
        return {
            "model": self.model, "passed": self.passed, "nodes": self.nodes, "units": self.units,
            "graph_params": self.graph_params, "model_params": self.model_params, "covered": self.covered,
            "not_reached": [{"name": n, "entries": k, "why": w} for n, k, w in self.not_reached],
            "checks": [{"name": c.name, "passed": c.passed, "detail": c.detail} for c in self.checks],
        }

    def __str__(self) -> str:
        share = f" ({self.covered / self.model_params:.1%})" if self.model_params else ""
        lines = [
            f"model       {self.model}",
            f"graph       {self.nodes} nodes, {self.units:,} rescaling units, {self.graph_params:,} parameters "
            "(batch-norms folded)",
            f"parameters  {self.covered:,} of the model's {self.model_params:,} read by the graph{share}",
        ]
        for name, entries, why in self.not_reached[:10]:
            lines.append(f"  not reached: {name} ({entries:,} entries): {why}")
        if len(self.not_reached) > 10:
            lines.append(f"  ... and {len(self.not_reached) - 10} more not reached")
        lines += [str(c) for c in self.checks]
        lines.append("all checks hold" if self.passed else "FAILED: " + ", ".join(c.name for c in self.failed))
        return "\n".join(lines)


def check(model, input_shape=None, example_input=None, seed: int = 0, scale: float = 0.5,
          max_paths: int | None = None, backend=None, progress: bool | None = None) -> CheckReport:
    """Compile ``model`` and run the checks of the module docstring; the model is not modified.

    Parameters
    ----------
    model, input_shape, example_input : as for ``pathir.compile``
    seed : seeds the random rescaling and the inputs of the checks
    scale : standard deviation of the random log-scales z
    max_paths : run the symbolic checks on graphs with at most this many paths
        (default ``pathir.neurons.symbolic.DEFAULT_MAX_PATHS``)
    backend : the backend of the IR's forward in the rescaling check ("torch", "numpy"; default torch)
    progress : a bar on stderr over the checks (None: when stderr is a terminal)

    Raises a PathirError where the model cannot be compiled at all (a refusal, not a failed check).
    """
    from pathir.neurons.symbolic import DEFAULT_MAX_PATHS  # lazy: imports networkx

    limit = DEFAULT_MAX_PATHS if max_paths is None else max_paths
    checks = []
    with Phases(("compile", "units", "write-back", "symbolic"), desc="check", progress=progress) as bar:
        bar.phase("compile")
        try:
            with warnings.catch_warnings(record=True) as caught:  # compile skips its self-check with a warning
                warnings.simplefilter("always")
                cm = pathir.compile(model, input_shape=input_shape, example_input=example_input, backend=backend)
            skipped = [str(w.message) for w in caught if str(w.message).startswith("self-check skipped")]
            for w in caught:
                if not str(w.message).startswith("self-check skipped"):
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            checks.append(CheckResult("self-check", None, skipped[0].removeprefix("self-check skipped: "))
                          if skipped else CheckResult("self-check", True,
                                                      "the IR's forward matches the model's own on a random batch"))
        except SelfCheckFailed as err:
            checks.append(CheckResult("self-check", False, str(err)))
            cm = pathir.compile(model, input_shape=input_shape, example_input=example_input, self_check=False,
                                backend=backend)
        rng = np.random.default_rng(seed)
        z = rng.normal(0.0, scale, len(cm.units))
        xs = {name: rng.normal(size=(2, *cm.graph.node(name).shape)) for name in cm.graph.inputs}
        bar.phase("units")
        checks.append(_check_ir_units(cm, z, xs))
        bar.phase("write-back")
        checks.append(_check_write_back(cm, model, z, xs, input_shape, example_input))
        bar.phase("symbolic")
        checks.append(_check_symbolic(cm, seed, limit))
    covered, total, missing = _coverage(cm, model, xs)
    return CheckReport(model=cm.name, nodes=len(cm.graph), units=len(cm.units), graph_params=cm.graph.num_params(),
                       model_params=total, covered=covered, not_reached=missing, checks=tuple(checks))


# ---------------------------------------------------------------- coverage


def _coverage(cm, model, xs) -> tuple[int, int, tuple]:
    """(entries read, entries in the model, ((name, entries, why), ...) not read). A torch parameter
    no graph param names as a source but which the model's output depends on (a conv bias folded
    into the batch-norm after it) counts as read: one autograd pass finds them."""

    if isinstance(model, Graph):  # its params are the model's
        return cm.graph.num_params(), cm.graph.num_params(), ()
    reached = {ref.name for p in cm.graph.params() for ref in p.sources}
    if hasattr(model, "named_parameters"):
        train_only = tuple(getattr(cm.writer, "train_only", ()))
        params = {name: int(t.numel()) for name, t in model.named_parameters()}
        reached |= _used_by_forward(model, xs, [n for n in params if n not in reached],
                                    getattr(cm.writer, "train_paths", ()))

        def why(name):
            if any(name == m or name.startswith(m + ".") for m in train_only):
                return "its module runs only in train mode (pathir analyses the eval-mode function)"
            return "the eval-mode forward does not use it on the way to an output"
    else:
        proto = load(model).proto
        params = _onnx_float_initializers(proto)
        reached |= _onnx_read(cm, proto, reached)

        def why(name):
            return "no output of the graph depends on it"
    covered = sum(k for name, k in params.items() if name in reached)
    missing = tuple((name, k, why(name)) for name, k in params.items() if name not in reached)
    return covered, sum(params.values()), missing


def _onnx_read(cm, proto, refs: set[str]) -> set[str]:
    """The ONNX initializers behind the graph's source refs that are not initializer names themselves (a Clip's
    threshold, bound as ``<node>.threshold``), every other input of a node one of them is read at, and the bounds
    of every Clip on an activation (0 of a ReLU, the threshold of a clipped ReLU: the graph reads them as its op)."""
    bindings = getattr(cm.writer, "bindings", {})
    out = {bindings[r].tensor for r in refs if r in bindings and bindings[r].tensor}
    # a tensor folded into a param another tensor of its node names (a conv's bias and a batch-norm's statistics,
    # folded into the bias its scale names): read, as every input of that node is
    nodes = {node for r in refs if r in bindings for node, _ in bindings[r].slots}
    out |= {b.tensor for b in bindings.values() if b.tensor and any(node in nodes for node, _ in b.slots)}
    constants = {t.name for t in proto.graph.initializer} | {o for n in proto.graph.node if n.op_type == "Constant"
                                                             for o in n.output}
    out |= {i for n in proto.graph.node if n.op_type == "Clip" and n.input and n.input[0] not in constants
            for i in n.input[1:] if i}
    return out


def _onnx_float_initializers(proto) -> dict[str, int]:
    from onnx import TensorProto


    floats = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
    return {t.name: math.prod(t.dims) for t in proto.graph.initializer if t.data_type in floats}


# ---------------------------------------------------------------- rescaling


def _deviation(out, ref) -> float:
    out, ref = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        return math.inf
    return float(np.abs(out - ref).max() / max(float(np.abs(ref).max()), 1e-300)) if ref.size else 0.0


def _as_numpy(out) -> dict:
    return {k: (tensor_float64(v) if hasattr(v, "detach") else np.asarray(v)) for k, v in out.items()}


def _check_ir_units(cm, z, xs) -> CheckResult:
    name = "rescaling units (IR)"
    backend = cm.get_backend()  # float64 (torch when installed, else numpy)
    before = _as_numpy(forward(cm.graph, backend, xs))
    after = _as_numpy(forward(rescale_graph(cm.graph, cm.units, z), backend, xs))
    err = max((_deviation(after[k], before[k]) for k in before), default=0.0)
    tol = TOLERANCE["float64"]
    detail = (f"a random rescaling of the {len(z):,} units (log-scales of std {np.std(z) if len(z) else 0:.2g}) "
              f"moves the float64 forward by {err:.2e} relative (tolerance {tol:g})")
    return CheckResult(name, err <= tol, detail)


def _check_write_back(cm, model, z, xs, input_shape, example_input) -> CheckResult:
    name = "rescaling write-back"
    if hasattr(model, "named_parameters"):
        return _torch_write_back(name, cm, model, z, xs, input_shape, example_input)
    if cm.writer is not None and hasattr(cm.writer, "to_onnx"):
        return _onnx_write_back(name, model, z, xs, input_shape)
    return CheckResult(name, None, "a bare Graph has no model to write into")


def _flat(out) -> list:
    from pathir.frontends.torch.inputs import output_tensors  # lazy: imports torch

    return output_tensors(out)


def _torch_outputs(model, xs, train=()) -> list:
    import torch

    from pathir.frontends.torch.inputs import eval_forward, model_dtype_device  # lazy: imports torch

    dtype, device = model_dtype_device(model)
    with eval_forward(model, train), torch.no_grad():  # the heads forward when compiled with aux heads
        inputs = [torch.from_numpy(x.copy()).to(dtype=dtype, device=device) for x in xs.values()]
        return [t.double().cpu().numpy() for t in _flat(model(*inputs))]


def _used_by_forward(model, xs, names, train=()) -> set[str]:
    """Those of ``names`` (parameters requiring grad) the eval-mode output depends on, by
    ``torch.autograd.grad`` (the model's ``.grad`` fields are not touched)."""
    import torch

    from pathir.frontends.torch.inputs import eval_forward, model_dtype_device  # lazy: imports torch

    params = dict(model.named_parameters())
    wanted = [n for n in names if params[n].requires_grad]
    if not wanted:
        return set()
    dtype, device = model_dtype_device(model)
    with eval_forward(model, train), torch.enable_grad():
        outs = [t for t in _flat(model(*[torch.from_numpy(x).to(dtype=dtype, device=device) for x in xs.values()]))
                if t.requires_grad]
        if not outs:
            return set()
        grads = torch.autograd.grad(sum(t.sum() for t in outs), [params[n] for n in wanted], allow_unused=True)
    return {n for n, g in zip(wanted, grads) if g is not None}


def _torch_write_back(name, cm, model, z, xs, input_shape, example_input) -> CheckResult:
    twin = copy.deepcopy(model).double()
    if example_input is not None and hasattr(example_input, "double"):
        example_input = example_input.double()
    twin_cm = pathir.compile(twin, input_shape=input_shape, example_input=example_input, self_check=False)
    if len(twin_cm.units) != len(z):
        return CheckResult(name, False, f"the float64 copy has {len(twin_cm.units)} units, the model {len(z)}")
    before_tensors = {k: v.clone() for k, v in twin.state_dict().items()}
    train = twin_cm.writer.train_paths
    before = _torch_outputs(twin, xs, train)
    try:
        twin_cm.commit_rescaling(z)
    except PathirError as err:
        return CheckResult(name, None, f"write-back refused on this model: {err}")
    after = _torch_outputs(twin, xs, train)
    # a tensor new after the write (a clipped ReLU replaced by a ClippedReLU holds its threshold) counts as changed
    changed = sum(k not in before_tensors or v.shape != before_tensors[k].shape or not bool((v == before_tensors[k]).all())
                  for k, v in twin.state_dict().items())
    err = max((_deviation(a, b) for a, b in zip(after, before)), default=0.0)
    tol = TOLERANCE["float64"]
    detail = (f"written into a float64 copy: {changed} tensors changed, its own forward moved by {err:.2e} "
              f"relative (tolerance {tol:g})")
    if len(z) and not changed:
        return CheckResult(name, False, detail + "; a rescaling of nonzero units changed no tensor")
    return CheckResult(name, err <= tol and len(after) == len(before), detail)


def _onnx_write_back(name, model, z, xs, input_shape) -> CheckResult:
    try:
        import onnxruntime as ort
    except ImportError:
        return CheckResult(name, None, "onnxruntime is not installed")
    twin = pathir.compile(model, input_shape=input_shape, self_check=False)  # its writer holds a copy
    source = twin.to_onnx()
    try:
        twin.commit_rescaling(z)
    except PathirError as err:
        return CheckResult(name, None, f"write-back refused on this model: {err}")

    def run(proto):
        sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        feeds = {}
        for inp in sess.get_inputs():
            dtype = np.float64 if inp.type == "tensor(double)" else np.float32
            x = xs[inp.name]
            batch = inp.shape[0] if inp.shape and isinstance(inp.shape[0], int) else x.shape[0]
            feeds[inp.name] = np.resize(x, (batch, *x.shape[1:])).astype(dtype)  # a file's fixed batch (1 by default)
        return sess.run(None, feeds), dtype

    try:
        (before, dtype), (after, _) = run(source), run(twin.to_onnx())
    except Exception as err:  # onnxruntime's judgement, not pathir's
        return CheckResult(name, None, f"onnxruntime cannot run the model ({type(err).__name__})")
    tol = TOLERANCE[np.dtype(dtype).name]
    err = max((_deviation(a, b) for a, b in zip(after, before)), default=0.0)
    return CheckResult(name, err <= tol, f"written into a copy run by onnxruntime ({np.dtype(dtype).name}): "
                                         f"its forward moved by {err:.2e} relative (tolerance {tol:g})")


# ---------------------------------------------------------------- symbolic


def _check_symbolic(cm, seed: int, limit: int) -> CheckResult:
    name = "symbolic"
    log10_paths = cm.num_paths(log10=True)
    if log10_paths > math.log10(max(limit, 1)):
        return CheckResult(name, None, f"10^{log10_paths:.1f} paths, above the {limit} the exact checks enumerate")
    try:
        report = cm.verify_symbolic(seed=seed, max_paths=limit)
    except GraphTooLarge as err:
        return CheckResult(name, None, str(err))
    if report.passed:
        return CheckResult(name, True, f"{len(report.checks)} exact checks hold ({', '.join(c.name for c in report.checks)})")
    return CheckResult(name, False, "; ".join(f"{c.name}: {c.detail}" for c in report.failed))
