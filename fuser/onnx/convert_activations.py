"""Converters for activations: each becomes the plain torch call a traced PyTorch model would contain,
so the fusion passes see an ONNX Relu exactly as they see ``torch.relu``.

The ops that are a fused activation (Relu, HardSigmoid, Mish, Gelu, ...) are read from the activation table
(fuser.activations, column ``onnx_in``) and become the row's canonical call; the rest (Erf, Softplus, Clip,
Softmax) are written here.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fuser.activations import ACTIVATIONS, ActivationSpec, OnnxForm
from fuser.onnx.builder import NodeContext
from fuser.onnx.registry import converter

# The newest opset the converters here are checked against.
LAST_OPSET = 21
# Clip-6 and older write "no bound" as the float32 extremes.
_FLOAT32_MAX = 3.4028234663852886e38


def python_scalar(t: torch.Tensor) -> int | float | bool:
    """A one-element constant as a Python number of its kind (int stays int: dtypes must not change)."""
    return t.reshape(()).item()


def _matches(form: OnnxForm, ctx: NodeContext) -> bool:
    """The node carries the attribute values that make it ``form``'s activation (floats as float32 stores them)."""
    for name, default, value in form.attributes:
        found = ctx.attr(name, default)
        if isinstance(value, float) and isinstance(found, (int, float)):
            if not math.isclose(float(found), value, rel_tol=1e-6):
                return False
        elif found != value:
            return False
    return True


def _hard_sigmoid_general(ctx: NodeContext) -> Any:
    """ONNX HardSigmoid with another alpha/beta than torch's: clamp(alpha * x + beta, 0, 1), exactly."""
    alpha, beta = float(ctx.attr("alpha", 0.2)), float(ctx.attr("beta", 0.5))
    return ctx.call(torch.clamp, ctx.call(operator.add, ctx.call(operator.mul, ctx.input(0), alpha), beta), 0.0, 1.0)


# ONNX ops that also mean something outside the table for other attribute values.
_OTHERWISE: dict[str, Callable[[NodeContext], Any]] = {"HardSigmoid": _hard_sigmoid_general}


def _table_converter(op_type: str, forms: list[tuple[ActivationSpec, OnnxForm]]) -> Callable[[NodeContext], Any]:
    """The converter of ``op_type``: the canonical call of the row whose attributes the node carries."""

    def convert(ctx: NodeContext) -> Any:
        for row, form in forms:
            if _matches(form, ctx):
                alpha = float(ctx.attr(*form.alpha)) if form.alpha else 0.0
                target, args, kwargs = row.canonical_call(ctx.input(0), alpha)
                return ctx.call(target, *args, **kwargs)
        if op_type in _OTHERWISE:
            return _OTHERWISE[op_type](ctx)
        expected = " or ".join(", ".join(f"{n}={v!r}" for n, _, v in form.attributes) for _, form in forms)
        given = ", ".join(f"{n}={ctx.attr(n, d)!r}" for n, d, _ in forms[0][1].attributes)
        raise ctx.invalid(f"{given} (expected {expected})")

    convert.__name__ = convert.__qualname__ = f"convert_{op_type}"
    return convert


def _register_table() -> None:
    """One converter per ONNX op of the activation table (fuser.activations, column ``onnx_in``)."""
    by_op: dict[str, list[tuple[ActivationSpec, OnnxForm]]] = {}
    for row in ACTIVATIONS:
        for form in row.onnx_in:
            by_op.setdefault(form.op_type, []).append((row, form))
    for op_type, forms in by_op.items():
        since = {form.since for _, form in forms}
        if len(since) != 1:
            raise ValueError(f"the activation table gives ONNX {op_type} several first opsets: {sorted(since)}")
        converter(op_type, opsets=(since.pop(), LAST_OPSET))(_table_converter(op_type, forms))


_register_table()


@converter("Erf", opsets=(9, 21))
def erf(ctx: NodeContext) -> Any:
    return ctx.call(torch.erf, ctx.input(0))


@converter("Softplus", opsets=(1, 21))
def softplus(ctx: NodeContext) -> Any:
    """log(1 + exp(x)); torch's softplus returns x itself past 20, where the two agree in float32 (and in
    float64 to 2e-9). With Tanh and Mul it is the written-out Mish torch's exporter writes."""
    return ctx.call(F.softplus, ctx.input(0))


@converter("Softmax", opsets=(13, 21))
def softmax(ctx: NodeContext) -> Any:
    return ctx.call(F.softmax, ctx.input(0), dim=int(ctx.attr("axis", -1)))


def _clip(ctx: NodeContext, low: Any, high: Any) -> Any:
    x = ctx.input(0)
    if low is None and high is None:
        return x
    return ctx.call(torch.clamp, x, low, high)


@converter("Clip", opsets=(6, 10))
def clip_attributes(ctx: NodeContext) -> Any:
    low, high = float(ctx.attr("min", -_FLOAT32_MAX)), float(ctx.attr("max", _FLOAT32_MAX))
    return _clip(ctx, None if low <= -_FLOAT32_MAX else low, None if high >= _FLOAT32_MAX else high)


@converter("Clip", opsets=(11, 21))
def clip_inputs(ctx: NodeContext) -> Any:
    """Constant bounds become Python numbers (``torch.clamp(x, 0.0, 6.0)``, which the core reads as
    relu6); bounds computed at run time stay tensors."""
    bounds = []
    for i in (1, 2):
        t = ctx.constant(i)
        if t is not None:
            bounds.append(python_scalar(t))
        else:
            bounds.append(ctx.optional_input(i))
    return _clip(ctx, *bounds)
