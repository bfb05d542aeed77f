"""Float64 references and case builders shared by the kernel tests (CPU and GPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fuser.activations import ACTIVATIONS
from fuser.kernels import Epilogue, Residual
from fuser.kernels.epilogue import apply_epilogue_torch

# Every row of the activation table, each with a residual placement and a scale: each axis is covered (every
# activation, residual none / before / after, scale on and off) without the full cross product. Derived from
# the table, so a new row is in every kernel epilogue test (tests/kernels/test_kernels_activations.py checks).
_RESIDUALS = (Residual.NONE, Residual.BEFORE_ACT, Residual.AFTER_ACT)
_SCALES = (1.0, 1.0, 0.5, 1.0, 1.7)
EPILOGUES = [
    Epilogue(
        row.act,
        alpha=0.1 if row.alpha_arg else 0.0,
        residual=_RESIDUALS[i % len(_RESIDUALS)],
        scale=_SCALES[i % len(_SCALES)],
    )
    for i, row in enumerate(ACTIVATIONS)
]


@dataclass(frozen=True)
class ConvCase:
    name: str
    batch: int
    c_in: int
    c_out: int
    hw: tuple[int, int]
    kernel: int
    stride: int = 1
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)  # top, bottom, left, right
    dilation: int = 1
    groups: int = 1

    def __str__(self) -> str:
        return self.name


def conv_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    case: ConvCase,
    epilogue: Epilogue,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """conv2d -> epilogue in float64 (asymmetric padding through F.pad)."""
    top, bottom, left, right = case.padding
    x64 = F.pad(x.double(), (left, right, top, bottom))
    y = F.conv2d(x64, w.double(), None, case.stride, 0, case.dilation, case.groups)
    bias = None if b is None else b.double()[:, None, None]
    return apply_epilogue_torch(y, bias, epilogue, None if residual is None else residual.double())


def gemm_reference(
    a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, epilogue: Epilogue, residual: torch.Tensor | None
) -> torch.Tensor:
    y = a.double() @ w.double().T
    return apply_epilogue_torch(
        y, None if b is None else b.double(), epilogue, None if residual is None else residual.double()
    )


def conv_output_hw(case: ConvCase) -> tuple[int, int]:
    top, bottom, left, right = case.padding
    h, w = case.hw
    span = case.dilation * (case.kernel - 1) + 1
    return (h + top + bottom - span) // case.stride + 1, (w + left + right - span) // case.stride + 1


def conv_inputs(
    case: ConvCase,
    epilogue: Epilogue,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    channels_last: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random x, weight, bias (BN-folded-like: non-zero, varied) and a residual if the epilogue has one."""
    x = torch.randn(case.batch, case.c_in, *case.hw, device=device).to(dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    fan_in = case.c_in // case.groups * case.kernel * case.kernel
    w = torch.randn(case.c_out, case.c_in // case.groups, case.kernel, case.kernel, device=device) / fan_in**0.5
    b = torch.randn(case.c_out, device=device)
    residual = None
    if epilogue.residual != Residual.NONE:
        residual = torch.randn(case.batch, case.c_out, *conv_output_hw(case), device=device).to(dtype)
    return x, w, b, residual
