"""The ``pathir pathcond`` and ``pathir enorm`` commands."""

import json
import textwrap

import pytest

torch = pytest.importorskip("torch")

from pathir.app.cli import main  # noqa: E402

FACTORY = textwrap.dedent("""
    import torch
    from torch import nn


    def small():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Flatten(), nn.Linear(27, 4), nn.ReLU(), nn.Linear(4, 2))
        with torch.no_grad():
            model[1].running_var.uniform_(0.5, 1.5)
            model[1].weight.uniform_(0.5, 2.0)
        return model.eval()
""")


@pytest.fixture
def factory(tmp_path, monkeypatch):
    (tmp_path / "cli_models.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import cli_models

    importlib.reload(cli_models)
    return cli_models


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("command,extra", [("pathcond", []), ("pathcond", ["--solver", "coordinate"]),
                                           ("enorm", []), ("enorm", ["-p", "1"])])
def test_writes_a_state_dict_with_the_same_function(command, extra, factory, tmp_path, capsys):
    out = tmp_path / "out.pt"
    code, stdout, err = _run(capsys, command, "cli_models:small", "--input-shape", "2,6,6", "-o", out, *extra)
    assert code == 0, err
    assert f"written to {out}" in stdout and "units / parameters" in stdout
    original, rescaled = factory.small(), factory.small()
    rescaled.load_state_dict(torch.load(out))
    assert any(not torch.equal(a, b) for a, b in zip(original.state_dict().values(), rescaled.state_dict().values()))
    x = torch.randn(5, 2, 6, 6)
    with torch.no_grad():
        assert torch.allclose(rescaled(x), original(x), rtol=1e-4, atol=1e-5)
    assert [p.name for p in tmp_path.iterdir() if p.suffix in (".pt", ".tmp")] == ["out.pt"]


def test_json_report(factory, tmp_path, capsys):
    code, stdout, _ = _run(capsys, "pathcond", "cli_models:small", "--input-shape", "2,6,6", "--json",
                           "-o", tmp_path / "o.pt")
    assert code == 0
    d = json.loads(stdout)
    assert d["objective_after"] < d["objective_before"] and d["written"] and d["output"].endswith("o.pt")
    code, stdout, _ = _run(capsys, "enorm", "cli_models:small", "--input-shape", "2,6,6", "--json")
    d = json.loads(stdout)
    assert code == 0 and d["criterion_after"] < d["criterion_before"] and not d["written"] and d["output"] is None


def test_report_only_without_output(factory, tmp_path, capsys):
    code, stdout, _ = _run(capsys, "pathcond", "cli_models:small", "--input-shape", "2,6,6")
    assert code == 0 and "no (report only)" in stdout and "written to" not in stdout
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("__")) == ["cli_models.py"]


@pytest.mark.parametrize("argv,message", [
    (["pathcond", "cli_models:small", "--input-shape", "2,6,6", "-o", "out.txt"], "must be a .pt file"),
    (["enorm", "cli_models:nothing", "--input-shape", "2,6,6", "-o", "out.pt"], "cannot load"),
    (["pathcond", "not_a_model_name", "-o", "out.pt"], "neither a torchvision model name"),
    (["pathcond", "cli_models:small", "--input-shape", "2,6,6", "-o", "missing/out.pt"], "does not exist"),
    (["enorm", "cli_models:small", "--input-shape", "2,6,6", "-p", "0", "-o", "out.pt"], "p must be a finite number > 0"),
])
def test_errors_are_one_line_exit_2_and_no_file(argv, message, factory, tmp_path, capsys):
    code, stdout, err = _run(capsys, *argv)
    assert code == 2 and message in err and err.count("\n") == 1 and err.startswith(f"pathir {argv[0]}: error:")
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("__")) == ["cli_models.py"]


def test_onnx_model_is_written_as_onnx(tmp_path, capsys):
    pytest.importorskip("onnx")
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=s).astype(np.float32), n)
             for n, s in (("W1", (4, 3)), ("b1", (4,)), ("W2", (2, 4)), ("b2", (2,)))]
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], transB=1), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("Gemm", ["r", "W2", "b2"], ["y"], transB=1)], "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])], inits)
    src = tmp_path / "mlp.onnx"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    src.write_bytes(model.SerializeToString())
    before = src.read_bytes()
    code, stdout, err = _run(capsys, "pathcond", src, "-o", tmp_path / "out.onnx")
    assert code == 0, err
    assert src.read_bytes() == before
    import onnxruntime as ort

    x = rng.normal(size=(5, 3)).astype(np.float32)
    run = lambda path: ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(run(tmp_path / "out.onnx"), run(src), rtol=1e-4, atol=1e-5)
    code, _, err = _run(capsys, "enorm", src, "-o", tmp_path / "out.pt")
    assert code == 2 and "must be a .onnx file" in err


@pytest.mark.parametrize("argv,message", [
    (["pathcond", "cli_models:small", "--max-sweeps", "0"], "--max-sweeps: expected a whole number >= 1"),
    (["pathcond", "cli_models:small", "--tol", "nan"], "--tol: expected a finite number > 0"),
    (["check", "cli_models:small", "--max-paths", "-1"], "--max-paths: expected a whole number >= 1"),
    (["summary", "cli_models:small", "--seed", "99999999999999999999"], "--seed: expected a whole number from 0"),
    (["enorm", "cli_models:small", "--input-shape", "2,6,6", "-p", "inf"], "p must be a finite number > 0"),
])
def test_a_meaningless_number_is_refused_naming_its_flag(argv, message, factory, capsys):
    """--max-sweeps 0 ran a sweep, --tol nan ran every sweep, --max-paths -1 was printed back, a huge --seed
    overflowed unnamed, enorm -p inf marked every unit degenerate."""
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's own refusal of a flag's value
        code = stop.code
    assert code == 2 and message in capsys.readouterr().err
