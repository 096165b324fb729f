"""Bad ONNX input: one clear message (naming the node and op type where there is
one), a non-zero exit code from the CLI, no output file, the source untouched."""

import importlib.util

import numpy as np
import pytest
import torch
from onnx_cases import export, exported, make_model, node, tensor_info

import pathir
from pathir.app.cli import main
from pathir.errors import PathirError

rng = np.random.default_rng(0)


def _cli(capsys, *args):
    """(exit code, stderr) of ``pathir ARGS``."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def _one_layer(op: str, opset: int = 17, **attrs):
    """x -> Conv -> Relu -> OP -> Conv -> y, the op named 'the_op'."""
    return make_model(
        [node("Conv", ["x", "W"], ["h"], "conv"), node("Relu", ["h"], ["r"], "relu"),
         node(op, ["r"], ["s"], "the_op", **attrs), node("Conv", ["s", "V"], ["y"], "head")],
        [tensor_info("x", ["N", 3, 4, 4])], [tensor_info("y", ["N", 2, 4, 4])],
        {"W": rng.normal(size=(4, 3, 1, 1)), "V": rng.normal(size=(2, 4, 1, 1))}, opset)


def _layer_norm():
    return make_model(
        [node("Gemm", ["x", "W"], ["h"], "fc", transB=1),
         node("LayerNormalization", ["h", "g", "b"], ["n"], "the_op"), node("Relu", ["n"], ["y"], "relu")],
        [tensor_info("x", ["N", 3])], [tensor_info("y", ["N", 4])],
        {"W": rng.normal(size=(4, 3)), "g": np.ones(4), "b": np.zeros(4)})


def _attention():
    return make_model(
        [node("Gemm", ["x", "W"], ["h"], "fc", transB=1), node("Reshape", ["h", "shape"], ["q"], "reshape"),
         node("Attention", ["q", "q", "q"], ["a"], "the_op"), node("Relu", ["a"], ["y"], "relu")],
        [tensor_info("x", ["N", 4])], [tensor_info("y", ["N", 1, 2, 2])],
        {"W": rng.normal(size=(4, 4)), "shape": np.array([-1, 1, 2, 2], dtype=np.int64)}, opset=23)


UNSUPPORTED = {
    "Sigmoid": lambda: _one_layer("Sigmoid"),
    "Tanh": lambda: _one_layer("Tanh"),
    "Gelu": lambda: _one_layer("Gelu", opset=20),
    "Softmax": lambda: _one_layer("Softmax", axis=1),
    "Clip": lambda: _one_layer("Clip", opset=6, min=-1.0, max=1.0),  # (with no bounds it is the identity)
    "LayerNormalization": _layer_norm,
    "Attention": _attention,
}


@pytest.mark.parametrize("op", sorted(UNSUPPORTED))
def test_unsupported_op_names_node_op_and_reason(op, tmp_path, capsys):
    model = UNSUPPORTED[op]()
    before = model.SerializeToString()
    with pytest.raises(pathir.UnsupportedOperation) as info:
        pathir.compile(model)
    err = info.value
    assert (err.node, err.op) == ("the_op", op)
    assert err.why and "'the_op'" in str(err) and f"op {op}" in str(err)
    assert model.SerializeToString() == before
    path = tmp_path / "m.onnx"
    path.write_bytes(before)
    code, stderr = _cli(capsys, "summary", path)
    assert code != 0 and stderr.count("\n") == 1 and "'the_op'" in stderr and op in stderr


@pytest.mark.parametrize("layer,op", [(torch.nn.Hardtanh(-1.0, 1.0), "Clip"), (torch.nn.Sigmoid(), "Sigmoid"),
                                      (torch.nn.Tanh(), "Tanh"), (torch.nn.Softmax(dim=1), "Softmax")])
def test_unsupported_layers_exported_from_torch(layer, op):
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), layer, torch.nn.Linear(4, 2))
    proto = export(net, (3,), "legacy")
    with pytest.raises(pathir.UnsupportedOperation) as info:
        pathir.compile(proto)
    names = {n.name: n.op_type for n in proto.graph.node}
    assert info.value.op == op and names[info.value.node] == op


def test_gelu_exported_from_torch_names_the_first_node_outside_the_model():
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.GELU(), torch.nn.Linear(4, 2))
    proto = export(net, (3,), "legacy")
    with pytest.raises(pathir.UnsupportedOperation) as info:
        pathir.compile(proto)
    names = {n.name: n.op_type for n in proto.graph.node}
    assert names[info.value.node] == info.value.op != "Gemm"


def test_missing_file(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="no such file") as err:
        pathir.compile(str(tmp_path / "nope.onnx"))
    assert isinstance(err.value, pathir.PathirError)  # one error family, and the builtin for code that expects it
    code, stderr = _cli(capsys, "summary", tmp_path / "nope.onnx")
    assert code != 0 and "no such file" in stderr


def _bad_files(tmp_path):
    good = exported("mlp", "legacy")[2].SerializeToString()
    files = {
        "truncated": good[: len(good) // 2],
        "truncated_near_end": good[:-3],
        "random_bytes": rng.integers(0, 256, size=2000, dtype=np.uint8).tobytes(),
        "text": b"this is not an onnx model\n",
        "empty": b"",
    }
    paths = {}
    for name, data in files.items():
        paths[name] = tmp_path / f"{name}.onnx"
        paths[name].write_bytes(data)
    paths["numpy"] = tmp_path / "array.npy"
    np.save(paths["numpy"], np.ones(5))
    return paths


def test_truncated_corrupt_or_not_onnx(tmp_path):
    for kind, path in _bad_files(tmp_path).items():
        with pytest.raises(PathirError, match=r"ONNX model") as info:
            pathir.compile(str(path))
        assert path.name in str(info.value), kind
        with pytest.raises(PathirError):
            pathir.compile(path.read_bytes())
        assert main(["summary", str(path)]) != 0, kind


def test_not_a_model_object():
    from pathir.frontends.onnx import lower

    with pytest.raises(PathirError, match="expected an ONNX path"):
        lower(12)


def test_dynamic_spatial_size_needs_an_input_shape(tmp_path, capsys):
    model = make_model([node("Conv", ["x", "W"], ["h"], "conv"), node("Relu", ["h"], ["y"], "relu")],
                       [tensor_info("x", ["N", 3, "H", "W"])], [tensor_info("y", ["N", 4, "H", "W"])],
                       {"W": rng.normal(size=(4, 3, 1, 1))})
    with pytest.raises(PathirError, match=r"input 'x' .* dynamic size \[N, 3, H, W\].*input_shape"):
        pathir.compile(model)
    with pytest.raises(PathirError, match="has 2 sizes"):
        pathir.compile(model, input_shape=(3, 5))
    assert pathir.compile(model, input_shape=(3, 5, 6)).graph.node("relu").shape == (4, 5, 6)
    path = tmp_path / "dyn.onnx"
    path.write_bytes(model.SerializeToString())
    code, stderr = _cli(capsys, "summary", path)
    assert code != 0 and "input_shape" in stderr
    assert _cli(capsys, "summary", path, "--input-shape", "3,5,6")[0] == 0


def test_given_input_shape_must_agree_with_static_sizes():
    _, _, proto = exported("mlp", "legacy")
    with pytest.raises(PathirError, match="disagrees"):
        pathir.compile(proto, input_shape=(6,))


def test_output_not_reached_by_the_relu_dag():
    model = make_model(
        [node("Gemm", ["x", "W"], ["h"], "fc", transB=1), node("Relu", ["h"], ["y"], "relu"),
         node("Shape", ["h"], ["size"], "shape")],
        [tensor_info("x", ["N", 3])],
        [tensor_info("y", ["N", 4]), onnx_int_info("size", [2])],
        {"W": rng.normal(size=(4, 3))})
    with pytest.raises(PathirError, match=r"output 'size' .* does not depend on the input"):
        pathir.compile(model)


def test_returning_the_input_unchanged():
    model = make_model(
        [node("Gemm", ["x", "W"], ["h"], "fc", transB=1), node("Relu", ["h"], ["y"], "relu"),
         node("Identity", ["x"], ["same"], "copy")],
        [tensor_info("x", ["N", 3])], [tensor_info("y", ["N", 4]), tensor_info("same", ["N", 3])],
        {"W": rng.normal(size=(4, 3))})
    with pytest.raises(pathir.UnsupportedOperation, match="input unchanged"):
        pathir.compile(model)


def test_training_mode_batchnorm_and_product_of_activations():
    bn = make_model(
        [node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"], "bn", training_mode=1)],
        [tensor_info("x", ["N", 2, 3])], [tensor_info("y", ["N", 2, 3])],
        {"s": np.ones(2), "b": np.zeros(2), "m": np.zeros(2), "v": np.ones(2)}, opset=15)
    with pytest.raises(pathir.UnsupportedOperation, match="training"):
        pathir.compile(bn)
    mul = make_model([node("Relu", ["x"], ["r"], "relu"), node("Mul", ["r", "r"], ["y"], "square")],
                     [tensor_info("x", ["N", 3])], [tensor_info("y", ["N", 3])])
    with pytest.raises(pathir.UnsupportedOperation) as info:
        pathir.compile(mul)
    assert (info.value.node, info.value.op) == ("square", "Mul")


@pytest.mark.parametrize("stats", [(2,), (2, 3)])
def test_per_element_batchnorm_of_opset_7_is_refused_by_name(stats):
    """spatial=0 normalizes each element with its own statistics (onnxruntime refuses (C,) statistics for a
    3-d input): refused naming the attribute, where (C,) statistics were read as the per-channel form."""
    s = {k: np.full(stats, 1.5) for k in "sbmv"}
    bn = make_model([node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], "bn", spatial=0)],
                    [tensor_info("x", ["N", 2, 3])], [tensor_info("y", ["N", 2, 3])], s, opset=7)
    with pytest.raises(pathir.UnsupportedOperation, match="spatial=0"):
        pathir.compile(bn, self_check=False)
    flat = make_model([node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], "bn", spatial=0)],
                      [tensor_info("x", ["N", 2])], [tensor_info("y", ["N", 2])],
                      {k: np.full(2, 1.5) for k in "sbmv"}, opset=7)
    pathir.compile(flat)  # on (N, C) per element is per channel: checked against onnxruntime


def onnx_int_info(name, shape):
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, TensorProto.INT64, shape)


# ------------------------------------------------------------------ no output file


@pytest.mark.parametrize("command,extra", [("pathcond", []), ("enorm", []), ("prune", ["--amount", "0.5"])])
def test_failing_commands_write_no_output_file(command, extra, tmp_path, capsys):
    if importlib.util.find_spec(f"pathir.app.commands.{command}") is None:
        pytest.skip(f"the '{command}' command is not written yet")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(UNSUPPORTED["Sigmoid"]().SerializeToString())
    out = tmp_path / "out.onnx"
    code, stderr = _cli(capsys, command, bad, "-o", out, *extra)
    assert code != 0 and "'the_op'" in stderr
    code, _ = _cli(capsys, command, tmp_path / "missing.onnx", "-o", out, *extra)
    assert code != 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.onnx"]


def test_save_failure_leaves_no_file(tmp_path, monkeypatch):
    cm = pathir.compile(exported("mlp", "legacy")[2])
    with pytest.raises(OSError):
        cm.save(tmp_path / "missing_dir" / "out.onnx")
    assert not (tmp_path / "missing_dir").exists()

    class Boom(Exception):
        pass

    def fail(*a, **k):
        raise Boom()

    monkeypatch.setattr("os.replace", fail)
    with pytest.raises(Boom):
        cm.save(tmp_path / "out.onnx")
    assert list(tmp_path.iterdir()) == []


def test_to_onnx_and_save_need_an_onnx_model():
    cm = pathir.compile(torch.nn.Sequential(torch.nn.Linear(2, 2)), input_shape=(2,))
    with pytest.raises(PathirError, match="compiled from ONNX"):
        cm.to_onnx()
    with pytest.raises(PathirError, match="compiled from ONNX"):
        cm.save("never.onnx")


def test_a_resize_whose_constant_sizes_fix_a_dynamic_batch_is_refused_by_that_reason():
    """sizes[0] = 2 equals the batch pathir walks at: the batch check passed, and the self-check failed as a
    'pathir bug' (with self_check=False a path-norm came back for a model with no per-sample function)."""
    model = make_model(
        [node("Conv", ["x", "W"], ["h"], "conv"), node("Relu", ["h"], ["r"], "relu"),
         node("Resize", ["r", "", "", "sz"], ["s"], "the_op", mode="nearest"), node("Conv", ["s", "V"], ["y"], "head")],
        [tensor_info("x", ["N", 3, 4, 4])], [tensor_info("y", [2, 2, 8, 8])],
        {"W": rng.normal(size=(4, 3, 1, 1)), "V": rng.normal(size=(2, 4, 1, 1)), "sz": np.array([2, 4, 8, 8], np.int64)})
    for self_check in (True, False):
        with pytest.raises(pathir.UnsupportedOperation, match="sizes fix the batch axis at 2 while the model's batch is dynamic"):
            pathir.compile(model, self_check=self_check)


def test_an_if_whose_branch_reads_an_activation_is_refused_as_control_flow():
    """The producer of the outer name the branch reads was taken for dead: 'reads h, which no node provides'."""
    from onnx import helper, numpy_helper

    then_g = helper.make_graph([helper.make_node("Relu", ["h"], ["t"])], "then", [], [tensor_info("t", ["N", 4])])
    else_g = helper.make_graph([helper.make_node("Neg", ["h"], ["e"])], "else", [], [tensor_info("e", ["N", 4])])
    model = make_model(
        [node("Gemm", ["x", "W"], ["h"], "fc", transB=1),
         node("If", ["cond"], ["r"], "the_if", then_branch=then_g, else_branch=else_g),
         node("Gemm", ["r", "V"], ["y"], "head", transB=1)],
        [tensor_info("x", ["N", 3])], [tensor_info("y", ["N", 2])],
        {"W": rng.normal(size=(4, 3)), "V": rng.normal(size=(2, 4)), "cond": np.array(1, np.int64)})
    model.graph.initializer[-1].CopyFrom(numpy_helper.from_array(np.array(True), "cond"))  # (make_model: no bools)
    with pytest.raises(pathir.UnsupportedOperation, match="control flow whose body reads an activation"):
        pathir.compile(model)


def _external(tmp_path, location="model.onnx.data"):
    import onnx

    proto = onnx.ModelProto()
    proto.CopyFrom(exported("mlp", "legacy")[2])
    path = tmp_path / "model.onnx"
    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True, size_threshold=0,
                    location=location)
    return path, tmp_path / location


@pytest.mark.parametrize("location", ["model.onnx.data", "weights.onnx"])
def test_the_output_never_goes_over_the_models_external_data(tmp_path, capsys, location):
    """Only the .onnx file itself was guarded: cm.save onto its data file was written, and the original model
    then computed NaN (the same by the CLI, where the data file's name ends in .onnx)."""
    path, data = _external(tmp_path, location)
    before = data.read_bytes()
    cm = pathir.compile(str(path), progress=False)
    cm.pathcond(progress=False)
    with pytest.raises(PathirError, match="its external tensor data"):
        cm.save(str(data))
    if location.endswith(".onnx"):
        code, stderr = _cli(capsys, "pathcond", path, "-o", data)
        assert code == 2 and "its external tensor data" in stderr
    assert data.read_bytes() == before
    cm.save(str(tmp_path / "out.onnx"))  # elsewhere: written, and the original's data kept
    assert data.read_bytes() == before


def test_a_missing_external_data_file_is_one_pathir_error(tmp_path, capsys):
    path, data = _external(tmp_path)
    data.unlink()
    with pytest.raises(PathirError, match="cannot read its external tensor data"):
        pathir.compile(str(path))
    code, stderr = _cli(capsys, "summary", path)
    assert code == 2 and "external tensor data" in stderr and "Traceback" not in stderr


def test_bytes_or_a_proto_whose_tensors_sit_in_external_files_are_refused(tmp_path, monkeypatch):
    """onnx resolved their data files against the working folder: another model's file of that name was read."""
    import onnx

    path, data = _external(tmp_path)
    want = pathir.compile(str(path)).path_norm(1)
    monkeypatch.chdir(tmp_path)  # where onnx would find the data file by its name
    for given in (path.read_bytes(), onnx.load(str(path), load_external_data=False)):
        with pytest.raises(PathirError, match="keeps its tensors in external files \\(model.onnx.data\\)"):
            pathir.compile(given)
    assert pathir.compile(onnx.load(str(path))).path_norm(1) == pytest.approx(want, rel=1e-12)


def _conv_relu_bn_conv():
    """x → Conv → Relu → BatchNormalization (unfolded: after the ReLU) → Conv → Relu, float32."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    g = np.random.default_rng(0)
    C = 4
    inits = dict(W1=g.normal(size=(C, 3, 3, 3)), b1=g.normal(size=C), W2=g.normal(size=(C, C, 3, 3)), b2=g.normal(size=C),
                 s=g.uniform(.5, 2, C), bb=g.normal(size=C), mean=g.normal(size=C), var=g.uniform(.5, 2, C))
    nodes = [helper.make_node("Conv", ["x", "W1", "b1"], ["c1"], name="conv1", pads=[1] * 4),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("BatchNormalization", ["r1", "s", "bb", "mean", "var"], ["n1"], name="bn", epsilon=1e-5),
             helper.make_node("Conv", ["n1", "W2", "b2"], ["c2"], name="conv2", pads=[1] * 4),
             helper.make_node("Relu", ["c2"], ["y"], name="relu2")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", C, 6, 6])],
                              [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()])
    return onnx.helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])


def test_an_onnx_running_variance_that_would_cancel_in_float32_is_refused():
    """var' = λ²(var + eps) − eps was written whatever λ: at λ² = e^-22 it cancelled to about −eps in float32
    (onnxruntime's output 4e-4 off), as the torch writer already refused."""
    model = _conv_relu_bn_conv()
    for z0, ok in ((-2.0, True), (-22.0, False)):
        cm = pathir.compile(model, progress=False)
        z = np.array([z0 if u.name.startswith("W1:") else 0.0 for u in cm.units])
        before = cm.to_onnx().SerializeToString()
        if ok:
            cm.commit_rescaling(z)
        else:
            with pytest.raises(PathirError, match="running variance is 'var'.*eps dominates"):
                cm.commit_rescaling(z)
            assert cm.to_onnx().SerializeToString() == before
    cm = pathir.compile(model, progress=False)
    assert cm.rescaled_variance_ratio() is not None  # the default bound sees ONNX's unfolded batch-norms too


def test_check_counts_a_clips_bounds_as_read():
    """A Clip's bounds as initializers (as torch.onnx.export(dynamo=True) writes ReLU6): the threshold is the graph's
    `<node>.threshold` bias and the lower bound its ReLU, yet `pathir check` listed both "not reached: no output of
    the graph depends on it". An initializer nothing reads is still listed."""
    import pathir.app.checks

    rng = np.random.default_rng(0)
    nodes = [node("Conv", ["x", "w1", "b1"], ["c"], pads=[1, 1, 1, 1]), node("Clip", ["c", "lo", "hi"], ["r"]),
             node("Conv", ["r", "w2"], ["y"])]
    inits = {"w1": rng.normal(size=(3, 2, 3, 3)), "b1": rng.normal(size=3), "lo": np.float32(0.0),
             "hi": np.float32(6.0), "w2": rng.normal(size=(2, 3, 1, 1)), "unused": rng.normal(size=4)}
    proto = make_model(nodes, [tensor_info("x", ["n", 2, 5, 5])], [tensor_info("y", ["n", 2, 5, 5])], inits)
    report = pathir.app.checks.check(proto)
    assert [name for name, _, _ in report.not_reached] == ["unused"]
    assert report.covered == report.model_params - 4


def test_tile_along_the_batch_axis_is_named():
    """Tile repeating the batch axis is named as that (the message said the batch axis had moved)."""
    tile = make_model([node("Relu", ["x"], ["r"], "relu"), node("Tile", ["r", "reps"], ["y"], "tile")],
                      [tensor_info("x", ["N", 3])], [tensor_info("y", ["M", 3])],
                      {"reps": np.array([2, 1], dtype=np.int64)})
    with pytest.raises(pathir.UnsupportedOperation, match="repeats the batch axis 2 times") as info:
        pathir.compile(tile)
    assert (info.value.node, info.value.op) == ("tile", "Tile")


def test_a_reshape_that_fixes_the_batch_of_a_dynamic_file_says_so():
    """Reshape to [1, 3] on an input of batch "N": refused with a raw numpy error about pathir's own trial batch
    ("cannot reshape array of size 6 into shape (1,3)", ONNX review); it says the shape fixes the batch now."""
    rng = np.random.default_rng(0)
    model = make_model(
        [node("Gemm", ["x", "W"], ["h"], "fc", transB=1), node("Relu", ["h"], ["r"], "relu"),
         node("Reshape", ["r", "s"], ["y"], "rr")],
        [tensor_info("x", ["N", 4])], [tensor_info("y", [1, 3])],
        {"W": rng.normal(size=(3, 4)), "s": np.array([1, 3], dtype=np.int64)})
    with pytest.raises(PathirError, match=r"its shape \[1, 3\] fixes the batch axis at 1 while the model's "
                                                   "batch is dynamic"):
        pathir.compile(model)
