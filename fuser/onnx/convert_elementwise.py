"""Converters for element-wise arithmetic, comparison, logic, selection and casts.

Add/Sub/Mul/Div become ``operator.add/sub/mul/truediv`` (what ``a + b`` traces to); a one-element
constant operand becomes a Python number, so ``x * 0.5`` reads as it would in a traced model. On shape
vectors (:class:`~fuser.onnx.shape_values.ShapeValue`) the same ops run entry by entry at import time.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from fuser.onnx.builder import NodeContext, Value, torch_dtype
from fuser.onnx.convert_activations import python_scalar
from fuser.onnx.registry import converter
from fuser.onnx.shape_values import ShapeValue, broadcast_pairs, from_tensor, is_integral


def as_shape_value(value: Value) -> ShapeValue | None:
    """``value`` as a ShapeValue when it is one or a small constant vector; None for run-time tensors."""
    if isinstance(value, ShapeValue):
        return value
    if isinstance(value, torch.Tensor):
        return from_tensor(value)
    return None


def _symbolic_binary(ctx: NodeContext, op: str, a: Value, b: Value) -> ShapeValue | None:
    """``a op b`` entry by entry when one side is a ShapeValue and the other one too or a small constant."""
    if not (isinstance(a, ShapeValue) or isinstance(b, ShapeValue)):
        return None
    sa, sb = as_shape_value(a), as_shape_value(b)
    if sa is None or sb is None:
        return None
    pairs = broadcast_pairs(sa, sb)
    if pairs is None:
        return None
    integral = is_integral(sa.dtype)
    items = []
    for x, y in pairs:
        item = ctx.builder.items.binary(op, x, y, integral)
        if item is None:
            return None
        items.append(item)
    dtype = torch.bool if op == "eq" else sa.dtype
    return ShapeValue(tuple(items), scalar=sa.scalar and sb.scalar, dtype=dtype)


def _operand(ctx: NodeContext, i: int, other: Value) -> Any:
    """Input ``i`` for a binary op whose other operand is ``other``.

    Against a run-time tensor, a one-element constant (or one-entry shape vector) becomes a Python
    number when that does not change the result's rank. Between constants nothing changes, so the
    folded result stays a tensor.
    """
    value = ctx.input(i)
    if not isinstance(other, fx.Node):
        return value
    other_rank = ctx.rank(1 - i)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        rank = value.dim()
    elif isinstance(value, ShapeValue) and len(value.items) == 1:
        rank = value.rank
    else:
        return value
    if rank > 0 and (other_rank is None or rank > other_rank):
        return value
    if isinstance(value, torch.Tensor):
        return python_scalar(value)
    item = value.items[0]
    if isinstance(item, fx.Node) or not value.dtype.is_floating_point:
        return item
    return float(item)


def _binary(ctx: NodeContext, op: str) -> Any:
    a, b = ctx.input(0), ctx.input(1)
    symbolic = _symbolic_binary(ctx, op, a, b)
    if symbolic is not None:
        return symbolic
    dtype = ctx.dtype(0) or ctx.dtype(1)
    x, y = _operand(ctx, 0, b), _operand(ctx, 1, a)
    if op == "div" and dtype is not None and is_integral(dtype):
        # ONNX integer division truncates toward zero; Python's // floors.
        return ctx.call(torch.div, x, y, rounding_mode="trunc")
    target = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv}[op]
    return ctx.call(target, x, y)


@converter("Add", versions=(7, 13, 14))
def add(ctx: NodeContext) -> Any:
    return _binary(ctx, "add")


@converter("Sub", versions=(7, 13, 14))
def sub(ctx: NodeContext) -> Any:
    return _binary(ctx, "sub")


@converter("Mul", versions=(7, 13, 14))
def mul(ctx: NodeContext) -> Any:
    return _binary(ctx, "mul")


@converter("Div", versions=(7, 13, 14))
def div(ctx: NodeContext) -> Any:
    return _binary(ctx, "div")


@converter("Mod", versions=(10, 13))
def mod(ctx: NodeContext) -> Any:
    """``fmod=0`` (integers only): the remainder takes the divisor's sign, as ``torch.remainder`` and Python's ``%``;
    ``fmod=1``: the dividend's, as ``torch.fmod``. torchvision's attention computes a head size this way from two
    constants, which fold; on shape vectors it stays symbolic."""
    fmod = int(ctx.attr("fmod", 0))
    dtype = ctx.dtype(0) or ctx.dtype(1)
    if not fmod and dtype is not None and not is_integral(dtype):
        raise ctx.invalid(f"fmod=0 on {dtype} inputs (ONNX requires fmod=1 for floating-point types)")
    a, b = ctx.input(0), ctx.input(1)
    if not fmod:
        symbolic = _symbolic_binary(ctx, "mod", a, b)
        if symbolic is not None:
            return symbolic
    return ctx.call(torch.fmod if fmod else torch.remainder, a, _operand(ctx, 1, a))


@converter("Equal", versions=(11, 13, 19))
def equal(ctx: NodeContext) -> Any:
    a, b = ctx.input(0), ctx.input(1)
    symbolic = _symbolic_binary(ctx, "eq", a, b)
    if symbolic is not None:
        return symbolic
    return ctx.call(torch.eq, a, b)


_COMPARISONS = {
    "Greater": ((7, 9, 13), torch.gt),
    "Less": ((7, 9, 13), torch.lt),
    "GreaterOrEqual": ((12, 16), torch.ge),
    "LessOrEqual": ((12, 16), torch.le),
}
_LOGICAL = {
    "And": ((7,), torch.logical_and),
    "Or": ((7,), torch.logical_or),
    "Xor": ((7,), torch.logical_xor),
}


def _register_binary(op_type: str, versions: tuple[int, ...], target: Any) -> None:
    """One converter per table entry: ``target(a, b)`` with numpy broadcasting, as ONNX has it."""

    @converter(op_type, versions=versions)
    def convert(ctx: NodeContext) -> Any:
        return ctx.call(target, ctx.input(0), ctx.input(1))

    convert.__name__ = convert.__qualname__ = op_type.lower()


for _op, (_versions, _target) in {**_COMPARISONS, **_LOGICAL}.items():
    _register_binary(_op, _versions, _target)


@converter("Not", versions=(1,))
def not_(ctx: NodeContext) -> Any:
    return ctx.call(torch.logical_not, ctx.input(0))


@converter("IsNaN", versions=(9, 13, 20))
def isnan(ctx: NodeContext) -> Any:
    return ctx.call(torch.isnan, ctx.input(0))


def _extremum(ctx: NodeContext, target: Any, symbolic: str) -> Any:
    """Max / Min of one or more inputs with broadcasting: ``torch.maximum`` pairwise (NaN wins, as in
    ONNX). Shape vectors stay symbolic entry by entry."""
    values = [ctx.input(i) for i in range(ctx.num_inputs) if ctx.has_input(i)]
    result = values[0]
    for value in values[1:]:
        pairs = None
        if isinstance(result, ShapeValue) or isinstance(value, ShapeValue):
            sa, sb = as_shape_value(result), as_shape_value(value)
            pairs = broadcast_pairs(sa, sb) if sa is not None and sb is not None else None
        if pairs is not None:
            pick = getattr(ctx.builder.items, symbolic)
            scalar = sa.scalar and sb.scalar
            result = ShapeValue(tuple(pick(x, y) for x, y in pairs), scalar=scalar, dtype=sa.dtype)
        else:
            result = ctx.call(target, result, value)
    return result


@converter("Max", versions=(8, 12, 13))
def max_(ctx: NodeContext) -> Any:
    return _extremum(ctx, torch.maximum, "maximum")


@converter("Min", versions=(8, 12, 13))
def min_(ctx: NodeContext) -> Any:
    return _extremum(ctx, torch.minimum, "minimum")


@converter("Pow", versions=(7, 12, 13, 15))
def pow_(ctx: NodeContext) -> Any:
    """``torch.pow(x, 2.0)`` for a constant exponent; ONNX keeps the base's dtype, so an integer base
    with a float exponent is cast back."""
    base, exponent = ctx.input(0), ctx.input(1)
    const = ctx.constant(1)
    base_dtype = ctx.dtype(0)
    if const is not None and const.numel() == 1 and const.dim() <= (ctx.rank(0) or 0):
        exponent = python_scalar(const)
    result = ctx.call(torch.pow, base, exponent)
    exp_dtype = ctx.dtype(1)
    if base_dtype is not None and exp_dtype is not None and is_integral(base_dtype) != is_integral(exp_dtype):
        result = ctx.method("to", result, base_dtype)
    return result


# One-input element-wise ops: the torch function each is, and the first opset of the schema converted.
_UNARY: dict[str, tuple[int, Any]] = {
    "Sqrt": (6, torch.sqrt),
    "Neg": (6, torch.neg),
    "Abs": (6, torch.abs),
    "Exp": (6, torch.exp),
    "Log": (6, torch.log),
    "Reciprocal": (6, torch.reciprocal),
    "Floor": (6, torch.floor),
    "Ceil": (6, torch.ceil),
    "Sin": (7, torch.sin),
    "Cos": (7, torch.cos),
}


def _register_unary(op_type: str, first: int, target: Any) -> None:
    @converter(op_type, opsets=(first, 22))
    def convert(ctx: NodeContext) -> Any:
        return ctx.call(target, ctx.input(0))

    convert.__name__ = convert.__qualname__ = op_type.lower()


for _op, (_first, _target) in _UNARY.items():
    _register_unary(_op, _first, _target)


@converter("Where", versions=(9, 16))
def where(ctx: NodeContext) -> Any:
    cond, a, b = ctx.input(0), ctx.input(1), ctx.input(2)
    if any(isinstance(v, ShapeValue) for v in (cond, a, b)):
        symbolic = _symbolic_where(cond, a, b)
        if symbolic is not None:
            return symbolic
    return ctx.call(torch.where, cond, a, b)


def _symbolic_where(cond: Value, a: Value, b: Value) -> ShapeValue | None:
    sc, sa, sb = as_shape_value(cond), as_shape_value(a), as_shape_value(b)
    if sc is None or sa is None or sb is None or not sc.is_constant:
        return None
    length = max(len(sc.items), len(sa.items), len(sb.items))
    if any(len(s.items) not in (1, length) for s in (sc, sa, sb)):
        return None

    def at(s: ShapeValue, k: int) -> Any:
        return s.items[0] if len(s.items) == 1 else s.items[k]

    items = tuple(at(sa, k) if at(sc, k) else at(sb, k) for k in range(length))
    return ShapeValue(items, scalar=sc.scalar and sa.scalar and sb.scalar, dtype=sa.dtype)


@converter("Cast", versions=(6, 9, 13, 19, 21, 23, 24, 25, 28))
def cast(ctx: NodeContext) -> Any:
    x = ctx.input(0)
    dtype = torch_dtype(int(ctx.attr("to")), ctx.describe())
    # Run-time entries of an integer shape vector are Python ints; as floats they behave the same in
    # float arithmetic, so an int -> int or int -> float cast only changes the declared dtype.
    symbolic = isinstance(x, ShapeValue) and not x.is_constant and is_integral(x.dtype)
    if symbolic and dtype != torch.bool and (is_integral(dtype) or dtype.is_floating_point):
        return ShapeValue(x.items, x.scalar, dtype)
    return ctx.method("to", x, dtype)


@converter("Identity", versions=(1, 13, 14, 16, 19, 21, 23, 24, 25))
def identity(ctx: NodeContext) -> Any:
    return ctx.input(0)
