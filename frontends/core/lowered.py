"""What a frontend hands to pathir.compile."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pathir.ir import Graph

__all__ = ["Lowered"]


@dataclass
class Lowered:
    """A lowered model: the raw graph (nothing folded yet), the frontend's
    write-back handle, and facts about the source model; ``reread``: how to read the
    model's current values into the raw graph without lowering again (torch, or None)."""

    graph: Graph
    writer: Any
    source_num_params: int
    name: str
    reread: Any = None
