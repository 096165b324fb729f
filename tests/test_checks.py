"""pathir.app.checks.check: every check can fail, and passes where the definition holds."""

import numpy as np
import pytest
from hypothesis import given, settings

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import pathir  # noqa: E402
import pathir.app.checks  # noqa: E402
from pathir.errors import SelfCheckFailed, UnsupportedOperation  # noqa: E402
from pathir.testing import relu_dags  # noqa: E402


def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


class Unused(nn.Module):
    """A conv bias folded into its batch-norm (read, not a source of its own) and a module never called."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.spare = nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.Linear(5, 5)
        self.out = nn.Linear(3 * 4 * 4, 2)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.conv(x))).flatten(1))


@settings(max_examples=15, deadline=None)
@given(relu_dags(max_neurons=40, max_paths=300))
def test_random_dags_pass_and_the_symbolic_check_runs(graph):
    report = pathir.app.checks.check(graph)
    assert report.passed, str(report)
    names = {c.name: c.passed for c in report.checks}
    assert names["rescaling units (IR)"] is True and names["rescaling write-back"] is None
    assert names["symbolic"] is True  # ≤ 300 paths: under the default limit


def test_torch_model_checks_and_model_untouched():
    model = _tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = pathir.app.checks.check(model, input_shape=(3,))
    assert report.passed and [c.passed for c in report.checks] == [True, True, True, True]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "all checks hold" in str(report) and report.to_dict()["passed"] is True


def test_coverage_names_the_unused_module_and_counts_the_folded_bias():
    model = Unused().eval()
    report = pathir.app.checks.check(model, input_shape=(2, 4, 4))
    assert [(n, k) for n, k, _ in report.not_reached] == [("spare.weight", 25), ("spare.bias", 5)]
    assert "does not use it" in report.not_reached[0][2]
    total = sum(p.numel() for p in model.parameters())
    assert report.model_params == total and report.covered == total - 30  # conv.bias counts as read
    assert "not reached: spare.weight (25 entries)" in str(report)


def test_onnx_coverage_counts_the_tensors_folded_into_a_batch_norm_as_read(tmp_path):
    """Conv -> BatchNormalization exported unfolded: the conv's bias and the statistics enter the folded bias only,
    and were listed as "not reached: no output of the graph depends on it" (review); every input of a node the
    graph reads counts as read, and an initializer no node reads still does not."""
    import onnx
    from onnx import helper, numpy_helper

    model = Unused().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    path = tmp_path / "bn.onnx"
    torch.onnx.export(model, (torch.randn(1, 2, 4, 4),), str(path), dynamo=False, do_constant_folding=False)
    proto = onnx.load(str(path))
    proto.graph.initializer.append(numpy_helper.from_array(np.ones(7, dtype=np.float32), "stray"))
    proto.graph.input.append(helper.make_tensor_value_info("stray", onnx.TensorProto.FLOAT, [7]))
    onnx.save(proto, str(path))
    report = pathir.app.checks.check(str(path))
    assert [(n, k) for n, k, _ in report.not_reached] == [("stray", 7)]
    assert report.covered == report.model_params - 7


def test_a_wrong_unit_fails_the_rescaling_checks(monkeypatch):
    """A rescaling that moves one param more than its units say (what a wrong unit would do) is caught."""
    import pathir.app.checks as checks
    import pathir.compiled as compiled

    real_ir, real_commit = checks.rescale_graph, compiled.commit_rescaling

    def ir_off_by_one(graph, units, z):
        first = []
        return real_ir(graph, units, z).map_params(lambda p: p if first else first.append(p) or _doubled(p))

    def commit_off_by_one(graph, units, z, model=None, writer=None, optimizer=None, **kwargs):
        out = real_commit(graph, units, z, model, writer, optimizer, **kwargs)
        with torch.no_grad():
            next(iter(model.parameters())).mul_(2.0)
        return out

    monkeypatch.setattr(checks, "rescale_graph", ir_off_by_one)  # the names where they are called
    monkeypatch.setattr(compiled, "commit_rescaling", commit_off_by_one)
    report = pathir.app.checks.check(_tiny(), input_shape=(3,))
    assert not report.passed
    assert [c.name for c in report.failed] == ["rescaling units (IR)", "rescaling write-back"]
    assert str(report).endswith("FAILED: rescaling units (IR), rescaling write-back")


def _doubled(p):
    from pathir.ir import Param

    return Param(p.name, p.value * 2.0, p.sources, p.how)


def test_self_check_failure_is_a_failed_check(monkeypatch):
    import pathir.self_check

    def fail(cm, model, kind):
        raise SelfCheckFailed("self-check: made to fail")

    monkeypatch.setattr(pathir.self_check, "self_check", fail)
    report = pathir.app.checks.check(_tiny(), input_shape=(3,))
    assert [c.name for c in report.failed] == ["self-check"] and "made to fail" in report.failed[0].detail


def test_refusal_propagates():
    class Tanh(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 2)

        def forward(self, x):
            return torch.tanh(self.a(x))

    with pytest.raises(UnsupportedOperation):
        pathir.app.checks.check(Tanh(), input_shape=(3,))


def test_symbolic_skipped_above_the_limit():
    report = pathir.app.checks.check(_tiny(), input_shape=(3,), max_paths=10)
    symbolic = report.checks[-1]
    assert symbolic.name == "symbolic" and symbolic.passed is None and "above the 10" in symbolic.detail


def test_onnx_model_checked_through_onnxruntime(tmp_path):
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=s).astype(np.float32), n)
             for n, s in (("W1", (4, 3)), ("b1", (4,)), ("W2", (2, 4)), ("b2", (2,)), ("unused", (5,)))]
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], transB=1), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("Gemm", ["r", "W2", "b2"], ["y"], transB=1)], "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])], inits)
    path = tmp_path / "mlp.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString())
    before = path.read_bytes()
    report = pathir.app.checks.check(str(path))
    assert report.passed and [c.passed for c in report.checks] == [True, True, True, True], str(report)
    assert "onnxruntime (float32)" in report.checks[2].detail
    assert report.not_reached == (("unused", 5, "no output of the graph depends on it"),) and report.covered == 26
    assert path.read_bytes() == before


def test_a_clipped_relu_replaced_by_the_write_back_passes_the_write_back_check():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU6(), torch.nn.Linear(4, 2)).eval()
    report = pathir.app.checks.check(net, input_shape=(3,))  # the ClippedReLU's new threshold buffer was a KeyError
    assert report.passed, str(report)


def test_a_self_check_compile_skipped_is_reported_skipped_not_passed():
    """A float32 forward that overflows (weights 1e30): compile skips its self-check with a warning, and `check`
    said 'ok self-check: the IR's forward matches the model's own'."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with torch.no_grad():
        net[0].weight.fill_(1e30), net[2].weight.fill_(1e30)
    report = pathir.app.checks.check(net, input_shape=(3,))
    first = report.checks[0]
    assert (first.name, first.passed) == ("self-check", None) and "not finite" in first.detail


def test_the_write_back_check_runs_an_onnx_file_at_its_fixed_batch(tmp_path):
    """torch.onnx.export's default input is (1, ...): the check fed a batch of 2, onnxruntime refused it, and the
    write-back check was 'skipped' under 'all checks hold'."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
    path = str(tmp_path / "fixed.onnx")
    torch.onnx.export(net, torch.randn(1, 3), path, dynamo=False)
    report = pathir.app.checks.check(path)
    write_back = next(c for c in report.checks if c.name == "rescaling write-back")
    assert write_back.passed is True, write_back.detail
