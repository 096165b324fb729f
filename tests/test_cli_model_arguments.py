"""The MODEL argument of every command: --weights (state_dict, checkpoints, pickles), --seed, .onnx files."""

import json
import textwrap

import pytest

torch = pytest.importorskip("torch")

import pathir  # noqa: E402
from pathir.app.cli import main  # noqa: E402

FACTORY = textwrap.dedent("""
    from torch import nn


    def small():
        return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(27, 4), nn.ReLU(), nn.Linear(4, 2))
""")
SHAPE = ("--input-shape", "2,6,6")


@pytest.fixture
def factory(tmp_path, monkeypatch):
    (tmp_path / "cli_weights_models.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import cli_weights_models

    return importlib.reload(cli_weights_models)


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _trained(factory, seed=7):
    """The factory's model with weights no default init gives (and batch-norm statistics set)."""
    torch.manual_seed(seed)
    model = factory.small()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-1.0, 1.0)
        model[1].running_var.uniform_(0.5, 1.5)
        model[1].running_mean.uniform_(-0.5, 0.5)
    return model.eval()


def _api_summary(model):
    return pathir.compile(model, input_shape=(2, 6, 6)).summary().to_dict()


@pytest.mark.parametrize("layout", ["state_dict", "checkpoint", "model_key", "data_parallel"])
def test_weights_give_the_api_numbers(layout, factory, tmp_path, capsys):
    model = _trained(factory)
    state = model.state_dict()
    obj = {"state_dict": state, "epoch": 3} if layout == "checkpoint" else {"model": state} \
        if layout == "model_key" else {f"module.{k}": v for k, v in state.items()} \
        if layout == "data_parallel" else state
    torch.save(obj, tmp_path / "w.pth")
    code, out, err = _run(capsys, "summary", "cli_weights_models:small", *SHAPE, "--weights", "w.pth", "--json")
    assert code == 0, err
    got, want = json.loads(out), _api_summary(model)
    assert got["log10_path_norms"] == want["log10_path_norms"] and got["log10_paths"] == want["log10_paths"]
    assert got["weights"] == "w.pth" and got["seed"] is None and "random" not in err


def test_torchvision_state_dict_round_trip(tmp_path, capsys, monkeypatch):
    torchvision = pytest.importorskip("torchvision")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(123)
    full = torchvision.models.resnet18().eval()
    with torch.no_grad():  # statistics no fresh model has: the file's values must be the ones used
        for m in full.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
    torch.save(full.state_dict(), tmp_path / "r18.pt")
    code, out, err = _run(capsys, "summary", "resnet18", "--input-shape", "3,32,32", "--weights", "r18.pt", "--json")
    assert code == 0, err
    want = pathir.compile(full, input_shape=(3, 32, 32)).summary().to_dict()
    assert json.loads(out)["log10_path_norms"] == want["log10_path_norms"]


def test_a_checkpoint_without_batchnorm_step_counters_loads_as_torch_loads_it(tmp_path, capsys, monkeypatch):
    """Older checkpoints hold no num_batches_tracked; torch's strict load takes them (counted from 0), pathir
    refused them as missing keys."""
    torchvision = pytest.importorskip("torchvision")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(1)
    full = torchvision.models.resnet18().eval()
    with torch.no_grad():
        for m in full.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_var.uniform_(0.5, 2.0)
    state = {k: v for k, v in full.state_dict().items() if not k.endswith("num_batches_tracked")}
    torch.save(state, tmp_path / "old.pt")
    code, out, err = _run(capsys, "summary", "resnet18", "--input-shape", "3,32,32", "--weights", "old.pt", "--json")
    assert code == 0, err
    want = pathir.compile(full, input_shape=(3, 32, 32)).summary().to_dict()
    assert json.loads(out)["log10_path_norms"] == want["log10_path_norms"]


def test_mismatched_weights_are_refused_naming_the_keys(factory, tmp_path, capsys):
    state = _trained(factory).state_dict()
    state["extra.weight"] = torch.zeros(1)
    del state["5.bias"]
    torch.save(state, tmp_path / "bad.pt")
    code, out, err = _run(capsys, "summary", "cli_weights_models:small", *SHAPE, "--weights", "bad.pt")
    assert code == 2 and out == ""
    assert "missing keys: 5.bias" in err and "unexpected keys: extra.weight" in err
    state = _trained(factory).state_dict()
    state["5.weight"] = torch.zeros(4, 26)
    torch.save(state, tmp_path / "shape.pt")
    code, _, err = _run(capsys, "summary", "cli_weights_models:small", *SHAPE, "--weights", "shape.pt")
    assert code == 2 and "5.weight (4, 26) (model (4, 27))" in err


def test_a_pickled_module_needs_trust_pickle(factory, tmp_path, capsys):
    model = _trained(factory)
    torch.save(model, tmp_path / "whole.pt")
    code, _, err = _run(capsys, "summary", "cli_weights_models:small", *SHAPE, "--weights", "whole.pt")
    assert code == 2 and "--trust-pickle" in err and err.count("\n") == 1
    assert "Sequential" in err and "\x1b" not in err  # the class it pickles named; torch's terminal escapes not
    (tmp_path / "junk.pt").write_text("not a torch file")
    for extra in ((), ("--trust-pickle",)):  # not a pickle at all: --trust-pickle is no way out, nor offered
        code, _, err = _run(capsys, "summary", "cli_weights_models:small", *SHAPE, "--weights", "junk.pt", *extra)
        assert code == 2 and "as a file torch.save wrote" in err and "--trust-pickle" not in err
    (tmp_path / "text.pt").write_text("hello world\nnot weights\n")  # torch.load's KeyError: its text a bare "101"
    code, _, err = _run(capsys, "summary", "cli_weights_models:small", *SHAPE, "--weights", "text.pt")
    assert code == 2 and "(KeyError in torch.load: not a pickle or zip archive of tensors)" in err
    code, out, err = _run(capsys, "summary", "cli_weights_models:small", *SHAPE, "--weights", "whole.pt",
                          "--trust-pickle", "--json")
    assert code == 0, err
    assert json.loads(out)["log10_path_norms"] == _api_summary(model)["log10_path_norms"]


def test_random_init_is_announced_once_and_seeded(factory, capsys):
    runs = {}
    for seed in (0, 0, 1):
        code, out, err = _run(capsys, "summary", "cli_weights_models:small", *SHAPE, "--json", "--seed", seed)
        assert code == 0 and err.count("no --weights given") == 1 and f"torch.manual_seed({seed})" in err
        runs.setdefault(seed, []).append(json.loads(out))
    assert runs[0][0]["log10_path_norms"] == runs[0][1]["log10_path_norms"] != runs[1][0]["log10_path_norms"]
    assert runs[0][0]["seed"] == 0 and runs[0][0]["weights"] is None
    code, out, err = _run(capsys, "summary", "cli_weights_models:small", *SHAPE, "-q")
    assert code == 0 and err == "" and "random init (seed 0)" in out


def test_observe_takes_the_seed_and_says_where_the_weights_came_from(factory, tmp_path, capsys):
    """observe dropped --seed (seed 0's numbers for --seed 5), said nothing of the random init, and its JSON had
    no weights/seed fields."""
    import numpy as np

    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(3, 2, 6, 6)))
    norms = {}
    for seed in (0, 5):
        code, out, err = _run(capsys, "observe", "cli_weights_models:small", "--inputs", tmp_path / "x.npy", "--json",
                              "--seed", seed)
        report = json.loads(out)
        assert code == 0 and f"torch.manual_seed({seed})" in err and report["seed"] == seed
        norms[seed] = report["global"]["log10_path_norm_l1"]
        torch.manual_seed(seed)
        want = pathir.compile(factory.small().eval(), input_shape=(2, 6, 6)).path_norm(1, log10=True)
        assert norms[seed] == pytest.approx(want, rel=1e-12)
    assert norms[0] != norms[5]
    code, out, err = _run(capsys, "observe", "cli_weights_models:small", "--inputs", tmp_path / "x.npy", "-q")
    assert code == 0 and err == ""


@pytest.mark.parametrize("source, match", [
    ("def small(:\n", "cannot import 'broken' for 'broken:small': SyntaxError"),
    ("def small():\n    raise RuntimeError('no data here')\n", "calling small\\(\\) with no arguments raised RuntimeError"),
    ("class small:\n    def __init__(self, h):\n        pass\n", "raised TypeError"),
])
def test_a_broken_factory_is_one_line_and_exit_2(factory, tmp_path, capsys, source, match):
    """A syntax error, a raising factory or a class that needs arguments gave a raw traceback and exit 1 (which
    `pathir check` documents as 'a check failed')."""
    import re

    name = f"broken_{abs(hash(source)) % 10**8}"  # a module name of its own: imports are cached per process
    (tmp_path / f"{name}.py").write_text(source.replace("\\n", "\n"))
    code, out, err = _run(capsys, "check", f"{name}:small", *SHAPE)
    assert code == 2 and len(err.strip().splitlines()) == 1 and re.search(match.replace("broken", name), err)
    code, out, err = _run(capsys, "summary", f"{name}.py", *SHAPE)
    assert code == 2 and f"MODEL takes its module and factory, {name}:FACTORY" in err


def test_onnx_file(tmp_path, capsys, factory):
    pytest.importorskip("onnx")
    model = _trained(factory)
    torch.onnx.export(model, (torch.randn(1, 2, 6, 6),), str(tmp_path / "small.onnx"), dynamo=False,
                      input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    code, out, err = _run(capsys, "summary", tmp_path / "small.onnx", "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["weights"].endswith("small.onnx") and "no --weights" not in err
    want = _api_summary(model)["log10_path_norms"]
    assert got["log10_path_norms"] == pytest.approx(want, rel=1e-5)  # float32 initializers
    code, _, err = _run(capsys, "summary", tmp_path / "small.onnx", "--weights", "w.pt")
    assert code == 2 and "carries its own weights" in err
    code, _, err = _run(capsys, "summary", tmp_path / "small.onnx", "--trust-pickle")  # (accepted silently)
    assert code == 2 and "an .onnx file is no pickle" in err


@pytest.mark.parametrize("text, shape", [("3,224,224", (3, 224, 224)), ("3x224x224", (3, 224, 224)), ("4,", (4,)),
                                         ("4,x", None), ("x", None), ("4,,5", None), ("0,3", None)])
def test_input_shape_is_read_whole_or_refused(text, shape):
    """'4,x' was read as (4,): the x taken for a separator and the empty part dropped."""
    from pathir.app.commands.common import parse_shape
    from pathir.errors import ArgumentError

    if shape is None:
        with pytest.raises(ArgumentError, match="--input-shape"):
            parse_shape(text)
    else:
        assert parse_shape(text) == shape


@pytest.mark.parametrize("command", [["pathcond"], ["prune", "--amount", "0.1"], ["equalize"], ["enorm"]])
def test_a_bare_torchvision_name_beside_a_file_of_that_name_writes_a_state_dict(command, tmp_path, capsys, monkeypatch):
    """docs/cli.md: a bare name is torchvision's even where a file of that name exists. The writing commands took
    such a MODEL for an ONNX file ("output for an ONNX model must be a .onnx file", or cm.save() refused only after
    the whole run); they now write the model's state_dict, and a .onnx output is refused before any work."""
    pytest.importorskip("torchvision")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "squeezenet1_1").write_text("not a model")
    args = [*command, "squeezenet1_1", "--input-shape", "3,32,32", "-q"]
    code, out, err = _run(capsys, *args, "-o", "sq.pt")
    assert code == 0, err
    assert "features.0.weight" in torch.load(tmp_path / "sq.pt")
    code, out, err = _run(capsys, *args, "-o", "sq.onnx")
    assert code == 2 and "must be a .pt file" in err and not (tmp_path / "sq.onnx").exists()


def test_a_python_file_with_a_factory_is_refused_before_running_it(factory, tmp_path, capsys):
    """``mynets.py:small`` was imported as the module 'mynets.py': the file's top level ran (here: it writes a
    marker), then 'No module named mynets.py'. It is refused first, saying what to type."""
    (tmp_path / "marked.py").write_text("open('ran', 'w').close()\n" + FACTORY)
    code, out, err = _run(capsys, "summary", "marked.py:small", *SHAPE)
    assert code == 2 and "MODEL takes a module, not a file: marked:small" in err
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("argv", [("summary", "cli_weights_models:small", *SHAPE, "--weights", ""),
                                  ("summary", "cli_weights_models:small", *SHAPE, "--weights", "  ")])
def test_an_empty_weights_path_is_refused_not_read_as_no_weights(argv, factory, capsys):
    """--weights "$CKPT" with CKPT unset printed the random init's numbers, exit 0 (review)."""
    with pytest.raises(SystemExit) as exit_:
        _run(capsys, *argv)
    assert exit_.value.code == 2 and "expected a file path, got an empty one" in capsys.readouterr().err


def test_observe_refuses_an_empty_compare_and_csv_with_json(factory, tmp_path, capsys):
    import numpy as np

    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(3, 2, 6, 6)).astype(np.float32))
    base = ("observe", "cli_weights_models:small", *SHAPE, "--inputs", tmp_path / "x.npy", "-q")
    with pytest.raises(SystemExit) as exit_:
        _run(capsys, *base, "--compare", "")
    assert exit_.value.code == 2 and "--compare: expected a file path" in capsys.readouterr().err
    code, _, err = _run(capsys, *base, "--csv", "--json")
    assert code == 2 and "--csv and --json each choose what is printed" in err


def test_demo_refuses_an_out_that_is_a_file_before_it_trains(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    code, _, err = _run(capsys, "demo", "--out", tmp_path / "afile", "--quick", "-q")
    assert code == 2 and "--out names a file, not a folder" in err
