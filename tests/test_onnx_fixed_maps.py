"""Fixed maps through the ONNX frontend (Resize in its torch-exported modes, the legacy
Upsample, Pad in every mode, DepthToSpace DCR / CRD, SpaceToDepth): the same function as
onnxruntime, the same graph and path-norms as the torch frontend on the same model;
unsupported modes refused naming them."""

import math

import numpy as np
import pytest
from onnx_cases import export, make_model, node, ort_run, rel, tensor_info
from test_torch_fixed_maps import CASES, build, definition_path_norm

import pathir
from pathir.errors import UnsupportedOperation

TORCH_CASES = ["pad_zero_2d", "pad_reflect_2d", "pad_replicate_3d", "pad_circular_2d", "pad_reflect_1d",
               "nearest_x2", "nearest_size", "bilinear", "bilinear_align", "bilinear_size", "bilinear_down",
               "linear_1d", "trilinear", "bicubic", "bicubic_align", "pixel_shuffle", "pixel_unshuffle"]


@pytest.mark.parametrize("case", TORCH_CASES)
def test_exported_fixed_op_equals_onnxruntime_and_the_torch_frontend(case):
    make, n, size = CASES[case]
    model, shape = build(make(), n, size)
    model = model.float()
    proto = export(model, shape, "legacy-nofold")
    cm, ct = pathir.compile(proto), pathir.compile(model, input_shape=shape)
    x = np.random.default_rng(0).normal(size=(2, *shape))
    got = np.asarray(cm.forward(x, backend="numpy"))
    assert rel(got, ort_run(proto, x)[0]) <= 1e-5
    # the exporter may write a size as a float32 scale (align_corners): coefficients then agree to float32
    assert rel(got, np.asarray(ct.forward(x, backend="numpy"))) <= 1e-6
    if case != "pad_circular_2d":  # exported as Slice + Concat: one more node, the same function
        layout = lambda g: [(n.kind, n.shape, sorted(e.map.kind.value for e in n.edges)) for n in g]
        assert layout(cm.graph) == layout(ct.graph)
    for q in (1, 2):
        assert math.isclose(cm.path_norm(q), ct.path_norm(q), rel_tol=1e-6)
    assert math.isclose(cm.path_norm(1), definition_path_norm(model.double(), shape, 1), rel_tol=1e-6)


def _resize_model(shape, attrs, scales=None, sizes=None, roi=None, opset=17):
    inits = {"roi": np.asarray(roi if roi is not None else [], dtype=np.float32)}
    inputs = ["x", "roi"]
    if scales is not None:
        inits["scales"] = np.asarray(scales, dtype=np.float32)
        inputs.append("scales")
    else:
        inits["sizes"] = np.asarray(sizes, dtype=np.int64)
        inputs += ["", "sizes"]
    w = np.random.default_rng(1).normal(size=(2, shape[1], 1, 1))
    nodes = [node("Resize", inputs, ["r"], **attrs), node("Relu", ["r"], ["h"]), node("Conv", ["h", "w"], ["y"])]
    inits["w"] = w
    return make_model(nodes, [tensor_info("x", shape)], [tensor_info("y", ["n", "c", "h", "w"])], inits, opset=opset)


@pytest.mark.parametrize("attrs, scales, sizes", [
    (dict(mode="linear", coordinate_transformation_mode="half_pixel"), [1, 1, 2, 1.5], None),
    (dict(mode="linear", coordinate_transformation_mode="align_corners"), None, [2, 3, 7, 5]),
    (dict(mode="linear", coordinate_transformation_mode="asymmetric"), [1, 1, 2, 2], None),
    (dict(mode="linear", coordinate_transformation_mode="pytorch_half_pixel"), None, [2, 3, 1, 6]),
    (dict(mode="cubic", coordinate_transformation_mode="half_pixel", cubic_coeff_a=-0.75), [1, 1, 2, 2], None),
    (dict(mode="cubic", coordinate_transformation_mode="align_corners", cubic_coeff_a=-0.5), None, [2, 3, 5, 6]),
    (dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor"), [1, 1, 2, 3], None),
    (dict(mode="nearest", coordinate_transformation_mode="half_pixel", nearest_mode="round_prefer_ceil"),
     None, [2, 3, 7, 2]),
    (dict(mode="nearest"), [1, 1, 0.5, 0.75], None),
    # an axis keeping its length (floor(4·1.1) = 4) under a scale other than 1, beside one that changes: onnxruntime
    # interpolates it (read alone it is a copy: onnxruntime copies a Resize that changes no length)
    (dict(mode="linear", coordinate_transformation_mode="half_pixel"), [1, 1, 2.7, 1.1], None),
    (dict(mode="cubic", coordinate_transformation_mode="half_pixel"), [1, 1, 1.2, 2], None),
    (dict(mode="linear"), [1, 1, 1.1, 1.2], None),  # no length changes: onnxruntime copies
    # cubic: read with the other axis resampled, constant along it only to float32 rounding (was refused as
    # "not separable")
    (dict(mode="cubic", coordinate_transformation_mode="align_corners"), [1, 1, 1.1, 2], None),
    (dict(mode="cubic", coordinate_transformation_mode="asymmetric"), [1, 1, 0.9, 1.1], None),
    # antialiased (opset 18; was refused): the filter widened by 1/scale when downsampling, as onnxruntime runs it
    (dict(mode="linear", antialias=1), [1, 1, 0.5, 0.75], None),
    (dict(mode="cubic", antialias=1, coordinate_transformation_mode="asymmetric"), None, [2, 3, 3, 2]),
    (dict(mode="linear", antialias=1, coordinate_transformation_mode="align_corners"), [1, 1, 2, 0.5], None),
])
def test_resize_modes_equal_onnxruntime(attrs, scales, sizes):
    proto = _resize_model([2, 3, 4, 4], attrs, scales, sizes, opset=18 if "antialias" in attrs else 17)
    cm = pathir.compile(proto)
    x = np.random.default_rng(2).normal(size=(2, 3, 4, 4))
    assert rel(np.asarray(cm.forward(x, backend="numpy")), ort_run(proto, x)[0]) <= 1e-5
    assert any(e.map.kind.value == "resample" for n in cm.graph for e in n.edges) or scales == [1, 1, 1.1, 1.2]


@pytest.mark.parametrize("attrs, roi, words", [
    (dict(mode="linear", coordinate_transformation_mode="tf_crop_and_resize"), [0, 0, 0, 0, 1, 1, 1, 1],
     "tf_crop_and_resize"),
    (dict(mode="cubic", exclude_outside=1), None, "exclude_outside"),
    (dict(mode="nearest", antialias=1), None, "nearest with antialias=1"),
])
def test_unsupported_resize_modes_are_refused_naming_them(attrs, roi, words):
    opset = 18 if "antialias" in attrs else 17
    proto = _resize_model([2, 3, 4, 4], attrs, [1, 1, 2, 2], roi=roi, opset=opset)
    with pytest.raises(UnsupportedOperation, match=words):
        pathir.compile(proto)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("scales", [[1, 1, 2, 1.5], [1, 1, 1.3, 1.0]])  # the second changes no length: a copy
def test_legacy_upsample_equals_onnxruntime(mode, scales):
    w = np.random.default_rng(1).normal(size=(2, 3, 1, 1))
    nodes = [node("Upsample", ["x", "scales"], ["r"], mode=mode), node("Relu", ["r"], ["h"]),
             node("Conv", ["h", "w"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", [2, 3, 3, 4])], [tensor_info("y", ["n", "c", "h", "w"])],
                       {"scales": np.asarray(scales, dtype=np.float32), "w": w}, opset=9)
    cm = pathir.compile(proto)
    x = np.random.default_rng(3).normal(size=(2, 3, 3, 4))
    assert rel(np.asarray(cm.forward(x, backend="numpy")), ort_run(proto, x)[0]) <= 1e-5


@pytest.mark.parametrize("op, attrs, c", [("DepthToSpace", dict(blocksize=2, mode="DCR"), 8),
                                          ("DepthToSpace", dict(blocksize=2, mode="CRD"), 8),
                                          ("SpaceToDepth", dict(blocksize=2), 2)])
def test_depth_space_ops_equal_onnxruntime_and_tie_units(op, attrs, c):
    rng = np.random.default_rng(4)
    spatial = 3 if op == "DepthToSpace" else 4
    c_out = c // 4 if op == "DepthToSpace" else c * 4
    nodes = [node("Conv", ["x", "w1"], ["a"]), node("Relu", ["a"], ["h"]), node(op, ["h"], ["s"], **attrs),
             node("Conv", ["s", "w2"], ["y"])]
    inits = {"w1": rng.normal(size=(c, 2, 1, 1)), "w2": rng.normal(size=(2, c_out, 1, 1))}
    outputs = [tensor_info("y", ["n", "c", "h", "w"])]
    proto = make_model(nodes, [tensor_info("x", [2, 2, spatial, spatial])], outputs, inits)
    cm = pathir.compile(proto)
    x = rng.normal(size=(2, 2, spatial, spatial))
    assert rel(np.asarray(cm.forward(x, backend="numpy")), ort_run(proto, x)[0]) <= 1e-5
    if op == "DepthToSpace":  # blocks of 4 hidden channels feed one channel of a weight-shared conv: one unit each
        assert len(cm.units) == c // 4
    else:
        assert len(cm.units) == c


@pytest.mark.parametrize("case", ["bilinear", "bicubic", "pad_reflect_2d", "pixel_shuffle"])
def test_pathcond_on_the_onnx_model_keeps_onnxruntime_outputs(case):
    make, n, size = CASES[case]
    model, shape = build(make(), n, size)
    proto = export(model.float(), shape, "legacy-nofold")
    cm = pathir.compile(proto)
    cm.pathcond()
    x = np.random.default_rng(5).normal(size=(2, *shape)).astype(np.float32)
    assert rel(ort_run(cm.to_onnx(), x)[0], ort_run(proto, x)[0]) <= 1e-5


def test_a_scalar_constant_factor_is_a_fixed_edge_as_in_torch():
    make, n, size = CASES["constant_factor"]
    model, shape = build(make(), n, size)
    proto = export(model.float(), shape, "legacy-nofold")
    cm, ct = pathir.compile(proto), pathir.compile(model.float(), input_shape=shape)
    x = np.random.default_rng(6).normal(size=(2, *shape))
    assert rel(np.asarray(cm.forward(x, backend="numpy")), ort_run(proto, x)[0]) <= 1e-5
    assert math.isclose(cm.path_norm(2), ct.path_norm(2), rel_tol=1e-6)


def _resize_by_scale(length: int, scale: float, mode: str, transform: str):
    nodes = [node("Relu", ["x"], ["r"]),
             node("Resize", ["r", "", "sc"], ["y"], mode=mode, coordinate_transformation_mode=transform)]
    out = math.floor(length * float(np.float32(scale)))
    return make_model(nodes, [tensor_info("x", ["N", 1, length, 1])], [tensor_info("y", ["N", 1, out, 1])],
                      {"sc": np.array([1, 1, scale, 1])}, opset=18)


@pytest.mark.parametrize("mode,transform", [("linear", "half_pixel"), ("linear", "pytorch_half_pixel"),
                                            ("linear", "asymmetric"), ("linear", "align_corners"),
                                            ("nearest", "half_pixel"), ("nearest", "align_corners")])
def test_resize_by_a_scale_is_onnxruntimes_map(mode, transform):
    """Where the output length L·scale is not whole, onnx's reference evaluator and onnxruntime place the
    samples differently (the reference's map had an edge onnxruntime's lacks, and align_corners failed the
    self-check): the graph's map is onnxruntime's own, read on one-hot inputs, edge for edge."""
    for length in range(3, 10):
        for scale in (0.6, 0.7, 1.3, 1.7, 2.5, 0.35):
            proto = _resize_by_scale(length, scale, mode, transform)
            ort_map = ort_run(proto, np.eye(length).reshape(length, 1, length, 1))[0].reshape(length, -1).T
            cm = pathir.compile(proto)
            ours = np.asarray(cm.forward(np.eye(length).reshape(length, 1, length, 1), backend="numpy"))
            ours = ours.reshape(length, -1).T  # the graph's map, one column per one-hot input
            assert np.array_equal(ours != 0, ort_map != 0), (length, scale)
            np.testing.assert_allclose(ours, ort_map, rtol=1e-6, atol=0)
            assert cm.num_paths() == np.count_nonzero(ort_map)


@pytest.mark.parametrize("op, opset, scale", [("Resize", 13, 7 / 6), ("Resize", 10, 7 / 6), ("Upsample", 9, 4 / 3)])
def test_lengths_and_rounding_as_onnxruntime_computes_them_in_float32(op, opset, scale):
    """6 × float32(7/6) is 7 in float32 (onnxruntime's output length) and 6.9999998 in float64 (read as 'no length
    changes', a copy of 6 rows); Upsample-9 nearest at float32(4/3) rounds row 4 to input row 3 in onnxruntime and
    to 2 in the Resize-13 pathir imitated it with."""
    scales = np.asarray([1, 1, scale, 1], dtype=np.float32)
    inputs = ["x", "scales"] if op == "Upsample" or opset < 11 else ["x", "", "scales"]
    nodes = [node(op, inputs, ["r"], mode="nearest" if op == "Upsample" else "linear"), node("Relu", ["r"], ["h"]),
             node("Conv", ["h", "w"], ["y"])]
    w = np.random.default_rng(1).normal(size=(2, 1, 1, 1))
    proto = make_model(nodes, [tensor_info("x", ["n", 1, 6, 3])], [tensor_info("y", ["n", 2, "h", 3])],
                       {"scales": scales, "w": w}, opset=opset)
    x = np.random.default_rng(3).normal(size=(2, 1, 6, 3))
    expected = ort_run(proto, x)[0]
    cm = pathir.compile(proto)
    got = np.asarray(cm.forward(x, backend="numpy"))
    assert got.shape == expected.shape and rel(got, expected) <= 1e-6
