"""Work split across the ranks of an initialised torch.distributed process group.

A job runs on one process unless ``torch.distributed.is_initialized()``; then
each rank takes its contiguous share of the samples (:func:`shard`, in rank
order, so that concatenating the ranks' shares restores the order), runs the
same code on it, and :func:`gather_or_raise` all-gathers the results. It first
all-gathers every rank's status, so a rank that raised (an interrupt or an exit included)
makes every other rank raise a :class:`~pathir.errors.RankFailed` naming that rank and its
error: none is left waiting in a collective the failing rank never reaches.

>>> [shard(10, rank, 3) for rank in range(3)]
[range(0, 3), range(3, 6), range(6, 10)]
>>> group() is None  # no process group in this process
True
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from pathir.errors import RankFailed

__all__ = ["Group", "group", "shard", "gather_or_raise", "join_launcher_group", "leave_group"]

@dataclass(frozen=True)
class Group:
    """This process's rank among ``size`` ranks."""

    rank: int
    size: int


def group() -> Group | None:
    """The default process group as (rank, size), or None when torch.distributed is not initialised.

    torch is not imported here: a process that never imported it has no process group.
    """
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return Group(dist.get_rank(), dist.get_world_size())


def shard(n: int, rank: int, size: int) -> range:
    """The indices rank ``rank`` of ``size`` walks among ``n``: contiguous, in rank order, sizes within one."""
    return range(n * rank // size, n * (rank + 1) // size)


def gather_or_raise(run, what: str = "the job"):
    """``run()`` on this rank, then every rank's result, in rank order, on every rank.

    If ``run`` raised on any rank, every rank raises :class:`RankFailed` naming the
    failing ranks and their errors (the failing rank's own error is its cause).
    """
    import torch.distributed as dist  # lazy: torch is imported already when a group exists

    error, result = None, None
    try:
        result = run()
    except BaseException as err:  # noqa: BLE001 - reported to every rank below (an interrupt too: else they wait)
        error = err
    status = [None] * dist.get_world_size()
    dist.all_gather_object(status, None if error is None else _described(error))
    failed = [(rank, text) for rank, text in enumerate(status) if text is not None]
    if failed:
        if error is not None and not isinstance(error, Exception):
            raise error  # this rank's own interrupt or exit goes on as it is; the others raise RankFailed
        lines = "; ".join(f"rank {rank} raised {text}" for rank, text in failed)
        raise RankFailed(f"{what} failed on {len(failed)} of {len(status)} ranks: {lines}") from error
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    return results


def _described(error: BaseException) -> str:
    """``"Type: message"``; the type alone where the message itself raises (this rank must still reach the
    gather every other rank waits in)."""
    try:
        return f"{type(error).__name__}: {error}"
    except Exception:  # noqa: BLE001 - any error of the error's own __str__
        return f"{type(error).__name__} (its message could not be formatted)"


def join_launcher_group() -> bool:
    """Under a launcher (torchrun sets WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT) with no group yet,
    initialise the default group (gloo: only Python objects travel) and return True; else False."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or group() is not None:
        return False
    import torch.distributed as dist  # lazy: torch only for a job a launcher started

    dist.init_process_group("gloo")
    return True


def leave_group() -> None:
    """Destroy the default group (the one :func:`join_launcher_group` made), once every rank has reached here:
    a rank that tore gloo down while another still sent its last gather aborted at exit about one run in four
    (SIGABRT, torchrun's exit status 1 after the whole table was printed)."""
    import torch.distributed as dist  # lazy: torch is imported already when a group exists

    dist.barrier()
    dist.destroy_process_group()
