"""Bias absorption (Nagel et al., "Data-Free Quantization", 2019, §4.2) on a graph.

A ReLU channel h whose whole pre-activation is a batch-norm's output, γ_h x̂ + β_h with x̂ about
N(0, 1) on data, is at least c_h = max(0, β_h − 3|γ_h|) on almost every input. Absorption subtracts
c_h from the channel's bias and adds what the channel's output lost to every node that reads it:
node w reading h through the map M gets M(c) in its bias. ReLU(x − c) + c = ReLU(x) for x ≥ c, so
the function is kept exactly where every absorbed pre-activation stays ≥ c, and changes elsewhere:
it is not exact, and the report measures by how much.

γ and β are read from the model's batch-norm tensors (the graph keeps only the folded
β − μγ/σ); on a rescaled graph they carry the channel's factor e^{s_h} like its bias. What a node
without a bias of its own receives (an identity node: a pooling, a sum; a max-pool) moves on to
its readers, as max and sums commute with a per-channel constant. Where the map of a constant is
not constant per channel, a convolution's zero padding, the interior value Σ_k W c is taken (DFQ's
choice): the border outputs then see c as 0 and the report lists those edges.

Refused (PathirError, nothing written): a shift that would reach a ReLU node without a bias or an
output without one (an absorbed ReLU that is itself an output included), a bias whose tensor cannot take an added constant (shared, derived from
several tensors by a factor, a clipped ReLU's threshold), another map whose image of a constant
varies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from pathir.backends.numpy import NumpyBackend
from pathir.errors import PathirError
from pathir.ir import Graph, MapKind, NodeKind, Role
from pathir.lifting.walk import forward
from pathir.rescaling.apply import log_scales
from pathir.rescaling.commit import rescaled_graph

__all__ = ["BatchNormReLU", "Absorption", "AbsorbReport", "ActivationRange", "batch_norm_relus", "absorb",
           "measure", "writable_bias_ref"]

#: the number of standard deviations DFQ keeps below β
SIGMAS = 3.0


@dataclass(frozen=True)
class BatchNormReLU:
    """A ReLU node whose whole pre-activation is one batch-norm's output: γ and β's tensor names, and the node
    whose bias holds the batch-norm's shift (the ReLU itself, or the batch-norm node a ReLU of its permutation
    reads alone: channels-last, token-wise)."""

    node: str
    gamma: str
    beta: str
    holder: str = ""

    @property
    def shifted(self) -> str:
        """The node whose bias the absorbed constant is subtracted from."""
        return self.holder or self.node


@dataclass
class Absorption:
    """The absorbed graph, the added bias per param name (the param's layout), c per absorbed node
    (the graph's scale), and the padded convolution edges whose borders see c as 0."""

    graph: Graph
    shifts: dict[str, np.ndarray]
    c: dict[str, np.ndarray]
    border_edges: list[str] = field(default_factory=list)
    found: int = 0  # the batch-norm ReLUs found, absorbed or not (c = 0 on every channel)


@dataclass
class ActivationRange:
    """max over the batch of an absorbed ReLU node's output (what a per-tensor activation quantizer
    spans), before and after absorption."""

    node: str
    before: float
    after: float


@dataclass
class AbsorbReport:
    """Bias absorption in an EqualizeReport: channels moved (c > 0) in how many ReLU nodes (of ``found``
    batch-norm ReLUs), the largest output change max |R(x) − R'(x)| and that over max |R(x)|, on ``batch``
    (the inputs given, or a seeded random batch), the activation ranges, and the padded convolutions' edges."""

    channels: int
    nodes: int
    max_abs_deviation: float
    rel_deviation: float
    batch: str
    activation_ranges: list[ActivationRange]
    border_edges: list[str]
    found: int = 0

    def lines(self) -> list[str]:
        before = sum(r.before for r in self.activation_ranges)
        after = sum(r.after for r in self.activation_ranges)
        out = [f"bias absorption: {self.channels} channels of {self.nodes} batch-norm ReLUs (of {self.found} found); "
               f"output changed by at most {self.max_abs_deviation:.4g} ({self.rel_deviation:.3g} of the largest "
               f"output) on {self.batch}; their activation ranges sum {before:.4g} -> {after:.4g}"]
        if not self.found:
            out.append("  no ReLU reads a batch-norm's output with its γ and β (folded batch-norms have none): nothing "
                       "to absorb")
        elif not self.nodes:
            out.append(f"  no channel of the {self.found} batch-norm ReLUs has β > {SIGMAS:g}|γ| (c = max(0, β − "
                       f"{SIGMAS:g}|γ|) is 0 on each): nothing to absorb")
        if self.border_edges:
            out.append(f"  zero-padded convolutions (borders see c as 0): {', '.join(self.border_edges)}")
        return out


def batch_norm_relus(graph: Graph) -> list[BatchNormReLU]:
    """The ReLU nodes whose bias is a batch-norm's folded shift (β its VALUE tensor, β and γ its
    OUT_SCALE tensors) and whose every incoming edge carries that γ: the pre-activation is γ x̂ + β."""
    out = []
    for n in graph.nodes:
        if n.kind is not NodeKind.RELU or not n.edges:
            continue
        holder = n
        if n.bias is None and len(n.edges) == 1 and n.edges[0].map.kind is MapKind.IDENTITY:
            # a ReLU of a permuted activation, built in the layout of the node it permutes (frontends): that node
            # holds the batch-norm's shift, and this ReLU is its only reader
            source = graph.node(n.edges[0].source)
            if source.kind is NodeKind.IDENTITY and source.name not in graph.outputs \
                    and len(graph.consumers[source.name]) == 1:
                holder = source
        found = _batch_norm_shift(holder)
        if found is not None:
            out.append(BatchNormReLU(n.name, *found, holder=holder.name if holder is not n else ""))
    return out


def _batch_norm_shift(n) -> tuple[str, str] | None:
    """(γ, β) tensor names where ``n``'s bias is a batch-norm's folded shift (β its VALUE tensor, β and γ its
    OUT_SCALE tensors) and every incoming edge carries that γ: its pre-activation is γ x̂ + β; else None."""
    if n.bias is None or not n.edges:
        return None
    value = [r.name for r in n.bias.sources if r.role is Role.VALUE]
    scales = [r.name for r in n.bias.sources if r.role is Role.OUT_SCALE]
    if len(value) != 1 or value[0] not in scales or len(scales) != 2:
        return None
    gamma = next(s for s in scales if s != value[0])
    if all(e.map.weight is not None and any(r.role is Role.OUT_SCALE and r.name == gamma
                                             for r in e.map.weight.sources) for e in n.edges):
        return gamma, value[0]
    return None


def writable_bias_ref(graph: Graph, node) -> str:
    """The name of the tensor to which a constant added to ``node``'s bias is added one to one (the
    plain bias, or the batch-norm β of a folded shift β − μγ/σ + ...), or PathirError naming why not."""
    p = node.bias
    where = f"node '{node.name}' ({node.origin or node.kind.value})"
    if p is None:
        raise PathirError(f"bias absorption: {where} has no bias to take the absorbed constant; nothing was written")
    if any(r.role is Role.CLIP_THRESHOLD for r in p.sources):
        raise PathirError(f"bias absorption: {where} is the clip of a clipped ReLU (ReLU6, hardtanh, clamp): its "
                          "threshold would have to move with the absorbed constant, which is not written. In a torch "
                          "model, pathir.equalize(..., relu6='relu') (pathir equalize --relu6 relu) replaces clipped "
                          "ReLU modules (nn.ReLU6, nn.Hardtanh(0, t)) by ReLUs first; a functional one in forward "
                          "(F.relu6, F.hardtanh, clamp) stays: write it as nn.ReLU6 or nn.ReLU. An ONNX Clip stays: "
                          "export the model with Relu. Or equalize without absorb_bias. Nothing was written")
    value = [r for r in p.sources if r.role is Role.VALUE]
    scales = {r.name for r in p.sources if r.role is Role.OUT_SCALE}
    others = [r for r in p.sources if r.role not in (Role.VALUE, Role.OUT_SCALE)]
    if len(value) != 1 or others or value[0].layout is not None or (scales and value[0].name not in scales):
        raise PathirError(f"bias absorption: the bias '{p.name}' of {where} ({p.how or 'as it is'}) is not one tensor "
                          "plus terms it does not enter, so a constant cannot be added to it; nothing was written")
    readers = sum(1 for n in graph.nodes for q in n.params() if q is p)
    if readers != 1:
        raise PathirError(f"bias absorption: the bias '{p.name}' of {where} is shared by {readers} nodes; "
                          "nothing was written")
    return value[0].name


def _constant_image(m, c: np.ndarray, shape: tuple, where: str) -> tuple[np.ndarray, bool]:
    """M applied to the per-channel constant c on a node of ``shape``: (its value per output channel,
    whether that is only its interior value, a zero-padded convolution's)."""
    backend = NumpyBackend()
    x = np.broadcast_to(c.reshape(-1, *([1] * (len(shape) - 1))), shape)[None].astype(np.float64)
    y = np.asarray(backend.apply(m, x, shape))[0]
    flat = y.reshape(y.shape[0], -1)
    if np.allclose(flat, flat[:, :1], rtol=1e-12, atol=1e-300):
        return flat[:, 0].copy(), False
    if m.kind is MapKind.CONV and any(p != (0, 0) for p in m.padding):
        # the interior value: the unpadded convolution's, on an input at least one (dilated) kernel wide
        # (where the node is smaller, every output position is on the border, and the value the same)
        inner = replace(m, padding=tuple((0, 0) for _ in m.padding))
        wide = (shape[0], *(max(n, d * (k - 1) + 1) for n, k, d in zip(shape[1:], m.W.shape[2:], m.dilation)))
        x = np.broadcast_to(c.reshape(-1, *([1] * (len(shape) - 1))), wide)[None].astype(np.float64)
        y = np.asarray(backend.apply(inner, x, wide))[0]
        flat = y.reshape(y.shape[0], -1)
        if flat.shape[1] and np.allclose(flat, flat[:, :1], rtol=1e-12, atol=1e-300):
            return flat[:, 0].copy(), True
    raise PathirError(f"bias absorption: the {m.kind.value} map of the edge {where} carries a per-channel constant to "
                      "a value that is not constant per channel, which no bias holds; nothing was written")


def absorb(graph: Graph, units, z, read_source) -> Absorption:
    """Bias absorption on ``graph`` rescaled by z (``graph`` itself when z is None): c per batch-norm
    ReLU channel from γ, β read by ``read_source(name) -> array`` (the model's tensors, not rescaled),
    subtracted there and carried to every reader's bias. Raises PathirError where a shift cannot be
    written; nothing is changed either way (the absorbed graph is a new one)."""
    found = batch_norm_relus(graph)
    scales = log_scales(graph, units, z) if z is not None else {}
    if z is not None:
        graph = rescaled_graph(graph, units, z)
    nodes = {n.name: n for n in graph.nodes}
    shifts: dict[str, np.ndarray] = {}
    c_of: dict[str, np.ndarray] = {}
    shifted: dict[str, str] = {}  # absorbed ReLU node -> the node whose bias takes its c
    for bn in found:
        n = nodes[bn.shifted]
        s = np.exp(scales.get(bn.shifted, np.zeros(n.channels)))
        gamma = np.asarray(read_source(bn.gamma), dtype=np.float64).reshape(-1) * s
        beta = np.asarray(read_source(bn.beta), dtype=np.float64).reshape(-1) * s
        c = np.maximum(0.0, beta - SIGMAS * np.abs(gamma))
        if np.any(c > 0):
            c_of[bn.node] = c
            shifted[bn.node] = bn.shifted
    subtracted = {shifted[k]: c for k, c in c_of.items()}
    deficit = dict(c_of)  # node -> how much its output is below the original (per channel)
    border: list[str] = []
    for n in graph.nodes:
        incoming = None
        for e in n.edges:
            d = deficit.get(e.source)
            if d is None or not np.any(d):
                continue
            if n.name in graph.outputs and n.bias is None:  # (a returned permutation of an absorbed ReLU, say)
                raise PathirError(f"bias absorption: the model's output '{n.name}' ({n.origin or n.kind.value}) reads "
                                  f"'{e.source}', whose output absorption lowers, and has no bias of its own: it would "
                                  "stay lowered by the absorbed constant, with no later bias to give it back; nothing "
                                  "was written")
            if n.kind is NodeKind.MAXPOOL:
                image, padded = d.copy(), False
            else:
                image, padded = _constant_image(e.map, d, nodes[e.source].shape,
                                                f"'{e.source}' -> '{n.name}' ({n.origin or n.kind.value})")
            if padded:
                border.append(f"{e.source} -> {n.name}")
            incoming = image if incoming is None else incoming + image
        own = subtracted.get(n.name)
        if n.name in c_of and n.name in graph.outputs:
            raise PathirError(f"bias absorption: the ReLU node '{n.name}' ({n.origin or n.kind.value}) is an output of the "
                              "model: its output would stay lowered by the absorbed constant, with no later bias to give it "
                              "back; nothing was written")
        if incoming is None and own is None:
            continue
        if incoming is not None and n.bias is None and n.kind in (NodeKind.IDENTITY, NodeKind.MAXPOOL) \
                and n.name not in graph.outputs:
            deficit[n.name] = incoming  # no bias of its own: its readers compensate
            continue
        writable_bias_ref(graph, n)
        delta = (0.0 if incoming is None else incoming) - (0.0 if own is None else own)
        shifts[n.bias.name] = shifts.get(n.bias.name, 0.0) + np.broadcast_to(delta, n.bias.shape)
    absorbed = graph.map_params(lambda p: p.with_value(p.value + shifts[p.name]) if p.name in shifts else p)
    return Absorption(absorbed, shifts, c_of, border, len(found))


def _batch(graph: Graph, inputs, size: int = 32, seed: int = 0):
    if inputs is not None:
        return inputs, "the inputs given"
    rng = np.random.default_rng(seed)
    batch = {n.name: rng.standard_normal((size, *n.shape)) for n in graph.nodes if n.kind is NodeKind.INPUT}
    return (next(iter(batch.values())) if len(batch) == 1 else batch), f"a seeded random batch of {size}"


def measure(graph: Graph, absorption: Absorption, backend, inputs=None) -> AbsorbReport:
    """The report of ``absorption`` of ``graph``: the output change and the absorbed nodes' activation
    ranges, by the graph's own forward on ``inputs`` (or a seeded standard normal batch)."""
    x, what = _batch(graph, inputs)
    a = forward(graph, backend, x, all_nodes=True)
    b = forward(absorption.graph, backend, x, all_nodes=True)
    top, change = 0.0, 0.0
    for name in graph.outputs:
        ya, yb = backend.to_numpy(a[name]), backend.to_numpy(b[name])
        top = max(top, float(np.max(np.abs(ya), initial=0.0)))
        change = max(change, float(np.max(np.abs(ya - yb), initial=0.0)))
    ranges = [ActivationRange(n, float(np.max(backend.to_numpy(a[n]))), float(np.max(backend.to_numpy(b[n]))))
              for n in absorption.c]
    return AbsorbReport(
        channels=int(sum(np.count_nonzero(c) for c in absorption.c.values())), nodes=len(absorption.c),
        max_abs_deviation=change, rel_deviation=change / top if top > 0 else (0.0 if change == 0 else math.inf),
        batch=what, activation_ranges=ranges, border_edges=list(absorption.border_edges), found=absorption.found)
