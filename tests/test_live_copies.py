"""A Compiled copied, pickled, or queried from two threads: each answer is for the model it follows as it is at
the time of the call, or a refusal; never another model's or an earlier state's number."""

import copy
import pickle
import threading

import pytest
import torch
import torch.nn as nn

import pathir
from pathir.errors import ModelChanged, PathirError


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)).double()


def _fresh(model):
    return pathir.compile(model, input_shape=(3,), self_check=False).path_norm(1)


def test_a_deep_copy_follows_the_copied_model():
    """It refused every query ('the model was replaced by the model'); after refresh() it answered for the original
    model (6.50 for 14.42), and its pathcond wrote into the copy a rescaling computed on the original."""
    net = _net()
    cm = pathir.compile(net, input_shape=(3,))
    twin = copy.deepcopy(cm)
    assert twin.model is not net
    with torch.no_grad():
        twin.model[0].weight.mul_(3)
    assert twin.path_norm(1) == pytest.approx(_fresh(twin.model), rel=1e-12)
    assert cm.path_norm(1) == pytest.approx(_fresh(net), rel=1e-12) != pytest.approx(twin.path_norm(1))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    twin.pathcond()
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_a_container_copied_whole_keeps_its_penalty_on_its_own_model():
    class Trainer(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _net()
            self.penalty = pathir.PathNormPenalty(self.net, q=1, input_shape=(3,))

    trainer = Trainer()
    twin = copy.deepcopy(trainer)
    assert twin.penalty.compiled.model is twin.net
    with torch.no_grad():
        twin.net[0].weight.mul_(2)
    assert float(twin.penalty()) == pytest.approx(_fresh(twin.net), rel=1e-12)
    assert float(trainer.penalty()) == pytest.approx(_fresh(trainer.net), rel=1e-12)


def test_a_shallow_copy_is_a_second_compiled_of_the_same_model():
    """Both shared one watch: once one re-read the model the other kept its old graph (6.50 for 14.42)."""
    net = _net()
    cm = pathir.compile(net, input_shape=(3,))
    other = copy.copy(cm)
    with torch.no_grad():
        net[0].weight.mul_(3)
    assert cm.path_norm(1) == pytest.approx(_fresh(net), rel=1e-12)
    assert other.path_norm(1) == pytest.approx(_fresh(net), rel=1e-12)


def test_pickling_and_copying_a_snapshot_are_refused_by_name():
    cm = pathir.compile(_net(), input_shape=(3,))
    with pytest.raises(PathirError, match="not pickled"):
        pickle.dumps(cm)
    with pytest.raises(PathirError, match="snapshot"):
        copy.deepcopy(cm.rescaled([0.1] * len(cm.units)))
    assert pathir.compile(pickle.loads(pickle.dumps(cm.graph))).path_norm(1) == pytest.approx(cm.path_norm(1))


def test_a_query_in_one_thread_looks_at_the_model_while_another_threads_call_runs():
    """The 'looked once' flag was per object: while one thread ran a long query, another thread's queries skipped
    the look and answered for the model before its edit (30 of 30 answers one edit behind)."""
    net = _net()
    cm = pathir.compile(net, input_shape=(3,))
    inside, done = threading.Event(), threading.Event()

    def long_call():
        with cm.looking_once():  # a call in progress, which has looked
            cm.path_norm(1)
            inside.set()
            done.wait(10)

    worker = threading.Thread(target=long_call)
    worker.start()
    inside.wait(10)
    with torch.no_grad():
        net[0].weight.mul_(1.1)
    try:
        assert cm.path_norm(1) == pytest.approx(_fresh(net), rel=1e-12)
    finally:
        done.set()
        worker.join()


def test_a_parameter_made_under_inference_mode_after_compile_is_refused():
    """Accepted, and its later in-place edits (which bump no version counter) went unseen: a stale path-norm."""
    net = _net()
    cm = pathir.compile(net, input_shape=(3,))
    with torch.inference_mode():
        w = net[0].weight.detach() * 1.0
    net[0].weight = nn.Parameter(w, requires_grad=False)
    with pytest.raises(ModelChanged, match="inference_mode"):
        cm.path_norm(1)


def test_a_parameter_swapped_for_a_meta_tensor_after_compile_is_refused():
    """Its re-read raised torch's own NotImplementedError ('Cannot copy out of meta tensor')."""
    net = _net()
    cm = pathir.compile(net, input_shape=(3,))
    before = {k: v.clone() for k, v in net.state_dict().items() if k != "0.weight"}
    net[0].weight = nn.Parameter(torch.empty_like(net[0].weight, device="meta"))
    for call in (lambda: cm.path_norm(1), cm.pathcond):
        with pytest.raises(ModelChanged, match="meta device"):
            call()
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())
