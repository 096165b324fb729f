"""A refused compile or query never changes the model (docs/capture.md, pathir.support.model_state).

Each hostile model below writes the model while pathir traces or runs it (batch-norm's
running statistics, a Python counter, a buffer, a weight through ``.data``, the training
flags) and is refused; afterwards every entry of the state_dict is the same tensor object,
bit for bit, with its dtype, ``requires_grad`` and version counter, and every module's
attributes and training flag are as before. So after an accepted compile."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pathir
from pathir.errors import PathirError, SelfCheckFailed, UnsupportedOperation


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(3, 4), nn.Linear(4, 2)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("rm", torch.zeros(4))
        self.register_buffer("rv", torch.ones(4))
        self.register_buffer("buf", torch.zeros(2))
        self.count = 0
        self.hidden = [self.fc.weight]  # a reference the tracer does not see: writes through it are real

    def head(self, h):
        return self.out(torch.relu(h))


class BatchNormFx(Base):
    def forward(self, x):
        return self.head(F.batch_norm(self.fc(x), self.rm, self.rv, training=True))


class BatchNormExport(Base):
    """Python control flow on a shape: fx cannot trace it, torch.export can."""

    def forward(self, x):
        h = self.fc(x)
        if x.shape[1] == 3:
            self.count += 1
            h = F.batch_norm(h, self.rm, self.rv, training=True)
        return self.head(h)


class CountThenSigmoid(Base):
    def forward(self, x):
        self.count += 1
        self.tag = "seen"  # a new attribute
        return torch.sigmoid(self.head(self.fc(x)))


class BufferThenSigmoid(Base):
    def forward(self, x):
        self.buf.add_(1)
        return torch.sigmoid(self.head(self.fc(x)))


class DataThenSigmoid(Base):
    def forward(self, x):
        self.fc.weight.data.mul_(2)
        return torch.sigmoid(self.head(self.fc(x)))


class HiddenDataWrite(Base):
    """Doubles a weight through .data (no version bump) at every call: the self-check fails."""

    def forward(self, x):
        self.hidden[0].data.mul_(2)
        return self.head(self.fc(x))


class HiddenNoOpWrite(Base):
    """Writes a weight's storage without changing it: the self-check passes, the write is seen."""

    def forward(self, x):
        self.hidden[0].data.mul_(1)
        return self.head(self.fc(x))


class FlipsTraining(Base):
    def forward(self, x):
        self.train()
        return torch.sigmoid(self.head(self.bn(self.fc(x))))


class InplaceParam(Base):
    def forward(self, x):
        with torch.no_grad():
            self.fc.weight.mul_(2)
            self.fc.bias.requires_grad_(False)
        return self.head(self.fc(x))


class ReplacesState(Base):
    def forward(self, x):
        self.fc.weight = nn.Parameter(self.fc.weight.detach() * 2)
        self.buf = self.buf + 1
        self.fc.bias.data = self.fc.bias.data.double()
        return torch.sigmoid(self.head(self.fc(x)))


class Raises(Base):
    def forward(self, x):
        self.count += 1
        self.buf.add_(1)
        self.hidden[0].data.mul_(2)
        self.rm.data = torch.full((4,), 7.0)
        raise ValueError("boom")


class Changing(Base):
    """A forward that differs between calls: the self-check fails."""

    def forward(self, x):
        self.count += 1
        return self.head(self.fc(x)) * self.count


HOSTILE = [
    (BatchNormFx, UnsupportedOperation, "batch statistics"),
    (BatchNormExport, UnsupportedOperation, "batch statistics"),
    (CountThenSigmoid, UnsupportedOperation, "sigmoid"),
    (BufferThenSigmoid, UnsupportedOperation, "'buf'"),
    (DataThenSigmoid, UnsupportedOperation, ""),
    (HiddenDataWrite, SelfCheckFailed, "self-check"),
    (HiddenNoOpWrite, UnsupportedOperation, "the forward writes the model's own 'fc.weight'"),
    (FlipsTraining, UnsupportedOperation, ""),
    (InplaceParam, UnsupportedOperation, "'fc.weight'"),
    (ReplacesState, UnsupportedOperation, ""),
    (Raises, PathirError, ""),
    (Changing, SelfCheckFailed, "self-check"),
]

INPUTS = {"input_shape": lambda: {"input_shape": (3,)}, "example_input": lambda: {"example_input": torch.randn(5, 3)}}


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def state_of(model):
    """Everything a refused call must leave as it was."""
    return {
        "tensors": {k: (v, v.detach().clone(), v.dtype, v.requires_grad, v._version)
                    for k, v in model.state_dict(keep_vars=True).items()},
        "modules": [(m, dict(m.__dict__), {k: dict(v) for k, v in m.__dict__.items() if isinstance(v, dict)},
                     m.training) for m in model.modules()],
    }


def assert_unchanged(model, before):
    now = model.state_dict(keep_vars=True)
    assert now.keys() == before["tensors"].keys()
    for k, (obj, value, dtype, requires_grad, version) in before["tensors"].items():
        t = now[k]
        assert t is obj, f"{k} is no longer the same tensor object"
        assert t.dtype == dtype and value.dtype == dtype, k
        assert torch.equal(t, value) and torch.equal(_bits(t.detach()), _bits(value)), f"{k} changed"
        assert t.requires_grad == requires_grad, k
        assert t._version == version, k
    mods = list(model.modules())
    assert len(mods) == len(before["modules"])
    for m, (old, attrs, tables, training) in zip(mods, before["modules"]):
        assert m is old
        assert m.training == training
        assert m.__dict__.keys() == attrs.keys()
        assert all(m.__dict__[k] is v for k, v in attrs.items()), type(m).__name__
        assert all(dict(getattr(m, k)) == v for k, v in tables.items())


@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("cls, error, match", HOSTILE, ids=[c[0].__name__ for c in HOSTILE])
def test_a_refused_compile_leaves_the_model_as_it_was(cls, error, match, inputs):
    torch.manual_seed(0)
    model = cls().eval()
    before = state_of(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(error, match=match):
            pathir.compile(model, **INPUTS[inputs]())
    assert_unchanged(model, before)


def test_the_export_fallback_is_the_path_taken():
    """BatchNormExport is refused by the torch.export interpreter (ATen op name), not by fx."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(UnsupportedOperation, match=r"op batch_norm\.default"):
            pathir.compile(BatchNormExport().eval(), input_shape=(3,))


def test_a_model_in_train_mode_and_its_optimizer_keep_their_state():
    """Train mode, gradients and an optimizer's state: a refusal touches none of them."""
    torch.manual_seed(0)
    model = BatchNormFx().train()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 3)).sum().backward()
    opt.step()
    grads = {n: (p.grad, p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None}
    moments = {k: v.clone() for k, v in opt.state[model.fc.weight].items()}
    before = state_of(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(UnsupportedOperation):
            pathir.compile(model, input_shape=(3,))
    assert_unchanged(model, before)
    for n, p in model.named_parameters():
        if n in grads:
            assert p.grad is grads[n][0] and torch.equal(p.grad, grads[n][1])
    assert all(torch.equal(opt.state[model.fc.weight][k], v) for k, v in moments.items())


@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_an_accepted_compile_leaves_the_model_as_it_was(mode, inputs):
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.bn, self.out = nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)
            self.calls = 0

        def forward(self, x):
            self.calls += 1  # a Python counter: compiled, and put back
            return self.out(torch.relu(self.bn(self.fc(x))))

    model = Net()
    model.train(mode == "train")
    model(torch.randn(8, 3))  # running statistics and num_batches_tracked away from their defaults
    model.calls = 0
    before = state_of(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = pathir.compile(model, self_check=True, **INPUTS[inputs]())
    assert_unchanged(model, before)
    assert cm.num_paths() > 0


def test_a_refused_query_leaves_the_model_as_it_was():
    """A query that re-lowers the model (here cm.refresh()) and is refused puts it back too."""
    torch.manual_seed(0)

    class Switch(Base):
        hostile = False

        def forward(self, x):
            h = self.fc(x)
            if self.hostile:
                self.count += 1
                self.hidden[0].data.mul_(2)
                h = F.batch_norm(h, self.rm, self.rv, training=True)
            return self.head(h)

    model = Switch().eval()
    cm = pathir.compile(model, input_shape=(3,))
    model.hostile = True
    before = state_of(model)
    with pytest.raises(UnsupportedOperation, match="batch statistics"):
        cm.refresh()
    assert_unchanged(model, before)


@pytest.mark.parametrize("act", [torch.nn.ReLU6, torch.nn.ReLU])
def test_an_interrupt_in_the_re_read_after_a_write_leaves_the_compiled_on_the_written_model(act):
    """Ctrl-C while the Compiled re-reads the model it has just written (a re-trace: a ReLU6 became a per-channel
    clip) escaped with the Compiled left on the old model (ModelChanged on the next query, review). The interrupt
    still goes on, with a note that the write is complete, and the Compiled holds the written model."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.b1, self.act = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), act()
            self.fc = torch.nn.Linear(8, 5)

        def forward(self, x):
            return self.fc(self.act(self.b1(self.c1(x))).mean((2, 3)))

    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.b1.weight.copy_(torch.exp(torch.randn(8) * 1.5))
    net.eval()
    state = {"armed": False, "calls": 0}

    def hook(mod, inputs, out):
        if state["armed"]:
            state["calls"] += 1
            if state["calls"] >= 3:  # the forward of the re-read, after the write and its check
                raise KeyboardInterrupt("Ctrl-C")

    net.register_forward_hook(hook)
    cm = pathir.compile(net, input_shape=(3, 8, 8))
    with pytest.raises(KeyboardInterrupt) as info:
        cm.equalize(callback=lambda *a: state.__setitem__("armed", True))
    assert any("written to the model, in full" in note for note in info.value.__notes__)
    state["armed"] = False
    fresh = pathir.compile(net, input_shape=(3, 8, 8))
    assert cm.path_norm(1) == pytest.approx(fresh.path_norm(1), rel=1e-13)  # the model's float32 values, re-read
    for p, q in zip(cm.graph.params(), fresh.graph.params(), strict=True):
        np.testing.assert_array_equal(p.value, q.value)
