"""Definitions by enumeration that several tests compare against."""

from pathir.analyses.incidence import ParamLayout
from pathir.neurons.expand import expand
from pathir.neurons.paths import enumerate_paths


def path_factors(graph):
    """Per enumerated path: (product of its fixed weights, [(flat index in θ, value)] of its free factors)."""
    layout = ParamLayout(tuple(graph.params()))
    net = expand(graph)
    out = []
    for p in enumerate_paths(net):
        const, free = 1.0, []
        start = net.nodes[p.start]
        if not start["is_input"]:
            free.append((layout.slice(start["bias"][0]).start + start["bias"][1], start["bias"][2]))
        for u, v, k in p.edges():
            d = net.edges[u, v, k]
            if d["param"] is None:
                const *= d["weight"]
            else:
                free.append((layout.slice(d["param"][0]).start + d["param"][1], d["weight"]))
        out.append((const, free))
    return out, layout
