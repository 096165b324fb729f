"""Every row of the op tables has a case, and every case is exact against the definition.

The corpus (tests/op_table_cases.py) runs once per process, in a module-scoped fixture, with the
tables' dispatch recorded: the torch interpreters' ``rule_for`` and the ONNX walk's ``RULES`` are
wrapped for the run. Each case has a test reading its outcome, and the coverage tests compare the
rows dispatched with the tables; nothing depends on test order or on which xdist worker runs what.

- torch: a model is lowered on the fx path (``pathir.compile``, with its self-check) and on the
  export path (``lower_exported``); the IR's forward matches the model's own float64 forward to
  1e-10 relative. ATen overloads torch.export never produces are hand-built fx graphs, interpreted
  by the export interpreter and compared with the GraphModule run in float64.
- ONNX: a graph built with onnx.helper is compiled (self-check against onnxruntime) and its IR
  forward matches onnxruntime's float32 output to 1e-5 relative.

A row no program can reach through pathir's capture is listed in ``DEAD`` with the reason (not
faked); a row whose rule refuses every call is in ``op_table_cases.REFUSALS`` and checked to refuse.
"""

from __future__ import annotations

import contextlib
import operator
import traceback

import numpy as np
import op_table_cases as cases
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pathir
from pathir.backends import get_backend
from pathir.errors import UnsupportedOperation
from pathir.frontends.onnx import lowering as onnx_lowering
from pathir.frontends.onnx.table import RULES as ONNX_RULES
from pathir.frontends.onnx.why import WHY as ONNX_WHY
from pathir.frontends.torch import interpreter
from pathir.frontends.torch.export import _ExportInterpreter, lower_exported
from pathir.frontends.torch.lower import trace
from pathir.frontends.torch.table import RULES as TORCH_RULES
from pathir.frontends.torch.table import rule_for, target_name
from pathir.lifting.walk import forward

TORCH_TOL, ONNX_TOL = 1e-10, 1e-5

#: rows no program reaches through pathir.compile in torch 2.14.1 (torch.fx never produces the target;
#: pathir's tracer records augmented assignment as operator.iadd, ...)
DEAD: dict = {}  # none in torch 2.14.1: the dunder methods and F.upsample* have no rows (fx never makes them)
_REFUSING = {row for r in cases.REFUSALS.values() for row in r.rows}


# ====================================================================== recording


def _row(target):
    """The table row a dispatched target uses (a module class: its nearest base with a row)."""
    if isinstance(target, type):
        return next((c for c in target.__mro__ if c in TORCH_RULES), target)
    return target


class _RecordingRules(dict):
    """The ONNX op table, recording every op type looked up that has a row."""

    def __init__(self, table, seen):
        super().__init__(table)
        self.seen = seen

    def get(self, key, default=None):
        if key in self:
            self.seen.add(key)
        return super().get(key, default)


@contextlib.contextmanager
def recording(seen: set):
    """Record into ``seen`` the torch rows dispatched and the ONNX op types looked up."""
    original = interpreter.rule_for

    def recording_rule_for(target):
        rule = original(target)
        if rule is not None:
            seen.add(_row(target))
        return rule

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "rule_for", recording_rule_for)
        mp.setattr(onnx_lowering, "RULES", _RecordingRules(onnx_lowering.RULES, seen))
        yield


# ====================================================================== running the cases


def _check(what, out, ref, tol):
    out, ref = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, f"{what}: shape {out.shape}, expected {ref.shape}"
    err = float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-300))
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


def _x(shape):
    return torch.randn(3, *shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def _graph_forward(graph, x):
    return forward(graph, get_backend("numpy"), x.numpy())[graph.outputs[0]]


def run_torch_case(case: cases.TorchCase, seen: set):
    model, x = case.make(), _x(case.shape)
    with torch.no_grad():
        ref = model(x).numpy()
    if "fx" in case.paths:
        rows: set = set()
        with recording(rows):
            cm = pathir.compile(model, input_shape=case.shape)
        seen |= rows
        aten = sorted(target_name(r) for r in rows if isinstance(r, torch._ops.OpOverload))
        assert not aten, f"fx path: torch.fx failed and pathir fell back to torch.export ({aten})"
        _check("fx path", cm.forward(x.numpy(), backend="numpy"), ref, TORCH_TOL)
    if "export" in case.paths:
        with recording(seen):
            graph = lower_exported(model, case.shape, type(model).__name__)
        _check("export path", _graph_forward(graph, x), ref, TORCH_TOL)


def run_aten_case(case: cases.AtenCase, seen: set):
    gm, x = case.make(), _x(case.shape)
    with torch.no_grad():
        ref = gm(x).numpy()
    with recording(seen):
        graph = _ExportInterpreter(gm, gm.graph, case.name, {}, {}).run([case.shape])
    _check("hand-built ATen graph", _graph_forward(graph, x), ref, TORCH_TOL)


def run_onnx_case(case: cases.OnnxCase, seen: set):
    proto = case.make()
    x = np.random.default_rng(7).normal(size=(3, *case.shape)).astype(np.float32)
    ref = cases.ort_output(proto, x)
    with recording(seen):
        cm = pathir.compile(proto)  # its self-check runs onnxruntime too
    _check("ONNX", cm.forward(x.astype(np.float64), backend="numpy"), ref, ONNX_TOL)


def _run_all(*tables) -> tuple[dict, set]:
    """({case name: None, or why it failed}, the rows dispatched) over (table, runner) pairs."""
    outcome, seen = {}, set()
    for table, runner in tables:
        for name, case in table.items():
            assert name not in outcome, f"two cases named {name!r}"
            try:
                runner(case, seen)
                outcome[name] = None
            except Exception as err:  # an inexact result or a refusal: the case's own test reports it
                outcome[name] = "".join(traceback.format_exception_only(type(err), err)).strip()
    return outcome, seen


@pytest.fixture(scope="module")
def torch_run():
    return _run_all((cases.TORCH, run_torch_case), (cases.ATEN, run_aten_case))


@pytest.fixture(scope="module")
def onnx_run():
    return _run_all((cases.ONNX, run_onnx_case))


class KnownDefect(AssertionError):
    """A case marked xfail failed as its ``expect`` says (any other failure fails the test)."""


def _params(table):
    return [pytest.param(n, marks=pytest.mark.xfail(strict=True, raises=KnownDefect, reason=c.xfail)) if c.xfail else n
            for n, c in table.items()]


def _assert_exact(outcome, case):
    failure = outcome[case.name]
    if case.xfail is None:
        assert failure is None, failure
    elif failure is not None:
        if case.expect not in failure:
            pytest.fail(f"known defect ({case.xfail}), but the case fails otherwise: {failure}")
        raise KnownDefect(failure)


@pytest.mark.parametrize("name", _params(cases.TORCH))
def test_torch_case_is_exact(torch_run, name):
    _assert_exact(torch_run[0], cases.TORCH[name])


@pytest.mark.parametrize("name", _params(cases.ATEN))
def test_hand_built_aten_graph_is_exact(torch_run, name):
    _assert_exact(torch_run[0], cases.ATEN[name])


@pytest.mark.parametrize("name", _params(cases.ONNX))
def test_onnx_case_is_exact(onnx_run, name):
    _assert_exact(onnx_run[0], cases.ONNX[name])


@pytest.mark.parametrize("name", list(cases.REFUSALS))
def test_row_that_refuses_every_call_refuses(name):
    refusal, seen = cases.REFUSALS[name], set()
    with recording(seen), pytest.raises(UnsupportedOperation):
        refusal.lower()
    assert set(refusal.rows) <= seen, f"{name} was refused before its row was dispatched (expected: {refusal.why})"


# ====================================================================== coverage


def _unexpected_failures(outcome, table) -> list[str]:
    return sorted(n for n, f in outcome.items() if f is not None and not table[n].xfail)


def test_every_torch_row_is_exercised(torch_run):
    outcome, seen = torch_run
    missing = sorted(target_name(t) for t in set(TORCH_RULES) - seen - set(DEAD) - _REFUSING)
    failing = _unexpected_failures(outcome, {**cases.TORCH, **cases.ATEN})
    assert not missing, (f"{len(missing)} torch rows no case in tests/op_table_cases.py reaches: {missing}"
                         f" (cases that failed before reaching theirs: {failing})")


def test_every_onnx_row_is_exercised(onnx_run):
    outcome, seen = onnx_run
    missing = sorted(set(ONNX_RULES) - seen)
    failing = _unexpected_failures(outcome, cases.ONNX)
    assert not missing, (f"{len(missing)} ONNX rows no case in tests/op_table_cases.py reaches: {missing}"
                         f" (cases that failed before reaching theirs: {failing})")


def test_dead_rows_are_rows_no_case_reaches(torch_run):
    stale = sorted(target_name(t) for t in DEAD if t not in TORCH_RULES)
    reached = sorted(target_name(t) for t in set(DEAD) & torch_run[1])
    assert not stale, f"DEAD lists rows the table no longer has: {stale}"
    assert not reached, f"DEAD lists rows the corpus reaches: {reached}"
    assert not set(DEAD) & _REFUSING


class _Spellings(nn.Module):
    """Every way of writing the dunder methods and upsample functions of ``DEAD``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("c", torch.tensor(2.0))
        self.register_buffer("w", torch.ones(4, 4))

    def forward(self, x):
        c, w, outs = self.c, self.w, []
        for name in ("add", "sub", "mul", "truediv", "matmul"):
            op = getattr(operator, name)
            outs += [op(x, x), op(c if name != "matmul" else w, x), getattr(x, f"__{name}__")(x),
                     getattr(c if name != "matmul" else w, f"__{name}__")(x)]
        for name in ("add", "mul"):
            outs += [getattr(x, f"__r{name}__")(x), getattr(c, f"__r{name}__")(x), getattr(x, f"__r{name}__")(2)]
        h = x * 1
        for name in ("iadd", "isub", "imul", "itruediv"):
            outs += [getattr(h, f"__{name}__")(x), getattr(operator, name)(h, x)]
        outs += [-x, x.__neg__(), c.__neg__() * x]
        img = x.reshape(-1, 1, 4, 4)
        outs += [F.upsample(img, scale_factor=2), F.upsample_nearest(img, scale_factor=2),
                 F.upsample_bilinear(img, scale_factor=2)]
        return outs


@pytest.mark.filterwarnings("ignore:`nn.functional.upsample")
def test_torch_fx_never_produces_the_dead_targets():
    nodes = trace(_Spellings()).nodes
    produced = {n.target for n in nodes if n.op in ("call_method", "call_function")}
    assert not produced & set(DEAD), sorted(target_name(t) for t in produced & set(DEAD))
    # why the table has no rows for the dunder methods (but __rsub__) and F.upsample*: fx never makes them
    dunders = {t for t in produced if isinstance(t, str) and t.startswith("__") and t != "__rsub__"}
    assert not dunders and not {F.upsample, F.upsample_nearest, F.upsample_bilinear} & produced
    assert F.interpolate in produced and "add" in produced and operator.iadd in produced


# ====================================================================== the tables themselves


def test_every_torch_row_has_a_callable_rule():
    kinds = (str, type, torch._ops.OpOverload)
    odd = [target_name(t) for t, r in TORCH_RULES.items() if not callable(r) or not (isinstance(t, kinds) or callable(t))]
    assert not odd, odd
    assert all(rule_for(t) is r for t, r in TORCH_RULES.items())


def test_torch_rows_have_distinct_names():
    names = [target_name(t) for t in TORCH_RULES]
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"rows named alike in docs and errors: {twice}"


def test_every_onnx_row_has_a_callable_rule():
    assert all(isinstance(op, str) and callable(r) for op, r in ONNX_RULES.items())


def test_onnx_refusal_reasons_name_no_lowered_op():
    stale = sorted(set(ONNX_WHY) & set(ONNX_RULES))
    assert not stale, f"frontends/onnx/why.py gives a refusal reason for ops the table lowers: {stale}"
