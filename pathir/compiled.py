"""The Compiled object: a lowered model, its graph, and every computation on it.

Each method is a thin door to the module that implements it; the user's model
is touched only by the write-back methods (pathcond, enorm, normalize, prune),
all at once, after everything else succeeded.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import numbers
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from pathir.analyses.facts import GraphFacts
from pathir.backends import get_backend
from pathir.enorm.run import enorm, normalize_units
from pathir.equalization.run import equalize
from pathir.errors import ArgumentError, ModelChanged, PassWroteInput, PathirError, PathirWarning
from pathir.ir import Graph, MapKind, Role
from pathir.ir.inputs import graph_inputs, tensor_float64
from pathir.lifting.active import active_path_counts, active_path_norm, local_affine
from pathir.lifting.diag_g import diag_g
from pathir.lifting.path_norm import num_paths, path_norm, path_norms
from pathir.lifting.path_norm_grad import check_differentiable_q, path_norm_and_grads
from pathir.lifting.pruning import path_magnitude_scores, prune
from pathir.lifting.walk import forward
from pathir.passes.manager import pass_name, run_recording
from pathir.pathcond.run import pathcond
from pathir.rescaling.apply import rescale_graph
from pathir.rescaling.bounds import default_max_log_scale
from pathir.rescaling.commit import check_optimizer, check_writable, commit_rescaling, rescaled_graph, with_bias_shifts
from pathir.support.array_pool import release as release_reserve
from pathir.support.progress import Phases
from pathir.support.threads import one_blas_thread

__all__ = ["Compiled", "Summary"]


#: why a Compiled is neither copied nor pickled
_NOT_COPIED = ("a Compiled follows one live model (it watches that model's tensors and re-reads them) and is not "
               "pickled, nor copied where it is a snapshot (rescaled(), apply()): compile the model again "
               "(pathir.compile(model, ...)) where it is loaded; cm.graph is a plain value you can copy or pickle")


def _looks_once(method):
    """Within one call of ``method`` (and the calls it makes), the model is compared with its reference
    once, at the first query: while a method runs only pathir's own write-back moves the model, and it
    has the next query look again. A look costs a walk over every module and tensor (~2 ms on
    shufflenet_v2; PathCond queried it six times)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.looking_once():
            return method(self, *args, **kwargs)

    return wrapper


@dataclass
class Summary:
    """What ``cm.summary()`` reports; ``str()`` is a table, ``to_dict()`` is JSON-ready."""

    name: str
    params: int
    graph_params: int
    nodes: int
    hidden_neurons: int
    hidden_channels: int
    log10_paths: float
    log10_path_norms: dict[float, float]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "params": self.params,
            "graph_params": self.graph_params,
            "nodes": self.nodes,
            "hidden_neurons": self.hidden_neurons,
            "hidden_channels": self.hidden_channels,
            "log10_paths": self.log10_paths,
            "path_norms": {f"l{q:g}": _maybe_exp10(v) for q, v in self.log10_path_norms.items()},
            "log10_path_norms": {f"l{q:g}": v for q, v in self.log10_path_norms.items()},
            **self.extra,
        }

    def __str__(self) -> str:
        rows = [
            ("model", self.name),
            ("parameters", f"{self.params:,}"),
            ("parameters in the graph (batch-norms folded)", f"{self.graph_params:,}"),
            ("nodes", f"{self.nodes}"),
            ("hidden neurons", f"{self.hidden_neurons:,}"),
            ("hidden channels", f"{self.hidden_channels:,}"),
            ("log10 #paths", f"{self.log10_paths:.3f}"),
        ]
        for q, v in self.log10_path_norms.items():
            rows.append((f"l{q:g} path-norm", _sci(v)))
        for k, v in self.extra.items():
            rows.append((k, str(v)))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _maybe_exp10(log10_value: float) -> float | None:
    return 10.0**log10_value if log10_value < 308 else None


def _sci(log10_value: float) -> str:
    if not math.isfinite(log10_value):
        return "0" if log10_value < 0 else "inf"
    e = math.floor(log10_value)
    return f"{10 ** (log10_value - e):.4f}e{e:+d}"


class Compiled:
    """A model lowered to the pathir IR: a thin façade over the algorithm modules.

    Every method unwraps the Compiled (graph, units, row keys, backend), calls the
    module that implements it and returns its result; a rescaling reaches the model
    only through :meth:`commit_rescaling`, masks only through :meth:`prune`.

    Attributes
    ----------
    graph : Graph
        The IR after the compile pipeline (batch-norms folded). Assigning a new graph
        drops what was found for the old one (units, B, row keys).
    model : object
        The user's model (nn.Module or onnx.ModelProto); changed only by write-back.
    writer : object
        The frontend's write-back handle (``rescale``, ``mask``; ``to_onnx`` and
        ``save`` for ONNX), ``None`` for a Compiled made from a bare Graph.

    A Compiled of a torch model follows it: every query first checks (about a
    millisecond) whether a parameter or buffer changed in place since compile or
    the last write-back (an optimizer step, ``load_state_dict``, an edit under
    ``torch.no_grad()``) and then re-reads the model into the same structure; a
    changed structure (a replaced module, a new shape, a new hook) raises
    ``ModelChanged`` asking to compile again. A Compiled derived from another
    (:meth:`rescaled`, :meth:`apply`) is a snapshot: it raises ``ModelChanged``
    once the model has moved. See docs/capture.md.
    """

    def __init__(self, graph: Graph, model=None, writer=None, source_num_params: int | None = None,
                 backend=None, name: str | None = None, watch=None, relower=None, read_written=None):
        self._watch, self._relower = watch, relower
        self._read_later = None  # a re-read of the written model a Ctrl-C cut short: done by the next query
        self._read_written = read_written  # () -> the graph of the model a writer holds now (ONNX), lowered again
        self._local = threading.local()  # _calls and _looked, per thread (see _looks_once)
        self._lock = threading.RLock()  # one thread at a time follows the model
        self.graph = graph
        self.model = model
        self.writer = writer
        self.transformed_by: tuple[str, ...] = ()  # user passes that changed the graph (compile): no write-back
        self.passes_run: tuple[str, ...] = ()  # every user pass run on the graph (compile's passes=, apply)
        self.source_num_params = source_num_params if source_num_params is not None else graph.num_params()
        self.backend = backend
        self.name = name or graph.name
        self._backends: dict = {}
        self._coordinates = None  # the graph's params as torch functions of the model's tensors
        self._spoiled = ""  # why the graph no longer holds the model's values (a pass wrote into it): every query refuses
        self._family = weakref.WeakSet([self])  # this Compiled and those made from it (apply, rescaled): they share params

    @property
    def _calls(self) -> int:
        return getattr(self._local, "calls", 0)

    @_calls.setter
    def _calls(self, value: int) -> None:
        self._local.calls = value

    @property
    def _looked(self) -> bool:
        return getattr(self._local, "looked", False)

    @_looked.setter
    def _looked(self, value: bool) -> None:
        self._local.looked = value

    def __copy__(self):
        """A second Compiled of the same model (its own watch: each follows the model by itself)."""
        return self._copy_of(self.model, {})

    def __deepcopy__(self, memo):
        """A Compiled of a deep copy of the model (the copy the memo holds, where a container such as a module
        holding a PathNormPenalty is copied), compiled again as this one was: it follows that copy."""
        return self._copy_of(None, memo)

    def _copy_of(self, model, memo: dict) -> "Compiled":
        if self.model is None:  # a bare Graph: a value
            return Compiled(copy.deepcopy(self.graph, memo), backend=self.backend, name=self.name)
        recompile = getattr(self, "_recompile", None)  # set by compile: a snapshot (rescaled(), apply()) has none
        if recompile is None:
            raise PathirError(_NOT_COPIED)
        if hasattr(self.writer, "to_onnx"):  # ONNX: the model as written so far
            model = self.to_onnx()
        elif model is None:
            model = copy.deepcopy(self.model, memo)
        out = recompile(model)
        out.name = self.name
        return out

    def __reduce_ex__(self, protocol):
        raise PathirError(_NOT_COPIED)

    @property
    def graph(self) -> Graph:
        return self.facts.graph

    @graph.setter
    def graph(self, graph: Graph) -> None:
        self._facts = GraphFacts(graph)

    @contextlib.contextmanager
    def looking_once(self):
        """Within the block (one public call, or compile's self-check), the model is compared with its
        reference once, at the first query (`_looks_once`). numpy's BLAS runs on one thread within
        (`pathir.support.threads.one_blas_thread` says why)."""
        self._calls += 1
        try:
            with one_blas_thread():
                yield
        finally:
            self._calls -= 1
            if not self._calls:
                self._looked = False

    @property
    def facts(self) -> GraphFacts:
        """The current graph's record (units, B, row keys), after following the model."""
        if self._spoiled:
            raise ModelChanged(self._spoiled)
        if self._read_later is not None:  # the model's own values as written (rounded to its dtype)
            read, self._read_later = self._read_later, None
            traced = _read_as(self._facts.graph, read)
            if traced is not None:
                self._facts = self._facts.with_values(traced)
        if self._watch is not None and not self._looked:
            with self._lock:  # a query in another thread, mid-call, does not stand for this thread's look
                change = self._watch.changed()
                if change is not None:
                    self._follow(change)
            self._looked = self._calls > 0
        try:
            self._facts.check_finite(self.transformed_by)
        except PathirError as err:
            bad = _nonfinite_tensors(self.model)
            if bad:  # the tensors the model holds them in (a parametrization's original0, a buffer)
                err.add_note(f"the model's tensors with NaN or infinite entries: {', '.join(bad)}")
            raise
        return self._facts

    def _follow(self, change: str) -> None:
        if self._relower is None and self._read_written is not None and change == "values":
            # an ONNX model another Compiled wrote through the same writer (one made by apply()): read again
            traced = _read_as(self._facts.graph, self._read_written)
            if traced is None:
                raise ModelChanged(f"{self.name}: the ONNX model this Compiled writes was written by another Compiled "
                                   "and no longer reads as the same graph; compile it again (cm.to_onnx())")
            self._facts = self._facts.with_values(traced)
            self._watch.mark()
            return
        if self._relower is None:
            raise ModelChanged(f"{self.name}: this Compiled is a snapshot (made by rescaled() or apply()) and "
                               f"its model has changed since ({change}): derive it again from a fresh compile")
        if change != "values":
            raise ModelChanged(f"{self.name}: the model's structure changed since compile ({change}): "
                               "compile it again with pathir.compile")
        self.refresh(self._watch.moved())

    def refresh(self, _moved: set[str] | None = None) -> None:
        """Re-read the model's current tensors into the graph (same structure). Queries do it by
        themselves after any in-place change autograd sees (reading only values when only weights
        moved, docs/live.md); call it after an edit through ``.data``."""
        if self._relower is None:
            return
        old, new = self._facts.graph, self._relower(_moved)
        if str(new) != str(old) and _form(new) == _form(old):
            # the same graph up to its nodes' names (a clipped ReLU a write made per-channel, which torch.export names
            # otherwise): the graph read, under the names of the graph kept (its fixed maps' values as read too)
            new = _named_as(new, old)
        if str(new) != str(old):
            raise ModelChanged(f"{self.name}: the model no longer lowers to the same graph; compile it again "
                               "with pathir.compile")
        self._facts = self._facts.with_values(new)
        self._watch.mark()

    def __repr__(self) -> str:
        return f"<pathir.Compiled {self.name}: {len(self.graph)} nodes, {self.graph.num_params():,} params>"

    def _with_graph(self, graph: Graph, changed: tuple[str, ...] = (), ran: tuple[str, ...] = ()) -> "Compiled":
        """A snapshot Compiled of ``graph`` with this one's model: it refuses queries once the model moves,
        and write-backs where ``changed`` (or this one's ``transformed_by``) names what moved its params."""
        watch = None if self._watch is None else self._watch.fresh()
        out = Compiled(graph, self.model, self.writer, self.source_num_params, self.backend, self.name, watch=watch)
        out._family = self._family  # (one set: a write into a param any of them shares mends them all)
        self._family.add(out)
        out.transformed_by = self.transformed_by + tuple(changed)
        out.passes_run = self.passes_run + tuple(ran)
        return out

    # ---------------------------------------------------------------- basics
    def get_backend(self, backend=None):
        """The backend to use (``backend``, else the Compiled's default); named backends are
        built once per Compiled, so the torch backend's device copies are reused between calls."""

        choice = backend if backend is not None else self.backend
        if choice is not None and not isinstance(choice, str):
            return get_backend(choice)
        if choice not in self._backends:
            self._backends[choice] = get_backend(choice)
        return self._backends[choice]

    def release(self) -> None:
        """Free what outlives a call: the units, B and row keys of the graph, the backends'
        device copies of the params, and the memory of earlier values kept for the next re-read of the
        model (the lowering's free blocks, and the process's reserve of dead Compileds' ones). Later calls
        rebuild what they need."""
        self._facts = GraphFacts(self._facts.graph)
        self._backends.clear()
        self._coordinates = None
        drop = getattr(self._relower, "drop_free", None)
        if drop is not None:
            drop()
        release_reserve()

    def forward(self, x, backend=None):
        """The IR's own forward R_theta(x) (float64); x of shape (B, *input shape).
        Returns the output array, a dict {output node: array} if several outputs, or, where the model
        returns one node more than once (``return h, h``), a tuple in the model's output order (a dict
        would hold it once); as the backend's array type."""

        out = forward(self.graph, self.get_backend(backend), x)
        names = self.graph.outputs
        if len(names) == 1:
            return out[names[0]]
        return tuple(out[n] for n in names) if len(set(names)) < len(names) else out

    def path_norm(self, q: float = 1.0, log10: bool = False, backend=None, differentiable: bool = False):
        """The l_q path-norm ||Phi(theta)||_q (docs/math.md §3), q > 0, or max_p |Phi_p| for
        q = math.inf; exact in log scale for every q and every representative of θ
        (docs/paths.md); ``log10=True`` gives its log10 (for norms beyond 1e308).

        ``differentiable=True`` (a torch model, 1 <= q < inf): a float64 torch scalar whose autograd
        gradient with respect to the model's own parameters is exactly d||Phi||_q/dθ, batch-norms
        folded or not, for use in a loss (docs/training.md)."""

        if differentiable:
            if log10:
                raise ArgumentError("path_norm: differentiable=True returns the norm itself; log10 is not offered with it")
            return self._differentiable_path_norm(q, backend)
        return path_norm(self.graph, q, self.get_backend(backend), log10)

    def _differentiable_path_norm(self, q, backend):
        q = check_differentiable_q(q)
        if self._relower is None:
            raise PathirError(f"{self.name}: path_norm(differentiable=True) needs a Compiled of a torch nn.Module, "
                              "following it (not an ONNX model, a bare Graph or a snapshot)")
        from pathir.frontends.torch.differentiable import eagerly  # lazy: imports torch

        return eagerly(self._path_norm_attached, q, backend)

    def _path_norm_attached(self, q, backend):
        from pathir.frontends.torch.coordinates import Coordinates  # lazy: imports torch
        from pathir.frontends.torch.differentiable import attach  # lazy: imports torch

        graph = self.graph  # follows the model first
        value, grads = path_norm_and_grads(graph, q, self.get_backend(backend))
        if self._coordinates is None or not self._coordinates.fits():  # built again after pruning, a module replaced
            self._coordinates = Coordinates(graph, self.model, rtol=1e-12, who="path_norm(differentiable=True)")
        coords = self._coordinates
        coords.check_each(graph, 1e-12, "path_norm(differentiable=True)")
        return attach(value, coords, grads)

    def path_norms(self, qs: Iterable[float] = (1, 2, 4), log10: bool = False, backend=None) -> dict[float, float]:
        """{q: :meth:`path_norm` (q)} for several q, on one compile: the model is read once, and the
        float64 copies of its weights on the backend are shared by the walks (one walk per q)."""
        return path_norms(self.graph, qs, self.get_backend(backend), log10)

    def num_paths(self, log10: bool = False, backend=None) -> float:
        """Number of paths of the DAG; ``log10=True`` for its log10."""

        return num_paths(self.graph, self.get_backend(backend), log10)

    # ------------------------------------------------ path activations at data
    def active_path_norm(self, x, q: float = 1.0, log10: bool = False, backend=None) -> np.ndarray:
        """‖Φ(θ) ⊙ a(θ, x)‖_q per sample of ``x`` (B, *input shape): the path-norm of the
        paths active at each sample (docs/activations.md); ``log10`` as for :meth:`path_norm`."""

        return active_path_norm(self.graph, self.get_backend(backend), x, q, log10)

    def active_path_counts(self, x, log10: bool = True, backend=None) -> np.ndarray:
        """Number of paths active at each sample of ``x`` (log10 by default)."""

        return active_path_counts(self.graph, self.get_backend(backend), x, log10)

    def local_affine(self, x, backend=None):
        """The affine piece J x' + c the model computes around each sample of ``x``
        (a :class:`pathir.lifting.active.LocalAffine`: ``intercept``, ``jvp``, ``vjp``, ``slope``)."""

        return local_affine(self.graph, self.get_backend(backend), x)

    def hidden_neurons(self) -> int:
        return sum(n.numel for n in self.graph.nodes if self.graph.is_hidden(n.name))

    def hidden_channels(self) -> int:
        """Sum of output channels of every conv / linear layer except those feeding an
        output (the classifier): the PathCond paper's count of hidden units."""
        total = 0
        for n in self.graph.nodes:
            if n.name in self.graph.outputs:
                continue
            total += sum(n.channels for e in n.edges if e.map.kind in (MapKind.DENSE, MapKind.CONV))
        return total

    @_looks_once
    def summary(self, qs: Sequence[float] = (1, 2, 4), backend=None) -> Summary:
        """Parameters, hidden neurons and channels, log10 #paths and path-norms."""
        be = self.get_backend(backend)
        return Summary(
            name=self.name,
            params=self.source_num_params,
            graph_params=self.graph.num_params(),
            nodes=len(self.graph),
            hidden_neurons=self.hidden_neurons(),
            hidden_channels=self.hidden_channels(),
            log10_paths=self.num_paths(log10=True, backend=be),
            log10_path_norms=self.path_norms(qs, log10=True, backend=be),
        )

    def apply(self, *passes, check: bool = True) -> "Compiled":
        """A new Compiled whose graph is this one's after ``passes`` (verified between them). A pass that
        changes the params is recorded in ``transformed_by``, and the new Compiled writes nothing back.
        A pass that writes into this one's graph instead is refused (``PassWroteInput``), and this one reads
        its model's values again, or, with nothing to read them from, refuses every query after."""

        try:
            graph, changed = run_recording(self.graph, passes, check=check)
        except PassWroteInput as err:
            for member in sorted(self._family, key=lambda c: c is not self):  # this one's note first
                err.add_note(member._mend_written(err, member is self))
            raise
        return self._with_graph(graph, changed, tuple(pass_name(p) for p in passes))

    def _mend_written(self, err: PassWroteInput, own: bool) -> str:
        """This Compiled's graph as its model holds it again, after a pass wrote into it or into a param it shares
        with one made from the same compile (``own``: into its own graph); what was done, as a note."""
        which = f"{self.name}: this Compiled" if own else f"{self.name}: a Compiled sharing those params (apply, rescaled)"
        try:
            if self._relower is not None:  # a live torch model: its tensors as they are now
                self._facts = self._facts.with_values(self._relower(None))
                return f"{which} read its model's values again"
            if self._read_written is not None:  # an ONNX model: as its writer holds it
                traced = _read_as(self._facts.graph, self._read_written)
                if traced is not None:
                    self._facts = self._facts.with_values(traced)
                    return f"{which} read its ONNX model's values again"
        except PathirError:
            pass
        given = " (the Graph given to pathir.compile itself was written)" if self.model is self._facts.graph else ""
        self._spoiled = (f"{self.name}: {str(err).split('.')[0]}{given}; this Compiled's graph, or one sharing its "
                         "params, no longer holds its model's values, and it has nothing to read them from again: "
                         "derive it again from a fresh compile")
        return f"{which} refuses every query from now on"

    # ---------------------------------------------------------------- ONNX models
    def _onnx_writer(self, what: str):
        if not (hasattr(self.writer, "to_onnx") and hasattr(self.writer, "save")):
            source = type(self.model).__name__ if self.model is not None else "a Graph"
            raise PathirError(f"cm.{what}() needs a model compiled from ONNX; this one was compiled from {source}")
        return self.writer

    def to_onnx(self):
        """The ONNX model with every write-back so far (pathcond, enorm, normalize,
        prune), as a new onnx.ModelProto; the source model or file is untouched."""
        return self._onnx_writer("to_onnx").to_onnx()

    def save(self, path) -> None:
        """Write :meth:`to_onnx` to ``path`` (through a temporary file: a failure leaves no file); never over
        the file the model was compiled from."""
        self._onnx_writer("save").save(path)  # (which refuses the files the model was read from)

    # ---------------------------------------------------------------- rescaling units
    @property
    def units(self):
        """The rescaling units of the graph (``pathir.analyses.find_units.Units``), found once per graph."""
        return self.facts.units

    def incidence(self):
        """(B, layout): the sparse n x H matrix B and the ParamLayout of θ, built once per graph
        (do not modify B)."""
        return self.facts.incidence

    def row_keys(self):
        """B's rows as a ``pathir.analyses.unit_rows.RowKeys``: per row, e(i) (H + 1) + l(i),
        the unit θ_i enters and the one it leaves (H for none), and A = -Bᵀ1, read from the units.
        The PathCond and ENorm solvers take it instead of B. Built once per graph."""
        return self.facts.row_keys

    @_looks_once
    def diag_g(self, backend=None) -> dict[str, np.ndarray]:
        """diag G: {source param name: array in the source tensor's layout and shape}.
        Raises PathNormOverflow beyond float64 (see ``pathir.lifting.diag_g.diag_g_flat``)."""

        return self._in_source_shapes(diag_g(self.graph, self.get_backend(backend)))

    def _in_source_shapes(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``arrays`` with each one shaped as the model holds its tensor (a bias held (C, 1, 1) or (1, C, 1, 1): the
        graph's param is (C,)), where the writer knows that shape and it has as many entries."""
        shape_of = getattr(self.writer, "source_shape", None)
        if shape_of is None or self.transformed_by:
            return arrays
        for name, value in arrays.items():
            shape = shape_of(name)
            if shape is not None and tuple(shape) != value.shape and math.prod(shape) == value.size:
                arrays[name] = value.reshape(shape)
        return arrays

    # ---------------------------------------------------------------- rescaling the model
    def commit_rescaling(self, z, optimizer=None, bias_shifts=None) -> None:
        """Rescale the model and the graph by z (one log-scale per unit: θ ← θ ⊙ exp(-Bz/2)),
        all or nothing: the model is written through the frontend writer (a Compiled made from
        a bare Graph has only its graph rescaled), then the rescaled graph becomes current and
        keeps the units, B and row keys found so far. With ``optimizer`` (a torch.optim optimizer
        of the model) its state moves too (docs/training.md). ``bias_shifts`` ({bias param name: array}):
        added to those biases after the rescaling, in the same transaction (bias absorption,
        docs/equalize.md). On any error nothing changed."""

        self._refuse_transformed("a rescaling")
        facts = self.facts
        follows = self._relower is not None and self.writer is not None  # a live torch model: re-read it
        # an ONNX model is lowered again as written: no rescaled float64 graph beside the old one and the new
        reads_written = self._read_written is not None and self.writer is not None
        try:
            new_graph = commit_rescaling(facts.graph, facts.units, z, self.model, self.writer, optimizer,
                                         bias_shifts=bias_shifts, rescaled=not (follows or reads_written))
        except BaseException as err:  # restored exactly: the model matches the graph again
            self._mark()
            if isinstance(err, PathirError) and self.passes_run and "output" in str(err) and "moved by" in str(err):
                err.add_note(f"This Compiled's graph went through your passes {list(self.passes_run)}: one that changes "
                             "what the graph computes (drops a branch, replaces an op) makes a rescaling of the graph "
                             "no rescaling of the model. Write back from a Compiled without it.")
            raise
        self._looked = False  # the model was written: the next query compares it again
        # the graph then holds the model's own values as written (rounded to its dtype), not float64 products
        # that drift from a float32 model: re-read where that reaches them, else read again where the model
        # reads as before
        if new_graph is None and follows and self._watch.changed() == "values":
            moved = self._watch.moved()
            if self._relower.covers(moved):
                return  # the next query re-reads the values the model holds now (docs/live.md)
            read_again = functools.partial(self._relower, moved)  # a value no re-read reaches (a pruned weight)
        else:  # a torch module replaced (a clipped ReLU made per-channel): traced again; an ONNX model: lowered again
            read_again = functools.partial(self._relower, None) if follows else self._read_written
        interrupted = None
        try:
            traced = _read_as(facts.graph, read_again)
        except ModelChanged as err:  # the model is written, in full; the graph it reads as is not this one's
            self._mark()
            self._spoiled = f"{err} (found on reading the model back after a write-back, which was written in full)"
            return
        except KeyboardInterrupt as err:  # Ctrl-C in the re-read: the model is written, so this Compiled holds the
            traced, interrupted = None, err  # float64 products, and its next query reads the model's own values
            self._read_later = read_again
            err.add_note("pathir: the rescaling had been written to the model, in full, before the interrupt; the "
                         "Compiled holds it too (its next query reads the values the model holds)")
        if traced is not None:
            self._mark()
            self._facts = facts.with_values(traced)
            return
        if new_graph is None:  # a trace of another form (a module the torch.export path reads otherwise): the
            # graph is rescaled here
            new_graph = with_bias_shifts(rescaled_graph(facts.graph, facts.units, z), bias_shifts)
        self._mark()
        self._facts = facts.with_values(new_graph)
        if interrupted is not None:
            raise interrupted

    @_looks_once
    def pathcond(self, solver: str = "newton", max_sweeps: int = 1000, tol: float = 1e-10,
                 write_back: bool = True, backend=None, max_log_scale: float | None = None, callback=None,
                 optimizer=None, progress: bool | None = None):
        """PathCond: minimise F(z) and rescale the model in place (function preserved);
        returns a PathCondReport. ``write_back=False`` leaves model and graph as they are
        (apply ``report.z`` with :meth:`rescaled` or :meth:`commit_rescaling`). ``max_log_scale``
        bounds every |z_h|: None (default) the largest the model's dtype holds, math.inf none.
        ``callback(step, F)`` runs after each solver step. ``optimizer``: its state moves with the
        rescaling (docs/training.md). ``progress``: a bar on stderr (None: when stderr is a
        terminal; see docs/cli.md). See docs/pathcond.md."""

        self._check_writable(write_back)
        max_log_scale = self._bound(max_log_scale)
        return pathcond(self.facts, self.get_backend(backend), solver=solver, max_sweeps=max_sweeps, tol=tol,
                        commit=self._committer(write_back, optimizer), name=self.name,
                        max_log_scale=max_log_scale, callback=callback, progress=progress)

    @_looks_once
    def equalize(self, bits: int = 8, objective: str = "noise", inputs=None, write_back: bool = True,
                 max_log_scale: float | None = None, optimizer=None, backend=None, progress: bool | None = None,
                 callback=None, certify: bool | None = None, absorb_bias: bool = False):
        """Equalization for quantization: the rescaling, over every unit of the graph, that makes
        per-tensor quantization of every weight tensor (batch-norm folded) add the least rounding noise
        to the network, ``objective="noise"``; the same noise in the outputs on the batch ``inputs`` (a
        calibration batch: data-aware), ``"output-noise"``; that balances the tensors' ranges (Nagel's
        criterion), ``"range"``; or that minimises the certified bound on the output change quantizing at
        ``bits`` causes, ``"path-metric"`` (docs/math.md §12). Rescales the model in place (function
        preserved) and returns an EqualizeReport. ``inputs`` (a batch): the report measures the real output
        change of quantizing on it. ``certify``: the report computes the certified bound (default:
        with the path-metric objective only). ``max_log_scale``, ``optimizer``, ``progress``: as for
        :meth:`pathcond`. ``absorb_bias``: then bias absorption (DFQ §4.2, not exact: the report's
        ``absorption`` measures the output change on ``inputs``, or on a seeded random batch; an ONNX
        model's batch-norms must be kept as BatchNormalization nodes). See docs/equalize.md."""

        for flag, value in (("absorb_bias", absorb_bias), ("certify", certify)):
            if not (isinstance(value, (bool, np.bool_)) or (flag == "certify" and value is None)):
                raise ArgumentError(f"{flag} must be True or False, got {value!r}")
        inputs = graph_inputs(self.graph, inputs)
        self._check_writable(write_back)
        read_source = self._source_reader() if absorb_bias else None
        if absorb_bias and read_source is None:
            raise PathirError("absorb_bias=True reads the batch-norm tensors of a torch or ONNX model; this Compiled "
                              f"holds {type(self.model).__name__}: bias absorption is not offered for it (nothing was "
                              "changed)")
        lower = self.variance_lower_bounds() if max_log_scale is None else None
        max_log_scale = self._bound(max_log_scale, variance=lower is None)
        return equalize(self.facts, self.get_backend(backend), bits=bits, objective=objective,
                        max_log_scale=max_log_scale, commit=self._committer(write_back, optimizer), inputs=inputs,
                        name=self.name, progress=progress, callback=callback, certify=certify, lower=lower,
                        read_source=read_source, read_back=lambda: self.graph)

    def variance_lower_bounds(self) -> np.ndarray | None:
        """Per unit, the lowest z_h whose write-back keeps the running variance of every batch-norm it
        feeds (one that could not be folded) to the dtype's precision: var ← λ²(var + eps) − eps with
        λ = e^{z_h/2} needs λ²(var + eps) ≥ 1e-3·eps, less a margin of log 4. Growing a channel is
        always exact, so only the lower side is bounded, and only for those units; None if no unit is."""

        units = self.facts.units
        H = len(units)
        lower = np.full(H + 1, -np.inf)
        ends = {id(p): e for p, e in zip(units.params, units.ends)}
        for p, var, eps in self._unfolded_variances():
            leave = ends[id(p)][1] if id(p) in ends else None
            if leave is None:
                continue
            if var.shape != np.shape(p.value):
                return None  # not one variance per entry: the scalar bound applies
            bound = np.log(1e-3 * eps / (var + eps)) + math.log(4.0)
            np.maximum.at(lower, np.broadcast_to(np.asarray(leave), var.shape), bound)
        lower = lower[:H]
        return lower if np.isfinite(lower).any() else None

    def _source_reader(self):
        """name -> float64 array of the model's source tensor: an ONNX writer's current initializer, a torch
        model's parameter or buffer (None for a bare graph)."""
        read = getattr(self.writer, "read", None)
        if read is not None:
            return read
        if not hasattr(self.model, "named_buffers"):
            return None
        named = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        return lambda name: tensor_float64(named[name])

    def _unfolded_variances(self):
        """(param, running variance as float64 array, eps) of every batch-norm that could not be folded and
        whose running statistics a rescaling moves (IN_STATS sources: a torch model's modules, an ONNX writer's
        BatchNormalization bindings; none for a bare graph)."""
        bindings = getattr(self.writer, "bindings", None)
        if bindings is not None:  # ONNX
            for p in self.graph.params():
                for ref in p.sources:
                    b = bindings.get(ref.name) if ref.role == Role.IN_STATS else None
                    if b is not None and b.kind == "bn_var":
                        yield p, np.asarray(b.value, dtype=np.float64).reshape(-1), float(b.eps)
            return
        if not hasattr(self.model, "get_submodule"):
            return
        for p in self.graph.params():
            for ref in p.sources:
                if ref.role == Role.IN_STATS and ref.name.endswith("running_var"):
                    module = self.model.get_submodule(ref.name.rpartition(".")[0])
                    yield p, tensor_float64(module.running_var).reshape(-1), module.eps

    def rescaled_variance_ratio(self) -> float | None:
        """min (var + eps) / eps over the batch-norm channels whose running statistics a rescaling
        moves (batch-norms that could not be folded), for the default bound; None if there are none."""

        ratio = None
        for _, var, eps in self._unfolded_variances():
            if not eps > 0:  # (var + 0) / 0: no floor under the variance for a rescaling to approach
                continue
            low = float(((var + eps) / eps).min())
            ratio = low if ratio is None else min(ratio, low)
        return ratio

    def narrowest_dtype(self) -> str:
        """The float dtype of the model's tensors with the smallest range ("float64" for a bare Graph
        or a model of float64 tensors only): the one a rescaling must fit when written back."""
        names = set()
        if hasattr(self.model, "parameters"):
            tensors = [*self.model.parameters(), *self.model.buffers()]
            names = {str(t.dtype).rsplit(".", 1)[-1] for t in tensors if t.is_floating_point()}
        else:  # ONNX (a ModelProto, or a path the writer has read): TensorProto data types
            proto = self.model if hasattr(getattr(self.model, "graph", None), "initializer") else \
                getattr(self.writer, "source", None)
            codes = {1: "float32", 10: "float16", 11: "float64", 16: "bfloat16"}
            if hasattr(getattr(proto, "graph", None), "initializer"):
                names = {codes.get(t.data_type, "float64") for t in proto.graph.initializer}
        for name in ("float16", "bfloat16", "float32"):
            if name in names:
                return name
        return "float64"

    @_looks_once
    def enorm(self, p: float = 2.0, max_sweeps: int = 1000, tol: float = 1e-10, costs=None,
              solver: str = "newton", write_back: bool = True, max_log_scale: float | None = None,
              callback=None, optimizer=None, progress: bool | None = None):
        """ENorm: minimise Σ c_i |θ_i|^p over the rescalings with |z_h| ≤ max_log_scale (None: the
        largest the model's dtype holds, as for :meth:`pathcond`; math.inf: unbounded) and rescale
        the model in place; returns an ENormReport. ``optimizer``: its state moves with the
        rescaling (docs/training.md). See docs/normalize.md."""

        self._check_writable(write_back)
        bound = self._bound(max_log_scale)
        return enorm(self.facts, p=p, max_sweeps=max_sweeps, tol=tol, costs=costs, solver=solver,
                     commit=self._committer(write_back, optimizer), name=self.name,
                     max_log_scale=None if math.isinf(bound) else bound, callback=callback, progress=progress)

    def _bound(self, max_log_scale: float | None, variance: bool = True) -> float:
        """``max_log_scale``, or for None the largest bound whose rescalings write back into the
        model's dtype finite and normal (``pathir.rescaling.bounds.default_max_log_scale``; with
        ``variance``, also the running variances of unfolded batch-norms, as one scalar)."""
        if max_log_scale is not None:
            if isinstance(max_log_scale, bool) or not isinstance(max_log_scale, numbers.Real) or not max_log_scale >= 0:
                raise ArgumentError(f"max_log_scale must be a number >= 0 (math.inf: unbounded), got {max_log_scale!r}")
            return float(max_log_scale)
        ratio = self.rescaled_variance_ratio() if variance else None
        bound = default_max_log_scale(self.graph, self.narrowest_dtype(), variance_ratio=ratio)
        if bound == 0.0 and ratio is not None and default_max_log_scale(self.graph, self.narrowest_dtype()) > 0.0:
            self._warn_variance_bound(ratio)
        return bound

    def _warn_variance_bound(self, ratio: float) -> None:
        """Say that the default bound is 0 because of a batch-norm that could not be folded, and how to lift it."""
        p = next((p for p, var, eps in self._unfolded_variances() if float(((var + eps) / eps).min()) == ratio), None)
        stats = [r.name for r in (p.sources if p is not None else ()) if r.role == Role.IN_STATS]
        name = min(stats, key=len, default="?").removesuffix(".running_var").removesuffix(".running_mean")
        warnings.warn(f"the default bound on the rescaling is 0, so nothing is rescaled: the batch-norm '{name}' "
                      f"cannot be folded and its running var + eps is only {ratio:.3g} eps, which a write-back keeps "
                      "to full precision only while it stays above 1e3 eps (docs/pathcond.md, 'Bounded "
                      "rescalings'). Pass max_log_scale= (a few units) to rescale anyway: var + eps is then kept to "
                      "within 1e3 ulps, and a rescaling past that is refused", PathirWarning, stacklevel=5)

    @_looks_once
    def normalize(self, p: float = 2.0, write_back: bool = True, optimizer=None, progress: bool | None = None):
        """The canonical representative: every unit's incoming weights and bias get unit
        l_p norm; rescales the model in place; returns a NormalizeReport. ``optimizer``: its
        state moves with the rescaling (docs/training.md). See docs/normalize.md."""

        self._check_writable(write_back)
        return normalize_units(self.facts, p=p, commit=self._committer(write_back, optimizer),
                               name=self.name, progress=progress)

    def _check_writable(self, write_back: bool) -> None:
        """Refuse a write-back the writer would refuse, before any solver runs (and a ``write_back`` that is no
        bool: "no" is truthy, and would write)."""
        if not isinstance(write_back, (bool, np.bool_)):
            raise ArgumentError(f"write_back must be True or False, got {write_back!r}; nothing was changed")
        if write_back:
            self._refuse_transformed("a rescaling")
            check_writable(self.graph, self.writer)

    def _refuse_transformed(self, what: str) -> None:
        """Refuse to write ``what`` into the model where a user pass changed the graph's params or its structure:
        it is computed on values (or shapes, or a function) the model does not hold."""
        if self.transformed_by and self.writer is not None:
            raise PathirError(
                f"{what} is not written back: {', '.join(repr(n) for n in self.transformed_by)} changed the "
                "graph (its parameters' values or shapes, or the nodes and edges around them), so a result computed on that "
                "graph does not apply to the model's tensors. Write back from a Compiled without them (pathir.compile without those passes=, not the result "
                "of cm.apply(...) or cm.rescaled(z)); on this one use write_back=False. Nothing was changed")

    def _committer(self, write_back: bool, optimizer):
        """The ``commit`` callback of a rescaling method (None when ``write_back=False``); an
        ``optimizer`` whose state cannot move is refused here, before any solver runs."""
        if optimizer is None:
            return self.commit_rescaling if write_back else None
        if not write_back:
            raise PathirError("optimizer= moves the optimizer's state with a written rescaling: it needs write_back=True")

        check_optimizer(self.writer, optimizer)
        return lambda z, **kw: self.commit_rescaling(z, optimizer=optimizer, **kw)

    def rescaled(self, z) -> "Compiled":
        """A new Compiled whose graph is rescaled by z (one log-scale per unit:
        θ ← θ ⊙ exp(-Bz/2)). Φ and the function are unchanged; the model is not touched, and the new
        Compiled writes nothing back (its params are not the model's tensors: ``transformed_by``)."""

        return self._with_graph(rescale_graph(self.graph, self.units, z), ("rescaled(z)",))

    # ---------------------------------------------------------------- pruning
    @_looks_once
    def path_magnitude_scores(self, backend=None) -> dict[str, np.ndarray]:
        """S_i = Σ_{p ∋ i} |Φ_p(θ)|, one backward pass:
        {source param name: array in the source tensor's layout and shape}."""

        return self._in_source_shapes(path_magnitude_scores(self.graph, self.get_backend(backend)))

    @_looks_once
    def prune(self, amount, criterion: str = "path-magnitude", scope: str = "global",
              include_biases: bool = False, backend=None, progress: bool | None = None):
        """Zero the ``amount`` (fraction or count) lowest-scoring weights of the
        model, through the frontend writer, all at once; returns a PruneReport
        (pruned count, bound Σ S_i, path-norm before/after). ``progress``: a bar on stderr over
        the phases score, write (None: when stderr is a terminal). See docs/pruning.md."""

        with Phases(("score", "write"), desc=f"prune {self.name}", progress=progress) as bar:
            bar.phase("score")

            def commit(pruned, masks):
                bar.phase("write")
                self._commit_masks(pruned, masks)

            return prune(self.graph, self.get_backend(backend), amount, criterion, scope, include_biases,
                         commit=commit)

    def _commit_masks(self, pruned: Graph, masks) -> None:
        """Write the masks ({param name: bool array}) into the model, then make ``pruned`` current."""
        if self.writer is not None and masks:
            self._refuse_transformed("pruning")
            if not hasattr(self.writer, "mask"):
                raise PathirError(f"the writer of this model ({type(self.writer).__name__}) cannot write masks")
            try:
                self.writer.mask(self.graph, masks)
            finally:
                self._mark()
        self.graph = pruned

    def _mark(self) -> None:
        """The model as written by pathir is the reference the next query compares against."""
        self._looked = False
        if self._watch is not None:
            self._watch.mark()

    # ---------------------------------------------------------------- symbolic (small graphs)
    def conservation_laws(self, symbolic: bool = False) -> dict:
        """H_h = Σ_{in_h} θ_i² − Σ_{out_h} θ_i² for every unit:
        {unit name: value at the graph's θ}; ``symbolic=True``: {unit name:
        sympy expression in the parameter symbols}. See docs/symbolic.md."""
        from pathir.neurons.symbolic import conservation_law_expressions, conservation_laws  # lazy: imports networkx

        if symbolic:
            return conservation_law_expressions(self.graph, self.units)
        return conservation_laws(self.graph, self.units)

    def verify_symbolic(self, seed: int = 0, max_paths: int | None = None, samples: int = 2):
        """Exact checks on the neuron-level graph (small graphs only): rescaling
        invariance, lifting identity, conservation laws, rank DΦ, path-norm pass.
        Returns a SymbolicReport (``.passed``, ``.checks``). See docs/symbolic.md."""
        from pathir.neurons.symbolic import DEFAULT_MAX_PATHS, verify_symbolic  # lazy: imports networkx

        limit = DEFAULT_MAX_PATHS if max_paths is None else max_paths
        return verify_symbolic(self.graph, self.units, seed=seed, max_paths=limit, samples=samples)


def _read_as(graph: Graph, read) -> Graph | None:
    """``graph`` with the values of ``read()`` (the model as written, read again) where that has ``graph``'s
    form: the same nodes, edges and params up to the nodes' names (an ONNX Clip rewritten as Relu and Min names
    its ReLU otherwise); None where there is no ``read``, it refuses, or it reads otherwise."""
    if read is None:
        return None
    try:
        again = read()
    except ModelChanged:  # a pass changes the graph read where it kept it at compile: refused, as on torch
        raise
    except PathirError:
        return None
    values = {p.name: p.value for p in again.params()}
    if _form(again) != _form(graph) or any(np.shape(values.get(p.name)) != p.shape for p in graph.params()):
        return None
    return graph.map_params(lambda p: p.with_value(values[p.name], owned=True))  # (sources as the writer knows them)


def _nonfinite_tensors(model, most: int = 5) -> list[str]:
    """'name (k entries)' for the first ``most`` parameters and buffers of a torch ``model`` holding NaN or infinite
    entries ([] for any other model)."""
    if not hasattr(model, "named_parameters"):
        return []
    found = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and t.numel():
            k = int((~t.detach().isfinite()).sum())
            if k:
                found.append(f"'{name}' ({k} of {t.numel()} entries)")
                if len(found) == most:
                    break
    return found


def _named_as(graph: Graph, like: Graph) -> Graph:
    """``graph`` with each node named as the node at its position in ``like`` (a graph of the same form)."""
    names = {n.name: m.name for n, m in zip(graph.nodes, like.nodes)}
    nodes = [dataclasses.replace(n, name=names[n.name], edges=tuple(dataclasses.replace(e, source=names[e.source])
                                                                     for e in n.edges)) for n in graph.nodes]
    return Graph(tuple(nodes), tuple(names[o] for o in graph.outputs), graph.name)


def _form(graph: Graph) -> list[str]:
    """``graph``'s lines of text with each node named by its position (params keep their names)."""
    position = {n.name: str(i) for i, n in enumerate(graph.nodes)}
    lines = [f"{[position[i] for i in graph.inputs]} -> {[position[o] for o in graph.outputs]}"]
    for n in graph.nodes:
        terms = [f"{e.map.describe()}({position[e.source]})" for e in n.edges]
        lines.append(f"{n.kind.value}{n.k if n.kind.value == 'maxpool' else ''}{list(n.shape)} = {' + '.join(terms)} "
                     f"+ bias({None if n.bias is None else n.bias.name})")
    return lines
