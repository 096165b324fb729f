"""The torch backend against the numpy backend (the definition), and both against autograd.

- every MapKind over random geometries: torch apply / adjoint / weight_grad equal
  numpy's to 1e-12 relative; <M x, y> = <x, M^T y>; adjoint and weight_grad equal
  torch.autograd of the map (both backends);
- k-max-pool nodes (k = 1, 2, 3);
- whole graphs built with GraphBuilder (every map kind, max-pools k = 1 and 2,
  biases, a shared weight): ``forward``, ``path_forward``, ``path_backward``;
- the same parity on CUDA where a GPU is present;
- the device cache of Params, array conversions, clear errors.
"""

import gc
import math
import weakref
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pathir.backends import get_backend
from pathir.backends.numpy import NumpyBackend
from pathir.backends.torch import TorchBackend
from pathir.errors import BackendError
from pathir.ir import (
    PARAMETERIZED,
    ChannelMap,
    Conv,
    Dense,
    Edge,
    FixedConv,
    Gather,
    GraphBuilder,
    Identity,
    MapKind,
    Node,
    NodeKind,
    Param,
    Pool,
    Resample,
    Reshape,
    Scale,
    SpatialMatrix,
)
from pathir.lifting.path_norm import path_norm
from pathir.lifting.walk import forward, path_backward, path_forward
from pathir.passes import maxpool_to_sum, path_view

NB = NumpyBackend()
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
TOL = 1e-12
KINDS = [pytest.param(k, id=k.value) for k in MapKind]


def rel_err(ref, got) -> float:
    """max |ref - got| / max |ref| (infinities must agree exactly)."""
    ref, got = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
    assert ref.shape == got.shape, (ref.shape, got.shape)
    inf = np.isinf(ref)
    np.testing.assert_array_equal(np.isinf(got), inf)
    np.testing.assert_array_equal(got[inf], ref[inf])
    ref, got = ref[~inf], got[~inf]
    scale = max(float(np.abs(ref).max(initial=0.0)), 1e-300)
    return float(np.abs(ref - got).max(initial=0.0)) / scale


# --------------------------------------------------------------- random maps


def _geometry(draw, n, with_ceil):
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(n))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(n))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(n))
    padding = tuple((draw(st.integers(0, 2)), draw(st.integers(0, 2))) for _ in range(n))
    top = 2 if n == 3 else 4
    spatial = tuple(
        max(1, d * (k - 1) + 1 - a - b) + draw(st.integers(0, top))
        for k, d, (a, b) in zip(kernel, dilation, padding)
    )
    ceil = draw(st.booleans()) if with_ceil else False
    return kernel, stride, dilation, padding, spatial, ceil


def _small_shape(draw, min_dims=1, max_dims=3):
    return tuple(draw(st.lists(st.integers(1, 4), min_size=min_dims, max_size=max_dims)))


@st.composite
def map_cases(draw, kinds=tuple(MapKind)):
    """(map, in_shape, rng) for a random map of one of ``kinds``."""
    kind = draw(st.sampled_from(kinds))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind is MapKind.IDENTITY:
        return Identity(), _small_shape(draw), rng
    if kind is MapKind.RESHAPE:
        s = _small_shape(draw, 2)
        target = draw(st.sampled_from([(math.prod(s),), tuple(reversed(s)), (s[0], math.prod(s[1:]))]))
        return Reshape(target), s, rng
    if kind is MapKind.CHANNEL_MAP:
        s = _small_shape(draw)
        index = tuple(draw(st.lists(st.integers(-1, s[0] - 1), min_size=1, max_size=5)))
        return ChannelMap(index), s, rng
    if kind is MapKind.GATHER:
        s = _small_shape(draw)
        out = _small_shape(draw)
        index = rng.integers(-1, math.prod(s), size=math.prod(out))
        return Gather(index, out), s, rng
    if kind is MapKind.SPATIAL_MATRIX:
        s = _small_shape(draw, 2)
        out = _small_shape(draw, 1, 2)
        return SpatialMatrix(rng.normal(size=(math.prod(out), math.prod(s[1:]))), out), s, rng
    if kind is MapKind.DENSE:
        s = _small_shape(draw)
        return Dense(Param("w", rng.normal(size=(draw(st.integers(1, 5)), math.prod(s))))), s, rng
    if kind is MapKind.SCALE:
        s = _small_shape(draw)
        return Scale(Param("w", rng.normal(size=s[0]))), s, rng
    n = draw(st.integers(1, 3))
    kernel, stride, dilation, padding, spatial, ceil = _geometry(draw, n, kind is MapKind.POOL)
    if kind is MapKind.POOL:
        channels = draw(st.integers(1, 3))
        m = Pool(kernel, stride, padding, dilation, ceil)
        out = m.out_shape((channels, *spatial))[1:]
        if draw(st.booleans()):
            m = Pool(kernel, stride, padding, dilation, ceil, rng.uniform(0.1, 1.0, size=out))
        return m, (channels, *spatial), rng
    groups = draw(st.integers(1, 3))
    c_in, c_out = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    W = Param("w", rng.normal(size=(c_out, c_in // groups, *kernel)))
    return Conv(W, stride, padding, dilation, groups), (c_in, *spatial), rng


def _reference(m, x, w):
    """Map ``m`` with weight tensor ``w`` in torch ops (autograd flows to x and w)."""
    if m.kind is MapKind.DENSE:
        return x.reshape(x.shape[0], -1) @ w.T
    if m.kind is MapKind.SCALE:
        return x * w.reshape(1, -1, *([1] * (x.ndim - 2)))
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[x.ndim - 2]
    pads = [p for a_b in reversed(m.padding) for p in a_b]
    return conv(F.pad(x, pads), w, None, m.stride, 0, m.dilation, m.groups)


# ------------------------------------------------------------- rule parity


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=40)
@given(data=st.data(), batch=st.integers(1, 3))
def test_rules_equal_numpy(device, kind, data, batch):
    m, s, rng = data.draw(map_cases(kinds=(kind,)))
    tb = TorchBackend(device)
    x = rng.normal(size=(batch, *s))
    y = NB.apply(m, x, s)
    assert tuple(y.shape) == (batch, *m.out_shape(s))
    g = rng.normal(size=y.shape)
    assert rel_err(y, tb.to_numpy(tb.apply(m, tb.asarray(x), s))) < TOL
    assert rel_err(NB.adjoint(m, g, s), tb.to_numpy(tb.adjoint(m, tb.asarray(g), s))) < TOL
    if m.kind in PARAMETERIZED:
        ref = NB.weight_grad(m, x, g, s)
        assert ref.shape == m.W.shape
        assert rel_err(ref, tb.to_numpy(tb.weight_grad(m, tb.asarray(x), tb.asarray(g), s))) < TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spatial", [(5,), (4, 3), (2, 3, 2)], ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("batch", [1, 3])
def test_pointwise_conv_by_matmul_equals_numpy(device, spatial, batch):
    """A 1 x 1 convolution at stride 1, unpadded and ungrouped (the torch backend's matmul path), and one just
    outside it (stride 2, padding 1, groups 2: torch's convolutions), against the numpy backend."""
    rng = np.random.default_rng(batch)
    n, tb = len(spatial), TorchBackend(device)
    for stride, pad, groups in [(1, 0, 1), (2, 0, 1), (1, 1, 1), (1, 0, 2)]:
        m = Conv(Param("w", rng.normal(size=(6, 4 // groups, *([1] * n)))), (stride,) * n, ((pad, pad),) * n,
                 (1,) * n, groups)
        s = (4, *spatial)
        x = rng.normal(size=(batch, *s))
        y = NB.apply(m, x, s)
        g = rng.normal(size=y.shape)
        assert rel_err(y, tb.to_numpy(tb.apply(m, tb.asarray(x), s))) < TOL
        assert rel_err(NB.adjoint(m, g, s), tb.to_numpy(tb.adjoint(m, tb.asarray(g), s))) < TOL
        assert rel_err(NB.weight_grad(m, x, g, s), tb.to_numpy(tb.weight_grad(m, tb.asarray(x), tb.asarray(g), s))) < TOL


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=25)
@given(data=st.data(), batch=st.integers(1, 3))
def test_adjoint_identity(backend, kind, data, batch):
    """<M x, y> = <x, M^T y>."""
    m, s, rng = data.draw(map_cases(kinds=(kind,)))
    be = get_backend(backend)
    x = rng.normal(size=(batch, *s))
    y = rng.normal(size=(batch, *m.out_shape(s)))
    lhs = float(np.sum(be.to_numpy(be.apply(m, be.asarray(x), s)) * y))
    rhs = float(np.sum(x * be.to_numpy(be.adjoint(m, be.asarray(y), s))))
    weights = 1.0 if m.weight is None else max(1.0, float(np.abs(m.weight.value).max()))
    scale = float(np.abs(x).sum() * np.abs(y).sum()) * weights
    assert abs(lhs - rhs) <= TOL * scale


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=25)
@given(data=st.data(), batch=st.integers(1, 3))
def test_adjoint_and_weight_grad_equal_autograd(backend, kind, data, batch):
    """M^T g = d<g, M x>/dx and weight_grad = d<g, M x>/dW by torch.autograd."""
    m, s, rng = data.draw(map_cases(kinds=(kind,)))
    be = get_backend(backend)
    x = torch.tensor(rng.normal(size=(batch, *s)), requires_grad=True)
    if m.kind in PARAMETERIZED:
        w = torch.tensor(m.W.value, requires_grad=True)
        y = _reference(m, x, w)
    else:  # the fixed map's own torch apply: autograd differentiates torch's ops, not our adjoint
        w, y = None, TorchBackend().apply(m, x, s)
    g = rng.normal(size=tuple(y.shape))
    grads = torch.autograd.grad(y, (x,) if w is None else (x, w), torch.tensor(g))
    assert rel_err(grads[0].numpy(), be.to_numpy(be.adjoint(m, be.asarray(g), s))) < TOL
    if w is not None:
        got = be.weight_grad(m, be.asarray(x.detach().numpy()), be.asarray(g), s)
        assert rel_err(grads[1].numpy(), be.to_numpy(got)) < TOL


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=80)
@given(case=map_cases(kinds=(MapKind.POOL,)), k=st.integers(1, 3))
def test_kth_max_pool_equals_numpy(device, case, k):
    window, s, rng = case
    window = replace(window, mult=None)  # a max-pool window has no multiplier
    k = min(k, math.prod(window.kernel))  # the k-th largest of a window needs k entries
    node = Node("mp", NodeKind.MAXPOOL, window.out_shape(s), (Edge("x", window),), k=k)
    tb = TorchBackend(device)
    x = rng.normal(size=(2, *s))
    ref = NB.kth_max_pool(node, x, s)
    assert rel_err(ref, tb.to_numpy(tb.kth_max_pool(node, tb.asarray(x), s))) == 0.0


# ------------------------------------------------------------ whole graphs


def random_graph(rng):
    """A small graph with every map kind, max-pools k = 1 and 2, biases and a shared weight."""
    b = GraphBuilder("zoo")
    P = b.param

    def bias(name, c):
        return P(name, rng.normal(size=c))

    C = 2 * int(rng.integers(1, 3))
    x = b.input("x", (2, int(rng.integers(8, 11)), int(rng.integers(8, 11))))
    geometry = [  # (stride, padding, dilation) of the first conv
        ((1, 1), ((1, 1), (1, 1)), (1, 1)),
        ((1, 2), ((1, 2), (0, 1)), (2, 1)),
        ((2, 1), ((0, 1), (2, 0)), (1, 1)),
    ]
    stride, padding, dilation = geometry[int(rng.integers(len(geometry)))]
    c1 = b.relu("c1", [(x, Conv(P("c1.w", rng.normal(size=(C, 2, 3, 3))), stride, padding, dilation))], bias("c1.b", C))
    shared = P("c2.w", rng.normal(size=(C, C // 2, 3, 3)) / 2)
    same = dict(stride=(1, 1), padding=((1, 1), (1, 1)), dilation=(1, 1), groups=2)
    c2 = b.relu("c2", [(c1, Conv(shared, **same)), (c1, Identity())], bias("c2.b", C))
    fixed = rng.normal(size=(C, C // 2, 3, 3)) * (rng.random((C, C // 2, 3, 3)) < 0.7)  # a fixed filter bank
    c3 = b.relu("c3", [(c2, Conv(shared, **same)), (c2, FixedConv(fixed, **same))], bias("c3.b", C))
    sc = b.identity("sc", [(c3, Scale(P("sc.w", rng.normal(size=C))))], bias("sc.b", C))
    mp1_window = Pool((2, 2), (2, 2), ((0, 1), (1, 0)), (1, 1), ceil_mode=True)
    mp1 = b.maxpool("mp1", sc, mp1_window, k=1, bias=bias("mp1.b", C))
    mp2 = b.maxpool("mp2", c1, Pool((3, 2), (1, 2), ((1, 1), (0, 0)), (2, 1)), k=2, bias=bias("mp2.b", C))
    avg_window = Pool((2, 2), (1, 1), ((1, 0), (0, 1)), (1, 1))
    h, w = avg_window.out_shape(b.shape(mp1))[1:]
    avg = b.identity("avg", [(mp1, replace(avg_window, mult=rng.uniform(0.2, 1.0, size=(h, w))))])
    ad_in = math.prod(b.shape(mp2)[1:])
    ad = b.identity("ad", [(mp2, SpatialMatrix(rng.uniform(0, 1, size=(h * w, ad_in)), (h, w)))])
    hh, ww = b.shape(avg)[1:]
    signed = [rng.normal(size=(hh, hh)) * (rng.random((hh, hh)) < 0.7), rng.normal(size=(ww, ww))]
    avg = b.identity("rs", [(avg, Resample(tuple(signed)))], bias("rs.b", C))
    perm = rng.permutation(2 * C)
    first = tuple(int(p) if p < C else -1 for p in perm)
    second = tuple(int(p) - C if p >= C else -1 for p in perm)
    cat = b.identity("cat", [(avg, ChannelMap(first)), (ad, ChannelMap(second))])
    n = 2 * C * h * w
    flat = b.identity("flat", [(cat, Reshape((n,)))])
    g = b.identity("gather", [(flat, Gather(rng.integers(-1, n, size=n), (n,)))])
    fc1 = b.relu("fc1", [(g, Dense(P("fc1.w", rng.normal(size=(5, n)) / math.sqrt(n))))], bias("fc1.b", 5))
    seq = b.identity("seq", [(cat, Reshape((2 * C, h * w)))])
    k1 = b.relu("k1", [(seq, Conv(P("k1.w", rng.normal(size=(3, 2 * C, 2))), (1,), ((1, 0),), (1,)))], bias("k1.b", 3))
    out = b.identity(
        "out",
        [(fc1, Dense(P("out.w1", rng.normal(size=(2, 5))))), (k1, Dense(P("out.w2", rng.normal(size=(2, 3 * h * w)))))],
        bias("out.b", 2),
    )
    return b.build(outputs=[out])


def test_random_graph_covers_every_kind():
    graph = random_graph(np.random.default_rng(0))
    kinds = {e.map.kind for n in graph.nodes for e in n.edges}
    assert kinds == set(MapKind)
    assert {n.k for n in graph.nodes if n.kind is NodeKind.MAXPOOL} == {1, 2}


def assert_scaled_close(ref, got, tb):
    """(m, L) pairs: values m * exp(L) agree to TOL relative."""
    (m_ref, L_ref), (m_got, L_got) = ref, got
    if m_ref is None:
        assert m_got is None
        return
    assert abs(L_ref - L_got) < 1e-9 * max(1.0, abs(L_ref))
    assert rel_err(m_ref, tb.to_numpy(m_got) * math.exp(L_got - L_ref)) < TOL


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=12)
@given(seed=st.integers(0, 2**32 - 1), q=st.sampled_from([0, 1, 2]))
def test_walks_equal_numpy(device, seed, q):
    rng = np.random.default_rng(seed)
    graph = random_graph(rng)
    tb = TorchBackend(device)
    x = rng.normal(size=(3, *graph.node("x").shape))

    ref = forward(graph, NB, x, all_nodes=True)
    got = forward(graph, tb, tb.asarray(x), all_nodes=True)
    assert ref.keys() == got.keys()
    for name in ref:
        assert rel_err(ref[name], tb.to_numpy(got[name])) < TOL, name

    view = path_view(maxpool_to_sum(graph), q)
    acts_ref, acts_got = path_forward(view, NB), path_forward(view, tb)
    for name in acts_ref:
        assert_scaled_close(acts_ref[name], acts_got[name], tb)
    grads_ref, params_ref = path_backward(view, NB, acts_ref)
    grads_got, params_got = path_backward(view, tb, acts_got)
    for name in grads_ref:
        assert_scaled_close(grads_ref[name], grads_got[name], tb)
    assert params_ref.keys() == params_got.keys() == {id(p) for p in view.params()}
    for key in params_ref:
        assert_scaled_close(params_ref[key], params_got[key], tb)
    if q > 0:
        assert path_norm(graph, q, tb) == pytest.approx(path_norm(graph, q, NB), rel=TOL)


# ----------------------------------------------------- cache, arrays, errors


def test_params_are_converted_once_and_not_kept_alive():
    tb = TorchBackend()
    p = Param("w", np.arange(6.0).reshape(2, 3))
    m = Dense(p)
    assert tb.param(p) is tb.param(p)
    np.testing.assert_array_equal(tb.to_numpy(tb.param(p)), p.value)
    x = tb.asarray(np.ones((1, 3)))
    np.testing.assert_array_equal(tb.to_numpy(tb.apply(m, x, (3,))), [[3.0, 12.0]])
    ref = weakref.ref(p)
    del p, m
    gc.collect()
    assert ref() is None
    assert len(tb._cache) == 0


def test_a_dropped_backend_and_its_power_view_free_their_tensors_at_once():
    """No backend is a reference cycle: one dropped (a power view is made per path-norm) frees its
    cached tensors by reference counting, without waiting for the cyclic collector."""
    p = Param("w", np.array([[1.0, -2.0], [3.0, 4.0]]))
    x = np.ones((1, 2))
    was = gc.isenabled()
    gc.disable()
    try:
        for make in (TorchBackend, lambda: TorchBackend().power_view(2.0)):
            tb = make()
            out = tb.to_numpy(tb.apply(Dense(p), tb.asarray(x), (2,)))
            cached = weakref.ref(tb.param(p))
            refs = weakref.ref(tb), cached
            del tb
            assert all(r() is None for r in refs)
        np.testing.assert_array_equal(out, [[5.0, 25.0]])
    finally:
        if was:
            gc.enable()


def test_rules_read_weights_through_the_cache():
    tb = TorchBackend()
    p = Param("w", np.array([[1.0, 2.0]]))
    tb.param(p).mul_(10.0)  # a poisoned device copy shows whether rules use it
    out = tb.apply(Dense(p), tb.asarray(np.ones((1, 2))), (2,))
    np.testing.assert_array_equal(tb.to_numpy(out), [[30.0]])


def test_asarray_and_to_numpy():
    tb = TorchBackend()
    ro = np.arange(4.0)
    ro.setflags(write=False)
    for value in (ro, [0.0, 1.0, 2.0, 3.0], torch.arange(4, dtype=torch.float32), np.arange(4)):
        t = tb.asarray(value)
        assert t.dtype == torch.float64 and t.device.type == "cpu"
        np.testing.assert_array_equal(tb.to_numpy(t), np.arange(4.0))
    assert TorchBackend(dtype=torch.float32).ones((2,)).dtype == torch.float32
    assert tb.amax(tb.asarray([-3.0, 2.0])) == 3.0 and tb.amax(tb.zeros((0,))) == 0.0
    assert tb.total(tb.asarray([1.0, 2.0])) == 3.0


def test_get_backend_builds_torch():
    be = get_backend("torch", device="cpu")
    assert isinstance(be, TorchBackend) and be.name == "torch" and be.device.type == "cpu"
    assert get_backend(be) is be


def test_missing_rules_and_dimensions_raise_clearly():
    tb = TorchBackend()
    window = Pool((2,), (1,), ((0, 0),), (1,))
    with pytest.raises(BackendError, match="backend torch has no rule for weight_grad of pool"):
        tb.weight_grad(window, tb.zeros((1, 1, 3)), tb.zeros((1, 1, 2)), (1, 3))
    conv4 = Conv(Param("w", np.ones((1, 1, 1, 1, 1, 1))), (1,) * 4, ((0, 0),) * 4, (1,) * 4)
    with pytest.raises(BackendError, match="no rule for 4-d conv"):
        tb.apply(conv4, tb.zeros((1, 1, 2, 2, 2, 2)), (1, 2, 2, 2, 2))


@CUDA
def test_cuda_tensors_stay_on_device():
    tb = TorchBackend("cuda")
    graph = random_graph(np.random.default_rng(1))
    out = forward(graph, tb, np.ones((2, *graph.node("x").shape)))
    assert all(t.device.type == "cuda" and t.dtype == torch.float64 for t in out.values())


@pytest.mark.parametrize("q", [0, 0.5, 1, 2, 3, 4])
def test_power_view_equals_the_path_view_pass_on_a_blocked_dense(q):
    """A dense weight above the block size is taken to the power a block of rows
    at a time; apply and adjoint must equal the numpy rules on |W|^q."""
    from pathir.backends.torch import _BLOCK_BYTES

    rng = np.random.default_rng(0)
    rows = _BLOCK_BYTES // (8 * 300) * 2 + 7  # several blocks and a ragged last one
    W = Param("w", rng.normal(size=(rows, 300)))
    view = TorchBackend().power_view(q)
    power = np.ones_like(W.value) if q == 0 else np.abs(W.value) ** q
    ref, be = Dense(Param("w", power)), NumpyBackend()
    x, g = np.abs(rng.normal(size=(2, 300))), rng.normal(size=(2, rows))
    np.testing.assert_allclose(view.to_numpy(view.apply(Dense(W), view.asarray(x), (300,))),
                               be.apply(ref, x, (300,)), rtol=1e-12)
    np.testing.assert_allclose(view.to_numpy(view.adjoint(Dense(W), view.asarray(g), (300,))),
                               be.adjoint(ref, g, (300,)), rtol=1e-11, atol=1e-11 * np.abs(g).sum())


@pytest.mark.parametrize("before", [True, False])
def test_the_walks_put_back_the_callers_flush_denormal_setting(before):
    """The walks flush subnormals, and set torch's flag to False after: a caller's own True was lost."""
    import pathir
    from pathir.backends.torch import flushing_denormals

    torch.set_flush_denormal(before)
    try:
        net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        pathir.compile(net, input_shape=(3,)).path_norm(2)
        assert flushing_denormals() is before
    finally:
        torch.set_flush_denormal(False)
