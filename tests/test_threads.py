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


def _blas_threads() -> set[int]:
    from threadpoolctl import threadpool_info

    return {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}


def test_one_blas_thread_limits_the_main_thread_until_its_outermost_block_ends():
    from threadpoolctl import threadpool_limits

    from pathir.support.threads import one_blas_thread

    with threadpool_limits(limits=2, user_api="blas"):
        with one_blas_thread():
            with one_blas_thread():
                assert _blas_threads() == {1}
            assert _blas_threads() == {1}  # the inner block's end keeps the outer one's limit
        assert _blas_threads() == {2}


def test_blocks_of_two_threads_closed_out_of_order_leave_blas_as_it_was():
    """The main thread's block opens, a worker's opens, the main's closes, then the worker's: only the main
    thread limits (one limit counted across threads was restored by the worker, which OpenBLAS ignored after
    the main thread had lowered it: numpy stayed on one thread), a worker's block changes nothing."""
    import threading

    from threadpoolctl import threadpool_limits

    from pathir.support.threads import one_blas_thread

    opened, main_closed, seen = threading.Event(), threading.Event(), []

    def worker():
        with one_blas_thread():
            opened.set()
            main_closed.wait(10)
            seen.append(_blas_threads())

    with threadpool_limits(limits=2, user_api="blas"):
        t = threading.Thread(target=worker)
        with one_blas_thread():
            t.start()
            opened.wait(10)
            assert _blas_threads() == {1}
        main_closed.set()
        t.join(10)
        assert seen == [{2}]
        assert _blas_threads() == {2}


def test_compile_and_public_calls_run_numpy_blas_on_one_thread_and_restore_it():
    """A user's pass runs inside compile, pathcond's callback inside the call: BLAS on one thread in both
    (OpenBLAS's spinning workers slowed the torch ops after every threaded product), the caller's count after."""
    from threadpoolctl import threadpool_limits

    import pathir

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    inside = []

    def watching(graph):
        inside.append(_blas_threads())
        return graph

    with threadpool_limits(limits=2, user_api="blas"):
        cm = pathir.compile(net, input_shape=(3,), passes=[watching])
        cm.pathcond(callback=lambda step, f: inside.append(_blas_threads()))
        assert len(inside) > 1 and all(s == {1} for s in inside)
        assert _blas_threads() == {2}
