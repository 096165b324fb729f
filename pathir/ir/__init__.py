"""The pathir IR: Param, maps, Node, Edge, Graph, verify, GraphBuilder."""

from .builder import GraphBuilder
from .graph import Graph
from .maps import (
    FIXED,
    PARAMETERIZED,
    ChannelMap,
    Conv,
    Dense,
    FixedConv,
    Gather,
    Identity,
    Map,
    MapKind,
    Pool,
    Resample,
    Reshape,
    Scale,
    SpatialMatrix,
    pool_output_size,
)
from .node import POSITIVELY_HOMOGENEOUS, Edge, Node, NodeKind
from .param import Param, PointwiseKernelLayout, Role, SourceRef, TransposedConvLayout
from .verify import verify

__all__ = [
    "Param", "PointwiseKernelLayout", "Role", "SourceRef", "TransposedConvLayout",
    "Map", "MapKind", "PARAMETERIZED", "FIXED",
    "Identity", "Reshape", "ChannelMap", "Pool", "SpatialMatrix", "Resample", "Gather", "FixedConv", "Dense", "Conv", "Scale",
    "pool_output_size",
    "Node", "Edge", "NodeKind", "POSITIVELY_HOMOGENEOUS",
    "Graph", "verify", "GraphBuilder",
]
