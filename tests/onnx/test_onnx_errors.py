"""Bad input gets a clear error naming the file (or node) and the problem, and the registry refuses a
second converter for an opset range already covered."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx_testing import check_import, const, info, make_model, single_op

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
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="first"),
        helper.make_node("Acos", ["r"], ["y"], name="arccosine"),
    ]
    model = make_model(nodes, [info("x", ["N", 3])], [info("y", ["N", 3])], opset=17)

    def no_work(*args: object, **kwargs: object) -> None:
        raise AssertionError("work started before the converter check")

    monkeypatch.setattr(importer, "_infer_shapes", no_work)
    monkeypatch.setattr(importer, "_build", no_work)
    with pytest.raises(
        NotImplementedError, match=r"no converter for op 'Acos' of domain 'ai.onnx' at opset 17 \(node 'arccosine'\)"
    ):
        import_onnx(model)


def test_all_unknown_ops_are_listed_with_their_domain() -> None:
    nodes = [
        helper.make_node("Acos", ["x"], ["a"], name="c1"),
        helper.make_node("Acos", ["a"], ["b"], name="c2"),
        helper.make_node("FusedThing", ["b"], ["y"], name="custom", domain="com.example"),
    ]
    graph = helper.make_graph(nodes, "g", [info("x", ["N", 3])], [info("y", ["N", 3])])
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 2)], ir_version=8
    )
    with pytest.raises(NotImplementedError) as err:
        import_onnx(model)
    assert "op 'Acos' of domain 'ai.onnx' at opset 17 (node 'c1', 'c2')" in str(err.value)
    assert "op 'FusedThing' of domain 'com.example' at opset 2 (node 'custom')" in str(err.value)


def test_op_outside_its_converter_opsets() -> None:
    """Gelu exists from opset 20; a model at opset 19 that uses it is told so."""
    with pytest.raises(NotImplementedError, match=r"'Gelu'.*opset 19.*onnx has no schema of it at or below opset 19"):
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


def test_registry_refuses_a_second_converter_for_a_version() -> None:
    registry = ConverterRegistry()
    registry.converter("Relu", versions=(6, 13))(lambda ctx: None)
    registry.converter("Relu", versions=(14,))(lambda ctx: None)
    with pytest.raises(DuplicateConverterError, match=r"ai.onnx::Relu version 13: .* is already registered"):
        registry.converter("Relu", versions=(13,))(lambda ctx: None)
    # A refused registration leaves nothing behind, and another domain is another key.
    assert registry.find("", "Relu", 13) is not None
    registry.converter("Relu", versions=(13,), domain="com.example")(lambda ctx: None)


def test_registry_refuses_a_second_converter_for_a_builtin_op() -> None:
    with pytest.raises(DuplicateConverterError, match=r"ai.onnx::Conv version 11: .*convert_layers.conv"):
        REGISTRY.converter("Conv", versions=(11,), domain="ai.onnx")(lambda ctx: None)


def test_registry_refuses_versions_that_are_not_schema_versions() -> None:
    with pytest.raises(ValueError, match=r"ai.onnx::Relu: \[7\] are not schema versions .* versions \[1, 6, 13, 14"):
        ConverterRegistry().converter("Relu", versions=(6, 7))
    with pytest.raises(ValueError, match=r"opsets must be \(first, last\)"):
        ConverterRegistry().converter("Relu", opsets=(14, 13))
    with pytest.raises(ValueError, match="exactly one of versions= and opsets="):
        ConverterRegistry().converter("Relu")


def test_an_opset_range_registers_the_schema_versions_in_it() -> None:
    """opsets=(6, 21) of Relu means the versions checked there: 6, 13, 14 (version 6 starts before 7)."""
    registry = ConverterRegistry()
    registry.converter("Relu", opsets=(7, 21))(lambda ctx: None)
    assert [e.version for e in registry.entries()] == [6, 13, 14]


def test_registry_picks_the_version_in_force_at_the_model_opset() -> None:
    split_attribute = REGISTRY.find("", "Split", 12)
    split_input = REGISTRY.find("ai.onnx", "Split", 13)
    assert split_attribute is not None and split_attribute.fn.__name__ == "split_attribute"
    assert split_input is not None and split_input.fn.__name__ == "split_input"
    assert REGISTRY.find("", "Split", 17).version == 13
    assert REGISTRY.find("", "Split", 18).version == 18


def test_a_converter_covers_later_opsets_until_the_schema_changes() -> None:
    """Relu's schema has not changed since version 14: every opset up to the newest onnx knows resolves
    to that converter, with no upper bound written in fuser."""
    newest = onnx.defs.onnx_opset_version()
    assert newest > 21
    relu = [REGISTRY.find("", "Relu", opset) for opset in range(14, newest + 1)]
    assert all(e is not None and e.version == 14 for e in relu)


def test_a_schema_changed_after_the_converter_is_refused() -> None:
    """A fake newer version of an op in a registry that knows only the older one: refused with the op,
    opset, node and the versions that are converted."""
    registry = ConverterRegistry()
    registry.converter("HardSigmoid", versions=(6,))(lambda ctx: None)
    assert registry.find("", "HardSigmoid", 21) is not None
    with pytest.raises(
        NotImplementedError,
        match=r"'HardSigmoid' of domain 'ai.onnx' at opset 22 \(node 'hs'\): its schema changed in version 22, "
        r"after the newest version fuser converts \(6\)",
    ):
        registry.lookup("", "HardSigmoid", 22, "hs")


def test_a_model_at_an_op_changed_after_its_converter_names_op_opset_and_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The importer's check before any work lists the changed op with the reason."""
    registry = ConverterRegistry()
    registry.converter("Relu", versions=(6, 13))(lambda ctx: None)
    monkeypatch.setattr(importer, "REGISTRY", registry)
    model = single_op("Relu", [["N", 3]], opset=18)
    with pytest.raises(
        NotImplementedError,
        match=r"no converter for op 'Relu' of domain 'ai.onnx' at opset 18 \(node 'Relu_0'\): "
        r"its schema changed in version 14",
    ):
        import_onnx(model)


def test_ops_of_other_domains_resolve_to_the_newest_registered_version() -> None:
    registry = ConverterRegistry()
    registry.converter("Fused", versions=(1, 3), domain="com.example")(lambda ctx: None)
    assert [registry.find("com.example", "Fused", o).version for o in (1, 2, 3, 9)] == [1, 1, 3, 3]
    assert registry.find("com.example", "Fused", 0) is None


@pytest.mark.parametrize("opset", sorted({22, 23, onnx.defs.onnx_opset_version()}))
def test_a_relu_model_at_a_new_opset_imports(opset: int) -> None:
    check_import(single_op("Relu", [["N", 3, 7]], opset=opset), f"Relu at opset {opset}")


def test_every_op_of_the_issue_is_covered_from_13_to_the_newest_opset() -> None:
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
    newest = onnx.defs.onnx_opset_version()
    missing = [(op, o) for op in ops for o in range(13, newest + 1) if REGISTRY.find("", op, o) is None]
    # HardSigmoid's schema changed in version 22 (bfloat16 added), checked separately by its converter.
    assert [m for m in missing if m[0] != "HardSigmoid"] == []
    # These ops enter ONNX after opset 13.
    assert [REGISTRY.find("", "HardSwish", o) is not None for o in (13, 14, 21)] == [False, True, True]
    assert [REGISTRY.find("", "LayerNormalization", o) is not None for o in (16, 17, 21)] == [False, True, True]
    assert [REGISTRY.find("", "Gelu", o) is not None for o in (19, 20, 21)] == [False, True, True]
