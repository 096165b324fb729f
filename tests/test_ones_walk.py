"""The path-norm of convolutional networks on the torch backend (whose all-ones walk stores feature
maps along their constant runs, pathir.lifting.ones_walk) equals its definition: a float64 forward,
on the all-ones input, of the model with every weight and bias w made |w|^q, its max-pools made sums
over their windows and every average's coefficient c made |c|^q (docs/math.md §3)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
F = torch.nn.functional

import pathir  # noqa: E402
from pathir.lifting import ones_walk  # noqa: E402
from pathir.lifting.ones_walk import ones_forward  # noqa: E402
from pathir.testing import relu_dags  # noqa: E402


class Layer(torch.nn.Module):
    """One step of a random network: conv (+ ReLU), max-pool, average pool, or a residual block."""

    def __init__(self, kind, channels, out, k, stride, pad, dil, ceil, include_pad):
        super().__init__()
        self.kind, self.k, self.stride, self.pad, self.dil = kind, k, stride, pad, dil
        self.ceil, self.include_pad = ceil, include_pad
        if kind in ("conv", "residual"):
            self.conv = torch.nn.Conv2d(channels, out, k, stride, pad, dil, bias=True)
        if kind == "residual":
            self.skip = torch.nn.Conv2d(channels, out, 1, stride, 0, bias=False)
            self.second = torch.nn.Conv2d(out, out, 3, 1, 1, bias=False)

    def forward(self, x):
        if self.kind == "conv":
            return F.relu(self.conv(x))
        if self.kind == "residual":
            return F.relu(self.second(F.relu(self.conv(x))) + self.skip(x))
        if self.kind == "max":
            return F.max_pool2d(x, self.k, self.stride, self.pad, self.dil, self.ceil)
        return F.avg_pool2d(x, self.k, self.stride, self.pad, self.ceil, self.include_pad)

    def path_norm_network(self, x, q):
        """This step of the path-norm network (its weights |w|^q) on ``x``."""
        if self.kind in ("conv", "residual"):
            c = self.conv
            y = F.conv2d(x, c.weight.abs() ** q, c.bias.abs() ** q, c.stride, c.padding, c.dilation)
            if self.kind == "conv":
                return y
            y = F.conv2d(y, self.second.weight.abs() ** q, None, 1, 1)
            return y + F.conv2d(x, self.skip.weight.abs() ** q, None, self.stride)
        if self.kind == "max":
            return _window_sum(x, self.k, self.stride, self.pad, self.dil, self.ceil)
        # an average: Σ_window x / divisor; its divisor per output read off torch's own average of ones
        ones = torch.ones_like(x[:, :1])
        sums = F.avg_pool2d(ones, self.k, self.stride, self.pad, self.ceil, True, divisor_override=1)
        avgs = F.avg_pool2d(ones, self.k, self.stride, self.pad, self.ceil, self.include_pad)
        coeff = avgs / sums
        return F.avg_pool2d(x, self.k, self.stride, self.pad, self.ceil, True, divisor_override=1) * coeff ** q


def _window_sum(x, k, stride, pad, dil, ceil):
    """Σ over each max-pool window (torch's max-pool geometry, dilation included)."""
    windows = F.max_pool2d(torch.ones_like(x[:, :1]), k, stride, pad, dil, ceil, return_indices=True)[1]
    out = torch.zeros(x.shape[0], x.shape[1], *windows.shape[2:], dtype=x.dtype)
    n = x.shape[2] + 2 * pad
    padded = F.pad(x, (pad, pad, pad, pad))
    oh, ow = windows.shape[2:]
    for i in range(oh):
        for j in range(ow):
            for a in range(k):
                for b in range(k):
                    r, c = i * stride + a * dil, j * stride + b * dil
                    if r < n and c < padded.shape[3]:
                        out[:, :, i, j] += padded[:, :, r, c]
    return out


class Net(torch.nn.Module):
    def __init__(self, layers, channels, classes):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.fc = torch.nn.Linear(channels, classes)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))

    def path_sum(self, shape, q):
        """Σ_p |Φ_p|^q by its definition: the path-norm network's forward on the all-ones input, summed
        (a float64 tensor, autograd reaching the parameters; call it on the model made double)."""
        x = torch.ones(1, *shape, dtype=torch.float64)
        for layer in self.layers:
            x = layer.path_norm_network(x, q)
        n = x.shape[2] * x.shape[3]
        x = x.sum(dim=(2, 3)) * (1.0 / n) ** q
        return (x @ (self.fc.weight.abs() ** q).T + self.fc.bias.abs() ** q).sum()

    def path_norm(self, shape, q) -> float:
        """log10 ||Φ||_q by its definition, in float64."""
        with torch.no_grad():
            total = float(self.double().path_sum(shape, q))
        self.float()
        return math.log10(total) / q

    def diag_g(self, shape) -> dict:
        """diag G by its definition: g = ∂(Σ_p |Φ_p|²)/∂u at u = θ² (docs/math.md §6), read off autograd's
        ∂/∂θ = 2θ ∂/∂u of the q = 2 path-norm network, per parameter name."""
        named = list(self.double().named_parameters())
        grads = torch.autograd.grad(self.path_sum(shape, 2.0), [p for _, p in named])
        out = {name: (g / (2 * p)).detach().numpy() for (name, p), g in zip(named, grads)}
        self.float()
        return out


@st.composite
def networks(draw):
    channels = draw(st.integers(1, 3))
    size = draw(st.integers(12, 48))
    layers, c, n = [], channels, size
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["conv", "conv", "residual", "max", "avg"]))
        k = draw(st.integers(1, 4))
        stride = draw(st.integers(1, 3))
        pad = draw(st.integers(0, k // 2))
        dil = draw(st.integers(1, 2)) if kind in ("conv", "max") else 1
        ceil = draw(st.booleans()) if kind in ("max", "avg") else False
        if kind == "residual":
            k, pad, dil = 3, 1, 1
        span = dil * (k - 1) + 1
        if n + 2 * pad < span:
            break
        out = draw(st.integers(1, 3)) if kind in ("conv", "residual") else c
        layer = Layer(kind, c, out, k, stride, pad, dil, ceil, draw(st.booleans()))
        probe = layer(torch.zeros(1, c, n, n))
        if probe.shape[2] < 1:
            break
        layers.append(layer)
        c, n = out, probe.shape[2]
    seed = draw(st.integers(0, 2**16))
    net = Net(layers, c, draw(st.integers(1, 3)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return net, (channels, size, size)


@settings(max_examples=60, deadline=None)
@given(case=networks(), q=st.sampled_from([0.5, 1.0, 2.0, 3.0]))
def test_path_norm_equals_the_path_norm_networks_forward(case, q):
    net, shape = case
    cm = pathir.compile(net, input_shape=shape, self_check=False)
    assert cm.path_norm(q, log10=True) == pytest.approx(net.path_norm(shape, q), rel=0, abs=1e-12)


def test_large_maps_are_stored_along_their_runs():
    """A 3x3 conv stack on a 64x64 input: every stored map is a few border bands and one interior
    slice, and the path-norm is still its definition."""
    torch.manual_seed(0)
    layers = [Layer("conv", 3, 4, 3, 1, 1, 1, False, True), Layer("max", 4, 4, 2, 2, 0, 1, False, True),
              Layer("residual", 4, 4, 3, 2, 1, 1, False, True), Layer("avg", 4, 4, 3, 1, 1, 1, False, False)]
    net = Net(layers, 4, 2)
    shape = (3, 64, 64)
    cm = pathir.compile(net, input_shape=shape, self_check=False)
    view = cm.get_backend().power_view(1.0)
    acts = ones_forward(cm.graph, view, linearize=True)
    stored = {n.name: tuple(acts[n.name][0].shape[2:]) for n in cm.graph.nodes if len(n.shape) == 3}
    assert all(max(s) <= 16 for s in stored.values()), stored
    assert cm.path_norm(1.0, log10=True) == pytest.approx(net.path_norm(shape, 1.0), rel=0, abs=1e-12)


def test_several_q_in_step_equal_their_definitions():
    """cm.path_norms walks every q in step, a dense weight above the block size (4 MiB) read once for
    all of them: each value is still its definition."""
    torch.manual_seed(1)
    layers = [Layer("conv", 2, 3, 3, 1, 1, 1, False, True), Layer("max", 3, 3, 2, 2, 0, 1, False, True)]
    net = Net(layers, 3, 1)
    net.fc = torch.nn.Linear(3, 1)
    wide = torch.nn.Linear(3 * 20 * 20, 600)  # 720,000 weights: 5.5 MiB in float64, walked in blocks
    head = torch.nn.Linear(600, 2)

    class Wide(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers, self.wide, self.head = torch.nn.ModuleList(layers), wide, head

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(F.relu(self.wide(x.flatten(1))))

    model, shape = Wide(), (2, 40, 40)
    qs = (0.5, 1.0, 2.0, 4.0)
    cm = pathir.compile(model, input_shape=shape, self_check=False)
    norms = cm.path_norms(qs, log10=True)
    with torch.no_grad():
        for q in qs:
            x = torch.ones(1, *shape, dtype=torch.float64)
            for layer in model.double().layers:
                x = layer.path_norm_network(x, q)
            x = x.flatten(1) @ (wide.weight.abs() ** q).T + wide.bias.abs() ** q
            x = x @ (head.weight.abs() ** q).T + head.bias.abs() ** q
            assert norms[q] == pytest.approx(math.log10(float(x.sum())) / q, rel=0, abs=1e-12)
    model.float()


def _assert_diag_g_is_its_definition(net, shape):
    cm = pathir.compile(net, input_shape=shape, self_check=False)
    got, want = cm.diag_g(), net.diag_g(shape)
    assert got.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-10, atol=0, err_msg=name)


@settings(max_examples=40, deadline=None)
@given(case=networks())
def test_diag_g_equals_the_gradient_of_the_q2_networks_forward(case):
    """diag G's backward walk reads the forward maps stored along their runs (expanded per read) and
    drops each once walked: every entry is still ∂(Σ_p |Φ_p|²)/∂(θ²), by autograd on the definition."""
    _assert_diag_g_is_its_definition(*case)


def test_diag_g_reads_large_maps_from_their_runs(monkeypatch):
    """On a 64x64 input the backward walk's forward maps come stored along their runs (expanded when
    read), and diag G is still its definition."""
    torch.manual_seed(2)
    layers = [Layer("conv", 3, 4, 3, 1, 1, 1, False, True), Layer("max", 4, 4, 2, 2, 0, 1, False, True),
              Layer("residual", 4, 4, 3, 2, 1, 1, False, True), Layer("avg", 4, 4, 3, 1, 1, 1, False, False)]
    net = Net(layers, 4, 2)
    expanded, expand = [], ones_walk.expand

    def counting(backend, x, runs):
        expanded.append(runs.compressed)
        return expand(backend, x, runs)

    monkeypatch.setattr(ones_walk, "expand", counting)
    _assert_diag_g_is_its_definition(net, (3, 64, 64))
    assert sum(expanded) >= 4  # the conv, pool and residual inputs were read from their runs


@pytest.mark.parametrize("forget", [True, False])
def test_the_forward_walk_drops_each_converted_weight_after_its_node(forget):
    """With ``forget`` the walk's backend holds no |w|^q once the walk is done (one layer's at a time
    while it runs), and the values are the same either way."""
    torch.manual_seed(3)
    net = Net([Layer("conv", 3, 4, 3, 1, 1, 1, False, True), Layer("residual", 4, 4, 3, 2, 1, 1, False, True)], 4, 2)
    cm = pathir.compile(net, input_shape=(3, 16, 16), self_check=False)
    view = cm.get_backend().power_view(2.0)
    acts = ones_forward(cm.graph, view, linearize=True, forget=forget)
    weights = [e.map.weight for n in cm.graph.nodes for e in n.edges if e.map.weight is not None]
    held = [w for w in weights if w in view._cache]
    assert held == ([] if forget else weights)
    again = ones_forward(cm.graph, cm.get_backend().power_view(2.0), linearize=True, forget=not forget)
    for name, (m, L, runs) in acts.items():
        if m is not None:
            assert torch.equal(m, again[name][0]) and L == again[name][1]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), old=st.tuples(st.integers(0, 11), st.integers(1, 12)),
       new=st.tuples(st.integers(0, 11), st.integers(1, 12)), data=st.data())
def test_restoring_runs_as_pieces_is_the_gather_by_index(n, old, new, data):
    """Re-storing a map from one run to another inside it (the torch backend's concatenation of views) reads
    each full position's stored slice: the gather by the stored index of every kept position."""
    from pathir.backends.torch import TorchBackend
    from pathir.lifting.ones_walk import Runs, restore

    s0, c0 = min(old[0], n - 1), min(old[1], n - min(old[0], n - 1))
    s1 = data.draw(st.integers(s0, s0 + c0 - 1))
    c1 = data.draw(st.integers(1, s0 + c0 - s1))
    before, after = Runs((n,), [(s0, c0) if c0 > 1 else (0, 1)]), Runs((n,), [(s1, c1) if c1 > 1 else (0, 1)])
    x = torch.randn(2, 3, before.stored[0], dtype=torch.float64)
    got = restore(TorchBackend(), x, before, after)
    s, c = after.runs[0]
    kept = np.concatenate([np.arange(s + 1), np.arange(s + c, n)])
    want = x[:, :, torch.as_tensor(before.index(0, kept))]
    assert got.shape == want.shape and torch.equal(got, want)


# --------------------------------------------------------------------- maps made again in the backward

def _diag_g_close(graph, rtol=1e-10):
    from pathir.lifting.diag_g import diag_g

    got, want = diag_g(graph, "torch"), diag_g(graph, "numpy")  # numpy: the plain walk of the path view
    assert got.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=rtol, atol=1e-300, err_msg=name)


@settings(max_examples=60, deadline=None)
@given(graph=relu_dags(spatial_dims=(1, 2), max_depth=6))
def test_param_grads_with_maps_made_again_equal_the_plain_walks(graph):
    """The backward walk reads a node made by pointwise sums alone (a concatenation, a channel map, a scale)
    summed again from its sources' maps, not kept from the forward: diag G is still the plain walk's."""
    _diag_g_close(graph)


class DenseShuffle(torch.nn.Module):
    """A densenet layer pair (concatenations, a batch-norm after one: an unfolded scale) and a channel shuffle:
    nodes made by pointwise sums, chained three deep."""

    def __init__(self):
        super().__init__()
        self.a, self.bn = torch.nn.Conv2d(2, 2, 3, padding=1), torch.nn.BatchNorm2d(4)
        self.b, self.fc = torch.nn.Conv2d(4, 2, 1), torch.nn.Linear(6, 3)

    def forward(self, x):
        y1 = F.relu(self.a(x))
        z = F.relu(self.bn(torch.cat([x, y1], 1)))
        out = torch.cat([x, y1, F.relu(self.b(z))], 1)
        out = out.view(out.shape[0], 2, 3, *out.shape[2:]).transpose(1, 2).reshape(out.shape)  # shuffle
        return self.fc(F.adaptive_avg_pool2d(out, 1).flatten(1))


def test_a_dense_block_walks_its_concatenations_again_and_keeps_its_diag_g():
    torch.manual_seed(3)
    net = DenseShuffle().eval()
    with torch.no_grad():
        net.bn.running_mean.uniform_(-1, 1), net.bn.running_var.uniform_(0.5, 2), net.bn.weight.uniform_(-2, 2)
    cm = pathir.compile(net, input_shape=(2, 12, 12), self_check=False)
    stored = ones_forward(cm.graph, cm.get_backend().power_view(2.0), linearize=True)
    assert sum(v is ones_walk.RECOMPUTE for v in stored.values()) >= 3  # the concatenations and the scale
    _diag_g_close(cm.graph)
    outputs = ones_forward(cm.graph, cm.get_backend().power_view(2.0), linearize=True, keep="outputs")
    assert set(outputs) == set(cm.graph.outputs)
