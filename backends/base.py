"""What every backend provides: a rule table keyed by MapKind and a few array ops."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import numpy as np

from pathir.errors import BackendError
from pathir.ir import Map, MapKind, Node

__all__ = ["Backend", "RuleTable"]

Rule = Optional[Callable[..., Any]]
RuleTable = dict[MapKind, tuple[Rule, Rule, Rule]]


class Backend:
    """A backend = ``rules`` (apply, adjoint, weight_grad per MapKind) + array ops.

    The walks in :mod:`pathir.lifting.walk` use only these; a missing rule raises
    "backend X has no rule for Y"."""

    name = "abstract"
    rules: RuleTable = {}

    def _rule(self, m: Map, which: int):
        rule = self.rules.get(m.kind, (None, None, None))[which]
        if rule is None:
            op = ("apply", "adjoint", "weight_grad")[which]
            raise BackendError(f"backend {self.name} has no rule for {op} of {m.kind.value}")
        return rule

    def apply(self, m: Map, x, in_shape):
        return self._rule(m, 0)(m, x, tuple(in_shape))

    def adjoint(self, m: Map, g, in_shape):
        return self._rule(m, 1)(m, g, tuple(in_shape))

    def weight_grad(self, m: Map, x, g, in_shape):
        return self._rule(m, 2)(m, x, g, tuple(in_shape))

    def flush_denormals(self):
        """Context of the path walks: a backend may treat subnormal numbers as 0 there."""
        return contextlib.nullcontext()

    # array ops every backend implements
    def asarray(self, value): raise NotImplementedError
    def to_numpy(self, x): raise NotImplementedError
    def ones(self, shape): raise NotImplementedError
    def zeros(self, shape): raise NotImplementedError
    def bias(self, node: Node, ndim: int): raise NotImplementedError
    def relu(self, x): raise NotImplementedError
    def kth_max_pool(self, node: Node, x, in_shape): raise NotImplementedError
    def amax(self, x) -> float: raise NotImplementedError
    def total(self, x) -> float: raise NotImplementedError
    def channel_sum(self, g): raise NotImplementedError

    def extrema(self, x) -> tuple[float, float]:
        """(min, max) of the entries of x ((0.0, 0.0) when empty)."""
        a = np.asarray(self.to_numpy(x), dtype=np.float64)
        return (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)

    def channel_amax(self, x):
        """max |x| over every axis but the first two, as a numpy float64 array (B, C): the
        certificate of the path walks (pathir.lifting.scaled) reads every channel's largest entry."""
        a = np.abs(np.asarray(self.to_numpy(x), dtype=np.float64))
        return a.reshape(a.shape[0], a.shape[1], -1).max(axis=2, initial=0.0)

    # the masked walks of pathir.lifting.pattern (activation patterns at data)
    def pool_choice(self, node: Node, x, in_shape, kth=None):
        """(B, C, *out) ints: the window offset (itertools.product order over the kernel) of
        each k-max-pool output's selected antecedent, the first attaining the k-th largest
        (``kth``: those k-th largest values, when the caller has them)."""
        raise BackendError(f"backend {self.name} has no rule for max-pool selection")

    def select_apply(self, node: Node, choice, x, in_shape):
        """The k-max-pool node's window with only the ``choice`` entry kept: y[o] = x[window(o)[choice[o]]]."""
        raise BackendError(f"backend {self.name} has no rule for max-pool selection")

    def select_adjoint(self, node: Node, choice, g, in_shape):
        """Adjoint of :meth:`select_apply` (shape (B, *in_shape))."""
        raise BackendError(f"backend {self.name} has no rule for max-pool selection")

    def row_amax(self, x):
        """max |x| over every axis but the first, as a numpy array (B,)."""
        raise BackendError(f"backend {self.name} has no rule for per-sample reductions")

    def row_total(self, x):
        """Sum over every axis but the first, as a numpy float64 array (B,)."""
        raise BackendError(f"backend {self.name} has no rule for per-sample reductions")
