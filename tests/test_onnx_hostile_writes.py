"""ONNX write-backs and files at their edges: an output holding its batch on axis 1 checked as such,
a model onnxruntime loads but will not run, an initializer callers may override, and paths pathir must
not write (its own input, a folder, a missing folder)."""

import hashlib
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as H
from onnx import numpy_helper as NH

import pathir
from pathir.app.cli import main
from pathir.errors import PathirError


def _save(tmp_path, graph, name="model.onnx", **kw):
    path = str(tmp_path / name)
    onnx.save(H.make_model(graph, opset_imports=[H.make_opsetid("", 17)], **kw), path)
    return path


def _mlp(W1, W2, inputs=(), gemm_first=True):
    nodes = [H.make_node("Gemm", ["x", "W1"], ["h"], name="g1", transB=1), H.make_node("Relu", ["h"], ["r"], name="relu"),
             H.make_node("Gemm", ["r", "W2"], ["y"], name="g2", transB=1)]
    return H.make_graph(nodes, "g", [H.make_tensor_value_info("x", TP.FLOAT, ["N", W1.shape[1]]), *inputs],
                        [H.make_tensor_value_info("y", TP.FLOAT, ["N", W2.shape[0]])],
                        [NH.from_array(W1, "W1"), NH.from_array(W2, "W2")])


def _spread_weights(seed=0, out=3):
    rng = np.random.default_rng(seed)
    W1 = (rng.normal(size=(8, 4)) * np.logspace(-2, 1.5, 8)[:, None]).astype(np.float32)
    return W1, rng.normal(size=(out, 8)).astype(np.float32)


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_a_square_output_with_its_batch_on_axis_1_passes_the_self_check_and_keeps_its_function(tmp_path):
    rng = np.random.default_rng(0)
    W1, W2 = rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(3, 8)).astype(np.float32)
    nodes = [H.make_node("Gemm", ["W1", "x"], ["h"], name="g1", transB=1), H.make_node("Relu", ["h"], ["r"], name="relu"),
             H.make_node("MatMul", ["W2", "r"], ["y"], name="mm")]  # y = W2 relu(W1 xᵀ): [3, N], 3 features
    graph = H.make_graph(nodes, "g", [H.make_tensor_value_info("x", TP.FLOAT, ["N", 4])],
                         [H.make_tensor_value_info("y", TP.FLOAT, [3, "N"])], [NH.from_array(W1, "W1"), NH.from_array(W2, "W2")])
    src = _save(tmp_path, graph)
    cm = pathir.compile(src)  # the self-check's batch is 3 too: the output reads as square
    cm.equalize(progress=False)
    cm.save(str(tmp_path / "eq.onnx"))
    x = rng.normal(size=(3, 4)).astype(np.float32)
    runs = [ort.InferenceSession(p, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
            for p in (src, str(tmp_path / "eq.onnx"))]
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-5, atol=1e-5 * np.abs(runs[0]).max())


def test_a_model_onnxruntime_loads_but_will_not_run_skips_the_self_check_with_the_reason(tmp_path):
    W = np.random.default_rng(0).normal(size=(2, 1, 3, 3)).astype(np.float32)
    graph = H.make_graph([H.make_node("Conv", ["x", "W"], ["c"], dilations=[2, 2], auto_pad="SAME_UPPER"),
                          H.make_node("Relu", ["c"], ["y"])], "g",
                         [H.make_tensor_value_info("x", TP.FLOAT, ["N", 1, 8, 8])],
                         [H.make_tensor_value_info("y", TP.FLOAT, ["N", 2, 8, 8])], [NH.from_array(W, "W")])
    src = _save(tmp_path, graph)
    with pytest.warns(UserWarning, match="onnxruntime cannot run the model"):
        pathir.compile(src)


def test_an_initializer_callers_may_feed_is_not_rescaled(tmp_path):
    W1, W2 = _spread_weights()
    src = _save(tmp_path, _mlp(W1, W2, [H.make_tensor_value_info("W1", TP.FLOAT, [8, 4])]))
    cm = pathir.compile(src)
    with pytest.raises(PathirError, match="'W1' is also a graph input"):
        cm.equalize(progress=False)
    np.testing.assert_array_equal(NH.to_array(cm.to_onnx().graph.initializer[0]), W1)


@pytest.mark.parametrize("op", ["Identity", "Transpose", "Cast"])
def test_an_initializer_callers_may_feed_is_not_rescaled_through_the_node_that_reads_it(tmp_path, op):
    """W1 -> Identity/Transpose/Cast -> Gemm: the write gave the Gemm a new initializer and left W1 an input no
    node reads, so a caller feeding W1 got another function from the written file (0.47 to 2.6 off)."""
    W1, W2 = _spread_weights()
    src_w = W1.T.copy() if op == "Transpose" else W1
    attrs = {"to": TP.FLOAT} if op == "Cast" else {}
    graph = _mlp(W1, W2, [H.make_tensor_value_info("W1", TP.FLOAT, list(src_w.shape))])
    graph.initializer[0].CopyFrom(NH.from_array(src_w, "W1"))
    graph.node.insert(0, H.make_node(op, ["W1"], ["Wc"], name="via", **attrs))
    graph.node[1].input[1] = "Wc"
    src = _save(tmp_path, graph)
    before = _sha(src)
    cm = pathir.compile(src)
    with pytest.raises(PathirError, match="'W1' is also a graph input"):
        cm.equalize(progress=False)
    assert [n.op_type for n in cm.to_onnx().graph.node] == [op, "Gemm", "Relu", "Gemm"] and _sha(src) == before


def test_a_clip_bound_callers_may_feed_is_not_replaced_silently(tmp_path):
    """The rewrite of a Clip(x, 0, t) whose t moves per channel replaces t by a Min's new initializer: where t
    is also a graph input, a caller feeding it changed the original's clip and no longer the written file's."""
    W1, W2 = _spread_weights()
    nodes = [H.make_node("Gemm", ["x", "W1"], ["h"], name="g1", transB=1),
             H.make_node("Clip", ["h", "zero", "six"], ["r"], name="clip"),
             H.make_node("Gemm", ["r", "W2"], ["y"], name="g2", transB=1)]
    graph = H.make_graph(nodes, "g", [H.make_tensor_value_info("x", TP.FLOAT, ["N", 4]),
                                      H.make_tensor_value_info("six", TP.FLOAT, [])],
                         [H.make_tensor_value_info("y", TP.FLOAT, ["N", 3])],
                         [NH.from_array(W1, "W1"), NH.from_array(W2, "W2"), NH.from_array(np.float32(0), "zero"),
                          NH.from_array(np.float32(6), "six")])
    cm = pathir.compile(_save(tmp_path, graph))
    with pytest.raises(PathirError, match="'six' is also a graph input"):
        cm.equalize(progress=False)
    assert [n.op_type for n in cm.to_onnx().graph.node] == ["Gemm", "Clip", "Gemm"]


@pytest.mark.parametrize("spelling", ["Clip", "Max", "Pad"])
def test_a_constant_read_as_fixed_that_callers_may_feed_refuses_the_write(tmp_path, spelling):
    """A 0 that makes Clip / Max a ReLU, or Pad's value, read as fixed and never written: where it is also a graph
    input, a caller feeding it (0.5) got another function from the written file (4-12 % off: onnx review)."""
    W1, W2 = _spread_weights()
    act = {"Clip": H.make_node("Clip", ["h", "c"], ["r"], name="act"),
           "Max": H.make_node("Max", ["h", "c"], ["r"], name="act"),
           "Pad": H.make_node("Pad", ["h", "pads", "c"], ["p"], name="act")}[spelling]
    nodes = [H.make_node("Gemm", ["x", "W1"], ["h"], name="g1", transB=1), act]
    if spelling == "Pad":  # pad the features with the fed value, then a ReLU and a layer reading the first 8
        nodes += [H.make_node("Relu", ["p"], ["q"]), H.make_node("Slice", ["q", "s0", "s1", "ax"], ["r"])]
    nodes.append(H.make_node("Gemm", ["r", "W2"], ["y"], name="g2", transB=1))
    inits = [NH.from_array(W1, "W1"), NH.from_array(W2, "W2"), NH.from_array(np.float32(0), "c"),
             NH.from_array(np.array([0, 0, 0, 2], np.int64), "pads"), NH.from_array(np.array([0], np.int64), "s0"),
             NH.from_array(np.array([8], np.int64), "s1"), NH.from_array(np.array([1], np.int64), "ax")]
    graph = H.make_graph(nodes, "g", [H.make_tensor_value_info("x", TP.FLOAT, ["N", 4]),
                                      H.make_tensor_value_info("c", TP.FLOAT, [])],
                         [H.make_tensor_value_info("y", TP.FLOAT, ["N", 3])], inits)
    src = _save(tmp_path, graph)
    before = _sha(src)
    cm = pathir.compile(src)
    with pytest.raises(PathirError, match="'c' is also a graph input"):
        cm.pathcond()
    assert _sha(src) == before
    np.testing.assert_array_equal(NH.to_array(cm.to_onnx().graph.initializer[0]), W1)


def test_the_cli_and_save_never_write_over_their_input(tmp_path, capsys):
    W1, W2 = _spread_weights()
    src = _save(tmp_path, _mlp(W1, W2))
    before = _sha(src)
    for out in (src, os.path.join(str(tmp_path), ".", "model.onnx")):
        assert main(["equalize", src, "-o", out]) == 2
        assert "is the input file" in capsys.readouterr().err
    cm = pathir.compile(src)
    cm.equalize(progress=False)
    with pytest.raises(PathirError, match="compiled from"):
        cm.save(src)
    assert _sha(src) == before


def test_save_names_the_path_it_was_given(tmp_path):
    W1, W2 = _spread_weights()
    cm = pathir.compile(_save(tmp_path, _mlp(W1, W2)))
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        cm.save(str(tmp_path / "no_such_dir" / "eq.onnx"))
    with pytest.raises(IsADirectoryError, match="is a folder"):
        cm.save(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["model.onnx"]


def test_weights_naming_a_folder_says_so(tmp_path, capsys):
    assert main(["summary", "resnet18", "--weights", str(tmp_path)]) == 2
    assert "names a folder" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["constant", "initializer"])
def test_a_sparse_weight_is_refused_by_name(tmp_path, how):
    """A MatMul weight from Constant(sparse_value=...) crashed with a raw TypeError (onnxruntime runs it); one in
    graph.sparse_initializer failed in shape inference ("Input tensors of wrong rank (0)")."""
    rng = np.random.default_rng(0)
    W = rng.normal(size=(4, 3)).astype(np.float32)
    W[np.abs(W) < 0.7] = 0
    at = np.flatnonzero(W)

    def sparse(name):
        return H.make_sparse_tensor(NH.from_array(W.ravel()[at], name), NH.from_array(at.astype(np.int64), name + "_i"),
                                    [4, 3])

    nodes = [H.make_node("MatMul", ["x", "Wk"], ["h"], name="mm"), H.make_node("Relu", ["h"], ["y"], name="relu")]
    if how == "constant":
        nodes.insert(0, H.make_node("Constant", [], ["Wk"], name="kw", sparse_value=sparse("v")))
    graph = H.make_graph(nodes, "g", [H.make_tensor_value_info("x", TP.FLOAT, ["N", 4])],
                         [H.make_tensor_value_info("y", TP.FLOAT, ["N", 3])],
                         sparse_initializer=[sparse("Wk")] if how == "initializer" else None)
    with pytest.raises(PathirError, match="sparse_value" if how == "constant" else "sparse initializers"):
        pathir.compile(_save(tmp_path, graph, ir_version=8))


def _appended_channels(block, tmp_path):
    """conv(x) with ``block`` (Expand of a (1, 1, 1, 1) constant to [N, 2, 5, 5]) appended on the channels, ReLU,
    Flatten, Gemm; its l1 path-norm by the definition (the |θ| network on ones, the block as it is)."""
    rng = np.random.default_rng(0)
    W1, b1 = rng.normal(size=(4, 2, 3, 3)).astype(np.float32), rng.normal(size=4).astype(np.float32)
    W2, b2 = rng.normal(size=(3, 150)).astype(np.float32), rng.normal(size=3).astype(np.float32)
    ints = lambda name, v: NH.from_array(np.array(v, np.int64), name)
    nodes = [H.make_node("Conv", ["x", "W1", "b1"], ["c"], pads=[1, 1, 1, 1]), H.make_node("Shape", ["c"], ["sh"]),
             H.make_node("Slice", ["sh", "s0", "s1"], ["n"]), H.make_node("Concat", ["n", "rest"], ["to"], axis=0),
             H.make_node("Expand", ["z", "to"], ["zz"]), H.make_node("Concat", ["c", "zz"], ["k"], axis=1, name="cat"),
             H.make_node("Relu", ["k"], ["r"]), H.make_node("Flatten", ["r"], ["f"]),
             H.make_node("Gemm", ["f", "W2", "b2"], ["y"], transB=1)]
    graph = H.make_graph(nodes, "g", [H.make_tensor_value_info("x", TP.FLOAT, ["N", 2, 5, 5])],
                         [H.make_tensor_value_info("y", TP.FLOAT, ["N", 3])],
                         [NH.from_array(W1, "W1"), NH.from_array(b1, "b1"), ints("s0", [0]), ints("s1", [1]),
                          ints("rest", [2, 5, 5]), NH.from_array(np.full((1, 1, 1, 1), block, np.float32), "z"),
                          NH.from_array(W2, "W2"), NH.from_array(b2, "b2")])
    ones = np.ones((2, 5, 5))
    padded = np.pad(ones, ((0, 0), (1, 1), (1, 1)))
    conv = np.array([[[np.sum(np.abs(W1[o]) * padded[:, i:i + 3, j:j + 3]) for j in range(5)] for i in range(5)]
                     for o in range(4)]) + np.abs(b1)[:, None, None]
    hidden = np.concatenate([conv, np.zeros((2, 5, 5))]).ravel()
    return _save(tmp_path, graph), float(np.sum(np.abs(W2) @ hidden + np.abs(b2)))


def test_constant_zeros_concatenated_to_an_activation_are_no_elements_and_written_back(tmp_path):
    """Concat(conv, zeros) was refused: "the op computes new values instead of moving elements"."""
    src, l1 = _appended_channels(0.0, tmp_path)
    cm = pathir.compile(src)
    assert cm.path_norm(1) == pytest.approx(l1, rel=1e-6)
    x = np.random.default_rng(1).normal(size=(4, 2, 5, 5)).astype(np.float32)
    ref = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(np.asarray(cm.forward(x)), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    cm.pathcond()
    cm.save(str(tmp_path / "pc.onnx"))
    out = ort.InferenceSession(str(tmp_path / "pc.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_a_non_zero_constant_concatenated_to_an_activation_is_refused_as_a_fixed_value(tmp_path):
    src, _ = _appended_channels(0.5, tmp_path)
    with pytest.raises(PathirError, match="constant that is not 0"):
        pathir.compile(src)


def test_where_over_a_bool_initializer_compiles_without_a_torch_warning(tmp_path):
    """torch.from_numpy on the read-only array of an ONNX initializer warned on every compile."""
    import warnings

    rng = np.random.default_rng(0)
    nodes = [H.make_node("Conv", ["x", "W1"], ["c"], pads=[1, 1, 1, 1]), H.make_node("Where", ["cd", "c", "z"], ["k"]),
             H.make_node("Relu", ["k"], ["y"])]
    graph = H.make_graph(nodes, "g", [H.make_tensor_value_info("x", TP.FLOAT, ["N", 2, 4, 4])],
                         [H.make_tensor_value_info("y", TP.FLOAT, ["N", 4, 4, 4])],
                         [NH.from_array(rng.normal(size=(4, 2, 3, 3)).astype(np.float32), "W1"),
                          NH.from_array(rng.random((4, 4, 4)) < 0.5, "cd"), NH.from_array(np.float32(0), "z")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pathir.compile(_save(tmp_path, graph))


@pytest.mark.parametrize("dynamo", [False, True], ids=["legacy", "dynamo"])
def test_an_exported_minus_inf_padding_before_a_max_pool_is_the_pools_padding(tmp_path, dynamo):
    """Pad(value=-inf) then MaxPool (timm's MaxPool2dSame exported) was refused as a fixed non-zero pad value."""
    import io

    import torch
    from test_capture_coverage import SamePool

    torch.manual_seed(0)
    model = SamePool().eval()
    buf = io.BytesIO()
    torch.onnx.export(model, (torch.randn(1, 2, 8, 8),), buf, input_names=["x"], dynamo=dynamo,
                      **({} if dynamo else {"dynamic_axes": {"x": {0: "N"}}}))
    proto = onnx.load_from_string(buf.getvalue())
    assert "Pad" in [n.op_type for n in proto.graph.node]
    cm = pathir.compile(proto)
    assert cm.path_norm(1) == pytest.approx(pathir.compile(model.double(), input_shape=(2, 8, 8)).path_norm(1), rel=1e-6)
    x = np.random.default_rng(0).normal(size=(1, 2, 8, 8)).astype(np.float32)
    ref = ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(np.asarray(cm.forward(x)), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("dynamo", [False, True], ids=["legacy", "dynamo"])
def test_an_exported_relu_rnn_from_a_zero_state_reads_as_the_torch_model(tmp_path, dynamo):
    """U @ zeros(N, H) folds to zeros whose shape follows the batch: refused as "computed from the batch size"."""
    import io

    import torch
    from test_capture_coverage import UnrolledRNN

    torch.manual_seed(0)
    model = UnrolledRNN().eval()
    buf = io.BytesIO()
    torch.onnx.export(model, (torch.randn(2, 4, 3),), buf, input_names=["x"], dynamo=dynamo,
                      **({} if dynamo else {"dynamic_axes": {"x": {0: "N"}}}))
    cm, ref = pathir.compile(onnx.load_from_string(buf.getvalue())), pathir.compile(model.double(), input_shape=(4, 3))
    for q in (1, 2):
        assert cm.path_norm(q) == pytest.approx(ref.path_norm(q), rel=1e-6)
