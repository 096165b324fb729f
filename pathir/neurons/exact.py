"""Exact arithmetic at the neuron level: Φ_p as sympy monomials and the exact
neuron-by-neuron forward, on the networkx expansion of a small graph.

:func:`symbolic_phi` writes Φ_p (β(v_0) times the weights along p) in parameter
symbols or exact numbers; :func:`neuron_values` is the neuron forward in exact
arithmetic, whose pre-activations and max-pool selections give the path
activations a_p(θ, x) (:func:`pathir.neurons.paths.activations`).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import sympy as sp

from pathir.backends.sympy import ZERO, exact, exact_array, exact_relu, symbol
from pathir.errors import ArgumentError
from pathir.neurons.paths import walk_neurons

__all__ = ["symbolic_phi", "neuron_values"]



def _entries(values: Mapping[str, object] | None):
    """entry(param name, flat index, the expansion's float) -> a symbol
    (``values`` None), the given value, or the float read exactly."""
    if values is None:
        return lambda name, i, fallback: symbol(name, i)
    flat = {name: np.asarray(v, dtype=object).reshape(-1) for name, v in values.items()}

    def entry(name: str, i: int, fallback: float):
        return exact(flat[name][i]) if name in flat else exact(fallback)

    return entry


def _refuse_unknown(net, values) -> None:
    """ArgumentError naming the keys of ``values`` that name no param of ``net`` (a typo would read the
    graph's own value silently)."""
    if not values:
        return
    known = {data["bias"][0] for _, data in net.nodes(data=True) if data.get("bias") is not None}
    known |= {data["param"][0] for *_, data in net.edges(keys=True, data=True) if data.get("param") is not None}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ArgumentError(f"values names no param of the network: {unknown}; its params are {sorted(known)}")


def symbolic_phi(net, paths, values: Mapping[str, object] | None = None) -> list[sp.Expr]:
    """Φ_p for each path (docs/math.md §2): β(v_0) times the weights along p, as a
    sympy monomial in parameter symbols (``values=None``) or as an exact number
    (``values``: {param name: entries, any shape}; a param not given reads the
    graph's own value). Fixed weights are exact constants.

    ``net`` from :func:`pathir.neurons.expand.expand`, ``paths`` from
    :func:`pathir.neurons.paths.enumerate_paths`.

    >>> import numpy as np
    >>> from pathir.ir import GraphBuilder, Dense, Identity
    >>> from pathir.neurons.expand import expand
    >>> from pathir.neurons.paths import enumerate_paths
    >>> b = GraphBuilder()
    >>> x = b.input("x", (1,))
    >>> h = b.relu("h", [(x, Dense(b.param("fc1.weight", [[2.0]])))], bias=b.param("fc1.bias", [1.0]))
    >>> y = b.identity("y", [(h, Dense(b.param("fc2.weight", [[3.0]]))), (x, Identity())])
    >>> net = expand(b.build(outputs=[y]))
    >>> paths = enumerate_paths(net)
    >>> symbolic_phi(net, paths)
    [fc1.weight[0]*fc2.weight[0], 1, fc1.bias[0]*fc2.weight[0]]
    """
    _refuse_unknown(net, values)
    entry = _entries(values)
    out = []
    for p in paths:
        start = net.nodes[p.start]
        factors = [] if start["is_input"] else [entry(*start["bias"])]
        for u, v, key in p.edges():
            data = net.edges[u, v, key]
            factors.append(exact(data["weight"]) if data["param"] is None else entry(*data["param"], data["weight"]))
        out.append(sp.Mul(*factors))
    return out


def neuron_values(net, x: Mapping[str, object], values: Mapping[str, object] | None = None):
    """The network of docs/math.md §1 neuron by neuron, exactly: a
    :class:`pathir.neurons.paths.NeuronValues` of sympy numbers, from which
    :func:`pathir.neurons.paths.activations` reads a_p(θ, x).

    ``x``: {input name: one sample of its shape}; ``values``: {param name:
    entries} (a param not given: the graph's own value, read exactly).
    """
    flat = {name: exact_array(np.asarray(v, dtype=object)).reshape(-1) for name, v in x.items()}
    _refuse_unknown(net, values)
    entry = _entries(values if values is not None else {})
    return walk_neurons(
        net, flat,
        weight=lambda data: exact(data["weight"]) if data["param"] is None else entry(*data["param"], data["weight"]),
        bias=lambda d: ZERO if d["bias"] is None else entry(*d["bias"]),
        total=lambda values: sp.Add(*values), relu=exact_relu,
    )
