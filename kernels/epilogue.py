"""The fused epilogue: one description shared by the graph side and the kernels.

A GEMM or convolution accumulator ``acc`` (float32) leaves a fused kernel as

    y = acc + bias
    y = y + residual            if residual is Residual.BEFORE_ACT   (ResNet: add, then ReLU)
    y = act(y)
    y = y + residual            if residual is Residual.AFTER_ACT    (YOLO/MBConv: act, then add)
    y = y * scale

The graph side builds an :class:`Epilogue` from the chain it matched; the Triton kernels receive
its fields as ``tl.constexpr`` values and run :func:`apply_activation`; the torch reference runs
:func:`apply_epilogue_torch`. Both implement the same formulas, listed in :class:`Activation`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


class Activation(enum.IntEnum):
    """Activations a fused kernel applies in its epilogue (values are the kernels' constexprs)."""

    NONE = 0
    RELU = 1  # max(x, 0)
    RELU6 = 2  # min(max(x, 0), 6)
    LEAKY_RELU = 3  # x if x >= 0 else alpha * x
    SILU = 4  # x * sigmoid(x)
    HARDSWISH = 5  # x * relu6(x + 3) / 6
    GELU = 6  # 0.5 * x * (1 + erf(x / sqrt(2)))
    GELU_TANH = 7  # 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))
    SIGMOID = 8  # 1 / (1 + exp(-x))
    TANH = 9  # tanh(x)


class Residual(enum.IntEnum):
    """Where a residual tensor is added, relative to the activation."""

    NONE = 0
    BEFORE_ACT = 1
    AFTER_ACT = 2


@dataclass(frozen=True)
class Epilogue:
    """What happens to the accumulator before the single store.

    ``alpha`` is the negative slope of LEAKY_RELU (ignored otherwise); ``scale`` multiplies the
    final value (1.0 means no scale).
    """

    act: Activation = Activation.NONE
    alpha: float = 0.0
    residual: Residual = Residual.NONE
    scale: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "act", Activation(self.act))
        object.__setattr__(self, "residual", Residual(self.residual))
        if not math.isfinite(self.alpha) or not math.isfinite(self.scale):
            raise ValueError(f"epilogue alpha and scale not finite: alpha={self.alpha}, scale={self.scale}")

    def describe(self) -> str:
        """A short human-readable form, e.g. ``'bias -> silu -> +residual'``."""
        steps = ["bias"]
        act = self.act.name.lower() if self.act != Activation.NONE else None
        if act == "leaky_relu":
            act = f"leaky_relu({self.alpha:g})"
        if self.residual == Residual.BEFORE_ACT:
            steps.append("+residual")
        if act:
            steps.append(act)
        if self.residual == Residual.AFTER_ACT:
            steps.append("+residual")
        if self.scale != 1.0:
            steps.append(f"*{self.scale:g}")
        return " -> ".join(steps)


NO_EPILOGUE = Epilogue()  # bias only: the default of the launchers


def apply_activation_torch(y: torch.Tensor, act: Activation, alpha: float = 0.0) -> torch.Tensor:
    """The torch reference of :class:`Activation` (out of place)."""
    act = Activation(act)
    if act == Activation.NONE:
        return y
    if act == Activation.RELU:
        return torch.relu(y)
    if act == Activation.RELU6:
        return torch.nn.functional.relu6(y)
    if act == Activation.LEAKY_RELU:
        return torch.nn.functional.leaky_relu(y, alpha)
    if act == Activation.SILU:
        return torch.nn.functional.silu(y)
    if act == Activation.HARDSWISH:
        return torch.nn.functional.hardswish(y)
    if act == Activation.GELU:
        return torch.nn.functional.gelu(y)
    if act == Activation.GELU_TANH:
        return torch.nn.functional.gelu(y, approximate="tanh")
    if act == Activation.SIGMOID:
        return torch.sigmoid(y)
    if act == Activation.TANH:
        return torch.tanh(y)
    raise ValueError(f"unknown activation {act!r}")


def apply_epilogue_torch(
    acc: torch.Tensor,
    bias: torch.Tensor | None,
    epilogue: Epilogue,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch reference of the whole epilogue; ``bias`` broadcasts over ``acc``'s channel dim.

    The caller shapes ``bias`` to broadcast (``[C, 1, 1]`` for NCHW, ``[N]`` for a GEMM).
    """
    if (residual is None) != (epilogue.residual == Residual.NONE):
        raise ValueError(f"epilogue {epilogue.describe()!r} and residual={residual is not None} disagree")
    y = acc if bias is None else acc + bias
    if epilogue.residual == Residual.BEFORE_ACT:
        y = y + residual
    y = apply_activation_torch(y, epilogue.act, epilogue.alpha)
    if epilogue.residual == Residual.AFTER_ACT:
        y = y + residual
    if epilogue.scale != 1.0:
        y = y * epilogue.scale
    return y


# ---------------------------------------------------------------------------------------------
# Triton side: the same formulas, on a float32 tile.


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1): saturates to +-1 without inf/inf (triton.language has no tanh builtin).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def apply_activation(x, alpha, ACT: tl.constexpr):
    """Apply :class:`Activation` ``ACT`` to a float32 tile ``x``; ``alpha`` is LEAKY_RELU's slope."""
    if ACT == 1:
        x = tl.maximum(x, 0.0)
    elif ACT == 2:
        x = tl.minimum(tl.maximum(x, 0.0), 6.0)
    elif ACT == 3:
        x = tl.where(x >= 0.0, x, x * alpha)
    elif ACT == 4:
        x = x * _sigmoid(x)
    elif ACT == 5:
        x = x * tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0) * (1.0 / 6.0)
    elif ACT == 6:
        x = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACT == 7:
        x = 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
    elif ACT == 8:
        x = _sigmoid(x)
    elif ACT == 9:
        x = _tanh(x)
    return x


@triton.jit
def apply_epilogue(
    acc, bias, residual, alpha, scale, ACT: tl.constexpr, RESIDUAL: tl.constexpr, HAS_SCALE: tl.constexpr
):
    """The whole epilogue on a float32 tile, in the order of :func:`apply_epilogue_torch`.

    ``bias`` is already broadcast-ready (or the scalar 0.0 when there is none); ``residual`` is a
    float32 tile of ``acc``'s shape when ``RESIDUAL`` is not :attr:`Residual.NONE` (ignored otherwise).
    """
    y = acc + bias
    if RESIDUAL == 1:
        y = y + residual
    y = apply_activation(y, alpha, ACT)
    if RESIDUAL == 2:
        y = y + residual
    if HAS_SCALE:
        y = y * scale
    return y
