"""Element-wise arithmetic, comparison, logic, selection and casts imported from ONNX match onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper
from onnx_testing import INT64, call_targets, check_import, const, info, make_model, single_op

from fuser.onnx.importer import import_onnx

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


# One-input ops, each on inputs where it is defined (Log and Reciprocal on a positive input: x * x + 0.5).
UNARY = {
    "Neg": torch.neg,
    "Abs": torch.abs,
    "Exp": torch.exp,
    "Log": torch.log,
    "Reciprocal": torch.reciprocal,
    "Floor": torch.floor,
    "Ceil": torch.ceil,
    "Sin": torch.sin,
    "Cos": torch.cos,
}


@pytest.mark.parametrize("opset", [13, 22])  # Sin and Cos have a schema 22
@pytest.mark.parametrize("op", UNARY)
def test_unary(op: str, opset: int) -> None:
    nodes = [
        helper.make_node("Mul", ["x0", "x0"], ["sq"]),
        helper.make_node("Add", ["sq", "half"], ["positive"]),
        helper.make_node(op, ["positive" if op in ("Log", "Reciprocal") else "x0"], ["y0"]),
    ]
    model = make_model(nodes, [info("x0", SHAPE)], [info("y0", None)], [const("half", np.float32(0.5))], opset=opset)
    module = check_import(model, f"{op} opset {opset}")
    assert UNARY[op] in call_targets(module), call_targets(module)


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


# -- comparisons, logic, IsNaN, Max / Min (what transformers' attention-mask code exports to) -----------


@pytest.mark.parametrize("op", ["Greater", "Less", "GreaterOrEqual", "LessOrEqual"])
@pytest.mark.parametrize("dtype", [INT64, TensorProto.FLOAT])
def test_comparison(op: str, dtype: int) -> None:
    """Integers drawn from [-5, 5] are often equal, so ``>`` and ``>=`` differ on many entries."""
    model = single_op(op, [SHAPE, [7, 1]], input_dtype=dtype, output_dtype=TensorProto.BOOL, opset=16)
    check_import(model, f"{op} {dtype}")


@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
def test_logical(op: str) -> None:
    inputs = [info("x0", SHAPE, TensorProto.BOOL), info("x1", [1, 7, 5], TensorProto.BOOL)]
    node = helper.make_node(op, ["x0", "x1"], ["y0"])
    check_import(make_model([node], inputs, [info("y0", None, TensorProto.BOOL)], opset=13), op)


def test_not_of_a_comparison() -> None:
    nodes = [helper.make_node("Greater", ["x0", "x1"], ["gt"]), helper.make_node("Not", ["gt"], ["y0"])]
    inputs = [info("x0", SHAPE), info("x1", [5])]
    check_import(make_model(nodes, inputs, [info("y0", None, TensorProto.BOOL)], opset=13), "Not")


def test_isnan_masks_what_sqrt_leaves_undefined() -> None:
    """sqrt of a negative entry is NaN: about half the entries; the attention exports zero them with Where."""
    nodes = [
        helper.make_node("Sqrt", ["x0"], ["root"]),
        helper.make_node("IsNaN", ["root"], ["nan"]),
        helper.make_node("Where", ["nan", "zero", "root"], ["y0"]),
        helper.make_node("Identity", ["nan"], ["y1"]),
    ]
    outputs = [info("y0", None), info("y1", None, TensorProto.BOOL)]
    model = make_model(nodes, [info("x0", SHAPE)], outputs, [const("zero", np.float32(0.0))], opset=20)
    check_import(model, "IsNaN")


@pytest.mark.parametrize("op", ["Max", "Min"])
@pytest.mark.parametrize("dtype", [INT64, TensorProto.FLOAT])
def test_max_min_of_three_broadcast_inputs(op: str, dtype: int) -> None:
    node = helper.make_node(op, ["x0", "x1", "x2"], ["y0"])
    inputs = [info("x0", SHAPE, dtype), info("x1", ["N", 1, 7, 1], dtype), info("x2", [5], dtype)]
    check_import(make_model([node], inputs, [info("y0", None, dtype)], opset=13), f"{op} {dtype}")


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_max_min_of_a_shape_vector_stays_symbolic(op: str) -> None:
    """max(shape, [1, 6, 6, 6]) entry by entry at import time: no tensor op, the batch still read at run time."""
    nodes = [helper.make_node("Shape", ["x0"], ["s"]), helper.make_node(op, ["s", "floor"], ["y0"])]
    model = make_model(nodes, [info("x0", SHAPE)], [info("y0", None, INT64)], [const("floor", [1, 6, 6, 6])], opset=13)
    module = check_import(model, f"{op} of Shape")
    assert not {torch.maximum, torch.minimum} & set(call_targets(module))


@pytest.mark.parametrize("fmod", [0, 1])
def test_integer_mod_takes_the_sign_onnx_says(fmod: int) -> None:
    """Dividends in [-5, 5] over divisors of both signs: fmod=0 gives the divisor's sign (-7 mod 3 is 2), fmod=1
    the dividend's (-1)."""
    node = helper.make_node("Mod", ["x0", "c"], ["y0"], fmod=fmod)
    divisor = const("c", np.array([2, -3, 4, 7, -1], np.int64))
    model = make_model([node], [info("x0", SHAPE, INT64)], [info("y0", None, INT64)], [divisor], opset=13)
    check_import(model, f"int64 Mod fmod={fmod}")


def test_float_mod_of_two_inputs() -> None:
    check_import(single_op("Mod", [SHAPE, [7, 5]], opset=13, fmod=1), "float Mod")


def test_mod_of_a_shape_vector_stays_symbolic() -> None:
    """The batch size mod 3, as shape arithmetic does it: no tensor op, the batch read at run time."""
    nodes = [helper.make_node("Shape", ["x0"], ["s"]), helper.make_node("Mod", ["s", "three"], ["y0"])]
    model = make_model(nodes, [info("x0", SHAPE)], [info("y0", None, INT64)], [const("three", [3, 2, 4, 3])], opset=13)
    module = check_import(model, "Mod of Shape", batches=(2, 7))
    assert torch.remainder not in call_targets(module) and "size" in call_targets(module)


def test_float_mod_without_fmod_is_refused_with_its_node() -> None:
    with pytest.raises(ValueError, match=r"'Mod_0' \(ai.onnx::Mod, opset 13\): .*fmod=0 on torch.float32"):
        import_onnx(single_op("Mod", [SHAPE, [7, 5]], opset=13))
