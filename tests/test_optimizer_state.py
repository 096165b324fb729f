"""cm.pathcond / enorm / normalize / commit_rescaling(optimizer=opt): the optimizer's state moves with the
rescaling (pathir.rescaling.optimizer_state).

Checked against the definition: right after the call the model's function is unchanged and, for every
parameter and state entry scaled by s^-k, state ⊙ θ^k is what it was; a momentum buffer or first moment
built from one gradient equals, after transport, the rescaled model's own gradient (autograd); refusals
leave model and optimizer bit for bit as they were."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
nn = torch.nn

import pathir  # noqa: E402
from pathir.errors import PathirError  # noqa: E402
from pathir.rescaling.optimizer_state import STATE_POWERS, Transport  # noqa: E402

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam-amsgrad-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, foreach=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "rmsprop-centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, initial_accumulator_value=0.1),
}


class Block(nn.Module):
    """conv-bn-relu with a skip, then pool, flatten, linear: batch-norms, a residual add, a classifier."""

    def __init__(self, c=4):
        super().__init__()
        self.stem = nn.Conv2d(2, c, 3, padding=1)
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.head = nn.Linear(c * 4, 3)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        h = torch.relu(self.bn(self.conv(h)) + h)
        return self.head(nn.functional.max_pool2d(h, 2).flatten(1))


def _trained(model, make_opt, x, steps=2):
    """The model in eval mode and its optimizer after ``steps`` steps on a fixed loss (state for every param)."""
    opt = make_opt(model.parameters())
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    with torch.no_grad():  # random running statistics, so the folded batch-norm is no identity
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model.eval(), opt


def _snapshot(model, opt):
    params = {p: p.detach().clone() for p in model.parameters()}
    state = {p: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()} for p, s in opt.state.items()}
    return params, state


def _assert_transported(model, opt, snapshot, rtol=1e-9):
    """For every held state entry with power k: state ⊙ θ^k unchanged; k = 0 entries unchanged."""
    params, state = snapshot
    powers = STATE_POWERS[type(opt).__name__]
    moved = sum(int(not torch.equal(p.detach(), old)) for p, old in params.items())
    for p, old_state in state.items():
        for key, old in old_state.items():
            new = opt.state[p][key]
            if old is None:
                assert new is None
                continue
            k = powers[key]
            if k == 0:
                assert torch.equal(new, old), key
                continue
            before, after = old * params[p] ** k, new * p.detach() ** k
            assert torch.allclose(after, before, rtol=rtol, atol=1e-300), (key, float((after - before).abs().max()))
    assert moved > 0, "the rescaling moved no parameter: the check would be void"


def _assert_untouched(model, opt, snapshot):
    params, state = snapshot
    for p in model.parameters():
        assert torch.equal(p.detach(), params[p])
    for p, old_state in state.items():
        for key, old in old_state.items():
            new = opt.state[p][key]
            assert (new is None and old is None) or torch.equal(new, old), key


@pytest.mark.parametrize("method", ["pathcond", "enorm", "normalize"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_moves_with_the_rescaling_and_the_function_is_kept(name, method):
    torch.manual_seed(0)
    x = torch.randn(5, 2, 4, 4, dtype=torch.float64)
    model, opt = _trained(Block().double(), OPTIMIZERS[name], x)
    before, snap = model(x), _snapshot(model, opt)
    cm = pathir.compile(model, input_shape=(2, 4, 4))
    report = getattr(cm, method)(optimizer=opt)
    assert report.written
    assert torch.allclose(model(x), before, rtol=1e-10, atol=1e-12)
    _assert_transported(model, opt, snap)


def _rescaled_gradient_check(make_opt, expected):
    """One step with lr = 0 (θ unchanged) leaves state = expected(grad); after a transported rescaling the
    state equals expected(the rescaled model's own gradient on the same batch)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2)).double()
    x = torch.randn(7, 3, dtype=torch.float64)
    opt = make_opt(model.parameters())
    model(x).square().mean().backward()
    opt.step()
    cm = pathir.compile(model, input_shape=(3,))
    z = np.random.default_rng(0).normal(size=len(cm.units))
    cm.commit_rescaling(z, optimizer=opt)
    model.zero_grad()
    model(x).square().mean().backward()
    for p in model.parameters():
        for key, want in expected(p.grad).items():
            assert torch.allclose(opt.state[p][key], want, rtol=1e-10, atol=1e-15), key


def test_momentum_buffer_is_the_rescaled_models_gradient():
    _rescaled_gradient_check(lambda ps: torch.optim.SGD(ps, lr=0.0, momentum=0.9),
                             lambda g: {"momentum_buffer": g})


def test_adam_moments_are_the_rescaled_models_gradient_moments():
    _rescaled_gradient_check(lambda ps: torch.optim.Adam(ps, lr=0.0, betas=(0.8, 0.9), amsgrad=True),
                             lambda g: {"exp_avg": 0.2 * g, "exp_avg_sq": 0.1 * g * g, "max_exp_avg_sq": 0.1 * g * g})


#: optimizers whose state is built from gradients alone (no weight decay: with it the loss itself is not
#: rescaling-invariant, and no state moves exactly; no initial accumulator: Adagrad's is scaled with its sum);
#: RMSprop's eps tiny, so its momentum buffer follows g/√v
REPLAYED = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, eps=1e-300),
    "rmsprop-momentum": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9, eps=1e-300),
    "rmsprop-centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True, eps=1e-300),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
}


@pytest.mark.parametrize("name", list(REPLAYED))
def test_state_is_what_the_optimizer_builds_from_the_rescaled_gradients(name):
    """The definition, for every state entry: after three steps and a transported rescaling θ' = s ⊙ θ, the
    state equals that of a fresh optimizer fed the same three gradients in the new coordinates (g / s). (An
    RMSprop's momentum buffer was scaled by 1/s; it sums g / √v and does not move.)"""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2)).double()
    x = torch.randn(7, 3, dtype=torch.float64)
    opt = REPLAYED[name](model.parameters())
    grads = []
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    cm = pathir.compile(model, input_shape=(3,))
    cm.commit_rescaling(np.random.default_rng(0).uniform(-2, 2, size=len(cm.units)), optimizer=opt)
    scales = [p.detach() / old for p, old in zip(model.parameters(), before)]
    assert any(not torch.allclose(s, torch.ones_like(s)) for s in scales)
    twins = [nn.Parameter(torch.zeros_like(p)) for p in model.parameters()]
    fresh = REPLAYED[name](twins)
    for step in grads:
        for t, g, s in zip(twins, step, scales):
            t.grad = g / s
        fresh.step()
    for p, t in zip(model.parameters(), twins):
        for key, value in opt.state[p].items():
            if key != "step":
                assert torch.allclose(value, fresh.state[t][key], rtol=1e-10, atol=0), (key, p.shape)


def _mlp_and_adam(x, steps=2):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 2)).double()
    return _trained(model, OPTIMIZERS["adam"], x, steps)


class MyAdam(torch.optim.Adam):
    pass


@pytest.mark.parametrize("make_opt, match", [
    (lambda ps: torch.optim.Adamax(ps, lr=1e-2), "does not know how the state of the optimizer Adamax"),
    (lambda ps: MyAdam(ps, lr=1e-2), "optimizer MyAdam"),
])
def test_unknown_optimizer_with_state_is_refused_and_nothing_changes(make_opt, match):
    x = torch.randn(4, 3, dtype=torch.float64)
    torch.manual_seed(2)
    model, opt = _trained(nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 2)).double(), make_opt, x)
    snap = _snapshot(model, opt)
    cm = pathir.compile(model, input_shape=(3,))
    for method in ("pathcond", "enorm", "normalize"):
        with pytest.raises(PathirError, match=match):
            getattr(cm, method)(optimizer=opt)
        _assert_untouched(model, opt, snap)


def test_unknown_optimizer_without_state_and_unheld_params_are_fine():
    x = torch.randn(4, 3, dtype=torch.float64)
    model, _ = _mlp_and_adam(x, steps=0)
    before = model(x)
    opt = torch.optim.Adamax(model.parameters(), lr=1e-2)  # no step yet: nothing to move
    pathir.compile(model, input_shape=(3,)).pathcond(optimizer=opt)
    assert torch.allclose(model(x), before, rtol=1e-10)
    assert not opt.state
    held = torch.optim.SGD(list(model[0].parameters()), lr=0.1, momentum=0.9)  # the last layer is not held
    model(x).sum().backward()
    held.step()
    snap = _snapshot(model, held)
    pathir.compile(model, input_shape=(3,)).commit_rescaling(np.ones(6), optimizer=held)
    _assert_transported(model, held, snap)


def test_an_unknown_state_entry_is_refused_before_the_solver_runs():
    x = torch.randn(4, 3, dtype=torch.float64)
    model, opt = _mlp_and_adam(x)
    opt.state[model[0].weight]["my_trace"] = torch.zeros_like(model[0].weight)
    snap = _snapshot(model, opt)
    with pytest.raises(PathirError, match="'my_trace' has no known scaling"):
        pathir.compile(model, input_shape=(3,)).pathcond(optimizer=opt)
    _assert_untouched(model, opt, snap)


def test_optimizer_needs_a_torch_model_and_write_back():
    x = torch.randn(4, 3, dtype=torch.float64)
    model, opt = _mlp_and_adam(x)
    cm = pathir.compile(model, input_shape=(3,))
    with pytest.raises(PathirError, match="needs write_back=True"):
        cm.enorm(write_back=False, optimizer=opt)
    with pytest.raises(PathirError, match="needs a torch model; this Compiled holds a bare Graph"):
        pathir.compile(cm.graph).pathcond(optimizer=opt)
    with pytest.raises(PathirError, match="takes a torch.optim.Optimizer"):
        cm.pathcond(optimizer=object())


def test_a_failing_optimizer_write_restores_model_and_optimizer(monkeypatch):
    x = torch.randn(4, 3, dtype=torch.float64)
    model, opt = _mlp_and_adam(x)
    snap = _snapshot(model, opt)
    write = Transport.write

    def write_then_fail(self):
        write(self)
        raise RuntimeError("injected failure")

    monkeypatch.setattr(Transport, "write", write_then_fail)
    cm = pathir.compile(model, input_shape=(3,))
    graph = str(cm.graph)
    with pytest.raises(RuntimeError, match="injected failure"):
        cm.commit_rescaling(np.full(6, 0.7), optimizer=opt)
    _assert_untouched(model, opt, snap)
    assert str(cm.graph) == graph and np.array_equal(cm.graph.params()[0].value, model[0].weight.detach().numpy())


def test_a_failing_model_write_leaves_the_optimizer_untouched(monkeypatch):
    x = torch.randn(4, 3, dtype=torch.float64)
    model, opt = _mlp_and_adam(x)
    snap = _snapshot(model, opt)
    cm = pathir.compile(model, input_shape=(3,))

    def fail(graph, scales):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(cm.writer, "rescale", fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        cm.pathcond(optimizer=opt)
    _assert_untouched(model, opt, snap)


def test_state_that_would_overflow_its_dtype_is_refused():
    x = torch.randn(4, 3)
    torch.manual_seed(2)
    model, opt = _trained(nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 2)), OPTIMIZERS["adam"], x)
    opt.state[model[0].weight]["exp_avg_sq"][0, 0] = 1e37
    snap = _snapshot(model, opt)
    with pytest.raises(PathirError, match="'exp_avg_sq' of '0.weight' does not fit torch.float32"):
        pathir.compile(model, input_shape=(3,)).commit_rescaling(np.full(6, -8.0), optimizer=opt)  # s = e^-4
    _assert_untouched(model, opt, snap)


def test_state_that_would_fall_below_the_smallest_normal_is_refused_and_a_subnormal_one_moves():
    """exp_avg_sq ⊙ s^-2 landed on float32 subnormals (1.3 % off, no refusal) where the model's own tensors refuse
    that (optimizer review); an entry already subnormal (a long-dead weight's second moment) moves as it is."""
    x = torch.randn(4, 3)
    torch.manual_seed(2)
    model, opt = _trained(nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 2)), OPTIMIZERS["adam"], x)
    opt.state[model[2].weight]["exp_avg_sq"][0, 0] = 1e-37
    snap = _snapshot(model, opt)
    with pytest.raises(PathirError, match="'exp_avg_sq' of '2.weight' does not fit torch.float32.*smallest normal"):
        pathir.compile(model, input_shape=(3,)).commit_rescaling(np.full(6, -8.0), optimizer=opt)  # s^-2 = e^-8
    _assert_untouched(model, opt, snap)
    opt.state[model[2].weight]["exp_avg_sq"][0, 0] = 1e-39  # subnormal already
    pathir.compile(model, input_shape=(3,)).commit_rescaling(np.full(6, -1.0), optimizer=opt)
    assert 0 < float(opt.state[model[2].weight]["exp_avg_sq"][0, 0]) < 1e-39


def test_an_optimizer_of_another_model_is_refused_and_nothing_changes():
    """An optimizer that stepped a copy of the model was accepted: the model rescaled, the optimizer stepping it
    kept its state in the old coordinates (optimizer review)."""
    x = torch.randn(4, 3, dtype=torch.float64)
    model, opt = _mlp_and_adam(x)
    copy_model, other = _mlp_and_adam(x)
    snap = _snapshot(model, opt)
    with pytest.raises(PathirError, match="holds none of this model's parameters"):
        pathir.compile(model, input_shape=(3,)).pathcond(optimizer=other)
    _assert_untouched(model, opt, snap)


def test_a_frozen_backbone_with_the_optimizer_of_its_head_is_written():
    """Fine-tuning: the compiled backbone frozen, the optimizer over a head outside it. No optimizer steps the
    backbone, so there is no state to move; the check above refused it (session review)."""
    torch.manual_seed(0)
    backbone, head = nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 4)).double(), nn.Linear(4, 2).double()
    backbone.requires_grad_(False)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    x = torch.randn(5, 3, dtype=torch.float64)
    head(backbone(x)).sum().backward()
    opt.step()
    before, state = backbone(x), {k: v.clone() for k, v in opt.state[head.weight].items()}
    pathir.compile(backbone, input_shape=(3,)).pathcond(optimizer=opt)
    assert torch.allclose(backbone(x), before, rtol=1e-10)
    assert all(torch.equal(v, state[k]) for k, v in opt.state[head.weight].items())


def _weight_normed(layer_index):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2)).double()
    nn.utils.parametrizations.weight_norm(model[layer_index], dim=0)
    return model


def test_weight_norm_with_one_factor_per_row_moves_g_state_only():
    """The first layer reads the (pinned) input: its factor is one per output row, so only g moves, linearly."""
    x = torch.randn(4, 3, dtype=torch.float64)
    model, opt = _trained(_weight_normed(0), OPTIMIZERS["sgd-momentum"], x)
    before, snap = model(x), _snapshot(model, opt)
    pathir.compile(model, input_shape=(3,)).pathcond(optimizer=opt)
    assert torch.allclose(model(x), before, rtol=1e-10)
    _assert_transported(model, opt, snap)
    v = model[0].parametrizations.weight.original1
    assert torch.equal(opt.state[v]["momentum_buffer"], snap[1][v]["momentum_buffer"])


def test_weight_norm_moved_by_a_ratio_of_norms_is_refused_when_its_state_is_held():
    x = torch.randn(4, 3, dtype=torch.float64)
    model, opt = _trained(_weight_normed(2), OPTIMIZERS["adam"], x)
    snap = _snapshot(model, opt)
    cm = pathir.compile(model, input_shape=(3,))
    with pytest.raises(PathirError, match=r"'2.weight' is weight-normalized .* not constant on its norm slices"):
        cm.pathcond(optimizer=opt)
    _assert_untouched(model, opt, snap)
    cm.pathcond()  # without the optimizer the model itself can be rescaled


def test_pruned_model_moves_the_state_of_weight_orig():
    x = torch.randn(4, 3, dtype=torch.float64)
    model, opt = _mlp_and_adam(x)
    cm = pathir.compile(model, input_shape=(3,))
    cm.prune(0.3)
    before, snap = model(x), _snapshot(model, opt)
    cm.pathcond(optimizer=opt)
    assert torch.allclose(model(x), before, rtol=1e-10)
    _assert_transported(model, opt, snap)


# ------------------------------------------------------------------ random models, random rescalings


class RandomNet(nn.Module):
    """Dense layers of random widths, optional biases, batch-norms and skip adds between equal widths."""

    def __init__(self, widths, bias, bn, skips):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(widths[:-1], widths[1:]))
        self.bns = nn.ModuleList(nn.BatchNorm1d(b) if bn else nn.Identity() for b in widths[1:-1])
        self.skips = skips

    def forward(self, x):
        for i, layer in enumerate(self.layers[:-1]):
            h = torch.relu(self.bns[i](layer(x)))
            x = h + x if self.skips and h.shape == x.shape else h
        return self.layers[-1](x)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(widths=st.lists(st.integers(1, 5), min_size=3, max_size=5), bias=st.booleans(), bn=st.booleans(),
       skips=st.booleans(), name=st.sampled_from(sorted(OPTIMIZERS)), seed=st.integers(0, 2**16))
def test_random_models_and_rescalings_keep_state_times_param(widths, bias, bn, skips, name, seed):
    torch.manual_seed(seed)
    x = torch.randn(6, widths[0], dtype=torch.float64)
    model, opt = _trained(RandomNet(widths, bias, bn, skips).double().train(), OPTIMIZERS[name], x)
    for m in model.bns:
        if isinstance(m, nn.BatchNorm1d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    before, snap = model(x), _snapshot(model, opt)
    cm = pathir.compile(model, input_shape=(widths[0],))
    z = np.random.default_rng(seed).uniform(-1.5, 1.5, size=len(cm.units))
    if not len(z):
        return
    cm.commit_rescaling(z, optimizer=opt)
    assert torch.allclose(model(x), before, rtol=1e-9, atol=1e-12)
    _assert_transported(model, opt, snap)


def test_momentum_sgd_after_a_transported_rescaling_is_momentum_sgd_with_lr_over_s_squared():
    """Equivariance over several steps: from θ' = s ⊙ θ with buffer m / s, momentum SGD steps are, mapped back by
    1/s, the steps of momentum SGD from θ with buffer m and per-entry learning rate lr / s² (∇L' = ∇L / s)."""
    import copy

    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2)).double()
    x, y = torch.randn(16, 3, dtype=torch.float64), torch.randn(16, 2, dtype=torch.float64)
    loss = lambda m: ((m(x) - y) ** 2).mean()  # noqa: E731
    lr, mu = 0.05, 0.9
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=mu)
    for _ in range(2):
        opt.zero_grad()
        loss(model).backward()
        opt.step()
    ref = copy.deepcopy(model)
    buffers = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    pathir.compile(model, input_shape=(3,)).enorm(optimizer=opt)
    s = [(p / q).detach() for p, q in zip(model.parameters(), ref.parameters())]
    assert max(float((f - 1).abs().max()) for f in s) > 0.1
    for _ in range(3):
        opt.zero_grad()
        loss(model).backward()
        opt.step()
        ref.zero_grad()
        loss(ref).backward()
        with torch.no_grad():
            for q, m, f in zip(ref.parameters(), buffers, s):
                m.mul_(mu).add_(q.grad)
                q.sub_(lr * m / f**2)
    for p, q, f in zip(model.parameters(), ref.parameters(), s):
        assert torch.allclose(p, f * q, rtol=1e-9, atol=1e-12)
    assert torch.allclose(model(x), ref(x), rtol=1e-9)


@pytest.mark.parametrize("method", ["pathcond", "enorm", "normalize"])
def test_the_grad_of_the_last_backward_moves_with_the_rescaling(method):
    """∇L' = ∇L / s: after the rescaling each .grad equals autograd's gradient of the same loss at the rescaled
    model, with no optimizer passed."""
    tnn = torch.nn
    torch.manual_seed(0)
    net = tnn.Sequential(tnn.Linear(4, 6), tnn.ReLU(), tnn.Linear(6, 6), tnn.ReLU(), tnn.Linear(6, 2)).double()
    with torch.no_grad():
        net[0].weight.mul_(torch.logspace(-2, 1, 6, dtype=torch.float64)[:, None])  # something for it to move
    x = torch.randn(16, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def loss():
        return net(x).square().mean()

    loss().backward()
    before = [p.detach().clone() for p in net.parameters()]
    getattr(pathir.compile(net, input_shape=(4,)), method)(progress=False)
    assert any(not torch.equal(a, p) for a, p in zip(before, net.parameters()))  # it did move
    moved = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    loss().backward()
    for got, want in zip(moved, (p.grad for p in net.parameters())):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_failed_rescaling_puts_the_grads_back():
    tnn = torch.nn
    torch.manual_seed(0)
    net = tnn.Sequential(tnn.Linear(4, 6), tnn.ReLU(), tnn.Linear(6, 2)).double()
    with torch.no_grad():
        net[0].weight.mul_(torch.logspace(-2, 1, 6, dtype=torch.float64)[:, None])
    armed = []

    def hook(module, inputs, output):
        if armed:
            raise RuntimeError("the write-back's function check fails")

    net[2].register_forward_hook(hook)
    cm = pathir.compile(net, input_shape=(4,))
    net(torch.randn(8, 4, dtype=torch.float64)).sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    armed.append(True)
    with pytest.raises(Exception, match="function check fails"):
        cm.pathcond(progress=False)
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), grads))


def _grad_kinds():
    return {
        "expanded": lambda p: torch.full((1,), 0.5, dtype=p.dtype).expand(p.shape),
        "inference": lambda p: _inference_copy(p),
        "sparse": lambda p: torch.ones_like(p).to_sparse(),
    }


def _inference_copy(p):
    with torch.inference_mode():
        return torch.ones_like(p)


@pytest.mark.parametrize("kind", ["expanded", "inference", "sparse"])
def test_a_grad_that_cannot_be_rescaled_in_place_is_refused_with_model_grads_and_state_untouched(kind):
    """An expanded .grad (one memory location for many entries), one made under inference_mode, a sparse one:
    each is refused by name before anything is written. The expanded one failed mid-write, and the undo,
    failing on it again, stopped there: momentum buffers and other grads stayed rescaled."""
    tnn = torch.nn
    torch.manual_seed(0)
    net = tnn.Sequential(tnn.Linear(4, 6), tnn.ReLU(), tnn.Linear(6, 5), tnn.ReLU(), tnn.Linear(5, 3)).double()
    with torch.no_grad():
        net[2].weight.mul_(7.0)
    x = torch.randn(8, 4, dtype=torch.float64)
    net, opt = _trained(net, lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), x)
    opt.zero_grad()
    net(x).square().mean().backward()
    net[0].bias.grad = _grad_kinds()[kind](net[0].bias)
    cm = pathir.compile(net, input_shape=(4,))
    snapshot = _snapshot(net, opt)
    grads = {p: p.grad.clone() for p in net.parameters()}
    with pytest.raises(PathirError, match=f"grad of a parameter of shape \\(6,\\).*{kind if kind != 'sparse' else 'sparse'}"):
        cm.pathcond(optimizer=opt, progress=False)
    _assert_untouched(net, opt, snapshot)
    for p, g in grads.items():
        assert torch.equal(p.grad.to_dense(), g.to_dense())


def test_an_undo_that_fails_on_one_tensor_puts_back_all_the_others():
    a, b, c = torch.zeros(3), torch.full((1,), 1.0).expand(3), torch.zeros(3)
    plan = Transport(updates=[(None, "grad", a, torch.ones(3)), (None, "grad", b, torch.ones(3)),
                              (None, "grad", c, torch.ones(3))])
    plan._written = [(None, "grad", t, torch.full((3,), 9.0)) for t in (a, b, c)]
    with pytest.raises(RuntimeError):
        plan.undo()
    assert torch.equal(a, torch.full((3,), 9.0)) and torch.equal(c, torch.full((3,), 9.0))


def _mlp_trained():
    """A 3-layer MLP whose hidden layer is far from balanced (ENorm moves it), after two SGD-momentum steps;
    the output layer's entries are never rescaled."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6), nn.ReLU(), nn.Linear(6, 3)).double()
    with torch.no_grad():
        net[2].weight.mul_(torch.exp(2 * torch.randn(6, 1, dtype=torch.float64)))
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        net(torch.randn(16, 5, dtype=torch.float64)).square().mean().backward()
        opt.step()
    return net, opt


@pytest.mark.parametrize("alias, match", [("state", "shares memory"), ("other param's state", "shares memory"),
                                          ("same object", "one tensor is")])
def test_a_state_tensor_over_another_ones_memory_is_refused(alias, match):
    """A momentum buffer that is a view of one the rescaling moves, or that very tensor: scaling that one in place
    would change it silently (the output bias is never rescaled; the first layer's weight by other factors than
    the second's)."""
    net, opt = _mlp_trained()
    opt.zero_grad(set_to_none=True)
    if alias == "state":
        opt.state[net[4].bias]["momentum_buffer"] = opt.state[net[2].bias]["momentum_buffer"][:3]
    elif alias == "same object":
        opt.state[net[4].bias]["momentum_buffer"] = opt.state[net[2].bias]["momentum_buffer"]  # one object, two params
    else:
        flat = torch.zeros(70, dtype=torch.float64)  # two weights' buffers over overlapping halves of one
        opt.state[net[2].weight]["momentum_buffer"] = flat[:42].view(6, 7)
        opt.state[net[0].weight]["momentum_buffer"] = flat[35:].view(7, 5)
        flat.normal_()
    cm = pathir.compile(net, input_shape=(5,))
    before = _snapshot(net, opt)
    with pytest.raises(PathirError, match=match):
        cm.enorm(optimizer=opt)
    _assert_untouched(net, opt, before)


def test_grads_as_views_of_one_flat_buffer():
    """Gradients laid in one flat buffer (as DDP's gradient buckets lay them): disjoint views move exactly, each
    by its own parameter's factor; overlapping ones are refused."""
    net, _ = _mlp_trained()
    x = torch.randn(8, 5, dtype=torch.float64)
    params = list(net.parameters())
    flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    net.zero_grad()
    net(x).square().mean().backward()
    start = 0
    for p in params:
        view = flat[start:start + p.numel()].view_as(p)
        view.copy_(p.grad)
        p.grad = view
        start += p.numel()
    old = {p: (p.detach().clone(), p.grad.clone()) for p in params}
    cm = pathir.compile(net, input_shape=(5,))
    cm.enorm()
    for p in params:  # grad ⊙ θ is what it was (∇L' = ∇L / s)
        theta, grad = old[p]
        torch.testing.assert_close(p.grad * p.detach(), grad * theta, rtol=1e-10, atol=1e-14)
    net[4].bias.grad = flat[1:4]  # overlaps the first layer's weight gradient
    net[0].weight.data.mul_(3.0)  # unbalanced again: ENorm moves the first hidden layer
    net[2].weight.data.div_(3.0)
    cm = pathir.compile(net, input_shape=(5,))
    before = [t.detach().clone() for t in net.state_dict().values()]
    grads = [p.grad.clone() for p in params]
    with pytest.raises(PathirError, match="shares memory"):
        cm.enorm()
    assert all(torch.equal(a, b) for a, b in zip(before, net.state_dict().values()))
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, params))


def test_disjoint_strided_gradients_and_an_unmoved_sparse_one_are_written():
    """Column blocks of one buffer interleave in memory without sharing a byte, as do x[:, 0::2] and x[:, 1]: their
    byte ranges meet, and the check refused them; an unused sparse Embedding's sparse .grad made every write raise
    torch's NotImplementedError (no strided memory to read). Against the definition: grad ⊙ θ unchanged."""
    body, _ = _mlp_trained()

    class WithSide(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.side = body, nn.Embedding(10, 4, sparse=True).double()

        def forward(self, x):
            return self.body(x)

    net = WithSide()
    net.side(torch.tensor([1, 2])).sum().backward()  # a sparse .grad the rescaling never moves
    body.zero_grad()
    net(torch.randn(8, 5, dtype=torch.float64)).square().mean().backward()
    w0, w2 = body[0].weight, body[2].weight  # (7, 5) and (6, 7)
    buf = torch.zeros(7, 11, dtype=torch.float64)
    buf[:, :5].copy_(w0.grad)
    w0.grad = buf[:, :5]
    cols = torch.zeros(6, 14, dtype=torch.float64)
    cols[:, 0::2].copy_(w2.grad)
    cols[:, 1].copy_(body[2].bias.grad)
    w2.grad, body[2].bias.grad = cols[:, 0::2], cols[:, 1]  # interleaved columns of one buffer
    moved = list(body.parameters())
    old = {p: (p.detach().clone(), p.grad.clone()) for p in moved}
    cm = pathir.compile(net, input_shape=(5,))
    cm.enorm()
    for p in moved:
        theta, grad = old[p]
        torch.testing.assert_close(p.grad * p.detach(), grad * theta, rtol=1e-10, atol=1e-14)
    assert any(not torch.equal(p.detach(), old[p][0]) for p in moved)
