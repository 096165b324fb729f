"""Defects the frontend fuzzer (tests/test_fuzz_frontends.py) found, each as the shrunk program it drew."""

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch_programs import export_path

import pathir


class DeadConv(nn.Module):
    """A module called for nothing: its output is unused in either mode."""

    def __init__(self):
        super().__init__()
        self.conv2 = nn.Conv2d(3, 1, 1, bias=False)
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        v1 = self.conv2(x)  # noqa: F841 - dead, as users leave it
        v4 = F.relu(x)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(v4, 1), 1))


class ChannelDeadBatchNorm(nn.Module):
    """A batch-norm whose channels the forward drops again (cat, then chunk keeps the other half)."""

    def __init__(self):
        super().__init__()
        self.bn2 = nn.BatchNorm2d(3)
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        v1 = self.bn2(x)
        v4, _ = torch.chunk(torch.cat([x, v1], dim=1), 2, dim=1)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x + v4, 1), 1))


class DeadConvBesideAWrite(nn.Module):
    """A dead module in a forward torch.fx cannot trace (a channel zeroed through a view)."""

    def __init__(self):
        super().__init__()
        self.conv3 = nn.Conv2d(3, 3, 3, padding=1, padding_mode="circular", bias=False)
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        v1 = x * 1.0
        v1[:, 1] = 0
        v2 = self.conv3(v1)  # noqa: F841 - dead
        v4 = v1 * 2.0
        return self.head(torch.flatten(F.adaptive_avg_pool2d(v4, 1), 1))


class DeadWrite(nn.Module):
    """A channel zeroed through a view of a tensor nothing reads again: the exported graph's in-place
    ``fill_`` has no table row (its functional form has one)."""

    def __init__(self, clamp: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.head = nn.Linear(3, 3)
        self.clamp = clamp

    def forward(self, x):
        v2 = x * 1.0
        v2[:, 1] = 0
        v8 = self.conv(x)
        if self.clamp:
            v8 = v8.clamp(min=0.1)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(v8, 1), 1))


@pytest.mark.parametrize("path", ["fx", "export"])
def test_a_dead_write_beside_a_refused_op_names_that_op(path):
    """It was refused naming ``fill_`` (a homogeneous write) instead of the clamp."""
    model = DeadWrite(clamp=True).double().eval()
    with export_path() if path == "export" else contextlib.nullcontext():
        with pytest.raises(pathir.PathirError, match="clamp"):
            pathir.compile(model, input_shape=(3, 8, 8))


@pytest.mark.parametrize("make", [DeadConv, ChannelDeadBatchNorm, DeadConvBesideAWrite, DeadWrite])
@pytest.mark.parametrize("path", ["fx", "export"])
def test_modules_no_mode_reads_do_not_block_write_back(make, path):
    """All were refused at write-back as "run only in train mode": the check counted every module the
    train-mode trace calls, used or not, and every module at all where torch.fx could not trace."""
    torch.manual_seed(0)
    model = make().double().eval()
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        before = model(x)
    with export_path() if path == "export" else contextlib.nullcontext():
        cm = pathir.compile(model, input_shape=(3, 8, 8))
    cm.pathcond(max_sweeps=5)
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=1e-10, atol=1e-10 * float(before.abs().max()))


class TrainOnlyHead(nn.Module):
    """The pattern the check is for: a head whose output only the train-mode forward uses."""

    def __init__(self):
        super().__init__()
        self.body = nn.Conv2d(3, 4, 3, padding=1)
        self.aux = nn.Linear(4, 2)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.flatten(F.adaptive_avg_pool2d(F.relu(self.body(x)), 1), 1)
        if self.training:
            return self.head(h), self.aux(h)
        return self.head(h)


class TrainOnlyHeadBesideAWrite(TrainOnlyHead):
    """The same behind a write torch.fx cannot trace: the check reads torch.export's graphs."""

    def forward(self, x):
        y = x * 1.0
        y[:, 0] = 0
        return super().forward(y)


@pytest.mark.parametrize("make", [TrainOnlyHead, TrainOnlyHeadBesideAWrite])
def test_a_train_only_head_is_still_refused(make):
    model = make().double().eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    cm = pathir.compile(model, input_shape=(3, 8, 8))
    with pytest.raises(pathir.PathirError, match="aux"):
        cm.pathcond(max_sweeps=5)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


class ZeroedOnlyChannel(nn.Module):
    """The only channel of a tensor written with 0 through a view, then concatenated with a live one
    (``concat=True``) or read on its own."""

    def __init__(self, concat: bool):
        super().__init__()
        self.conv = nn.Conv2d(3, 1, 1)
        self.conv2 = nn.Conv2d(3, 2, 1)
        self.head = nn.Linear(3 if concat else 1, 3)
        self.concat = concat

    def forward(self, x):
        v = self.conv(x) * 1.0
        v[:, 0] = 0
        if self.concat:
            v = torch.cat([v, F.relu(self.conv2(x))], 1)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(v, 1), 1))


@pytest.mark.parametrize("path", ["fx", "export"])
def test_a_zeroed_tensor_is_exact_beside_others_and_refused_alone(path):
    """A select_scatter that keeps no element of its input was refused as "selects no element" even
    where the zeros are concatenated with live channels; read on its own (a constant activation the
    graph cannot hold) it is refused saying so, the model untouched."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    context = export_path if path == "export" else contextlib.nullcontext
    model = ZeroedOnlyChannel(concat=True).double().eval()
    with torch.no_grad():
        before = model(x)
    with context():
        cm = pathir.compile(model, input_shape=(3, 8, 8))
    torch.testing.assert_close(torch.as_tensor(cm.forward(x.numpy(), backend="numpy")), before, rtol=1e-12, atol=1e-12)
    # the zero channel carries no path: those of conv2 through the head, and the biases' own
    w2, w = model.conv2.weight.detach().reshape(2, 3), model.head.weight.detach()[:, 1:]
    edges = int((w != 0).sum()) * 64  # (head output, conv2 channel) pairs x the 64 positions the average reads
    paths = edges * 3 + edges + 3  # from the 3 input channels, from conv2's biases, the head's own biases
    assert cm.num_paths() == paths and bool((w2 != 0).all())
    cm.pathcond(max_sweeps=5)
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=1e-10, atol=1e-10)
    alone = ZeroedOnlyChannel(concat=False).double().eval()
    state = {k: v.clone() for k, v in alone.state_dict().items()}
    with context(), pytest.raises(pathir.PathirError, match="every element of this activation is 0"):
        pathir.compile(alone, input_shape=(3, 8, 8))
    assert all(torch.equal(v, state[k]) for k, v in alone.state_dict().items())
