"""Element-wise arithmetic, comparison, selection and casts imported from ONNX match onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx_testing import INT64, check_import, const, info, make_model, single_op

SHAPE = ["N", 3, 7, 5]


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize(
    "other_shape", [["N", 3, 7, 5], [5], [3, 1, 1], ["N", 1, 7, 1]], ids=["same", "row", "channel", "mixed"]
)
def test_binary_two_inputs(op: str, other_shape: list) -> None:
    check_import(single_op(op, [SHAPE, other_shape], opset=14), f"{op} with {other_shape}")


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize(
    "constant",
    [np.float32(0.37), np.array([1.7], np.float32), np.linspace(0.5, 2.0, 5, dtype=np.float32)],
    ids=["scalar", "one-element", "vector"],
)
@pytest.mark.parametrize("constant_first", [False, True])
def test_binary_with_constant(op: str, constant: np.ndarray, constant_first: bool) -> None:
    names = ["c", "x0"] if constant_first else ["x0", "c"]
    node = helper.make_node(op, names, ["y0"])
    model = make_model([node], [info("x0", SHAPE)], [info("y0", None)], [const("c", constant)], opset=13)
    check_import(model, f"{op} constant first={constant_first}")


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
def test_integer_arithmetic(op: str) -> None:
    """Integer Div truncates toward zero in ONNX (Python's // floors: -7 // 2 == -4, ONNX gives -3)."""
    node = helper.make_node(op, ["x0", "c"], ["y0"])
    divisor = const("c", np.array([2, -3, 4, 7, -1], np.int64))
    model = make_model([node], [info("x0", SHAPE, INT64)], [info("y0", None, INT64)], [divisor], opset=14)
    check_import(model, f"int64 {op}")


def test_sqrt_of_square() -> None:
    nodes = [helper.make_node("Mul", ["x0", "x0"], ["sq"]), helper.make_node("Sqrt", ["sq"], ["y0"])]
    check_import(make_model(nodes, [info("x0", SHAPE)], [info("y0", None)], opset=13), "Sqrt")


@pytest.mark.parametrize("exponent", [np.float32(2.0), np.float32(3.0), np.float32(0.5)])
def test_pow_constant_exponent(exponent: np.float32) -> None:
    nodes = [helper.make_node("Mul", ["x0", "x0"], ["sq"]), helper.make_node("Pow", ["sq", "e"], ["y0"])]
    model = make_model(nodes, [info("x0", SHAPE)], [info("y0", None)], [const("e", exponent)], opset=15)
    check_import(model, f"Pow {exponent}")


def test_pow_tensor_exponent() -> None:
    nodes = [helper.make_node("Sigmoid", ["x0"], ["base"]), helper.make_node("Pow", ["base", "x1"], ["y0"])]
    model = make_model(nodes, [info("x0", SHAPE), info("x1", [7, 5])], [info("y0", None)], opset=13)
    check_import(model, "Pow tensor exponent")


@pytest.mark.parametrize("opset", [13, 19])
def test_equal_and_where(opset: int) -> None:
    nodes = [
        helper.make_node("Equal", ["x0", "x1"], ["eq"]),
        helper.make_node("Where", ["eq", "x2", "x3"], ["y0"]),
        helper.make_node("Identity", ["eq"], ["y1"]),
    ]
    inputs = [info("x0", SHAPE, INT64), info("x1", [5], INT64), info("x2", SHAPE), info("x3", [1])]
    outputs = [info("y0", None), info("y1", None, TensorProto.BOOL)]
    check_import(make_model(nodes, inputs, outputs, opset=opset), f"Equal/Where opset {opset}")


@pytest.mark.parametrize(
    "to", [TensorProto.INT64, TensorProto.INT32, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BOOL]
)
def test_cast(to: int) -> None:
    nodes = [
        helper.make_node("Mul", ["x0", "k"], ["scaled"]),
        helper.make_node("Cast", ["scaled"], ["y0"], to=to),
    ]
    model = make_model(nodes, [info("x0", SHAPE)], [info("y0", None, to)], [const("k", np.float32(3.3))], opset=13)
    check_import(model, f"Cast to {to}")


def test_identity_of_input_and_constant() -> None:
    nodes = [helper.make_node("Identity", ["x0"], ["y0"]), helper.make_node("Identity", ["c"], ["y1"])]
    model = make_model(
        nodes, [info("x0", SHAPE)], [info("y0", None), info("y1", None)], [const("c", np.arange(6.0))], opset=16
    )
    module = check_import(model, "Identity")
    assert [n.op for n in module.graph.nodes] == ["placeholder", "get_attr", "output"]


def test_constant_arithmetic_is_folded() -> None:
    """A chain computed only from initializers runs at import time: one buffer, no ops on it."""
    nodes = [
        helper.make_node("Mul", ["a", "b"], ["ab"]),
        helper.make_node("Add", ["ab", "a"], ["c"]),
        helper.make_node("Add", ["x0", "c"], ["y0"]),
    ]
    inits = [const("a", np.linspace(-1, 1, 5, dtype=np.float32)), const("b", np.float32(1.5))]
    model = make_model(nodes, [info("x0", SHAPE)], [info("y0", None)], inits, opset=13)
    module = check_import(model, "folded constants")
    assert [n.op for n in module.graph.nodes] == ["placeholder", "get_attr", "call_function", "output"]


def test_float_dtype_preserved_with_python_scalar() -> None:
    """A float16 tensor times a scalar stays float16, as in ONNX."""
    node = helper.make_node("Mul", ["x0", "c"], ["y0"])
    model = make_model(
        [node],
        [info("x0", SHAPE, TensorProto.FLOAT16)],
        [info("y0", None, TensorProto.FLOAT16)],
        [const("c", np.float16(0.75))],
        opset=13,
    )
    check_import(model, "float16 Mul", tol=1e-3)
