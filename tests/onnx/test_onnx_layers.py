"""Layers imported from ONNX (Conv, ConvTranspose, BatchNormalization, InstanceNormalization, MatMul, Gemm, pools,
LayerNormalization, the reductions, CumSum, Resize, Pad) match onnxruntime at two batch sizes, across attribute and
opset forms."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx_testing import (
    assert_outputs_match,
    check_import,
    const,
    info,
    make_model,
    random_feeds,
    run_module,
    run_ort,
    single_op,
)

from fuser.onnx.importer import import_onnx

RNG = np.random.default_rng(7)


def weights(*shape: int) -> np.ndarray:
    return (RNG.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)


# -- Conv ------------------------------------------------------------------------------------------


CONV_CASES = {
    "plain": dict(x=[5, 13, 11], w=[7, 5, 3, 3], attrs={}),
    "pads": dict(x=[5, 13, 11], w=[7, 5, 3, 3], attrs={"pads": [1, 1, 1, 1]}),
    "stride-dilation": dict(x=[5, 21, 19], w=[7, 5, 3, 3], attrs={"strides": [2, 3], "dilations": [2, 1]}),
    "asymmetric": dict(x=[5, 13, 11], w=[7, 5, 3, 2], attrs={"pads": [0, 1, 2, 0]}),
    "groups": dict(x=[6, 13, 11], w=[9, 2, 3, 3], attrs={"group": 3, "pads": [1, 1, 1, 1]}),
    "depthwise": dict(x=[6, 13, 11], w=[6, 1, 3, 3], attrs={"group": 6, "pads": [1, 1, 1, 1]}),
    "same-upper-s2": dict(x=[5, 13, 10], w=[7, 5, 3, 3], attrs={"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    "same-lower-s2": dict(x=[5, 13, 10], w=[7, 5, 4, 3], attrs={"auto_pad": "SAME_LOWER", "strides": [2, 2]}),
    "same-upper-s1": dict(x=[5, 13, 10], w=[7, 5, 4, 4], attrs={"auto_pad": "SAME_UPPER"}),
    "valid": dict(x=[5, 13, 10], w=[7, 5, 3, 3], attrs={"auto_pad": "VALID"}),
    "1d": dict(x=[5, 19], w=[7, 5, 3], attrs={"pads": [2, 1]}),
    "3d": dict(x=[3, 5, 7, 6], w=[4, 3, 3, 3, 2], attrs={"pads": [1, 1, 0, 1, 1, 0]}),
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv(case: str, bias: bool) -> None:
    spec = CONV_CASES[case]
    w = weights(*spec["w"])
    inits = [const("w", w)] + ([const("b", RNG.standard_normal(w.shape[0]).astype(np.float32))] if bias else [])
    node = helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["y"], **spec["attrs"])
    model = make_model([node], [info("x", ["N", *spec["x"]])], [info("y", None)], inits, opset=13)
    check_import(model, f"Conv {case}")


# -- ConvTranspose ---------------------------------------------------------------------------------


# The weight is [C_in, C_out / group, *kernel].
CONV_TRANSPOSE_CASES = {
    "k2s2": dict(x=[5, 13, 11], w=[5, 7, 2, 2], attrs={"strides": [2, 2]}),  # ultralytics' mask prototypes
    "pads": dict(x=[5, 13, 11], w=[5, 7, 3, 3], attrs={"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "asymmetric": dict(x=[5, 13, 11], w=[5, 7, 3, 3], attrs={"strides": [2, 2], "pads": [0, 1, 2, 0]}),
    "output-padding": dict(
        x=[5, 13, 11], w=[5, 7, 3, 4], attrs={"strides": [2, 3], "pads": [1, 1, 1, 1], "output_padding": [1, 2]}
    ),
    "groups-dilation": dict(x=[6, 13, 11], w=[6, 3, 3, 3], attrs={"group": 3, "dilations": [2, 1]}),
    "output-shape": dict(x=[5, 13, 11], w=[5, 7, 3, 3], attrs={"strides": [2, 2], "output_shape": [26, 21]}),
    "output-shape-upper": dict(
        x=[5, 13, 11], w=[5, 7, 3, 3], attrs={"strides": [2, 2], "output_shape": [26, 21], "auto_pad": "SAME_UPPER"}
    ),
    "same-upper": dict(x=[5, 13, 11], w=[5, 7, 3, 3], attrs={"strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    "same-lower": dict(x=[5, 13, 11], w=[5, 7, 3, 3], attrs={"strides": [2, 2], "auto_pad": "SAME_LOWER"}),
    "1d": dict(x=[5, 19], w=[5, 7, 3], attrs={"strides": [2], "pads": [2, 1]}),
    "3d": dict(x=[3, 5, 7, 6], w=[3, 4, 3, 3, 2], attrs={"strides": [1, 2, 2], "pads": [1, 1, 0, 1, 0, 0]}),
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", list(CONV_TRANSPOSE_CASES))
def test_conv_transpose(case: str, bias: bool) -> None:
    spec = CONV_TRANSPOSE_CASES[case]
    w = weights(*spec["w"])
    c_out = w.shape[1] * spec["attrs"].get("group", 1)
    inits = [const("w", w)] + ([const("b", RNG.standard_normal(c_out).astype(np.float32))] if bias else [])
    node = helper.make_node("ConvTranspose", ["x", "w"] + (["b"] if bias else []), ["y"], **spec["attrs"])
    model = make_model([node], [info("x", ["N", *spec["x"]])], [info("y", None)], inits, opset=17)
    check_import(model, f"ConvTranspose {case}")


def test_conv_transpose_to_an_output_shape_needs_the_input_size() -> None:
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="up", strides=[2, 2], output_shape=[26, 21])
    model = make_model([node], [info("x", ["N", 5, "H", "W"])], [info("y", None)], [const("w", weights(5, 7, 3, 3))])
    with pytest.raises(NotImplementedError, match=r"'up' \(ai.onnx::ConvTranspose, opset 17\): an output_shape"):
        import_onnx(model)


# -- BatchNormalization ----------------------------------------------------------------------------


@pytest.mark.parametrize("opset", [9, 14, 15, 21])
def test_batch_norm(opset: int) -> None:
    c = 7
    inits = [
        const("scale", RNG.uniform(0.5, 1.5, c)),
        const("bias", RNG.standard_normal(c) * 0.2),
        const("mean", RNG.standard_normal(c) * 0.2),
        const("var", RNG.uniform(0.25, 1.75, c)),
    ]
    node = helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y"], epsilon=1e-3)
    model = make_model([node], [info("x", ["N", c, 5, 3])], [info("y", None)], inits, opset=opset)
    check_import(model, f"BatchNormalization opset {opset}")


def test_batch_norm_in_training_mode_normalizes_by_its_own_statistics() -> None:
    """torch.onnx's form of timm's weight standardization: a training-mode BatchNormalization of the conv's
    weight, reshaped to one row per output channel (its inputs' mean and var are unused in that mode)."""
    c_out, c_in = 7, 5
    weight = RNG.standard_normal((c_out, c_in, 3, 3)).astype(np.float32)
    inits = [
        const("w", weight.reshape(1, c_out, -1)),
        const("w_shape", np.array(weight.shape, np.int64)),
        const("gain", RNG.uniform(0.5, 1.5, c_out)),
        const("zero", np.zeros(c_out, np.float32)),
        const("mean", np.zeros(c_out, np.float32)),
        const("var", np.ones(c_out, np.float32)),
    ]
    nodes = [
        helper.make_node(
            "BatchNormalization",
            ["w", "gain", "zero", "mean", "var"],
            ["w_std", "running_mean", "running_var"],  # as torch.onnx writes it; nothing reads the last two
            epsilon=1e-6,
            training_mode=1,
        ),
        helper.make_node("Reshape", ["w_std", "w_shape"], ["w_conv"]),
        helper.make_node("Conv", ["x", "w_conv"], ["y"], pads=[1, 1, 1, 1]),
    ]
    # onnx's checker wants the output's shape where a node runs in training mode
    model = make_model(nodes, [info("x", ["N", c_in, 9, 7])], [info("y", ["N", c_out, 9, 7])], inits, opset=15)
    check_import(model, "BatchNormalization training_mode=1 on a weight")


def test_batch_norm_in_training_mode_whose_running_statistics_are_read_is_refused() -> None:
    c = 7
    inits = [const(n, np.ones(c, np.float32)) for n in ("scale", "bias", "mean", "var")]
    node = helper.make_node(
        "BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y", "running_mean", "running_var"],
        training_mode=1,
    )  # fmt: skip
    outputs = [info("y", ["N", c, 5, 3]), info("running_mean", [c])]
    model = make_model([node], [info("x", ["N", c, 5, 3])], outputs, inits, opset=15)
    with pytest.raises(NotImplementedError, match=r"BatchNormalization.*using output 1 \('running_mean'\)"):
        import_onnx(model)


@pytest.mark.parametrize("opset", [13, 22])  # schema versions 6 and 22
def test_instance_norm(opset: int) -> None:
    c = 7
    inits = [const("scale", RNG.uniform(0.5, 1.5, c)), const("bias", RNG.standard_normal(c) * 0.2)]
    node = helper.make_node("InstanceNormalization", ["x", "scale", "bias"], ["y"], epsilon=1e-4)
    model = make_model([node], [info("x", ["N", c, 13])], [info("y", None)], inits, opset=opset)
    check_import(model, f"InstanceNormalization opset {opset}")


# -- MatMul, Gemm ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "equation, shapes",
    [
        ("bhid,bhjd->bhij", [["N", 3, 7, 5], ["N", 3, 9, 5]]),
        ("... i d, ... j d -> ... i j", [["N", 2, 7, 5], ["N", 2, 9, 5]]),
        ("nchw,kc->nkhw", [["N", 5, 7, 3], [11, 5]]),
        ("bij->bji", [["N", 7, 5]]),
    ],
    ids=["batched-qk", "ellipsis-spaces", "channel-mix", "transpose"],
)
def test_einsum(equation: str, shapes: list) -> None:
    check_import(single_op("Einsum", shapes, opset=17, equation=equation), f"Einsum {equation}")


@pytest.mark.parametrize(
    "a_shape, b_shape",
    [(["N", 19], [19, 21]), (["N", 7, 19], [19, 13]), (["N", 3, 7, 19], ["N", 3, 19, 5]), (["N", 19], [19])],
    ids=["2d", "3d-const", "4d-batched", "vector"],
)
def test_matmul(a_shape: list, b_shape: list) -> None:
    if "N" in b_shape:
        model = single_op("MatMul", [a_shape, b_shape], opset=13)
    else:
        model = single_op(
            "MatMul", [a_shape], opset=13, initializers=[const("b", weights(*b_shape))], extra_inputs=["b"]
        )
    check_import(model, f"MatMul {a_shape} x {b_shape}")


GEMM_CASES = {
    "linear": dict(attrs={"transB": 1}, c=[21]),
    "no-bias": dict(attrs={"transB": 1}, c=None),
    "transB0": dict(attrs={}, c=[21]),
    "alpha-beta": dict(attrs={"transB": 1, "alpha": 0.7, "beta": 1.3}, c=[21]),
    "row-c": dict(attrs={"transB": 1}, c=[1, 21]),
    "scalar-c": dict(attrs={"transB": 1}, c=[1]),
    "matrix-c": dict(attrs={"transB": 1, "beta": 0.5}, c=[3, 21]),
    "transA": dict(attrs={"transA": 1, "transB": 1}, c=[21]),
}


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("case", list(GEMM_CASES))
def test_gemm_constant_weight(case: str, opset: int) -> None:
    spec = GEMM_CASES[case]
    k, n = 19, 21
    trans_a, trans_b = spec["attrs"].get("transA", 0), spec["attrs"].get("transB", 0)
    a_shape = [k, 3] if trans_a else ["N", k]
    if case == "matrix-c":
        a_shape = [3, k]
    inits = [const("b", weights(n, k) if trans_b else weights(k, n))]
    names = ["a", "b"]
    if spec["c"] is not None:
        inits.append(const("c", RNG.standard_normal(spec["c"]).astype(np.float32)))
        names.append("c")
    node = helper.make_node("Gemm", names, ["y"], **spec["attrs"])
    model = make_model([node], [info("a", a_shape)], [info("y", None)], inits, opset=opset)
    batches = (1,) if case in ("matrix-c", "transA") else (2, 5)
    check_import(model, f"Gemm {case}", batches=batches)


@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_runtime_operands(trans_b: int) -> None:
    b_shape = [21, 19] if trans_b else [19, 21]
    model = single_op("Gemm", [["N", 19], b_shape, [21]], opset=13, transB=trans_b, alpha=1.1, beta=0.9)
    check_import(model, f"Gemm runtime transB={trans_b}")


# -- pooling ---------------------------------------------------------------------------------------


POOL_CASES = {
    "k3s2": {"kernel_shape": [3, 3], "strides": [2, 2]},
    "k2": {"kernel_shape": [2, 2], "strides": [2, 2]},
    "pads": {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1]},
    "asymmetric": {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [0, 1, 1, 0]},
    "ceil": {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
    "ceil-pads": {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1},
    "same-upper": {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"},
    "sppf-k5": {"kernel_shape": [5, 5], "strides": [1, 1], "pads": [2, 2, 2, 2]},
}


@pytest.mark.parametrize("opset", [13, 21])
@pytest.mark.parametrize("case", list(POOL_CASES))
def test_max_pool(case: str, opset: int) -> None:
    model = single_op("MaxPool", [["N", 3, 13, 11]], opset=opset, **POOL_CASES[case])
    check_import(model, f"MaxPool {case}")


def test_max_pool_dilated_1d() -> None:
    model = single_op("MaxPool", [["N", 3, 17]], opset=13, kernel_shape=[3], dilations=[2], pads=[1, 1])
    check_import(model, "MaxPool dilated 1-D")


@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("case", ["k3s2", "k2", "pads", "ceil", "ceil-pads", "same-upper"])
def test_average_pool(case: str, count_include_pad: int) -> None:
    attrs = dict(POOL_CASES[case], count_include_pad=count_include_pad)
    model = single_op("AveragePool", [["N", 3, 13, 11]], opset=19, **attrs)
    check_import(model, f"AveragePool {case} count_include_pad={count_include_pad}")


def test_average_pool_asymmetric_counting_pads() -> None:
    attrs = dict(POOL_CASES["asymmetric"], count_include_pad=1)
    check_import(single_op("AveragePool", [["N", 3, 13, 11]], opset=13, **attrs), "AveragePool asymmetric")


@pytest.mark.parametrize("shape", [["N", 5, 7, 3], ["N", 5, 7], ["N", 5, 3, 4, 2]], ids=["2d", "1d", "3d"])
def test_global_average_pool(shape: list) -> None:
    check_import(single_op("GlobalAveragePool", [shape], opset=13), f"GlobalAveragePool {shape}")


# -- LayerNormalization, ReduceMean ----------------------------------------------------------------


@pytest.mark.parametrize("axis", [-1, -2, 2])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm(axis: int, bias: bool) -> None:
    shape = ["N", 7, 5, 19]
    norm_shape = shape[axis:]
    inits = [const("scale", RNG.uniform(0.5, 1.5, norm_shape))]
    if bias:
        inits.append(const("bias", RNG.standard_normal(norm_shape) * 0.3))
    node = helper.make_node(
        "LayerNormalization", ["x", "scale"] + (["bias"] if bias else []), ["y"], axis=axis, epsilon=1e-4
    )
    model = make_model([node], [info("x", shape)], [info("y", shape)], inits, opset=17)
    check_import(model, f"LayerNormalization axis {axis}")


def test_layer_norm_broadcast_scale() -> None:
    """A scale of shape [1, D] broadcasts over the normalized [T, D]: not F.layer_norm's weight."""
    inits = [const("scale", RNG.uniform(0.5, 1.5, [1, 19])), const("bias", RNG.standard_normal([19]))]
    node = helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"], axis=-2)
    model = make_model([node], [info("x", ["N", 5, 19])], [info("y", ["N", 5, 19])], inits, opset=17)
    check_import(model, "LayerNormalization broadcast scale")


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axes", [[-1], [2, 3], [1], None], ids=["last", "spatial", "channel", "all"])
def test_reduce_mean_attribute(axes: list | None, keepdims: int) -> None:
    attrs = {"keepdims": keepdims} | ({"axes": axes} if axes is not None else {})
    check_import(single_op("ReduceMean", [["N", 5, 7, 3]], opset=13, **attrs), f"ReduceMean {axes}")


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axes", [[-1], [2, 3], None], ids=["last", "spatial", "all"])
def test_reduce_mean_input(axes: list | None, keepdims: int) -> None:
    inits = [const("axes", np.array(axes, np.int64))] if axes is not None else []
    extra = ["axes"] if axes is not None else []
    model = single_op(
        "ReduceMean", [["N", 5, 7, 3]], opset=18, initializers=inits, extra_inputs=extra, keepdims=keepdims
    )
    check_import(model, f"ReduceMean opset 18 {axes}")


# Reductions besides ReduceMean: (the last opset whose schema has the axes as an attribute, the first with them
# as an input).
REDUCTIONS = {"ReduceL2": (17, 18), "ReduceSum": (12, 13), "ReduceMax": (17, 18), "ReduceMin": (17, 18)}


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axes", [[-1], [1, 2], None], ids=["last", "two", "all"])
@pytest.mark.parametrize("axes_as_input", [False, True], ids=["attribute", "input"])
@pytest.mark.parametrize("op", list(REDUCTIONS))
def test_reductions(op: str, axes_as_input: bool, axes: list | None, keepdims: int) -> None:
    opset = REDUCTIONS[op][axes_as_input]
    if axes_as_input:
        inits = [const("axes", np.array(axes, np.int64))] if axes is not None else []
        extra = ["axes"] if axes is not None else []
        model = single_op(op, [["N", 5, 7, 3]], opset=opset, initializers=inits, extra_inputs=extra,
                          keepdims=keepdims)  # fmt: skip
    else:
        attrs = {"keepdims": keepdims} | ({"axes": axes} if axes is not None else {})
        model = single_op(op, [["N", 5, 7, 3]], opset=opset, **attrs)
    check_import(model, f"{op} opset {opset} {axes}")


def test_reduce_mean_noop_with_empty_axes() -> None:
    model = single_op("ReduceMean", [["N", 5, 7, 3]], opset=18, noop_with_empty_axes=1)
    module = check_import(model, "ReduceMean noop")
    assert [n.op for n in module.graph.nodes] == ["placeholder", "output"]


# -- CumSum ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("reverse, exclusive", [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("axis", [1, -1])
def test_cumsum(axis: int, reverse: int, exclusive: int) -> None:
    inits = [const("axis", np.int64(axis))]
    model = single_op(
        "CumSum",
        [["N", 5, 7]],
        opset=14,
        initializers=inits,
        extra_inputs=["axis"],
        reverse=reverse,
        exclusive=exclusive,
    )
    check_import(model, f"CumSum axis {axis} reverse {reverse} exclusive {exclusive}")


@pytest.mark.parametrize("dtype", [TensorProto.INT32, TensorProto.INT64])
def test_cumsum_keeps_the_integer_dtype(dtype: int) -> None:
    """torch.cumsum widens int32 to int64 unless told; GPT-2's position ids are a cumsum of the mask."""
    model = single_op(
        "CumSum",
        [["N", 9]],
        opset=11,
        initializers=[const("axis", np.array([1], np.int64))],
        extra_inputs=["axis"],
        input_dtype=dtype,
        output_dtype=dtype,
    )
    check_import(model, f"CumSum {dtype}")


# -- Resize ----------------------------------------------------------------------------------------


RESIZE_CASES = {
    "nearest-asymmetric-floor": dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
    "nearest-half-pixel-ceil": dict(
        mode="nearest", coordinate_transformation_mode="half_pixel", nearest_mode="round_prefer_ceil"
    ),
    "nearest-default": dict(mode="nearest"),
    "linear-half-pixel": dict(mode="linear", coordinate_transformation_mode="half_pixel"),
    "linear-pytorch-half-pixel": dict(mode="linear", coordinate_transformation_mode="pytorch_half_pixel"),
    "linear-align-corners": dict(mode="linear", coordinate_transformation_mode="align_corners"),
    "cubic-half-pixel": dict(mode="cubic", coordinate_transformation_mode="half_pixel", cubic_coeff_a=-0.75),
    "cubic-align-corners": dict(mode="cubic", coordinate_transformation_mode="align_corners", cubic_coeff_a=-0.75),
}


@pytest.mark.parametrize("scales", [[1, 1, 2, 2], [1, 1, 3, 2]], ids=["x2", "x3x2"])
@pytest.mark.parametrize("opset", [11, 13, 18, 19])
@pytest.mark.parametrize("case", list(RESIZE_CASES))
def test_resize_scales(case: str, opset: int, scales: list) -> None:
    inits = [const("scales", np.array(scales, np.float32))]
    roi = [const("roi", np.array([], np.float32))] if opset < 13 else []
    extra = ["roi" if opset < 13 else "", "scales"]
    model = single_op(
        "Resize", [["N", 3, 5, 7]], opset=opset, initializers=roi + inits, extra_inputs=extra, **RESIZE_CASES[case]
    )
    check_import(model, f"Resize {case} opset {opset} scales {scales}")


@pytest.mark.parametrize(
    "case",
    [
        "nearest-asymmetric-floor",
        "linear-half-pixel",
        "linear-align-corners",
        "cubic-half-pixel",
        "nearest-half-pixel-ceil",
    ],
)
def test_resize_sizes(case: str) -> None:
    """sizes = Shape(x)[:2] ++ [9, 4], as torch exports ``F.interpolate(x, size=(9, 4))``."""
    nodes = [
        helper.make_node("Shape", ["x"], ["xs"], end=2),
        helper.make_node("Concat", ["xs", "hw"], ["sizes"], axis=0),
        helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], **RESIZE_CASES[case]),
    ]
    model = make_model(nodes, [info("x", ["N", 3, 5, 7])], [info("y", None)], [const("hw", [9, 4])], opset=15)
    check_import(model, f"Resize {case} sizes")


def test_resize_constant_sizes_keep_the_batch() -> None:
    """Constant sizes carry the batch the file was exported at; the import keeps the batch dynamic and
    resizes each sample as onnxruntime does at that batch (onnxruntime would resize the batch too)."""
    inits = [const("sizes", np.array([1, 3, 9, 4], np.int64))]
    model = single_op(
        "Resize",
        [["N", 3, 5, 7]],
        opset=13,
        initializers=inits,
        extra_inputs=["", "", "sizes"],
        **RESIZE_CASES["linear-half-pixel"],
    )
    module = check_import(model, "Resize constant sizes", batches=(1,))
    feeds = random_feeds(model, 3)
    out = run_module(module, feeds)[0]
    assert out.shape == (3, 3, 9, 4)
    for i in range(3):
        ref = run_ort(model, {"x0": feeds["x0"][i : i + 1]})
        assert_outputs_match([out[i : i + 1]], ref, f"sample {i}")


def test_resize_downscale_linear() -> None:
    inits = [const("scales", np.array([1, 1, 0.5, 0.75], np.float32))]
    model = single_op(
        "Resize",
        [["N", 3, 12, 9]],
        opset=13,
        initializers=inits,
        extra_inputs=["", "scales"],
        **RESIZE_CASES["linear-half-pixel"],
    )
    check_import(model, "Resize linear downscale")


def test_resize_axes_opset18() -> None:
    inits = [const("scales", np.array([2.0, 3.0], np.float32))]
    model = single_op(
        "Resize",
        [["N", 3, 5, 7]],
        opset=18,
        initializers=inits,
        extra_inputs=["", "scales"],
        axes=[2, 3],
        mode="nearest",
        coordinate_transformation_mode="asymmetric",
        nearest_mode="floor",
    )
    check_import(model, "Resize axes")


def test_resize_sizes_from_shape() -> None:
    """sizes = Shape(x)[:2] ++ Shape(y)[2:], the upsample-to-match pattern of detectors' necks."""
    nodes = [
        helper.make_node("Shape", ["x"], ["xs"]),
        helper.make_node("Slice", ["xs", "zero", "two"], ["nc"]),
        helper.make_node("Shape", ["ref"], ["rs"]),
        helper.make_node("Slice", ["rs", "two", "four"], ["hw"]),
        helper.make_node("Concat", ["nc", "hw"], ["sizes"], axis=0),
        helper.make_node(
            "Resize",
            ["x", "", "", "sizes"],
            ["y"],
            mode="nearest",
            coordinate_transformation_mode="asymmetric",
            nearest_mode="floor",
        ),
    ]
    inits = [const("zero", [0]), const("two", [2]), const("four", [4])]
    model = make_model(
        nodes, [info("x", ["N", 3, 5, 7]), info("ref", ["N", 2, 10, 14])], [info("y", None)], inits, opset=13
    )
    check_import(model, "Resize to a run-time size")


# -- Pad -------------------------------------------------------------------------------------------


PAD_CASES = {
    "spatial": [0, 0, 1, 2, 0, 0, 2, 1],
    "last": [0, 0, 0, 3, 0, 0, 0, 1],
    "channel-and-spatial": [0, 1, 1, 0, 0, 2, 0, 1],
    "crop": [0, 0, -1, 1, 0, 0, 1, -2],
}


PAD_MODES = ["constant", "reflect", "edge", "wrap"]


# Negative pads (cropping) exist only for mode="constant" in torch; the other modes refuse them below.
@pytest.mark.parametrize("case, mode", [(c, m) for c in PAD_CASES for m in PAD_MODES if m == "constant" or c != "crop"])
def test_pad(case: str, mode: str) -> None:
    pads = PAD_CASES[case]
    opset = 19 if mode == "wrap" else 13
    inits = [const("pads", np.array(pads, np.int64))]
    extra = ["pads"]
    if mode == "constant":
        inits.append(const("value", np.float32(0.75)))
        extra.append("value")
    model = single_op("Pad", [["N", 3, 7, 5]], opset=opset, initializers=inits, extra_inputs=extra, mode=mode)
    check_import(model, f"Pad {case} {mode}")


@pytest.mark.parametrize("mode", ["constant", "reflect"])
def test_pad_axes_opset18(mode: str) -> None:
    inits = [const("pads", np.array([1, 2, 2, 1], np.int64)), const("axes", np.array([-1, 2], np.int64))]
    model = single_op(
        "Pad", [["N", 3, 7, 5]], opset=18, initializers=inits, extra_inputs=["pads", "", "axes"], mode=mode
    )
    check_import(model, f"Pad axes {mode}")


def test_pad_opset11_default_value() -> None:
    inits = [const("pads", np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))]
    model = single_op("Pad", [["N", 3, 7, 5]], opset=11, initializers=inits, extra_inputs=["pads"])
    check_import(model, "Pad opset 11")


@pytest.mark.parametrize("mode", PAD_MODES[1:])
def test_pad_negative_pads_refused_unless_constant(mode: str) -> None:
    inits = [const("pads", np.array(PAD_CASES["crop"], np.int64))]
    opset = 19 if mode == "wrap" else 13
    model = single_op("Pad", [["N", 3, 7, 5]], opset=opset, initializers=inits, extra_inputs=["pads"], mode=mode)
    with pytest.raises(NotImplementedError, match=rf"'Pad_0'.*Pad, opset {opset}.*negative pads with mode='{mode}'"):
        import_onnx(model)


def test_pad_of_the_batch_dim_with_edge_is_refused() -> None:
    inits = [const("pads", np.array([1, 0, 0, 0, 0, 0, 0, 1], np.int64))]
    model = single_op("Pad", [["N", 3, 7, 5]], opset=13, initializers=inits, extra_inputs=["pads"], mode="edge")
    with pytest.raises(NotImplementedError, match=r"'Pad_0'.*mode='edge' padding dims \[0, 3\]"):
        import_onnx(model)
