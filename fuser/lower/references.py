"""The fused ops in plain torch: the "torch" backend, what exporters record, and the oracle of the tests.

Under "bf16" / "fp16" the operands are rounded the way the kernels round them (cast, then computed in
float32), so the reference of a reduced-precision call is that call's arithmetic, not float32's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fuser.activations import apply_activation_torch
from fuser.kernels.epilogue import Epilogue, apply_epilogue_torch
from fuser.kernels.precision import Precision
from fuser.lower.conv_geometry import ConvGeometry


def _round_operands(precision: Precision, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Round float32 operands the way the kernels do under bf16/fp16 (cast, then compute in float32)."""
    dtype = precision.operand_dtype
    if dtype is None:
        return list(tensors)
    return [t.to(dtype).to(t.dtype) if t.dtype == torch.float32 else t for t in tensors]


def conv2d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    geometry: ConvGeometry,
    epilogue: Epilogue,
    precision: Precision = Precision.IEEE,
    input_scale: torch.Tensor | None = None,
    cat_with: torch.Tensor | None = None,
    upsample: int = 1,
    input_affine: torch.Tensor | None = None,
    input_act: int = 0,
) -> torch.Tensor:
    """``epilogue(conv2d(x, weight) + bias)`` in plain torch. With a ``cat_with`` the conv's input is
    ``cat([upsample_nearest(x, upsample), cat_with], 1)`` (the kernels' virtual input); with an
    ``input_scale`` it is then multiplied by it (the channel-scale prologue, in ``x``'s dtype); with an
    ``input_affine`` it becomes ``input_act(x * s + t)`` (:func:`affine_prologue_reference`)."""
    if cat_with is not None:
        up = F.interpolate(x, scale_factor=upsample, mode="nearest") if upsample != 1 else x
        x = torch.cat([up, cat_with], 1)
    if input_scale is not None:
        x = x * input_scale
    if input_affine is not None:
        x = affine_prologue_reference(x, input_affine, input_act)
    x_, w_ = _round_operands(precision, x, weight)
    top, bottom, left, right = geometry.padding
    stride, dilation, groups = geometry.stride, geometry.dilation, geometry.groups
    if top == bottom and left == right:
        y = F.conv2d(x_, w_, bias, stride, (top, left), dilation, groups)
    else:
        y = F.conv2d(F.pad(x_, (left, right, top, bottom)), w_, bias, stride, 0, dilation, groups)
    return apply_epilogue_torch(y, None, epilogue, residual)  # the bias went into the conv: one op fewer


def affine_prologue_reference(x: torch.Tensor, affine: torch.Tensor, act: int) -> torch.Tensor:
    """``act(x * s + t)`` per channel (dim 1 of ``x``; ``affine`` is ``[C, 2]``, columns ``s`` and ``t``),
    computed in float32 (float64 for a float64 ``x``) and rounded to ``x``'s dtype, as the kernels' affine
    prologue does. A conv's zero padding then pads this result, as it pads the activation's output."""
    compute = torch.promote_types(x.dtype, torch.float32)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    s, t = (affine[:, i].to(compute).reshape(shape) for i in (0, 1))
    return apply_activation_torch(x.to(compute) * s + t, act).to(x.dtype)


def gemm_reference(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    epilogue: Epilogue,
    precision: Precision = Precision.IEEE,
) -> torch.Tensor:
    """``epilogue(a @ weight.T + bias)`` in plain torch."""
    a_, w_ = _round_operands(precision, a, weight)
    return apply_epilogue_torch(F.linear(a_, w_, bias), None, epilogue, residual)
