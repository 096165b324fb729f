"""A forward that writes the model's own state from Python (``self.count += 1``, a buffer
replaced by a new tensor, a parameter edited in place): tracing runs that code on the real
tensors and the traced graph does not show it. pathir refuses, naming the tensor, and the model's
state is as before the call. A state update guarded by ``if self.training`` is not run by the
eval-mode capture and compiles exactly."""

import pytest
import torch
import torch.nn as nn
from capture_reference import assert_forward

import pathir
from pathir.errors import UnsupportedOperation


class Counter(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 2)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        if self.how == "inplace":
            self.count += 1
        elif self.how == "replace":
            self.count = self.count + 1
        elif self.how == "param":
            with torch.no_grad():
                self.a.weight.mul_(1.0)
        elif self.how == "train_only" and self.training:
            self.count += 1
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("how, name", [("inplace", "'count'"), ("replace", "'count'"), ("param", "'a.weight'")])
def test_forward_writing_its_own_state_is_refused_and_the_state_put_back(how, name):
    torch.manual_seed(0)
    model = Counter(how).double().eval()
    count, weight = model.count, model.a.weight.detach().clone()
    with pytest.raises(UnsupportedOperation, match=f"the forward writes the model's own {name}"):
        pathir.compile(model, input_shape=(4,))
    assert model.count is count and float(model.count) == 0.0
    assert torch.equal(model.a.weight, weight)


def test_state_update_under_training_flag_is_not_run_by_the_capture():
    model = Counter("train_only").double().train()
    assert_forward(model, (4,), tol=1e-12)
    assert float(model.count) == 0.0 and model.training



@pytest.mark.parametrize("self_check", [True, False])
def test_a_state_write_read_through_torch_export_is_refused_without_the_self_check_too(self_check):
    """torch.export runs the forward on fake tensors, so the model's own buffer did not move and the write went
    unseen: with self_check=False the graph kept the count of the trace (and a later query raised ModelChanged)."""
    torch.manual_seed(0)
    model = Counter("inplace").double().eval()
    model.register_forward_hook(lambda m, i, o: None)  # the model's own hook: read through torch.export
    with pytest.raises(UnsupportedOperation, match="the forward writes the model's own 'count'"):
        pathir.compile(model, input_shape=(4,), self_check=self_check)
    assert float(model.count) == 0.0


class _Outer(nn.Module):
    """A Counter as a submodule, behind Python control flow on shapes (fx fails: torch.export reads it)."""

    def __init__(self, how, read):
        super().__init__()
        self.m, self.read = Counter(how), read

    def forward(self, x):
        if x.dim() < 2:
            return x
        y = self.m(x)
        return y * self.m.count if self.read else y


@pytest.mark.parametrize("read", [False, True], ids=["unread", "read"])
@pytest.mark.parametrize("self_check", [True, False])
def test_a_submodule_replacing_its_buffer_is_refused_on_the_torch_export_path(read, self_check):
    """``self.count = self.count + 1`` in a submodule: torch.export drops the new value (an add nobody reads) and
    puts the module back, so the write went unseen: accepted where unread, and where read refused as a forward
    that 'depends on its batch size' (the self-check's calls saw the count move)."""
    torch.manual_seed(0)
    model = _Outer("replace", read).double().eval()
    count = model.m.count
    with pytest.raises(UnsupportedOperation, match="the forward writes the model's own 'm.count'"):
        pathir.compile(model, input_shape=(4,), self_check=self_check)
    assert model.m.count is count and float(model.m.count) == 0.0


class _BatchBranch(nn.Module):
    """Branches on the batch size beyond every size a probe runs (fx cannot trace it: torch.export's path)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        if x.shape[0] > 6:
            return self.b(torch.relu(self.a(x)))
        return self.b(torch.relu(-self.a(x)))


def test_a_branch_on_the_batch_size_is_refused_not_fixed_to_the_traced_one():
    net = _BatchBranch().double()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(UnsupportedOperation, match=r"branches on its batch size.*2 <= batch and batch <= 6"):
        pathir.compile(net, input_shape=(3,))
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())


class _ScalesInputInPlace(nn.Module):
    """``x /= 255`` on its input, then a per-sample net; ``**kwargs`` keeps torch.fx out (torch.export's path)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x, **kwargs):
        x /= 255.0
        return self.b(torch.relu(self.a(x)))


def test_a_forward_scaling_its_input_in_place_is_per_sample_on_the_export_path():
    """The eager probes start from inputs the reference run has not divided (they were refused as depending on
    the batch size)."""
    torch.manual_seed(0)
    net = _ScalesInputInPlace().double()
    cm = pathir.compile(net, input_shape=(3,))
    x = torch.randn(7, 3, dtype=torch.float64)
    torch.testing.assert_close(torch.as_tensor(cm.forward(x.numpy())), net(x.clone()), rtol=1e-12, atol=1e-12)


class _WeightFromParam(nn.Module):
    """A linear layer whose weight the forward computes from a parameter; ``**kwargs``: torch.export's path."""

    def __init__(self, expr: str):
        super().__init__()
        self.expr = expr
        self.w, self.v = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(2, 4, 3))
        self.b = nn.Linear(4, 2)

    def forward(self, x, **kwargs):
        w = {"scaled": lambda: 2 * self.w, "indexed": lambda: self.v[0], "cast": lambda: self.w.float().double(),
             "sum": lambda: self.w + 0 * self.w}[self.expr]()
        return self.b(torch.relu(torch.nn.functional.linear(x, w)))


@pytest.mark.parametrize("expr,name", [("scaled", "w"), ("indexed", "v"), ("cast", "w"), ("sum", "w")])
def test_a_weight_computed_from_a_parameter_is_refused_naming_it_on_the_export_path(expr, name):
    with pytest.raises(UnsupportedOperation, match=f"computes with the model's tensor '{name}'"):
        pathir.compile(_WeightFromParam(expr).double(), input_shape=(3,))


class _LenReshape(nn.Module):
    """``x.reshape(len(x), -1)``: torch.export makes the batch size a constant, with no branch (``if x.dim()``
    keeps torch.fx out)."""

    def __init__(self):
        super().__init__()
        self.c, self.l = nn.Conv2d(2, 3, 3), nn.Linear(3 * 4 * 4, 2)

    def forward(self, x):
        if x.dim() == 4:
            x = torch.relu(self.c(x))
        return self.l(x.reshape(len(x), -1))


def test_len_of_the_batch_in_a_reshape_is_per_sample_and_compiles():
    torch.manual_seed(0)
    net = _LenReshape().double()
    cm = pathir.compile(net, input_shape=(2, 6, 6))
    x = torch.randn(7, 2, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(torch.as_tensor(cm.forward(x.numpy())), net(x), rtol=1e-12, atol=1e-12)
