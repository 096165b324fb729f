"""PathCond: minimise F(z) = n log Σ g e^{Bz} − Σ Bz over the rescalings.

:func:`solve` is the array-level entry (g, B or its row keys); :func:`pathcond`
runs it on a graph and builds the report. :mod:`.objective` holds F, its
gradient and the report's log-spreads; :mod:`.newton` (the default),
:mod:`.block` and :mod:`.coordinate` are the solvers; all take a bound
``max_log_scale`` on |z_h| (`pathir.rescaling.bounds` picks the default).
"""

from pathir.pathcond.objective import PathCondResult, gradient, log_spread, objective, rescaled_log_g
from pathir.pathcond.run import PathCondReport, pathcond
from pathir.pathcond.solvers import METHODS, solve

__all__ = [
    "solve", "METHODS", "PathCondResult", "objective", "gradient", "rescaled_log_g", "log_spread",
    "PathCondReport", "pathcond",
]
