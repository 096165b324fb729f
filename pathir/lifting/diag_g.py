"""diag G, the path-magnitude diagonal (docs/math.md §6), in one forward + backward.

    g_i = G_ii = Σ_{p ∋ i} (Φ_p(θ) / θ_i)^2 = Σ_{p ∋ i} Π_{other factors of p} factor^2

With u = θ^2 as leaf variables, g = ∂(Σ outputs)/∂u of the q = 2 path-norm
network ``path_view(maxpool_to_sum(graph), 2)`` (fixed weights squared too),
fed all ones: the weight-gradient of each param in that network. The walks keep
every value as (m, L) = m·e^L, so g is first known per param as a mantissa
array and a log-scale; :func:`diag_g_flat` returns it normalised by its
maximum together with the log of that maximum (PathCond's F only moves by a
constant under a global scale of g), :func:`diag_g` the plain values, raising
PathNormOverflow where one does not fit float64.

Under a rescaling z, g ← g ⊙ exp(Bz).
"""

from __future__ import annotations

import math

import numpy as np

from pathir.backends import get_backend
from pathir.errors import PathirError, PathNormOverflow
from pathir.ir import Graph, Param, Role
from pathir.lifting.param_grads import at_common_scale, param_log_parts

__all__ = ["diag_g", "diag_g_flat", "diag_g_log_parts", "source_layout"]

_LOG_MAX = math.log(np.finfo(np.float64).max)


def source_layout(p: Param, value: np.ndarray) -> np.ndarray:
    """``value`` (the param's shape) in the layout of the param's VALUE source tensor
    (``SourceRef.to_source``: a transpose, a transposed convolution's kernel layout)."""
    for ref in p.sources:
        if ref.role is Role.VALUE:
            return ref.to_source(value)
    return value


def arrays_by_source(params, log_parts, what: str, hint: str, layout=None) -> dict[str, np.ndarray]:
    """{``Param.source_name``: m·e^L} from one (m, L) per param (m of the param's shape; ``layout(p, v)``
    maps it to the source tensor's layout). Raises PathNormOverflow naming the param where a value
    exceeds float64 (``hint`` says what to use instead), PathirError where two params share a name.

    ``log_parts`` is consumed: each writable m is scaled in place into its value (no second copy of θ)."""
    out: dict[str, np.ndarray] = {}
    for p, (m, L) in zip(params, log_parts):
        if L > _LOG_MAX:
            raise PathNormOverflow(
                f"{what} of param '{p.name}' reaches about 10^{L / math.log(10):.1f}, beyond float64: use {hint}"
            )
        name = p.source_name
        if name in out:
            raise PathirError(f"two params are reported under the source name '{name}'")
        if L == -math.inf:
            value = np.zeros(p.shape)
        else:
            positive = int(np.count_nonzero(m))
            smallest = float(np.min(m, where=m > 0, initial=np.inf))  # (before m is scaled in place)
            if m.flags.writeable:
                value = m
                value *= math.exp(L)
            else:
                value = m * math.exp(L)
            if int(np.count_nonzero(value)) != positive:  # an entry below float64's range read as 0: "no path"
                low = L + math.log(smallest)
                raise PathNormOverflow(
                    f"{what} of param '{p.name}' falls to about 10^{low / math.log(10):.1f} at an entry, below "
                    f"float64's range (it would read as 0, no path through it): use {hint}")
        out[name] = value if layout is None else layout(p, value)
    return out


def diag_g_log_parts(graph: Graph, backend, outer=frozenset()) -> list[tuple[np.ndarray, float]]:
    """For each param of ``graph.params()``: (m, L) with g = m·e^L, m ≥ 0 of
    the param's shape and max m = 1 (m = 0, L = -inf where g vanishes). ``outer``: ids of dense and
    1×1-convolution params used once (`pathir.lifting.low_rank.factorable`) whose m may come as a
    `LowRank` (a convolution's product at most its rank P, not 1)."""

    return param_log_parts(graph, get_backend(backend), 2.0, what="diag G", outer=outer)


def diag_g_parts(graph: Graph, backend=None, outer=frozenset()) -> tuple[list[np.ndarray], float]:
    """([g / max g per param of ``graph.params()``, in its shape], log max g): `diag_g_flat` without
    the flat copy; each array is the walk's own, scaled in place. ``log max g`` is -inf when g = 0.
    ``outer`` as for `diag_g_log_parts` (a `LowRank` in place of the array where kept factored)."""

    return at_common_scale(diag_g_log_parts(graph, backend, outer))


def diag_g_flat(graph: Graph, backend=None) -> tuple[np.ndarray, float]:
    """(g / max g, log max g): g flat in the order of θ (``graph.params()``, C order).

    Never overflows; entries below ~1e-308 of the maximum underflow to 0.
    ``log max g`` is -inf when g = 0 (a graph without paths).
    """
    parts, top = diag_g_parts(graph, backend)
    g = np.empty(sum(m.size for m in parts))
    start = 0
    parts.reverse()
    while parts:  # each part is copied into g and released: one copy of θ, not two
        m = parts.pop()
        g[start:start + m.size] = m.reshape(-1)
        start += m.size
        del m
    return g, top


def diag_g(graph: Graph, backend=None) -> dict[str, np.ndarray]:
    """diag G per source parameter: {``Param.source_name``: array in the source tensor's layout}.

    Raises PathNormOverflow naming the param if an entry exceeds float64, or a nonzero one falls below its range (then
    use :func:`diag_g_flat`, normalised, with its log-scale).

    >>> import numpy as np
    >>> from pathir.ir import GraphBuilder, Dense
    >>> b = GraphBuilder()
    >>> x = b.input("x", (1,))
    >>> h = b.relu("h", [(x, Dense(b.param("w1", [[2.0]])))], bias=b.param("b1", [1.0]))
    >>> y = b.identity("y", [(h, Dense(b.param("w2", [[3.0]])))])
    >>> g = diag_g(b.build(outputs=[y]), "numpy")   # paths: x-h-y (w1 w2), bias b1-y (b1 w2)
    >>> {k: np.round(v, 12).ravel().tolist() for k, v in g.items()}
    {'w1': [9.0], 'b1': [9.0], 'w2': [5.0]}
    """
    return arrays_by_source(graph.params(), diag_g_log_parts(graph, backend), "diag G",
                            "pathir.lifting.diag_g.diag_g_flat (normalised, with its log-scale)", source_layout)
