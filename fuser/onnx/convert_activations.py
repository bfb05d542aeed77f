"""Converters for activations: each becomes the plain torch call a traced PyTorch model would contain,
so the fusion passes see an ONNX Relu exactly as they see ``torch.relu``."""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.nn.functional as F

from fuser.onnx.builder import NodeContext
from fuser.onnx.registry import converter

# Clip-6 and older write "no bound" as the float32 extremes.
_FLOAT32_MAX = 3.4028234663852886e38


def python_scalar(t: torch.Tensor) -> int | float | bool:
    """A one-element constant as a Python number of its kind (int stays int: dtypes must not change)."""
    return t.reshape(()).item()


@converter("Relu", opsets=(6, 21))
def relu(ctx: NodeContext) -> Any:
    return ctx.call(torch.relu, ctx.input(0))


@converter("Sigmoid", opsets=(6, 21))
def sigmoid(ctx: NodeContext) -> Any:
    return ctx.call(torch.sigmoid, ctx.input(0))


@converter("Tanh", opsets=(6, 21))
def tanh(ctx: NodeContext) -> Any:
    return ctx.call(torch.tanh, ctx.input(0))


@converter("Erf", opsets=(9, 21))
def erf(ctx: NodeContext) -> Any:
    return ctx.call(torch.erf, ctx.input(0))


@converter("LeakyRelu", opsets=(6, 21))
def leaky_relu(ctx: NodeContext) -> Any:
    return ctx.call(F.leaky_relu, ctx.input(0), float(ctx.attr("alpha", 0.01)))


@converter("HardSwish", opsets=(14, 21))
def hardswish(ctx: NodeContext) -> Any:
    return ctx.call(F.hardswish, ctx.input(0))


@converter("HardSigmoid", opsets=(6, 21))
def hardsigmoid(ctx: NodeContext) -> Any:
    """torch's hardsigmoid is relu6(x + 3) / 6, i.e. ONNX's alpha=1/6, beta=0.5 (stored as float32)."""
    x = ctx.input(0)
    alpha, beta = float(ctx.attr("alpha", 0.2)), float(ctx.attr("beta", 0.5))
    if math.isclose(alpha, 1 / 6, rel_tol=1e-6) and beta == 0.5:
        return ctx.call(F.hardsigmoid, x)
    return ctx.call(torch.clamp, ctx.call(operator.add, ctx.call(operator.mul, x, alpha), beta), 0.0, 1.0)


@converter("Gelu", opsets=(20, 21))
def gelu(ctx: NodeContext) -> Any:
    approximate = ctx.attr("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise ctx.invalid(f"approximate={approximate!r} (expected 'none' or 'tanh')")
    return ctx.call(F.gelu, ctx.input(0), approximate=approximate)


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
