"""The ONNX frontend: models exported from torch inside the test run (both
exporters) and hand-built graphs compile, and the IR's forward equals
onnxruntime's (float64 IR vs float32 ORT: relative error <= 1e-5) and torch's."""

import numpy as np
import pytest
import torch
from onnx_cases import (
    MODELS,
    UNFOLDED,
    export,
    exported,
    fresh_bn_convnet,
    make_model,
    node,
    ort_run,
    rel,
    tensor_info,
)

import pathir
from pathir.backends import available_backends
from pathir.errors import PathirError
from pathir.ir import MapKind, NodeKind, Role

BACKENDS = [b for b in ("numpy", "torch") if b in available_backends()]
DYNAMO = ["residual", "pools_include_pad", "pools_exclude_pad", "concat", "shuffle", "bn_mlp"]
CASES = (
    [(m, e) for m in MODELS for e in ("legacy", "legacy-nofold")]
    + [(m, "dynamo") for m in DYNAMO]
    + [(m, "dynamo-noopt") for m in ("residual", "shuffle")]
)
rng = np.random.default_rng(0)


def _ir_forward(cm, x, backend):
    out = cm.forward(np.asarray(x, dtype=np.float64), backend=backend)
    return out.cpu().numpy() if isinstance(out, torch.Tensor) else np.asarray(out)


@pytest.mark.parametrize("name,exporter", CASES)
def test_forward_equals_onnxruntime_and_torch(name, exporter):
    model, shape, proto = exported(name, exporter)
    cm = pathir.compile(proto)
    x = rng.normal(size=(4, *shape)).astype(np.float32)
    ref = ort_run(proto, x)[0]
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    for backend in BACKENDS:
        out = _ir_forward(cm, x, backend)
        assert rel(out, ref) <= 1e-5, backend
        assert rel(out, expected) <= 1e-5, backend


@pytest.mark.parametrize("name,exporter", [(m, e) for m, e in CASES if e in UNFOLDED])
def test_same_graph_and_path_quantities_as_the_torch_frontend(name, exporter):
    model, shape, proto = exported(name, exporter)
    cm, ct = pathir.compile(proto), pathir.compile(model, input_shape=shape)
    layout = lambda g: [(n.kind, n.shape, sorted(e.map.kind.value for e in n.edges), n.bias is not None) for n in g]
    if name != "shuffle":  # torch.fx counts x.shape as a reader of x (one more node); ONNX Shape reads no data
        assert layout(cm.graph) == layout(ct.graph)
    assert cm.source_num_params == ct.source_num_params == sum(p.numel() for p in model.parameters())
    for q in (1, 2):
        assert cm.path_norm(q) == pytest.approx(ct.path_norm(q), rel=1e-9)
    assert cm.num_paths() == pytest.approx(ct.num_paths(), rel=1e-12)
    g_onnx, g_torch = cm.diag_g(backend="numpy"), ct.diag_g(backend="numpy")
    assert set(g_onnx) == set(g_torch)
    for k in g_torch:
        np.testing.assert_allclose(g_onnx[k], g_torch[k], rtol=1e-9, atol=1e-300, err_msg=k)


def test_params_are_named_and_bound_by_initializer():
    _, _, proto = exported("residual", "legacy-nofold")
    cm = pathir.compile(proto)
    inits = {t.name for t in proto.graph.initializer}
    conv2 = next(p for p in cm.graph.params() if p.name == "conv2.weight")
    # bn2 folded into conv2: the batch-norm affine takes the out-factor of a rescaling
    assert [(r.name, r.role) for r in conv2.sources] == [
        ("conv2.weight", Role.VALUE), ("bn2.weight", Role.OUT_SCALE), ("bn2.bias", Role.OUT_SCALE)]
    assert all(r.name in inits for p in cm.graph.params() for r in p.sources)
    origins = {n.origin for n in cm.graph if n.kind is not NodeKind.INPUT}
    assert any("(Relu)" in o for o in origins) and any("(Gemm)" in o for o in origins)


def test_symbolic_batch_and_shape_arithmetic_before_reshape():
    model, shape, proto = exported("pools_include_pad", "legacy", dynamic_batch=True)
    ops = {n.op_type for n in proto.graph.node}
    assert {"Shape", "Gather", "Unsqueeze", "Concat", "Reshape"} <= ops  # x.reshape(x.size(0), -1)
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param
    cm = pathir.compile(proto)
    x = rng.normal(size=(5, *shape)).astype(np.float32)
    assert rel(_ir_forward(cm, x, "numpy"), ort_run(proto, x)[0]) <= 1e-5


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_symbolic_batch_from_both_exporters(exporter):
    _, shape, proto = exported("shuffle", exporter, dynamic_batch=True)
    cm = pathir.compile(proto)
    x = rng.normal(size=(3, *shape)).astype(np.float32)
    assert rel(_ir_forward(cm, x, "numpy"), ort_run(proto, x)[0]) <= 1e-5


def test_path_bytes_and_modelproto_give_one_graph_and_the_source_is_untouched(tmp_path):
    _, _, proto = exported("concat", "legacy-nofold")
    before = proto.SerializeToString()
    path = tmp_path / "concat.onnx"
    path.write_bytes(before)
    graphs = [str(pathir.compile(m).graph).split("\n", 1)[1] for m in (proto, before, str(path), path)]
    assert len(set(graphs)) == 1
    assert proto.SerializeToString() == before and path.read_bytes() == before


def test_fresh_batchnorms_deduplicated_by_the_exporter():
    # the legacy exporter shares equal initializers (fresh gamma = running_var = 1)
    # through Identity nodes; each still lowers to its own source tensor
    proto = export(fresh_bn_convnet(), (3, 6, 6), "legacy-nofold")
    assert any(n.op_type == "Identity" for n in proto.graph.node)
    cm = pathir.compile(proto)
    names = {r.name for p in cm.graph.params() for r in p.sources}
    assert {"1.weight", "1.bias", "4.weight", "4.bias"} <= names
    x = rng.normal(size=(2, 3, 6, 6)).astype(np.float32)
    assert rel(_ir_forward(cm, x, "numpy"), ort_run(proto, x)[0]) <= 1e-5


# ------------------------------------------------------------------ hand-built graphs


def _check(model, x, batch_second_output=False, **kw):
    cm = pathir.compile(model, **kw)
    ref = ort_run(model, x)[0]
    out = _ir_forward(cm, x, "numpy")
    assert rel(out.T if batch_second_output else out, ref) <= 1e-5
    return cm


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("c_shape", [(3,), (1, 3), (), None])
def test_gemm_trans_b_alpha_beta_and_broadcast_bias(trans_b, c_shape):
    W = rng.normal(size=(3, 4) if trans_b else (4, 3))
    inits = {"W": W}
    inputs = ["x", "W"]
    if c_shape is not None:
        inits["C"] = rng.normal(size=c_shape)
        inputs.append("C")
    model = make_model(
        [node("Gemm", inputs, ["h"], "fc", alpha=0.5, beta=2.0, transB=trans_b), node("Relu", ["h"], ["y"], "relu")],
        [tensor_info("x", ["N", 4])], [tensor_info("y", ["N", 3])], inits)
    cm = _check(model, rng.normal(size=(5, 4)).astype(np.float32))
    (w,) = [p for p in cm.graph.params() if p.name == "W"]
    np.testing.assert_allclose(w.value, 0.5 * (W if trans_b else W.T).astype(np.float32), rtol=1e-7)
    assert w.sources[0].transposed == (not trans_b)


def test_gemm_with_the_activation_as_b_and_trans_a():
    # h = W1 @ x^T + C1 (batch on axis 1), y = relu(h)^T @ W2 (transA reads it back)
    model = make_model(
        [node("Gemm", ["W1", "x", "C1"], ["h"], "fc1", transB=1), node("Relu", ["h"], ["r"], "relu"),
         node("Gemm", ["r", "W2", "C2"], ["y"], "fc2", transA=1, alpha=1.5)],
        [tensor_info("x", ["N", 4])], [tensor_info("y", ["N", 2])],
        {"W1": rng.normal(size=(6, 4)), "C1": rng.normal(size=(6, 1)), "W2": rng.normal(size=(6, 2)),
         "C2": rng.normal(size=(1, 2))})
    cm = _check(model, rng.normal(size=(5, 4)).astype(np.float32))
    assert [n.kind for n in cm.graph] == [NodeKind.INPUT, NodeKind.RELU, NodeKind.IDENTITY]
    w2 = next(p for p in cm.graph.params() if p.name == "W2")
    assert w2.sources[0].transposed and w2.shape == (2, 6)


def test_gemm_output_with_the_batch_on_axis_1():
    model = make_model(
        [node("Gemm", ["W1", "x", "C1"], ["h"], "fc1", transB=1), node("Relu", ["h"], ["y"], "relu")],
        [tensor_info("x", ["N", 4])], [tensor_info("y", [6, "N"])],
        {"W1": rng.normal(size=(6, 4)), "C1": rng.normal(size=(6, 1))})
    cm = _check(model, rng.normal(size=(5, 4)).astype(np.float32), batch_second_output=True)
    assert cm.writer.outputs == {"y": ("relu", True)}


def test_gemm_contracting_the_batch_is_refused():
    model = make_model([node("Gemm", ["x", "W"], ["y"], "fc", transA=1)],
                       [tensor_info("x", ["N", 4])], [tensor_info("y", [4, 3])], {"W": rng.normal(size=(4, 3))})
    with pytest.raises(pathir.UnsupportedOperation, match="batch axis"):
        pathir.compile(model, input_shape=(4,))


def test_matmul_then_add_with_bias_on_either_side():
    model = make_model(
        [node("MatMul", ["x", "W"], ["h"], "mm"), node("Add", ["h", "b"], ["h2"], "add"), node("Relu", ["h2"], ["r"], "relu"),
         node("MatMul", ["r", "W2"], ["h3"], "mm2"), node("Add", ["c", "h3"], ["y"], "add2")],
        [tensor_info("x", ["N", 4])], [tensor_info("y", ["N", 2])],
        {"W": rng.normal(size=(4, 6)), "b": rng.normal(size=(1, 6)), "W2": rng.normal(size=(6, 2)), "c": np.array(0.7)})
    cm = _check(model, rng.normal(size=(5, 4)).astype(np.float32))
    assert str(cm.graph).splitlines()[2:] == [
        "  1  relu: relu[6] = dense(W)(x) + bias(b)",
        "  2  add2: identity[2] = dense(W2)(relu) + bias(c)",
    ]
    np.testing.assert_allclose(cm.graph.node("add2").bias.value, [0.7, 0.7], rtol=1e-7)


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID", "NOTSET"])
def test_conv_and_pools_with_auto_pad(auto_pad):
    pad = {"pads": [1, 0, 2, 1]} if auto_pad == "NOTSET" else {}
    pool_pad = {"pads": [1, 0, 0, 1]} if auto_pad == "NOTSET" else {}
    model = make_model(
        [node("Conv", ["x", "W", "B"], ["h"], "conv", auto_pad=auto_pad, strides=[2, 2], kernel_shape=[4, 3], **pad),
         node("Relu", ["h"], ["r"], "relu"),
         node("AveragePool", ["r"], ["p"], "avg", auto_pad=auto_pad, kernel_shape=[2, 2], strides=[2, 1], **pool_pad),
         node("MaxPool", ["p"], ["y"], "max", auto_pad=auto_pad, kernel_shape=[2, 2], strides=[1, 1])],
        [tensor_info("x", ["N", 3, 17, 15])], [tensor_info("y", ["N", "c", "h", "w"])],
        {"W": rng.normal(size=(5, 3, 4, 3)), "B": rng.normal(size=(5,))})
    _check(model, rng.normal(size=(2, 3, 17, 15)).astype(np.float32))


@pytest.mark.parametrize("opset", [11, 13])
def test_a_squeeze_without_axes_on_a_dynamic_batch_is_refused_and_with_axes_compiles(opset):
    """Squeeze() removes every axis of size 1: at a batch of 1 the batch axis too (onnxruntime's output (5,), not
    (1, 5)), a function of the batch size that pathir's per-sample graph was silently taken to be."""
    def model(axes):
        extra = {} if axes is None or opset >= 13 else {"axes": axes}
        inputs = ["r"] + (["axes"] if axes is not None and opset >= 13 else [])
        inits = {"W": rng.normal(size=(5, 6)), **({"axes": np.array(axes)} if axes and opset >= 13 else {})}
        return make_model([node("Gemm", ["x", "W"], ["h"], "fc", transB=1), node("Relu", ["h"], ["r"], "relu"),
                           node("Unsqueeze", ["r"] + (["one"] if opset >= 13 else []), ["u"], "un",
                                **({} if opset >= 13 else {"axes": [2]})),
                           node("Squeeze", ["u"] + inputs[1:], ["y"], "sq", **extra)],
                          [tensor_info("x", ["N", 6])], [tensor_info("y", ["N", 5])],
                          {**inits, **({"one": np.array([2])} if opset >= 13 else {})}, opset=opset)
    with pytest.raises(pathir.UnsupportedOperation, match="'sq' \\(op Squeeze\\).*Squeeze without axes"):
        pathir.compile(model(None))
    _check(model([2]), rng.normal(size=(3, 6)).astype(np.float32))


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
def test_a_dilated_pool_with_same_padding_is_refused_by_name(op, auto_pad):
    """onnxruntime pads it as if undilated and sizes its output dilated (a length-6 MaxPool of kernel 2, dilation 2:
    5 outputs, the specification's 6): pathir, which followed the specification, was refused by its own
    self-check as a bug, and without it gave the specification's numbers for a model onnxruntime runs otherwise."""
    model = make_model([node("Relu", ["x"], ["r"], "relu"),
                        node(op, ["r"], ["y"], "pool", kernel_shape=[2], dilations=[2], auto_pad=auto_pad)],
                       [tensor_info("x", ["N", 1, 6])], [tensor_info("y", ["N", 1, "L"])], opset=19)
    for self_check in (True, False):
        with pytest.raises(pathir.UnsupportedOperation, match=rf"'pool' \(op {op}\).*auto_pad {auto_pad} with dilations"):
            pathir.compile(model, self_check=self_check)


@pytest.mark.parametrize("include_pad", [0, 1])
@pytest.mark.parametrize("ceil", [0, 1])
def test_pools_with_dilations_padding_and_ceil_mode(include_pad, ceil):
    model = make_model(
        [node("Conv", ["x", "W"], ["h"], "conv", group=2, dilations=[2, 1], pads=[1, 1, 1, 1]),
         node("Relu", ["h"], ["r"], "relu"),
         node("MaxPool", ["r"], ["m"], "max", kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 1],
              dilations=[1, 2], ceil_mode=ceil),
         node("AveragePool", ["m"], ["y"], "avg", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
              dilations=[2, 1], ceil_mode=ceil, count_include_pad=include_pad)],
        [tensor_info("x", ["N", 4, 13, 12])], [tensor_info("y", ["N", "c", "h", "w"])],
        {"W": rng.normal(size=(6, 2, 3, 3))}, opset=19)
    cm = _check(model, rng.normal(size=(3, 4, 13, 12)).astype(np.float32))
    assert cm.graph.node("conv" if "conv" in cm.graph else "relu").edges[0].map.groups == 2


@pytest.mark.parametrize("opset,keepdims", [(13, 1), (18, 0), (18, 1)])
def test_reduce_mean_over_the_spatial_axes(opset, keepdims):
    axes = {"axes": [2, 3]} if opset < 18 else {}
    inputs = ["r"] if opset < 18 else ["r", "axes"]
    inits = {"W": rng.normal(size=(4, 3, 3, 3))}
    if opset >= 18:
        inits["axes"] = np.array([-1, 2], dtype=np.int64)
    model = make_model(
        [node("Conv", ["x", "W"], ["h"], "conv"), node("Relu", ["h"], ["r"], "relu"),
         node("ReduceMean", inputs, ["y"], "mean", keepdims=keepdims, **axes)],
        [tensor_info("x", ["N", 3, 6, 7])], [tensor_info("y", ["N", 4, 1, 1] if keepdims else ["N", 4])], inits, opset)
    cm = _check(model, rng.normal(size=(2, 3, 6, 7)).astype(np.float32))
    pool = next(e.map for n in cm.graph for e in n.edges if e.map.kind is MapKind.POOL)
    np.testing.assert_allclose(pool.mult, np.full((1, 1), 1 / 20))


def test_dynamic_spatial_size_with_input_shape():
    model = make_model(
        [node("Conv", ["x", "W"], ["h"], "conv", pads=[1, 1, 1, 1]), node("Relu", ["h"], ["r"], "relu"),
         node("GlobalAveragePool", ["r"], ["g"], "gap"), node("Flatten", ["g"], ["f"], "flat"),
         node("Gemm", ["f", "V"], ["y"], "fc", transB=1)],
        [tensor_info("x", ["N", 3, "H", "W"])], [tensor_info("y", ["N", 2])],
        {"W": rng.normal(size=(5, 3, 3, 3)), "V": rng.normal(size=(2, 5))})
    cm = _check(model, rng.normal(size=(2, 3, 7, 5)).astype(np.float32), input_shape=(3, 7, 5))
    assert cm.graph.node("x").shape == (3, 7, 5)


def test_concat_transpose_slice_pad_and_global_max_pool():
    model = make_model(
        [node("Conv", ["x", "W"], ["a"], "conv"), node("Relu", ["a"], ["r"], "relu"),
         node("Concat", ["r", "x"], ["c"], "cat", axis=1),
         node("Transpose", ["c"], ["t"], "transpose", perm=[0, 1, 3, 2]),
         node("Slice", ["t", "starts", "ends", "axes"], ["s"], "slice"),
         node("Pad", ["s", "pads"], ["p"], "pad"),
         node("GlobalMaxPool", ["p"], ["y"], "gmp")],
        [tensor_info("x", ["N", 3, 5, 6])], [tensor_info("y", ["N", 7, 1, 1])],
        {"W": rng.normal(size=(4, 3, 1, 1)), "starts": np.array([1], dtype=np.int64),
         "ends": np.array([5], dtype=np.int64), "axes": np.array([2], dtype=np.int64),
         "pads": np.array([0, 0, 1, 0, 0, 0, 0, 2], dtype=np.int64)})
    _check(model, rng.normal(size=(2, 3, 5, 6)).astype(np.float32))


def test_two_outputs_and_a_shared_output_node():
    model = make_model(
        [node("Gemm", ["x", "W"], ["h"], "fc", transB=1), node("Relu", ["h"], ["y1"], "relu"),
         node("Identity", ["y1"], ["y2"], "copy")],
        [tensor_info("x", ["N", 3])], [tensor_info("y1", ["N", 4]), tensor_info("y2", ["N", 4])],
        {"W": rng.normal(size=(4, 3))})
    cm = pathir.compile(model)
    assert len(cm.graph.outputs) == 2 and len(set(cm.graph.outputs)) == 2
    x = rng.normal(size=(3, 3)).astype(np.float32)
    out = cm.forward(x.astype(np.float64), backend="numpy")
    refs = ort_run(model, x)
    for name, ref in zip(cm.graph.outputs, refs):
        assert rel(out[name], ref) <= 1e-5


@pytest.mark.parametrize("opset", [7, 13])
def test_clip_at_float32s_largest_value_is_a_relu(opset):
    """Clip(min=0, max=FLT_MAX), opset 6-10's default written out (or FLT_MAX as the max input): no finite x
    reaches it, so it is a ReLU. It was a clipped ReLU of threshold 3.4e38: path_norm(1) 1.46e39 for 15.34."""
    from onnx_cases import make_model, node, tensor_info

    rng = np.random.default_rng(5)
    inits = {"W1": rng.normal(size=(3, 4)), "b1": rng.normal(size=4), "W2": rng.normal(size=(4, 2)),
             "b2": rng.normal(size=2)}
    top = float(np.finfo(np.float32).max)
    if opset < 11:
        clips = [node("Clip", ["h"], ["a"], min=0.0, max=top)]
    else:
        inits |= {"lo": np.float32(0.0), "hi": np.float32(top)}
        clips = [node("Clip", ["h", "lo", "hi"], ["a"])]
    model = make_model([node("Gemm", ["x", "W1", "b1"], ["h"]), *clips, node("Gemm", ["a", "W2", "b2"], ["y"])],
                       [tensor_info("x", ["N", 3])], [tensor_info("y", ["N", 2])], inits, opset=opset)
    w = {k: np.asarray(v, dtype=np.float32).astype(np.float64) for k, v in inits.items()}
    relu_l1 = ((np.abs(w["W1"]).sum(0) + np.abs(w["b1"])) @ np.abs(w["W2"])).sum() + np.abs(w["b2"]).sum()
    assert pathir.compile(model).path_norm(1) == pytest.approx(relu_l1, rel=1e-12)


def _clip_mlp(hi, dtype=None):
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    W1, W2 = rng.normal(size=(3, 4)), rng.normal(size=(4, 2))
    kind = TensorProto.BFLOAT16 if dtype == "bfloat16" else TensorProto.FLOAT

    def tensor(name, a):
        a = np.asarray(a, np.float32)
        return helper.make_tensor(name, kind, a.shape, a.ravel().tolist())

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"), helper.make_node("Clip", ["h", "lo", "hi"], ["r"],
                                                                                       name="r"),
         helper.make_node("MatMul", ["r", "W2"], ["y"], name="fc2")], "g",
        [helper.make_tensor_value_info("x", kind, ["N", 3])], [helper.make_tensor_value_info("y", kind, ["N", 2])],
        [tensor("W1", W1), tensor("W2", W2), tensor("lo", 0.0), tensor("hi", hi)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_clip_at_bfloat16s_largest_value_is_a_relu():
    """numpy's finfo does not know ml_dtypes' bfloat16: Clip(0, 3.39e38) stayed a clipped ReLU (path_norm 2.3e39)."""
    import warnings

    import ml_dtypes

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # onnxruntime runs no bfloat16 MatMul on the CPU: the self-check is skipped
        clipped = pathir.compile(_clip_mlp(float(ml_dtypes.finfo(ml_dtypes.bfloat16).max), "bfloat16"))
        relu = pathir.compile(_clip_mlp(float("inf"), "bfloat16"))
    assert clipped.path_norm(1) == pytest.approx(relu.path_norm(1), rel=1e-12) and relu.path_norm(1) < 100


def test_a_rescaled_threshold_leaving_float32_is_refused_not_written_as_inf():
    """Clip(0, 1e38) rescaled x100 was written as inf (min(relu, inf) = relu passed onnxruntime's probe), and the
    written file was then refused by pathir.compile ('a non-finite threshold')."""
    cm = pathir.compile(_clip_mlp(1e38))
    before = cm.to_onnx().SerializeToString()
    with pytest.raises(PathirError, match="'r.threshold' would leave float32's range"):
        cm.commit_rescaling(np.full(len(cm.units), 2 * np.log(100.0)))
    assert cm.to_onnx().SerializeToString() == before


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_constant_is_named_as_such(bad):
    """A NaN was refused as 'varies over positions' (NaN != NaN), an inf in x − c reported as −inf (the negated param)."""
    from onnx_cases import make_model, node, tensor_info

    rng = np.random.default_rng(0)
    inits = {"W": rng.normal(size=(3, 4)), "c": np.array([bad, 1.0, 1.0, 1.0]), "W2": rng.normal(size=(4, 2))}
    model = make_model([node("MatMul", ["x", "W"], ["h"]), node("Sub", ["h", "c"], ["s"]), node("Relu", ["s"], ["r"]),
                        node("MatMul", ["r", "W2"], ["y"])], [tensor_info("x", ["N", 3])], [tensor_info("y", ["N", 2])],
                       inits)
    with pytest.raises(PathirError, match=f"non-finite entry \\({bad}\\)"):
        pathir.compile(model)


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_leaky_relu_of_slope_one_is_the_identity_and_others_refused(alpha):
    """LeakyRelu(alpha=1) is x for every float: read as the identity (onnxruntime's output, and the path-norm
    of Gemm → Gemm → Relu → Gemm written out); any slope but 0 and 1 stays refused, naming it."""
    W1, W2, W3 = rng.normal(size=(4, 3)), rng.normal(size=(4, 4)), rng.normal(size=(2, 4))
    model = make_model(
        [node("Gemm", ["x", "W1"], ["h"], "fc1", transB=1), node("LeakyRelu", ["h"], ["a"], "leaky", alpha=alpha),
         node("Gemm", ["a", "W2"], ["b"], "fc2", transB=1), node("Relu", ["b"], ["r"], "relu"),
         node("Gemm", ["r", "W3"], ["y"], "fc3", transB=1)],
        [tensor_info("x", ["N", 3])], [tensor_info("y", ["N", 2])], {"W1": W1, "W2": W2, "W3": W3})
    if alpha != 1.0:
        with pytest.raises(PathirError, match="LeakyRelu with a slope other than 0 or 1"):
            pathir.compile(model)
        return
    cm = _check(model, rng.normal(size=(5, 3)).astype(np.float32))
    w1, w2, w3 = (np.abs(np.asarray(w, np.float32).astype(np.float64)) for w in (W1, W2, W3))
    assert cm.path_norm(1) == pytest.approx((w3 @ w2 @ w1).sum(), rel=1e-12)


def _split_with_empty_part(read_empty: bool):
    W1, W2 = rng.normal(size=(6, 3)), rng.normal(size=(2, 6))
    nodes = [node("Gemm", ["x", "W1"], ["h"], "fc1", transB=1), node("Relu", ["h"], ["r"], "relu"),
             node("Split", ["r", "sp"], ["a", "b"], "split", axis=1)]
    nodes += [node("Concat", ["a", "b"], ["c"], "cat", axis=1), node("Gemm", ["c", "W2"], ["y"], "fc2", transB=1)] \
        if read_empty else [node("Gemm", ["a", "W2"], ["y"], "fc2", transB=1)]
    return make_model(nodes, [tensor_info("x", ["N", 3])], [tensor_info("y", ["N", 2])],
                      {"W1": W1, "W2": W2, "sp": np.array([6, 0], dtype=np.int64)}), (W1, W2)


def test_a_split_with_an_empty_part_nobody_reads_lowers():
    """Split into sizes [6, 0], the empty part unread: onnxruntime runs it, and so does pathir (it was refused
    for the empty part's shape). An empty part the graph reads is refused naming it."""
    model, (W1, W2) = _split_with_empty_part(False)
    cm = _check(model, rng.normal(size=(5, 3)).astype(np.float32))
    w1, w2 = (np.abs(np.asarray(w, np.float32).astype(np.float64)) for w in (W1, W2))
    assert cm.path_norm(1) == pytest.approx((w2 @ w1).sum(), rel=1e-12)
    with pytest.raises(PathirError, match="its output 'b' has the empty per-sample shape \\[0\\], and the graph reads it"):
        pathir.compile(_split_with_empty_part(True)[0])


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize("length", [6, 8])
def test_a_valid_pool_in_ceil_mode_sizes_its_output_as_onnxruntime(op, length):
    """auto_pad=VALID with ceil_mode=1: ceil_mode was dropped for VALID (length 8, kernel 3, stride 2 gave 3
    outputs where onnxruntime gives 4; found by a review)."""
    W = rng.normal(size=(2, 2, 1))
    model = make_model([node("Conv", ["x", "W"], ["h"]), node("Relu", ["h"], ["r"]),
                        node(op, ["r"], ["y"], kernel_shape=[3], strides=[2], auto_pad="VALID", ceil_mode=1)],
                       [tensor_info("x", ["N", 2, length])], [tensor_info("y", ["N", 2, "L"])], {"W": W}, opset=19)
    x = rng.normal(size=(3, 2, length)).astype(np.float32)
    ref = ort_run(model, x)[0]
    out = np.asarray(pathir.compile(model, self_check=False).forward(x.astype(np.float64), backend="numpy"))
    assert out.shape == ref.shape and rel(out, ref) <= 1e-5


@pytest.mark.parametrize("axes", [[3, 1], [4, 1], [-3, 4]])
def test_an_opset_11_unsqueeze_with_unsorted_axes_places_them_by_the_output_rank(axes):
    """The specification places every axis by the output's rank, whatever their order; onnx's reference evaluator
    (which pathir runs on element ids) inserted them one after another ([3, 1] put the new axis at 4)."""
    W = rng.normal(size=(4, 4, 1, 1))
    model = make_model([node("Conv", ["x", "W"], ["h"]), node("Relu", ["h"], ["r"]),
                        node("Unsqueeze", ["r"], ["u"], axes=axes), node("Relu", ["u"], ["y"])],
                       [tensor_info("x", ["N", 4, 5, 6])], [tensor_info("y", ["N", "a", "b", "c", "d", "e"])], {"W": W}, opset=11)
    x = rng.normal(size=(2, 4, 5, 6)).astype(np.float32)
    ref = ort_run(model, x)[0]
    out = np.asarray(pathir.compile(model, self_check=False).forward(x.astype(np.float64), backend="numpy"))
    assert out.shape == ref.shape and rel(out, ref) <= 1e-5


def test_an_unsqueeze_naming_one_axis_twice_is_refused():
    """axes [2, -3] of a rank-3 input: -3 is 2 again in the rank-5 output; onnxruntime refuses it, and onnx's
    reference evaluator (which pathir ran) gave a shape of its own."""
    W = rng.normal(size=(2, 2, 1))
    model = make_model([node("Conv", ["x", "W"], ["h"]), node("Relu", ["h"], ["r"]),
                        node("Unsqueeze", ["r"], ["u"], axes=[2, -3]), node("Mul", ["u", "s"], ["y"])],
                       [tensor_info("x", ["N", 2, 3])], [tensor_info("y", ["N", "a", "b", "c", "d"])],
                       {"W": W, "s": np.full((1, 1, 1, 1, 1), 2.0)}, opset=11)  # (the Mul's rank satisfies inference)
    with pytest.raises(PathirError, match=r"its axes \[2, -3\] name one axis of its rank-5 output twice"):
        pathir.compile(model, self_check=False)
