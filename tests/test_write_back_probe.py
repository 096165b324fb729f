"""A rescaling written into a torch model keeps its function, checked on a probe after the write.

Each model here reads a tensor the writer rescales somewhere pathir's graph does not see it: running
statistics shared by a folded and a kept batch-norm (one buffer, or a shallow copy of the module), a
kept batch-norm's running variance also used as a constant factor, a clip threshold buffer also
multiplied in. The write rules alone changed the output by 1-44 %; every write is now refused with the
model untouched. Also: a transposed convolution's flipped mask prunes (was a torch ValueError)."""

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pathir
from pathir.errors import PathirError


class _SharedStats(nn.Module):
    """``bn`` folded into ``c1``; ``bn2`` (after a ReLU) kept; one running statistic is one buffer."""

    def __init__(self, shared: str):
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.c2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)
        if shared == "module":
            self.bn2 = copy.copy(self.bn)  # a second module holding the same tensors
        else:
            setattr(self.bn2, shared, getattr(self.bn, shared))

    def forward(self, x):
        h = F.relu(self.bn(self.c1(x)))
        return self.fc(self.bn2(F.relu(self.c2(h))).mean((2, 3)))


class _StatsAsFactor(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.c2, self.fc = nn.Conv2d(4, 4, 3, padding=1), nn.Linear(4, 2)

    def forward(self, x):
        h = self.bn(F.relu(self.c1(x)))  # kept: its running statistics are rescaled
        h = F.relu(self.c2(h)) / self.bn.running_var.sqrt().view(1, -1, 1, 1)  # and read as a constant
        return self.fc(h.mean((2, 3)))


class _ThresholdAsFactor(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.o = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.register_buffer("t", torch.tensor([0.7, 1.2, 0.9, 1.5]))
        with torch.no_grad():
            self.a.weight.mul_(3)

    def forward(self, x):
        h = torch.minimum(F.relu(self.a(x)), self.t)  # a clipped ReLU whose threshold buffer is rescaled
        return self.o(F.relu(self.b(h)) * self.t)  # and read as a constant factor


def _random_stats(net):
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 2)
                m.bias.uniform_(-1, 1)
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    return net


CASES = {
    "running_var shared": (lambda: _random_stats(_SharedStats("running_var")), (3, 6, 6)),
    "running_mean shared": (lambda: _random_stats(_SharedStats("running_mean")), (3, 6, 6)),
    "a shallow copy of the batch-norm": (lambda: _random_stats(_SharedStats("module")), (3, 6, 6)),
    "running_var read as a factor": (lambda: _random_stats(_StatsAsFactor()), (3, 6, 6)),
    "threshold read as a factor": (_ThresholdAsFactor, (3,)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES)
def test_a_write_that_would_change_the_function_is_refused_untouched(case, dtype):
    build, shape = CASES[case]
    torch.manual_seed(0)
    net = build().to(dtype).eval()
    if case == "running_var shared":
        net.bn2.running_var = net.bn.running_var  # .to() makes new buffers: tie them again
    elif case == "running_mean shared":
        net.bn2.running_mean = net.bn.running_mean
    state = copy.deepcopy(net.state_dict())
    x = torch.randn(8, *shape, dtype=dtype)
    with torch.no_grad():
        before = net(x)
    cm = pathir.compile(net, input_shape=shape)
    z = np.random.default_rng(0).normal(scale=2, size=len(cm.units))
    if case == "a shallow copy of the batch-norm":  # γ, β tied too: move only the kept one's input, so
        z = np.array([1.5 if n.startswith("c2:") else 0.0 for n in cm.units.names])  # their factors agree
    with pytest.raises(PathirError, match="output 0 moved by"):
        cm.commit_rescaling(z)
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())
    with torch.no_grad():
        assert torch.equal(net(x), before)


def test_a_transposed_convolution_is_pruned_through_its_flipped_mask():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU(), nn.ConvTranspose2d(4, 3, 3), nn.ReLU(), nn.Flatten(),
                        nn.Linear(3 * 7 * 7, 2))
    weight = net[2].weight.detach().clone()
    report = pathir.compile(net, input_shape=(3, 5, 5)).prune(0.3)
    zeroed = int((net[2].weight == 0).sum() - (weight == 0).sum())
    assert report.per_tensor["2.weight"][0] == zeroed > 0
    kept = net[2].weight != 0
    assert torch.equal(net[2].weight[kept], weight[kept])


class _KeptStats(nn.Module):
    """``bn`` after a ReLU: kept, so a rescaling writes its running statistics (the probe runs)."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn, self.c2, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1), \
            nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(F.relu(self.c2(self.bn(F.relu(self.c1(x))))).mean((2, 3)))


def _forwards(monkeypatch):
    from pathir.frontends.torch.function_kept import Probe

    calls, run = [], Probe._outputs
    monkeypatch.setattr(Probe, "_outputs", lambda self: calls.append(1) or run(self))
    return calls


def test_the_first_write_reads_its_before_from_the_self_check_and_the_next_from_the_last_write(monkeypatch):
    torch.manual_seed(0)
    net = _random_stats(_KeptStats()).eval()
    x = torch.randn(5, 3, 6, 6)
    with torch.no_grad():
        before = net(x)
    cm = pathir.compile(net, input_shape=(3, 6, 6))
    calls = _forwards(monkeypatch)
    z = np.random.default_rng(0).normal(size=len(cm.units))
    cm.commit_rescaling(z)
    assert len(calls) == 1  # the "after" forward only: "before" was compile's self-check
    cm.commit_rescaling(-z)
    assert len(calls) == 2  # "before" was the last write's "after"
    with torch.no_grad():
        torch.testing.assert_close(net(x), before, rtol=1e-4, atol=1e-5)
        net.bn.running_mean.add_(0.1)  # a change autograd sees: the stamp moves, "before" runs again
        moved = net(x)
    cm.commit_rescaling(z)
    assert len(calls) == 4
    with torch.no_grad():
        torch.testing.assert_close(net(x), moved, rtol=1e-4, atol=1e-5)


def test_a_change_the_stamp_cannot_see_is_written_again_against_a_fresh_forward(monkeypatch):
    """An edit through ``.data`` bumps no version: the recorded "before" is stale, the check fails against
    it, and the write is put back and done again, checked against a fresh forward (no false refusal)."""
    torch.manual_seed(0)
    net = _random_stats(_KeptStats()).eval()
    cm = pathir.compile(net, input_shape=(3, 6, 6))
    net.bn.running_mean.data.add_(3.0)  # the function moves; no version does
    cm.refresh()
    x = torch.randn(5, 3, 6, 6)
    with torch.no_grad():
        before = net(x)
    calls = _forwards(monkeypatch)
    cm.commit_rescaling(np.random.default_rng(1).normal(size=len(cm.units)))
    assert len(calls) == 3  # after (against the stale record), then before and after afresh
    with torch.no_grad():
        torch.testing.assert_close(net(x), before, rtol=1e-4, atol=1e-5)


def test_a_refusal_against_a_recorded_before_is_confirmed_by_a_fresh_forward(monkeypatch):
    torch.manual_seed(0)
    net = _random_stats(_StatsAsFactor()).eval()
    state = copy.deepcopy(net.state_dict())
    cm = pathir.compile(net, input_shape=(3, 6, 6))
    calls = _forwards(monkeypatch)
    with pytest.raises(PathirError, match="output 0 moved by") as info:
        cm.commit_rescaling(np.random.default_rng(0).normal(scale=2, size=len(cm.units)))
    assert "recorded" not in str(info.value) and len(calls) == 3
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())


# ------------------------------------------------------------ tensors over one memory


class _TiedAE(nn.Module):
    """``dec.weight`` a new Parameter over ``enc.weight``'s memory (the tied-autoencoder idiom)."""

    def __init__(self):
        super().__init__()
        self.enc, self.dec, self.out = nn.Linear(4, 3), nn.Linear(3, 4), nn.Linear(4, 2)
        self.dec.weight = nn.Parameter(self.enc.weight.data.t())

    def forward(self, x):
        return self.out(F.relu(self.dec(F.relu(self.enc(x)))))


class _BufferOverBias(nn.Module):
    """A buffer over a bias's memory, read as a constant factor: only parameters are written."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.out = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2)
        self.register_buffer("gate", self.b.bias.data)

    def forward(self, x):
        return self.out(F.relu(self.b(F.relu(self.a(x)))) * self.gate)


class _ConvOverConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.fc = nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 3, 3, padding=1), nn.Linear(3, 2)
        self.c2.weight = nn.Parameter(self.c1.weight.data)

    def forward(self, x):
        return self.fc(F.relu(self.c2(F.relu(self.c1(x)))).mean((2, 3)))


class _Expanded(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(3, 2)
        self.a.weight = nn.Parameter(torch.randn(1, 4).expand(3, 4))

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


class _DisjointViews(nn.Module):
    """Weight and bias as disjoint slices of one flat buffer (as flattened-parameter trainers keep them):
    one memory, no entry read twice, so a write is exact."""

    def __init__(self):
        super().__init__()
        flat = torch.randn(4 * 3 + 3)
        self.a, self.b = nn.Linear(4, 3), nn.Linear(3, 2)
        self.a.weight = nn.Parameter(flat[:12].view(3, 4))
        self.a.bias = nn.Parameter(flat[12:])

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


SHARED = {"a Parameter over another's .data": (_TiedAE, (4,), "same memory"),
          "a buffer over a bias": (_BufferOverBias, (4,), "shares memory with"),
          "a conv weight over another's": (_ConvOverConv, (3, 5, 5), "same memory"),
          "an expanded weight": (_Expanded, (4,), "stride 0")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", SHARED)
def test_tensors_over_one_memory_are_refused_untouched(case, dtype):
    build, shape, words = SHARED[case]
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)  # built in the dtype: .to() would copy and untie the memory
    try:
        net = build().eval()
    finally:
        torch.set_default_dtype(torch.float32)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(8, *shape, dtype=dtype)
    with torch.no_grad():
        before = net(x)
    cm = pathir.compile(net, input_shape=shape)
    for method in (lambda: cm.commit_rescaling(np.random.default_rng(0).normal(size=len(cm.units))), cm.pathcond):
        with pytest.raises(PathirError, match=words):
            method()
        assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())
        with torch.no_grad():
            assert torch.equal(net(x), before)


def test_disjoint_views_of_one_memory_are_written_exactly():
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        net = _DisjointViews().eval()
    finally:
        torch.set_default_dtype(torch.float32)
    x = torch.randn(8, 4, dtype=torch.float64)
    with torch.no_grad():
        before = net(x)
    cm = pathir.compile(net, input_shape=(4,))
    cm.commit_rescaling(np.random.default_rng(0).normal(size=len(cm.units)))
    with torch.no_grad():
        torch.testing.assert_close(net(x), before, rtol=1e-12, atol=1e-12)


def test_a_user_pass_that_changes_the_params_makes_write_backs_refused():
    """normalize (a registered pass) keeps the function but moves the values: PathCond solved on its graph
    and written onto the model's own tensors left the model worse conditioned, its report saying better."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).double()
    state = copy.deepcopy(net.state_dict())
    cm = pathir.compile(net, input_shape=(4,), passes=["normalize"])
    assert cm.transformed_by == ("normalize",)
    for method in (cm.pathcond, lambda: cm.prune(0.5), lambda: cm.commit_rescaling(np.zeros(len(cm.units)))):
        with pytest.raises(PathirError, match="'normalize' changed the graph"):
            method()
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())
    assert cm.pathcond(write_back=False).objective_after <= cm.pathcond(write_back=False).objective_before
    kept = pathir.compile(net, input_shape=(4,), passes=[lambda g: g])  # a pass that keeps them: written as before
    assert kept.transformed_by == ()
    kept.pathcond()


@pytest.mark.parametrize("derive", ["apply", "rescaled"])
def test_a_compiled_derived_by_apply_or_rescaled_writes_nothing_back(derive):
    """cm.apply(pass) and cm.rescaled(z) hold params the model does not: pruning masks chosen on them pruned the
    model's 5 largest weights, and a PathCond computed on a normalised graph was written onto the raw one."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).double()
    state = copy.deepcopy(net.state_dict())
    cm = pathir.compile(net, input_shape=(4,))
    if derive == "apply":
        derived, name = cm.apply("normalize"), "'normalize'"
        assert cm.apply(lambda g: g).transformed_by == ()  # a pass that keeps every param: nothing recorded
    else:
        derived, name = cm.rescaled(np.linspace(-1.0, 1.0, len(cm.units))), "'rescaled\\(z\\)'"
    for method in (derived.pathcond, lambda: derived.prune(0.5, criterion="magnitude"), derived.equalize):
        with pytest.raises(PathirError, match=f"{name} changed the graph"):
            method()
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())
    assert derived.pathcond(write_back=False).objective_after <= derived.pathcond(write_back=False).objective_before


def test_a_write_inside_parametrize_cached_is_refused_untouched():
    """A weight-normed layer kept its cached weight while its neighbours were rescaled: off by 2 %."""
    import torch.nn.utils.parametrize as P
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 2)).double().eval()
    weight_norm(net[2])
    state = copy.deepcopy(net.state_dict())
    with P.cached():
        cm = pathir.compile(net, input_shape=(4,))
        with pytest.raises(PathirError, match="parametrize.cached"):
            cm.commit_rescaling(np.random.default_rng(0).normal(size=len(cm.units)))
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())
    cm.commit_rescaling(np.random.default_rng(0).normal(size=len(cm.units)))  # outside: written


def test_a_user_pass_that_changes_the_function_is_named_by_the_self_check_and_the_write_back():
    """The self-check blamed 'a pathir bug' for a user's rounding pass; the probe, after a pass that drops a
    branch, blamed running statistics. Both now name the user's passes."""
    from pathir.errors import SelfCheckFailed

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).double()

    def rounding(g):
        return g.map_params(lambda p: p.with_value(np.round(p.value * 2) / 2))

    with pytest.raises(SelfCheckFailed, match="compile ran your passes \\['rounding'\\] before this check"):
        pathir.compile(net, input_shape=(4,), passes=[rounding])

    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x):
            h = torch.relu(self.fc1(x))
            return self.fc2(h) + h  # the skip ties h to the output: no unit

    def drop_skip(g):  # structure only: every param kept as it is
        return g.replace_nodes([dataclasses.replace(n, edges=tuple(e for e in n.edges if e.map.kind.value != "identity"))
                                for n in g.nodes])

    res = Res().double()
    with torch.no_grad():
        res.fc1.weight.mul_(10)
    state = copy.deepcopy(res.state_dict())
    cm = pathir.compile(res, input_shape=(3,)).apply(drop_skip)
    # a pass that keeps every param byte for byte but drops an edge is recorded: pruning masks (whose function
    # change is meant, so no probe can tell) were written with a bound the model then broke by 155x
    assert cm.passes_run == ("drop_skip",) and cm.transformed_by == ("drop_skip",) and len(cm.units) == 3
    for method in (cm.pathcond, lambda: cm.prune(3), cm.equalize):
        with pytest.raises(PathirError, match="'drop_skip' changed the graph"):
            method()
    assert all(torch.equal(state[k], v) for k, v in res.state_dict().items())
    renamed = pathir.compile(res, input_shape=(3,)).apply(
        lambda g: g.replace_nodes([dataclasses.replace(n, origin="elsewhere") for n in g.nodes]))
    assert renamed.transformed_by == ()  # descriptions only: written as before


class _KeptNorm(nn.Module):
    """A batch-norm after a ReLU (kept, its running statistics moved by a rescaling), its variance 1 ulp from
    where (v + eps) - eps rounds: the old write moved it though z = 0 (dpn68: six tensors, "rescaled" by nothing)."""

    def __init__(self):
        super().__init__()
        self.c, self.b, self.o = nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3, eps=1e-3), nn.Linear(3 * 36, 2)
        with torch.no_grad():
            self.b.running_var.copy_(torch.tensor([0.9997221827507019, 0.999999999, 0.7]))

    def forward(self, x):
        return self.o(torch.relu(self.b(torch.relu(self.c(x)))).flatten(1))


def test_a_zero_rescaling_leaves_every_tensor_bit_for_bit():
    torch.manual_seed(0)
    net = _KeptNorm().double().eval()
    state = copy.deepcopy(net.state_dict())
    cm = pathir.compile(net, input_shape=(2, 8, 8))
    cm.commit_rescaling(np.zeros(len(cm.units)))
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())


def test_a_deep_rescaling_keeps_a_kept_batch_norm_to_float64_precision():
    """var + (λ² − 1)(var + eps), an intermediate version, lost float64 digits as λ fell (z = −18: the output 2e-9
    off, z = −22 a false refusal); λ²(var + eps) − eps keeps them (and λ = 1 leaves var as it was)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.BatchNorm1d(6), nn.Linear(6, 3), nn.ReLU(),
                        nn.Linear(3, 2)).double().eval()  # (the batch-norm after the ReLU: kept, its statistics moved)
    with torch.no_grad():
        net[2].running_var.uniform_(0.5, 1.5)
    var = net[2].running_var.clone()
    x = torch.randn(5, 4, dtype=torch.float64)
    with torch.no_grad():
        before = net(x)
    cm = pathir.compile(net, input_shape=(4,))
    cm.commit_rescaling(np.full(len(cm.units), -18.0))
    assert not torch.equal(net[2].running_var, var)  # the formula is exercised
    with torch.no_grad():
        assert float((net(x) - before).abs().max() / before.abs().max()) < 1e-12
