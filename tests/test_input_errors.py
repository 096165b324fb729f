"""Bad input to pathir.compile: one-line PathirErrors naming what to fix; the model untouched."""

import numpy as np
import pytest
import torch
import torch.nn as nn
from capture_reference import assert_forward, path_norm_q

import pathir
from pathir.errors import InputShapeError, PathirError


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)).double()


def _untouched(model, fn):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [m.training for m in model.modules()]
    fn()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert flags == [m.training for m in model.modules()]


@pytest.mark.parametrize("shape", [(1, 3, 8, 8), (4, 8, 8), (8, 8), (3, 8)])
def test_wrong_input_shape_says_input_shape(shape):
    model = _cnn()

    def go():
        with pytest.raises(InputShapeError, match=r"input_shape=.*without the batch axis") as info:
            pathir.compile(model, input_shape=shape)
        assert "\n" not in str(info.value)

    _untouched(model, go)


@pytest.mark.parametrize("shape", ["abc", (0, 3), (), True])
def test_not_a_shape(shape):
    with pytest.raises(InputShapeError, match="input_shape"):
        pathir.compile(_cnn(), input_shape=shape)


def test_int_is_a_1d_shape():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).double()
    assert pathir.compile(model, input_shape=4).num_paths() == pathir.compile(model, input_shape=(4,)).num_paths()


def test_lazy_module_refused():
    model = nn.Sequential(nn.LazyLinear(3), nn.ReLU(), nn.Linear(3, 2))
    with pytest.raises(PathirError, match="uninitialized .* run one forward"):
        pathir.compile(model, input_shape=(4,))


def test_meta_device_refused():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    with pytest.raises(PathirError, match="meta device"):
        pathir.compile(model, input_shape=(4,))


@pytest.mark.parametrize("where", ["whole", "submodule"])
def test_torchscript_module_refused_naming_what_to_pass(where):
    inner = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    model = torch.jit.script(nn.Sequential(inner, nn.Linear(3, 2))) if where == "whole" else \
        nn.Sequential(torch.jit.script(inner), nn.Linear(3, 2))
    with pytest.raises(PathirError, match="TorchScript module .* before torch.jit.script"):
        pathir.compile(model, input_shape=(4,))


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 5), nn.Linear(4, 5), nn.Linear(5, 2)

    def forward(self, x, y, mask=None):
        return self.c(torch.relu(self.a(x) + self.b(y)))


def test_several_inputs():
    torch.manual_seed(0)
    model = TwoInputs().double()
    cm = pathir.compile(model, input_shape=[(3,), (4,)])
    x, y = torch.randn(3, 3, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    out = cm.forward({cm.graph.inputs[0]: x.numpy(), cm.graph.inputs[1]: y.numpy()}, backend="numpy")
    assert abs(out - model(x, y).detach().numpy()).max() < 1e-12
    for q in (1, 2):
        assert cm.path_norm(q) ** q == pytest.approx(path_norm_q(model, [(3,), (4,)], q), rel=1e-10)


def test_several_inputs_wrong_count():
    with pytest.raises(PathirError, match="input_shape=\\[\\(...\\), \\(...\\)\\]|input_shape="):
        pathir.compile(TwoInputs(), input_shape=(3,))


class ShapeBranch(nn.Module):
    """Python control flow on a shape: fx fails, torch.export is the fallback."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, bias=True)
        self.fc = nn.Linear(3 * 4 * 4, 2)

    def forward(self, x):
        h = torch.relu(self.conv(x))
        if h.shape[-1] > 2:
            h = h.flatten(1)
        return self.fc(h)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float16, 1e-2)])
def test_export_fallback_in_the_models_dtype(dtype, tol):
    torch.manual_seed(0)
    model = ShapeBranch().to(dtype)
    cm = pathir.compile(model, input_shape=(2, 6, 6))
    if dtype is torch.float64:
        assert_forward(model, (2, 6, 6), tol=tol)
    assert cm.num_paths() > 0


class WithConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        if h.shape[0] > 0:
            h = h * torch.tensor(2.0)  # a constant torch.export lifts to an input
        return h


def test_lifted_constant_is_not_a_second_input():
    """torch.export lifts torch.tensor(2.0) to a graph input: it is a constant (a fixed edge)."""
    torch.manual_seed(0)
    model = WithConstant().double()
    cm = assert_forward(model, (3,))
    assert len(cm.graph.inputs) == 1


def test_bad_shape_on_a_pruned_model_leaves_its_tensors_in_place():
    from torch.nn.utils import prune

    model = _cnn()
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    weight = model[0].weight
    with pytest.raises(InputShapeError):
        pathir.compile(model, input_shape=(4, 8, 8))
    assert model[0].weight is weight


def test_a_model_that_fails_at_every_batch_is_refused_with_its_own_error():
    """fx traces without running the ops, so a model that never runs (here a float32 layer before a float64
    one) first failed in the self-check, which blamed a batch size fixed in the forward."""
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    model[0].float()
    with pytest.raises(InputShapeError, match="Sequential itself fails .* same dtype"):
        pathir.compile(model, input_shape=(3,))


def test_a_forward_that_fixes_its_batch_size_is_still_named():
    class Fixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(x.view(2, 3)).relu()  # runs at the trace's batch (2), fails at the check's

    with pytest.raises(pathir.SelfCheckFailed, match="fixes its batch size"):
        pathir.compile(Fixed(), input_shape=(3,))


@pytest.mark.parametrize("form", ["numpy", "torch", "list", "dict"])
def test_complex_inputs_are_refused_by_every_method_that_runs_the_graph(form):
    """A complex batch was read as its real part by the walks at data (active path-norms, counts, the local
    affine piece, observe): numbers for an input the model itself refuses (torch: 'mat1 and mat2 must have the
    same dtype'). Every such method now refuses it, naming the input."""
    import numpy as np

    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)).double()
    cm = pathir.compile(model, input_shape=(3,))
    x = np.random.default_rng(0).normal(size=(4, 3)) + 0.5j
    name = cm.graph.inputs[0]
    x = {"numpy": x, "torch": torch.tensor(x), "list": x.tolist(), "dict": {name: x}}[form]
    for call in (lambda: cm.active_path_norm(x), lambda: cm.active_path_counts(x), lambda: cm.local_affine(x),
                 lambda: cm.forward(x), lambda: pathir.observe(cm, x)):
        with pytest.raises(InputShapeError, match=f"input '{name}' is complex"):
            call()


@pytest.mark.parametrize("dtype", ["object", "longdouble", "str", "datetime64[s]"])
def test_inputs_that_are_not_float64_readable_are_refused_by_every_method_that_runs_the_graph(dtype):
    """An object array of floats or a longdouble one failed inside the backend (a BackendError naming the
    input node, not why); a longdouble batch is rounded to float64, which no model runs. Each is now refused
    as an input, naming it and what to pass."""
    import numpy as np

    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)).double()
    cm = pathir.compile(model, input_shape=(3,))
    x = np.random.default_rng(0).normal(size=(4, 3))
    x = x.astype("U8") if dtype == "str" else (x * 1e6).astype(dtype) if dtype.startswith("datetime") else \
        x.astype(dtype)
    name = cm.graph.inputs[0]
    why = "extended precision" if dtype == "longdouble" else "not of float64 numbers"
    for call in (lambda: cm.active_path_norm(x), lambda: cm.active_path_counts(x), lambda: cm.local_affine(x),
                 lambda: cm.forward(x), lambda: pathir.observe(cm, x), lambda: cm.equalize(inputs=x, write_back=False)):
        with pytest.raises(InputShapeError, match=f"input '{name}' is .*{why}"):
            call()


@pytest.mark.parametrize("rows", [[["1", "2", "3"]], [[1.0, None, 3.0]], [[1.0, 2.0], [3.0]]])
def test_lists_that_are_not_numbers_are_refused_by_forward_and_equalize(rows):
    """A list of lists skipped the dtype check: forward failed inside the backend (a BackendError), and
    equalize(inputs=) read the strings '1', '2', '3' as numbers."""
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)).double()
    cm = pathir.compile(model, input_shape=(3,))
    name = cm.graph.inputs[0]
    for call in (lambda: cm.forward(rows), lambda: cm.active_path_norm(rows), lambda: cm.equalize(inputs=rows)):
        with pytest.raises(InputShapeError, match=f"input '{name}' is (an array of .* not of float64 numbers|a list numpy "
                                                  "cannot read)"):
            call()


def test_a_float8_batch_is_read_exactly():
    """torch's float8 tensors failed in the walks at data (isfinite is not implemented for them); every float8
    value is a float32 one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)).double()
    cm = pathir.compile(model, input_shape=(3,))
    x8 = torch.randn(6, 3).to(torch.float8_e4m3fn)
    x32 = x8.float()
    assert cm.active_path_norm(x8).tolist() == cm.active_path_norm(x32).tolist()
    assert cm.active_path_counts(x8).tolist() == cm.active_path_counts(x32).tolist()
    assert torch.equal(torch.as_tensor(cm.forward(x8)), torch.as_tensor(cm.forward(x32)))


def test_negated_views_and_lists_of_grad_tensors_as_inputs():
    """A float64 batch that is a lazily negated view is read by its values everywhere (equalize(inputs=) and the
    active path-metric raised torch's RuntimeError); a list of tensors that require grad is refused clearly."""
    torch.manual_seed(0)
    cm = pathir.compile(nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)).double(), input_shape=(3,))
    x = torch.randn(4, 3, dtype=torch.float64)
    xn = torch._neg_view(-x)
    assert cm.active_path_norm(xn).tolist() == cm.active_path_norm(x).tolist()
    assert pathir.active_path_metric(cm, cm, xn).x_scale.tolist() == pathir.active_path_metric(cm, cm, x).x_scale.tolist()
    report = cm.equalize(inputs=xn, write_back=False)
    assert report.observed_before == cm.equalize(inputs=x, write_back=False).observed_before
    with pytest.raises(InputShapeError, match="a list numpy cannot read"):
        cm.active_path_norm([torch.ones(3, requires_grad=True)])


def test_a_scalar_batch_is_refused_by_forward():
    """forward read the batch size before any check: a float raised a raw TypeError, a 0-d array an IndexError."""
    import numpy as np

    cm = pathir.compile(nn.Sequential(nn.Linear(1, 3), nn.ReLU(), nn.Linear(3, 1)).double(), input_shape=(1,))
    for x in (0.5, np.float64(0.5), torch.tensor(0.5)):
        with pytest.raises(InputShapeError, match="got a scalar"):
            cm.forward(x)
    assert np.asarray(cm.forward([[0.5], [1.0]])).shape == (2, 1)


class _Nested(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.o, self.p = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2), torch.nn.Linear(4, 3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return {"o": self.o(h)}, [self.p(h), (self.o(h),)]


def test_nested_outputs_are_flattened_in_order_on_both_paths():
    """A tuple of a dict and a list holding a tuple: fx refused it naming an internal type ('immutable_dict'), where
    torch.export flattened it; both read the tensors in order now (found by a review)."""
    from capture_reference import Untraceable

    torch.manual_seed(0)
    net = _Nested().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with torch.no_grad():
        (o,), (p, (o2,)) = net(x)[0].values(), net(x)[1]
    for model in (net, Untraceable(net)):
        cm = pathir.compile(model, input_shape=(3,))
        out = cm.forward(x.numpy())
        assert len(cm.graph.outputs) == 3
        for name, ref in zip(cm.graph.outputs, (o, p, o2)):
            np.testing.assert_allclose(out[name], ref.numpy(), rtol=1e-12)


class _ConstantOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.a(x), torch.zeros(x.shape[0], 2, dtype=x.dtype)


class _DictIn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)

    def forward(self, batch):
        return self.a(batch["a"]) + self.b(batch["b"])


def test_a_constant_output_and_a_forward_taking_a_dict_are_refused_for_what_they_are():
    """The constant was named as an internal 'ParamTensor'; the dict forward got the hint that the shape was wrong."""
    with pytest.raises(pathir.UnsupportedOperation, match="returns a tensor no input reaches .*torch.zeros"):
        pathir.compile(_ConstantOut(), input_shape=(3,))
    for shapes in ([(3,), (2,)], (3,)):
        with pytest.raises(pathir.InputShapeError, match=r"one tensor per entry of input_shape .*a wrapper"):
            pathir.compile(_DictIn(), input_shape=shapes)
