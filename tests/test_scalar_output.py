"""A network whose output is one number per sample (a regression head's ``.squeeze(-1)``: a node of shape ()):
every analysis and rescaling reads it as one channel (they raised IndexError: the units' channel of a scalar)."""

import contextlib
import copy

import numpy as np
import pytest
import torch

import pathir
from pathir.ir import Dense, GraphBuilder, Reshape


class SqueezedHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden, self.head = torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.head(torch.relu(self.hidden(x))).squeeze(-1)


@pytest.mark.parametrize("method", ["pathcond", "enorm", "normalize", "equalize"])
def test_rescalings_of_a_squeezed_head_keep_its_function(method):
    torch.manual_seed(0)
    net = SqueezedHead().double()
    x = torch.randn(8, 3, dtype=torch.float64)
    y = net(x).detach()
    cm = pathir.compile(net, input_shape=(3,))
    assert cm.graph.node(cm.graph.outputs[0]).shape == ()
    assert len(cm.units) == 4
    getattr(cm, method)()
    assert torch.allclose(net(x), y, rtol=1e-6, atol=1e-9)


def test_a_scalar_node_built_by_hand_has_its_path_norm_and_passes_the_symbolic_checks():
    b = GraphBuilder("scalar")
    x = b.input("x", (2,))
    h = b.relu("h", [(x, Dense(b.param("w1", [[2.0, 1.0], [-3.0, 1.0]])))])
    y = b.identity("y", [(h, Dense(b.param("w2", [[1.0, 1.0]])))])
    z = b.identity("z", [(y, Reshape(()))], shape=())
    cm = pathir.compile(b.build([z]))
    assert cm.path_norm(1, backend="numpy") == pytest.approx(7.0, rel=1e-15)  # |2|+|1|+|-3|+|1| times 1
    assert len(cm.units) == 2
    assert cm.verify_symbolic().passed
    report = copy.deepcopy(cm).pathcond(write_back=False)
    assert np.all(np.isfinite(report.z))


class _SqueezedAndBack(torch.nn.Module):
    """A scalar node read again: squeeze(-1) then unsqueeze(-1), into a layer and beside it."""

    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = torch.nn.Linear(3, 1), torch.nn.Linear(1, 1)

    def forward(self, x):
        y = torch.relu(self.fc(x)).squeeze(-1)
        return self.fc2(y.unsqueeze(-1)) + 0.5 * y.unsqueeze(-1)


def test_a_scalar_node_read_back_by_a_reshape_has_its_path_norms_and_counts():
    """The all-ones walk indexed the scalar source's channel axis (an IndexError inside num_paths and path_norm
    for q < inf); the figures are the enumeration's (a review's reproduction)."""
    from pathir.neurons.paths import enumerate_num_paths, enumerate_path_norm

    torch.manual_seed(0)
    cm = pathir.compile(_SqueezedAndBack().double(), input_shape=(3,))
    for backend in ("numpy", "torch"):
        assert cm.num_paths(backend=backend) == enumerate_num_paths(cm.graph) == 9
        for q in (0.5, 1, 2):
            assert cm.path_norm(q, backend=backend) == pytest.approx(enumerate_path_norm(cm.graph, q), rel=1e-12)


def test_a_bias_on_a_scalar_node_is_refused_by_verify():
    """It crashed with an IndexError in verify; the forward walk has no channel axis to add it on."""
    b = GraphBuilder("scalar-bias")
    x = b.input("x", (3,))
    h = b.relu("h", [(x, Dense(b.param("w", [[1.0, -2.0, 0.5]])))])
    s = b.identity("s", [(h, Reshape(()))], bias=b.param("sb", [0.5]))
    with pytest.raises(pathir.GraphVerificationError, match="a scalar node .* has no channel axis to hold bias 'sb'"):
        b.build(outputs=[s])


class PerSampleScalar(torch.nn.Module):
    """``s = h[:, 0]``, one number per sample, under a fixed factor, a difference or a max, stacked back."""

    def __init__(self, op):
        super().__init__()
        self.a, self.o, self.op = torch.nn.Linear(4, 6), torch.nn.Linear(2, 2), op

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.o(torch.stack([self.op(h[:, 0], h), h[:, 1]], 1))


class ScaledInPlace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.o = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)

    def forward(self, x):
        h = self.a(x)
        h[:, 0] *= 2
        return self.o(torch.relu(h))


SCALAR_OPS = {"s*2": lambda s, h: s * 2, "2*s": lambda s, h: 2 * s, "s/2": lambda s, h: s / 2, "-s": lambda s, h: -s,
              "s-h2": lambda s, h: s - h[:, 2], "add alpha": lambda s, h: torch.add(s, h[:, 2], alpha=3),
              "s*tensor": lambda s, h: s * torch.tensor(3.0, dtype=s.dtype),
              "maximum": lambda s, h: torch.maximum(s, h[:, 2]),
              "squeezed*2": lambda s, h: h[:, 0:1].squeeze(1) * 2}


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("op", [*SCALAR_OPS, "h[:, 0] *= 2"])
def test_a_per_sample_scalar_under_a_fixed_factor_or_a_max_is_lowered_exactly(op, capture):
    """These raised a raw IndexError (``out_shape`` read the channel axis of shape ()), torch.maximum an internal
    pool-geometry message (torch review): as (1,), scaled or maxed, back to ()."""
    from torch_programs import export_path

    torch.manual_seed(0)
    net = (ScaledInPlace() if op == "h[:, 0] *= 2" else PerSampleScalar(SCALAR_OPS[op])).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    with export_path() if capture == "export" else contextlib.nullcontext():
        cm = pathir.compile(net, input_shape=(4,))
    np.testing.assert_allclose(cm.forward(x.numpy()), net(x).detach().numpy(), rtol=1e-12, atol=1e-12)


class ScalarHead(torch.nn.Module):
    def __init__(self, factor: float = 2.0, keep_axis: bool = False):
        super().__init__()
        self.a, self.factor, self.keep_axis = torch.nn.Linear(4, 6), factor, keep_axis

    def forward(self, x):
        h = torch.relu(self.a(x))
        return h[:, 0:1] * self.factor if self.keep_axis else h[:, 0] * self.factor


def test_a_scalar_output_past_the_fast_walk_walks_per_neuron():
    """q = 1000 (and weights near 1e300) leave the fast walk for the per-channel one, which read a node of shape
    () as having channels (raw IndexError, diff review): such a graph goes to the per-neuron log-space walk, and
    gives the (1,)-shaped spelling's numbers."""
    torch.manual_seed(0)
    scalar, column = ScalarHead().double(), ScalarHead(keep_axis=True).double()
    column.load_state_dict(scalar.state_dict())
    a, b = pathir.compile(scalar, input_shape=(4,)), pathir.compile(column, input_shape=(4,))
    for q in (1, 1000):
        assert a.path_norm(q) == pytest.approx(b.path_norm(q), rel=1e-12)
    huge = ScalarHead(1e300).double()
    cm = pathir.compile(huge, input_shape=(4,))
    x = torch.randn(5, 4, dtype=torch.float64)
    y = huge(x).detach()
    cm.pathcond()
    assert torch.allclose(huge(x), y, rtol=1e-12, atol=0)
