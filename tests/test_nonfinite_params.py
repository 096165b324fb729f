"""A NaN or infinite weight, bias or fixed coefficient is refused by name: some walks dropped a NaN bias
(a finite, wrong path-norm: 2.0 where the definition is NaN), and a NaN fixed multiplier lost every path."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pathir
from pathir.errors import GraphVerificationError, PathirError
from pathir.ir import Dense, GraphBuilder
from pathir.ir.maps import Conv, Pool, SpatialMatrix

P = GraphBuilder.param


def _nan_bias_graph():
    b = GraphBuilder("g")
    x = b.input("x", (2,))
    h = b.relu("h", [(x, Dense(P("w1", np.eye(2))))], bias=P("b1", [np.nan, 0.0]))
    return b.build([b.identity("y", [(h, Dense(P("w2", np.ones((1, 2)))))])])


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_a_nan_bias_is_refused_naming_it(backend):
    cm = pathir.compile(_nan_bias_graph(), progress=False)
    with pytest.raises(PathirError, match=r"param 'b1'.*1 NaN or infinite entries"):
        cm.path_norm(1, backend=backend)


@pytest.mark.parametrize("fixed", [Pool((2,), (2,), ((0, 0),), (1,), False, np.array([np.nan, 1.0])),
                                   SpatialMatrix(np.array([[np.nan, 1.0, 0.0, 0.0]]), (1,))])
def test_a_nan_fixed_coefficient_fails_verification(fixed):
    b = GraphBuilder()
    x = b.input("x", (1, 4))
    h = b.relu("h", [(x, Conv(P("w", np.ones((1, 1, 1))), (1,), ((0, 0),), (1,)))])
    with pytest.raises(GraphVerificationError, match="non-finite fixed coefficient"):
        pathir.compile(b.build([b.identity("y", [(h, fixed)])]), progress=False)


def test_a_torch_model_with_a_nan_bias_is_refused_at_compile_and_after_a_live_edit():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).double()
    cm = pathir.compile(net, input_shape=(3,))
    with torch.no_grad():
        net[0].bias[1] = float("inf")
    with pytest.raises(PathirError, match=r"param '0.bias' \(from 0.bias\).*inf at flat index 1"):
        cm.path_norm(1)
    with pytest.raises(PathirError, match="param '0.bias'"):
        pathir.compile(net, input_shape=(3,))


def test_a_nan_batchnorm_statistic_folded_into_a_weight_is_named():
    """The message named the folded weight '0.weight' only ("fix the model's weights"); its recipe names the
    batch-norm's running variance."""
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU()).eval()
    with torch.no_grad():
        net[1].running_var[2] = float("nan")
    with pytest.raises(PathirError, match=r"param '0.weight' \(made as 0.weight \* \(1.weight / sqrt\(1.running_var"):
        pathir.compile(net, input_shape=(3, 6, 6))


def test_a_shape_of_booleans_fails_verification():
    from pathir.ir import Graph, Node, NodeKind, verify

    graph = Graph((Node("x", NodeKind.INPUT, (True,)), ), ("x",), "g")
    with pytest.raises(GraphVerificationError, match="not positive integers"):
        verify(graph)


@pytest.mark.parametrize("backend", ["torch", "numpy"])
@pytest.mark.parametrize("tiny", [1e-310, 5e-324])
def test_a_subnormal_weight_is_refused_naming_it(backend, tiny):
    """The torch walks count subnormals as 0: one path of weights 1e-310 and 1e300 (Φ = 1e-10, the model's own
    forward on 1) had path-norm 0.0, scores 0.0 and a path-metric '0 <= d <= 0 (exact)'."""
    b = GraphBuilder("g")
    x = b.input("x", (1,))
    h = b.relu("h", [(x, Dense(P("w1", np.array([[tiny]]))))])
    cm = pathir.compile(b.build([b.identity("y", [(h, Dense(P("w2", np.array([[1e300]]))))])]), progress=False)
    with pytest.raises(PathirError, match=r"param 'w1'.*1 subnormal float64 entries"):
        cm.path_norm(1, backend=backend)


def test_a_nan_behind_a_parametrization_is_named_by_the_tensor_that_holds_it():
    """A NaN in a weight-norm's original0 was named by the weight's name only (last notes' Left): the refusal now
    lists the model's tensors that hold NaN or infinite entries."""
    import torch

    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    torch.nn.utils.parametrizations.weight_norm(net[0])
    with torch.no_grad():
        net[0].parametrizations.weight.original0[1] = float("nan")
    with pytest.raises(PathirError) as info:
        pathir.compile(net, input_shape=(3,))
    assert "'0.parametrizations.weight.original0' (1 of 4 entries)" in "".join(info.value.__notes__)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 7), st.sampled_from([0.0, np.nan, np.inf, -np.inf, 1e-310, -4e-320, 3.0]),
       st.integers(0, 2**16))
def test_the_chunked_finiteness_scan_is_its_definition(size, chunk, planted, seed):
    """Every entry finite and 0 or normal, read a chunk at a time, whatever chunk holds the planted entry."""
    from pathir.analyses.facts import _normal_or_zero

    tiny = np.finfo(np.float64).tiny
    rng = np.random.default_rng(seed)
    value = rng.normal(size=size) * rng.choice([0.0, 1.0], size=size)
    value[rng.integers(size)] = planted
    magnitude = np.abs(value)
    expected = bool(np.all(np.isfinite(value)) and np.all((magnitude == 0) | (magnitude >= tiny)))
    assert _normal_or_zero(value.reshape(1, -1), tiny, chunk=chunk) == expected
