"""A 3x3 conv whose tile reads its input once per channel block, as three column-shifted halos, in Gluon
(kernels/NOTES.md version 23).

Why: the shipped implicit GEMM's box tiles (conv_boxes.py) load one activation box per filter tap, nine per
channel block, and on YOLOv8n's 64->64 3x3 @80 at batch 32 that traffic (with the tap's weights, through L2) is
what NOTES versions 20-22 could not cut in Triton: a shared-memory tile cannot be read at a shifted offset there.
Here a tile of ``BH x BW`` output pixels loads, per channel block, the three boxes of ``BH + 2`` input rows by
``BW`` columns that start one column left of, at and right of the tile (``kw`` = 0, 1, 2). Tap ``(kh, kw)``'s
activation operand is then rows ``kh .. kh + BH`` of box ``kw``: ``BH * BW`` consecutive pixels of shared memory,
fed to wgmma from there. The boxes sit one after another in one allocation, ``BH + 2`` rows each, so a tap's
operand starts a whole number of image rows in; with ``BW * BLOCK_K`` elements a multiple of 1024 bytes that
offset is a multiple of the 128-byte swizzle's 1024-byte pattern, which keeps each view a plain NVMMA operand.
Per 128-pixel tile and 64-channel block that is 3 x 10 x 16 pixels read (60 KiB in fp16) instead of 9 x 128
(144 KiB). The weights stream through ``W_BUFS`` shared-memory buffers, one tap per buffer, refilled as soon as
the wgmma reading them has retired; wgmma runs asynchronously one step behind the loads.

TMA boxes must have power-of-two sides, so each column-shifted box is two copies: ``BH`` rows and 2 rows. The
descriptor's zero fill past the image's edges is the padding, and its clipping of the output box makes partial
tiles at the right and bottom edges safe.

Scope: a 3x3 filter at stride 1 with padding 1, one group, dense channels_last input and output of one dtype
(fp16, bf16, or float32 computed in TF32), ``C_in`` and ``C_out`` such that a pixel row is a multiple of 16
bytes; the implicit GEMM's fused epilogue (bias, activation, a dense residual, scale, TF32-rounded stores).
:func:`halo_refusal` says what is refused, :func:`halo_tile` where conv2d_act routes to it (where it was measured
faster), :func:`triton_refusal` which Tritons compile it.
Gluon compiles for the GPU only: no interpreter runs it; tests/kernels/test_kernels_halo.py compiles it for
sm_90 on the CPU and checks it against float64 on the GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import _unwrap_if_constexpr, builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import constexpr_function

from .epilogue import NO_EPILOGUE, Epilogue, apply_epilogue, round_tf32_tile
from .launch import LaunchOptions
from .packing import PackedConvWeight
from .precision import Precision

# triton 3.9 renamed the TMA copies (3.6: async_copy_global_to_shared / async_copy_shared_to_global)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
SWIZZLE_BYTES = 128  # a pixel's channel block is one 128-byte swizzled row: 64 fp16 or 32 float32 channels


@constexpr_function
def _mma_layout(block_m, block_n, num_warps, operand_bits):
    """The wgmma accumulator layout of a ``[block_m, block_n]`` tile: warps stacked along M first; the
    instruction's K is 32 bytes of the operand."""
    warps_m = min(num_warps, block_m // 16)
    warps_n = num_warps // warps_m
    n = block_n // warps_n
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[warps_m, warps_n], instr_shape=[16, min(n, 256), 256 // operand_bits]
    )


@builtin
def _view(desc, dtype, shape, layout, _semantic=None):
    """``desc``'s memory seen as ``shape`` in ``layout``, from its first element (triton 3.6 names the method
    ``_reinterpret``, 3.9 ``reinterpret``; both lower to the same op)."""
    shape = [_unwrap_if_constexpr(s) for s in shape]
    return _semantic.memdesc_reinterpret(desc, _unwrap_if_constexpr(dtype), shape, _unwrap_if_constexpr(layout))


@gluon.jit
def _load_halo(x_top, x_bottom, halo_rows, bar, image, ih0, iw0, c0, BH: gl.constexpr):
    """The three column-shifted ``(BH + 2) x BW`` boxes of channel block ``c0`` whose top-left input pixel is
    ``(ih0, iw0 + kw)``, into image rows ``kw * (BH + 2)`` on of ``halo_rows`` (``[rows, BW, BLOCK_K]``),
    completing on ``bar``. A subslice must start at a multiple of its length, so each destination is the view
    that starts at its first row, reinterpreted as the descriptor's box."""
    mbarrier.expect(bar, 3 * (x_top.block_type.nbytes + x_bottom.block_type.nbytes))
    for kw in gl.static_range(3):
        top = _view(halo_rows.index(kw * (BH + 2)), x_top.dtype, x_top.block_type.shape, x_top.layout)
        _tma_load(x_top, [image, ih0, iw0 + kw, c0], bar, top)
        bottom = _view(halo_rows.index(kw * (BH + 2) + BH), x_bottom.dtype, x_bottom.block_type.shape, x_bottom.layout)
        _tma_load(x_bottom, [image, ih0 + BH, iw0 + kw, c0], bar, bottom)


@gluon.jit
def _load_step_weight(w_desc, w_tail, w_bufs, w_bars, step, C_IN, n0, FULL_STEPS, W_BUFS: gl.constexpr,
                      BLOCK_K: gl.constexpr, HAS_TAIL: gl.constexpr):  # fmt: skip
    """Reduction step ``step``'s weight tile -- tap ``step % 9`` of channel block ``step // 9``, through ``w_tail``
    (the narrower last block) from step ``FULL_STEPS`` on -- into buffer ``step % W_BUFS``. The packed weight's
    column of (tap, channel) is ``tap * C_in + channel``."""
    block = step // 9
    column = (step - block * 9) * C_IN + block * BLOCK_K
    buf = step % W_BUFS
    bar = w_bars.index(buf)
    if HAS_TAIL:
        if step < FULL_STEPS:
            mbarrier.expect(bar, w_desc.block_type.nbytes)
            _tma_load(w_desc, [n0, column], bar, w_bufs.index(buf))
        else:
            mbarrier.expect(bar, w_tail.block_type.nbytes)
            tail_buf = _view(w_bufs.index(buf), w_tail.dtype, w_tail.block_type.shape, w_tail.layout)
            _tma_load(w_tail, [n0, column], bar, tail_buf)
    else:
        mbarrier.expect(bar, w_desc.block_type.nbytes)
        _tma_load(w_desc, [n0, column], bar, w_bufs.index(buf))


@gluon.jit
def _block_taps(acc, halo_rows, w_bufs, w_bars, first_step, steps, w_desc, w_tail, C_IN, n0, FULL_STEPS,
                K: gl.constexpr, A_LAYOUT: gl.constexpr, B_LAYOUT: gl.constexpr, BH: gl.constexpr,
                BW: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, W_BUFS: gl.constexpr,
                HAS_TAIL: gl.constexpr):  # fmt: skip
    """``acc`` plus the nine taps of one channel block ``K`` wide, whose halo is in ``halo_rows`` and whose
    weights arrive in the ring from step ``first_step`` on; each retired step's buffer is refilled with the step
    ``W_BUFS`` after it. Returns once the block's last wgmma has retired (its halo is then free)."""
    dtype: gl.constexpr = w_bufs.dtype
    for tap in gl.static_range(9):
        step = first_step + tap
        buf = step % W_BUFS
        mbarrier.wait(w_bars.index(buf), (step // W_BUFS) & 1)
        # rows kh .. kh + BH of box kw: a subslice must start at a multiple of its own length, so the operand is
        # the view of BH * BW pixels that starts at image row kh of box kw
        a = _view(halo_rows.index((tap % 3) * (BH + 2) + tap // 3), dtype, [BH * BW, K], A_LAYOUT)
        b = _view(w_bufs.index(buf), dtype, [BLOCK_N, K], B_LAYOUT).permute((1, 0))
        acc = warpgroup_mma(a, b, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # the previous step's wgmma has retired
        refill = step - 1 + W_BUFS
        if step > 0 and refill < steps:
            _load_step_weight(w_desc, w_tail, w_bufs, w_bars, refill, C_IN, n0, FULL_STEPS, W_BUFS, BLOCK_K, HAS_TAIL)
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))


@gluon.jit(do_not_specialize=["C_IN", "tiles_h", "tiles_w"])
def _conv3x3_halo_kernel(
    # tensor descriptors: x_top / x_bottom the input [N, H, W, C_in] in boxes of BH and 2 rows by BW pixels by
    # BLOCK_K channels, x_top_tail / x_bottom_tail the same BLOCK_K_TAIL channels wide (the last, narrower block
    # when HAS_TAIL); w_desc the packed weight [C_out, 9 * C_in] in [BLOCK_N, BLOCK_K] tiles, w_tail in
    # [BLOCK_N, BLOCK_K_TAIL] ones; out_desc the output [N, OH, OW, C_out] in [1, BH, BW, BLOCK_N] boxes,
    # res_desc the residual likewise (out_desc when there is none). bias_ptr: float32 [C_out]
    x_top,
    x_bottom,
    x_top_tail,
    x_bottom_tail,
    w_desc,
    w_tail,
    out_desc,
    res_desc,
    bias_ptr,
    # sizes
    C_IN,
    C_OUT,
    tiles_h,
    tiles_w,
    alpha,
    scale,
    # constexprs: the epilogue's, as the implicit GEMM's (epilogue.py), then the tile's
    HAS_BIAS: gl.constexpr,
    ACT: gl.constexpr,
    RESIDUAL: gl.constexpr,
    HAS_SCALE: gl.constexpr,
    ROUND_TF32: gl.constexpr,
    BH: gl.constexpr,
    BW: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    BLOCK_K_TAIL: gl.constexpr,
    HAS_TAIL: gl.constexpr,
    HALO_ROWS: gl.constexpr,
    W_BUFS: gl.constexpr,
    num_warps: gl.constexpr,
):
    BLOCK_M: gl.constexpr = BH * BW
    dtype: gl.constexpr = x_top.dtype
    bits: gl.constexpr = dtype.primitive_bitwidth
    pid = gl.program_id(0)
    pid_n = gl.program_id(1)
    tw = pid % tiles_w
    th = (pid // tiles_w) % tiles_h
    image = pid // (tiles_w * tiles_h)
    oh0 = th * BH
    ow0 = tw * BW
    n0 = pid_n * BLOCK_N

    # one halo buffer and one weight ring; the tail block reuses both, seen with its narrower rows
    halo4 = gl.allocate_shared_memory(dtype, [1, HALO_ROWS, BW, BLOCK_K], x_top.layout)
    a_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=BLOCK_K * bits // 8, element_bitwidth=bits, rank=2)
    a_tail: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=BLOCK_K_TAIL * bits // 8, element_bitwidth=bits, rank=2
    )
    halo_rows = _view(halo4, dtype, [HALO_ROWS, BW, BLOCK_K], a_layout)
    halo_tail = _view(halo4, dtype, [HALO_ROWS, BW, BLOCK_K_TAIL], a_tail)
    w_bufs = gl.allocate_shared_memory(dtype, [W_BUFS, BLOCK_N, BLOCK_K], w_desc.layout)
    w_bars = gl.allocate_shared_memory(gl.int64, [W_BUFS, 1], mbarrier.MBarrierLayout())
    halo_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(W_BUFS):
        mbarrier.init(w_bars.index(i), count=1)
    mbarrier.init(halo_bar, count=1)

    full_blocks = C_IN // BLOCK_K  # the host makes it at least 1
    full_steps = 9 * full_blocks
    steps = full_steps + 9 * HAS_TAIL
    _load_halo(x_top, x_bottom, halo_rows, halo_bar, image, oh0 - 1, ow0 - 1, 0, BH)
    for s in gl.static_range(W_BUFS):
        if s < steps:
            _load_step_weight(w_desc, w_tail, w_bufs, w_bars, s, C_IN, n0, full_steps, W_BUFS, BLOCK_K, HAS_TAIL)

    mma_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps, bits)
    w_layout: gl.constexpr = w_desc.layout
    w_tail_layout: gl.constexpr = w_tail.layout
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    for block in range(full_blocks):
        mbarrier.wait(halo_bar, block & 1)
        acc = _block_taps(acc, halo_rows, w_bufs, w_bars, block * 9, steps, w_desc, w_tail, C_IN, n0, full_steps,
                          BLOCK_K, a_layout, w_layout, BH, BW, BLOCK_N, BLOCK_K, W_BUFS, HAS_TAIL)  # fmt: skip
        c_next = (block + 1) * BLOCK_K
        if block + 1 < full_blocks:
            _load_halo(x_top, x_bottom, halo_rows, halo_bar, image, oh0 - 1, ow0 - 1, c_next, BH)
        elif HAS_TAIL:
            _load_halo(x_top_tail, x_bottom_tail, halo_tail, halo_bar, image, oh0 - 1, ow0 - 1, c_next, BH)
    if HAS_TAIL:
        mbarrier.wait(halo_bar, full_blocks & 1)
        acc = _block_taps(acc, halo_tail, w_bufs, w_bars, full_steps, steps, w_desc, w_tail, C_IN, n0, full_steps,
                          BLOCK_K_TAIL, a_tail, w_tail_layout, BH, BW, BLOCK_N, BLOCK_K, W_BUFS, HAS_TAIL)  # fmt: skip

    for i in gl.static_range(W_BUFS):
        mbarrier.invalidate(w_bars.index(i))
    mbarrier.invalidate(halo_bar)

    out4 = gl.allocate_shared_memory(dtype, [1, BH, BW, BLOCK_N], out_desc.layout)
    out2 = out4.reshape([BLOCK_M, BLOCK_N])
    if RESIDUAL != 0:  # the residual's box arrives in the output's buffer, which is free until the store
        res_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(res_bar, count=1)
        mbarrier.expect(res_bar, res_desc.block_type.nbytes)
        _tma_load(res_desc, [image, oh0, ow0, n0], res_bar, out4)
        mbarrier.wait(res_bar, 0)
        mbarrier.invalidate(res_bar)
        residual = out2.load(mma_layout).to(gl.float32)
        gl.thread_barrier()  # every warp has read the residual before any overwrites it with the output
    else:
        residual = 0.0
    channels = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
    if HAS_BIAS:  # noqa: SIM108  (a constexpr branch: only one side is compiled)
        bias = gl.load(bias_ptr + channels, mask=channels < C_OUT, other=0.0)[None, :]
    else:
        bias = 0.0
    y = apply_epilogue(acc, bias, residual, alpha, scale, ACT, RESIDUAL, HAS_SCALE)
    if ROUND_TF32:
        y = round_tf32_tile(y)
    out2.store(y.to(dtype))
    fence_async_shared()
    _tma_store(out_desc, [image, oh0, ow0, n0], out4)
    tma.store_wait(pendings=0)


def triton_refusal() -> str | None:
    """Why the installed Triton cannot compile the kernel, or None. Written for triton 3.6 (the GPU machine's):
    triton 3.9 rejects a reinterpreted view larger than the view it starts from ("result shared-memory footprint
    exceeds the source view"), which is how a tap's operand starts a non-aligned number of rows into the halo;
    tests/kernels/test_kernels_halo.py checks both sides, so a Triton that lifts this shows up there."""
    if triton.__version__.startswith("3.6."):
        return None
    return f"triton {triton.__version__} (the kernel's shifted shared-memory views compile on triton 3.6 only)"


@dataclass(frozen=True)
class HaloTile:
    """A launch configuration: ``box`` the tile's output rows and columns (``BH * BW`` of 64 or 128 pixels, powers
    of two, ``BW`` at least 8); ``block_n`` the output channels per tile (None: all of them, rounded up to a power
    of two, at most 128); ``weight_buffers`` the taps in flight; ``num_warps`` 4 or 8."""

    box: tuple[int, int] = (8, 16)
    block_n: int | None = None
    weight_buffers: int = 4
    num_warps: int = 4

    def __post_init__(self) -> None:
        bh, bw = self.box
        if bh * bw not in (64, 128) or bw < 8 or bh & (bh - 1) or bw & (bw - 1):
            raise ValueError(f"HaloTile: box {self.box} must be powers of two with 64 or 128 pixels, at least 8 wide")


# The routing rule's evidence (results/halo-conv-2026-12-04b.json and -05.json, batch 32, against the implicit GEMM in
# the same run, best halo tile): YOLOv8n's 64->64 @80 fp16 49.7 us against 62.2, tf32 80.1 against 111.4; its head's
# 64->80 @80 fp16 83.4 against 95.9, tf32 141.8 against 207.8; 32->32 @80 tf32 40.1 against 61.7; ResNet-50's 64->64
# @56 (boxes overhanging the image by 8 of 64 columns, 896 tiles) fp16 28.1 against 34.9, tf32 46.1 against 60.6. With
# the narrower tail block (-05), the head's 80->80 @80 fp16 120.4 against 129.9, tf32 187.4 against 225.3, and @40 (5 x
# 3 boxes overhanging by 8 of 48 columns, 480 tiles) on the two-buffer tile fp16 35.8 against 41.2, tf32 54.9 against
# 69.2. It lost or tied where C_in leaves a channel block mostly empty (32->32 in fp16, 16->16) and where the boxes
# overhang more (the head at 20). Beyond what was measured (more than two channel blocks; fewer tiles or more overhang
# than each tile's limits below) the implicit GEMM keeps the conv.
HALO_MAX_BLOCKS = 2  # channel blocks of 128 bytes: 64 float32 channels were two and won


@dataclass(frozen=True)
class _RouteLimit:
    """Where one of the routed tiles was measured to win: at least ``min_tiles`` boxes, covering at most
    ``max_overhang`` times the output's pixels."""

    tile: HaloTile
    min_tiles: int
    max_overhang: float


# 64 output channels or fewer: four weight buffers on 8 warps, measured down to ResNet's 896 tiles at 1.14 overhang;
# more: two buffers on 4 warps, which keeps two programs per SM (96 KiB each), measured down to the head's 480 at 1.2
_NARROW_ROUTE = _RouteLimit(HaloTile((8, 16), None, 4, 8), 896, 1.15)
_WIDE_ROUTE = _RouteLimit(HaloTile((8, 16), None, 2, 4), 480, 1.2)


HALO_ENV = "FUSER_HALO"  # "0": never route to the halo kernel (benchmarks compare against the implicit GEMM)


def halo_enabled() -> bool:
    """False where ``FUSER_HALO=0`` turns the route off (read per plan: conv2d_act's plan key holds it)."""
    return os.environ.get(HALO_ENV, "1") != "0"


def halo_route(
    x: torch.Tensor,
    weight: PackedConvWeight,
    residual: torch.Tensor | None,
    out_nhwc: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int, int, int],
    dilation: tuple[int, int],
) -> HaloTile | None:
    """The tile conv2d_act runs this call's plan with on the halo kernel, or None for the implicit GEMM: a CUDA
    call of a 3x3 conv at stride 1 with padding 1 that :func:`halo_refusal` and :func:`triton_refusal` accept and
    :func:`halo_tile` picks, unless ``FUSER_HALO=0``."""
    if not halo_enabled() or x.device.type != "cuda":
        return None
    if stride != (1, 1) or padding != (1, 1, 1, 1) or dilation != (1, 1):
        return None
    if halo_refusal(x, weight, residual, out_nhwc) is not None or triton_refusal() is not None:
        return None
    n, c_in, h, w = x.shape
    return halo_tile(n, c_in, weight.out_channels, h, w, x.element_size())


def halo_possible(
    in_channels: int,
    out_channels: int,
    groups: int,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding4: Sequence[int],
    dilation: Sequence[int],
) -> bool:
    """Whether some call of this conv could take the halo route on this machine (for the report, which knows the
    layer but not the call's batch, image size or dtype): a CUDA GPU, a Triton that compiles the kernel, and a
    3x3 ungrouped conv at stride 1, dilation 1, padding ``(top, bottom, left, right)`` of 1 on every side (what
    :func:`halo_route` takes), whose channels :func:`halo_tile` accepts in fp16 or float32."""
    if tuple(kernel_size) != (3, 3) or tuple(stride) != (1, 1) or tuple(dilation) != (1, 1) or groups != 1:
        return False
    if tuple(padding4) != (1, 1, 1, 1) or out_channels > 128:
        return False
    if not any(halo_tile(_NARROW_ROUTE.min_tiles, in_channels, out_channels, 8, 16, size) for size in (2, 4)):
        return False
    return triton_refusal() is None and torch.cuda.is_available()


def halo_tile(n: int, c_in: int, c_out: int, oh: int, ow: int, element_size: int) -> HaloTile | None:
    """The tile :func:`prepare_halo` runs a stride-1, padding-1 3x3 conv with where the halo kernel was measured
    faster than the implicit GEMM, else None: one or two whole channel blocks (128 bytes of input channels each;
    what is left in a narrower tail block, :func:`channel_blocks`), at most 128 output channels (one column of
    tiles), and 8 x 16 boxes within the tile's limits (:data:`_NARROW_ROUTE` up to 64 output channels, else
    :data:`_WIDE_ROUTE`): enough of them, covering the output with little overhang."""
    block_k = SWIZZLE_BYTES // element_size
    if c_in < block_k or c_in // block_k > HALO_MAX_BLOCKS or c_out > 128:
        return None
    route = _NARROW_ROUTE if c_out <= 64 else _WIDE_ROUTE
    rows, cols = -(-oh // 8), -(-ow // 16)
    if n * rows * cols < route.min_tiles or rows * 8 * cols * 16 > route.max_overhang * oh * ow:
        return None
    return route.tile


def halo_refusal(
    x: torch.Tensor,
    weight: PackedConvWeight,
    residual: torch.Tensor | None = None,
    out_nhwc: torch.Tensor | None = None,
) -> str | None:
    """Why the halo kernel cannot run this conv, or None (see the module docstring's scope). ``residual``
    ``[N, C_out, OH, OW]`` and ``out_nhwc`` ``[N, OH, OW, C_out]``, when given, are checked too."""
    _, c_in, h, w = x.shape
    c_out = weight.out_channels
    size = x.element_size()
    if weight.kernel_size != (3, 3) or weight.groups != 1:
        return f"a {weight.kernel_size} filter in {weight.groups} groups (a 3x3 ungrouped conv only)"
    if x.dtype != weight.data.dtype or x.dtype not in _GL_DTYPES:
        return f"a {x.dtype} input to {weight.data.dtype} weights (fp16, bf16 or float32 operands of one dtype)"
    if weight.precision not in (Precision.FP16, Precision.BF16, Precision.TF32):
        return f"the {weight.precision.value} precision (wgmma runs float32 operands in TF32 only)"
    if c_in != weight.in_channels or (c_in * size) % 16 or (c_out * size) % 16 or c_in * size < SWIZZLE_BYTES:
        return (
            f"{c_in} input / {c_out} output channels (a pixel row of each a multiple of 16 bytes, the input's at "
            f"least {SWIZZLE_BYTES} bytes)"
        )
    if weight.data.stride(0) * weight.data.element_size() % 16 or weight.data.stride(1) != 1:
        return f"a packed weight with strides {weight.data.stride()} (rows 16-byte aligned, columns contiguous)"
    if x.stride() != (h * w * c_in, 1, w * c_in, c_in) or x.data_ptr() % 16:
        return f"an input with strides {x.stride()} (a dense channels_last input, 16-byte aligned)"
    if residual is not None and (residual.stride() != (h * w * c_out, 1, w * c_out, c_out) or residual.data_ptr() % 16):
        return f"a residual with strides {residual.stride()} (a dense channels_last tensor of the output's shape)"
    if out_nhwc is not None and (out_nhwc.stride(2) * size % 16 or out_nhwc.stride(3) != 1 or out_nhwc.data_ptr() % 16):
        return f"an output with strides {out_nhwc.stride()} (pixel rows 16-byte aligned, channels contiguous)"
    return None


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}


def channel_blocks(c_in: int, element_size: int) -> tuple[int, int]:
    """``(block_k, block_k_tail)``: the channel block, 128 bytes of channels (one swizzled row), and the width of
    the narrower last block that takes the ``c_in % block_k`` channels left over (a power of two, at least 32 bytes:
    one wgmma K step), or 0 where the blocks divide ``c_in``. YOLOv8n's 80-channel head in fp16: 64 + 16, where a
    second 64-wide block would be three quarters zeros."""
    block_k = SWIZZLE_BYTES // element_size
    left = c_in % block_k
    return block_k, (max(32 // element_size, triton.next_power_of_2(left)) if left else 0)


def prepare_halo(
    weight: PackedConvWeight, bias: torch.Tensor | None, epilogue: Epilogue, tile: HaloTile, dtype: torch.dtype
) -> Callable[..., None]:
    """The launch of one conv's calls: ``run(x, w, bias, residual, out_nhwc)`` with ``x`` ``[N, C_in, H, W]``
    channels_last, ``w`` the packed weight's data, ``residual`` ``[N, C_out, H, W]`` channels_last (or None) and
    ``out_nhwc`` the output's ``[N, H, W, C_out]`` view, all as :func:`halo_refusal` accepted for the example call.
    The layouts and constexprs are fixed here; each call builds its tensor descriptors (their base addresses) and
    launches through :class:`LaunchOptions`, as the Triton kernels' plans do."""
    bh, bw = tile.box
    bits = 8 * torch.empty((), dtype=dtype).element_size()
    c_in, c_out = weight.in_channels, weight.out_channels
    block_k, block_k_tail = channel_blocks(c_in, bits // 8)
    block_n = tile.block_n or min(128, max(16, triton.next_power_of_2(c_out)))
    swizzled = lambda channels, rank: gl.NVMMASharedLayout(
        swizzle_byte_width=channels * bits // 8, element_bitwidth=bits, rank=rank
    )
    # unswizzled: a swizzled TMA box's rows are at most 128 bytes, and block_n float32 channels are up to 512
    out_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=bits, rank=4)
    tail = block_k_tail or block_k  # without a tail block its descriptors repeat the full block's (unused)
    constexprs = dict(
        HAS_BIAS=bias is not None, ACT=int(epilogue.act), RESIDUAL=int(epilogue.residual),
        HAS_SCALE=epilogue.scale != 1.0, ROUND_TF32=epilogue.round_tf32, BH=bh, BW=bw, BLOCK_N=block_n,
        BLOCK_K=block_k, BLOCK_K_TAIL=tail, HAS_TAIL=block_k_tail > 0,
        HALO_ROWS=triton.next_power_of_2(3 * (bh + 2)), W_BUFS=tile.weight_buffers, num_warps=tile.num_warps,
    )  # fmt: skip
    alpha, scale = float(epilogue.alpha), float(epilogue.scale)
    options = LaunchOptions(constexprs)  # after the first call, launches skip the JIT's binding (launch.py)

    def run(x: torch.Tensor, w: torch.Tensor, bias: Any, residual: Any, out_nhwc: torch.Tensor) -> None:
        n, _, h, wd = x.shape
        x_nhwc = x.permute(0, 2, 3, 1)
        box = lambda rows, channels: TensorDescriptor.from_tensor(
            x_nhwc, [1, rows, bw, channels], swizzled(channels, 4)
        )
        out_desc = TensorDescriptor.from_tensor(out_nhwc, [1, bh, bw, block_n], out_layout)
        res_desc = out_desc
        if residual is not None:
            res_desc = TensorDescriptor.from_tensor(residual.permute(0, 2, 3, 1), [1, bh, bw, block_n], out_layout)
        tiles_h, tiles_w = triton.cdiv(h, bh), triton.cdiv(wd, bw)
        grid = (n * tiles_h * tiles_w, triton.cdiv(c_out, block_n))
        options.launch(_conv3x3_halo_kernel, grid, (
            box(bh, block_k), box(2, block_k), box(bh, tail), box(2, tail),
            TensorDescriptor.from_tensor(w, [block_n, block_k], swizzled(block_k, 2)),
            TensorDescriptor.from_tensor(w, [block_n, tail], swizzled(tail, 2)),
            out_desc, res_desc, bias if bias is not None else out_nhwc,
            c_in, c_out, tiles_h, tiles_w, alpha, scale,
        ))  # fmt: skip

    return run


def conv3x3_halo(
    x: torch.Tensor,
    weight: PackedConvWeight,
    bias: torch.Tensor | None = None,
    epilogue: Epilogue = NO_EPILOGUE,
    residual: torch.Tensor | None = None,
    *,
    tile: HaloTile = HaloTile(),
) -> torch.Tensor:
    """``epilogue(conv3x3(x, weight, padding=1) + bias [, residual])`` as one launch of the halo kernel, into a new
    channels_last tensor of ``x``'s dtype: what conv2d_act routes to where :func:`halo_tile` says, callable
    directly with any tile (tests, benchmarks/halo_conv.py). ``bias`` float32 ``[C_out]``. Raises ValueError
    naming what :func:`halo_refusal` or :func:`triton_refusal` refuses."""
    if epilogue.residual and residual is None:
        raise ValueError(f"conv3x3_halo: the epilogue ({epilogue.describe()}) adds a residual but none was given")
    why = halo_refusal(x, weight, residual) or triton_refusal()
    if why is not None:
        raise ValueError(f"conv3x3_halo: cannot run {why}")
    n, _, h, w = x.shape
    out = torch.empty((n, weight.out_channels, h, w), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    if out.numel():
        prepare_halo(weight, bias, epilogue, tile, x.dtype)(x, weight.data, bias, residual, out.permute(0, 2, 3, 1))
    return out


__all__ = [
    "HaloTile",
    "conv3x3_halo",
    "halo_enabled",
    "halo_refusal",
    "halo_route",
    "halo_tile",
    "prepare_halo",
    "triton_refusal",
]
