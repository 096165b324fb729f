"""Progress bars on stderr for the calls that can take seconds: one helper for all of them.

``progress=None`` (the default everywhere) shows a bar only when stderr is a
terminal; ``True`` always, ``False`` never. A :class:`Phases` bar advances one
step per named phase ("units", "diag G", "solve", "write") and shows the
current phase and, through :meth:`Phases.callback` (the ``callback(iteration,
value)`` a solver calls after each sweep), the sweep and the objective. A bar
writes only to stderr, never to stdout, so ``--json`` output stays clean.

>>> with Phases(["units", "solve"], desc="demo", progress=False) as bar:
...     bar.phase("units")
...     bar.phase("solve")
...     bar.callback(3, 1.5)
>>> bar.done, bar.last
(['units', 'solve'], (3, 1.5))
"""

from __future__ import annotations

import inspect
import sys
import warnings
import weakref

from pathir.errors import NotConvergedWarning

__all__ = ["enabled", "Phases", "bar", "solver_callback", "chain_callbacks", "warn_not_converged", "close_all"]

_OPEN: "weakref.WeakSet[Phases]" = weakref.WeakSet()


def enabled(progress: bool | None) -> bool:
    """Whether to draw: ``progress`` when given, else whether stderr is a terminal."""
    if progress is not None:
        return bool(progress)
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stderr
        return False


def bar(iterable=None, desc: str = "", total=None, progress: bool | None = None, unit: str = "it"):
    """A tqdm bar on stderr, disabled unless :func:`enabled` (``leave=False``: it clears itself)."""
    return quiet_tqdm()(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, leave=False,
                        disable=not enabled(progress), dynamic_ncols=True)


def quiet_tqdm():
    """tqdm without its monitor thread (which tqdm starts for every bar, a disabled one too, and leaves
    running in the user's process); the monitor only refreshes bars that stall."""
    global _QUIET
    if _QUIET is None:
        from tqdm import tqdm

        _QUIET = type("QuietTqdm", (tqdm,), {"monitor_interval": 0})
    return _QUIET


_QUIET = None


class Phases:
    """A bar over named phases: ``phase(name)`` closes the previous one and starts ``name``;
    ``callback(iteration, value)`` shows the sweep and the objective of the running phase.
    ``done`` lists the phases started, ``last`` the last (iteration, value) seen, drawn or not."""

    def __init__(self, phases, desc: str = "", progress: bool | None = None, value_name: str = "F"):
        self.phases, self.desc, self.value_name = list(phases), desc, value_name
        self.done: list[str] = []
        self.last: tuple | None = None
        self._bar = bar(desc=desc, total=len(self.phases), progress=progress, unit="phase")
        _OPEN.add(self)

    def phase(self, name: str) -> None:
        if self.done:
            self._bar.update(1)
        self.done.append(name)
        self._bar.set_description_str(f"{self.desc}: {name}" if self.desc else name)

    def callback(self, iteration: int, value: float) -> None:
        self.last = (iteration, value)
        self._bar.set_postfix_str(f"sweep {iteration}, {self.value_name} = {value:.6g}", refresh=True)

    def close(self) -> None:
        if self in _OPEN:
            _OPEN.discard(self)
            if self.done:
                self._bar.update(1)
            self._bar.close()

    def __enter__(self) -> "Phases":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def close_all() -> None:
    """Close the bars a call left open when it raised (the CLI calls it before printing the error)."""
    for phases in list(_OPEN):
        phases._bar.close()
        _OPEN.discard(phases)


def solver_callback(solver, phases: Phases) -> dict:
    """``{"callback": phases.callback}`` when ``solver`` takes a ``callback(iteration, value)``
    argument, else ``{}``: the call sites pass it through without knowing which solvers do."""
    try:
        return {"callback": phases.callback} if "callback" in inspect.signature(solver).parameters else {}
    except (TypeError, ValueError):
        return {}


def chain_callbacks(*callbacks):
    """One ``callback(iteration, value)`` calling each of ``callbacks`` that is not None, in order."""
    live = [c for c in callbacks if c is not None]

    def call(iteration, value):
        for c in live:
            c(iteration, value)
    return call


def warn_not_converged(what: str, name: str, sweeps: int, hint: str = "raise max_sweeps or tol") -> None:
    """The warning a solver's caller gives when its stopping rule was not met."""
    warnings.warn(f"{what} on {name or 'the model'} did not converge in {sweeps} sweeps ({hint}); "
                  "the result is the last iterate (still function-preserving)", NotConvergedWarning, stacklevel=4)
