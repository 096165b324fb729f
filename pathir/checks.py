"""``pathir.checks``: the public name of :mod:`pathir.app.checks` (``pathir check``)."""

from pathir.app.checks import *  # noqa: F401,F403
from pathir.app.checks import __all__  # noqa: F401
