"""Shape and data-movement ops imported from ONNX match onnxruntime, and shape arithmetic follows the
batch size at run time (each graph runs at two batch sizes)."""

from __future__ import annotations

import operator
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from onnx_testing import (
    INT64,
    assert_outputs_match,
    assert_survives_pickling,
    call_targets,
    check_import,
    const,
    info,
    make_model,
    random_feeds,
    run_module,
    run_ort,
    single_op,
)

from fuser.onnx.exporter import export_onnx
from fuser.onnx.importer import import_onnx

SHAPE = ["N", 6, 5, 7]


# -- Shape, Gather ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "opset, attrs", [(13, {}), (15, {"start": 1}), (15, {"start": -2, "end": -1}), (19, {"end": 2})]
)
def test_shape(opset: int, attrs: dict) -> None:
    model = single_op("Shape", [SHAPE], opset=opset, output_dtype=INT64, **attrs)
    check_import(model, f"Shape {attrs}")


GATHER_INDICES = {
    "scalar": np.int64(2),
    "negative-scalar": np.int64(-1),
    "vector": np.array([4, 0, 2, 2], np.int64),
    "negative-vector": np.array([-1, 0, -3], np.int64),
    "matrix": np.array([[1, 0], [3, -2]], np.int64),
}


@pytest.mark.parametrize("axis", [1, 2, -1])
@pytest.mark.parametrize("case", list(GATHER_INDICES))
def test_gather_constant_indices(case: str, axis: int) -> None:
    model = single_op(
        "Gather", [SHAPE], opset=13, initializers=[const("i", GATHER_INDICES[case])], extra_inputs=["i"], axis=axis
    )
    check_import(model, f"Gather {case} axis {axis}")


def test_gather_embedding() -> None:
    """Constant table, run-time token ids: the embedding lookup of a transformer's ONNX export."""
    table = const("table", np.random.default_rng(0).standard_normal((11, 19)).astype(np.float32))
    node = helper.make_node("Gather", ["table", "ids"], ["y"], axis=0)
    model = make_model([node], [info("ids", ["N", 7], INT64)], [info("y", None)], [table], opset=13)
    # random_feeds draws ids in [-5, 5]: negative ids index from the end, as in onnxruntime.
    check_import(model, "Gather embedding")


def check_with_indices_in(model: onnx.ModelProto, low: int, high: int, what: str) -> None:
    """Like check_import, with the run-time input "i" clipped to [low, high]: valid indices at both batch
    sizes (out-of-range ones are an error in onnxruntime, not a value)."""
    module = import_onnx(model)
    for batch in (2, 5):
        feeds = random_feeds(model, batch, seed=batch)
        feeds["i"] = np.clip(feeds["i"], low, high)
        assert_outputs_match(run_module(module, feeds), run_ort(model, feeds), f"{what} batch {batch}")


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_elements_run_time_indices(axis: int) -> None:
    """Indices in [-5, 4] over data dims of at least 5: negative ones count from the end, as in onnxruntime."""
    index_shape = {0: ["N", 5, 7], 1: [6, "N", 7], -1: [6, 5, "N"]}[axis]
    node = helper.make_node("GatherElements", ["x0", "i"], ["y0"], axis=axis)
    inputs = [info("x0", [6, 5, 7]), info("i", index_shape, INT64)]
    check_with_indices_in(make_model([node], inputs, [info("y0", None)], opset=13), -5, 4, f"GatherElements {axis}")


@pytest.mark.parametrize("negative", [False, True])
def test_gather_elements_constant_int32_indices(negative: bool) -> None:
    rng = np.random.default_rng(1)
    indices = rng.integers(-5 if negative else 0, 5, (3, 5, 4)).astype(np.int32)
    node = helper.make_node("GatherElements", ["x0", "i"], ["y0"], axis=-1)
    model = make_model([node], [info("x0", ["N", 5, 7])], [info("y0", None)], [const("i", indices)], opset=11)
    check_import(model, "GatherElements constant indices", batches=(3,))


def test_gather_elements_of_a_constant_table() -> None:
    """The position-id lookup of transformers' BERT export: a constant [1, 64] table, run-time indices."""
    table = const("table", np.arange(64, dtype=np.int64)[None] * 3)
    node = helper.make_node("GatherElements", ["table", "i"], ["y0"], axis=1)
    model = make_model([node], [info("i", [1, "N"], INT64)], [info("y0", None, INT64)], [table], opset=13)
    check_import(model, "GatherElements of a table")


@pytest.mark.parametrize(
    "data_shape, index_shape",
    [(["N", 6, 5], ["N", 3, 1]), (["N", 6, 5], [4, 2]), ([7, 6, 5], ["N", 2, 4, 3])],
    ids=["rows", "pairs", "points"],
)
def test_gather_nd(data_shape: list, index_shape: list) -> None:
    """The last index dim picks that many leading data dims; indices in [-2, 1] are valid for the batch
    dim at both batch sizes."""
    node = helper.make_node("GatherND", ["x0", "i"], ["y0"])
    model = make_model([node], [info("x0", data_shape), info("i", index_shape, INT64)], [info("y0", None)], opset=13)
    check_with_indices_in(model, -2, 1, "GatherND")


def test_gather_nd_with_batch_dims_is_refused() -> None:
    node = helper.make_node("GatherND", ["x0", "i"], ["y0"], name="gnd", batch_dims=1)
    model = make_model([node], [info("x0", ["N", 6, 5]), info("i", ["N", 2, 1], INT64)], [info("y0", None)], opset=13)
    with pytest.raises(NotImplementedError, match=r"'gnd' \(ai.onnx::GatherND, opset 13\): batch_dims=1"):
        import_onnx(model)


SCATTER_INDICES = {
    "rows": np.array([[4], [0], [-2]]),  # [3, 1]: whole [6, 5] slices of three rows, one counted from the end
    "elements": np.array([[[0, 1, 2], [6, 5, 4]], [[-1, 0, 0], [3, -6, 1]]]),  # [2, 2, 3]: single elements
}


@pytest.mark.parametrize("kind", SCATTER_INDICES)
def test_scatter_nd_writes_into_a_copy(kind: str) -> None:
    """Unique constant indices (repeated ones leave the result undefined without a reduction) over a [7, 6, 5]
    run-time tensor: the updates land where onnxruntime puts them, the rest is the data."""
    indices = SCATTER_INDICES[kind]
    updates = list(indices.shape[:-1]) + [6, 5][indices.shape[-1] - 1 :]
    node = helper.make_node("ScatterND", ["x0", "i", "x1"], ["y0"])
    inputs = [info("x0", [7, 6, 5]), info("x1", updates)]
    model = make_model([node], inputs, [info("y0", None)], [const("i", indices)], opset=13)
    module = check_import(model, f"ScatterND {kind}", batches=(1,))
    assert torch.index_put in call_targets(module)
    assert_survives_pickling(module, random_feeds(model, 1))


@pytest.mark.parametrize("reduction, opset", [("add", 16), ("mul", 16), ("max", 18), ("min", 18)])
@pytest.mark.parametrize("kind", ["rows", "elements", "one"])
def test_scatter_nd_reduces_repeated_indices(reduction: str, opset: int, kind: str, tmp_path: Path) -> None:
    """Each update combined with what is there, repeated and negative indices included (row 1 is written three
    times, once as -6), whole rows, single elements and one lone index tuple; as onnxruntime, and so is the
    module exported back to ONNX (torch.onnx's export of index_put with accumulate kept one of repeated adds)."""
    indices = {
        "rows": np.array([[1], [4], [-6], [1], [0]]),  # [5, 1] into [7, 6, 5]
        "elements": np.array([[[1, 2, 3], [1, 2, 3]], [[-6, 2, -2], [6, 0, 4]]]),  # [2, 2, 3]
        "one": np.array([2, -1]),  # [2]: one [5] row
    }[kind]
    updates = list(indices.shape[:-1]) + [6, 5][indices.shape[-1] - 1 :]
    node = helper.make_node("ScatterND", ["x0", "i", "x1"], ["y0"], reduction=reduction)
    inputs = [info("x0", [7, 6, 5]), info("x1", updates)]
    model = make_model([node], inputs, [info("y0", None)], [const("i", indices)], opset=opset)
    module = check_import(model, f"ScatterND {reduction} {kind}", batches=(1,))
    assert torch.scatter_reduce in call_targets(module)
    feeds = random_feeds(model, 1)
    assert_survives_pickling(module, feeds)
    path = export_onnx(module, tuple(torch.from_numpy(v) for v in feeds.values()), tmp_path / "scatter.onnx")
    exported = dict(zip([f"input_{i}" for i in range(len(feeds))], feeds.values(), strict=True))  # its names
    assert_outputs_match(run_module(module, feeds), run_ort(str(path), exported), f"ScatterND {reduction} {kind} back")


def test_scatter_nd_with_an_unknown_reduction_is_refused() -> None:
    node = helper.make_node("ScatterND", ["x0", "i", "x1"], ["y0"], name="snd", reduction="median")
    model = make_model(
        [node], [info("x0", [7, 6, 5]), info("x1", [2, 6, 5])], [info("y0", None)], [const("i", [[1], [3]])], opset=18
    )
    with pytest.raises(NotImplementedError, match=r"'snd' \(ai.onnx::ScatterND, opset 18\): reduction='median'"):
        import_onnx(model)


def test_shape_gather_as_output() -> None:
    """Shape -> Gather -> output: a run-time shape vector leaves the graph as an int64 tensor."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "idx"], ["y"], axis=0),
    ]
    model = make_model(nodes, [info("x", SHAPE)], [info("y", None, INT64)], [const("idx", [3, 0])], opset=13)
    check_import(model, "Shape/Gather output")


# -- Reshape and the shape arithmetic torch exports ------------------------------------------------


def test_reshape_to_batch_minus_one() -> None:
    """``x.view(x.size(0), -1)`` as torch exports it: Shape, Gather, Unsqueeze, Concat, Reshape."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
        helper.make_node("Unsqueeze", ["b", "axes0"], ["b1"]),
        helper.make_node("Concat", ["b1", "minus1"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    inits = [const("zero", np.int64(0)), const("axes0", [0]), const("minus1", [-1])]
    model = make_model(nodes, [info("x", SHAPE)], [info("y", ["N", 210])], inits, opset=13)
    module = check_import(model, "view(size(0), -1)")
    assert torch.reshape in call_targets(module)
    assert "size" in call_targets(module), "the batch size must be read at run time"


def test_torch_expand_pattern() -> None:
    """``cls.expand(x.size(0), -1, -1)`` as torch exports it, with ConstantOfShape, Mul, Equal, Where."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
        helper.make_node("Unsqueeze", ["b", "axes0"], ["b1"]),
        helper.make_node("Concat", ["b1", "minus1", "minus1"], ["sizes"], axis=0),
        helper.make_node("Shape", ["sizes"], ["len"]),
        helper.make_node("ConstantOfShape", ["len"], ["ones"], value=helper.make_tensor("v", INT64, [1], [1])),
        helper.make_node("Mul", ["ones", "neg"], ["neg_ones"]),
        helper.make_node("Equal", ["sizes", "neg_ones"], ["is_neg"]),
        helper.make_node("Where", ["is_neg", "ones", "sizes"], ["target"]),
        helper.make_node("Expand", ["cls", "target"], ["tok"]),
        helper.make_node("Concat", ["tok", "x"], ["y"], axis=1),
    ]
    inits = [
        const("zero", np.int64(0)),
        const("axes0", [0]),
        const("minus1", [-1]),
        const("neg", np.int64(-1)),
        const("cls", np.random.default_rng(1).standard_normal((1, 1, 7)).astype(np.float32)),
    ]
    model = make_model(nodes, [info("x", ["N", 5, 7])], [info("y", None)], inits, opset=13)
    module = check_import(model, "expand(b, -1, -1)")
    targets = call_targets(module)
    assert "expand" in targets and torch.where not in targets, "the shape arithmetic should fold away"


@pytest.mark.parametrize(
    "shape, opset, allowzero",
    [([0, 35, 6], 13, 0), ([-1, 7], 13, 0), ([0, -1, 5, 7], 14, 0), ([-1, 6, 35], 14, 1), ([0, 3, 2, -1], 19, 0)],
)
def test_reshape_constant(shape: list, opset: int, allowzero: int) -> None:
    """0 copies the input's size there (here the batch), unless allowzero=1."""
    attrs = {"allowzero": allowzero} if opset >= 14 else {}
    model = single_op("Reshape", [SHAPE], opset=opset, initializers=[const("s", shape)], extra_inputs=["s"], **attrs)
    check_import(model, f"Reshape {shape}")


@pytest.mark.parametrize("axis", [0, 1, 2, 4, -1, -3])
def test_flatten(axis: int) -> None:
    check_import(single_op("Flatten", [SHAPE], opset=13, axis=axis), f"Flatten axis {axis}")


@pytest.mark.parametrize("perm", [[0, 2, 3, 1], [3, 1, 0, 2], None])
def test_transpose(perm: list | None) -> None:
    attrs = {"perm": perm} if perm is not None else {}
    check_import(single_op("Transpose", [SHAPE], opset=13, **attrs), f"Transpose {perm}")


# -- Concat, Split, Slice --------------------------------------------------------------------------


@pytest.mark.parametrize("axis", [1, -1, 3])
def test_concat_with_constant(axis: int) -> None:
    other = [1, 6, 5, 2] if axis in (-1, 3) else [1, 2, 5, 7]
    nodes = [
        helper.make_node("Expand", ["c", "shape_like"], ["cb"]),
        helper.make_node("Concat", ["x", "x", "cb"], ["y"], axis=axis),
    ]
    c = const("c", np.random.default_rng(2).standard_normal(other).astype(np.float32))
    model = make_model(
        [
            helper.make_node("Shape", ["x"], ["xs"]),
            helper.make_node("Slice", ["xs", "z", "one"], ["b"]),
            helper.make_node("Concat", ["b", "rest"], ["shape_like"], axis=0),
            *nodes,
        ],
        [info("x", SHAPE)],
        [info("y", None)],
        [c, const("z", [0]), const("one", [1]), const("rest", other[1:])],
        opset=13,
    )
    check_import(model, f"Concat axis {axis}")


SPLIT_CASES = {
    "attr-sizes": dict(opset=11, attrs={"split": [1, 2, 3], "axis": 1}, sizes=None, outputs=3),
    "attr-equal": dict(opset=11, attrs={"axis": 1}, sizes=None, outputs=3),
    "input-sizes": dict(opset=13, attrs={"axis": -1}, sizes=[2, 4, 1], outputs=3),
    "input-equal": dict(opset=13, attrs={"axis": 1}, sizes=None, outputs=2),
    "num-outputs-uneven": dict(opset=18, attrs={"axis": -1, "num_outputs": 3}, sizes=None, outputs=3),
    "num-outputs-even": dict(opset=18, attrs={"axis": 1, "num_outputs": 2}, sizes=None, outputs=2),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_split(case: str) -> None:
    spec = SPLIT_CASES[case]
    inits = [const("split", spec["sizes"])] if spec["sizes"] else []
    model = single_op(
        "Split",
        [SHAPE],
        opset=spec["opset"],
        initializers=inits,
        extra_inputs=["split"] if inits else [],
        outputs=spec["outputs"],
        **spec["attrs"],
    )
    check_import(model, f"Split {case}")


SLICE_CASES = {
    "basic": ([1], [4], [1], None),
    "two-axes": ([1, 0], [-1, 3], [3, 1], None),
    "steps": ([0, 1], [7, 6], [3, 1], [2, 3]),
    "clamped": ([-100], [100], [2], None),
    "to-end": ([2], [2**63 - 1], [-1], None),
    "reverse": ([-1], [-(2**63)], [1], [-1]),
    "reverse-step2": ([4], [0], [3], [-2]),
    "reverse-clamped": ([100], [-100], [-1], [-3]),
    "reverse-start-below-size": ([-100, -9], [-200, 0], [1, 0], [-1, -1]),
    "negative-axes": ([1, 0], [3, 2], [-1, -2], None),
}


@pytest.mark.parametrize("opset", [10, 13])
@pytest.mark.parametrize("case", list(SLICE_CASES))
def test_slice(case: str, opset: int) -> None:
    starts, ends, axes, steps = SLICE_CASES[case]
    inits = [const("starts", starts), const("ends", ends), const("axes", axes)]
    extra = ["starts", "ends", "axes"]
    if steps is not None:
        inits.append(const("steps", steps))
        extra.append("steps")
    model = single_op("Slice", [SHAPE], opset=opset, initializers=inits, extra_inputs=extra)
    check_import(model, f"Slice {case}")


def test_slice_of_a_shape_vector() -> None:
    """Slices of Shape(x) run at import time on the size entries, clamping like ONNX."""
    nodes, inits, outputs = [helper.make_node("Shape", ["x"], ["s"])], [], []
    for k, (start, end, step) in enumerate([(1, 3, 1), (-1, -100, -1), (-100, -200, -1), (100, 0, -2), (0, 9, 2)]):
        inits += [const(f"b{k}", [start]), const(f"e{k}", [end]), const(f"a{k}", [0]), const(f"t{k}", [step])]
        nodes.append(helper.make_node("Slice", ["s", f"b{k}", f"e{k}", f"a{k}", f"t{k}"], [f"y{k}"]))
        outputs.append(info(f"y{k}", None, INT64))
    check_import(make_model(nodes, [info("x", SHAPE)], outputs, inits, opset=13), "Slice of Shape")


def test_slice_with_run_time_end() -> None:
    """x[:, :, :h - 1] with h read from the shape: the end is a run-time size."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "two"], ["h"], axis=0),
        helper.make_node("Sub", ["h", "one"], ["h1"]),
        helper.make_node("Unsqueeze", ["h1", "axes0"], ["end"]),
        helper.make_node("Slice", ["x", "zero", "end", "axes2"], ["y"]),
    ]
    inits = [
        const("two", np.int64(2)),
        const("one", np.int64(1)),
        const("axes0", [0]),
        const("zero", [0]),
        const("axes2", [2]),
    ]
    check_import(make_model(nodes, [info("x", SHAPE)], [info("y", None)], inits, opset=13), "Slice run-time end")


# -- Squeeze, Unsqueeze, Expand --------------------------------------------------------------------


@pytest.mark.parametrize("opset", [11, 13, 21])
@pytest.mark.parametrize("axes", [[1], [-1, 1], None])
def test_squeeze(axes: list | None, opset: int) -> None:
    shape = ["N", 1, 5, 1]
    out = {1: ["N", 5, 1], 2: ["N", 5]}[len(axes)] if axes else ["N", 5]
    if opset < 13:
        attrs = {"axes": axes} if axes else {}
        model = single_op("Squeeze", [shape], opset=opset, output_shape=out, **attrs)
    else:
        inits = [const("axes", axes)] if axes else []
        extra = ["axes"] if axes else []
        model = single_op("Squeeze", [shape], opset=opset, initializers=inits, extra_inputs=extra, output_shape=out)
    check_import(model, f"Squeeze {axes} opset {opset}")


@pytest.mark.parametrize("opset", [11, 13, 21])
@pytest.mark.parametrize("axes", [[1], [0, 4], [-1], [-1, 1]])
def test_unsqueeze(axes: list, opset: int) -> None:
    shape = ["N", 5, 3]
    if opset < 13:
        model = single_op("Unsqueeze", [shape], opset=opset, axes=axes)
    else:
        model = single_op("Unsqueeze", [shape], opset=opset, initializers=[const("axes", axes)], extra_inputs=["axes"])
    check_import(model, f"Unsqueeze {axes} opset {opset}")


@pytest.mark.parametrize(
    "x_shape, target",
    [(["N", 1, 5], [1, 7, 1]), (["N", 1, 5], [3, 1, 7, 5]), ([1, 5], [4, 1]), (["N", 3, 1, 5], [2, 1])],
    ids=["keep-batch", "new-leading", "broadcast-batchless", "short-shape"],
)
def test_expand_constant_shape(x_shape: list, target: list) -> None:
    if "N" not in x_shape:
        node = helper.make_node("Expand", ["c", "t"], ["e"])
        add = helper.make_node("Add", ["e", "x"], ["y"])
        c = const("c", np.random.default_rng(3).standard_normal(x_shape).astype(np.float32))
        model = make_model([node, add], [info("x", ["N", 4, 5])], [info("y", None)], [c, const("t", target)], 13)
    else:
        model = single_op("Expand", [x_shape], opset=13, initializers=[const("t", target)], extra_inputs=["t"])
    check_import(model, f"Expand {x_shape} to {target}")


# -- Constant, ConstantOfShape, Range, Cast on shapes ----------------------------------------------


@pytest.mark.parametrize(
    "attrs",
    [
        {"value": helper.make_tensor("v", TensorProto.FLOAT, [7], np.linspace(-1, 1, 7))},
        {"value_float": 0.625},
        {"value_floats": [0.5, -1.5, 2.0, 0.25, 1.0, 3.0, -2.0]},
    ],
    ids=["tensor", "float", "floats"],
)
def test_constant(attrs: dict) -> None:
    nodes = [helper.make_node("Constant", [], ["c"], **attrs), helper.make_node("Mul", ["x", "c"], ["y"])]
    check_import(make_model(nodes, [info("x", SHAPE)], [info("y", None)], opset=13), f"Constant {list(attrs)}")


@pytest.mark.parametrize("opset", [13, 20, 21])
def test_constant_of_shape_from_run_time_shape(opset: int) -> None:
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("ConstantOfShape", ["s"], ["c"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.5])),
        helper.make_node("Sub", ["x", "c"], ["y"]),
        helper.make_node("Constant", [], ["ints"], value_ints=[2, 3]),
        helper.make_node("ConstantOfShape", ["ints"], ["y1"], value=helper.make_tensor("w", INT64, [1], [7])),
    ]
    outputs = [info("y", None), info("y1", None, INT64)]
    check_import(make_model(nodes, [info("x", SHAPE)], outputs, opset=opset), "ConstantOfShape")


def test_range_from_run_time_size() -> None:
    """arange(batch) and arange(0.5, width, 1.5) with sizes read at run time (detector anchor grids)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
        helper.make_node("Range", ["zero", "b", "one"], ["y0"]),
        helper.make_node("Gather", ["s", "three"], ["w"], axis=0),
        helper.make_node("Cast", ["w"], ["wf"], to=TensorProto.FLOAT),
        helper.make_node("Range", ["half", "wf", "step"], ["y1"]),
    ]
    inits = [
        const("zero", np.int64(0)),
        const("one", np.int64(1)),
        const("three", np.int64(3)),
        const("half", np.float32(0.5)),
        const("step", np.float32(1.5)),
    ]
    outputs = [info("y0", None, INT64), info("y1", None)]
    module = check_import(make_model(nodes, [info("x", SHAPE)], outputs, inits, opset=13), "Range")
    assert torch.arange in call_targets(module)


def range_float16(**attrs: int) -> onnx.ModelProto:
    half = TensorProto.FLOAT16
    node = helper.make_node("Range", ["s", "l", "d"], ["y"], name="range", **attrs)
    return make_model([node], [info(n, [], half) for n in "sld"], [info("y", None, half)], opset=27)


def test_range_float16_opset27() -> None:
    """Version 27 adds float16 bounds, counted in float32 (stash_type=1, the default): over 1000..1100 in
    steps of 0.7, where float16 steps are 0.5 apart, every entry must equal onnxruntime's."""
    model = range_float16()
    feeds = {"s": np.array(1000.0, np.float16), "l": np.array(1100.0, np.float16), "d": np.array(0.7, np.float16)}
    (expected,) = run_ort(model, feeds)
    (got,) = run_module(import_onnx(model), feeds)
    assert got.dtype == torch.float16 and got.shape == expected.shape
    assert np.array_equal(got.numpy(), expected)


def test_range_accumulating_in_float16_is_refused() -> None:
    with pytest.raises(NotImplementedError, match=r"'range' \(ai.onnx::Range, opset 27\): stash_type=10"):
        import_onnx(range_float16(stash_type=TensorProto.FLOAT16))


def test_shape_arithmetic_div_mul_cast() -> None:
    """Reshape to (b, c // 2, 2 * h, w): integer Div and Mul on run-time sizes."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Div", ["s", "div"], ["d"]),
        helper.make_node("Mul", ["d", "mul"], ["m"]),
        helper.make_node("Cast", ["m"], ["shape"], to=INT64),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    inits = [const("div", [1, 2, 1, 1]), const("mul", [1, 1, 2, 1])]
    model = make_model(nodes, [info("x", SHAPE)], [info("y", ["N", 3, 10, 7])], inits, opset=13)
    check_import(model, "shape arithmetic")


def test_tensors_made_at_run_time_follow_the_input_device() -> None:
    """arange, full and shape vectors made at run time land on the inputs' device, so the module works
    after ``.to(device)`` (meta stands in for CUDA: mixing it with a CPU tensor fails the same way)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
        helper.make_node("Range", ["zero", "b", "one"], ["y0"]),
        helper.make_node("ConstantOfShape", ["s"], ["c"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.5])),
        helper.make_node("Sub", ["x", "c"], ["y1"]),
        helper.make_node("Gather", ["s", "idx"], ["y2"], axis=0),
    ]
    inits = [const("zero", np.int64(0)), const("one", np.int64(1)), const("idx", [3, 0])]
    outputs = [info("y0", None, INT64), info("y1", None), info("y2", None, INT64)]
    module = check_import(make_model(nodes, [info("x", SHAPE)], outputs, inits, opset=13), "run-time tensors")
    outs = module.to("meta")(torch.empty(4, 6, 5, 7, device="meta"))
    assert [o.device.type for o in outs] == ["meta"] * 3
    assert [tuple(o.shape) for o in outs] == [(4,), (4, 6, 5, 7), (2,)]


def test_run_time_sizes_over_unknown_dims_pickle() -> None:
    """Expand by run-time sizes over dims shape inference cannot size, and a reversing Slice of such a
    dim, need max/min of sizes at run time: as operator nodes, so the module re-traces (torch.save)."""
    nodes = [
        helper.make_node("Shape", ["y"], ["ys"]),
        helper.make_node("Slice", ["ys", "zero", "two"], ["lead"]),
        helper.make_node("Concat", ["lead", "one"], ["target"], axis=0),
        helper.make_node("Expand", ["x", "target"], ["e"]),
        helper.make_node("Slice", ["e", "minus2", "lowest", "axes2", "minus1"], ["out"]),
    ]
    inits = [
        const("zero", [0]),
        const("two", [2]),
        const("one", [1]),
        const("minus2", [-2]),
        const("lowest", [-(2**63)]),
        const("axes2", [2]),
        const("minus1", [-1]),
    ]
    inputs = [info("x", ["N", 1, "M"]), info("y", ["N", 4, "M"])]
    model = make_model(nodes, inputs, [info("out", ["N", 4, None])], inits, opset=13)
    module = check_import(model, "Expand/Slice over unknown dims")
    assert_survives_pickling(module, random_feeds(model, 3))


def test_constant_sliced_by_a_run_time_size_pickles() -> None:
    """pos_embedding[:, :x.size(1)] + x: a buffer indexed by a run-time size survives torch.save/load."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Slice", ["s", "one", "two"], ["t"]),
        helper.make_node("Slice", ["pos", "zero", "t", "one"], ["p"]),
        helper.make_node("Add", ["x", "p"], ["y"]),
    ]
    pos = np.random.default_rng(4).standard_normal((1, 11, 5)).astype(np.float32)
    inits = [const("pos", pos), const("zero", [0]), const("one", [1]), const("two", [2])]
    model = make_model(nodes, [info("x", ["N", "M", 5])], [info("y", None)], inits, opset=13)
    module = check_import(model, "buffer sliced at run time")
    assert_survives_pickling(module, random_feeds(model, 3))


# -- sizes the file fixes fold at import time ---------------------------------------------------------


def anchor_grid_model(dims: list) -> onnx.ModelProto:
    """A detector's anchor grid from a feature map's size (Shape -> Gather -> Range -> Expand), scaled by
    the batch-dynamic input: what shape arithmetic on fixed dims looks like in a YOLO head."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "three"], ["w"], axis=0),
        helper.make_node("Cast", ["w"], ["wf"], to=TensorProto.FLOAT),
        helper.make_node("Range", ["zero", "wf", "one"], ["r"]),
        helper.make_node("Add", ["r", "half"], ["centres"]),
        helper.make_node("Expand", ["centres", "s"], ["grid"]),
        helper.make_node("Mul", ["x", "grid"], ["y"]),
    ]
    inits = [
        const("three", np.int64(3)),
        const("zero", np.float32(0.0)),
        const("one", np.float32(1.0)),
        const("half", np.float32(0.5)),
    ]
    return make_model(nodes, [info("x", dims)], [info("y", None)], inits, opset=13)


def input_size_reads(module: torch.fx.GraphModule) -> list[int]:
    """The dims of graph inputs read at run time, sorted."""
    reads = [n for n in module.graph.nodes if n.op == "call_method" and n.target == "size"]
    return sorted(n.args[1] for n in reads if n.args[0].op == "placeholder")


def test_shape_arithmetic_on_fixed_dims_folds() -> None:
    """Width 7 is fixed by the file: the grid is a constant made at import time, no arange runs and only
    the batch is read at run time (the Expand to the input's shape needs it)."""
    module = check_import(anchor_grid_model(["N", 6, 5, 7]), "fixed-size anchor grid")
    assert torch.arange not in call_targets(module)
    assert input_size_reads(module) == [0]


def test_shape_arithmetic_on_symbolic_dims_stays_at_run_time() -> None:
    model = anchor_grid_model(["N", 6, 5, "W"])
    module = check_import(model, "dynamic-width anchor grid")
    assert torch.arange in call_targets(module)
    assert input_size_reads(module) == [0, 3]


def test_a_file_fixed_at_batch_1_still_runs_at_any_batch() -> None:
    """Dim 0 is read at run time even where the file fixes it: batch 1 matches onnxruntime, batch 3 (which
    onnxruntime refuses for this file) gives the same rows as three batch-1 runs."""
    model = anchor_grid_model([1, 6, 5, 7])
    module = import_onnx(model)
    x = np.random.default_rng(0).standard_normal((3, 6, 5, 7)).astype(np.float32)
    rows = [run_ort(model, {"x": x[i : i + 1]})[0] for i in range(3)]
    (got,) = run_module(module, {"x": x})
    assert_outputs_match([got], [np.concatenate(rows)], "batch 3 of a batch-1 file")


def test_a_reshape_target_answers_later_size_reads() -> None:
    """Expand of a reshaped tensor to sizes read from the reshape's input: the reshape's own dims are
    those sizes, so no max(a, b) arithmetic (abs, floordiv) is emitted for a == b."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "dims"], ["nh"], axis=0),
        helper.make_node("Concat", ["nh", "last"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["r"]),
        helper.make_node("Expand", ["r", "target"], ["y"]),
    ]
    inits = [const("dims", [0, 2]), const("last", [42])]
    model = make_model(nodes, [info("x", ["N", 6, "H", 7])], [info("y", ["N", "H", 42])], inits, opset=13)
    # ONNX's inference gives up on a reshape to run-time sizes; exporters write its type, as here.
    model.graph.value_info.append(info("r", ["N", "H", 42]))
    module = check_import(model, "Expand of a reshape")
    assert operator.abs not in call_targets(module)
    assert input_size_reads(module) == [0, 2]


# -- sizes the importer works out itself ----------------------------------------------------------------


class SamePaddedConv(torch.nn.Module):
    """timm's Conv2dSame: TensorFlow's "same" padding from the input's size. Under torch.onnx's TorchScript
    exporter the sizes are tensors, so the file computes the pads with Div, Ceil and Clip on floats, which ONNX
    shape inference does not evaluate: past the first such conv it knows no spatial size."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(c_in, c_out, 3, stride, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pads = []
        for size in x.size()[-2:]:
            s = self.conv.stride[0]
            if isinstance(size, torch.Tensor):
                pads.append(torch.clamp(((size / s).ceil() - 1) * s + 3 - size, min=0).to(torch.int64))
            else:
                pads.append(max((-(-size // s) - 1) * s + 3 - size, 0))
        pad_h, pad_w = pads
        x = torch.nn.functional.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))
        return torch.relu(self.conv(x))


def test_sizes_past_pads_onnx_inference_cannot_follow_are_worked_out(tmp_path: Path) -> None:
    model = torch.nn.Sequential(SamePaddedConv(3, 5, 2), SamePaddedConv(5, 7, 2), SamePaddedConv(7, 4, 1)).eval()
    x = torch.randn(2, 3, 21, 19)
    path = tmp_path / "same.onnx"
    torch.onnx.export(model, (x,), str(path), input_names=["x"], dynamic_axes={"x": {0: "N"}}, opset_version=17,
                      dynamo=False, do_constant_folding=False)  # fmt: skip
    inferred = onnx.shape_inference.infer_shapes(onnx.load(path), data_prop=True)
    known = {v.name: v.type.tensor_type.shape for v in inferred.graph.value_info}
    convs = [n.output[0] for n in inferred.graph.node if n.op_type == "Conv"]
    assert not known[convs[1]].dim[2].HasField("dim_value")  # what ONNX's own inference leaves unknown
    module = import_onnx(path)
    assert torch.nn.functional.pad in call_targets(module)  # the pads: constants, in the graph as such
    for batch in (2, 5):
        feeds = {"x": np.random.default_rng(batch).standard_normal((batch, 3, 21, 19)).astype(np.float32)}
        assert_outputs_match(run_module(module, feeds), run_ort(onnx.load(path), feeds), f"batch {batch}")
    pads = [n for n in module.graph.nodes if n.target is torch.nn.functional.pad]
    assert all(isinstance(p, int) for n in pads for p in n.args[1]), [n.args for n in pads]
