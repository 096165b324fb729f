"""Differential fuzzing of the torch frontend: random torch programs (tests/torch_programs.py), each
compiled on the fx path and on the torch.export fallback, and each exact or refused.

- accepted: the forward equals eager float64 PyTorch to 1e-10, the ℓ1 and ℓ2 path-norms and the path
  count equal the program's path-norm network (written from the definition, not by pathir; with a
  batch-norm that reads a layer with a bias, one of the networks with it folded or kept), and a
  PathCond write-back, then an equalization write-back, keep the eager function;
- refused: a PathirError naming the non-homogeneous op the program holds, the state_dict bit-identical;
- anything else (another exception type, an accepted non-homogeneous program) fails.

The same programs exported to ONNX (the TorchScript exporter, no constant folding) are judged against
onnxruntime: forward to float32 precision, path-norms against the same path-norm network, a PathCond
write-back and then an equalization write-back whose files onnxruntime runs to the same outputs.

The CI profile is derandomized; ``pytest -m fuzz --hypothesis-seed=random -p no:randomly`` with
``PATHIR_FUZZ_EXAMPLES=2000`` runs a long search (docs/architecture.md, "Testing")."""

import contextlib
import os

import numpy as np
import pytest
import torch
from fuzz_checks import equalized
from hypothesis import HealthCheck, given, reject, settings
from torch_programs import export_path, torch_programs

import pathir
from pathir.errors import PathirError
from pathir.frontends.onnx.table import RULES as ONNX_RULES

CI_EXAMPLES = 100  # per path: 200 programs, about half a minute on two cores
LONG_EXAMPLES = int(os.environ.get("PATHIR_FUZZ_EXAMPLES", "500"))


def _outputs(out):
    if isinstance(out, dict):
        return [out[k] for k in sorted(out)]
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _close(got, want, what, source):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    scale = max(float(np.abs(want).max()), 1e-300)
    assert got.shape == want.shape and float(np.abs(got - want).max()) <= 1e-10 * scale, f"{what}\n{source}"


def _one_of(got: float, wants: list[float], rel: float, what: str) -> None:
    """``got`` equals one of the path-norm networks' figures (one per fold choice at the batch-norms that
    read a layer with a bias; a single one without such batch-norms) to ``rel``."""
    assert any(got == pytest.approx(w, rel=rel) for w in wants), f"{got!r} not in {wants!r}: {what}"


def judge(program, path: str):
    model = program.build()
    source = program.source()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with torch.no_grad():
        eager = [t.numpy() for t in _outputs(model(x))]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with export_path() if path == "export" else contextlib.nullcontext():  # re-reads after a write trace again
        _judge_compiled(program, model, source, x, eager, state)


def _judge_compiled(program, model, source, x, eager, state):
    try:
        cm = pathir.compile(model, input_shape=(3, 8, 8))
    except PathirError as err:
        assert program.refused_op is not None, f"refused a homogeneous program ({err})\n{source}"
        assert program.refused_op in str(err).lower(), f"the refusal does not name {program.refused_op}: {err}\n{source}"
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items()), f"refusal changed the model\n{source}"
        return
    if program.refused_op == "batch size":  # compiled where what it divides is 0 (x - x): one function at every batch
        for batch in (1, 3, 6):
            xb = torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(batch), dtype=torch.float64)
            with torch.no_grad():
                want = [t.numpy() for t in _outputs(model(xb))]
            got = cm.forward(xb.numpy(), backend="numpy")
            for g, e in zip([got[k] for k in cm.graph.outputs] if isinstance(got, dict) else [got], want):
                _close(g, e.reshape(g.shape) if g.size == e.size else e, f"forward at batch {batch}", source)
        return
    assert program.refused_op is None, f"accepted a program with {program.refused_op}\n{source}"
    got = cm.forward(x.numpy(), backend="numpy")
    got = [got[k] for k in cm.graph.outputs] if isinstance(got, dict) else [got]
    assert len(got) == len(eager), source
    for g, e in zip(got, eager):
        _close(g, e.reshape(g.shape) if g.size == e.size else e, "forward", source)
    for q in (1.0, 2.0):
        wants = [v ** (1 / q) for v in program.path_sums(model, q)]
        _one_of(cm.path_norm(q), wants, 1e-9, f"path_norm({q})\n{source}")
    _one_of(cm.num_paths(), program.path_sums(model, 0), 1e-9, f"path count\n{source}")
    with contextlib.suppress(pathir.NotConvergedWarning):
        cm.pathcond(max_sweeps=5)
    with torch.no_grad():
        after = [t.numpy() for t in _outputs(model(x))]
    for a, e in zip(after, eager):
        _close(a, e, "PathCond write-back", source)
    if equalized(cm):
        with torch.no_grad():
            after = [t.numpy() for t in _outputs(model(x))]
        for a, e in zip(after, eager):
            _close(a, e, "equalization write-back", source)


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("path", ["fx", "export"])
@settings(max_examples=CI_EXAMPLES, derandomize=True, **SETTINGS)
@given(program=torch_programs())
def test_random_programs_are_exact_or_refused(path, program):
    judge(program, path)


@pytest.mark.slow
@pytest.mark.fuzz
@pytest.mark.parametrize("path", ["fx", "export"])
@settings(max_examples=LONG_EXAMPLES, **SETTINGS)
@given(program=torch_programs(max_statements=12, non_homogeneous=0.15))
def test_long_fuzz(path, program):
    judge(program, path)


def judge_onnx(program, exporter: str = "legacy-nofold"):
    """The program exported to ONNX (by default the TorchScript exporter, no constant folding): pathir's
    compile of the file equals onnxruntime to float32 precision and the path-norms equal the program's
    path-norm network, or it is refused naming the op; a PathCond write-back keeps onnxruntime's output."""
    from onnx_cases import export, ort_run

    model = program.build().float()  # exported as users export: float32
    source = program.source()
    try:
        proto = export(model, (3, 8, 8), exporter, dynamic_batch=True)
    except Exception:  # the exporter's own failure (adaptive max-pools to a size > 1): no file to judge
        reject()
    x = np.random.default_rng(5).normal(size=(2, 3, 8, 8)).astype(np.float32)
    ref = ort_run(proto, x)
    try:
        cm = pathir.compile(proto)
    except PathirError as err:
        if program.refused_op is None:  # only an op the ONNX table does not claim
            op = getattr(err, "op", None)
            assert op in {n.op_type for n in proto.graph.node} and op not in ONNX_RULES, \
                f"refused a homogeneous program ({err})\n{source}"
        return
    # the TorchScript exporter writes len(x) as the number it traced: that file computes one function at every batch
    baked = program.refused_op == "batch size"
    assert program.refused_op is None or baked, f"accepted a program with {program.refused_op}\n{source}"
    got = cm.forward(x.astype(np.float64), backend="numpy")
    got = [got[k] for k in cm.graph.outputs] if isinstance(got, dict) else [got]
    for g, r in zip(got, ref):
        scale = max(float(np.abs(r).max()), 1e-30)
        assert float(np.abs(g - r).max()) <= 1e-5 * scale, f"ONNX forward\n{source}"
    if baked:  # (the program's path-norm network reads the batch size: no reference for the file)
        return
    for q in (1.0, 2.0):  # the exported weights are the model's, rounded to float32
        wants = [v ** (1 / q) for v in program.path_sums(model.double(), q)]
        _one_of(cm.path_norm(q), wants, 1e-6, f"ONNX path_norm({q})\n{source}")
    with contextlib.suppress(pathir.NotConvergedWarning):
        cm.pathcond(max_sweeps=5)
    for a, r in zip(ort_run(cm.writer.to_onnx(), x), ref):
        scale = max(float(np.abs(r).max()), 1e-30)
        assert float(np.abs(a - r).max()) <= 1e-4 * scale, f"ONNX PathCond write-back\n{source}"
    if equalized(cm):
        for a, r in zip(ort_run(cm.writer.to_onnx(), x), ref):
            scale = max(float(np.abs(r).max()), 1e-30)
            assert float(np.abs(a - r).max()) <= 1e-4 * scale, f"ONNX equalization write-back\n{source}"


@settings(max_examples=40, derandomize=True, **SETTINGS)
@given(program=torch_programs(max_statements=5))
def test_random_programs_exported_to_onnx_are_exact_or_refused(program):
    judge_onnx(program)


@settings(max_examples=10, derandomize=True, **SETTINGS)
@given(program=torch_programs(max_statements=5))
def test_random_programs_exported_by_dynamo_are_exact_or_refused(program):
    """The exporter torch.onnx.export uses by default (dynamo; about 2 s a program, so a few in CI)."""
    judge_onnx(program, "dynamo")
