"""The one place where the graph side calls the Triton launchers of ``fuser.kernels``.

:func:`conv2d` and :func:`gemm` return a call that runs the kernel for every call shaped like the example
one (the launch plan is built once), or None when no kernel covers the case (then the op runs its torch
reference, which is always correct). Which cases those are is decided by ``fuser.kernels`` itself
(``conv2d_supported``) and by :func:`kernel_name`, which the report uses to say where a chain will run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fuser.kernels.epilogue import Epilogue
from fuser.kernels.precision import Precision
from fuser.lower.backends import KERNEL_DTYPES
from fuser.lower.conv_geometry import ConvGeometry, conv_padding


def kernel_name(
    op: str,
    *,
    in_channels: int = 0,
    out_channels: int = 0,
    groups: int = 1,
    kernel_size: Sequence[int] = (1, 1),
    stride: Sequence[int] = (1, 1),
    padding: int | str | Sequence[int] = 0,
    dilation: Sequence[int] = (1, 1),
    compiled: bool = True,
) -> str:
    """Which kernel a fused op runs on the Triton backends (for the report): the kernels' own decision
    (``fuser.kernels.conv_choice``), the one the launcher acts on, and where the halo conv (conv_halo.py) may take
    a call instead on this machine, that too (its route depends on the call's batch and image size); ``compiled``
    False (the interpreter backend) never takes that route."""
    if op == "gemm":
        return "gemm"
    from fuser.kernels.conv_choice import conv_kernel
    from fuser.kernels.conv_halo import halo_possible

    kernel = conv_kernel(in_channels, out_channels, groups, kernel_size, stride, padding)
    if kernel is None:
        return f"torch reference (grouped conv, groups={groups})"
    padding4 = conv_padding(padding, kernel_size, dilation)  # "same" and pairs as the fused module holds them
    if compiled and halo_possible(in_channels, out_channels, groups, kernel_size, stride, padding4, dilation):
        return f"{kernel.value}, or the halo conv on large grids"  # conv_halo.halo_tile decides per call
    return kernel.value


def conv_kernel_name(
    weight_shape: Sequence[int],
    groups: int,
    stride: Sequence[int],
    padding: int | str | Sequence[int],
    dilation: Sequence[int],
    backend: str,
) -> str:
    """:func:`kernel_name` of a fused conv whose weight is ``[C_out, C_in / groups, kh, kw]``, on ``backend``: the
    halo route is named only where the backend runs compiled kernels (the interpreter never takes it)."""
    c_out, c_in_group, kh, kw = weight_shape
    return kernel_name(
        "conv",
        compiled=backend in ("auto", "triton", "measured"),
        in_channels=c_in_group * groups,
        out_channels=c_out,
        groups=groups,
        kernel_size=(kh, kw),
        stride=stride,
        padding=padding,
        dilation=dilation,
    )


def pack_conv(
    weight: torch.Tensor, groups: int, precision: Precision, input_gain: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The conv weight packed for the kernels, or None where they do not run this conv."""
    from fuser import kernels

    if not kernels.conv2d_supported(weight.shape[1] * groups, weight.shape[0], groups):
        return None
    return kernels.pack_conv_weight(weight, precision, groups=groups, input_gain=input_gain).data


def pack_gemm(weight: torch.Tensor, precision: Precision, input_gain: torch.Tensor | None = None) -> torch.Tensor:
    from fuser import kernels

    return kernels.pack_gemm_weight(weight, precision, input_gain=input_gain).data


def _residual_fits(residual: torch.Tensor | None, out_shape: Sequence[int]) -> bool:
    """False when adding ``residual`` would broadcast the output to a larger shape (the reference handles it)."""
    if residual is None:
        return True
    try:
        return tuple(torch.broadcast_shapes(tuple(out_shape), residual.shape)) == tuple(out_shape)
    except RuntimeError:
        return False


Call = Callable[..., torch.Tensor]


def conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    packed: torch.Tensor | None,
    geometry: ConvGeometry,
    epilogue: Epilogue,
    precision: Precision,
    *,
    interpret: bool,
    out: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
    cat_with: torch.Tensor | None = None,
    upsample: int = 1,
    input_affine: torch.Tensor | None = None,
    input_act: int = 0,
    pool: torch.Tensor | None = None,
) -> Call | None:
    """``call(x, residual, out=None, input_scale=None, cat_with=None, pool=None)`` running the kernel for every
    call shaped like this one, or None. With an example ``out`` it stores into every ``out`` shaped and strided
    like it; with an example ``input_scale`` it computes the conv of ``x * input_scale`` for every
    ``input_scale`` like it; with a ``cat_with``, the conv of ``cat([upsample_nearest(x, upsample),
    cat_with], 1)`` without materializing it (see :func:`virtual_cat_applies`). ``input_affine`` (a
    constant of the call) makes it the conv of ``input_act(x * s + t)`` (see :func:`affine_prologue_applies`).
    With an example ``pool`` it also writes the output's mean over its pixels into every ``pool`` like it
    (see :func:`pool_applies`)."""
    from fuser import kernels

    groups = geometry.groups
    c_out, c_in_per_group, kh, kw = weight.shape
    if not kernels.conv2d_supported(c_in_per_group * groups, c_out, groups) or x.dim() != 4:
        return None
    if x.dtype not in KERNEL_DTYPES or weight.dtype not in KERNEL_DTYPES:
        return None
    if input_scale is not None and not scale_prologue_applies(x, input_scale, weight, geometry, cat_with):
        return None
    if cat_with is not None and not virtual_cat_applies(x, cat_with, upsample, weight, geometry):
        return None
    if input_affine is not None and not affine_prologue_applies(
        x, input_affine, input_scale, weight, geometry, cat_with
    ):
        return None
    if cat_with is None and upsample != 1:
        return None
    if pool is not None and not pool_applies(x, pool, weight, geometry, cat_with):
        return None
    oh, ow = geometry.output_size((x if cat_with is None else cat_with).shape[2:], (kh, kw))
    if not _residual_fits(residual, (x.shape[0], c_out, oh, ow)):
        return None
    if packed is None:
        packed = pack_conv(weight, groups, precision)
    packed_weight = kernels.PackedConvWeight.from_parts(
        packed, c_out, c_in_per_group * groups, kh, kw, groups, precision
    )
    plan = kernels.conv2d_act_plan(
        x,
        packed_weight,
        bias,
        stride=geometry.stride,
        padding=geometry.padding,
        dilation=geometry.dilation,
        epilogue=epilogue,
        residual=residual,
        out=out,
        interpret=interpret,
        input_scale=input_scale,
        cat_with=cat_with,
        upsample=upsample,
        input_affine=input_affine,
        input_act=input_act,
        pool=pool,
    )
    # the plan uses the strides of out, input_scale, cat_with and pool: it is only ever called with ones like them
    return lambda x, residual, out=None, input_scale=None, cat_with=None, pool=None: plan(
        x, packed, bias, residual, out, input_scale, cat_with, input_affine, pool
    )


def pool_applies(
    x: torch.Tensor,
    pool: torch.Tensor,
    weight: torch.Tensor,
    geometry: ConvGeometry,
    cat_with: torch.Tensor | None = None,
) -> bool:
    """Whether the kernel also writes the output's mean over its pixels into ``pool``: a contiguous
    ``[N, C_out]`` of ``x``'s dtype and device, and a depthwise conv (the depthwise kernel sums it in its
    epilogue; no other kernel does). Elsewhere the reference computes the mean of the output."""
    from fuser.kernels.conv_choice import ConvKernel, conv_kernel

    if type(pool) is not torch.Tensor or pool.dtype != x.dtype or pool.device != x.device or cat_with is not None:
        return False
    c_out, c_in_g, kh, kw = weight.shape
    if tuple(pool.shape) != (x.shape[0], c_out) or not pool.is_contiguous():
        return False
    kernel = conv_kernel(c_in_g * geometry.groups, c_out, geometry.groups, (kh, kw), geometry.stride, geometry.padding)
    return kernel == ConvKernel.DEPTHWISE


def virtual_cat_applies(
    x: torch.Tensor, cat_with: torch.Tensor, upsample: int, weight: torch.Tensor, geometry: ConvGeometry
) -> bool:
    """Whether the implicit-GEMM kernel reads ``cat([upsample_nearest(x, upsample), cat_with], 1)`` itself:
    two 4-D sources of one dtype and device that concatenate, ``x``'s channels a multiple of the smallest
    channel block, an ungrouped conv on the tensor-core kernels. Elsewhere the reference concatenates."""
    from fuser.kernels.conv import VIRTUAL_CAT_ALIGN
    from fuser.kernels.conv_choice import conv_kernel

    if type(cat_with) is not torch.Tensor or cat_with.dim() != 4 or x.dim() != 4 or type(upsample) is not int:
        return False
    if cat_with.dtype != x.dtype or cat_with.device != x.device or upsample < 1:
        return False
    n, c_a, h, w = x.shape
    if (cat_with.shape[0], cat_with.shape[2], cat_with.shape[3]) != (n, h * upsample, w * upsample):
        return False
    c_out, c_in, kh, kw = weight.shape
    kernel = conv_kernel(c_in, c_out, geometry.groups, (kh, kw), geometry.stride, geometry.padding)
    return (
        c_a % VIRTUAL_CAT_ALIGN == 0
        and c_a + cat_with.shape[1] == c_in
        and geometry.groups == 1
        and kernel is not None
        and kernel.tensor_cores
    )


def scale_prologue_applies(
    x: torch.Tensor,
    input_scale: torch.Tensor,
    weight: torch.Tensor,
    geometry: ConvGeometry,
    cat_with: torch.Tensor | None = None,
) -> bool:
    """Whether a kernel computes ``conv(x * input_scale)`` itself: a scale of ``x``'s dtype and shape
    ``[N or 1, C_in, 1, 1]`` (one factor per image and channel), and a kernel with the operand prologue
    (every one but the RGB stem's direct conv). Elsewhere the reference multiplies first."""
    from fuser.kernels.conv_choice import ConvKernel, conv_kernel

    if type(input_scale) is not torch.Tensor or input_scale.dim() != 4 or input_scale.dtype != x.dtype:
        return False
    if input_scale.device != x.device:
        return False
    n, c_in = x.shape[0], x.shape[1] + (0 if cat_with is None else cat_with.shape[1])
    if input_scale.shape[0] not in (1, n) or input_scale.shape[1] != c_in or input_scale.shape[2:] != (1, 1):
        return False
    c_out, _, kh, kw = weight.shape
    groups = geometry.groups
    kernel = conv_kernel(c_in, c_out, groups, (kh, kw), geometry.stride, geometry.padding)
    return kernel is not None and kernel != ConvKernel.DIRECT


def affine_prologue_applies(
    x: torch.Tensor,
    affine: torch.Tensor,
    input_scale: torch.Tensor | None,
    weight: torch.Tensor,
    geometry: ConvGeometry,
    cat_with: torch.Tensor | None = None,
) -> bool:
    """Whether a kernel computes the conv of ``act(x * s + t)`` itself: a float32 ``[C_in, 2]`` affine on
    ``x``'s device, no channel scale as well (both would be the prologue), and a kernel with the operand
    prologue. Elsewhere the reference applies it first."""
    from fuser.kernels.conv_choice import ConvKernel, conv_kernel

    if input_scale is not None or type(affine) is not torch.Tensor or affine.dtype != torch.float32:
        return False
    c_in = x.shape[1] + (0 if cat_with is None else cat_with.shape[1])
    if tuple(affine.shape) != (c_in, 2) or affine.device != x.device or not affine.is_contiguous():
        return False
    c_out, _, kh, kw = weight.shape
    kernel = conv_kernel(c_in, c_out, geometry.groups, (kh, kw), geometry.stride, geometry.padding)
    return kernel is not None and kernel != ConvKernel.DIRECT


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
) -> Call | None:
    """``call(a, residual)`` running the kernel for every call shaped like this one, or None."""
    from fuser import kernels

    n, k = weight.shape
    out_shape = (*a.shape[:-1], n)
    if a.dim() == 0 or not _residual_fits(residual, out_shape):
        return None
    if a.dtype not in KERNEL_DTYPES or weight.dtype not in KERNEL_DTYPES:
        return None
    if packed is None:
        packed = pack_gemm(weight, precision)
    packed_weight = kernels.PackedGemmWeight.from_parts(packed, n, k, precision)
    if a.dim() in (2, 3):
        plan = kernels.gemm_act_plan(a, packed_weight, bias, epilogue=epilogue, residual=residual, interpret=interpret)
        return lambda a, residual: plan(a, packed, bias, residual)
    # 1-D and 4-D+ inputs: the kernel sees the rows as one 2-D matrix.
    res = None if residual is None else residual.expand(out_shape).reshape(-1, n)
    plan = kernels.gemm_act_plan(
        a.reshape(-1, k), packed_weight, bias, epilogue=epilogue, residual=res, interpret=interpret
    )

    def call(a: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        res = None if residual is None else residual.expand(out_shape).reshape(-1, n)
        return plan(a.reshape(-1, k), packed, bias, res).reshape(out_shape)

    return call
