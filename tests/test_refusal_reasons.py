"""What users write that has no place in a ReLU DAG is refused with the reason, naming the op
(never the generic "outside the model" when pathir knows why), and the model is left untouched.

PReLU, Softplus and Threshold (torch, on the fx and the export path) and PRelu, Softplus and ThresholdedRelu
(ONNX) name the node, the op, where it came from and the reason docs/ops.md gives. GatherElements with constant
indices is an element move and is lowered (against onnxruntime); indices read from the input are refused."""

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from onnx_cases import make_model, node, tensor_info
from op_table_cases import ort_output

import pathir
from pathir.errors import UnsupportedOperation
from pathir.frontends.torch.export import lower_exported


class After(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.a, self.o, self.op = nn.Linear(4, 4), nn.Linear(4, 2), op
        self.t, self.W = nn.Parameter(torch.tensor(2.0)), nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return self.o(self.op(self, torch.relu(self.a(x))))


CASES = {
    "clamp(0.5, 6)": (lambda m, h: torch.clamp(h, 0.5, 6.0), "clamp.*lower bound other than 0"),
    "hardtanh(-1, 1)": (lambda m, h: F.hardtanh(h, -1.0, 1.0), "hardtanh.*clips below"),
    "abs": (lambda m, h: h.abs(), "abs.*not one of pathir's neurons"),
    "pow": (lambda m, h: h**2, "pow.*power of an activation"),
    "sort": (lambda m, h: h.sort(1).values, "sort.*orders by value"),
    "cumsum": (lambda m, h: h.cumsum(1), "cumsum.*cumulative sum"),
    "einsum": (lambda m, h: torch.einsum("bi,ij->bj", h, m.W), "einsum.*Linear"),
    "cast": (lambda m, h: h.to(torch.float32).double(), "casts an activation"),
    "ones_like": (lambda m, h: h + torch.ones_like(h), "ones_like.*new tensor of an activation's shape"),
    "compare": (lambda m, h: h * (h > 0.5), "compares an activation"),
    "gate": (lambda m, h: h * h, "multiplicative gate"),
    "learnable divisor": (lambda m, h: h / m.t, "divides an activation by the learnable parameter 't'"),
    "scalar parameter": (lambda m, h: h * m.t, "parameter 't' of shape \\[\\]"),
    "softmax": (lambda m, h: F.softmax(h, 1), "softmax"),
    "constant": (lambda m, h: h + 1, "constant 1"),
    "gather": (lambda m, h: torch.gather(h, 1, torch.tensor([[3, 0, 0, 2]]).expand(h.shape[0], -1)),
               "gather.*index tensor.*index_select or indexing"),
    "take_along_dim": (lambda m, h: torch.take_along_dim(h, torch.tensor([[3, 0, 1, 2]]), 1),
                       "take_along_dim.*index tensor"),
    "write into zeros": (lambda m, h: _written_into_zeros(h), "writes an activation into a tensor made in the forward"),
    "scatter": (lambda m, h: torch.zeros_like(h).scatter(1, torch.tensor([[3, 0, 1, 2]]).expand(h.shape[0], -1), h),
                "scatter.*index tensor"),
}


def _written_into_zeros(h):
    z = torch.zeros_like(h)
    z[:, [3, 0]] = h[:, :2]
    return z


@pytest.mark.parametrize("name", list(CASES))
def test_refused_with_its_reason_and_the_model_untouched(name):
    op, why = CASES[name]
    torch.manual_seed(0)
    model = After(op).double().eval()
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(UnsupportedOperation, match=why):
        pathir.compile(model, input_shape=(4,))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


# ====================================================================== PReLU, Softplus, Threshold

GENERIC = "outside the ReLU DAG model"


class _Act(nn.Module):
    """``act(fc(x))``: ``act`` a module, or a function of the activation."""

    def __init__(self, act):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = act if isinstance(act, nn.Module) else None
        self.fn = None if isinstance(act, nn.Module) else act

    def forward(self, x):
        h = self.fc(x)
        return self.act(h) if self.act is not None else self.fn(h)


#: case -> (the activation, the op the error names, key words of its reason)
TORCH = {
    "nn.PReLU": (lambda: nn.PReLU(4, init=0.1), "PReLU", ("positively homogeneous", "negative slope", "learnable")),
    "F.prelu": (lambda: lambda h: F.prelu(h, torch.tensor([0.25])), "prelu", ("positively homogeneous", "slope")),
    "nn.Softplus": (lambda: nn.Softplus(beta=2.0), "Softplus", ("not positively homogeneous", "softplus(0)")),
    "F.softplus": (lambda: lambda h: F.softplus(h), "softplus", ("not positively homogeneous", "smooth ReLU")),
    "nn.InstanceNorm1d(tracked)": (lambda: nn.Sequential(nn.Unflatten(1, (4, 1)), nn.InstanceNorm1d(4, track_running_stats=True)),
                                   "InstanceNorm1d", ("its own statistics", "tracks running statistics", "BatchNorm")),
    "nn.Threshold(0.1, 0)": (lambda: nn.Threshold(0.1, 0.0), "Threshold", ("threshold t ≠ 0", "homogeneous")),
    "nn.Threshold(0, 1)": (lambda: nn.Threshold(0.0, 1.0), "Threshold", ("value v ≠ 0", "homogeneous")),
    "F.threshold(x, 0.5, 0.5)": (lambda: lambda h: F.threshold(h, 0.5, 0.5), "threshold",
                                 ("threshold(x, 0, 0) is a ReLU", "homogeneous")),
    "torch.threshold(x, -1, 0)": (lambda: lambda h: torch.threshold(h, -1.0, 0.0), "threshold",
                                  ("threshold(x, 0, 0) is a ReLU", "homogeneous")),
}


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", list(TORCH))
def test_torch_refusal_names_the_op_and_why(name):
    make, op, words = TORCH[name]
    model = _Act(make())
    before = _state(model)
    with pytest.raises(UnsupportedOperation) as info:
        pathir.compile(model, input_shape=(4,))
    err, text = info.value, str(info.value)
    assert op.lower() in err.op.lower(), text  # F.threshold is torch's _threshold
    assert err.node and f"node '{err.node}'" in text
    if isinstance(model.act, nn.Module):
        assert err.where.split(".")[0] == "act" and f"from {err.where}" in text  # the module it came from
    assert GENERIC not in text
    for w in words:
        assert w in text, text
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("name", ["nn.PReLU", "nn.Softplus", "nn.Threshold(0.1, 0)", "F.threshold(x, 0.5, 0.5)"])
def test_torch_export_path_gives_the_same_reason(name):
    make, op, words = TORCH[name]
    model = _Act(make())
    with pytest.raises(UnsupportedOperation) as info:
        lower_exported(model, (4,), "M")
    text = str(info.value)
    assert info.value.op.split(".")[0] == op.lower().lstrip("_"), text  # the ATen op: prelu.default, ...
    assert GENERIC not in text
    for w in words:
        assert w in text, text


@pytest.mark.parametrize("act", [lambda: nn.Threshold(0.0, 0.0), lambda: lambda h: F.threshold(h, 0, 0)])
def test_threshold_at_zero_is_a_relu(act):
    model = _Act(act()).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    cm = pathir.compile(model, input_shape=(4,))
    with torch.no_grad():
        ref = torch.relu(model.fc(x)).numpy()
    np.testing.assert_allclose(cm.forward(x.numpy(), backend="numpy"), ref, rtol=1e-10, atol=1e-12)


# ====================================================================== ONNX


def _onnx(op_nodes, inits=None, out_shape=("N", 4), extra_inputs=()):
    """x -> Gemm 'fc' -> op nodes -> y."""
    rng = np.random.default_rng(0)
    return make_model([node("Gemm", ["x", "W"], ["h"], "fc", transB=1), *op_nodes],
                      [tensor_info("x", ["N", 4]), *extra_inputs],
                      [tensor_info("y", list(out_shape))],
                      {"W": rng.normal(size=(4, 4)), **(inits or {})})


ONNX = {
    "PRelu": (lambda: _onnx([node("PRelu", ["h", "slope"], ["y"], "act")], {"slope": np.full(4, 0.1)}),
              ("positively homogeneous", "slope", "learnable")),
    "Softplus": (lambda: _onnx([node("Softplus", ["h"], ["y"], "act")]),
                 ("not positively homogeneous", "smooth ReLU", "Softplus(0)")),
    "ThresholdedRelu": (lambda: _onnx([node("ThresholdedRelu", ["h"], ["y"], "act", alpha=0.5)]),
                        ("not positively homogeneous", "x > alpha", "alpha = 0")),
}


@pytest.mark.parametrize("op", list(ONNX))
def test_onnx_refusal_names_the_node_and_why(op):
    make, words = ONNX[op]
    with pytest.raises(UnsupportedOperation) as info:
        pathir.compile(make())
    err, text = info.value, str(info.value)
    assert (err.node, err.op) == ("act", op), text
    assert "ONNX node #1" in err.where
    for w in words:
        assert w in text, text


def _gather_elements(idx):
    """y = GatherElements(fc(x), expand(idx, [N, 4]), axis=1): torch.gather(h, 1, idx.expand(N, -1))."""
    return _onnx([node("Shape", ["h"], ["n"], end=1), node("Concat", ["n", "four"], ["s"], axis=0),
                  node("Expand", ["idx", "s"], ["i"]), node("GatherElements", ["h", "i"], ["y"], "ge", axis=1)],
                 {"idx": np.asarray([idx], dtype=np.int64), "four": np.asarray([len(idx)], dtype=np.int64)},
                 out_shape=("N", len(idx)))


@pytest.mark.parametrize("idx", [[3, 2, 1, 0], [1, 1, 0, 3], [2, 0]])
def test_onnx_gather_elements_with_constant_indices_is_an_element_move(idx):
    proto = _gather_elements(idx)
    x = np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)
    cm = pathir.compile(proto)  # its self-check runs onnxruntime too
    np.testing.assert_allclose(cm.forward(x.astype(np.float64), backend="numpy"), ort_output(proto, x),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op, axis, out", [("GatherElements", 1, ("N", 4)), ("Gather", 1, ("N", "N", 4)),
                                           ("Gather", 0, ("N", 4, 4))])
def test_onnx_gather_with_indices_from_the_input_is_refused(op, axis, out):
    proto = _onnx([node(op, ["h", "i"], ["y"], "ge", axis=axis)], out_shape=out,
                  extra_inputs=[helper.make_tensor_value_info("i", TensorProto.INT64, ["N", 4])])
    with pytest.raises(UnsupportedOperation) as info:
        pathir.compile(proto, input_shape={"x": (4,), "i": (4,)})
    assert (info.value.node, info.value.op) == ("ge", op)
    assert "data-dependent selection" in str(info.value) and "'i'" in str(info.value)


def test_onnx_gather_elements_keeping_a_prefix_of_the_batch_is_refused():
    """Indices of one sample on a batch of N (onnxruntime keeps sample 0 only): refused, saying why."""
    proto = _onnx([node("GatherElements", ["h", "idx"], ["y"], "ge", axis=1)],
                  {"idx": np.asarray([[3, 2, 1, 0]], dtype=np.int64)}, out_shape=(1, 4))
    with pytest.raises(UnsupportedOperation) as info:
        pathir.compile(proto)
    assert (info.value.node, info.value.op) == ("ge", "GatherElements")
    assert "the batch axis" in str(info.value) and "expand the indices" in str(info.value)


class _SubParam(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.a, self.w, self.b, self.form = nn.Linear(4, 3), nn.Parameter(torch.randn(3)), nn.Linear(3, 2), form

    def forward(self, x):
        h = self.a(x)
        h = h - self.w if self.form == "sub" else torch.add(h, self.w, alpha=-2.0)
        return self.b(torch.relu(h))


@pytest.mark.parametrize("form, words", [("sub", ("learnable parameter 'w'", "added (h + b)")),
                                         ("add alpha", ("the learnable parameter 'w'",))])
def test_a_parameter_met_where_pathir_wants_an_activation_is_named_as_one(form, words):
    net = _SubParam(form)
    with pytest.raises(UnsupportedOperation) as info:
        pathir.compile(net, input_shape=(4,))
    assert all(w in str(info.value) for w in words) and "ParamTensor" not in str(info.value)


# ------------------------------------------------------------ numbers computed from the batch size (ONNX)


def _batch_divided(reshape_too: bool):
    """relu(fc(x)) / x.shape[0] as both exporters write it (Shape -> Gather -> Cast -> Div); with
    ``reshape_too`` only a Reshape to Shape(h) reads the batch size, as a shape."""
    nodes = [node("Gemm", ["x", "W"], ["h"], "fc", transB=1), node("Relu", ["h"], ["a"], "relu"),
             node("Shape", ["a"], ["sh"], "shape")]
    if reshape_too:
        nodes += [node("Reshape", ["a", "sh"], ["y"], "reshape")]
    else:
        nodes += [node("Gather", ["sh", "i0"], ["n"], "batch", axis=0),
                  node("Cast", ["n"], ["nf"], "cast", to=TensorProto.FLOAT), node("Div", ["a", "nf"], ["y"], "div")]
    return make_model(nodes, [tensor_info("x", ["N", 4])], [tensor_info("y", ["N", 4])],
                      {"W": np.random.default_rng(0).normal(size=(4, 4)), "i0": np.array(0, dtype=np.int64)})


def test_an_onnx_number_computed_from_the_batch_size_is_refused_where_read_as_a_coefficient():
    """It was folded at the walk's batch (2): the graph was off by N/2 at every other batch size, silently."""
    with pytest.raises(UnsupportedOperation) as info:
        pathir.compile(_batch_divided(False))
    assert (info.value.node, info.value.op) == ("div", "Div")
    assert "computed from the batch size" in str(info.value) and "'nf'" in str(info.value)


def test_an_onnx_shape_read_as_a_reshape_target_still_lowers_at_every_batch_size():
    proto = _batch_divided(True)
    cm = pathir.compile(proto)
    for batch in (1, 3, 5):
        x = np.random.default_rng(batch).normal(size=(batch, 4)).astype(np.float32)
        np.testing.assert_allclose(cm.forward(x.astype(np.float64), backend="numpy"), ort_output(proto, x),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("to, exact", [(TensorProto.FLOAT16, False), (TensorProto.BFLOAT16, False),
                                       (TensorProto.DOUBLE, True), (TensorProto.FLOAT, True)])
def test_an_onnx_cast_of_an_activation_lowers_where_exact_and_is_refused_where_it_rounds(to, exact):
    """A float32 -> float16 -> float32 round trip was lowered as nothing: off by 3e-5, within the self-check's
    tolerance, silently."""
    proto = _onnx([node("Relu", ["h"], ["a"], "relu"), node("Cast", ["a"], ["c"], "narrow", to=to),
                   node("Cast", ["c"], ["y"], "back", to=TensorProto.FLOAT)])
    if exact:
        x = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
        np.testing.assert_allclose(pathir.compile(proto).forward(x.astype(np.float64), backend="numpy"),
                                   ort_output(proto, x), rtol=1e-6, atol=1e-7)
        return
    with pytest.raises(UnsupportedOperation) as info:
        pathir.compile(proto)
    assert (info.value.node, info.value.op) == ("narrow", "Cast") and "rounds every value" in str(info.value)


@pytest.mark.parametrize("op", ["Mul", "Div"])
def test_an_onnx_constant_of_higher_rank_is_refused_at_the_op_that_broadcasts_it(op):
    """onnxruntime's output gains a leading axis, (1, N, 4): the lowering dropped it (a self-check 'by inf',
    or numpy's text at a later Squeeze)."""
    proto = _onnx([node(op, ["h", "c"], ["y"], "scale")], {"c": np.full((1, 1, 1), 1.5)}, out_shape=(1, "N", 4))
    with pytest.raises(UnsupportedOperation) as info:
        pathir.compile(proto)
    assert (info.value.node, info.value.op) == ("scale", op) and "leading axes" in str(info.value)


def test_an_onnx_clip_without_bounds_is_the_identity():
    proto = _onnx([node("Relu", ["h"], ["r"], "relu"), node("Clip", ["r"], ["y"], "clip")])
    x = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    np.testing.assert_allclose(pathir.compile(proto).forward(x.astype(np.float64), backend="numpy"),
                               ort_output(proto, x), rtol=1e-6, atol=1e-7)


ONNX_WORDS = {
    "negative Pad": (lambda: _onnx([node("Pad", ["h", "pads"], ["y"], "crop")],
                                   {"pads": np.array([0, 1, 0, -1], dtype=np.int64)}), ("crop", "Slice")),
    "QDQ weight": (lambda: helper.make_model(helper.make_graph(
        [node("DequantizeLinear", ["Wq", "sc", "zp"], ["Wd"], "dq"), node("Gemm", ["x", "Wd"], ["y"], "fc")], "qdq",
        [tensor_info("x", ["N", 4])], [tensor_info("y", ["N", 3])],
        [numpy_helper.from_array(v, k) for k, v in (("Wq", np.arange(12, dtype=np.int8).reshape(4, 3)),
                                                     ("sc", np.array(0.1, np.float32)), ("zp", np.array(0, np.int8)))]),
        opset_imports=[helper.make_opsetid("", 17)]), ("quantized (QDQ) model",)),
}


@pytest.mark.parametrize("case", list(ONNX_WORDS))
def test_onnx_refusals_say_what_the_op_is(case):
    make, words = ONNX_WORDS[case]
    with pytest.raises(UnsupportedOperation) as info:
        pathir.compile(make())
    assert all(w in str(info.value) for w in words), str(info.value)


def test_an_onnx_op_that_moves_the_batch_axis_is_named_though_an_index_op_follows():
    """A Slice dropping samples, then a Flatten: the refusal named the Flatten, which only read the result."""
    proto = make_model(
        [node("Gemm", ["x", "W"], ["h"], "fc", transB=1), node("Relu", ["h"], ["r"], "relu"),
         node("Slice", ["r", "s", "e", "a"], ["t"], "drop_first_sample"), node("Flatten", ["t"], ["y"], "flatten")],
        [tensor_info("x", ["N", 4])], [tensor_info("y", ["M", 4])],
        {"W": np.random.default_rng(0).normal(size=(4, 4)), "s": np.array([1], dtype=np.int64),
         "e": np.array([1000], dtype=np.int64), "a": np.array([0], dtype=np.int64)})
    with pytest.raises(UnsupportedOperation) as info:
        pathir.compile(proto)
    assert (info.value.node, info.value.op) == ("drop_first_sample", "Slice")


class _Roll(nn.Module):
    def __init__(self, roll, hook=False):
        super().__init__()
        self.a, self.b, self.roll = nn.Linear(3, 4), nn.Linear(4, 2), roll
        if hook:  # a forward hook of the model's own: traced by torch.export
            self.register_forward_hook(lambda m, i, o: o)

    def forward(self, x):
        return self.b(self.roll(torch.relu(self.a(x)).unsqueeze(-1)).squeeze(-1))


@pytest.mark.parametrize("hook", [False, True], ids=["fx", "export"])
@pytest.mark.parametrize("roll", [lambda h: torch.roll(h, 6, 0), lambda h: h.roll(2, dims=0), lambda h: torch.roll(h, 2),
                                  lambda h: torch.roll(h, (6, 1), (0, 1))],
                         ids=["batch by 6", "method by 2", "flattened", "batch and features"])
def test_a_roll_of_the_batch_axis_is_refused(roll, hook):
    """A roll of axis 0 by a multiple of the batch size is the identity at that size: at the trace's batch of 2
    (and the self-check's of 3, a shift of 6) it passed, and the samples of every other batch came back rolled."""
    torch.manual_seed(0)
    model = _Roll(roll, hook).double()
    with pytest.raises(UnsupportedOperation, match="rolls the batch axis"):
        pathir.compile(model, input_shape=(3,), self_check=False)


@pytest.mark.parametrize("hook", [False, True], ids=["fx", "export"])
def test_a_roll_of_the_features_is_exact(hook):
    torch.manual_seed(0)
    model = _Roll(lambda h: torch.roll(h, 1, 1), hook).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    cm = pathir.compile(model, input_shape=(3,))
    assert np.allclose(cm.forward(x.numpy()), model(x).detach().numpy(), rtol=1e-12, atol=1e-12)


def _qat_linear():
    import torch.ao.nn.qat as nnqat
    import torch.ao.quantization as tq

    qconfig = tq.QConfig(activation=nn.Identity, weight=tq.default_weight_fake_quant)
    torch.manual_seed(1)
    model = nn.Sequential(nnqat.Linear(8, 16, qconfig=qconfig), nn.ReLU(), nnqat.Linear(16, 4, qconfig=qconfig))
    model.train()
    model(torch.randn(32, 8))
    model.eval()
    model.apply(tq.disable_observer)  # a deployed QAT model: fake-quant on, statistics frozen
    return model


def _dynamic_linear():
    import torch.ao.nn.quantized.dynamic as nnqd

    return nn.Sequential(nnqd.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


@pytest.mark.parametrize("make", [_qat_linear, _dynamic_linear])
def test_a_module_that_quantizes_in_its_forward_is_refused_by_what_it_is(make):
    """A torch.ao qat.Linear took nn.Linear's rule (its base class): its weight fake-quant was dropped (the IR forward
    1.9e-5 off; compiled silently with self_check=False); a dynamic-quantized Linear was 'outside the ReLU DAG'."""
    model = make()
    state = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    for self_check in (True, False):
        with pytest.raises(pathir.UnsupportedOperation, match="quantizes in its forward"):
            pathir.compile(model, input_shape=(8,), self_check=self_check)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_a_float_fused_module_of_torch_ao_is_still_lowered():
    import torch.ao.nn.intrinsic as nni

    torch.manual_seed(0)
    model = nn.Sequential(nni.LinearReLU(nn.Linear(8, 16), nn.ReLU()), nn.Linear(16, 4)).eval()
    x = torch.randn(5, 8)
    np.testing.assert_allclose(pathir.compile(model, input_shape=(8,)).forward(x.double().numpy(), backend="numpy"),
                               model(x).detach().double().numpy(), rtol=1e-5, atol=1e-6)


class _Cast(nn.Module):
    def __init__(self, cast):
        super().__init__()
        self.a, self.b, self.cast = nn.Linear(4, 6), nn.Linear(6, 2), cast

    def forward(self, x):
        return self.b(torch.relu(self.a(self.cast(x))))


@pytest.mark.parametrize("cast", [lambda x: x.float(), lambda x: x.to(torch.float32), lambda x: x.type(torch.float32),
                                  lambda x: x.to("cpu")])
def test_a_cast_to_the_models_own_dtype_is_the_identity(cast):
    """``x = x.float()`` at the top of a float32 model's forward was refused as 'casts to another dtype'."""
    torch.manual_seed(0)
    model = _Cast(cast).eval()
    x = torch.randn(5, 4)
    np.testing.assert_allclose(pathir.compile(model, input_shape=(4,)).forward(x.double().numpy(), backend="numpy"),
                               model(x).detach().double().numpy(), rtol=1e-5, atol=1e-6)


def test_a_cast_to_another_dtype_is_refused_by_name():
    with pytest.raises(pathir.UnsupportedOperation, match=r"\.half\(\) casts an activation to float16 in a float32"):
        pathir.compile(_Cast(lambda x: x.half().float()).eval(), input_shape=(4,))


def test_a_cast_to_another_tensors_dtype_is_refused():
    """``h.to(buffer)`` with a bfloat16 buffer was read as the identity (its ParamTensor wrapper missed the check):
    0.097 off with self_check=False."""

    class ToOther(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.c = nn.Linear(4, 6), nn.Linear(6, 2)
            self.register_buffer("ref", torch.zeros(1, dtype=torch.bfloat16))

        def forward(self, x):
            return self.c(torch.relu(self.a(x).to(self.ref).float()))

    with pytest.raises(pathir.UnsupportedOperation, match=r"\.to\(tensor\)"):
        pathir.compile(ToOther().eval(), input_shape=(4,), self_check=False)
