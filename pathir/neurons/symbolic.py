"""Symbolic checks of a small graph, and the conservation laws of gradient flow.

On the neuron-level expansion (:mod:`pathir.neurons.expand`), with Φ written as sympy
monomials in parameter symbols (:mod:`pathir.backends.sympy`),
:func:`verify_symbolic` checks, exactly:

1. ``rescaling_invariance``: Φ(θ) is unchanged when every parameter of unit h
   is multiplied by λ^(-B[i,h]) (λ > 0 a symbol; docs/math.md §2, §5), for every unit;
2. ``lifting_identity``: R_θ(x)_o = Σ_{p ends at o} Φ_p a_p (A [x; 1])_p
   (docs/math.md §2) against the graph's own forward in exact arithmetic, at the
   graph's θ and at a random rational θ, on random rational inputs;
3. ``conservation_laws``: Σ_i ∂Φ_p/∂θ_i · B[i,h] θ_i = 0 identically for
   every path p and unit h (docs/math.md §9), by symbolic differentiation;
4. ``rank``: rank DΦ at a random rational point, exactly, reported beside
   n − H; it must not exceed n − rank[B_h ⊙ θ]_h (the kernel the units give);
5. ``path_norm``: the path-norm pass (``path_view(maxpool_to_sum(g))`` fed
   all ones) equals Σ_p |Φ_p|^q for q = 1, 2 at a random rational θ.

Conservation laws (docs/math.md §9): for each unit h,

    H_h(θ) = Σ_{i ∈ in_h} θ_i² − Σ_{i ∈ out_h} θ_i² = −Σ_i B[i,h] θ_i²

is constant along gradient flow of any loss of the form ℓ ∘ Φ; plain gradient
descent with step η changes it by exactly η² gᵀ diag(−B_h) g per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pathir.analyses.find_units import find_units
from pathir.analyses.incidence import incidence
from pathir.errors import ArgumentError, ArgumentKeyError, GraphTooLarge
from pathir.ir import Graph
from pathir.lifting.walk import forward
from pathir.neurons.expand import expand
from pathir.neurons.paths import activations, enumerate_paths, input_incidence, multiplicities
from pathir.passes import maxpool_to_sum, path_view

__all__ = [
    "Check", "SymbolicReport", "verify_symbolic", "conservation_laws", "conservation_law_expressions",
    "DEFAULT_MAX_PATHS",
]

DEFAULT_MAX_PATHS = 2000

CHECK_NAMES = ("rescaling_invariance", "lifting_identity", "conservation_laws", "rank", "path_norm")


@dataclass(frozen=True)
class Check:
    """One named check: whether it passed, what was checked, and where it failed.

    ``counterexample`` is None when the check passed; ``data`` holds the numbers
    a check reports (the rank check: rank, n, H, ...)."""

    name: str
    passed: bool
    detail: str
    counterexample: dict[str, Any] | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        text = f"[{'PASS' if self.passed else 'FAIL'}] {self.name}: {self.detail}"
        if self.counterexample:
            text += "\n" + "\n".join(f"      {k}: {v}" for k, v in self.counterexample.items())
        return text


@dataclass(frozen=True)
class SymbolicReport:
    """What :func:`verify_symbolic` found: ``checks`` in order, ``passed`` when all passed."""

    graph: str
    checks: tuple[Check, ...]
    num_paths: int
    num_params: int
    num_units: int

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def __getitem__(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise ArgumentKeyError(f"no check named '{name}'; checks: {[c.name for c in self.checks]}")

    @property
    def rank(self) -> int | None:
        """rank DΦ at the random point (None if the rank check did not get that far)."""
        return self["rank"].data.get("rank")

    def __str__(self) -> str:
        verdict = "passed" if self.passed else f"FAILED ({len(self.failed)} of {len(self.checks)} checks)"
        head = (f"symbolic checks of '{self.graph}': {verdict}; {self.num_paths} paths, "
                f"n = {self.num_params} params, H = {self.num_units} units")
        return "\n".join([head, *(f"  {c}" for c in self.checks)])

    __repr__ = __str__


# ------------------------------------------------------------------ helpers


def _path_text(p) -> str:
    return " -> ".join(f"{name}[{i}]" for name, i in p.neurons)


def _random_point(layout, rng) -> dict[str, np.ndarray]:
    """A random nonzero rational value per parameter entry: ±a/b, a in 1..9, b in 1..5."""
    import sympy as sp

    out = {}
    for p in layout.params:
        num = rng.integers(1, 10, size=p.size) * rng.choice([-1, 1], size=p.size)
        den = rng.integers(1, 6, size=p.size)
        arr = np.empty(p.size, dtype=object)
        arr[:] = [sp.Rational(int(a), int(b)) for a, b in zip(num, den)]
        out[p.name] = arr.reshape(p.shape)
    return out


def _random_inputs(graph: Graph, rng, batch: int) -> dict[str, np.ndarray]:
    import sympy as sp

    out = {}
    for name in graph.inputs:
        shape = (batch, *graph.node(name).shape)
        size = int(np.prod(shape))
        num, den = rng.integers(-9, 10, size=size), rng.integers(1, 5, size=size)
        arr = np.empty(size, dtype=object)
        arr[:] = [sp.Rational(int(a), int(b)) for a, b in zip(num, den)]
        out[name] = arr.reshape(shape)
    return out


class _Context:
    """Everything the checks share: the expansion, the paths, symbolic Φ, B and θ's symbols."""

    def __init__(self, graph: Graph, units, max_paths: int, seed: int):
        from pathir.backends.sympy import symbol  # lazy: imports sympy
        from pathir.neurons.exact import symbolic_phi  # lazy: imports sympy

        self.graph = graph
        self.net = expand(graph)
        self.paths = enumerate_paths(self.net, max_paths)
        self.units = find_units(graph)[1] if units is None else units
        self.B, self.layout = incidence(graph, self.units)
        self.n, self.H = len(self.layout), len(self.units)
        self.symbols = []
        for p in self.layout.params:
            self.symbols.extend(symbol(p.name, i) for i in range(p.size))
        self.index = {s: i for i, s in enumerate(self.symbols)}
        self.phi = symbolic_phi(self.net, self.paths)
        # Φ_p = c · Π θ_i^e: the exponent of each parameter on each path
        self.powers = [{self.index[s]: int(e) for s, e in f.as_powers_dict().items() if s in self.index}
                       for f in self.phi]
        self.paths_of: dict[int, list[int]] = {}
        for k, pw in enumerate(self.powers):
            for i in pw:
                self.paths_of.setdefault(i, []).append(k)
        Bc = self.B.tocsc()
        self.columns = []  # unit h -> [(flat index i, B[i, h])]
        for h in range(self.H):
            cut = slice(Bc.indptr[h], Bc.indptr[h + 1])
            self.columns.append(list(zip(Bc.indices[cut].tolist(), Bc.data[cut].astype(int).tolist())))
        self.rng = np.random.default_rng(seed)
        self.point = _random_point(self.layout, self.rng)

    def touching(self, h: int) -> list[int]:
        """Paths through some parameter of unit h's column, in path order."""
        return sorted({k for i, _ in self.columns[h] for k in self.paths_of.get(i, ())})


# ------------------------------------------------------------------ checks


def _rescaling(ctx: _Context) -> Check:
    import sympy as sp

    lam = sp.Symbol("λ", positive=True)
    bad, first = 0, None
    for h in range(ctx.H):
        sub = {ctx.symbols[i]: ctx.symbols[i] * lam ** (-b) for i, b in ctx.columns[h]}
        for k in ctx.touching(h):
            new = ctx.phi[k].xreplace(sub)
            if sp.expand(new - ctx.phi[k]) != 0:
                bad += 1
                if first is None:
                    first = {"unit": ctx.units.names[h], "path": _path_text(ctx.paths[k]),
                             "Phi_p": ctx.phi[k], "rescaled": new}
                break
    if first is None:
        return Check("rescaling_invariance", True, f"Φ is unchanged by the rescaling of each of the {ctx.H} units")
    return Check("rescaling_invariance", False, f"{bad} of {ctx.H} units change Φ when rescaled", first)


def _lifting(ctx: _Context, backend_cls, samples: int) -> Check:
    import sympy as sp

    from pathir.backends.sympy import exact  # lazy: imports sympy
    from pathir.neurons.exact import neuron_values, symbolic_phi  # lazy: imports sympy

    A, columns = input_incidence(ctx.net, ctx.paths)
    col = A.argmax(axis=1) if len(ctx.paths) else np.zeros(0, dtype=int)
    compared = 0
    for label, values in (("the graph's own θ", None), ("a random rational θ", ctx.point)):
        x = _random_inputs(ctx.graph, ctx.rng, samples)
        out = forward(ctx.graph, backend_cls(values), x)
        phi = symbolic_phi(ctx.net, ctx.paths, values if values is not None else {})
        for b in range(samples):
            sample = {name: v[b] for name, v in x.items()}
            a = activations(ctx.net, ctx.paths, neuron_values(ctx.net, sample, values))
            x1 = [exact(sample[v[0]].reshape(-1)[v[1]]) for v in columns[:-1]] + [sp.S.One]
            lifted = {}
            for k, p in enumerate(ctx.paths):
                if a[k]:
                    lifted[p.end] = lifted.get(p.end, sp.S.Zero) + phi[k] * x1[col[k]]
            for o in ctx.graph.outputs:
                got = np.reshape(np.asarray(out[o], dtype=object)[b], -1)  # a scalar output (shape ()) too
                for j in range(got.size):
                    want = lifted.get((o, j), sp.S.Zero)
                    compared += 1
                    if exact(got[j]) != want:
                        return Check("lifting_identity", False, "the graph's forward and the lifting identity differ", {
                            "theta": label, "x": {k: v.tolist() for k, v in sample.items()},
                            "output": f"{o}[{j}]", "forward": got[j], "sum_p Phi_p a_p (A[x;1])_p": want,
                        })
    return Check("lifting_identity", True,
                 f"R(x) = Σ_p Φ_p a_p (A[x;1])_p exactly on {compared} output values "
                 f"({samples} inputs at the graph's θ and at a random rational θ)")


def _conservation(ctx: _Context) -> Check:
    import sympy as sp

    pairs = 0
    for h in range(ctx.H):
        col = dict(ctx.columns[h])
        for k in ctx.touching(h):
            pairs += 1
            terms = [b * s * sp.diff(ctx.phi[k], s) for s in ctx.phi[k].free_symbols
                     if (i := ctx.index.get(s)) is not None and (b := col.get(i))]
            expr = sp.expand(sp.Add(*terms))
            if expr != 0:
                return Check("conservation_laws", False, "DΦ(θ)·(B_h ⊙ θ) is not identically 0", {
                    "unit": ctx.units.names[h], "path": _path_text(ctx.paths[k]), "Phi_p": ctx.phi[k],
                    "sum_i dPhi_p/dtheta_i B[i,h] theta_i": expr,
                })
    return Check("conservation_laws", True,
                 f"DΦ(θ)·(B_h ⊙ θ) = 0 identically for all {ctx.H} units ({pairs} path-unit pairs)")


def _qq_rank(rows: dict[int, dict[int, Any]], shape) -> int:
    from sympy import QQ
    from sympy.polys.matrices import DomainMatrix

    conv = {r: {c: QQ(int(v.p), int(v.q)) for c, v in row.items() if v != 0} for r, row in rows.items()}
    conv = {r: row for r, row in conv.items() if row}
    if not conv:
        return 0
    return int(DomainMatrix(conv, shape, QQ).rank())


def _rank(ctx: _Context) -> Check:
    import sympy as sp

    theta = np.concatenate([ctx.point[p.name].reshape(-1) for p in ctx.layout.params]) if ctx.n else np.zeros(0, object)
    values = [sp.Mul(f.as_coeff_Mul()[0], *(theta[i] ** e for i, e in pw.items())) for f, pw in zip(ctx.phi, ctx.powers)]
    J = {k: {i: e * v / theta[i] for i, e in pw.items()} for k, (v, pw) in enumerate(zip(values, ctx.powers))}
    r = _qq_rank(J, (len(ctx.paths), ctx.n))
    K = {}  # rows i, columns h: the directions B_h ⊙ θ
    for h, col in enumerate(ctx.columns):
        for i, b in col:
            K.setdefault(i, {})[h] = b * theta[i]
    r_units = _qq_rank(K, (ctx.n, ctx.H))
    bound = ctx.n - r_units
    data = {"rank": r, "n": ctx.n, "H": ctx.H, "n_minus_H": ctx.n - ctx.H, "unit_directions": r_units,
            "paths": len(ctx.paths)}
    where = f"(n = {ctx.n}, H = {ctx.H}, {len(ctx.paths)} paths, random rational θ)"
    if r > bound:
        return Check("rank", False, f"rank DΦ = {r} > n − rank[B_h ⊙ θ] = {bound}: some unit direction is not in ker DΦ {where}",
                     {"rank": r, "bound": bound}, data)
    if r == ctx.n - ctx.H:
        text = f"rank DΦ = {r} = n − H {where}"
    else:
        text = f"rank DΦ = {r} < n − H = {ctx.n - ctx.H} {where}"
    if r_units < ctx.H:
        text += f"; the unit directions span only {r_units}"
    return Check("rank", True, text, None, data)


def _path_norm(ctx: _Context, backend_cls) -> Check:
    import sympy as sp

    from pathir.neurons.exact import symbolic_phi  # lazy: imports sympy

    phi = symbolic_phi(ctx.net, ctx.paths, ctx.point)
    view = path_view(maxpool_to_sum(ctx.graph), 1)
    ones = {name: np.ones((1, *view.node(name).shape)) for name in view.inputs}
    found = {}
    listed = multiplicities(ctx.net, ctx.paths)
    for q in (1, 2):
        want = sp.Add(*(int(m) * abs(v) ** q for v, m in zip(phi, listed)))
        out = forward(view, backend_cls(ctx.point).power_view(q), ones)
        got = sp.Add(*(sp.Add(*out[o].ravel()) for o in view.outputs))
        found[q] = got
        if got != want:
            return Check("path_norm", False, f"the l{q} path-norm pass differs from Σ_p |Φ_p|^{q}",
                         {"q": q, "path-norm pass": got, "sum_p |Phi_p|^q": want})
    return Check("path_norm", True, "the path-norm pass gives Σ_p |Φ_p|^q exactly for q = 1, 2 (random rational θ)",
                 None, {"sums": found})


# ------------------------------------------------------------------ entry points


def verify_symbolic(graph: Graph, units=None, seed: int = 0, max_paths: int = DEFAULT_MAX_PATHS,
                    samples: int = 2, backend=None) -> SymbolicReport:
    """Run the five symbolic checks (module docstring) on a small graph.

    Parameters
    ----------
    graph : Graph
        Small enough to expand into neurons and enumerate its paths.
    units : Units, optional
        The rescaling units to check (default: ``find_units(graph)``).
    seed : int
        Seeds the random rational θ and inputs.
    max_paths : int
        Above this many paths GraphTooLarge is raised before any check.
    samples : int
        Random inputs per θ for the lifting identity.
    backend : type, optional
        The exact backend class the graph's own forward runs on (default
        :class:`pathir.backends.sympy.SympyBackend`), called with {param name: values}.

    Returns
    -------
    SymbolicReport
        ``report.passed``, ``report.checks`` (each a :class:`Check`), ``report.rank``.

    Examples
    --------
    >>> import numpy as np
    >>> from pathir.ir import GraphBuilder, Dense
    >>> b = GraphBuilder("mlp")
    >>> x = b.input("x", (2,))
    >>> h = b.relu("h", [(x, Dense(b.param("fc1.weight", [[1.0, -2.0], [0.5, 1.0]])))], bias=b.param("fc1.bias", [0.5, -1.0]))
    >>> y = b.identity("y", [(h, Dense(b.param("fc2.weight", [[2.0, -1.0]])))])
    >>> report = verify_symbolic(b.build(outputs=[y]))
    >>> report.passed, [c.name for c in report.checks]
    (True, ['rescaling_invariance', 'lifting_identity', 'conservation_laws', 'rank', 'path_norm'])
    >>> print(report)
    symbolic checks of 'mlp': passed; 6 paths, n = 8 params, H = 2 units
      [PASS] rescaling_invariance: Φ is unchanged by the rescaling of each of the 2 units
      [PASS] lifting_identity: R(x) = Σ_p Φ_p a_p (A[x;1])_p exactly on 4 output values (2 inputs at the graph's θ and at a random rational θ)
      [PASS] conservation_laws: DΦ(θ)·(B_h ⊙ θ) = 0 identically for all 2 units (6 path-unit pairs)
      [PASS] rank: rank DΦ = 6 = n − H (n = 8, H = 2, 6 paths, random rational θ)
      [PASS] path_norm: the path-norm pass gives Σ_p |Φ_p|^q exactly for q = 1, 2 (random rational θ)
    """
    from pathir.backends.sympy import SympyBackend  # lazy: imports sympy

    backend_cls = SympyBackend if backend is None else backend
    ctx = _Context(graph, units, max_paths, seed)
    runs = [
        ("rescaling_invariance", lambda: _rescaling(ctx)),
        ("lifting_identity", lambda: _lifting(ctx, backend_cls, samples)),
        ("conservation_laws", lambda: _conservation(ctx)),
        ("rank", lambda: _rank(ctx)),
        ("path_norm", lambda: _path_norm(ctx, backend_cls)),
    ]
    checks = []
    for name, run in runs:
        try:
            checks.append(run())
        except GraphTooLarge:
            raise
        except Exception as err:  # a check that cannot run has failed; say why
            checks.append(Check(name, False, f"raised {type(err).__name__}: {err}"))
    return SymbolicReport(graph.name, tuple(checks), len(ctx.paths), ctx.n, ctx.H)


def _theta(layout, theta) -> np.ndarray:
    if theta is None:
        return layout.theta()
    if isinstance(theta, dict):
        unknown = sorted(set(theta) - {p.name for p in layout.params})
        if unknown:
            raise ArgumentError(f"theta names no param of the graph: {unknown}; its params are "
                                f"{[p.name for p in layout.params]}")
        missing = [p.name for p in layout.params if p.name not in theta]
        if missing:
            raise ArgumentError(f"theta has no entry for param(s) {missing}: give every param of the graph "
                                f"({[p.name for p in layout.params]}), or a flat vector")
        parts = [np.asarray(theta[p.name], dtype=np.float64) for p in layout.params]
        for p, part in zip(layout.params, parts):
            if part.shape != np.shape(p.value):
                raise ArgumentError(f"theta['{p.name}'] has shape {part.shape}, the param {tuple(np.shape(p.value))}")
        return np.concatenate([part.reshape(-1) for part in parts]) if parts else np.zeros(0)
    theta = np.asarray(theta, dtype=np.float64)
    if theta.shape != (len(layout),):
        raise ArgumentError(f"theta must be flat of length {len(layout)} (the graph's params in order), got {theta.shape}")
    return theta


def conservation_laws(graph: Graph, units=None, theta=None) -> dict[str, float]:
    """H_h(θ) = Σ_{in_h} θ_i² − Σ_{out_h} θ_i² = −(Bᵀ θ²)_h for every unit (docs/math.md §9).

    Parameters
    ----------
    graph : Graph
    units : Units, optional (default ``find_units(graph)``)
    theta : optional; θ as a flat vector (``graph.params()`` order, C order) or
        {param name: array}. Default: the graph's own parameters.

    Returns
    -------
    dict
        {unit name: H_h}, in unit order.

    >>> import numpy as np
    >>> from pathir.ir import GraphBuilder, Dense
    >>> b = GraphBuilder()
    >>> x = b.input("x", (2,))
    >>> h = b.relu("h", [(x, Dense(b.param("fc1.weight", [[1.0, 2.0]])))], bias=b.param("fc1.bias", [3.0]))
    >>> y = b.identity("y", [(h, Dense(b.param("fc2.weight", [[4.0]])))])
    >>> conservation_laws(b.build(outputs=[y]))     # 1 + 4 + 9 - 16
    {'fc1:c0': -2.0}
    """

    units = find_units(graph)[1] if units is None else units
    B, layout = incidence(graph, units)
    values = -(B.T @ (_theta(layout, theta) ** 2))
    return {name: float(v) for name, v in zip(units.names, values)}


def conservation_law_expressions(graph: Graph, units=None) -> dict[str, Any]:
    """{unit name: H_h as a sympy expression in the parameter symbols} (``fc1.weight[3]``).

    >>> import numpy as np
    >>> from pathir.ir import GraphBuilder, Dense
    >>> b = GraphBuilder()
    >>> x = b.input("x", (2,))
    >>> h = b.relu("h", [(x, Dense(b.param("fc1.weight", [[1.0, 2.0]])))], bias=b.param("fc1.bias", [3.0]))
    >>> y = b.identity("y", [(h, Dense(b.param("fc2.weight", [[4.0]])))])
    >>> conservation_law_expressions(b.build(outputs=[y]))
    {'fc1:c0': fc1.bias[0]**2 + fc1.weight[0]**2 + fc1.weight[1]**2 - fc2.weight[0]**2}
    """
    import sympy as sp

    from pathir.backends.sympy import symbol  # lazy: imports sympy

    units = find_units(graph)[1] if units is None else units
    B, layout = incidence(graph, units)
    Bc = B.tocsc()
    out = {}
    for h, name in enumerate(units.names):
        terms = []
        for i, b in zip(Bc.indices[Bc.indptr[h]:Bc.indptr[h + 1]], Bc.data[Bc.indptr[h]:Bc.indptr[h + 1]]):
            pname, idx = layout.locate(int(i))
            p = layout.params[layout.position(pname)]
            flat = int(np.ravel_multi_index(idx, p.shape)) if p.shape else 0
            terms.append(-int(b) * symbol(pname, flat) ** 2)
        out[name] = sp.Add(*terms)
    return out
