"""The pair algebra the rescaling solvers share (PathCond, ENorm, normalize).

B's rows grouped into unit pairs with their masses (:mod:`.unit_pairs`,
:mod:`.param_pairs`), the pair mass matrix and its Laplacian at a point
(:mod:`.pair_matrix`, :mod:`.pair_laplacian`), the layer groups' coarse space
(:mod:`.coarse`) and the log-space helpers (:mod:`.log_space`). Everything here
works on arrays and the analyses of a graph; nothing walks the graph.
"""
