"""Float64 references and case builders shared by the kernel tests (CPU and GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
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
    kernel: int | tuple[int, int]
    stride: int | tuple[int, int] = 1
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)  # top, bottom, left, right
    dilation: int | tuple[int, int] = 1
    groups: int = 1

    def __str__(self) -> str:
        return self.name

    @property
    def kernel_hw(self) -> tuple[int, int]:
        return _pair(self.kernel)


def _pair(v: int | tuple[int, int]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (v[0], v[1])


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
    (h, w), (kh, kw) = case.hw, case.kernel_hw
    (sh, sw), (dh, dw) = _pair(case.stride), _pair(case.dilation)
    return (h + top + bottom - dh * (kh - 1) - 1) // sh + 1, (w + left + right - dw * (kw - 1) - 1) // sw + 1


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
    kh, kw = case.kernel_hw
    fan_in = case.c_in // case.groups * kh * kw
    w = torch.randn(case.c_out, case.c_in // case.groups, kh, kw, device=device) / fan_in**0.5
    b = torch.randn(case.c_out, device=device)
    residual = None
    if epilogue.residual != Residual.NONE:
        residual = torch.randn(case.batch, case.c_out, *conv_output_hw(case), device=device).to(dtype)
    return x, w, b, residual


def record_launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Record every interpreted launch from now on as ``(jit function name, constexpr kwargs)``."""
    from fuser.kernels import launch

    seen: list[tuple[str, dict[str, Any]]] = []
    real = launch.run_interpreted

    def recording(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> None:
        seen.append((kernel.fn.__name__, kwargs))
        real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(launch, "run_interpreted", recording)
    return seen
