"""One torch thread for loops of small ops.

A loop of cache-sized torch ops (a chunked log, a block-by-block write) opens one
parallel region per op; each costs a hand-off to torch's other threads worth
more than the op's share of work, and on a loaded machine a wait for a
descheduled thread (measured on 2 shared cores: a chunked log over diag G 5 to 15x
slower on 2 threads than on 1). Inside :func:`one_torch_thread` such loops run on the
calling thread; large single ops (a walk's convolutions) keep every thread.
Used by: the chunked logs of diag G (`pathir.support.fast_log`), the power view's
|w|^q blocks of a large dense weight (``backends.torch``) and the torch writer's
row blocks (``frontends.torch.writer``).

>>> import torch
>>> before = torch.get_num_threads()
>>> with one_torch_thread():
...     torch.get_num_threads()
1
>>> torch.get_num_threads() == before
True
"""

from __future__ import annotations

import contextlib

__all__ = ["one_torch_thread"]


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
