"""Weights packed once, at optimize time, in the layout and dtype the fused kernels read.

GEMM layout (convolutions and linear layers): ``[C_out, K_pad]`` with ``K = KH * KW * C_in / groups``
ordered ``(kh, kw, c)`` and contiguous, zero-padded to a multiple of 16 elements. The padding makes
every row start 16-byte aligned, which tensor descriptors (TMA) require, and the zeros add nothing to
a dot. Depthwise layout (``groups == C_in == C_out > 1``): ``[KH * KW, C]``, channels contiguous, so a
tile of channels at one tap is one vector load. Direct layout (the few-channel convs of direct_conv.py, the RGB
stem): float32 ``[groups * K, columns]``, row ``g * K + k`` holding the output channels of group ``g`` for
reduction index ``k`` (ordered ``(kh, kw, c)``), zero-padded to :func:`direct_columns`: each filter tap's
weights for a tile of channels are one unmasked vector load that every lane shares, and the kernel multiplies
on the FMA units in float32 (bf16 / fp16 policies round the values to their dtype first; nothing is rounded to
TF32, since no tensor core reads them).

Under "tf32" a dot whose activation operand reaches the tensor cores unrounded (they truncate it) gets its
weights multiplied, per input channel, by ``input_gain`` before they are rounded (see
:func:`scale_input_channels`): the graph side (fuser.rewrite.tf32_rounding) passes TRUNCATION_GAIN for the channels
no producer stored rounded, which cancels truncation's average bias at no cost per call.

The operand dtype comes from the precision: bf16 / fp16 cast here, once; tf32, tf32x3 and ieee keep
float32 (those are ways of doing a float32 dot). The cast is rounded from the float32 value.

Both dataclasses can be rebuilt from ``(data tensor, ints, precision string)`` with ``from_parts``, so
the graph side can pass them through a ``torch.library`` custom op, whose schema holds only tensors
and scalars.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .conv_choice import ConvKernel, conv_kernel, is_depthwise
from .precision import Precision, round_to_tf32

K_ALIGN = 16  # elements: 64 bytes in float32, 32 bytes in 16-bit, both multiples of TMA's 16


def operand_dtype(precision: Precision) -> torch.dtype:
    """The dtype a dot's operands have under ``precision``."""
    return precision.operand_dtype or torch.float32


def direct_block_n(c_out_g: int) -> int:
    """The channel tile of the direct kernel: the group's output channels rounded up to a power of two, 16 to 64."""
    return min(64, max(16, 1 << max(0, c_out_g - 1).bit_length()))


def direct_columns(c_out_g: int) -> int:
    """Columns of the direct layout: ``c_out_g`` rounded up to whole channel tiles (:func:`direct_block_n`)."""
    block = direct_block_n(c_out_g)
    return -(-c_out_g // block) * block


def padded_k(k: int) -> int:
    """``k`` rounded up to the packing alignment."""
    return -(-k // K_ALIGN) * K_ALIGN


@dataclass(frozen=True)
class PackedConvWeight:
    """A convolution weight packed for :func:`fuser.kernels.conv2d_act`.

    ``data`` is ``[C_out, K_pad]`` (GEMM layout) or ``[KH * KW, C]`` (depthwise layout) in the precision's
    operand dtype, or float32 ``[groups * K, direct_columns(C_out / groups)]`` (direct layout); see the module
    docstring.
    """

    data: torch.Tensor
    out_channels: int
    in_channels: int
    kernel_size: tuple[int, int]
    groups: int
    precision: Precision

    @property
    def depthwise(self) -> bool:
        return is_depthwise(self.in_channels, self.out_channels, self.groups)

    @property
    def direct(self) -> bool:
        """True where the direct kernel (few input channels per group, FMA units) runs this conv."""
        return conv_kernel(self.in_channels, self.out_channels, self.groups, self.kernel_size) == ConvKernel.DIRECT

    @property
    def k_total(self) -> int:
        """The GEMM reduction length ``KH * KW * C_in / groups`` (before padding)."""
        return self.kernel_size[0] * self.kernel_size[1] * (self.in_channels // self.groups)

    @classmethod
    def from_parts(
        cls,
        data: torch.Tensor,
        out_channels: int,
        in_channels: int,
        kernel_h: int,
        kernel_w: int,
        groups: int,
        precision: Precision | str,
    ) -> PackedConvWeight:
        """Rebuild from plain values (what a custom op's schema can carry), checking they agree."""
        packed = cls(
            data,
            int(out_channels),
            int(in_channels),
            (int(kernel_h), int(kernel_w)),
            int(groups),
            Precision.parse(precision),
        )
        packed._check()
        return packed

    def _check(self) -> None:
        _check_groups(self.in_channels, self.out_channels, self.groups)
        kh, kw = self.kernel_size
        if self.depthwise:
            expected, dtype = (kh * kw, self.out_channels), operand_dtype(self.precision)
        elif self.direct:
            expected = (self.groups * self.k_total, direct_columns(self.out_channels // self.groups))
            dtype = torch.float32
        else:
            expected, dtype = (self.out_channels, padded_k(self.k_total)), operand_dtype(self.precision)
        if tuple(self.data.shape) != expected or self.data.dtype != dtype or not self.data.is_contiguous():
            raise ValueError(
                f"packed conv weight data is {tuple(self.data.shape)} {self.data.dtype}"
                f"{'' if self.data.is_contiguous() else ' non-contiguous'}; expected contiguous {expected} "
                f"{dtype} for C_out={self.out_channels}, C_in={self.in_channels}, kernel {kh}x{kw}, "
                f"groups={self.groups}, precision {self.precision.value}"
            )


@dataclass(frozen=True)
class PackedGemmWeight:
    """A linear weight ``[N, K]`` packed for :func:`fuser.kernels.gemm_act` as ``[N, K_pad]``."""

    data: torch.Tensor
    out_features: int
    in_features: int
    precision: Precision

    @classmethod
    def from_parts(
        cls, data: torch.Tensor, out_features: int, in_features: int, precision: Precision | str
    ) -> PackedGemmWeight:
        """Rebuild from plain values (what a custom op's schema can carry), checking they agree."""
        packed = cls(data, int(out_features), int(in_features), Precision.parse(precision))
        expected = (packed.out_features, padded_k(packed.in_features))
        dtype = operand_dtype(packed.precision)
        if tuple(data.shape) != expected or data.dtype != dtype or not data.is_contiguous():
            raise ValueError(
                f"packed gemm weight data is {tuple(data.shape)} {data.dtype}; expected contiguous "
                f"{expected} {dtype} for N={packed.out_features}, K={packed.in_features}, "
                f"precision {packed.precision.value}"
            )
        return packed


def _check_groups(in_channels: int, out_channels: int, groups: int) -> None:
    if groups < 1 or in_channels % groups or out_channels % groups:
        raise ValueError(f"groups={groups} must divide both C_in={in_channels} and C_out={out_channels}")


def scale_input_channels(weight: torch.Tensor, gain: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """``weight`` (``[C_out, C_in / groups, ...]``, a conv's or a linear's ``[N, K]``) with the columns that
    multiply input channel ``c`` scaled by ``gain[c]`` (``gain`` has ``C_in`` entries); a new tensor."""
    c_out, c_in_g = weight.shape[:2]
    if gain.numel() != c_in_g * groups:
        raise ValueError(f"input gain has {gain.numel()} entries for a weight of {c_in_g * groups} input channels")
    per_row = gain.to(weight).reshape(groups, c_in_g).repeat_interleave(c_out // groups, 0)
    return weight * per_row.reshape(c_out, c_in_g, *([1] * (weight.dim() - 2)))


def _pad_k(weight_2d: torch.Tensor, precision: Precision, tensor_cores: bool = True) -> torch.Tensor:
    """``[N, K]`` as the kernels read it: in the operand dtype, K padded, and rounded to TF32 where the
    tensor cores will read it under "tf32" (see round_to_tf32)."""
    k = weight_2d.shape[1]
    data = weight_2d.to(operand_dtype(precision))
    if tensor_cores and precision == Precision.TF32:
        data = round_to_tf32(data)
    return F.pad(data, (0, padded_k(k) - k)).contiguous()


def pack_conv_weight(
    weight: torch.Tensor, precision: Precision | str, groups: int = 1, input_gain: torch.Tensor | None = None
) -> PackedConvWeight:
    """Pack a ``[C_out, C_in / groups, KH, KW]`` convolution weight (the BN already folded into it).

    ``input_gain`` (``C_in`` factors, or None) scales the weight per input channel where the tensor cores
    read it under "tf32" (see the module docstring); it is ignored elsewhere. Returns new tensors on
    ``weight``'s device; ``weight`` itself is not modified.
    """
    precision = Precision.parse(precision)
    if weight.dim() != 4:
        raise ValueError(f"conv weight must be 4-D [C_out, C_in/groups, KH, KW], got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"conv weight must be floating point, got {weight.dtype}")
    c_out, c_in_g, kh, kw = weight.shape
    in_channels = c_in_g * groups
    _check_groups(in_channels, c_out, groups)
    dtype = operand_dtype(precision)
    w = weight.detach()
    kernel = conv_kernel(in_channels, c_out, groups, (kh, kw))
    if is_depthwise(in_channels, c_out, groups):
        data = w.reshape(c_out, kh * kw).t().to(dtype).contiguous()
    elif kernel == ConvKernel.DIRECT:
        data = _direct_layout(w, groups, dtype)
    else:
        flat = w.permute(0, 2, 3, 1).reshape(c_out, kh * kw * c_in_g)
        tensor_cores = kernel is not None and kernel.tensor_cores
        if input_gain is not None and tensor_cores and precision == Precision.TF32:
            flat = scale_input_channels(w, input_gain, groups).permute(0, 2, 3, 1).reshape(c_out, kh * kw * c_in_g)
        data = _pad_k(flat, precision, tensor_cores=tensor_cores)
    return PackedConvWeight(data, int(c_out), int(in_channels), (int(kh), int(kw)), int(groups), precision)


def _direct_layout(w: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """``w [C_out, C_in / groups, KH, KW]`` in the direct layout: rounded to the operand ``dtype``, held in float32
    (the kernel's FMAs are float32; the values stay exact), ``[groups * K, direct_columns(C_out / groups)]``."""
    c_out, c_in_g, kh, kw = w.shape
    c_out_g = c_out // groups
    per_group = w.to(dtype).float().reshape(groups, c_out_g, c_in_g, kh, kw)
    rows = per_group.permute(0, 3, 4, 2, 1).reshape(groups * kh * kw * c_in_g, c_out_g)  # (g, kh, kw, c) x channel
    return F.pad(rows, (0, direct_columns(c_out_g) - c_out_g)).contiguous()


def pack_gemm_weight(
    weight: torch.Tensor, precision: Precision | str, input_gain: torch.Tensor | None = None
) -> PackedGemmWeight:
    """Pack a ``[N, K]`` linear weight (``nn.Linear.weight``'s layout: C = A @ W^T); ``input_gain`` (``K``
    factors or None) as for :func:`pack_conv_weight`."""
    precision = Precision.parse(precision)
    if weight.dim() != 2:
        raise ValueError(f"gemm weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"gemm weight must be floating point, got {weight.dtype}")
    w = weight.detach()
    if input_gain is not None and precision == Precision.TF32:
        w = scale_input_channels(w, input_gain)
    data = _pad_k(w, precision)
    return PackedGemmWeight(data, int(weight.shape[0]), int(weight.shape[1]), precision)
