"""pathir.support.progress: bars on stderr only when asked or on a terminal; solver callbacks passed where taken."""

import io
import sys

import pytest

import pathir.support.progress as progress_module
from pathir.support.progress import Phases, close_all, enabled, solver_callback, warn_not_converged


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_enabled_follows_the_terminal_unless_told(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert (enabled(None), enabled(True), enabled(False)) == (False, True, False)
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert (enabled(None), enabled(True), enabled(False)) == (True, True, False)


def test_phases_draw_the_phase_sweep_and_objective_on_stderr_only(capsys):
    with Phases(["units", "solve", "write"], desc="PathCond net", progress=True) as bar:
        bar.phase("units")
        bar.phase("solve")
        bar.callback(12, 3.25)
        bar.phase("write")
    out, err = capsys.readouterr()
    assert out == "" and "PathCond net: solve" in err and "sweep 12, F = 3.25" in err
    assert bar.done == ["units", "solve", "write"] and bar.last == (12, 3.25)
    with Phases(["solve"], progress=False) as quiet:
        quiet.phase("solve")
        quiet.callback(1, 1.0)
    assert capsys.readouterr() == ("", "") and quiet.last == (1, 1.0)


def test_solver_callback_only_for_solvers_that_take_one():
    bar = Phases(["solve"], progress=False)

    def with_callback(g, B, *, max_sweeps=10, callback=None):
        for k in range(3):
            callback and callback(k + 1, 10.0 - k)

    def without(g, B, *, max_sweeps=10):
        pass

    assert solver_callback(without, bar) == {}
    with_callback(None, None, **solver_callback(with_callback, bar))
    assert bar.last == (3, 8.0)


def test_non_convergence_is_a_runtime_warning():
    with pytest.warns(RuntimeWarning, match="ENorm on net did not converge in 7 sweeps"):
        warn_not_converged("ENorm", "net", 7)


def test_close_all_closes_the_bars_a_failing_call_left(capsys):
    def failing():
        bar = Phases(["units", "solve"], desc="ENorm net", progress=True)
        bar.phase("units")
        raise ValueError("bad")

    with pytest.raises(ValueError) as info:
        failing()
    left = info.value.__traceback__.tb_next.tb_frame.f_locals["bar"]
    assert not left._bar.disable and left in list(progress_module._OPEN)
    close_all()
    assert left not in list(progress_module._OPEN)
    left.close()  # closing again is harmless
    assert "ENorm net: units" in capsys.readouterr().err
