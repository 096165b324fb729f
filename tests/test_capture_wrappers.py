"""Wrappers users put around a module: ``torch.compile(model)`` and ``nn.DataParallel(model)`` are
read through to the module they wrap (the same graph, path-norms and write-back as the module
itself), and a TorchScript module is refused (see test_input_errors)."""

import pytest
import torch
import torch.nn as nn

import pathir


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(12, 2)).double().eval()


@pytest.mark.parametrize("wrap", [nn.DataParallel, lambda m: torch.compile(m, backend="eager")],
                         ids=["DataParallel", "torch.compile"])
def test_a_wrapped_module_compiles_to_the_modules_own_numbers_and_write_back_reaches_it(wrap):
    inner, plain = _net(), _net()
    model = wrap(inner)
    cm, ref = pathir.compile(model, input_shape=(2, 6, 6)), pathir.compile(plain, input_shape=(2, 6, 6))
    for q in (1, 2):
        assert cm.path_norm(q) == pytest.approx(ref.path_norm(q), rel=1e-12)
    x = torch.randn(4, 2, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        before = plain(x)
        cm.pathcond()
        after = model(x)
    assert torch.allclose(after, before, rtol=1e-10, atol=1e-12)
    moved = [k for k, v in inner.state_dict().items() if not torch.equal(v, plain.state_dict()[k])]
    assert moved  # the wrapped module itself was rescaled (its batch-norm takes the factors)


class _OptionalArgs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.o = torch.nn.Linear(4, 5), torch.nn.Linear(5, 2)

    def forward(self, x, logits_only=None, mask=None, *, temp=None):
        h = self.a(x).relu()
        if mask is not None:
            h = h * mask
        if temp is None:
            h = h * 2
        h = self.o(h)
        return h if logits_only is None else h.relu()


def test_arguments_pathir_does_not_feed_are_traced_as_their_defaults():
    """fx made each a Proxy, which is never None: the trace took the branches eager never does (a final ReLU
    the model does not apply, silently; a mask refused as a gate)."""
    import numpy as np

    torch.manual_seed(0)
    net = _OptionalArgs().double().eval()
    with torch.no_grad():
        net.o.bias.fill_(5.0)  # positive outputs near 0: the final ReLU shows only on large inputs
    cm = pathir.compile(net, input_shape=(4,))
    x = 100 * torch.randn(16, 4, dtype=torch.float64)
    np.testing.assert_allclose(cm.forward(x.numpy()), net(x).detach().numpy(), rtol=1e-12, atol=1e-12)


class _TakesKeywords(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.o = torch.nn.Linear(4, 5), torch.nn.Linear(5, 2)

    def forward(self, x, **kw):  # (kw unread: fx traced it as an input; read, fx's trace failed and fell back)
        return self.o(self.a(x).relu())


def test_a_forward_taking_keyword_arguments_is_captured_as_called_without_them():
    """forward(self, x, **kw): fx made kw one more input and refused the model as taking two inputs; torch.export
    (the fallback) calls it without them, as pathir's input_shape does. Checked against the model's forward and
    the path-norm written out by hand."""
    import numpy as np

    torch.manual_seed(0)
    net = _TakesKeywords().double().eval()
    cm = pathir.compile(net, input_shape=(4,))
    x = torch.randn(8, 4, dtype=torch.float64)
    np.testing.assert_allclose(cm.forward(x.numpy()), net(x).detach().numpy(), rtol=1e-12, atol=1e-12)
    a, o = net.a, net.o
    with torch.no_grad():  # (|W|q layer by layer on ones, biases as inputs of constant 1: docs/math.md)
        ones = (o.weight.abs() @ (a.weight.abs() @ torch.ones(4, dtype=torch.float64) + a.bias.abs())
                + o.bias.abs()).sum()
    assert cm.path_norm(1) == pytest.approx(float(ones), rel=1e-12)


class _WritesItsInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.o = torch.nn.Linear(4, 5), torch.nn.Linear(5, 2)

    def forward(self, x):
        x[:, 0] = 0  # writes the caller's tensor: torch.export returns its new value as an output first
        return self.o(self.a(x).relu())


def test_an_input_the_forward_writes_is_not_one_of_the_graphs_outputs():
    """The functionalized graph's input-mutation output became a graph output: the self-check refused 'the
    model returns 1 tensors, the IR 2', and without it path-norms counted the input's identity paths."""
    import numpy as np

    torch.manual_seed(0)
    net = _WritesItsInput().double()
    cm = pathir.compile(net, input_shape=(4,))
    assert len(cm.graph.outputs) == 1
    x = torch.randn(3, 4, dtype=torch.float64)
    np.testing.assert_allclose(cm.forward(x.numpy()), net(x.clone()).detach().numpy(), rtol=1e-12, atol=1e-12)


def test_a_torch_compiled_submodule_is_read_through_and_rescaled():
    """torch.compile at the root was read through; as a submodule fx ran into dynamo's raw RuntimeError."""
    import numpy as np

    class Sub(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2)))

        def forward(self, x):
            return self.inner(x)

    torch.manual_seed(0)
    net = Sub().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    with torch.no_grad():
        before = net.inner._orig_mod(x)
    cm = pathir.compile(net, input_shape=(4,))
    np.testing.assert_allclose(cm.forward(x.numpy()), before.numpy(), rtol=1e-12, atol=1e-12)
    cm.commit_rescaling(np.random.default_rng(0).normal(size=len(cm.units)))
    with torch.no_grad():
        torch.testing.assert_close(net.inner._orig_mod(x), before, rtol=1e-12, atol=1e-12)


def test_a_module_from_torch_export_is_refused_saying_what_to_pass():
    """Its train() and eval() raise: pathir's mode switch surfaced torch's raw NotImplementedError."""
    exported = torch.export.export(torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU()), (torch.randn(2, 4),))
    with pytest.raises(pathir.PathirError, match="torch.export"):
        pathir.compile(exported.module(), input_shape=(4,))


@pytest.mark.parametrize("how", ["prune", "weight_norm"])
def test_a_parametrized_weight_on_the_export_path_is_refused_saying_why(how):
    """Forced onto torch.export (a hook on the root module), a weight computed from parameters was refused
    naming internal ATen ops ('_assert_tensor_metadata ... outside the ReLU DAG model')."""
    import torch.nn.utils.prune as prune

    net = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    if how == "prune":
        prune.l1_unstructured(net[2], "weight", 0.5)
    else:
        torch.nn.utils.parametrizations.weight_norm(net[2])
    net.register_forward_hook(lambda mod, i, o: o * 2)
    with pytest.raises(pathir.UnsupportedOperation, match="computes a tensor from the parameter.*parametrization"):
        pathir.compile(net, input_shape=(4,))


def test_a_table_of_weights_indexed_in_the_forward_is_refused_naming_the_table():
    """efficientvit's attention biases (self.biases[:, self.idx]) were refused as 'a parametrization'."""
    class Table(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)
            self.table = torch.nn.Parameter(torch.randn(5))
            self.register_buffer("idx", torch.tensor([0, 2, 4]))

        def forward(self, x):
            return torch.relu(self.fc(x)) + self.table[self.idx]

    model = Table()
    model.register_forward_hook(lambda mod, i, o: o * 2)  # onto torch.export
    with pytest.raises(pathir.UnsupportedOperation, match="'table'.*indexed in the forward"):
        pathir.compile(model, input_shape=(4,))


def test_a_forward_that_branches_on_activation_values_is_refused_in_pathirs_words():
    """torch.export's GuardOnDataDependentSymNode text was the whole message."""

    class Branch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.o = torch.nn.Linear(4, 5), torch.nn.Linear(5, 2)

        def forward(self, x):
            h = self.a(x).relu()
            if h.sum() > 0:
                h = h * 2
            return self.o(h)

    with pytest.raises(pathir.PathirError, match="depends on the values of a tensor"):
        pathir.compile(Branch(), input_shape=(4,))


def test_a_data_parallel_inside_the_model_is_read_through_and_written_back():
    """As a submodule it was a torch.nn leaf with no row: refused "outside the ReLU DAG model"."""

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = nn.DataParallel(_net()), nn.Linear(2, 3).double()

        def forward(self, x):
            return self.head(torch.relu(self.body(x)))

    model = Outer().eval()
    cm = pathir.compile(model, input_shape=(2, 6, 6))
    ref = pathir.compile(nn.Sequential(_net(), nn.ReLU(), model.head).eval(), input_shape=(2, 6, 6))
    assert cm.path_norm(1) == pytest.approx(ref.path_norm(1), rel=1e-12)
    x = torch.randn(4, 2, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        before = model(x)
        cm.pathcond(progress=False)
        assert torch.allclose(model(x), before, rtol=1e-10, atol=1e-12)
    assert any(not torch.equal(a, b) for a, b in zip(model.body.module.parameters(), _net().parameters()))


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.lin2(torch.relu(self.lin1(x)))


def _scaled(self, x, scale):
    return self.lin2(torch.relu(self.lin1(x))) * scale


def _l1_path_norm(net):
    """‖Φ‖₁ by definition: the |θ| network (biases |b|) on an all-ones input, summed."""
    w1, b1, w2, b2 = (p.detach().abs() for p in (net.lin1.weight, net.lin1.bias, net.lin2.weight, net.lin2.bias))
    return float((w2 @ (w1 @ torch.ones(3, dtype=w1.dtype) + b1) + b2).sum())


@pytest.mark.parametrize("where", ["root partial", "root method", "leaf lambda"])
def test_a_forward_set_on_the_instance_is_the_one_compiled(where):
    """fx traces the class's forward at the root and lowers a torch.nn leaf by its class: an instance's own
    forward (functools.partial, a bound method of another function, a lambda) was read as the class's, a
    silent wrong answer with self_check=False. It is now captured through torch.export, which calls it."""
    import functools
    import types

    torch.manual_seed(0)
    net = _Mlp().double()
    if where == "root partial":
        net.forward = functools.partial(_scaled, net, scale=3.0)
    elif where == "root method":
        net.forward = types.MethodType(lambda self, x: _scaled(self, x, 3.0), net)
    else:
        lin2 = net.lin2
        lin2.forward = lambda h: nn.Linear.forward(lin2, h) * 3.0
    expected = 3.0 * _l1_path_norm(net)  # every path ends in lin2, which the factor 3 follows (its bias too)
    x = torch.randn(5, 3, dtype=torch.float64)
    for self_check in (True, False):
        cm = pathir.compile(net, input_shape=(3,), self_check=self_check)
        with torch.no_grad():
            assert torch.allclose(torch.as_tensor(cm.forward(x.numpy())), net(x), rtol=1e-12, atol=1e-12)
        assert cm.path_norm(1) == pytest.approx(expected, rel=1e-12)


class _Tied(nn.Module):
    def __init__(self, hook):
        super().__init__()
        self.a, self.m1, self.m2, self.b = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.m2.weight = self.m1.weight
        if hook:  # the model's own hook: torch.export reads it
            self.register_forward_hook(lambda m, i, o: None)

    def forward(self, x):
        return self.b(torch.relu(self.m2(torch.relu(self.m1(torch.relu(self.a(x)))))))


def test_tied_weights_read_through_torch_export_are_the_fx_graphs():
    """torch.export's lifted parameters name every registration of a tied weight; pathir's table of the model's
    tensors had the first only (KeyError: 'm2.weight', reported as 'please report it')."""
    torch.manual_seed(0)
    fx, exported = _Tied(False).double(), _Tied(True).double()
    exported.load_state_dict(fx.state_dict())
    a, b = pathir.compile(fx, input_shape=(3,)), pathir.compile(exported, input_shape=(3,))
    assert b.path_norm(2) == pytest.approx(a.path_norm(2), rel=1e-12)
    x = torch.randn(5, 3, dtype=torch.float64)
    with torch.no_grad():
        before = exported(x)
        b.pathcond()
        assert torch.allclose(exported(x), before, rtol=1e-10, atol=1e-12)
        assert exported.m1.weight is exported.m2.weight


@pytest.mark.parametrize("weight", ["made in forward", "a buffer's view"])
def test_a_constant_weight_read_through_torch_export_is_exact(weight):
    """A float tensor computed from no activation came through as a bare tensor where a layer reads a weight:
    AttributeError ('Tensor' object has no attribute 'tensor'), reported as 'please report it'."""

    class Fixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)
            self.register_buffer("k", torch.rand(16, dtype=torch.float64))
            self.register_forward_hook(lambda m, i, o: None)

        def forward(self, x):
            w = torch.eye(4, dtype=torch.float64) * 0.5 if weight == "made in forward" else self.k.view(4, 4)
            return self.b(torch.nn.functional.linear(torch.relu(self.a(x)), w))

    torch.manual_seed(0)
    model = Fixed().double()
    x = torch.randn(5, 3, dtype=torch.float64)
    cm = pathir.compile(model, input_shape=(3,))
    assert torch.allclose(torch.as_tensor(cm.forward(x.numpy())), model(x), rtol=1e-12, atol=1e-12)


def test_a_no_grad_block_read_through_torch_export_is_refused_by_its_reason():
    """torch.export makes the block a subgraph, which pathir looked up on the model (AttributeError: 'submod_1',
    reported as 'please report it'); torch.fx, which records no grad mode, reads it exactly."""

    class NoGrad(nn.Module):
        def __init__(self, hook):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)
            if hook:
                self.register_forward_hook(lambda m, i, o: None)

        def forward(self, x):
            h = torch.relu(self.a(x))
            with torch.no_grad():
                return self.b(h)

    from pathir.errors import UnsupportedOperation

    with pytest.raises(UnsupportedOperation, match="subgraph of its own"):
        pathir.compile(NoGrad(True), input_shape=(3,))
    assert pathir.compile(NoGrad(False), input_shape=(3,)).path_norm(1) > 0


def test_torch_cond_on_activation_values_is_refused_by_what_it_reads():
    """pathir's write watch (a dispatch mode around compile) had no rule for torch.cond: the model's own forward
    failed under it, and the refusal blamed the model ('Cond itself fails on a batch of input_shape')."""

    class Cond(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x):
            h = torch.relu(self.a(x))
            return self.b(torch.cond(h.sum() > 0, lambda t: t * 2, lambda t: t * 3, (h,)))

    from pathir.errors import InputShapeError, UnsupportedOperation

    with pytest.raises(UnsupportedOperation) as info:
        pathir.compile(Cond().double(), input_shape=(3,))
    assert not isinstance(info.value, InputShapeError) and "itself fails" not in str(info.value)


@pytest.mark.parametrize("wrap", [nn.DataParallel, lambda m: torch.compile(m, backend="eager")],
                         ids=["DataParallel", "torch.compile"])
@pytest.mark.parametrize("how", ["weight_norm", "legacy_weight_norm", "prune"])
def test_a_wrapped_model_with_a_derived_weight_reads_as_the_bare_one(wrap, how):
    """Wrapped at the root, fx failed on the wrapper and torch.export cannot read weight_norm or pruning: the
    model was refused with reasons that were not the cause (a root hook, a write through a view)."""
    from torch.nn.utils import parametrizations, prune

    def build():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 2)).double()
        if how == "weight_norm":
            parametrizations.weight_norm(net[2])
        elif how == "legacy_weight_norm":
            with pytest.warns(FutureWarning):
                torch.nn.utils.weight_norm(net[2])
        else:
            prune.l1_unstructured(net[2], "weight", amount=0.5)
        return net

    inner, plain = build(), build()
    model = wrap(inner)
    cm, ref = pathir.compile(model, input_shape=(4,)), pathir.compile(plain, input_shape=(4,))
    for q in (1, 2):
        assert cm.path_norm(q) == pytest.approx(ref.path_norm(q), rel=1e-12)
    x = torch.randn(6, 4, dtype=torch.float64)
    with torch.no_grad():
        before = plain(x)
        cm.pathcond()
        assert torch.allclose(model(x), before, rtol=1e-10, atol=1e-12)


def test_functional_call_over_another_modules_tensors_reads_the_tensors_it_runs_with():
    """fx read the called module's own parameters, not those functional_call put in their place: equal at
    compile, the self-check passed, and once the fast weights moved path_norm stayed at the old 2.14 (34.7)."""
    from torch.func import functional_call

    class Fast(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(2)
            self.net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).double()
            self.fast = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).double()
            self.fast.load_state_dict(self.net.state_dict())

        def forward(self, x):
            return functional_call(self.net, dict(self.fast.named_parameters()), (x,))

    def l1(seq):  # the definition: the |θ| network on an all-ones input
        h = torch.ones(1, 4, dtype=torch.float64)
        h = torch.relu(h @ seq[0].weight.abs().T + seq[0].bias.abs())
        return float((h @ seq[2].weight.abs().T + seq[2].bias.abs()).sum())

    model = Fast().eval()
    cm = pathir.compile(model, input_shape=(4,))
    assert cm.path_norm(1) == pytest.approx(l1(model.fast), rel=1e-12)
    with torch.no_grad():
        for p in model.fast.parameters():
            p.mul_(3.0)
    assert cm.path_norm(1) == pytest.approx(l1(model.fast), rel=1e-12)
    x = torch.randn(5, 4, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(torch.as_tensor(cm.forward(x.numpy())), model(x), rtol=1e-12, atol=1e-12)


def test_a_data_parallel_subclass_with_a_forward_of_its_own_is_read_by_that_forward():
    """Unwrapped to its module, DataParallel(...)'s subclass lost its forward (x3 and a head of its own)."""
    class Scaled(nn.DataParallel):
        def forward(self, x):
            return super().forward(x) * 3

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)).double()
    cm, bare = pathir.compile(Scaled(inner), input_shape=(4,)), pathir.compile(inner, input_shape=(4,))
    assert cm.path_norm(1) == pytest.approx(3 * bare.path_norm(1), rel=1e-12)


class _TrainHead(nn.Module):
    """An aux head its forward returns in train mode only."""

    def __init__(self):
        super().__init__()
        self.a, self.o, self.aux = nn.Linear(4, 5), nn.Linear(5, 2), nn.Linear(5, 2)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return (self.o(h), self.aux(h)) if self.training else self.o(h)


def test_a_wrapper_in_train_mode_around_a_module_in_eval_mode_reads_the_eval_forward():
    """DataParallel(m).train() with m.eval(): the forward runs m in eval, yet the heads forward (its aux head an
    output) was lowered from the wrapper's flag: path-norm 5.73 for the 2.75 of the function run."""
    torch.manual_seed(0)
    inner = _TrainHead().double().eval()
    wrapped = nn.DataParallel(inner)
    wrapped.training = True  # the wrapper's flag alone (train() would set the module's too)
    cm = pathir.compile(wrapped, input_shape=(4,))
    assert cm.graph.outputs == ("module.o",)
    assert cm.path_norm(1) == pytest.approx(pathir.compile(inner, input_shape=(4,)).path_norm(1), rel=1e-12)


@pytest.mark.parametrize("outer_train", [True, False], ids=["train_around_eval", "eval_around_train"])
def test_mixed_train_flags_lower_the_forward_as_the_flags_stand(outer_train):
    """An Outer(nn.Module) in train mode around an eval-mode model with an aux head: the heads forward was lowered
    from the root's flag (path-norm 5.49 for the 2.10 of the function run); the other way round the head was
    missing from the graph."""
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = _TrainHead()

        def forward(self, x):
            return self.inner(x)

    torch.manual_seed(0)
    model = Outer().double()
    model.training, model.inner.training = outer_train, not outer_train
    cm = pathir.compile(model, input_shape=(4,))
    runs = model(torch.zeros(1, 4, dtype=torch.float64))
    assert len(cm.graph.outputs) == (1 if isinstance(runs, torch.Tensor) else len(runs))
    assert (model.training, model.inner.training) == (outer_train, not outer_train)


def _doubling_backend(gm, example_inputs):
    """A dynamo backend whose code computes twice what the module's Python forward does."""
    def run(*args):
        out = gm(*args)
        return type(out)(2 * t for t in out) if isinstance(out, (tuple, list)) else 2 * out
    return run


def _failing_backend(gm, example_inputs):
    raise RuntimeError("no compiler here")


def test_a_torch_compiled_model_whose_code_differs_from_its_forward_is_refused():
    """The self-check ran the model under pathir's dispatch mode, where dynamo falls back to the Python forward: a
    compiled model whose code computes otherwise (dynamo's cache skipping a hook added after an identical module
    was compiled, torch review) compiled, and every number was the forward's, not the model's. It runs the compiled
    code too now."""
    from pathir.errors import SelfCheckFailed

    def mlp():
        return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double().eval()

    torch._dynamo.reset()
    with pytest.raises(SelfCheckFailed, match="torch.compile'd 'the model' computes other numbers"):
        pathir.compile(torch.compile(mlp(), backend=_doubling_backend), input_shape=(3,))
    torch._dynamo.reset()
    in_place = mlp()
    in_place.compile(backend=_doubling_backend)  # compiled in place (latest-commits review): the same check
    with pytest.raises(SelfCheckFailed, match="computes other numbers"):
        pathir.compile(in_place, input_shape=(3,))
    torch._dynamo.reset()
    failing = torch.compile(mlp(), backend=_failing_backend)
    with pytest.warns(UserWarning, match="did not run as compiled here"):
        pathir.compile(failing, input_shape=(3,))
    torch._dynamo.reset()


def test_a_hook_added_after_an_identical_module_was_compiled_is_in_the_numbers():
    """The torch review's case: dynamo's cached code of one compiled Sequential, reused for a second one whose
    first layer has a hook added since, skipped the hook; pathir reported the hooked forward's numbers while the
    model returned others. After compile, the Compiled and the model agree (or compile refuses)."""
    from pathir.errors import SelfCheckFailed

    torch._dynamo.reset()

    def mlp():
        return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double().eval()

    x = torch.randn(4, 3, dtype=torch.float64)
    with torch.no_grad():
        torch.compile(mlp(), backend="eager")(x)
    inner = mlp()
    inner[0].register_forward_hook(lambda mod, i, o: o * 2)
    model = torch.compile(inner, backend="eager")
    with torch.no_grad():
        model(x)
    try:
        cm = pathir.compile(model, input_shape=(3,))
    except SelfCheckFailed:
        return
    with torch.no_grad():
        assert torch.allclose(torch.as_tensor(cm.forward(x.numpy())), model(x), rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()
