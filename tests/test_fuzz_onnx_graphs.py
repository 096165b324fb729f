"""Differential fuzzing of the ONNX frontend: random graphs written with onnx.helper
(tests/onnx_programs.py), compiled from a file on disk, each exact or refused.

- accepted: pathir's forward equals onnxruntime's (float64 graphs, run in double by onnxruntime: to
  1e-10; float32 graphs: to 1e-5 of the output's scale, onnxruntime rounding every product and sum to
  float32 over a few dozen terms), the ℓ1 and ℓ2 path-norms and the path count equal the graph's
  path-norm network run by onnxruntime (written from the definition, not by pathir; float32: 1e-5),
  and the files a PathCond write-back and then an equalization write-back save give onnxruntime's
  original outputs;
- refused: a PathirError naming the node and the op type of the op the graph must be refused for;
- either way the source file stays bytes-identical; any other exception fails.

The CI profile is derandomized; ``PATHIR_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz_onnx_graphs.py -m fuzz
--hypothesis-seed=random`` runs a long search (docs/architecture.md, "Testing the frontends")."""

import contextlib
import os

import numpy as np
import pytest
from fuzz_checks import equalized
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from onnx_programs import onnx_programs, run, window_out

import pathir
from pathir.errors import PathirError

CI_EXAMPLES = 60
LONG_EXAMPLES = int(os.environ.get("PATHIR_FUZZ_EXAMPLES", "500"))


def _close(got, want, tol, what, text):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}\n{text}"
    scale = max(float(np.abs(want).max()), 1e-30)
    err = float(np.abs(got - want).max())
    assert err <= tol * scale, f"{what}: error {err:.3g} of {scale:.3g}\n{text}"


def judge(program, folder):
    model = program.model()
    path = os.path.join(folder, "graph.onnx")
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    source = open(path, "rb").read()
    text = program.describe()
    try:
        try:
            cm = pathir.compile(path)
        except PathirError as err:
            assert program.refused is not None, f"refused a graph of claimed ops ({err})\n{text}"
            node, op = program.refused
            assert node in str(err) and op in str(err), f"the refusal does not name {node} ({op}): {err}\n{text}"
            return
        assert program.refused is None, f"accepted a graph with {program.refused}\n{text}"
        double = program.dtype == TensorProto.DOUBLE
        tol = 1e-10 if double else 1e-5
        x = np.random.default_rng(5).normal(size=(3, *program.input_shape)).astype(program.np_dtype)
        ref = run(model, x)
        got = cm.forward(x.astype(np.float64), backend="numpy")
        got = [got[k] for k in cm.graph.outputs] if isinstance(got, dict) else [got]
        assert len(got) == len(ref), f"{len(got)} outputs, onnxruntime {len(ref)}\n{text}"
        for g, r in zip(got, ref):
            _close(g, r, tol, "forward", text)
        for q in (1.0, 2.0):
            want = program.path_sum(q) ** (1 / q)
            assert cm.path_norm(q) == pytest.approx(want, rel=1e-5), f"path_norm({q})\n{text}"
        assert cm.num_paths() == pytest.approx(program.path_sum(0.0), rel=1e-6), f"path count\n{text}"
        with contextlib.suppress(pathir.NotConvergedWarning):
            cm.pathcond(max_sweeps=5)
        written = os.path.join(folder, "pathcond.onnx")
        cm.save(written)
        for a, r in zip(run_file(written, x), ref):
            _close(a, r, 1e-9 if double else 1e-4, "PathCond write-back", text)
        if equalized(cm):
            cm.save(written)
            for a, r in zip(run_file(written, x), ref):
                _close(a, r, 1e-9 if double else 1e-4, "equalization write-back", text)
    finally:
        assert open(path, "rb").read() == source, f"the source file changed\n{text}"


def run_file(path, x):
    import onnx

    return run(onnx.load(path), x)


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                      HealthCheck.function_scoped_fixture])


@settings(max_examples=CI_EXAMPLES, derandomize=True, **SETTINGS)
@given(program=onnx_programs(min_statements=3, refuse=0.15))
def test_random_onnx_graphs_are_exact_or_refused(program, tmp_path):
    judge(program, tmp_path)


@pytest.mark.slow
@pytest.mark.fuzz
@settings(max_examples=LONG_EXAMPLES, **SETTINGS)
@given(program=onnx_programs(min_statements=2, max_statements=10, refuse=0.15))
def test_long_fuzz_onnx_graphs(program, tmp_path):
    judge(program, tmp_path)


@given(L=st.integers(1, 9), k=st.integers(1, 3), s=st.integers(1, 3), p0=st.integers(0, 2), p1=st.integers(0, 2),
       d=st.integers(1, 2), ceil=st.booleans())
def test_the_generator_counts_the_windows_onnxruntime_computes(L, k, s, p0, p1, d, ceil):
    """The graphs' shapes rest on window_out: onnxruntime's output length of a MaxPool."""
    if p0 >= k or p1 >= k or (k - 1) * d + 1 > L + p0 + p1:
        return
    g = helper.make_graph(
        [helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[k], strides=[s], pads=[p0, p1], dilations=[d],
                          ceil_mode=int(ceil))],
        "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, L])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    out = run(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), np.ones((1, 1, L), np.float32))[0]
    assert window_out(L, k, s, p0, p1, d, ceil) == out.shape[-1]
