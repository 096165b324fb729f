"""One torch thread for loops of small ops.

A loop of cache-sized torch ops (a chunked log, a block-by-block write) opens one
parallel region per op; each costs a hand-off to torch's other threads worth
more than the op's share of work, and on a loaded machine a wait for a
descheduled thread (measured on 2 shared cores: a chunked log over diag G 5 to 15x
slower on 2 threads than on 1). Inside :func:`one_torch_thread` such loops run on the
calling thread; large single ops (a walk's convolutions) keep every thread.
:func:`one_blas_thread` does the same for numpy's and scipy's BLAS (the solvers' small
vector operations). Used by: the chunked logs of diag G (`pathir.support.fast_log`), the power view's
|w|^q blocks of a large dense weight (``backends.torch``) and the torch writer's
row blocks (``frontends.torch.writer``).

>>> import torch
>>> before = torch.get_num_threads()
>>> with one_torch_thread():
...     torch.get_num_threads()
1
>>> torch.get_num_threads() == before
True
>>> from threadpoolctl import threadpool_info
>>> with one_blas_thread():
...     all(lib["num_threads"] == 1 for lib in threadpool_info() if lib["user_api"] == "blas")
True
"""

from __future__ import annotations

import contextlib
import os
import threading

__all__ = ["one_torch_thread", "one_blas_thread", "beside"]

_POOL = None  # (pid, the one worker thread of `beside`), made on first use in each process
_BLAS = None  # threadpoolctl's controller of the loaded BLAS libraries, made once (see one_blas_thread)


@contextlib.contextmanager
def one_torch_thread():
    """torch's intra-op threads set to 1 inside the block, restored after (also on an error)."""
    import torch  # lazy: keeps torch out of `import pathir`

    old = torch.get_num_threads()
    if old == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@contextlib.contextmanager
def one_blas_thread():
    """numpy's and scipy's BLAS limited to one thread inside the block (threadpoolctl), restored after.
    The controller is made once per process: making one scans every loaded library, 2 to 8 ms with
    torch loaded, and PathCond and equalize each entered such a limit at least once per call."""
    global _BLAS
    if _BLAS is None:
        import scipy.linalg  # noqa: F401  (its BLAS loaded before the libraries are listed)
        from threadpoolctl import ThreadpoolController  # lazy: spares `import pathir` the package

        _BLAS = ThreadpoolController()
    with _BLAS.limit(limits=1, user_api="blas"):
        yield


def beside(fn, *args, here: bool = False):
    """``fn(*args)`` started on a second thread, returning a handle whose ``result()`` waits for it (and
    re-raises its error): for two memory-bound halves of one evaluation (numpy's products release the
    GIL), each on its own core. One worker for the process, so a call made on it runs right there, as
    does every call with ``here`` (the same handle, already done: callers need no second code path)."""
    global _POOL
    from concurrent.futures import Future, ThreadPoolExecutor

    if here or threading.current_thread().name.startswith("pathir-beside"):  # (on the worker: no deadlock)
        done = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as err:
            done.set_exception(err)
        return done
    if _POOL is None or _POOL[0] != os.getpid():  # a forked child inherits the pool but not its thread
        _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="pathir-beside"))
    return _POOL[1].submit(fn, *args)
