"""Tensors of a model that share memory without being one tensor object.

A rescaling writes each source tensor once; a tensor reached under two names (``b.weight = a.weight``) is
one object and written once, with its two factors compared (the writer). Two *different* objects over the
same memory are not seen that way: ``nn.Parameter(a.weight.data.t())`` (a tied autoencoder),
``register_buffer("gate", b.bias.data)``, overlapping views of one base. Writing one then writes the other,
which the graph reads as an independent tensor. :func:`overlaps` finds such pairs before a write, so the
writer can check the function it keeps (the probe) and every written value (the last write wins).

>>> import torch, torch.nn as nn
>>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2))
>>> net[2].weight = nn.Parameter(net[0].weight.data.t())
>>> overlaps(net, [("0.weight", net[0].weight)])
[('0.weight', '2.weight')]
>>> self_overlapping(torch.zeros(1, 4).expand(3, 4))
True
"""

from __future__ import annotations

import torch

from pathir.frontends.torch.live import named_tensors
from pathir.support.tensor_memory import extent, share_bytes

__all__ = ["overlaps", "self_overlapping", "registered_names"]


def registered_names(model: torch.nn.Module) -> dict[int, list[str]]:
    """{id(tensor): every name the model registers it under, in registration order}: one Parameter held
    by two modules (``b.weight = a.weight``) is one tensor under two names."""
    out: dict[int, list[str]] = {}
    for name, t in named_tensors(model):
        out.setdefault(id(t), []).append(name)
    return out


def self_overlapping(t: torch.Tensor) -> bool:
    """Whether two entries of ``t`` are one memory location (a stride of 0 on an axis of 2 or more: an
    expanded tensor): no rescaling that gives them different factors can be written into it."""
    return any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride()))


def overlaps(model: torch.nn.Module, written: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str]]:
    """(written name, other name) for each parameter or buffer of ``model`` that is another object than a
    written tensor but reads a byte of the written one's memory (written tensors among themselves included)."""
    spans = [(name, t, e) for name, t in written if (e := extent(t)) is not None]
    if not spans:
        return []
    by_storage: dict[int, list] = {}
    for name, mine, (ptr, _, _) in spans:
        by_storage.setdefault(ptr, []).append((name, mine))
    out, seen = [], set()
    for other, t in named_tensors(model):
        e = extent(t)
        if e is None or e[0] not in by_storage:
            continue
        for name, mine in by_storage[e[0]]:
            if mine is not t and (other, name) not in seen and share_bytes(mine, t):
                seen.add((name, other))
                out.append((name, other))
    return out
