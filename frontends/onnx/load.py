"""Reading an ONNX model for lowering: file, bytes or ModelProto -> a checked
ModelProto, its per-sample input shapes and batch size.

Every failure is one ``PathirError`` sentence naming the file: a missing file,
bytes that do not parse, a file that is not an ONNX model, a model the ONNX
checker or shape inference rejects, an input of dynamic (symbolic) spatial size
without ``input_shape``. The caller's ModelProto is never modified (shape
inference runs on a copy whose input sizes are fixed).
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass

import numpy as np

from pathir.errors import InputShapeError, MissingFile, PathirError

__all__ = ["OnnxModelError", "Source", "load", "skeleton", "input_shapes", "infer_shapes", "numpy_dtype"]


class OnnxModelError(PathirError, ValueError):
    """The model could not be read or checked as ONNX."""


@dataclass
class Source:
    """A loaded model: the proto (the caller's own object when one was given:
    read only), a display name, the opset of the default domain, and its
    skeleton (see :func:`skeleton`) on which checks and shape inference run."""

    proto: object
    name: str
    opset: int
    skeleton: object = None
    files: tuple = ()  # the files read (the model and its external tensor data): never written over


#: initializers above this many elements are left out of the skeleton (weights, never shape data)
_LARGE = 4096


def skeleton(proto):
    """A copy of ``proto`` without its large initializers' data: each becomes a
    typed graph input of its shape. The checker and shape inference need
    only their types, and the weights of a large model then never get copied
    or serialized again."""
    import math

    import onnx
    from onnx import helper

    m = onnx.ModelProto()
    m.ir_version = proto.ir_version
    m.opset_import.extend(proto.opset_import)
    m.functions.extend(proto.functions)
    src, g = proto.graph, m.graph
    g.name = src.name
    g.node.extend(src.node)
    g.input.extend(src.input)
    g.output.extend(src.output)
    g.value_info.extend(src.value_info)
    g.sparse_initializer.extend(src.sparse_initializer)
    declared = {vi.name for vi in src.input}
    for t in src.initializer:
        if math.prod(t.dims) <= _LARGE:
            g.initializer.append(t)
        elif t.name not in declared:
            g.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return m


def _parse(data: bytes, name: str):
    import onnx
    from google.protobuf.message import DecodeError

    try:
        proto = onnx.load_model_from_string(bytes(data))
    except (DecodeError, RuntimeError, ValueError) as err:
        raise OnnxModelError(f"'{name}' cannot be read as an ONNX model (not ONNX, truncated or corrupt): {err}") from None
    return proto


def load(model) -> Source:
    """The ModelProto behind ``model`` (path, bytes or ModelProto), checked."""
    import onnx

    if isinstance(model, onnx.ModelProto):
        proto, name = model, model.graph.name or "model"
    elif isinstance(model, (bytes, bytearray)):
        proto, name = _parse(model, "<bytes>"), "model"
    elif isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        name = os.path.basename(path)
        if not os.path.exists(path):
            raise MissingFile(f"no such file: {path}")
        if os.path.isdir(path):
            raise OnnxModelError(f"'{path}' is a directory, not an ONNX file")
        with open(path, "rb") as f:
            proto = _parse(f.read(), name)
        files = [path]
        if any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
            from onnx.external_data_helper import load_external_data_for_model

            folder = os.path.dirname(os.path.abspath(path))
            files += sorted({os.path.join(folder, e.value) for t in proto.graph.initializer
                             if t.data_location == onnx.TensorProto.EXTERNAL for e in t.external_data
                             if e.key == "location"})
            try:
                load_external_data_for_model(proto, folder)
            except Exception as err:  # OSError, ValueError, onnx's ValidationError (a missing data file)
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise OnnxModelError(f"'{name}': cannot read its external tensor data: {first}") from None
    else:
        raise OnnxModelError(f"expected an ONNX path, bytes or onnx.ModelProto, got {type(model).__name__}")
    if not isinstance(model, (str, os.PathLike)):
        external = sorted({e.value for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
                           for e in t.external_data if e.key == "location"})
        if external:  # onnx would resolve them against the working folder: another model's files of that name
            raise OnnxModelError(
                f"'{name}' keeps its tensors in external files ({', '.join(external[:3])}), which a model given as "
                "bytes or as an onnx.ModelProto without its data cannot locate: pass the .onnx path (pathir reads "
                "the data files beside it), or onnx.load(path) it first (which reads them in)")
    if not proto.HasField("graph") or len(proto.graph.node) == 0 or not proto.opset_import:
        raise OnnxModelError(f"'{name}' is not an ONNX model (no graph, nodes or opset)")
    if proto.graph.sparse_initializer:
        names = [t.values.name for t in proto.graph.sparse_initializer]
        raise OnnxModelError(f"'{name}' stores {', '.join(repr(n) for n in names[:3])} as sparse initializers "
                             "(graph.sparse_initializer), which pathir does not read: store them dense (graph.initializer)")
    proto = _inlined(proto, name)
    light = skeleton(proto)
    _check(light, name)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    return Source(proto, name, opset, light, tuple(files) if isinstance(model, (str, os.PathLike)) else ())


def _inlined(proto, name: str):
    """``proto`` with its model-local functions (``torch.onnx.export(..., export_modules_as_functions=...)``)
    inlined at every call (a new proto: the caller's is not modified), as onnxruntime runs them; ``proto``
    itself where it has none. Its write-backs are of the inlined graph, which computes the same function."""
    if not proto.functions:
        return proto
    from onnx.inliner import inline_local_functions

    try:
        return inline_local_functions(proto)
    except Exception as err:  # noqa: BLE001 - onnx's C++ errors come as several types
        raise OnnxModelError(f"'{name}': its local functions ({', '.join(f.name for f in proto.functions[:3])}) "
                             f"cannot be inlined: {err}") from None


def _check(proto, name: str) -> None:
    import onnx

    try:
        onnx.checker.check_model(proto)
    except (onnx.checker.ValidationError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OnnxModelError(f"'{name}' is not a valid ONNX model: {first}") from None


def _dims(value_info) -> list:
    """Declared dims of a graph input: int, or the symbol / None when dynamic."""
    t = value_info.type
    if not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
        return []
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.tensor_type.shape.dim]


def input_shapes(src: Source, input_shape=None) -> tuple[dict[str, tuple[int, ...]], int | None]:
    """({input name: per-sample shape}, batch size or None if symbolic).

    ``input_shape`` (without the batch axis) fixes dynamic sizes; a dict gives
    one per input. Given sizes must agree with the declared static ones."""
    g = src.proto.graph
    inits = {t.name for t in g.initializer}
    inputs = [vi for vi in g.input if vi.name not in inits]
    if not inputs:
        raise OnnxModelError(f"'{src.name}' has no graph input")
    if input_shape is not None and not isinstance(input_shape, dict):
        if len(inputs) != 1:
            raise OnnxModelError(
                f"'{src.name}' has inputs {[vi.name for vi in inputs]}: give input_shape as {{name: shape}}"
            )
        input_shape = {inputs[0].name: input_shape}
    given = dict(input_shape or {})
    unknown = set(given) - {vi.name for vi in inputs}
    if unknown:
        raise OnnxModelError(f"input_shape names {sorted(unknown)}, which are not inputs of '{src.name}'")
    shapes, batches = {}, set()
    for vi in inputs:
        dims = _dims(vi)
        if len(dims) < 2:
            raise OnnxModelError(
                f"input '{vi.name}' of '{src.name}' has shape {dims or 'unknown'}: pathir needs (batch, channels, ...)"
            )
        want = given.get(vi.name)
        if want is not None:
            want = _sizes(want, vi.name)
            if len(want) != len(dims) - 1:
                raise OnnxModelError(
                    f"input_shape {list(want)} has {len(want)} sizes; input '{vi.name}' {_show(dims)} needs "
                    f"{len(dims) - 1} (the shape without the batch axis)"
                )
            for d, w in zip(dims[1:], want):
                if isinstance(d, int) and d > 0 and d != w:
                    raise OnnxModelError(
                        f"input_shape {list(want)} disagrees with the static shape {_show(dims)} of input '{vi.name}'"
                    )
            shapes[vi.name] = want
        else:
            if not all(isinstance(d, int) and d > 0 for d in dims[1:]):
                raise OnnxModelError(
                    f"input '{vi.name}' of '{src.name}' has a dynamic size {_show(dims)}: pass input_shape=(...) "
                    f"(on the command line --input-shape) with its {len(dims) - 1} sizes after the batch axis"
                )
            shapes[vi.name] = tuple(int(d) for d in dims[1:])
        b = dims[0]
        batches.add(b if isinstance(b, int) and b > 0 else None)
    batch = batches.pop() if len(batches) == 1 else None
    return shapes, batch


def _sizes(want, name: str) -> tuple[int, ...]:
    """The sizes of ``input_shape`` for input ``name``: positive integers (no float is truncated)."""
    try:
        sizes = tuple(operator.index(d) for d in want)
        if any(isinstance(d, bool) for d in want):
            raise TypeError(want)
    except TypeError:
        raise InputShapeError(f"input_shape {want!r} for input '{name}' must hold integer sizes") from None
    if any(d <= 0 for d in sizes):
        raise InputShapeError(f"input_shape {want!r} for input '{name}' has a non-positive size")
    return sizes


def _show(dims) -> str:
    return "[" + ", ".join(str(d) if d is not None else "?" for d in dims) + "]"


def infer_shapes(src: Source, shapes: dict[str, tuple[int, ...]]):
    """ONNX shape inference (strict) on the skeleton with the per-sample input sizes fixed.

    Returns {tensor name: elem_type} of every value it types; raises
    OnnxModelError naming the first problem it reports."""
    import onnx

    model = src.skeleton if src.skeleton is not None else skeleton(src.proto)
    for vi in model.graph.input:
        if vi.name in shapes:
            dims = vi.type.tensor_type.shape.dim
            for d, size in zip(list(dims)[1:], shapes[vi.name]):
                d.Clear()
                d.dim_value = size
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OnnxModelError(f"ONNX shape inference failed on '{src.name}': {first}") from None
    g = inferred.graph
    types = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.type.HasField("tensor_type"):
            types[vi.name] = vi.type.tensor_type.elem_type
    for t in g.initializer:
        types[t.name] = t.data_type
    return types


def numpy_dtype(elem_type: int):
    """numpy dtype of an ONNX tensor element type (float32 when unknown)."""
    import onnx

    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError, ValueError):
        return np.dtype(np.float32)


def float_info(dtype):
    """``finfo`` of a floating ``dtype``: numpy's, or ml_dtypes' for bfloat16 (which numpy's does not know); None
    for any other dtype."""
    try:
        return np.finfo(dtype)
    except (TypeError, ValueError):
        pass
    try:
        import ml_dtypes

        return ml_dtypes.finfo(dtype)
    except (ImportError, TypeError, ValueError):
        return None
