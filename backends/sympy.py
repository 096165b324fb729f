"""The sympy backend: exact arithmetic and symbolic Φ on small graphs.

It is the numpy table with overrides (STYLE.md): the same rules, run on numpy
*object* arrays of sympy numbers or expressions. Most numpy rules work on
object arrays as they are, once the map they read holds exact weights; the
overrides are where numpy would bring a float in:

- every map is first made exact: a free weight reads this backend's ``values``
  (sympy Rationals, or Symbols for symbolic work), a fixed constant (1/k of an
  average pool, an adaptive pool's matrix) is converted by :func:`exact`;
- conv and pool windows pad with sympy's 0 (numpy pads with the float 0.0);
- ReLU is ``max(v, 0)`` by exact comparison, ``sympy.Max(v, 0)`` on an expression;
- the k-max-pool sorts each window exactly (``sympy.Max`` for a symbolic k = 1).

:func:`exact` reads a float as the simplest rational that rounds to it
(denominator up to 10^6; so 1/3 reads as 1/3), or else as its exact binary
value. The float64 graph and its exact reading agree to rounding.

At the neuron level (:mod:`pathir.neurons.expand`), :func:`symbolic_phi` writes Φ_p
(docs/math.md §2) as a monomial in parameter symbols named after the param and the
flat C-order index of the entry (``fc1.weight[3]``), and :func:`neuron_values`
is the exact neuron-by-neuron forward whose pre-activations and max-pool
selections give the path activations a_p(θ, x).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Mapping

import numpy as np
import sympy as sp

from pathir.errors import ArgumentError, BackendError
from pathir.ir import FIXED, PARAMETERIZED, Conv, FixedConv, MapKind, Node, Pool, Resample, SpatialMatrix

from .base import Backend, RuleTable
from .numpy import RULES as NUMPY_RULES
from .numpy import bcast, conv_parts, grouped, pad_axes, window_slices, window_stack

__all__ = [
    "SympyBackend", "exact", "exact_array", "symbol", "param_symbols", "exact_relu",
]

ZERO, ONE = sp.S.Zero, sp.S.One
MAX_DENOMINATOR = 10**6


# ------------------------------------------------------------ exact numbers


def exact(value) -> sp.Expr:
    """``value`` as an exact sympy number (sympy objects pass through).

    >>> exact(0.25), exact(1 / 3), exact(2)
    (1/4, 1/3, 2)
    """
    if isinstance(value, sp.Basic):
        return value
    if isinstance(value, (int, np.integer)):
        return sp.Integer(int(value))
    f = float(value)
    if not math.isfinite(f):
        raise ArgumentError(f"cannot read {f} as an exact number")
    r = Fraction(f).limit_denominator(MAX_DENOMINATOR)
    if float(r) != f:
        r = Fraction(f)
    return sp.Rational(r.numerator, r.denominator)


_exact_ufunc = np.frompyfunc(exact, 1, 1)


def exact_array(a) -> np.ndarray:
    """An object array of exact sympy numbers (or the expressions it already holds)."""
    arr = np.asarray(a)
    out = np.empty(arr.shape, dtype=object)
    out[...] = _exact_ufunc(arr) if arr.size else arr
    return out


def symbol(param: str, index: int) -> sp.Symbol:
    """The symbol of entry ``index`` (flat, C order) of param ``param``: ``fc1.weight[3]``."""
    return sp.Symbol(f"{param}[{int(index)}]", real=True)


def param_symbols(graph) -> dict[str, np.ndarray]:
    """{param name: object array of its symbols, in the param's shape}.

    >>> import numpy as np
    >>> from pathir.ir import GraphBuilder, Dense
    >>> b = GraphBuilder()
    >>> x = b.input("x", (2,))
    >>> y = b.identity("y", [(x, Dense(b.param("fc.weight", np.ones((1, 2)))))], bias=b.param("fc.bias", [0.0]))
    >>> param_symbols(b.build(outputs=[y]))
    {'fc.weight': array([[fc.weight[0], fc.weight[1]]], dtype=object), 'fc.bias': array([fc.bias[0]], dtype=object)}
    """
    out = {}
    for p in graph.params():
        arr = np.empty(p.size, dtype=object)
        arr[:] = [symbol(p.name, i) for i in range(p.size)]
        out[p.name] = arr.reshape(p.shape)
    return out


# ------------------------------------------------------------------ rules


@dataclass(frozen=True, eq=False)
class _ExactWeight:
    """Stands in for a Param inside the numpy rules: same name and shape, exact entries."""

    name: str
    value: np.ndarray

    @property
    def shape(self):
        return tuple(self.value.shape)

    @property
    def size(self):
        return int(self.value.size)


def _pool_apply(m, x, s):
    y = window_stack(x, m, s, ZERO).sum(axis=-1)
    return y if m.mult is None else y * m.mult


def _conv_apply(m, x, s):
    Wg, k, out = conv_parts(m, s)
    xp = grouped(pad_axes(x, m.padding, ZERO), m.groups)
    y = ZERO
    for off in itertools.product(*(range(kk) for kk in k)):
        win = xp[(slice(None),) * 3 + window_slices(off, m.dilation, m.stride, out)]
        y = y + np.einsum("bgi...,goi->bgo...", win, Wg[(Ellipsis,) + off])
    return y.reshape(x.shape[0], -1, *out)


def _conv_wgrad(m, x, g, s):
    Wg, k, out = conv_parts(m, s)
    xp = grouped(pad_axes(x, m.padding, ZERO), m.groups)
    gg = grouped(g, m.groups)
    gW = np.full(Wg.shape, ZERO, dtype=object)
    B, G = gg.shape[:2]
    for off in itertools.product(*(range(kk) for kk in k)):
        win = xp[(slice(None),) * 3 + window_slices(off, m.dilation, m.stride, out)]
        gW[(Ellipsis,) + off] = np.einsum(
            "bgop,bgip->goi", gg.reshape(B, G, gg.shape[2], -1), win.reshape(B, G, win.shape[2], -1)
        )
    return gW.reshape(m.W.shape)


#: numpy's rules, with the window rules that pad overridden (sympy's 0, not 0.0)
RULES: RuleTable = {
    **NUMPY_RULES,
    MapKind.POOL: (_pool_apply, NUMPY_RULES[MapKind.POOL][1], None),
    MapKind.CONV: (_conv_apply, NUMPY_RULES[MapKind.CONV][1], _conv_wgrad),
    MapKind.FIXED_CONV: (_conv_apply, NUMPY_RULES[MapKind.FIXED_CONV][1], None),
}


def exact_relu(v):
    v = exact(v)  # numpy's zeros on object arrays are Python ints
    if v.is_comparable:
        return v if v > 0 else ZERO
    return sp.Max(v, ZERO)


_relu_ufunc = np.frompyfunc(exact_relu, 1, 1)


def _kth_largest(values, k: int):
    values = [exact(v) for v in values if v is not sp.S.NegativeInfinity]  # padding is no neuron
    if all(v.is_comparable for v in values):
        return sorted(values, reverse=True, key=lambda v: v)[k - 1]
    if k == 1:
        return sp.Max(*values)
    raise BackendError(f"backend sympy: a symbolic {k}-max-pool has no closed form; evaluate at numbers")


class SympyBackend(Backend):
    """Exact (and symbolic) evaluation: numpy object arrays of sympy numbers.

    Parameters
    ----------
    values : {param name: array-like}, optional
        The free parameters to use instead of the graph's own (sympy numbers,
        symbols or floats, in the param's shape or flat); a param not given
        reads its own value exactly (see :func:`exact`).

    The walks of :mod:`pathir.lifting.walk` run on it unchanged: ``forward`` gives
    exact outputs (object arrays). The log-scaled path walks need floats; for
    exact path sums run ``forward`` on a path view (see :meth:`power_view`).

    >>> import numpy as np
    >>> from pathir.lifting.walk import forward
    >>> from pathir.ir import GraphBuilder, Dense
    >>> b = GraphBuilder()
    >>> x = b.input("x", (2,))
    >>> h = b.relu("h", [(x, Dense(b.param("w1", [[0.5, -1.0], [1.0, 1.0]])))])
    >>> y = b.identity("y", [(h, Dense(b.param("w2", [[1.0, 3.0]])))])
    >>> g = b.build(outputs=[y])
    >>> forward(g, SympyBackend(), np.array([[1, 1 / 3]]))["y"]
    array([[25/6]], dtype=object)
    >>> forward(g, SympyBackend(param_symbols(g)), np.array([[1, 0]]))["y"]
    array([[w2[0]*Max(0, w1[0]) + w2[1]*Max(0, w1[2])]], dtype=object)
    """

    name = "sympy"
    rules = RULES

    def __init__(self, values: Mapping[str, object] | None = None,
                 transform: Callable[[sp.Expr], sp.Expr] | None = None,
                 fixed_transform: Callable[[sp.Expr], sp.Expr] | None = None):
        self.values = dict(values or {})
        self._transform = transform  # applied to every free weight and bias entry
        self._fixed = fixed_transform  # applied to every nonzero fixed constant
        self._params: dict[int, tuple[object, np.ndarray]] = {}
        self._maps: dict[int, tuple[object, object]] = {}

    def __repr__(self) -> str:
        return f"SympyBackend({len(self.values)} params given)"

    def check_graph(self, graph) -> None:
        """ArgumentError naming the keys of ``values`` that name no param of ``graph`` (a typo would read the
        graph's own value silently); the forward walk calls it first."""
        unknown = sorted(set(self.values) - {p.name for p in graph.params()})
        if unknown:
            raise ArgumentError(f"values names no param of the graph: {unknown}; its params are "
                                f"{[p.name for p in graph.params()]}")

    def power_view(self, q: float) -> "SympyBackend":
        """This backend seeing every weight, bias and fixed constant w as |w|^q,
        exactly (q = 0: every free weight and bias is 1, a fixed constant 1).

        Run on ``path_view(maxpool_to_sum(graph), 1)`` (ReLUs and max-pools made
        sums, weights already |w|) with the all-ones input, ``forward`` sums
        |Φ_p|^q exactly (docs/math.md §3)."""
        q = exact(q)
        fn = (lambda w: ONE) if q == 0 else (lambda w: sp.Abs(w) ** q)
        return SympyBackend(self.values, transform=fn, fixed_transform=fn)

    # ------------------------------------------------------ exact weights
    def param(self, p) -> np.ndarray:
        """The exact entries of Param ``p`` (object array of its shape)."""
        hit = self._params.get(id(p))
        if hit is not None and hit[0] is p:
            return hit[1]
        given = self.values.get(p.name)
        if given is None:
            arr = exact_array(p.value)
        else:
            arr = exact_array(np.asarray(given, dtype=object))
            if arr.size != p.size:
                raise ArgumentError(f"values['{p.name}'] has {arr.size} entries, the param {p.size} (shape {p.shape})")
            arr = arr.reshape(p.shape)
        if self._transform is not None:
            arr = np.frompyfunc(self._transform, 1, 1)(arr).astype(object).reshape(p.shape)
        self._params[id(p)] = (p, arr)  # the Param is kept alive, so its id stays its own
        return arr

    def _constant(self, a: np.ndarray) -> np.ndarray:
        arr = exact_array(a)
        if self._fixed is not None:
            fn = self._fixed
            arr = np.frompyfunc(lambda c: fn(c) if c != 0 else ZERO, 1, 1)(arr).astype(object).reshape(arr.shape)
        return arr

    def exact_map(self, m):
        """``m`` reading exact weights: free ones from :meth:`param`, fixed ones converted."""
        hit = self._maps.get(id(m))
        if hit is not None and hit[0] is m:
            return hit[1]
        if m.kind in PARAMETERIZED:
            out = _with(m, W=_ExactWeight(m.weight.name, self.param(m.weight)))
        elif isinstance(m, Pool) and m.mult is not None:
            out = _with(m, mult=self._constant(m.mult))
        elif isinstance(m, SpatialMatrix):
            out = _with(m, matrix=self._constant(m.matrix))
        elif isinstance(m, Resample):
            out = _with(m, matrices=tuple(self._constant(a) for a in m.matrices))
        elif isinstance(m, FixedConv):  # the same arithmetic as a Conv reading the exact constants
            conv = Conv(m.W, m.stride, m.padding, m.dilation, m.groups)
            out = _with(conv, W=_ExactWeight(m.label, self._constant(m.kernel)))
        else:
            assert m.kind in FIXED
            out = m  # weights 1: the transforms send 1 to 1
        self._maps[id(m)] = (m, out)
        return out

    def apply(self, m, x, in_shape):
        return super().apply(self.exact_map(m), x, in_shape)

    def adjoint(self, m, g, in_shape):
        return super().adjoint(self.exact_map(m), g, in_shape)

    def weight_grad(self, m, x, g, in_shape):
        return super().weight_grad(self.exact_map(m), x, g, in_shape)

    # ------------------------------------------------------------ array ops
    def asarray(self, value):
        if isinstance(value, np.ndarray) and value.dtype == object:
            return exact_array(value)
        return exact_array(np.asarray(value))

    def to_numpy(self, x):
        return np.asarray(x, dtype=object)

    def ones(self, shape):
        return np.full(tuple(shape), ONE, dtype=object)

    def zeros(self, shape):
        return np.full(tuple(shape), ZERO, dtype=object)

    def bias(self, node: Node, ndim: int):
        return bcast(self.param(node.bias), ndim)

    def relu(self, x):
        return _relu_ufunc(x).astype(object) if x.size else x

    def kth_max_pool(self, node: Node, x, in_shape):
        stack = window_stack(x, node.edges[0].map, tuple(in_shape), sp.S.NegativeInfinity)
        out = np.empty(stack.shape[:-1], dtype=object)
        for idx in np.ndindex(*out.shape):
            out[idx] = _kth_largest(list(stack[idx]), node.k)
        return out

    def amax(self, x):
        return max((abs(v) for v in x.ravel()), default=ZERO)

    def total(self, x):
        return sp.Add(*x.ravel())

    def channel_sum(self, g):
        return g.reshape(g.shape[0], g.shape[1], -1).sum(axis=(0, 2))


def _with(m, **fields):
    """A copy of map ``m`` with ``fields`` set as they are (the constructors'
    float64 conversion would undo the exact arrays)."""
    import copy

    out = copy.copy(m)
    for k, v in fields.items():
        object.__setattr__(out, k, v)
    return out
