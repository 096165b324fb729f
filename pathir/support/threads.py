"""One torch thread for loops of small ops.

A loop of cache-sized torch ops (a chunked log, a block-by-block write) opens one
parallel region per op; each costs a hand-off to torch's other threads worth
more than the op's share of work, and on a loaded machine a wait for a
descheduled thread (measured on 2 shared cores: a chunked log over diag G 5 to 15x
slower on 2 threads than on 1). Inside :func:`one_torch_thread` such loops run on the
calling thread; large single ops (a walk's convolutions) keep every thread.
:func:`one_blas_thread` does the same for numpy's and scipy's BLAS (the solvers' small
vector operations; every public call: its docstring says why). Used by: the chunked logs of diag G (`pathir.support.fast_log`), the power view's
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
import functools
import os
import threading

__all__ = ["one_torch_thread", "one_blas_thread", "on_one_blas_thread", "beside"]

_POOL = None  # (pid, the one worker thread of `beside`), made on first use in each process
_BLAS = None  # threadpoolctl's controller of the loaded BLAS libraries, made once (see one_blas_thread)
_BLAS_LIMIT = None  # the limit of the outermost one_blas_thread block now open (main thread), if any
_BLAS_DEPTH = 0  # how many one_blas_thread blocks the main thread has open


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
    """numpy's and scipy's BLAS limited to one thread inside the block (threadpoolctl), restored when the
    outermost block ends. Only the main thread limits, and a block in any other thread changes nothing: the
    count is one per process, and OpenBLAS ignored a raise made from another thread after the main thread
    had lowered it (measured), so a restore there could leave numpy on one thread for good.

    Compiled's public methods and ``pathir.compile`` run inside one. pathir's dense numpy products are small,
    and OpenBLAS's workers, once woken by a threaded call, spin for about 0.1 s on the cores torch's next op
    needs: on 2 cores a forward right after a 2-thread 200×200 matmul took 2× its time (PathCond's write-back
    check, on shufflenet_v2_x0_5: 10 ms slower per call). The controller is made once per process: making one
    scans every loaded library, 2 to 8 ms with torch loaded."""
    global _BLAS, _BLAS_LIMIT, _BLAS_DEPTH
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _BLAS is None:
        import scipy.linalg  # noqa: F401  (its BLAS loaded before the libraries are listed)
        from threadpoolctl import ThreadpoolController  # lazy: spares `import pathir` the package

        _BLAS = ThreadpoolController()
    if not _BLAS_DEPTH:
        _BLAS_LIMIT = _BLAS.limit(limits=1, user_api="blas")  # (set when made)
    _BLAS_DEPTH += 1
    try:
        yield
    finally:
        _BLAS_DEPTH -= 1
        if not _BLAS_DEPTH:
            limit, _BLAS_LIMIT = _BLAS_LIMIT, None
            limit.restore_original_limits()


def on_one_blas_thread(fn):
    """Decorate ``fn`` to run inside :func:`one_blas_thread`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with one_blas_thread():
            return fn(*args, **kwargs)

    return wrapper


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
