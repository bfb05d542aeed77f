"""Which kernel runs a convolution: the one decision that packing, the launch planner and the report read.

Packing needs it to know whether the tensor cores will read the weights (then they are rounded to TF32
under "tf32"; the direct kernel multiplies on the FMA units and keeps them exact) and which layout to
write; the planner to launch that kernel; the report to name it. Computing it in each place let them
disagree, so here it is once. No triton import: the graph side can ask without loading the kernels.

The order, first match wins:

1. depthwise (``groups == C_in == C_out > 1``): the direct depthwise kernel (depthwise.py);
2. at most ``MAX_DIRECT_CIN`` input channels per group and at most ``MAX_DIRECT_TAPS`` multiply-adds per
   output (the RGB stem, any stride or padding): the direct kernel (direct_conv.py);
3. 1x1, stride 1, no padding, one group: the plain GEMM on the NHWC rows (gemm.py);
4. everything else: the implicit GEMM (conv.py), reducing over (tap, channel block) steps from
   ``FLAT_K_BELOW`` input channels per group up, unless a filter of several taps would pad more than
   ``FLAT_K_PAD_ABOVE`` of each tap's channel blocks (then over flat K); below ``FLAT_K_BELOW`` over filter
   rows where a row holds at least ``ROW_RUN_MIN`` to ``ROW_RUN_MAX`` (kw, channel) weights (the 7x7 RGB
   stem, patch embeddings), else over flat K.

Stride and padding only choose between the two tensor-core kernels (3 and 4), so a caller that does not
know them (packing) gets the right layout and rounding from the defaults. Split-K is not a different
kernel: it is a tile configuration of kernels 3 and 4 (splitk.py), chosen per input shape.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

MAX_DIRECT_CIN = 4
MAX_DIRECT_TAPS = 64  # the direct kernel unrolls C_in/groups x KH x KW multiply-adds per output
FLAT_K_BELOW = 16  # below this many input channels per group the flat-K order wastes fewer lanes
# A filter row of KW * C_in/groups weights is one contiguous run of the packed K order and of the NHWC input
# (for each output pixel): from this long a run, reducing row by row decodes the lanes once per row instead
# of every element's (kh, kw, c) and bounds per step, which bound the 7x7 stem at batch 32 (kernels/NOTES.md).
ROW_RUN_MIN = 16
ROW_RUN_MAX = 128  # a row is one K step (conv.py): longer rows take the flat order
# Channel blocks pad each tap's channels to a whole block (``channel_block``), a cost the flat-K order pays once
# per filter instead of once per tap. YOLOv8n's detect head has 80 channels: blocks of 64 make 18 steps of which
# 37.5% are zeros, flat K 12 (720 in 64s). On the H200 (results/conv-tile-sweep-2026-12-04e.json, -04f.json) its
# 80->80 3x3 @80 ran 131.5 us in flat K against 178 for the best channel-block tile at batch 32 fp16, 275 against
# 297 in tf32 (whose 32-wide blocks pad 17%), 9.2 against 11.1 at batch 1 fp16, and 15.4 against 14.7 at batch 1
# tf32 (the one regime it lost, by 5%). Measured on 80 channels only; 48, 96 and 144 pad 25% and stay in blocks.
FLAT_K_PAD_ABOVE = 0.25


class ConvKernel(str, enum.Enum):
    """A conv kernel; the value is the name the report prints."""

    DEPTHWISE = "depthwise"
    DIRECT = "direct conv"
    GEMM_1X1 = "gemm (1x1 conv)"
    IMPLICIT_GEMM = "implicit-gemm conv"
    IMPLICIT_GEMM_FLAT_K = "implicit-gemm conv (flat K)"
    IMPLICIT_GEMM_ROW_RUNS = "implicit-gemm conv (filter rows)"

    @property
    def triton_function(self) -> str:
        """The name of the ``@triton.jit`` function this choice launches (a split-K tile configuration
        launches the shared reduction kernel after it)."""
        return {
            ConvKernel.DEPTHWISE: "_depthwise_act_kernel",
            ConvKernel.DIRECT: "_direct_conv_act_kernel",
            ConvKernel.GEMM_1X1: "_gemm_act_kernel",
        }.get(self, "_conv2d_act_kernel")

    @property
    def tensor_cores(self) -> bool:
        """Whether the kernel's dot reads the weights on the tensor cores."""
        return self not in (ConvKernel.DEPTHWISE, ConvKernel.DIRECT)


def is_depthwise(in_channels: int, out_channels: int, groups: int) -> bool:
    """True for convolutions that take the direct depthwise kernel."""
    return groups > 1 and groups == in_channels == out_channels


def _has_padding(padding: int | str | Sequence[int]) -> bool:
    if isinstance(padding, str):  # "valid" is none; "same" is none for the only kernel size it matters for, 1x1
        return False
    if isinstance(padding, int):
        return padding != 0
    return any(int(p) != 0 for p in padding)


def conv_kernel(
    in_channels: int,
    out_channels: int,
    groups: int,
    kernel_size: Sequence[int],
    stride: Sequence[int] = (1, 1),
    padding: int | str | Sequence[int] = 0,
) -> ConvKernel | None:
    """The kernel that runs this convolution, or None when no kernel does (groups not dividing both
    channel counts: the torch reference runs it)."""
    if groups < 1 or in_channels < 1 or in_channels % groups or out_channels % groups:
        return None
    kh, kw = (int(k) for k in kernel_size)
    c_in_g = in_channels // groups
    if is_depthwise(in_channels, out_channels, groups):
        return ConvKernel.DEPTHWISE
    if c_in_g <= MAX_DIRECT_CIN and c_in_g * kh * kw <= MAX_DIRECT_TAPS:
        return ConvKernel.DIRECT
    if (kh, kw) == (1, 1) and tuple(stride) == (1, 1) and not _has_padding(padding) and groups == 1:
        return ConvKernel.GEMM_1X1
    return reduction_order(c_in_g, kh, kw)


def channel_block(c_in_g: int) -> int:
    """The channel block of a 16-bit implicit GEMM over ``c_in_g`` channels per tap (conv.py's
    ``conv_candidates``; float32 operands take half of it from 64): the channels' power of two, 16 to 64."""
    return min(64, max(16, 1 << (c_in_g - 1).bit_length()))


def channel_padding(c_in_g: int) -> float:
    """The share of a tap's channel-block lanes that are zeros: 0.375 for 80 channels in two blocks of 64."""
    block = channel_block(c_in_g)
    return 1 - c_in_g / (-(-c_in_g // block) * block)


def flat_k_width(c_in_g: int, operand_bytes: int) -> int:
    """The widest K step of a flat-K launch (conv.py's ``conv_candidates``): 64, or 32 where flat K stands in for
    padded channel blocks (``c_in_g`` from ``FLAT_K_BELOW``) on float32 operands, the width of the blocks there.
    A float32 stage of 128x128 tiles then takes 32 KiB, so three stages leave room for a second program per SM:
    on YOLOv8n's 80->80 3x3 @80 (results/conv-tile-sweep-2026-12-04h.json, tf32) 225 us against 276 at batch 32
    and 14.9 against 15.8 at batch 1."""
    return 32 if operand_bytes == 4 and c_in_g >= FLAT_K_BELOW else 64


def reduction_order(c_in_g: int, kh: int, kw: int) -> ConvKernel:
    """How the implicit GEMM walks its reduction for ``c_in_g`` input channels per group and a ``kh x kw``
    filter: one of the three ``IMPLICIT_GEMM*`` choices (conv.py's ``K_ORDER``)."""
    if c_in_g >= FLAT_K_BELOW:
        padded = kh * kw > 1 and channel_padding(c_in_g) > FLAT_K_PAD_ABOVE
        return ConvKernel.IMPLICIT_GEMM_FLAT_K if padded else ConvKernel.IMPLICIT_GEMM
    rows = ROW_RUN_MIN <= kw * c_in_g <= ROW_RUN_MAX
    return ConvKernel.IMPLICIT_GEMM_ROW_RUNS if rows else ConvKernel.IMPLICIT_GEMM_FLAT_K
