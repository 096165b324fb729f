"""Deprecated alias: ``pathir.passes.incidence`` moved to :mod:`pathir.analyses.incidence` (an analysis, not a pass)."""

import warnings

from pathir.analyses.incidence import *  # noqa: F401,F403
from pathir.analyses.incidence import __all__  # noqa: F401

warnings.warn("pathir.passes.incidence moved to pathir.analyses.incidence", DeprecationWarning, stacklevel=2)
