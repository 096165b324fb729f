"""``torch.stack(branches, dim=0)`` read back along dim 0 (``.sum(0)``, ``.mean(0)``, ``.amax(0)``, ``.max(0)``,
``stacked[i]``, ``.unbind(0)``), as ensembles and multi-branch heads write it, on both torch paths: checked against
the model's own forward, the path-norm network written out (every weight |w|, the all-ones input, a max read as
the sum of its operands, docs/math.md §3), and a function-keeping PathCond; any other read of the stack (which moves
the batch axis) is refused naming it, the model untouched."""

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn

import pathir
from pathir.errors import UnsupportedOperation

READS = {
    "sum(0)": lambda s: s.sum(0),
    "torch.sum(dim=0)": lambda s: torch.sum(s, dim=0),
    "mean(dim=0)": lambda s: s.mean(dim=0),
    "amax(0)": lambda s: s.amax(0),
    "max(0).values": lambda s: s.max(0).values,
    "torch.max(dim=0)[0]": lambda s: torch.max(s, dim=0)[0],
    "s[0] + s[-1] + s[1]": lambda s: s[0] + s[-1] + s[1],
    "sum(unbind(0))": lambda s: sum(s.unbind(0)),
    "s[1:].sum(0) + s.select(0, 0)": lambda s: s[1:].sum(0) + s.select(0, 0),
    "sum over dims (0, 2)": lambda s: s.sum((0, 2)),
}


class Branches(nn.Module):
    """Three linear branches of x stacked on dim 0 (their weights set by :func:`_net`), read back by ``read``, then
    ReLU and a linear head."""

    def __init__(self, read, export=False):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.W = nn.Parameter(torch.randn(3, 3, 4, generator=gen, dtype=torch.float64))  # one (3, 4) per branch
        self.b = nn.Parameter(torch.randn(3, 3, generator=gen, dtype=torch.float64))
        self.C = nn.Parameter(torch.randn(2, 3, generator=gen, dtype=torch.float64))
        self.read, self.export = read, export

    def forward(self, x):
        if self.export and x.shape[-1] != 4:  # Python control flow on a shape: fx cannot trace it
            raise ValueError("four features")
        s = torch.stack([nn.functional.linear(x, getattr(self, f"w{k}"), getattr(self, f"c{k}")) for k in range(3)])
        h = torch.relu(self.read(s))
        return nn.functional.linear(h, self.C)


def _net(read, export=False):
    net = Branches(read, export)
    for k in range(3):  # the branches' own parameters (a weight indexed in the forward is no layer's)
        setattr(net, f"w{k}", nn.Parameter(net.W[k].detach().clone()))
        setattr(net, f"c{k}", nn.Parameter(net.b[k].detach().clone()))
    del net.W, net.b
    return net


def _path_norm_network(net, name) -> float:
    """Σ over paths of |product of weights|: the net with every weight |w|, on the all-ones input, its ReLUs
    the identity there and a max the sum of its operands; each branch read as often as the reading sums it."""
    A = [getattr(net, f"w{k}").detach().abs() for k in range(3)]
    c = [getattr(net, f"c{k}").detach().abs() for k in range(3)]
    branch = [a @ torch.ones(4, dtype=torch.float64) + ck for a, ck in zip(A, c)]
    share = 1 / 3 if name == "mean(dim=0)" else 1.0  # every other reading takes each branch once (a max: summed)
    h = sum(share * b for b in branch)
    return float((net.C.detach().abs() @ h).sum())


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
@pytest.mark.parametrize("name", [n for n in READS if n != "sum over dims (0, 2)"])
def test_a_stack_on_dim_0_read_back_along_it_is_its_activations(name, export):
    net = _net(READS[name], export)
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = net(x).detach().clone()
    cm = pathir.compile(net, input_shape=(4,))
    np.testing.assert_allclose(cm.forward(x.numpy()), y.numpy(), rtol=1e-12, atol=1e-12)
    assert cm.path_norm(1) == pytest.approx(_path_norm_network(net, name), rel=1e-12)
    cm.pathcond()
    torch.testing.assert_close(net(x), y, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
def test_a_reduction_over_dim_0_and_a_sample_axis(export):
    """(B, 2, 4) tokens: each branch (B, 2, 3), the stack summed over dim 0 and the tokens' axis."""
    net = _net(READS["sum over dims (0, 2)"], export)
    x = torch.randn(5, 2, 4, dtype=torch.float64)
    y = net(x).detach().clone()
    cm = pathir.compile(net, input_shape=(2, 4))
    np.testing.assert_allclose(cm.forward(x.numpy()), y.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
@pytest.mark.parametrize("read", [lambda s: s.sum(0, keepdim=True)[0], lambda s: s.transpose(0, 1).sum(1),
                                  lambda s: s.sum(1), lambda s: s[:, 0].sum(0) + s[0],
                                  lambda s: s.flip(0)[0] * 1.0 + s[:, :, :1].sum(0),
                                  lambda s: s[0:0].sum(0) + s[0], lambda s: s.narrow(0, 0, 0).mean(0) + s[1]],
                         ids=["keepdim", "transpose", "over the batch", "one sample", "flip then slice", "empty slice",
                              "empty narrow"])
def test_any_other_read_of_a_stack_on_dim_0_is_refused_naming_it(read, export):
    net = _net(read, export)
    state = copy.deepcopy(net.state_dict())
    net(torch.randn(5, 4, dtype=torch.float64))  # (a model torch runs)
    with pytest.raises(UnsupportedOperation, match=r"torch.stack\(\.\.\., dim=0\) of 3 activations|pick whole|empty"):
        pathir.compile(net, input_shape=(4,))
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())


@pytest.mark.parametrize("exporter", ["legacy-nofold", "dynamo-noopt"])
@pytest.mark.parametrize("name", ["sum(0)", "mean(dim=0)", "amax(0)", "s[0] + s[-1] + s[1]", "sum(unbind(0))"])
def test_an_onnx_export_of_a_stack_read_along_dim_0_gives_the_torch_frontends_numbers(name, exporter):
    pytest.importorskip("onnxruntime")
    from onnx_cases import export, ort_run, rel

    net = _net(READS[name]).float()
    proto = export(net, (4,), exporter)
    cm, ct = pathir.compile(proto), pathir.compile(_net(READS[name]).float(), input_shape=(4,))
    x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
    assert rel(cm.forward(x, backend="numpy"), ort_run(proto, x)[0]) <= 1e-5
    for q in (1, 2):
        assert cm.path_norm(q) == pytest.approx(ct.path_norm(q), rel=1e-9)
    before = ort_run(proto, x)[0]
    cm.pathcond()
    assert rel(ort_run(cm.to_onnx(), x)[0], before) <= 1e-5
