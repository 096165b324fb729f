"""Deprecated alias: ``pathir.passes.find_units`` moved to :mod:`pathir.analyses.find_units` (an analysis, not a pass)."""

import warnings

from pathir.analyses.find_units import *  # noqa: F401,F403
from pathir.analyses.find_units import __all__  # noqa: F401

warnings.warn("pathir.passes.find_units moved to pathir.analyses.find_units", DeprecationWarning, stacklevel=2)
