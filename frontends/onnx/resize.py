"""ONNX Resize and the legacy Upsample, lowered to a ``Resample`` (one matrix per spatial axis).

The coefficients of each axis are read off the op itself on one-hot inputs along that axis,
constant along the others, so every mode and coordinate transform is the op's own, and the op is
checked to act axis by axis: as onnxruntime runs it (where the two differ, onnxruntime is what the
model runs on: a scale whose output length is not whole, align_corners by scale), or onnx's reference
evaluator where onnxruntime is missing or cannot run the node alone. Refused, naming what: a region of interest
(tf_crop_and_resize), coordinate transforms other than half_pixel, align_corners,
asymmetric and pytorch_half_pixel, cubic with exclude_outside, nearest with antialias (antialiased
linear and cubic are read like the rest), keep_aspect_ratio_policy, and any scaling of the batch or
channel axes. ``axes`` (opset 18): the
scales or sizes of the axes it names, the others kept.
"""

from __future__ import annotations

import numpy as np
import torch

from pathir.frontends.core import fixed_maps
from pathir.frontends.core.values import Value
from pathir.frontends.onnx.batch_size import depends_on_batch
from pathir.frontends.onnx.evaluate import run_node
from pathir.frontends.onnx.layers import attrs

__all__ = ["resize", "upsample"]

_TRANSFORMS = {"half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel"}
_MODES = {"nearest", "linear", "cubic"}


def resize(low, node, ins):
    a = attrs(node)
    mode = a.get("mode", "nearest")
    transform = a.get("coordinate_transformation_mode", "half_pixel")
    if mode not in _MODES:
        low.unsupported(f"Resize mode '{mode}'")
    if transform not in _TRANSFORMS:
        low.unsupported(f"Resize coordinate_transformation_mode '{transform}'")
    if mode == "cubic" and a.get("exclude_outside", 0):
        low.unsupported("Resize cubic with exclude_outside=1")
    if a.get("keep_aspect_ratio_policy", "stretch") != "stretch":
        low.unsupported(f"Resize with keep_aspect_ratio_policy={a['keep_aspect_ratio_policy']}")
    if a.get("antialias", 0) and mode == "nearest":  # (antialiased linear and cubic are read as any mode is)
        low.unsupported("Resize nearest with antialias=1 (onnxruntime runs antialiasing for linear and cubic only)")
    if _opset(low) < 11:  # Resize-10: (X, scales), asymmetric coordinates, as Upsample
        return [_resampled_by(low, node, ins, _resize_input(low, node, 1, "scales"), None, f"resize_{mode}")]
    roi = low.const(node, 1, "roi", required=False) if len(node.input) > 1 and node.input[1] else None
    if roi is not None and roi.size:
        low.unsupported("Resize with a region of interest (roi)")
    scales = _resize_input(low, node, 2, "scales")
    sizes = _resize_input(low, node, 3, "sizes")
    rank = len(low.act(node, 0).shape) + 1
    axes = list(range(rank)) if a.get("axes") is None else [int(d) % rank for d in a["axes"]]
    if sizes is not None and 0 in axes and not low.batch_fixed and not depends_on_batch(low.const(node, 3, "sizes")):
        low.unsupported(f"its sizes fix the batch axis at {int(sizes.reshape(-1)[axes.index(0)])} while the model's batch is dynamic: "
                        "the output's batch does not follow the input's (pass sizes computed from Shape, or scales)")
    if a.get("axes") is not None:
        node, scales, sizes = _all_axes(low, node, a["axes"], scales, sizes)
    return [_resampled_by(low, node, ins, scales, sizes, f"resize_{mode}")]


def _all_axes(low, node, axes, scales, sizes):
    """The node without ``axes``, its scales or sizes given for every axis (the others kept)."""
    from onnx import helper

    v = low.act(node, 0)
    rank = len(v.shape) + 1
    axes = [int(d) + rank if int(d) < 0 else int(d) for d in axes]
    given = scales if scales is not None else sizes
    if given is None or given.size != len(axes) or sorted(set(axes)) != sorted(axes) or not all(0 <= d < rank for d in axes):
        low.unsupported(f"Resize with axes={axes} and {0 if given is None else given.size} scales/sizes")
    if scales is not None:
        full = np.ones(rank, dtype=scales.dtype)
    else:
        full = np.array([low.batch, *v.shape], dtype=sizes.dtype)
    full[axes] = given.reshape(-1)
    bare = helper.make_node(node.op_type, node.input, node.output, name=node.name,
                            **{k: v for k, v in attrs(node).items() if k != "axes"})
    return bare, (full if scales is not None else None), (full if sizes is not None else None)


def upsample(low, node, ins):
    a = attrs(node)
    mode = a.get("mode", "nearest")
    if mode not in ("nearest", "linear", "bilinear"):
        low.unsupported(f"Upsample mode '{mode}'")
    scales = a.get("scales")
    scales = np.asarray(scales, dtype=np.float32) if scales is not None else _resize_input(low, node, 1, "scales")
    return [_resampled_by(low, node, ins, scales, None, f"upsample_{mode}")]


def _opset(low) -> int:
    """The model's default-domain opset (Resize's inputs moved at 11: (X, scales) before, (X, roi, scales, sizes) from)."""
    return next((o.version for o in low.proto.opset_import if o.domain in ("", "ai.onnx")), 0)


def _resize_input(low, node, k, what):
    if len(node.input) <= k or not node.input[k]:
        return None
    c = np.asarray(low.const(node, k, what))
    return c if c.size else None


def _resampled_by(low, node, ins, scales, sizes, label) -> Value:
    v = low.act(node, 0)
    rank = len(v.shape) + 1
    if (scales is None) == (sizes is None):
        low.unsupported("expected exactly one of scales and sizes")
    given = scales if scales is not None else sizes
    if given.size != rank:
        low.unsupported(f"{given.size} scales/sizes for a {rank}-d tensor")
    keep = [1.0, 1.0] if scales is not None else [low.batch, v.shape[0]]
    if [float(g) for g in given[:2]] != [float(x) for x in keep]:
        low.unsupported("resizing the batch or channel axis")
    n = rank - 2
    spatial = v.shape[1:]
    # onnxruntime copies its input where no axis changes length, whatever the scales; where one does, an axis
    # that keeps its length under a scale other than 1 is interpolated (the specification's coordinates). Such
    # an axis is read with the other axes doubled (constant one-hot signals along them: still constant)
    resized = scales is not None and any(_out_len(L, s) != L for L, s in zip(spatial, given[2:]))
    if scales is not None and not resized:  # (onnxruntime's copy, for Resize and the legacy Upsample alike)
        return v
    kept = [resized and _out_len(L, s) == L and float(s) != 1 for L, s in zip(spatial, given[2:])]

    def call(basis, d):
        x = basis.numpy()  # float64: the coefficients exactly, whatever the model's dtype
        per = given.copy()
        for e in range(n):
            if e != d:
                per[2 + e] = (2 if kept[d] else 1) if scales is not None else x.shape[2 + e]
        per[0], per[1] = (1, 1) if scales is not None else (x.shape[0], x.shape[1])
        return torch.as_tensor(np.asarray(_run_resize(low, node, ins, x, per, scales is not None),
                                          dtype=np.float64))

    # (kept axes are read with the others resampled too: constant along them to float32 rounding, not exactly)
    mats = fixed_maps.axis_matrices(low, v.shape[1:], call, tolerance=1e-5 if any(kept) else 0.0)
    if all(m.shape[0] == m.shape[1] and np.array_equal(m, np.eye(m.shape[0])) for m in mats):
        return v
    return fixed_maps.resampled(low, v, mats, label)


def _out_len(length: int, scale) -> int:
    """An axis's output length under ``scale`` as onnxruntime computes it: the product in float32, truncated
    (6 × float32(7/6) is 7 there, 6.9999998 in float64)."""
    return int(np.float32(length) * np.float32(scale))


def _run_resize(low, node, ins, x, per, is_scales):
    from onnx import helper

    if node.op_type == "Upsample":  # = Resize with asymmetric coordinates, nearest rounding down
        if len(node.input) > 1:  # (Upsample-9: scales an input) onnxruntime's own rounding, where it runs the node
            ran = _onnxruntime_node(low.proto, node, [x, np.asarray(per, dtype=np.float32)])
            if ran is not None:
                return ran
        linear = attrs(node).get("mode", "nearest") != "nearest"
        resize = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear" if linear else "nearest",
                                  coordinate_transformation_mode="asymmetric", nearest_mode="floor")
        opset13 = helper.make_model(helper.make_graph([], "resize", [], []),
                                    opset_imports=[helper.make_opsetid("", 13)])
        return run_node(opset13, resize, [x, None, np.asarray(per, dtype=np.float32)])[0]
    new = list(ins)
    new[0] = x
    new[(2 if _opset(low) >= 11 else 1) if is_scales else 3] = np.asarray(per, dtype=np.float32 if is_scales else np.int64)
    ran = _onnxruntime_node(low.proto, node, new)
    return ran if ran is not None else run_node(low.proto, node, new)[0]


def _onnxruntime_node(proto, node, inputs: list):
    """``node`` run by onnxruntime on ``inputs`` (its first, the one-hot basis, in float64 where
    onnxruntime runs the op in it, else float32: a basis is exact in either): the coefficients of the op as onnxruntime runs the model, where onnx's reference
    evaluator places samples differently (Resize by a scale whose output length is not whole, or
    align_corners by scale). None where onnxruntime is missing or cannot run the node alone."""
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        return None
    inits = [numpy_helper.from_array(np.asarray(v), name) for name, v in zip(node.input[1:], inputs[1:])
             if name and v is not None]
    for dtype, kind in ((np.float64, TensorProto.DOUBLE), (np.float32, TensorProto.FLOAT)):  # float64 where it runs
        x = np.asarray(inputs[0], dtype=dtype)
        graph = helper.make_graph([node], "resize", [helper.make_tensor_value_info(node.input[0], kind, x.shape)],
                                  [helper.make_tensor_value_info(node.output[0], kind, None)], inits)
        model = helper.make_model(graph, opset_imports=list(proto.opset_import))
        model.ir_version = proto.ir_version
        try:
            session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
            return np.asarray(session.run(None, {node.input[0]: x})[0], dtype=np.float64)
        except Exception:  # a type, opset or form onnxruntime cannot run alone
            continue
    return None  # the reference evaluator's
