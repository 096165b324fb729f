"""What the CLI prints and writes: check's exit codes, prune's amount, files' modes, pipes, progress, --quiet."""

import io
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

torch = pytest.importorskip("torch")

import pathir  # noqa: E402
from pathir.app.cli import main  # noqa: E402
from pathir.errors import SelfCheckFailed  # noqa: E402

FACTORY = textwrap.dedent("""
    import torch
    from torch import nn


    def tiny():
        return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


    def small():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Flatten(), nn.Linear(27, 4), nn.ReLU(), nn.Linear(4, 2))
        with torch.no_grad():
            model[1].running_var.uniform_(0.5, 1.5)
        return model


    class Tanh(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 2)

        def forward(self, x):
            return torch.tanh(self.a(x))
""")
TINY = ("cli_output_models:tiny", "--input-shape", "3")
SMALL = ("cli_output_models:small", "--input-shape", "2,6,6")


@pytest.fixture(autouse=True)
def factory(tmp_path, monkeypatch):
    (tmp_path / "cli_output_models.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import cli_output_models

    return importlib.reload(cli_output_models)


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _files(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".pt", ".onnx", ".tmp"))


# ---------------------------------------------------------------- check


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_check_exit_0_when_all_hold(backend, capsys):
    code, out, err = _run(capsys, "check", *TINY, "--backend", backend)
    assert code == 0, out + err
    assert "all checks hold" in out and "ok      symbolic" in out and "26 of the model's 26" in out


def test_check_exit_1_names_the_failing_check(capsys, monkeypatch):
    import pathir.self_check

    def fail(cm, model, kind):
        raise SelfCheckFailed("self-check: made to fail for the test")

    monkeypatch.setattr(pathir.self_check, "self_check", fail)
    code, out, _ = _run(capsys, "check", *TINY)
    assert code == 1 and out.rstrip().endswith("FAILED: self-check")
    code, out, _ = _run(capsys, "check", *TINY, "--json")
    d = json.loads(out)
    assert code == 1 and d["passed"] is False and d["checks"][0] == {
        "name": "self-check", "passed": False, "detail": "self-check: made to fail for the test"}


def test_check_exit_2_on_refusal(capsys):
    code, out, err = _run(capsys, "check", "cli_output_models:Tanh", "--input-shape", "3")
    assert code == 2 and out == "" and err.splitlines()[-1].startswith("pathir check: error:") and "tanh" in err


# ---------------------------------------------------------------- prune


def test_prune_reports_only_without_output(capsys, tmp_path):
    code, out, _ = _run(capsys, "prune", *SMALL, "--amount", "0.25")
    assert code == 0 and "a fraction 0.25 of the candidates" in out and "model pruned" in out
    assert "no (report only)" in out and _files(tmp_path) == []


def test_prune_amount_as_a_count(capsys, tmp_path):
    code, out, _ = _run(capsys, "prune", *SMALL, "--amount", "50", "--json", "-o", "p.pt")
    d = json.loads(out)
    assert code == 0 and d["amount_understood"] == "50 entries (a count)" and d["pruned"] == 50
    state = torch.load(tmp_path / "p.pt")
    assert sum(int((v == 0).sum()) for k, v in state.items() if k.endswith("weight") and v.dim() > 1) >= 50


@pytest.mark.parametrize("amount", ["50.5", "0", "-1", "1.5", "half"])
def test_prune_amount_errors_name_the_forms(amount, capsys):
    code, out, err = _run(capsys, "prune", *SMALL, f"--amount={amount}")
    assert code == 2 and out == "" and "a fraction 0 < A < 1" in err and "a whole number A >= 1" in err
    assert "no --weights" not in err  # refused before the model is built


def test_criterion_help_lists_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["prune", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exit_.value.code == 0 and "path-magnitude (default)" in out and "magnitude: |weight|" in out


# ---------------------------------------------------------------- files, version, JSON


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_outputs_follow_the_umask(umask, capsys, tmp_path):
    old = os.umask(umask)
    try:
        assert _run(capsys, "pathcond", *SMALL, "-q", "-o", "r.pt")[0] == 0
        assert _run(capsys, "prune", *SMALL, "-q", "--amount", "0.5", "-o", "p.pt")[0] == 0
    finally:
        os.umask(old)
    for name in ("r.pt", "p.pt"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask
    assert _files(tmp_path) == ["p.pt", "r.pt"]  # no temporary left


@pytest.mark.parametrize("command", ["equalize", "pathcond", "prune"])
def test_an_output_path_that_is_a_folder_is_one_error_line_before_any_work(command, capsys, tmp_path, monkeypatch):
    (tmp_path / "out.pt").mkdir()
    monkeypatch.setattr(pathir, "compile", lambda *a, **k: pytest.fail("compiled before the output path was checked"))
    extra = ("--amount", "0.5") if command == "prune" else ()
    code, out, err = _run(capsys, command, *TINY, *extra, "-q", "-o", "out.pt")
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [f"pathir {command}: error: output path is a folder: 'out.pt' (name the file to write)"]
    assert _files(tmp_path) == ["out.pt"] and not any((tmp_path / "out.pt").iterdir())


def test_a_folder_the_file_system_refuses_is_refused_before_any_work(capsys, tmp_path, monkeypatch):
    """Permission bits pass for root where the file system refuses (a read-only mount, /sys): the write failed
    after the work, naming pathir's temporary file; a folder without a .pt suffix was named a wrong suffix."""
    import tempfile

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied", kwargs.get("dir"))

    mkstemp = tempfile.mkstemp
    monkeypatch.setattr(tempfile, "mkstemp", refused)
    monkeypatch.setattr(pathir, "compile", lambda *a, **k: pytest.fail("compiled before the output path was checked"))
    code, _, err = _run(capsys, "pathcond", *TINY, "-q", "-o", "out.pt")
    assert code == 2 and err.strip().splitlines() == [
        f"pathir pathcond: error: output folder is not writable: {tmp_path} (Permission denied)"]
    (tmp_path / "outdir").mkdir()
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    code, _, err = _run(capsys, "pathcond", *TINY, "-q", "-o", "outdir")
    assert code == 2 and "output path is a folder: 'outdir'" in err


def test_a_write_that_fails_is_one_error_line(capsys, tmp_path, monkeypatch):
    from pathir.app.commands import common

    def refuse(path, write):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(common, "write_atomic", refuse)
    code, out, err = _run(capsys, "pathcond", *TINY, "-q", "-o", "r.pt")
    assert code == 2 and err.strip().splitlines() == ["pathir pathcond: error: [Errno 13] Permission denied: 'r.pt'"]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"pathir {pathir.__version__}"


def test_json_is_concise_unless_history(capsys):
    code, out, _ = _run(capsys, "enorm", *SMALL, "--json", "-q")
    d = json.loads(out)
    assert code == 0 and "history" not in d and d["seed"] == 0
    code, out, _ = _run(capsys, "pathcond", *SMALL, "--json", "-q", "--history")
    d = json.loads(out)
    history = d["history"]  # one F per solver step (Newton: block warm-up sweeps, then iterations)
    assert code == 0 and 1 <= len(history) <= d["sweeps"] + 1
    assert all(b <= a * (1 + 1e-12) for a, b in zip(history, history[1:]))  # F never rises
    for command in ("pathcond", "enorm"):  # (it was ignored without a word)
        code, out, err = _run(capsys, command, *SMALL, "-q", "--history")
        assert code == 2 and not out and "--history" in err and "needs --json" in err


def test_every_json_report_names_its_model_weights_and_seed(capsys):
    for command in ("summary", "pathcond", "enorm", "equalize"):
        code, out, _ = _run(capsys, command, *SMALL, "--json", "-q")
        d = json.loads(out)
        assert code == 0 and {"model", "weights", "seed"} <= d.keys(), (command, sorted(d))


def test_reports_use_words_not_argument_names(capsys):
    for command in ("pathcond", "enorm"):
        code, out, _ = _run(capsys, command, *SMALL, "-q")
        assert code == 0 and "no (report only)" in out and "write_back" not in out


def test_broken_pipe_exits_quietly(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    proc = subprocess.Popen([sys.executable, "-m", "pathir.app.cli", "summary", *TINY, "--json"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # the reader is gone before anything is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and "Error" not in err


# ---------------------------------------------------------------- progress


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_on_a_terminal_off_with_quiet(monkeypatch, capsys):
    for quiet, expect in ((False, True), (True, False)):
        fake = _Terminal()
        monkeypatch.setattr(sys, "stderr", fake)
        code = main([*("pathcond",), *SMALL, *(["-q"] if quiet else [])])
        monkeypatch.undo()
        stdout = capsys.readouterr().out
        assert code == 0 and "objective F" in stdout
        drawn = fake.getvalue()
        assert ("PathCond" in drawn and "solve" in drawn and "compile" in drawn) is expect, drawn
        if quiet:
            assert drawn == ""


def test_progress_off_when_stderr_is_not_a_terminal(capsys):
    code, _, err = _run(capsys, "pathcond", *SMALL)
    assert code == 0 and "PathCond" not in err and "%|" not in err


@pytest.mark.parametrize("method", ["pathcond", "enorm", "normalize", "prune"])
def test_progress_argument_of_the_api(method, factory, capsys):
    call = (lambda cm, p: cm.prune(0.5, progress=p)) if method == "prune" else \
        (lambda cm, p: getattr(cm, method)(progress=p))
    for progress in (True, False):
        cm = pathir.compile(factory.small().eval(), input_shape=(2, 6, 6), progress=progress)
        call(cm, progress)
        err = capsys.readouterr().err
        assert ("write" in err and "compile" in err) is progress, err


def test_progress_argument_of_path_metric(factory, capsys):
    a = pathir.compile(factory.small().eval(), input_shape=(2, 6, 6), progress=False)
    b = pathir.compile(factory.small().eval(), input_shape=(2, 6, 6), progress=False)
    for progress in (True, False):
        m = pathir.path_metric(a, b, progress=progress)
        assert m.upper <= 1e-9 * m.norm_a  # same seed, same weights
        assert ("path-metric" in capsys.readouterr().err) is progress


@pytest.mark.parametrize("method", ["pathcond", "enorm"])
def test_not_converging_warns(method, factory):
    cm = pathir.compile(factory.small().eval(), input_shape=(2, 6, 6))
    with pytest.warns(RuntimeWarning, match="did not converge in 1 sweeps"):
        report = getattr(cm, method)(max_sweeps=1, write_back=False)
    assert not report.converged
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert getattr(cm, method)(write_back=False).converged


def test_the_cli_run_in_process_leaves_the_callers_random_stream_and_sys_path(capsys):
    """load_model seeded torch's global generator (the caller's next torch.rand changed) and put the working
    folder on sys.path once per call."""
    import sys

    _run(capsys, "summary", *TINY, "-q")  # the folder is on sys.path once, from here on
    path = list(sys.path)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    for _ in range(2):
        code, _, _ = _run(capsys, "summary", *TINY, "-q")
        assert code == 0
    assert torch.equal(torch.rand(3), expected) and sys.path == path
