"""The neuron-level view of a (small) graph: one networkx node per neuron.

:mod:`.expand` builds it, :mod:`.paths` enumerates paths, Φ and the path
activations a(θ, x) on it (the definitions every fast path is tested
against), and :mod:`.symbolic` runs the exact checks (rescaling invariance,
lifting identity, conservation laws, rank DΦ) with the sympy backend.
"""

from pathir.neurons.expand import Neuron, expand
from pathir.neurons.paths import Path, enumerate_num_paths, enumerate_path_norm, enumerate_paths, lifted_output
from pathir.neurons.symbolic import SymbolicReport, conservation_law_expressions, conservation_laws, verify_symbolic

__all__ = [
    "Neuron", "expand", "Path", "enumerate_paths", "enumerate_path_norm", "enumerate_num_paths",
    "lifted_output", "SymbolicReport", "verify_symbolic", "conservation_laws", "conservation_law_expressions",
]
