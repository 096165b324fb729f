"""one_torch_thread: one thread inside, the caller's count restored after, also on an error; beside: a second thread."""

import pytest
import torch

from pathir.support.threads import one_torch_thread


def test_restored_after_an_error():
    before = torch.get_num_threads()
    with pytest.raises(ValueError), one_torch_thread():
        assert torch.get_num_threads() == 1
        raise ValueError
    assert torch.get_num_threads() == before


def test_beside_runs_on_the_second_thread_and_re_raises_its_error():
    import threading

    from pathir.support.threads import beside

    assert beside(lambda: threading.current_thread().name).result().startswith("pathir-beside")
    with pytest.raises(ZeroDivisionError):
        beside(lambda: 1 / 0).result()


def test_beside_called_beside_runs_inline_instead_of_waiting_for_itself():
    from pathir.support.threads import beside

    assert beside(lambda: beside(lambda: 7).result() + 1).result() == 8  # one worker: a queued call would deadlock


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="fork only")
def test_beside_in_a_forked_child_gets_its_own_thread():
    import os

    from pathir.support.threads import beside

    assert beside(lambda: 1).result() == 1  # the parent's pool exists
    pid = os.fork()
    if pid == 0:  # the child's copy of the pool has no thread: a new one must be made
        os._exit(0 if beside(lambda: 2).result() == 2 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
