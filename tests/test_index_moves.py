"""Ops that only move, copy or drop elements of an activation (flip, roll, rot90, movedim, repeat,
expand, tile, repeat_interleave, stack, unbind, select, index_select, unfold, tensor_split), against
the definition on both torch capture paths and through ONNX: each is a fixed 0/1 selection between
the same neurons (a copied element is one neuron read twice), so the forward is the model's own, the
path-norms and counts equal the model run on |θ|^q, and pathcond keeps the function."""

import pytest
import torch
import torch.nn as nn
from capture_reference import Untraceable, assert_definition, assert_forward, eval_forward, path_norm_q
from hypothesis import given, settings
from hypothesis import strategies as st

import pathir
from pathir.errors import UnsupportedOperation


class Moves(nn.Module):
    """flip, roll, rot90, movedim, swapaxes and a transposed view between convs."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.o = nn.Conv2d(2, 3, 3), nn.Conv2d(3, 4, 2), nn.Linear(4 * 3 * 3, 2)

    def forward(self, x):
        h = torch.relu(self.a(x)).flip(-1)
        h = torch.roll(h, shifts=(1, -2), dims=(2, 3))
        h = torch.rot90(h, 1, (2, 3)).movedim(1, 3).swapaxes(2, 3)  # (B, H, C, W)
        h = torch.relu(self.b(h.permute(0, 2, 1, 3).fliplr()))  # fliplr: the channels reversed
        return self.o(h.flatten(1))


class Copies(nn.Module):
    """repeat, expand, tile, repeat_interleave: one neuron read at several positions."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.fc, self.o = nn.Conv2d(2, 3, 3), nn.Conv2d(6, 2, 3), nn.Linear(4, 3), nn.Linear(2 * 2 * 4 + 12 + 6, 2)

    def forward(self, x):
        h = torch.relu(self.a(x))  # (3, 4, 4)
        g = torch.relu(self.b(h.repeat(1, 2, 1, 1)))  # (2, 2, 2)
        g = g.repeat_interleave(2, dim=3).flatten(1)  # 16
        f = torch.relu(self.fc(x[:, 0, 0, :2].repeat(1, 2)))  # (3,)
        e = f.unsqueeze(-1).expand(-1, -1, 4).flatten(1)  # 12
        t = torch.tile(f, (2,))  # 6
        return self.o(torch.cat([g, e, t], 1))


class Stacks(nn.Module):
    """stack, unbind, select, index_select with a repeated index, unfold, tensor_split."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.o = nn.Conv1d(2, 4, 3), nn.Conv1d(2, 4, 3), nn.Linear(40, 2)
        self.register_buffer("pick", torch.tensor([3, 0, 3, 1]))

    def forward(self, x):
        h, g = torch.relu(self.a(x)), torch.relu(self.b(x))  # (4, 6) each
        s = torch.stack([h, g], dim=1)  # (2, 4, 6)
        u0, u1 = s.unbind(1)
        w = torch.relu(u0 + s.select(1, 1)) + u1
        z = torch.index_select(w, 1, self.pick)  # (4, 6) with channel 3 twice
        win = z.unfold(2, 3, 2).flatten(1)  # (4, 2, 3) -> 24
        first, rest = torch.tensor_split(g, [1], dim=1)
        return self.o(torch.cat([win, first.flatten(1), rest[:, :1].flatten(1), h[:, 0, :4]], 1))


CASES = {"moves": (Moves, (2, 6, 6)), "copies": (Copies, (2, 6, 6)), "stacks": (Stacks, (2, 8))}


def _model(name):
    torch.manual_seed(0)
    cls, shape = CASES[name]
    return cls().double().eval(), shape




@pytest.mark.parametrize("name", list(CASES))
def test_forward_path_norms_and_counts_equal_the_definition(name):
    model, shape = _model(name)
    assert_definition(assert_forward(model, shape, tol=1e-12), model, shape)


@pytest.mark.parametrize("name", list(CASES))
def test_export_path_gives_the_definition_too(name):
    model, shape = _model(name)
    wrapped = Untraceable(model)
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(wrapped)
    assert_definition(assert_forward(wrapped, shape, tol=1e-12), model, shape)


@pytest.mark.parametrize("name", list(CASES))
def test_pathcond_keeps_the_function(name):
    model, shape = _model(name)
    x = torch.randn(4, *shape, dtype=torch.float64)
    before = eval_forward(model, x)
    pathir.compile(model, input_shape=shape).pathcond()
    assert torch.allclose(eval_forward(model, x), before, rtol=1e-9, atol=1e-12)


class MixesBatch(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.a, self.op = nn.Linear(3, 3), op

    def forward(self, x):
        return self.op(torch.relu(self.a(x)))


@pytest.mark.parametrize("op", [lambda h: h.flip(0), lambda h: torch.roll(h, 1, 0), lambda h: h.repeat(2, 1),
                                lambda h: torch.stack([h, h], 0).flatten(0, 1)])
def test_a_move_across_the_batch_is_refused(op):
    with pytest.raises(UnsupportedOperation, match="batch"):
        pathir.compile(MixesBatch(op).double(), input_shape=(3,))


onnx_cases = pytest.importorskip("onnx_cases")


@pytest.mark.parametrize("exporter", ["legacy-nofold", "dynamo-noopt"])
@pytest.mark.parametrize("name", list(CASES))
def test_onnx_export_gives_the_torch_frontends_numbers(name, exporter):
    model, shape = _model(name)
    model = model.float()
    try:
        proto = onnx_cases.export(model, shape, exporter)
    except torch.onnx.errors.UnsupportedOperatorError as err:  # the exporter's limit (legacy: no rot90)
        pytest.skip(str(err).splitlines()[0])
    if any(n.op_type in ("If", "Loop") for n in proto.graph.node):  # legacy: repeat_interleave, unfold as loops
        with pytest.raises(UnsupportedOperation, match="control flow whose body reads an activation"):
            pathir.compile(proto)
        return
    cm, ct = onnx_cases.assert_export_matches(proto, model, shape)


# ---------------------------------------------------------------- random chains of moves


def _move(name, r, shape):
    """The move ``name`` on a tensor of per-sample ``shape``, its axis and amounts fixed by r (plain
    Python numbers, so that the traced forward holds no shape arithmetic)."""
    nd = len(shape)
    ax = 1 + r % nd
    return {
        "flip": lambda t: t.flip(ax),
        "roll": lambda t: torch.roll(t, r % 3 - 1, ax),
        "repeat": lambda t: t.repeat(1, *[2 if i + 1 == ax else 1 for i in range(nd)]),
        "interleave": lambda t: t.repeat_interleave(2, ax),
        "swap": lambda t: t.transpose(1, nd),
        "slice": lambda t: t.narrow(ax, 0, max(1, shape[ax - 1] - 1)),
        "stack": lambda t: torch.stack([t, t.flip(-1)], ax).flatten(ax, ax + 1),
        "pick": lambda t: t[:, [r % shape[0], 0, r % shape[0]]],
    }[name]


_MOVES = ("flip", "roll", "repeat", "interleave", "swap", "slice", "stack", "pick")


class Chain(nn.Module):
    """conv -> relu -> a chain of moves (a ReLU after each odd one) -> linear."""

    def __init__(self, moves, seeds, shape):
        super().__init__()
        self.a = nn.Conv2d(1, 2, 2)
        h = torch.zeros(1, 2, shape[1] - 1, shape[2] - 1)
        self.fns = []
        for name, r in zip(moves, seeds):
            self.fns.append(_move(name, r, tuple(h.shape[1:])))
            h = self.fns[-1](h)
        self.o = nn.Linear(h[0].numel(), 2)

    def forward(self, x):
        h = torch.relu(self.a(x))
        for k, fn in enumerate(self.fns):
            h = fn(h)
            if k % 2:
                h = torch.relu(h)
        return self.o(h.flatten(1))


@settings(max_examples=25)
@given(st.lists(st.sampled_from(_MOVES), min_size=1, max_size=4), st.lists(st.integers(0, 5), min_size=4, max_size=4))
def test_random_chains_of_moves_equal_the_definition(moves, seeds):
    torch.manual_seed(0)
    shape = (1, 4, 3)
    model = Chain(moves, seeds, shape).double().eval()
    cm = assert_forward(model, shape, tol=1e-12)
    for q in (1.0, 2.0):
        assert cm.path_norm(q) ** q == pytest.approx(path_norm_q(model, [shape], q), rel=1e-10)
