"""The one place where the graph side calls the Triton launchers of ``fuser.kernels``.

Each function returns the kernel's output, or None when no kernel covers the case (then the op runs its
torch reference, which is always correct). Which cases those are is decided by ``fuser.kernels`` itself
(``conv2d_supported``) and by :func:`kernel_name`, which the report uses to say where a chain will run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fuser.kernels.epilogue import Epilogue
from fuser.kernels.precision import Precision


def kernel_name(
    op: str,
    *,
    in_channels: int = 0,
    out_channels: int = 0,
    groups: int = 1,
    kernel_size: Sequence[int] = (1, 1),
    stride: Sequence[int] = (1, 1),
) -> str:
    """Which kernel a fused op runs on the Triton backends (for the report)."""
    if op == "gemm":
        return "gemm"
    from fuser import kernels

    if not kernels.conv2d_supported(in_channels, out_channels, groups):
        return f"torch reference (grouped conv, groups={groups})"
    if groups > 1 and groups == in_channels == out_channels:
        return "depthwise"
    if tuple(kernel_size) == (1, 1) and tuple(stride) == (1, 1) and groups == 1:
        return "gemm (1x1 conv)"
    return "implicit-gemm conv"


def pack_conv(weight: torch.Tensor, groups: int, precision: Precision) -> torch.Tensor | None:
    """The conv weight packed for the kernels, or None where they do not run this conv."""
    from fuser import kernels

    if not kernels.conv2d_supported(weight.shape[1] * groups, weight.shape[0], groups):
        return None
    return kernels.pack_conv_weight(weight, precision, groups=groups).data


def pack_gemm(weight: torch.Tensor, precision: Precision) -> torch.Tensor:
    from fuser import kernels

    return kernels.pack_gemm_weight(weight, precision).data


def conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    packed: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    epilogue: Epilogue,
    precision: Precision,
    *,
    interpret: bool,
) -> torch.Tensor | None:
    from fuser import kernels

    c_out, c_in_per_group, kh, kw = weight.shape
    if not kernels.conv2d_supported(c_in_per_group * groups, c_out, groups):
        return None
    if packed is None:
        packed = pack_conv(weight, groups, precision)
    packed_weight = kernels.PackedConvWeight.from_packed(
        packed,
        out_channels=c_out,
        in_channels=c_in_per_group * groups,
        kernel_size=(kh, kw),
        groups=groups,
        precision=precision,
    )
    return kernels.conv2d_act(
        x,
        packed_weight,
        bias,
        stride=tuple(stride),
        padding=tuple(padding),
        dilation=tuple(dilation),
        epilogue=epilogue,
        residual=residual,
        interpret=interpret,
    )


def gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    packed: torch.Tensor | None,
    epilogue: Epilogue,
    precision: Precision,
    *,
    interpret: bool,
) -> torch.Tensor | None:
    from fuser import kernels

    if packed is None:
        packed = pack_gemm(weight, precision)
    packed_weight = kernels.PackedGemmWeight.from_packed(
        packed, out_features=weight.shape[0], in_features=weight.shape[1], precision=precision
    )
    return kernels.gemm_act(a, packed_weight, bias, epilogue=epilogue, residual=residual, interpret=interpret)
