"""Write-back into an ONNX model: rescalings and masks, on a copy.

The source ModelProto (or file) is never touched: the writer keeps its own
current model, a deep copy made at the first write; ``to_onnx()`` returns it
and ``save(path)`` writes it atomically (temporary file, then rename).

Each IR param names its source tensors (``Param.sources``); the frontend
records, per ref name, a ``Binding``: the tensor the node reads, the (node,
input index) slots that read it for this param, its value and its role. The
role rules are the torch writer's (frontends/torch/writer.py): a param on edge
u -> v changes entry [o, i] by e^{s_v}[o] · e^{-s_u}[i] (``Map.weight_channels``),
a bias of v by e^{s_v}; a VALUE tensor takes the in-factor unless the param
has IN_STATS sources and the out-factor unless it has OUT_SCALE ones;
OUT_SCALE tensors (batch-norm scale and bias) take e^{s_v}; IN_STATS tensors
take the input factor λ = e^{s_u}: mean ← λ·mean, var ← λ²(var + eps) − eps.

Factors are multiplicative, so they apply to the initializer whatever constant
the frontend folded into the param (Gemm alpha/beta, a transpose, a broadcast
bias, which is expanded to one value per channel when the factors differ).
A tensor that other nodes also read (a deduplicated initializer, an Identity
alias) is not overwritten: the bound slots get a new initializer; producers
and initializers nothing reads any more are removed.

A clipped ReLU's threshold (``Role.CLIP_THRESHOLD``, a bias of its unit: e^{s_v}
per channel) is bound to a ``Clip(x, 0, t)`` node (kind ``clip``) or to the
constant of a ``Min(Relu(x), t)`` (kind ``clip_min``). A Clip takes one number: a
rescaling that moves its channels (any factor other than exactly 1) rewrites it as
``Relu(x)`` then ``Min`` with a constant initializer of shape (1, C, 1, ..., 1)
holding the rescaled thresholds (opset 8 or later, for Min's broadcasting); the
Min's output keeps the Clip's name, so the model's interface is unchanged. A
Min's constant is rescaled like a bias.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Mapping

import numpy as np

from pathir.errors import PathirError
from pathir.frontends.core.write_rules import EntryFactor, check_variance, mask_plan, source_factors
from pathir.frontends.onnx.function_kept import check_onnx_function
from pathir.frontends.onnx.load import float_info, skeleton
from pathir.ir import Graph, Role
from pathir.support.files import same_file, write_atomic

__all__ = ["Binding", "OnnxWriter"]


@dataclass
class Binding:
    """Where one ref name lives in the ONNX graph.

    ``kind``: weight, bias, bn_scale, bn_bias, bn_mean, bn_var, clip (a Clip node's
    threshold: ``value`` the number, ``tensor`` its max input or "" for an attribute,
    the slot (Clip output, 2)) or clip_min (a Min's per-channel constant); ``layout``
    (all kinds but weight): the shape a per-channel vector takes to broadcast
    against the tensor; ``eps``: the batch-norm epsilon (bn_var)."""

    tensor: str
    slots: list[tuple[str, int]]
    value: np.ndarray
    kind: str
    layout: tuple[int, ...] | None = None
    eps: float = 0.0


class OnnxWriter:
    """Write-back handle of an ONNX model (``cm.writer`` of a compiled .onnx).

    Examples
    --------
    >>> import numpy as np, onnx, pathir
    >>> from onnx import helper, numpy_helper, TensorProto
    >>> rng = np.random.default_rng(0)
    >>> W1, W2 = rng.normal(size=(2, 3)).astype(np.float32), rng.normal(size=(3, 1)).astype(np.float32)
    >>> g = helper.make_graph(
    ...     [helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"), helper.make_node("Relu", ["h"], ["r"], name="relu"),
    ...      helper.make_node("MatMul", ["r", "W2"], ["y"], name="fc2")], "mlp",
    ...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])],
    ...     [numpy_helper.from_array(W1, "W1"), numpy_helper.from_array(W2, "W2")])
    >>> model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    >>> cm = pathir.compile(model)
    >>> cm.writer.rescale(cm.graph, {"relu": np.log([2.0, 4.0, 0.5])})
    >>> new = cm.to_onnx()
    >>> new_W1 = numpy_helper.to_array(new.graph.initializer[0])
    >>> bool(np.allclose(new_W1, W1 * [2.0, 4.0, 0.5]))
    True
    >>> bool(np.array_equal(numpy_helper.to_array(model.graph.initializer[0]), W1))   # the source is untouched
    True
    """

    def __init__(self, model, bindings: Mapping[str, Binding], outputs=None, read_from=()):
        self.source = model
        #: the files the model was read from (the .onnx and its external data): never written over
        self.read_from = tuple(read_from)
        self.bindings = {k: _copy(b) for k, b in bindings.items()}
        #: ONNX output name -> (IR output node, whether the ONNX tensor has its batch on axis 1)
        self.outputs = dict(outputs or {})
        self._model = None
        self._written = None  # (the model before the last rescale, its graph) until check_written() reads it
        #: moves with every change of the current model (a write, a restore): what a Compiled's watch reads
        self.version = 0

    # ------------------------------------------------------------ the model
    def to_onnx(self):
        """The current model (the source plus every write-back so far), as a new ModelProto."""
        import onnx

        out = onnx.ModelProto()
        out.CopyFrom(self._model if self._model is not None else self.source)
        return out

    def save(self, path) -> None:
        """Write the current model to ``path`` (``pathir.support.files.write_atomic``: a temporary file
        beside it, then a rename, so a failure leaves no file behind)."""
        path = os.fspath(path)
        for source in self.read_from:
            if same_file(path, source):
                what = "the model file" if source == self.read_from[0] else "its external tensor data"
                raise PathirError(f"'{path}' is a file the model was compiled from ({what}, '{source}'): pathir "
                                  "never writes over what it read; name another file")
        model = self._model if self._model is not None else self.source
        if model.ByteSize() > 2**31 - 1:
            raise PathirError("the model is larger than 2 GB: protobuf cannot write it in one file")
        data = model.SerializeToString()
        write_atomic(path, lambda f: f.write(data))  # mode from the umask, nothing left on failure

    # ------------------------------------------------------------ rescaling
    def rescale(self, graph: Graph, log_scales: Mapping[str, np.ndarray]) -> None:
        """Apply per-channel ``log_scales`` ({node: (channels,)}) to the model.

        Every new tensor is computed before anything is written; on any error
        (not a rescaling of ``graph``, an unknown tensor, two different factors
        for one tensor) the current model is unchanged."""
        updates, rewrites = {}, {}
        # each tensor's factors computed when it is reached (a large weight's a block of rows at a time)
        for name, sides_of in source_factors(graph, log_scales, lazy=True).items():
            sides = sides_of()
            b = self._binding(name)
            if b.kind in ("clip", "clip_min") and b.layout is None:  # held: no constant of a shape that broadcasts
                if np.any(np.asarray(sides[Role.CLIP_THRESHOLD]) != 1.0):  # holds one threshold per channel
                    raise PathirError(f"write-back refused: the rescaling moves the thresholds of '{name}', whose "
                                      "channels lie along no single axis of the activation it clips (no constant "
                                      "of one value per channel broadcasts there); nothing was changed")
                continue
            if b.kind == "clip":  # a Clip holds one number: rewritten when its channels move
                if np.any(np.asarray(sides[Role.CLIP_THRESHOLD]) != 1.0):
                    new = self._rescaled(name, b, sides)
                    rewrites[name] = _in_dtype(name, np.broadcast_to(new, b.layout), b.value.dtype, b.value)
                continue
            new = self._rescaled_by_rows(name, b, sides)
            if new is None:
                new = _in_dtype(name, self._rescaled(name, b, sides), np.asarray(b.value).dtype, b.value)
            updates[name] = new
        before = self._current()  # (never changed in place: a write swaps in a new model)
        self._commit(updates, rewrites)
        self._written = (before, graph)

    def check_written(self) -> None:
        """Refuse (PathirError) the last :meth:`rescale` if onnxruntime's outputs moved on a probe
        (``pathir.frontends.onnx.function_kept``); ``commit_rescaling`` calls it and, on a refusal,
        restores the writer's snapshot."""
        written, self._written = self._written, None
        if written is not None:
            check_onnx_function(written[0], self._current(), written[1])

    def _current(self):
        """The current model itself (the source, or the last write's new model): read, never written."""
        return self._model if self._model is not None else self.source

    def _binding(self, name: str) -> Binding:
        b = self.bindings.get(name)
        if b is None:
            raise PathirError(f"source tensor '{name}' is not a tensor this ONNX model was lowered from")
        return b

    @staticmethod
    def _per_channel(name, b: Binding, f: np.ndarray) -> np.ndarray:
        f = np.asarray(f, dtype=np.float64)
        if f.size != int(np.prod(b.layout)):
            raise PathirError(f"source tensor '{name}': {f.size} factors for {int(np.prod(b.layout))} channels")
        return f.reshape(b.layout)

    def _in_layout(self, name: str, b: Binding, f: np.ndarray) -> np.ndarray:
        """A weight-layout (or per-channel) array shaped as the source tensor."""
        if b.kind == "weight":
            if f.size != b.value.size:
                raise PathirError(f"source tensor '{name}' has {b.value.size} entries, its factor {f.size}")
            return np.asarray(f).reshape(b.value.shape)
        return self._per_channel(name, b, f)

    def _rescaled_by_rows(self, name: str, b: Binding, sides) -> np.ndarray | None:
        """A weight's new value in its own dtype, range-checked as :func:`_in_dtype` checks it, computed a block
        of rows at a time through its lazy factor (float64 temporaries of a block, not of the tensor); None
        where its factor has no row blocks (the whole-tensor path then)."""
        f = sides.get(Role.VALUE)
        value = np.asarray(b.value)
        if set(sides) != {Role.VALUE} or b.kind != "weight" or not isinstance(f, EntryFactor) or not f.by_rows \
                or f.shape != value.shape or value.ndim == 0:
            return None
        out = np.empty(value.shape, dtype=value.dtype)
        step = max(1, _BLOCK_ENTRIES // max(1, value[0].size))
        broke = 0
        for start in range(0, value.shape[0], step):
            rows = slice(start, min(value.shape[0], start + step))
            block = value[rows].astype(np.float64)
            with np.errstate(over="ignore"):
                f.scale_block(block, rows.start, rows.stop)
            out[rows], bad = _cast(block, value.dtype, value[rows])
            broke += bad
        if broke:
            raise _out_of_range(name, value.dtype, broke)
        return out

    def _rescaled(self, name: str, b: Binding, sides) -> np.ndarray:
        old = np.asarray(b.value, dtype=np.float64)
        if Role.IN_STATS in sides:
            if len(sides) > 1:
                raise PathirError(f"source tensor '{name}' is both running statistics and a rescaled value")
            lam = self._per_channel(name, b, sides[Role.IN_STATS])
            if b.kind == "bn_mean":
                return lam * old
            if b.kind == "bn_var":
                new = np.where(lam == 1.0, old, lam**2 * (old + b.eps) - b.eps)  # (λ = 1: old, no ulp moved)
                check_variance(f"whose running variance is '{name}'", b.eps, new, new.astype(np.asarray(b.value).dtype), "nothing was changed")
                return new
            raise PathirError(f"source tensor '{name}' has role in_stats but is no batch-norm running statistic")
        new = old
        for f in sides.values():
            f = self._in_layout(name, b, np.asarray(f))  # (a lazy EntryFactor formed whole here)
            if f.shape != old.shape and np.allclose(f, f.reshape(-1)[0], rtol=1e-15, atol=0):
                f = f.reshape(-1)[0]  # one factor for a broadcast tensor: keep its shape
            new = new * f
        return new

    # ------------------------------------------------------------ bias absorption
    def source_shape(self, name: str) -> tuple | None:
        """The shape of initializer ``name`` as the file holds it, or None where no binding names it."""
        try:
            return tuple(np.shape(self._binding(name).value))
        except PathirError:
            return None

    def read(self, name: str) -> np.ndarray:
        """The current value of the source tensor ``name`` (float64, its own shape)."""
        return np.asarray(self._binding(name).value, dtype=np.float64)

    def shift_biases(self, graph: Graph, shifts: Mapping[str, np.ndarray]) -> None:
        """Add ``shifts[name]`` (the param's layout) to the initializer behind each named bias param of
        ``graph``: the param's one VALUE tensor, which enters it with coefficient 1 (a Conv/Gemm bias or a
        BatchNormalization's B; ``pathir.equalization.absorb.writable_bias_ref``). All computed before
        any is written, as :meth:`rescale`."""
        updates = {}
        for p in graph.params():
            if p.name not in shifts:
                continue
            (ref,) = [r for r in p.sources if r.role is Role.VALUE]
            b = self._binding(ref.name)
            if b.kind not in ("bias", "bn_bias", "neg_bias"):
                raise PathirError(f"source tensor '{ref.name}' ({b.kind}) is no bias initializer: a constant cannot "
                                  "be added to it; nothing was changed")
            old = np.asarray(b.value, dtype=np.float64)
            delta = self._per_channel(ref.name, b, np.asarray(shifts[p.name], dtype=np.float64).reshape(-1))
            new = old - delta if b.kind == "neg_bias" else old + delta  # a Sub's constant holds −(the bias)
            if new.shape != old.shape:
                raise PathirError(f"source tensor '{ref.name}' holds one value for {delta.size} channels: a "
                                  "per-channel constant cannot be added to it; nothing was changed")
            updates[ref.name] = new
        self._commit(updates)

    # ------------------------------------------------------------ transactions
    def snapshot(self):
        """The current model and bindings (never mutated in place: every write swaps in new ones)."""
        return self._model, self.bindings

    def restore(self, state) -> None:
        """Back to a :meth:`snapshot` (the version moves only where a write had swapped another model in)."""
        if self._model is not state[0] or self.bindings is not state[1]:
            self._model, self.bindings = state
            self.version += 1

    # ------------------------------------------------------------ masks
    def mask(self, graph: Graph, masks: Mapping[str, np.ndarray]) -> None:
        """Zero the pruned entries: ``masks`` maps a param name (or its source
        name) to a bool array of the param's shape (True: keep). The zeros land
        in the VALUE initializer; all masks are applied at once.

        Raises PathirError (model unchanged) for a param whose zeros are not its
        source tensor's zeros (an unfolded batch-norm scale, a folded batch-norm bias)."""
        updates = {}
        for p, m, ref in mask_plan(graph, masks):
            if ref.name in updates:
                raise PathirError(f"two masks for the tensor '{ref.name}'")
            b = self._binding(ref.name)
            keep = self._in_layout(ref.name, b, ref.to_source(m.astype(np.float64)))
            updates[ref.name] = np.asarray(b.value, dtype=np.float64) * keep
        self._commit(updates)

    # ------------------------------------------------------------ commit
    def _commit(self, updates: Mapping[str, np.ndarray], rewrites: Mapping[str, np.ndarray] | None = None) -> None:
        """Write new values (float64, the source layout) into a copy of the current
        model, and rewrite the Clip nodes of ``rewrites`` ({ref: per-channel thresholds in
        the binding's layout}); swap it in only when every write succeeded and the checker agrees."""
        import onnx
        from onnx import numpy_helper


        if not updates and not rewrites:
            return
        model = self.to_onnx()
        bindings = {k: _copy(b) for k, b in self.bindings.items()}
        g = model.graph
        if model.ir_version >= 4:  # (IR 3 lists every initializer as an input: a rule, not an interface)
            fed = _overridable_defaults(g)
            if fed:
                raise PathirError(f"write-back refused: the initializer {', '.join(repr(t) for t in fed)} is also a graph "
                                  "input, a default a caller may override by feeding it, and a caller who does would "
                                  "get another function from the written file (one the rescaling wrote, or a constant "
                                  "pathir read as fixed: a Clip's or Max's 0, a Pad value, a Slice's bounds); remove it "
                                  "from the graph's inputs (graph.input) to make it a constant. Nothing was changed")
        orphans: set[str] = set()
        if rewrites:
            orphans |= _rewrite_clips(model, bindings, rewrites)
        nodes = {n.output[0]: n for n in g.node}
        readers = _readers(g)
        inits = {t.name: t for t in g.initializer}
        outputs = {o.name for o in g.output}
        rebind = []
        for ref, value in updates.items():
            b = bindings[ref]
            arr = np.asarray(value).astype(b.value.dtype, copy=False)
            if b.tensor in inits and b.tensor not in outputs and set(readers.get(b.tensor, [])) <= set(b.slots):
                if tuple(inits[b.tensor].dims) != arr.shape:  # (a scalar made per channel): a recorded shape is stale
                    _drop_value_info(g, b.tensor)
                inits[b.tensor].CopyFrom(numpy_helper.from_array(arr, b.tensor))
            else:
                orphans.add(b.tensor)
                rebind.append((ref, b, arr))
                for key, k in b.slots:
                    nodes[key].input[k] = ""  # detached until the new initializer has its name
            b.value = arr
        _remove_dead(g, orphans)
        taken = _names(g)
        for ref, b, arr in rebind:
            name, i = ref, 1
            while name in taken:
                name, i = f"{ref}_{i}", i + 1
            taken.add(name)
            add_initializer(model, arr, name)
            for key, k in b.slots:
                nodes[key].input[k] = name
            b.tensor = name
        try:
            onnx.checker.check_model(skeleton(model))
        except (onnx.checker.ValidationError, ValueError) as err:
            raise PathirError(f"write-back produced an invalid ONNX model (nothing was changed): {err}") from None
        self._model, self.bindings = model, bindings
        self.version += 1


#: entries of a weight rescaled at a time (``OnnxWriter._rescaled_by_rows``: its float64 temporaries)
_BLOCK_ENTRIES = 1 << 20


def _overridable_defaults(g) -> list[str]:
    """The initializers that are also graph inputs (defaults a caller may override) that a node reads: a rescaling
    written into the file keeps its function only for the defaults, whether it wrote them (a weight) or read them
    as fixed (a Clip's min 0, a Pad value, a Slice's bounds, which then meet rescaled values)."""
    defaults = {i.name for i in g.input} & {t.name for t in g.initializer}
    return sorted(defaults & {t for n in g.node for t in n.input})


def _in_dtype(name: str, value: np.ndarray, dtype, old=None) -> np.ndarray:
    """``value`` in the tensor's dtype, or PathirError (nothing written) where an entry leaves its range: overflows
    (a threshold cast to inf: min(relu, inf) = relu passes onnxruntime's probe, and the file is then refused), or,
    against the tensor's ``old`` entries, a nonzero entry cast to 0 or a normal one to a subnormal."""
    cast, broke = _cast(value, dtype, old)
    if broke:
        raise _out_of_range(name, dtype, broke)
    return cast


def _cast(value: np.ndarray, dtype, old=None) -> tuple[np.ndarray, int]:
    """(``value`` cast to ``dtype``, how many entries left its range: overflowed, or, against ``old``, fell from
    nonzero to 0 or from normal to subnormal)."""
    value = np.asarray(value)
    with np.errstate(over="ignore", under="ignore"):
        cast = value.astype(dtype)
    wide = cast.astype(np.float64)
    broke = np.isfinite(value) & ~np.isfinite(wide)
    if old is not None:
        before = np.broadcast_to(np.asarray(old, dtype=np.float64), wide.shape)
        broke |= np.isfinite(before) & ~np.isfinite(wide)  # (a product that overflowed float64 on the way)
        tiny = float(float_info(dtype).tiny)
        broke |= ((before != 0) & (wide == 0)) | ((np.abs(before) >= tiny) & (np.abs(wide) < tiny))
    return cast, int(np.count_nonzero(broke))


def _out_of_range(name: str, dtype, count: int) -> PathirError:
    return PathirError(f"source tensor '{name}' would leave {np.dtype(dtype).name}'s range under this rescaling "
                       f"({count} entries overflow, or fall to 0 or below its smallest normal number); "
                       "bound it (max_log_scale=...); nothing was changed")


def _rewrite_clips(model, bindings: dict, rewrites: Mapping[str, np.ndarray]) -> set[str]:
    """Each rewritten Clip(x, 0, t) becomes Relu(x) then Min(·, T), T a new initializer of per-channel
    thresholds (its binding becomes a clip_min one); returns the Clip's bound inputs, which may now be dead."""
    from onnx import helper

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 8:
        raise PathirError(f"write-back refused: the model's opset {opset} has no broadcasting Min (opset 8) to hold "
                          "the per-channel thresholds of a rescaled Clip; nothing was changed")
    g = model.graph
    taken = _names(g) | {n.name for n in g.node}

    def fresh(base: str) -> str:
        name, i = base, 1
        while name in taken:
            name, i = f"{base}_{i}", i + 1
        taken.add(name)
        return name

    nodes, orphans = list(g.node), set()
    for ref, value in rewrites.items():
        b = bindings[ref]
        key = b.slots[0][0]
        k = next(i for i, n in enumerate(nodes) if n.op_type == "Clip" and n.output[0] == key)
        clip = nodes[k]
        relu_out, tensor = fresh(f"{key}_relu"), fresh(ref)
        add_initializer(model, np.ascontiguousarray(value), tensor)
        nodes[k:k + 1] = [helper.make_node("Relu", [clip.input[0]], [relu_out], name=fresh(f"{clip.name or key}_relu")),
                          helper.make_node("Min", [relu_out, tensor], [key], name=clip.name)]
        orphans.update(x for x in clip.input[1:] if x)
        b.tensor, b.slots, b.kind, b.value = tensor, [(key, 1)], "clip_min", np.asarray(value)
    del g.node[:]
    g.node.extend(nodes)
    return orphans


def _drop_value_info(g, name: str) -> None:
    """Remove the recorded type and shape of tensor ``name`` (optional in ONNX; an exporter's entry for a
    tensor whose shape the write changed would contradict it, which shape inference refuses)."""
    kept = [vi for vi in g.value_info if vi.name != name]
    if len(kept) != len(g.value_info):
        del g.value_info[:]
        g.value_info.extend(kept)


def add_initializer(model, value: np.ndarray, name: str) -> None:
    """Append initializer ``name``; a model of IR version 3 also lists it as a graph input (its rule:
    every initializer is one), so the checker and onnxruntime accept it."""
    from onnx import helper, numpy_helper

    tensor = numpy_helper.from_array(value, name)
    model.graph.initializer.append(tensor)
    if model.ir_version < 4:
        model.graph.input.append(helper.make_tensor_value_info(name, tensor.data_type, list(value.shape)))


def _copy(b: Binding) -> Binding:
    """A binding whose slots can change; values are never written in place, so they are shared."""
    return replace(b, slots=list(b.slots))


def _subgraph_inputs(node):
    """Names read inside a node's subgraphs (If/Loop/Scan bodies), conservatively."""
    from onnx import AttributeProto

    for a in node.attribute:
        graphs = [a.g] if a.type == AttributeProto.GRAPH else list(a.graphs) if a.type == AttributeProto.GRAPHS else []
        for sg in graphs:
            for n in sg.node:
                yield from (x for x in n.input if x)
                yield from _subgraph_inputs(n)


def _readers(g) -> dict[str, list[tuple[str, int]]]:
    out: dict[str, list] = {}
    for n in g.node:
        for k, x in enumerate(n.input):
            if x:
                out.setdefault(x, []).append((n.output[0], k))
        for x in _subgraph_inputs(n):
            out.setdefault(x, []).append((n.output[0], -1))
    return out


def _remove_dead(g, candidates: set[str]) -> None:
    """Remove the initializers and nodes producing ``candidates`` that nothing reads
    any more (not a graph output), and, in turn, what only they read."""
    while candidates:
        readers = _readers(g)
        keep = {o.name for o in g.output} | {vi.name for vi in g.input}  # the model's interface stays
        dead = {t for t in candidates if t not in readers and t not in keep}
        if not dead:
            return
        candidates = set()
        for t in list(g.initializer):
            if t.name in dead:
                g.initializer.remove(t)
        for n in list(g.node):
            if any(o in dead for o in n.output) and all((o in dead) or (o not in readers and o not in keep)
                                                        for o in n.output if o):
                g.node.remove(n)
                candidates.update(x for x in n.input if x)
        for vi in list(g.value_info):
            if vi.name in dead:
                g.value_info.remove(vi)


def _names(g) -> set[str]:
    names = {t.name for t in g.initializer} | {vi.name for vi in g.input} | {vi.name for vi in g.output}
    names |= {vi.name for vi in g.value_info}
    for n in g.node:
        names.update(o for o in n.output if o)
    return names


class WriterWatch:
    """The version of an ONNX writer's model as last marked: a write through the same writer by another
    Compiled (one made by ``apply``) moves it, and the Compiled holding this watch re-reads the model or, a
    snapshot, refuses its queries (as a torch model's watch does)."""

    def __init__(self, writer: OnnxWriter):
        self.writer = writer
        self.mark()

    def mark(self) -> None:
        self._seen = self.writer.version

    def changed(self) -> str | None:
        return None if self.writer.version == self._seen else "values"

    def moved(self) -> None:
        return None  # (any tensor may have moved: the model is read again whole)

    def fresh(self) -> "WriterWatch":
        """A watch of the same writer, marked now."""
        return WriterWatch(self.writer)
