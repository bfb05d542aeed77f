"""Bad input gets a clear error naming the file (or node) and the problem, and the registry refuses a
second converter for an opset range already covered."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx_testing import const, info, make_model, single_op

from fuser.onnx import importer
from fuser.onnx.errors import OnnxModelError
from fuser.onnx.importer import import_onnx
from fuser.onnx.registry import REGISTRY, ConverterRegistry, DuplicateConverterError


def matmul_model() -> onnx.ModelProto:
    w = np.random.default_rng(0).standard_normal((19, 13)).astype(np.float32)
    return single_op("MatMul", [["N", 19]], opset=17, initializers=[const("w", w)], extra_inputs=["w"])


# -- files ------------------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.onnx"
    with pytest.raises(FileNotFoundError, match=f"ONNX model file not found: {path}"):
        import_onnx(path)


def test_not_onnx(tmp_path: Path) -> None:
    path = tmp_path / "notes.onnx"
    path.write_text("these are my notes, not a model\n" * 10)
    with pytest.raises(OnnxModelError, match=rf"{path}: not a valid ONNX model.*truncated or not ONNX"):
        import_onnx(str(path))


def test_truncated_protobuf(tmp_path: Path) -> None:
    data = matmul_model().SerializeToString()
    path = tmp_path / "truncated.onnx"
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(OnnxModelError, match=rf"{path}: not a valid ONNX model.*truncated"):
        import_onnx(path)


def test_empty_protobuf(tmp_path: Path) -> None:
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    with pytest.raises(OnnxModelError, match=rf"{path}: not an ONNX model"):
        import_onnx(path)


def test_checker_failure(tmp_path: Path) -> None:
    """A node reading a value nothing produces: onnx.checker's message is passed on with the file."""
    model = matmul_model()
    model.graph.node[0].input[1] = "nowhere"
    path = tmp_path / "broken.onnx"
    onnx.save(model, path)
    with pytest.raises(OnnxModelError, match=rf"{path}: onnx.checker rejects the model:.*nowhere"):
        import_onnx(path)


def test_checker_failure_of_a_model_proto() -> None:
    model = matmul_model()
    model.graph.node[0].input[1] = "nowhere"
    with pytest.raises(OnnxModelError, match=r"<ModelProto>: onnx.checker rejects the model"):
        import_onnx(model)


def save_with_external_data(tmp_path: Path) -> Path:
    path = tmp_path / "model.onnx"
    onnx.save(matmul_model(), path, save_as_external_data=True, location="model.weights", size_threshold=0)
    return path


def test_external_data_is_loaded(tmp_path: Path) -> None:
    path = save_with_external_data(tmp_path)
    module = import_onnx(path)
    w = onnx.numpy_helper.to_array(matmul_model().graph.initializer[0])
    (weight,) = [b for name, b in module.named_buffers()]
    assert np.array_equal(weight.numpy(), w)


def test_missing_external_data(tmp_path: Path) -> None:
    path = save_with_external_data(tmp_path)
    os.remove(tmp_path / "model.weights")
    with pytest.raises(FileNotFoundError, match=rf"{path}: external data file 'model.weights' of initializer 'w'"):
        import_onnx(path)


def test_truncated_external_data(tmp_path: Path) -> None:
    path = save_with_external_data(tmp_path)
    weights = tmp_path / "model.weights"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(OnnxModelError, match=rf"{path}: external data file .*model.weights is truncated"):
        import_onnx(path)


def test_model_proto_with_unloaded_external_data(tmp_path: Path) -> None:
    path = save_with_external_data(tmp_path)
    model = onnx.load(path, load_external_data=False)
    with pytest.raises(OnnxModelError, match=r"initializer 'w' is stored as external data that was not loaded"):
        import_onnx(model)


def test_wrong_argument_type() -> None:
    with pytest.raises(TypeError, match=r"expected a path or an onnx\.ModelProto, got bytes"):
        import_onnx(b"model")


# -- ops without converters -------------------------------------------------------------------------


def test_unknown_op_is_named_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """The unknown op comes last; shape inference and the graph build must not have started."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="first"), helper.make_node("Cos", ["r"], ["y"], name="cosine")]
    model = make_model(nodes, [info("x", ["N", 3])], [info("y", ["N", 3])], opset=17)

    def no_work(*args: object, **kwargs: object) -> None:
        raise AssertionError("work started before the converter check")

    monkeypatch.setattr(importer, "_infer_shapes", no_work)
    monkeypatch.setattr(importer, "_build", no_work)
    with pytest.raises(
        NotImplementedError, match=r"no converter for op 'Cos' of domain 'ai.onnx' at opset 17 \(node 'cosine'\)"
    ):
        import_onnx(model)


def test_all_unknown_ops_are_listed_with_their_domain() -> None:
    nodes = [
        helper.make_node("Cos", ["x"], ["a"], name="c1"),
        helper.make_node("Cos", ["a"], ["b"], name="c2"),
        helper.make_node("FusedThing", ["b"], ["y"], name="custom", domain="com.example"),
    ]
    graph = helper.make_graph(nodes, "g", [info("x", ["N", 3])], [info("y", ["N", 3])])
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 2)], ir_version=8
    )
    with pytest.raises(NotImplementedError) as err:
        import_onnx(model)
    assert "op 'Cos' of domain 'ai.onnx' at opset 17 (node 'c1', 'c2')" in str(err.value)
    assert "op 'FusedThing' of domain 'com.example' at opset 2 (node 'custom')" in str(err.value)


def test_op_outside_its_converter_opsets() -> None:
    """Gelu exists from opset 20; a model at opset 19 that uses it gets the covered ranges listed."""
    with pytest.raises(
        NotImplementedError, match=r"'Gelu'.*opset 19.*converters exist for ai.onnx::Gelu opsets 20..21"
    ):
        REGISTRY.lookup("", "Gelu", 19, "g")


def test_unsupported_attribute_names_the_node() -> None:
    model = single_op("MaxPool", [["N", 3, 9, 9]], opset=13, kernel_shape=[2, 2], storage_order=1)
    with pytest.raises(
        NotImplementedError, match=r"ONNX node 'MaxPool_0' \(ai.onnx::MaxPool, opset 13\): storage_order=1"
    ):
        import_onnx(model)


def test_unsupported_second_output_names_the_node() -> None:
    node = helper.make_node("MaxPool", ["x"], ["y0", "y1"], name="MaxPool_0", kernel_shape=[2, 2])
    outputs = [info("y0", ["N", 3, 8, 8]), info("y1", ["N", 3, 8, 8], onnx.TensorProto.INT64)]
    model = make_model([node], [info("x", ["N", 3, 9, 9])], outputs, opset=13)
    with pytest.raises(NotImplementedError, match=r"'MaxPool_0'.*using output 1 \('y1'\) is not supported"):
        import_onnx(model)


# -- the registry ------------------------------------------------------------------------------------


def test_registry_refuses_overlapping_ranges() -> None:
    registry = ConverterRegistry()
    registry.converter("Relu", opsets=(6, 13))(lambda ctx: None)
    registry.converter("Relu", opsets=(14, 21))(lambda ctx: None)
    with pytest.raises(DuplicateConverterError, match=r"ai.onnx::Relu opsets 13..14 overlaps .* opsets 6..13"):
        registry.converter("Relu", opsets=(13, 14))(lambda ctx: None)
    registry.converter("Relu", opsets=(13, 14), domain="com.example")(lambda ctx: None)


def test_registry_refuses_a_second_converter_for_a_builtin_op() -> None:
    with pytest.raises(DuplicateConverterError, match=r"ai.onnx::Conv opsets 11..11 overlaps"):
        REGISTRY.converter("Conv", opsets=(11, 11), domain="ai.onnx")(lambda ctx: None)


def test_registry_refuses_a_bad_range() -> None:
    with pytest.raises(ValueError, match=r"opsets must be \(first, last\)"):
        ConverterRegistry().converter("Relu", opsets=(14, 13))


def test_registry_picks_the_range_of_the_model_opset() -> None:
    split_attribute = REGISTRY.find("", "Split", 12)
    split_input = REGISTRY.find("ai.onnx", "Split", 13)
    assert split_attribute is not None and split_attribute.fn.__name__ == "split_attribute"
    assert split_input is not None and split_input.fn.__name__ == "split_input"
    assert REGISTRY.find("", "Split", 22) is None


def test_every_op_of_the_issue_is_covered_from_13_to_21() -> None:
    ops = [
        "Conv",
        "BatchNormalization",
        "Relu",
        "Sigmoid",
        "Mul",
        "Add",
        "Sub",
        "Div",
        "Clip",
        "LeakyRelu",
        "HardSigmoid",
        "Tanh",
        "Erf",
        "MatMul",
        "Gemm",
        "Concat",
        "Split",
        "Slice",
        "Reshape",
        "Flatten",
        "Transpose",
        "Squeeze",
        "Unsqueeze",
        "Resize",
        "MaxPool",
        "AveragePool",
        "GlobalAveragePool",
        "Softmax",
        "ReduceMean",
        "Pow",
        "Sqrt",
        "Shape",
        "Gather",
        "Cast",
        "Constant",
        "ConstantOfShape",
        "Range",
        "Expand",
        "Identity",
        "Where",
        "Equal",
        "Pad",
    ]
    missing = [(op, opset) for op in ops for opset in range(13, 22) if REGISTRY.find("", op, opset) is None]
    assert not missing
    # These ops enter ONNX after opset 13.
    assert [REGISTRY.find("", "HardSwish", o) is not None for o in (13, 14, 21)] == [False, True, True]
    assert [REGISTRY.find("", "LayerNormalization", o) is not None for o in (16, 17, 21)] == [False, True, True]
    assert [REGISTRY.find("", "Gelu", o) is not None for o in (19, 20, 21)] == [False, True, True]
