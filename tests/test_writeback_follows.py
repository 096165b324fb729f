"""A rescaling written into a live torch model is followed like an optimizer step: no float64 graph is
built at write time, and the next query reads the model as it now holds its values (in its own dtype),
bit for bit what a fresh compile of the written model gives."""

import numpy as np
import pytest
import torch
import torch.nn as nn

import pathir
from pathir.rescaling import commit


def _net(dtype):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 4 * 4, 5),
                        nn.ReLU(), nn.Linear(5, 3)).to(dtype).eval()
    with torch.no_grad():
        net[1].running_mean.normal_()
        net[1].running_var.uniform_(0.5, 2.0)
        net[0].weight.mul_(torch.logspace(-2, 2, 6, dtype=dtype).reshape(6, 1, 1, 1))
    return net


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_after_pathcond_the_graph_is_a_fresh_compile_of_the_written_model(dtype, monkeypatch):
    net = _net(dtype)
    cm = pathir.compile(net, input_shape=(3, 6, 6))
    before = cm.path_norm(1)
    built = []
    monkeypatch.setattr(commit, "rescale_graph", lambda *a, **k: built.append(1))  # never called on this path
    report = cm.pathcond()
    assert report.written and not built
    monkeypatch.undo()
    fresh = pathir.compile(net, input_shape=(3, 6, 6))
    for p, q in zip(cm.graph.params(), fresh.graph.params(), strict=True):
        assert np.array_equal(p.value, q.value), p.name
    # Φ is invariant to the rescaling, up to the rounding of the written tensors in their dtype
    rel = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]
    assert cm.path_norm(1) == pytest.approx(before, rel=rel)


def test_a_refused_rescaling_leaves_the_model_and_the_graph_as_they_were():
    net = _net(torch.float32)
    cm = pathir.compile(net, input_shape=(3, 6, 6))
    state = {k: v.clone() for k, v in net.state_dict().items()}
    graph = cm.graph
    z = np.zeros(len(cm.units))
    z[0] = 2000.0  # e^{±1000}: out of float64
    with pytest.raises(pathir.PathirError, match="overflows or underflows float64"):
        cm.commit_rescaling(z)
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())
    assert cm.graph is graph


def test_where_a_re_read_would_trace_again_the_write_traces_the_model_as_written():
    """A weight_norm layer's weight is computed by a hook: no re-read without tracing covers it, so the write traces
    the model as written (the graph then holds the model's own values, exactly a fresh compile's; the float64
    rescaled graph it took before drifted from a float32 model by its rounding)."""
    torch.manual_seed(1)
    net = nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(4, 6)), nn.ReLU(), nn.Linear(6, 2))
    cm = pathir.compile(net, input_shape=(4,))
    graph = cm.graph
    x = torch.randn(5, 4)
    before = net(x).detach()
    z = np.linspace(-1.0, 1.0, len(cm.units))
    cm.commit_rescaling(z)
    assert cm._watch.changed() is None and cm._facts.graph is not graph
    for p, q in zip(cm.graph.params(), pathir.compile(net, input_shape=(4,)).graph.params(), strict=True):
        np.testing.assert_array_equal(p.value, q.value)
    torch.testing.assert_close(net(x).detach(), before, rtol=1e-5, atol=1e-6)


def test_writes_into_a_clipped_relu_read_on_the_export_path_are_followed_write_after_write():
    """The ClippedReLU pathir wrote lowers, on the torch.export path, to a graph of another form than the ReLU6 it
    replaced: a write that traced the model again must not then refuse the next query as a structural change."""
    import functools

    class Clipped(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.act = nn.Linear(4, 6), nn.Linear(6, 2), nn.ReLU6()

        def forward(self, x, k):
            return self.b(self.act(self.a(x))) * k

    torch.manual_seed(0)
    net = Clipped()
    net.forward = functools.partial(Clipped.forward, net, k=2.0)  # set on the instance: read through torch.export
    cm = pathir.compile(net, input_shape=(4,))
    x = torch.randn(3, 4)
    before = net(x).detach()
    for method in ("pathcond", "enorm", "equalize", "pathcond"):
        getattr(cm, method)()
        fresh = pathir.compile(net, input_shape=(4,)).path_norm(1)
        assert cm.path_norm(1) == pytest.approx(fresh, rel=1e-7)
        torch.testing.assert_close(net(x).detach(), before, rtol=1e-5, atol=1e-5)
