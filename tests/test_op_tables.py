"""Every row of the op tables has a case, and every case is exact against the definition.

The corpus (tests/op_table_cases.py) runs once per process, in a module-scoped fixture, with the
tables' dispatch recorded: the torch interpreters' ``rule_for`` and the ONNX walk's ``RULES.get``
are wrapped for the run. Each case then has a test reading its outcome, and the coverage tests
compare the rows dispatched with the tables (no dependence on test order or on xdist workers).

- torch: a model is lowered on the fx path (``pathir.compile``, with its self-check) and on the
  export path (``lower_exported``); the IR's forward matches the model's own float64 forward to
  1e-10 relative. ATen overloads torch.export never produces are hand-built fx graphs, interpreted
  by the export interpreter and compared with the GraphModule run in float64.
- ONNX: a graph built with onnx.helper is compiled (self-check against onnxruntime) and its IR
  forward matches onnxruntime's float32 output to 1e-5 relative.
"""

from __future__ import annotations

import contextlib
import traceback

import numpy as np
import op_table_cases as cases
import pytest
import torch

import pathir
from pathir.backends import get_backend
from pathir.frontends.onnx import lowering as onnx_lowering
from pathir.frontends.torch import interpreter
from pathir.frontends.torch.export import lower_exported
from pathir.frontends.torch.table import RULES as TORCH_RULES
from pathir.frontends.torch.table import target_name
from pathir.lifting.walk import forward

TORCH_TOL, ONNX_TOL = 1e-10, 1e-5


# ====================================================================== recording


def _row(target):
    """The table row a dispatched target uses (a module class: its nearest base with a row)."""
    if isinstance(target, type):
        return next((c for c in target.__mro__ if c in TORCH_RULES), target)
    return target


class _RecordingRules(dict):
    """The ONNX op table, recording every op type looked up."""

    def __init__(self, table, seen):
        super().__init__(table)
        self.seen = seen

    def get(self, key, default=None):
        if key in self:
            self.seen.add(key)
        return super().get(key, default)


@contextlib.contextmanager
def recording(seen: set):
    """Record into ``seen`` the torch targets whose row is dispatched and the ONNX op types looked up."""
    original = interpreter.rule_for

    def rule_for(target):
        rule = original(target)
        if rule is not None:
            seen.add(_row(target))
        return rule

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "rule_for", rule_for)
        mp.setattr(onnx_lowering, "RULES", _RecordingRules(onnx_lowering.RULES, seen))
        yield


# ====================================================================== running the cases


def _rel(out, ref) -> float:
    out, ref = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, f"shape {out.shape}, expected {ref.shape}"
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-300))


def _check(what, out, ref, tol):
    err = _rel(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


def run_torch_case(case: cases.TorchCase, seen: set):
    model = case.make()
    x = torch.randn(3, *case.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    with torch.no_grad():
        ref = model(x).numpy()
    if "fx" in case.paths:
        rows: set = set()
        with recording(rows):
            cm = pathir.compile(model, input_shape=case.shape)
        aten = sorted(target_name(r) for r in rows if isinstance(r, torch._ops.OpOverload))
        assert not aten, f"fx path: torch.fx failed and pathir fell back to torch.export ({aten})"
        seen |= rows
        _check("fx path", cm.forward(x.numpy(), backend="numpy"), ref, TORCH_TOL)
    if "export" in case.paths:
        with recording(seen):
            graph = lower_exported(model, case.shape, type(model).__name__)
        _check("export path", forward(graph, get_backend("numpy"), x.numpy())[graph.outputs[0]], ref, TORCH_TOL)


def _run_all(table: dict, runner) -> tuple[dict, set]:
    """{case name: None or the failure}, and the rows dispatched."""
    outcome, seen = {}, set()
    for name, case in table.items():
        try:
            runner(case, seen)
            outcome[name] = None
        except Exception as err:  # an AssertionError or a refusal: reported by the case's test
            outcome[name] = "".join(traceback.format_exception_only(type(err), err)).strip()
    return outcome, seen


@pytest.fixture(scope="module")
def torch_run():
    return _run_all(cases.TORCH, run_torch_case)


def _params(table):
    return [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=c.xfail)) if c.xfail else n
            for n, c in table.items()]


@pytest.mark.parametrize("name", _params(cases.TORCH))
def test_torch_case_is_exact(torch_run, name):
    failure = torch_run[0][name]
    assert failure is None, failure


def test_every_torch_row_is_exercised(torch_run):
    missing = sorted(target_name(t) for t in set(TORCH_RULES) - torch_run[1])
    assert not missing, f"{len(missing)} torch rows no case reaches: {missing}"
