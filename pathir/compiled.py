"""The Compiled object: a lowered model, its graph, and every computation on it.

Each method is a thin door to the module that implements it; the user's model
is touched only by the write-back methods (pathcond, enorm, normalize, prune),
all at once, after everything else succeeded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from pathir.ir import Graph, MapKind

__all__ = ["Compiled", "Summary"]


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
    """A model lowered to the pathir IR.

    Attributes
    ----------
    graph : Graph
        The IR after the compile pipeline (batch-norms folded).
    model : object
        The user's model (nn.Module or onnx.ModelProto); changed only by write-back.
    frontend : object
        The frontend's write-back handle (``None`` for a bare Graph).
    """

    def __init__(self, graph: Graph, model=None, frontend=None, source_num_params: int | None = None,
                 backend=None, name: str | None = None):
        self.graph = graph
        self.model = model
        self.frontend = frontend
        self.source_num_params = source_num_params if source_num_params is not None else graph.num_params()
        self.backend = backend
        self.name = name or graph.name

    def __repr__(self) -> str:
        return f"<pathir.Compiled {self.name}: {len(self.graph)} nodes, {self.graph.num_params():,} params>"

    # ---------------------------------------------------------------- basics
    def _backend(self, backend=None):
        """The backend to use; named backends are built once per Compiled, so the
        torch backend's device copies of the params are reused between calls."""
        from pathir.backends import get_backend

        choice = backend if backend is not None else self.backend
        if choice is not None and not isinstance(choice, str):
            return get_backend(choice)
        cache = self.__dict__.setdefault("_backends", {})
        if choice not in cache:
            cache[choice] = get_backend(choice)
        return cache[choice]

    def forward(self, x, backend=None):
        """The IR's own forward R_theta(x) (float64); x of shape (B, *input shape).
        Returns the output array (dict if several outputs), as the backend's array type."""
        from pathir.lifting.walk import forward

        out = forward(self.graph, self._backend(backend), x)
        return out[self.graph.outputs[0]] if len(out) == 1 else out

    def path_norm(self, q: float = 1.0, log10: bool = False, backend=None) -> float:
        """The l_q path-norm ||Phi(theta)||_q (MATH.md §3), exact in float64 without
        overflow; ``log10=True`` gives its log10 (for norms beyond 1e308)."""
        from pathir.lifting.path_norm import path_norm

        return path_norm(self.graph, q, self._backend(backend), log10)

    def path_norms(self, qs: Iterable[float] = (1, 2, 4), log10: bool = False, backend=None) -> dict[float, float]:
        from pathir.lifting.path_norm import path_norms

        return path_norms(self.graph, qs, self._backend(backend), log10)

    def num_paths(self, log10: bool = False, backend=None) -> float:
        """Number of paths of the DAG (MATH.md §2); ``log10=True`` for its log10."""
        from pathir.lifting.path_norm import num_paths

        return num_paths(self.graph, self._backend(backend), log10)

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

    def summary(self, qs: Sequence[float] = (1, 2, 4), backend=None) -> Summary:
        """Parameters, hidden neurons and channels, log10 #paths and path-norms."""
        be = self._backend(backend)
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
        """A new Compiled whose graph is this one's after ``passes`` (verified between them)."""
        from pathir.passes import run_passes

        graph = run_passes(self.graph, passes, check=check)
        return Compiled(graph, self.model, self.frontend, self.source_num_params, self.backend, self.name)

    # ---------------------------------------------------------------- ONNX models
    def _onnx_writer(self, what: str):
        from pathir.errors import PathirError

        if not (hasattr(self.frontend, "to_onnx") and hasattr(self.frontend, "save")):
            source = type(self.model).__name__ if self.model is not None else "a Graph"
            raise PathirError(f"cm.{what}() needs a model compiled from ONNX; this one was compiled from {source}")
        return self.frontend

    def to_onnx(self):
        """The ONNX model with every write-back so far (pathcond, enorm, normalize,
        prune), as a new onnx.ModelProto; the source model or file is untouched."""
        return self._onnx_writer("to_onnx").to_onnx()

    def save(self, path) -> None:
        """Write :meth:`to_onnx` to ``path`` (through a temporary file: a failure leaves no file)."""
        self._onnx_writer("save").save(path)

    # ---------------------------------------------------------------- rescaling units
    @property
    def units(self):
        """The rescaling units of the graph (``pathir.passes.find_units.Units``;
        MATH.md §5), found once per graph object."""
        cached = self.__dict__.get("_units")
        if cached is None or cached[0] is not self.graph:
            from pathir.passes.find_units import find_units

            cached = (self.graph, find_units(self.graph)[1])
            self.__dict__["_units"] = cached
        return cached[1]

    def incidence(self):
        """(B, layout): the sparse n x H matrix B of MATH.md §5 and the ParamLayout of θ,
        built once per graph object (do not modify B)."""
        cached = self.__dict__.get("_incidence")
        if cached is None or cached[0] is not self.graph:
            from pathir.passes.incidence import incidence

            cached = (self.graph, incidence(self.graph, self.units))
            self.__dict__["_incidence"] = cached
        return cached[1]

    def row_keys(self):
        """B's rows (``incidence()``) as a ``pathir.rescaling.unit_rows.RowKeys``: per row, e(i) (H + 1) + l(i),
        the unit θ_i enters and the one it leaves (H for none), and A = -Bᵀ1, read from the units.
        The PathCond and ENorm solvers take it with B (``row_key=``) instead of re-deriving it from B.
        Built once per graph object."""
        cached = self.__dict__.get("_row_keys")
        if cached is None or cached[0] is not self.graph:
            from pathir.passes.incidence import row_keys

            cached = (self.graph, row_keys(self.units))
            self.__dict__["_row_keys"] = cached
        return cached[1]

    def _adopt_rescaled(self, graph: Graph) -> None:
        """Make ``graph``, a rescaling of ``self.graph`` (same structure, new values),
        the current graph; the units, B and the row keys carry over (only the params' values moved)."""
        import dataclasses

        from pathir.passes.incidence import ParamLayout

        units, old = self.units, self.graph
        params = tuple(graph.params())
        self.graph = graph
        self.__dict__["_units"] = (graph, dataclasses.replace(units, params=params))
        # B and the row keys carry over where they were built for the old graph (they are not built here)
        incidence, row_keys = self.__dict__.get("_incidence"), self.__dict__.get("_row_keys")
        if incidence is not None and incidence[0] is old:
            self.__dict__["_incidence"] = (graph, (incidence[1][0], ParamLayout(params)))
        if row_keys is not None and row_keys[0] is old:
            self.__dict__["_row_keys"] = (graph, row_keys[1])

    def diag_g(self, backend=None) -> dict[str, np.ndarray]:
        """diag G (MATH.md §6): {source param name: array of that param's shape}.
        Raises PathNormOverflow beyond float64 (see ``pathir.lifting.diag_g.diag_g_flat``)."""
        from pathir.lifting.diag_g import diag_g

        return diag_g(self.graph, self._backend(backend))

    # ---------------------------------------------------------------- rescaling the model
    def pathcond(self, solver: str = "block", max_sweeps: int = 1000, tol: float = 1e-10,
                 write_back: bool = True, backend=None):
        """PathCond (MATH.md §7): minimise F(z) and rescale the model in place
        (function preserved); returns a PathCondReport. ``write_back=False``
        leaves model and graph as they are (apply ``report.z`` with
        :meth:`rescaled`). See docs/pathcond.md."""
        from pathir.pathcond.run import pathcond

        return pathcond(self, solver=solver, max_sweeps=max_sweeps, tol=tol, write_back=write_back, backend=backend)

    def enorm(self, p: float = 2.0, max_sweeps: int = 1000, tol: float = 1e-10, costs=None,
              solver: str = "block", write_back: bool = True):
        """ENorm (MATH.md §8): minimise Σ c_i |θ_i|^p over the rescalings and rescale
        the model in place; returns an ENormReport. See docs/normalize.md."""
        from pathir.enorm.run import enorm

        return enorm(self, p=p, max_sweeps=max_sweeps, tol=tol, costs=costs, solver=solver, write_back=write_back)

    def normalize(self, p: float = 2.0, write_back: bool = True):
        """The canonical representative (MATH.md §8): every unit's incoming weights and
        bias get unit l_p norm; rescales the model in place; returns a NormalizeReport.
        See docs/normalize.md."""
        from pathir.enorm.run import normalize

        return normalize(self, p=p, write_back=write_back)

    # ---------------------------------------------------------------- pruning
    def path_magnitude_scores(self, backend=None) -> dict[str, np.ndarray]:
        """S_i = Σ_{p ∋ i} |Φ_p(θ)| (MATH.md §4), one backward pass:
        {source param name: array in the source tensor's layout}."""
        from pathir.lifting.pruning import path_magnitude_scores

        return path_magnitude_scores(self.graph, self._backend(backend))

    def prune(self, amount, criterion: str = "path-magnitude", scope: str = "global",
              include_biases: bool = False, backend=None):
        """Zero the ``amount`` (fraction or count) lowest-scoring weights of the
        model, through the frontend writer, all at once; returns a PruneReport
        (pruned count, bound Σ S_i, path-norm before/after). See docs/pruning.md."""
        from pathir.lifting.pruning import prune

        return prune(self, amount, criterion, scope, include_biases, backend)

    def rescaled(self, z) -> "Compiled":
        """A new Compiled whose graph is rescaled by z (one log-scale per unit:
        θ ← θ ⊙ exp(-Bz/2)). Φ and the function are unchanged; the model is not touched."""
        from pathir.rescaling.apply import rescale_graph

        graph = rescale_graph(self.graph, self.units, z)
        return Compiled(graph, self.model, self.frontend, self.source_num_params, self.backend, self.name)

    # ---------------------------------------------------------------- symbolic (small graphs)
    def conservation_laws(self, symbolic: bool = False) -> dict:
        """H_h = Σ_{in_h} θ_i² − Σ_{out_h} θ_i² for every unit (MATH.md §9):
        {unit name: value at the graph's θ}; ``symbolic=True``: {unit name:
        sympy expression in the parameter symbols}. See docs/symbolic.md."""
        from pathir.neurons.symbolic import conservation_law_expressions, conservation_laws

        if symbolic:
            return conservation_law_expressions(self.graph, self.units)
        return conservation_laws(self.graph, self.units)

    def verify_symbolic(self, seed: int = 0, max_paths: int | None = None, samples: int = 2):
        """Exact checks on the neuron-level graph (small graphs only): rescaling
        invariance, lifting identity, conservation laws, rank DΦ, path-norm pass.
        Returns a SymbolicReport (``.passed``, ``.checks``). See docs/symbolic.md."""
        from pathir.neurons.symbolic import DEFAULT_MAX_PATHS, verify_symbolic

        limit = DEFAULT_MAX_PATHS if max_paths is None else max_paths
        return verify_symbolic(self.graph, self.units, seed=seed, max_paths=limit, samples=samples)

    def _write_rescaling(self, log_scales) -> None:
        """Write per-channel log-scales ({node: (channels,)}) into the user's model."""
        from pathir.errors import PathirError

        if self.frontend is None:
            raise PathirError("this Compiled has no source model to write a rescaling into (compiled from a Graph)")
        self.frontend.rescale(self.graph, log_scales)
