"""A 3x3 conv whose weights stay in shared memory: each program loads the nine filter taps once and walks many
box tiles of output pixels (an experiment, in no candidate list; kernels/NOTES.md versions 21 and 22).

Measured on the H200 (results/resident-weights-2026-12-04.json, batch 32 fp16): slower than the shipped implicit
GEMM on the conv it was built for, 64->64 @80 (77 us against 62: its 72 KiB of weights leave one program per SM),
faster on 32->32 @80 (27.8 against 33.6, two programs per SM). Kept with its tests and benchmarks/resident_weights.py
so that the measurement can be repeated; offering it would take a ``TileConfig`` field and a table class.

Why: on YOLOv8n's 64->64 3x3 @80 at batch 32 the implicit GEMM's 1600 box tiles each read the same 72 KiB of
fp16 weights, a third of the kernel's L2 traffic, and the row stays at 2.9x its roofline floor (NOTES version
20). With all of C_in in one channel block and all of C_out in one column block, the nine [C_in, C_out] weight
tiles fit in shared memory beside the activation buffers. Compiled for sm_90 (triton 3.9, on the CPU), Triton
keeps the nine loop-invariant weight tiles as shared-memory allocations made once, before the tile loop, and
feeds them to wgmma from there; it pipelines the nine unrolled activation box loads across tiles with a buffer
each per stage, so shared memory is ``9 * C_in * C_out * 2`` bytes plus ``9 * (stages - 1)`` activation boxes:
64-row tiles at 3 stages take 229,520 bytes (one program per SM), 128-row tiles fit only at 1 stage (91 KiB).

Scope: 16-bit operands, a 3x3 filter at stride 1 with padding 1 (same-size output), one group, ``C_in`` a multiple
of 8 up to 64 and ``C_out`` up to 64 (``BLOCK_K`` and ``BLOCK_N`` their powers of two, at least 16); a dense
channels_last input; the conv's fused epilogue (bias, activation, residual, scale) as the implicit GEMM's.
:func:`resident_refusal` says what else is refused. Box tiles as in conv_boxes.py (the descriptor's zero fill is
the padding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .autotune import device_facts
from .conv_boxes import box_descriptor_view, box_rows, load_tap_box
from .epilogue import NO_EPILOGUE, Epilogue
from .interpret import run_interpreted
from .launch import check_residual, make_descriptor
from .packing import PackedConvWeight
from .precision import dot_acc
from .tiles import epilogue_tile, row_offsets, store_tile

RESIDENT_BLOCK = 64  # the largest C_in and C_out: nine 64x64 fp16 tiles are 72 KiB of shared memory
BOX_W = 16


@triton.jit
def _tap_weight(w_ptr, tap, C_IN, offs_k, k_ok, channels, n_ok, stride_wn):
    """Tap ``tap``'s ``[BLOCK_K, BLOCK_N]`` weight tile of the packed ``[C_out, 9 * C_in]`` weight (zeros past
    ``C_in`` and ``C_out``)."""
    ptrs = w_ptr + channels[None, :].to(tl.int64) * stride_wn + (tap * C_IN + offs_k)[:, None]
    return tl.load(ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)


@triton.jit
def _tap_dot(acc, x_desc, image, oh0, ow0, KH: tl.constexpr, KW: tl.constexpr, C_IN, w, BLOCK_M: tl.constexpr,
             BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """``acc`` plus tap ``(KH, KW)``'s activation box (stride 1, padding 1) times its resident weight ``w``."""
    a = load_tap_box(x_desc, image, oh0, ow0, KH, KW, 0, C_IN, 1, 1, 1, 1, BLOCK_M, BLOCK_K)
    return dot_acc(a, w, acc, DOT_PRECISION, UPCAST)


@triton.jit
def _conv3x3_resident_kernel(
    # pointers: x_desc the 5-D box descriptor of the NHWC input (conv_boxes.box_descriptor_view), w_ptr the packed
    # [C_out, 9 * C_in] weight, out_ptr the NHWC output rows
    x_desc,
    w_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    # sizes
    OH,
    OW,
    C_IN,
    C_OUT,
    M,
    # strides
    stride_wn,
    stride_om,
    sr_n,
    sr_h,
    sr_w,
    sr_c,
    # epilogue scalars
    alpha,
    scale,
    # constexprs
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BOX_W: tl.constexpr,
):
    offs_k = tl.arange(0, BLOCK_K)
    channels = tl.arange(0, BLOCK_N)
    k_ok = offs_k < C_IN
    n_ok = channels < C_OUT
    # The nine taps' weights, loaded once per program: loop invariants of the tile loop below.
    w0 = _tap_weight(w_ptr, 0, C_IN, offs_k, k_ok, channels, n_ok, stride_wn)
    w1 = _tap_weight(w_ptr, 1, C_IN, offs_k, k_ok, channels, n_ok, stride_wn)
    w2 = _tap_weight(w_ptr, 2, C_IN, offs_k, k_ok, channels, n_ok, stride_wn)
    w3 = _tap_weight(w_ptr, 3, C_IN, offs_k, k_ok, channels, n_ok, stride_wn)
    w4 = _tap_weight(w_ptr, 4, C_IN, offs_k, k_ok, channels, n_ok, stride_wn)
    w5 = _tap_weight(w_ptr, 5, C_IN, offs_k, k_ok, channels, n_ok, stride_wn)
    w6 = _tap_weight(w_ptr, 6, C_IN, offs_k, k_ok, channels, n_ok, stride_wn)
    w7 = _tap_weight(w_ptr, 7, C_IN, offs_k, k_ok, channels, n_ok, stride_wn)
    w8 = _tap_weight(w_ptr, 8, C_IN, offs_k, k_ok, channels, n_ok, stride_wn)
    BOX_H: tl.constexpr = BLOCK_M // BOX_W
    tiles = (M // (OH * OW)) * tl.cdiv(OH, BOX_H) * tl.cdiv(OW, BOX_W)
    for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
        offs_m, m_ok, n_idx, oh, ow, image, oh0, ow0 = box_rows(tile, OH, OW, BLOCK_M, BOX_W)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _tap_dot(acc, x_desc, image, oh0, ow0, 0, 0, C_IN, w0, BLOCK_M, BLOCK_K, DOT_PRECISION, UPCAST)
        acc = _tap_dot(acc, x_desc, image, oh0, ow0, 0, 1, C_IN, w1, BLOCK_M, BLOCK_K, DOT_PRECISION, UPCAST)
        acc = _tap_dot(acc, x_desc, image, oh0, ow0, 0, 2, C_IN, w2, BLOCK_M, BLOCK_K, DOT_PRECISION, UPCAST)
        acc = _tap_dot(acc, x_desc, image, oh0, ow0, 1, 0, C_IN, w3, BLOCK_M, BLOCK_K, DOT_PRECISION, UPCAST)
        acc = _tap_dot(acc, x_desc, image, oh0, ow0, 1, 1, C_IN, w4, BLOCK_M, BLOCK_K, DOT_PRECISION, UPCAST)
        acc = _tap_dot(acc, x_desc, image, oh0, ow0, 1, 2, C_IN, w5, BLOCK_M, BLOCK_K, DOT_PRECISION, UPCAST)
        acc = _tap_dot(acc, x_desc, image, oh0, ow0, 2, 0, C_IN, w6, BLOCK_M, BLOCK_K, DOT_PRECISION, UPCAST)
        acc = _tap_dot(acc, x_desc, image, oh0, ow0, 2, 1, C_IN, w7, BLOCK_M, BLOCK_K, DOT_PRECISION, UPCAST)
        acc = _tap_dot(acc, x_desc, image, oh0, ow0, 2, 2, C_IN, w8, BLOCK_M, BLOCK_K, DOT_PRECISION, UPCAST)
        res_rows = row_offsets(n_idx, oh, ow, sr_n, sr_h, sr_w)
        y = epilogue_tile(acc, channels, n_ok, m_ok, bias_ptr, res_ptr, res_rows, sr_c, alpha, scale, HAS_BIAS, ACT,
                          RESIDUAL, HAS_SCALE, False)  # fmt: skip
        store_tile(out_ptr, offs_m, stride_om, channels, m_ok, n_ok, y)


def resident_refusal(x: torch.Tensor, weight: PackedConvWeight) -> str | None:
    """Why :func:`conv3x3_resident` cannot run this conv, or None (see the module docstring's scope)."""
    _, c_in, h, w = x.shape
    c_out = weight.out_channels
    if weight.kernel_size != (3, 3) or weight.groups != 1:
        return f"a {weight.kernel_size} filter in {weight.groups} groups (a 3x3 ungrouped conv only)"
    if weight.data.element_size() != 2 or x.dtype != weight.data.dtype:
        return f"a {x.dtype} input to {weight.data.dtype} weights (16-bit operands of one dtype only)"
    if c_in != weight.in_channels or c_in > RESIDENT_BLOCK or c_in % 8 or c_out > RESIDENT_BLOCK:
        return f"{c_in} input / {c_out} output channels (at most {RESIDENT_BLOCK} each, inputs a multiple of 8)"
    if x.stride() != (h * w * c_in, 1, w * c_in, c_in) or x.data_ptr() % 16:
        return f"an input with strides {x.stride()} (a dense channels_last input, 16-byte aligned)"
    return None


def conv3x3_resident(
    x: torch.Tensor,
    weight: PackedConvWeight,
    bias: torch.Tensor | None = None,
    epilogue: Epilogue = NO_EPILOGUE,
    residual: torch.Tensor | None = None,
    *,
    block_m: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    programs_per_sm: int = 1,
    interpret: bool = False,
) -> torch.Tensor:
    """``epilogue(conv3x3(x, weight, padding=1) + bias [, residual])`` as one launch of the resident-weight kernel,
    into a new channels_last tensor of ``x``'s dtype. ``bias`` float32 ``[C_out]``; ``residual`` of the output's
    shape. Raises ValueError naming what :func:`resident_refusal` refuses."""
    why = resident_refusal(x, weight)
    if why is not None:
        raise ValueError(f"conv3x3_resident: cannot run {why}")
    if block_m % BOX_W or block_m < BOX_W:
        raise ValueError(f"conv3x3_resident: block_m={block_m} must be a multiple of the box width {BOX_W}")
    n, c_in, h, w = x.shape
    c_out = weight.out_channels
    out = torch.empty((n, c_out, h, w), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    residual = check_residual("conv3x3_resident", epilogue, residual, out.shape)
    if out.numel() == 0:
        return out
    # the channels' powers of two (16 at least: the fp16 dot's K step), so narrow convs keep narrow tiles
    block_k, block_n = (max(16, triton.next_power_of_2(c)) for c in (c_in, c_out))
    x_desc = make_descriptor(box_descriptor_view(x, (1, 1)), [1, block_m // BOX_W, 1, BOX_W, block_k])
    tiles = n * triton.cdiv(h, block_m // BOX_W) * triton.cdiv(w, BOX_W)
    facts = None if interpret else device_facts(x.device)
    sms = facts[2] if facts is not None else 4
    grid = (max(1, min(tiles, programs_per_sm * sms)),)
    res = residual if residual is not None else out
    rs = res.stride()
    launch = (
        (lambda *a, **k: run_interpreted(_conv3x3_resident_kernel, grid, *a, **k))
        if interpret
        else (_conv3x3_resident_kernel[grid])
    )
    launch(
        x_desc, weight.data, bias if bias is not None else out, res, out,
        h, w, c_in, c_out, n * h * w,
        weight.data.stride(0), c_out, rs[0], rs[2], rs[3], rs[1],
        float(epilogue.alpha), float(epilogue.scale),
        HAS_BIAS=bias is not None, ACT=int(epilogue.act), RESIDUAL=int(epilogue.residual),
        HAS_SCALE=epilogue.scale != 1.0, DOT_PRECISION="tf32", UPCAST=interpret,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BOX_W=BOX_W,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
