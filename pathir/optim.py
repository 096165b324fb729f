"""``pathir.optim``: the public name of :mod:`pathir.integrations.optim` (Path-SGD)."""

from pathir.integrations.optim import *  # noqa: F401,F403
from pathir.integrations.optim import __all__  # noqa: F401
