"""Every bad argument of a public call is refused with a PathirError naming it, the model untouched.

The subclasses keep the builtin type a caller may already catch: ArgumentError and
InputShapeError are ValueErrors, ArgumentTypeError a TypeError, ArgumentKeyError a KeyError.
"""

import math

import numpy as np
import pytest
import torch

import pathir
from pathir.errors import ArgumentError, ArgumentKeyError, ArgumentTypeError, InputShapeError, PathirError


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).double()


@pytest.fixture()
def cm():
    return pathir.compile(_mlp(), input_shape=(3,))


X_BAD = np.ones((2, 5))

#: (call, the argument's name as the message must show it, the error class)
CALLS = [
    (lambda cm: cm.path_norm(0), "q", ArgumentError),
    (lambda cm: cm.path_norm(-1), "q", ArgumentError),
    (lambda cm: cm.path_norm(float("nan")), "q", ArgumentError),
    (lambda cm: cm.path_norm("2"), "q", ArgumentTypeError),
    (lambda cm: cm.path_norm(None), "q", ArgumentTypeError),
    (lambda cm: cm.path_norms((1, 0)), "q", ArgumentError),
    (lambda cm: cm.summary(qs=(2, -2)), "q", ArgumentError),
    (lambda cm: cm.active_path_norm(np.ones((2, 3)), q=0), "q", ArgumentError),
    (lambda cm: cm.active_path_norm(X_BAD), "x", InputShapeError),
    (lambda cm: cm.active_path_counts(X_BAD), "x", InputShapeError),
    (lambda cm: cm.local_affine(X_BAD), "x", InputShapeError),
    (lambda cm: cm.forward(X_BAD), "x", InputShapeError),
    (lambda cm: cm.forward(np.ones((0, 3))), "x", InputShapeError),  # an empty batch (was a BackendError)
    (lambda cm: cm.local_affine(np.ones((2, 3))).jvp(np.ones((3, 3))), "v", InputShapeError),
    (lambda cm: cm.local_affine(np.ones((1, 3))).slope(output="nope"), "output", ArgumentError),
    (lambda cm: cm.pathcond(max_log_scale=-1), "max_log_scale", ArgumentError),
    (lambda cm: cm.pathcond(solver="nope"), "solver", ArgumentError),
    (lambda cm: cm.enorm(max_log_scale=-1), "max_log_scale", ArgumentError),
    (lambda cm: cm.enorm(p=0), "p", ArgumentError),
    (lambda cm: cm.enorm(solver="nope"), "method", ArgumentError),
    (lambda cm: cm.enorm(costs=np.ones(3)), "costs", ArgumentError),
    (lambda cm: cm.enorm(costs={"nope": 1.0}), "costs", ArgumentKeyError),
    (lambda cm: cm.normalize(p=0), "p", ArgumentError),
    (lambda cm: cm.rescaled(np.zeros(3)), "z", ArgumentError),
    (lambda cm: cm.rescaled(np.full(4, np.nan)), "z", ArgumentError),
    (lambda cm: cm.rescaled("ab"), "z must be real numbers", ArgumentError),
    (lambda cm: cm.rescaled(np.array([1j, 0, 0, 0])), "z must be real numbers", ArgumentError),
    (lambda cm: cm.rescaled([[0.0, 1.0], [2.0]]), "z must be an array", ArgumentError),
    (lambda cm: cm.commit_rescaling(np.zeros(5)), "z", ArgumentError),
    (lambda cm: cm.prune(2.5), "amount", ArgumentError),
    (lambda cm: cm.prune("half"), "amount", ArgumentError),
    (lambda cm: cm.prune(0.5, criterion="nope"), "criterion", ArgumentError),
    (lambda cm: cm.prune(0.5, scope="nope"), "scope", ArgumentError),
    (lambda cm: cm.get_backend("nope"), "backend", ArgumentError),
    (lambda cm: cm.path_norm(1, backend="nope"), "backend", ArgumentError),
    (lambda cm: cm.units["nope"], "unit", ArgumentKeyError),
    (lambda cm: cm.graph.node("nope"), "node", ArgumentKeyError),
    (lambda cm: pathir.path_metric(cm, "a model"), "a and b", ArgumentTypeError),
    (lambda cm: pathir.output_bound(cm, cm, X_BAD), "x", InputShapeError),
    (lambda cm: pathir.active_path_metric(cm, cm, X_BAD), "x", InputShapeError),
    (lambda cm: pathir.observe(cm, np.ones((2, 3)), qs=(1, 0)), "q", ArgumentError),
    (lambda cm: pathir.observe(cm, X_BAD), "x", InputShapeError),
    (lambda cm: pathir.optim.PathSGD(cm.model.parameters(), cm, lr=-1), "lr", ArgumentError),
    (lambda cm: pathir.optim.PathSGD(cm.model.parameters(), cm, k=1.5), "k", ArgumentError),
    (lambda cm: pathir.optim.PathSGD(cm.model.parameters(), cm, momentum=1), "momentum", ArgumentError),
]


@pytest.mark.parametrize("call, name, kind", CALLS)
def test_a_bad_argument_is_a_pathir_error_naming_it(cm, call, name, kind):
    before = {k: v.clone() for k, v in cm.model.state_dict().items()}
    with pytest.raises(kind) as info:
        call(cm)
    assert isinstance(info.value, PathirError)
    assert name in str(info.value), str(info.value)
    assert "\n" not in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in cm.model.state_dict().items())


def test_the_error_classes_keep_the_builtin_ones():
    assert issubclass(ArgumentError, ValueError) and issubclass(InputShapeError, ValueError)
    assert issubclass(ArgumentTypeError, TypeError) and issubclass(ArgumentKeyError, KeyError)
    assert str(ArgumentKeyError("no unit named 'u'")) == "no unit named 'u'"  # not KeyError's quoted repr
    for cls in (ArgumentError, ArgumentTypeError, ArgumentKeyError):
        assert getattr(pathir, cls.__name__) is cls


@pytest.mark.parametrize("shape", [(3, 6.5, 6), (3, 6.0, 6), (3, -6, 6), (3, 0, 6), -3, 0, "3", (3, "6", 6), 2.5])
def test_input_shape_needs_positive_integer_sizes(shape):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 2, 3), torch.nn.ReLU()).double()
    with pytest.raises(InputShapeError, match="input_shape"):
        pathir.compile(model, input_shape=shape)


def test_integer_types_of_other_libraries_are_sizes():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 2, 3), torch.nn.ReLU()).double()
    for shape in [(3, np.int64(6), 6), torch.Size([3, 6, 6]), np.array([3, 6, 6])]:
        cm = pathir.compile(model, input_shape=shape)
        assert cm.graph.node(cm.graph.inputs[0]).shape == (3, 6, 6)


def test_q_inf_is_accepted_everywhere_q_is(cm):
    x = np.random.default_rng(0).normal(size=(2, 3))
    assert cm.path_norm(math.inf) <= cm.path_norm(2)
    assert np.all(cm.active_path_norm(x, math.inf) <= cm.path_norm(math.inf) * (1 + 1e-15))
