"""Nodes and edges of the IR: groups of neurons of one activation type."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .maps import Map
from .param import Param

__all__ = ["NodeKind", "POSITIVELY_HOMOGENEOUS", "Edge", "Node"]


class NodeKind(enum.Enum):
    """Activation type of every neuron of a node (docs/math.md §1)."""

    INPUT = "input"
    IDENTITY = "identity"
    RELU = "relu"
    MAXPOOL = "maxpool"


POSITIVELY_HOMOGENEOUS = frozenset({NodeKind.IDENTITY, NodeKind.RELU, NodeKind.MAXPOOL})


@dataclass(frozen=True)
class Edge:
    """Contribution ``map(source output)`` to the target's pre-activation."""

    source: str
    map: Map


@dataclass(frozen=True, eq=False)
class Node:
    """A group of neurons of one type, shape ``(C, *spatial)`` (batch left out).

    Pre-activation = sum of the incoming edges' outputs + bias (one per channel,
    broadcast over spatial positions). A MAXPOOL node has exactly one edge, a
    ``Pool`` window without multiplier, and outputs the k-th largest value of
    each window (k = 1 for an ordinary max-pool) plus its bias.
    ``origin`` says where the node came from (module path, ONNX node name).
    """

    name: str
    kind: NodeKind
    shape: tuple[int, ...]
    edges: tuple[Edge, ...] = ()
    bias: Param | None = None
    k: int = 1
    origin: str = ""

    @property
    def channels(self) -> int:
        """The length of the channel axis; a scalar node (shape (), a model's ``.squeeze(-1)``) is one channel."""
        return self.shape[0] if self.shape else 1

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def params(self) -> list[Param]:
        """Free params of this node in flat order: edge weights, then the bias."""
        out = [e.map.weight for e in self.edges if e.map.weight is not None]
        if self.bias is not None:
            out.append(self.bias)
        return out
