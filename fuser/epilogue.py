"""The fused epilogue: one description shared by the graph side and the kernels (no triton here).

A GEMM or convolution accumulator ``acc`` (float32) leaves a fused kernel as

    y = acc + bias
    y = y + residual            if residual is Residual.BEFORE_ACT   (ResNet: add, then ReLU)
    y = act(y)
    y = y + residual            if residual is Residual.AFTER_ACT    (YOLO/MBConv: act, then add)
    y = y * scale
    y = round_tf32(y)           if round_tf32 (the kernels only; see Epilogue)

The graph side builds an :class:`Epilogue` from the chain it matched; the Triton kernels
(fuser.kernels.epilogue, which re-exports these names) receive its fields as ``tl.constexpr`` values; the
torch reference runs :func:`apply_epilogue_torch`. The activations and their formulas are the rows of
fuser.activations.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from fuser.activations import Activation, apply_activation_torch


class Residual(enum.IntEnum):
    """Where a residual tensor is added, relative to the activation."""

    NONE = 0
    BEFORE_ACT = 1
    AFTER_ACT = 2


@dataclass(frozen=True)
class Epilogue:
    """What happens to the accumulator before the single store.

    ``alpha`` is the negative slope of LEAKY_RELU (ignored otherwise); ``scale`` multiplies the
    final value (1.0 means no scale). ``round_tf32``: the kernels store the float32 result rounded to
    nearest TF32, set (fuser.rewrite.tf32_rounding) where only TF32 tensor-core dots read it, which round it so
    anyway, but to nearest rather than by truncation. The torch reference ignores it: it is how a TF32
    kernel stores, not part of the function (the reference does not model TF32's operands either, and
    exporters record it).
    """

    act: Activation = Activation.NONE
    alpha: float = 0.0
    residual: Residual = Residual.NONE
    scale: float = 1.0
    round_tf32: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "act", Activation(self.act))
        object.__setattr__(self, "residual", Residual(self.residual))
        object.__setattr__(self, "round_tf32", bool(self.round_tf32))
        if not math.isfinite(self.alpha) or not math.isfinite(self.scale):
            raise ValueError(f"epilogue alpha and scale not finite: alpha={self.alpha}, scale={self.scale}")

    def describe(self, bias: bool = True) -> str:
        """A short human-readable form, e.g. ``'bias -> silu -> +residual'``; ``bias=False`` for an op that
        adds none (a bias-free conv with no BatchNorm folded into it). ``'none'`` where nothing is applied."""
        steps = ["bias"] if bias else []
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
        if self.round_tf32:
            steps.append("tf32 store")
        return " -> ".join(steps) or "none"


NO_EPILOGUE = Epilogue()  # bias only: the default of the launchers


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
