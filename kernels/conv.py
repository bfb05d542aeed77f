"""``conv2d_act``: convolution -> (folded BN) bias -> activation [-> residual] in one kernel.

Implicit GEMM on NHWC: output pixels are the GEMM's M (``N * OH * OW``), output channels its N, and
the reduction runs over ``K = KH * KW * C_in / groups`` in the packed weight's ``(kh, kw, c)`` order.
The input patch is gathered straight from the activation as it is loaded (no im2col buffer), with
masks for padding, image borders and odd channel counts. Three reduction orders:

- channel blocks (C_in / groups >= 16): one loop over (tap, channel block), a tile of contiguous
  channels per step; the loop is flat so the compiler pipelines loads across taps.
- flat K (4 < C_in / groups < 16): K itself is tiled, each element decoding its own (kh, kw, c), so
  a 3x3x5 patch is two 32-wide steps instead of nine 16-wide steps of 5 useful lanes.
- filter rows (C_in / groups < 16 and a filter row of 16 to 128 (kw, c) weights: the 7x7 RGB stem, patch
  embeddings): one K step per filter row. A row's ``KW * C_in/groups`` weights are contiguous in the packed
  K order, and for an output pixel its inputs sit at the same lane offsets from the row's first tap, so each
  lane's (kw, c), offset and column bounds are decoded once, before the loop, and per step only the pixel's
  row is: flat K decodes and bounds every element every step.

Dispatch follows conv_choice.py (the decision packing and the report read too): depthwise convs go to
depthwise.py, convs with at most 4 input channels per group (the RGB stem) to the direct kernel of
direct_conv.py, 1x1 stride-1 unpadded convs to the plain GEMM of gemm.py, everything else (any stride,
padding, dilation, groups) here. Weights can be read through a tensor descriptor (TMA) and the output
written through one when their rows are 16-byte aligned and groups == 1; the pointer path takes every
other case. A tile config with ``split_k > 1`` splits the reduction across programs (splitk.py); one with
``box_w`` reads the activations as boxes through TMA (conv_boxes.py), one with ``tap_shift`` as consecutive
rows of a zero-bordered copy of the input (conv_boxes.py); one with ``stream_k`` (forced only, see
tile_config.py) deals every tile's steps out to a fixed grid. One helper computes a tile's accumulator over a
range of steps, :func:`_implicit_gemm_tile`; the kernel's two drivers choose the tiles and ranges and how each
tile ends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from .autotune import Problem, TileConfig, device_facts, matmul_candidates
from .bordered_copy import bordered_copy_plan
from .conv_boxes import (
    bordered_rows,
    box_block,
    box_candidates,
    box_descriptor_view,
    box_refusal,
    box_rows,
    box_shape_refusal,
    boxes_by_default,
    load_tap_box,
    shifted_twins,
    strided_box_twins,
    tap_shift_refusal,
)
from .conv_choice import ConvKernel, channel_block, conv_kernel, flat_k_width, reduction_order
from .conv_halo import halo_enabled, halo_route, prepare_halo
from .depthwise import depthwise_candidates, prepare_depthwise
from .direct_conv import direct_candidates, prepare_direct
from .epilogue import NO_EPILOGUE, Epilogue
from .gemm import gemm_candidates, prepare_gemm
from .launch import (
    FLOAT32_BIASES,
    KernelCall,
    PlanCache,
    aligned_2d,
    cdiv,
    check_bias,
    check_device,
    check_float,
    check_input_affine,
    check_input_scale,
    check_out,
    check_path,
    check_residual,
    choose_tile,
    descriptors_available,
    dot_precision,
    make_descriptor,
    tensor_meta,
    with_fallback,
)
from .packing import PackedConvWeight
from .precision import dot_acc
from .splitk import (
    STREAM_K_INTERPRETER_SMS,
    SplitK,
    reduces_in_tail,
    split_k_candidates,
    split_shifted_twins,
    stream_k_grid,
    wide_split_candidates,
)
from .tile_heuristic import pipeline_fits
from .tiles import (
    arrive_and_sum,
    decode_rows,
    epilogue_store,
    finish_tile,
    grouped_tile,
    load_operand,
    prologue_code,
    row_offsets,
    split_range,
    virtual_cat_pointers,
)


@triton.jit
def _implicit_gemm_tile(
    pid_m,
    pid_n,
    group,
    step_lo,
    step_hi,
    x_ptr,
    w_ref,
    ps_ptr,
    x2_ptr,
    H,
    W,
    C_IN_G,
    OH,
    OW,
    C_OUT_G,
    M,
    K_TOTAL,
    stride_h,
    stride_w,
    pad_top,
    pad_left,
    dil_h,
    dil_w,
    sx_n,
    sx_h,
    sx_w,
    sx_c,
    stride_wn,
    sps_n,
    sps_c,
    C_A,
    sx2_n,
    sx2_h,
    sx2_w,
    sx2_c,
    KH: tl.constexpr,
    KW: tl.constexpr,
    K_ORDER: tl.constexpr,
    PROLOGUE: tl.constexpr,
    VIRTUAL_CAT: tl.constexpr,
    UP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    USE_DESC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BOX_W: tl.constexpr,
    TAP_SHIFT: tl.constexpr,
):
    """The float32 accumulator of output tile ``(pid_m, pid_n)`` of ``group`` over reduction steps
    ``[step_lo, step_hi)`` (:func:`reduction_steps` counts them), and the tile's rows and channels:
    ``(acc, offs_m, m_ok, n_idx, oh, ow, channels, n_ok)``. What one program of a whole, split or stream-K
    tile computes; the kernel's drivers decide which steps and how the tile ends."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < C_OUT_G
    w_row0 = group * C_OUT_G + pid_n * BLOCK_N
    channels = group * C_OUT_G + offs_n

    # Output pixel -> (image, oh, ow) -> top-left input coordinate of its receptive field.
    if BOX_W > 0:
        offs_m, m_ok, n_idx, oh, ow, box_image, box_oh0, box_ow0 = box_rows(pid_m, OH, OW, BLOCK_M, BOX_W)
        x_rows = 0  # x_ptr is the box descriptor: no row addresses
    elif TAP_SHIFT:
        offs_m, m_ok, n_idx, oh, ow = bordered_rows(pid_m, M, OH, OW, pad_top, pad_left, BLOCK_M)
        x_rows = 0  # x_ptr is the descriptor over the zero-bordered input's rows
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        n_idx, oh, ow = decode_rows(offs_m, m_ok, OH, OW)
        x_rows = x_ptr + n_idx.to(tl.int64) * sx_n + (group * C_IN_G).to(tl.int64) * sx_c
    ih0 = oh * stride_h - pad_top
    iw0 = ow * stride_w - pad_left
    ps_img = n_idx.to(tl.int64)[:, None] * sps_n

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if K_ORDER == 2:  # filter rows: the host makes BLOCK_K >= KW * C_IN_G, one step per filter row
        row_len = KW * C_IN_G
        kw = offs_k // C_IN_G
        c = offs_k - kw * C_IN_G
        r_ok = offs_k < row_len
        iw = iw0[:, None] + (kw * dil_w)[None, :]
        col_ok = m_ok[:, None] & r_ok[None, :] & (iw >= 0) & (iw < W)
        lane = (kw * dil_w).to(tl.int64) * sx_w + (c * sx_c).to(tl.int64)
        cols = (x_rows + iw0.to(tl.int64) * sx_w)[:, None] + lane[None, :]
        ps_col = ((group * C_IN_G + c) * sps_c)[None, :]
        for kh in range(step_lo, step_hi):
            ih = ih0 + kh * dil_h
            ok = col_ok & ((ih >= 0) & (ih < H))[:, None]
            a = load_operand(cols + (ih.to(tl.int64) * sx_h)[:, None], ok, ps_ptr, ps_img, ps_col, PROLOGUE)
            if USE_DESC:
                # Columns past this row belong to the next filter row; a's zeros cancel them.
                w = w_ref.load([w_row0, kh * row_len]).T
            else:
                w_ptrs = w_ref + channels[None, :].to(tl.int64) * stride_wn + (kh * row_len + offs_k)[:, None]
                w = tl.load(w_ptrs, mask=n_ok[None, :] & r_ok[:, None], other=0.0)
            acc = dot_acc(a, w, acc, DOT_PRECISION, UPCAST)
    elif K_ORDER == 1:  # flat K
        for k0 in range(step_lo * BLOCK_K, step_hi * BLOCK_K, BLOCK_K):
            k = k0 + offs_k
            tap = k // C_IN_G
            c = k - tap * C_IN_G
            kh = tap // KW
            kw = tap - kh * KW
            ih = ih0[:, None] + (kh * dil_h)[None, :]
            iw = iw0[:, None] + (kw * dil_w)[None, :]
            ok = m_ok[:, None] & (k < K_TOTAL)[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            a_ptrs = x_rows[:, None] + ih.to(tl.int64) * sx_h + iw.to(tl.int64) * sx_w + (c * sx_c)[None, :]
            a = load_operand(a_ptrs, ok, ps_ptr, ps_img, ((group * C_IN_G + c) * sps_c)[None, :], PROLOGUE)
            if USE_DESC:
                w = w_ref.load([w_row0, k0]).T
            else:
                w_ptrs = w_ref + channels[None, :].to(tl.int64) * stride_wn + k[:, None]
                w = tl.load(w_ptrs, mask=n_ok[None, :] & (k < K_TOTAL)[:, None], other=0.0)
            acc = dot_acc(a, w, acc, DOT_PRECISION, UPCAST)
    else:
        c_blocks = tl.cdiv(C_IN_G, BLOCK_K)
        for step in range(step_lo, step_hi):
            tap = step // c_blocks
            c0 = (step - tap * c_blocks) * BLOCK_K
            kh = tap // KW
            kw = tap - kh * KW
            c = c0 + offs_k
            c_ok = c < C_IN_G
            if BOX_W > 0:
                a = load_tap_box(x_ptr, box_image, box_oh0, box_ow0, kh, kw, c0, C_IN_G, stride_h, stride_w,
                                 pad_top, pad_left, BLOCK_M, BLOCK_K)  # fmt: skip
            elif TAP_SHIFT:
                a = x_ptr.load([pid_m * BLOCK_M + (kh - pad_top) * (W + pad_left) + kw - pad_left, c0])
            else:
                ih = ih0 + kh * dil_h
                iw = iw0 + kw * dil_w
                row_ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                if VIRTUAL_CAT:
                    a_ptrs = virtual_cat_pointers(x_ptr, x2_ptr, n_idx, ih, iw, c, c0, C_A, sx_n, sx_h, sx_w,
                                                  sx_c, sx2_n, sx2_h, sx2_w, sx2_c, UP)  # fmt: skip
                else:
                    pix = ih.to(tl.int64) * sx_h + iw.to(tl.int64) * sx_w
                    a_ptrs = x_rows[:, None] + pix[:, None] + (c * sx_c)[None, :]
                a = load_operand(a_ptrs, row_ok[:, None] & c_ok[None, :], ps_ptr, ps_img,
                                 ((group * C_IN_G + c) * sps_c)[None, :], PROLOGUE)  # fmt: skip
            k_w = tap * C_IN_G + c0
            if USE_DESC:
                # Columns past this tap's channels belong to the next tap; a's zeros cancel them.
                w = w_ref.load([w_row0, k_w]).T
            else:
                w_ptrs = w_ref + channels[None, :].to(tl.int64) * stride_wn + (k_w + offs_k)[:, None]
                w = tl.load(w_ptrs, mask=n_ok[None, :] & c_ok[:, None], other=0.0)
            acc = dot_acc(a, w, acc, DOT_PRECISION, UPCAST)
    return acc, offs_m, m_ok, n_idx, oh, ow, channels, n_ok


@triton.jit
def tile_rows_total(M, OH, OW, pad_top, pad_left, BLOCK_M: tl.constexpr, BOX_W: tl.constexpr, TAP_SHIFT: tl.constexpr):
    """The row count the tile grid covers: ``M`` output pixels, or for box tiles (conv_boxes.py) each image's
    boxes padded at its edges, or for shifted taps the zero-bordered images' pixels."""
    if BOX_W > 0:
        total = (M // (OH * OW)) * tl.cdiv(OH, BLOCK_M // BOX_W) * tl.cdiv(OW, BOX_W) * BLOCK_M
    elif TAP_SHIFT:
        total = (M // (OH * OW)) * (OH + pad_top) * (OW + pad_left)
    else:
        total = M
    return total


@triton.jit
def reduction_steps(KH: tl.constexpr, KW: tl.constexpr, C_IN_G, K_TOTAL, K_ORDER: tl.constexpr, BLOCK_K: tl.constexpr):
    """The reduction's step count in ``K_ORDER``: filter rows, ``BLOCK_K`` columns of flat K, or
    (tap, channel block) pairs."""
    if K_ORDER == 2:
        steps = KH
    elif K_ORDER == 1:
        steps = tl.cdiv(K_TOTAL, BLOCK_K)
    else:
        steps = KH * KW * tl.cdiv(C_IN_G, BLOCK_K)
    return steps


# Image sizes and the conv geometry vary per layer: not specialized, so layers that differ only in them share
# one compile. (Triton would compile a stride, padding or dilation of 1 in as a constant and mark a 0 as
# divisible by 16: that buys nothing here, they enter only the pixel decode, not the channel-contiguous loads.)
@triton.jit(
    do_not_specialize=["H", "W", "OH", "OW", "M", "stride_h", "stride_w", "pad_top", "pad_left", "dil_h", "dil_w"]
)
def _conv2d_act_kernel(
    # pointers; w_ref and out_ref are tensor descriptors when USE_DESC; ps_ptr: the prologue's [N, C_in]
    # factors (tiles.py); ws_ptr and count_ptr, when SPLIT_K > 1 or STREAM_K: the float32 [slots, M, C_out]
    # workspace and the tiles' int32 arrival counters (tiles.arrive_and_sum)
    x_ptr,
    w_ref,
    bias_ptr,
    res_ptr,
    out_ref,
    ps_ptr,
    x2_ptr,  # VIRTUAL_CAT: the second source b of the input cat([upsample_nearest(x, UP), b], 1) (tiles.py)
    ws_ptr,
    count_ptr,
    # sizes
    H,
    W,
    C_IN_G,
    OH,
    OW,
    C_OUT_G,
    M,
    K_TOTAL,
    # conv geometry
    stride_h,
    stride_w,
    pad_top,
    pad_left,
    dil_h,
    dil_w,
    # strides (elements): x as NHWC logical, packed w [C_out, K_pad], residual as NCHW logical
    sx_n,
    sx_h,
    sx_w,
    sx_c,
    stride_wn,
    sr_n,
    sr_c,
    sr_h,
    sr_w,
    stride_om,
    stride_wsm,  # the workspace's rows: C_out (an argument, so that Triton sees it divisible by 16)
    sps_n,
    sps_c,
    C_A,
    sx2_n,
    sx2_h,
    sx2_w,
    sx2_c,
    # epilogue scalars
    alpha,
    scale,
    # constexprs
    KH: tl.constexpr,
    KW: tl.constexpr,
    K_ORDER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ROUND_TF32: tl.constexpr,
    PROLOGUE: tl.constexpr,
    VIRTUAL_CAT: tl.constexpr,
    UP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    USE_DESC: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SPLIT_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    BOX_W: tl.constexpr,
    STREAM_K: tl.constexpr,
    TAP_SHIFT: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    steps = reduction_steps(KH, KW, C_IN_G, K_TOTAL, K_ORDER, BLOCK_K)
    if STREAM_K:
        # Stream-K (one group, row tiles): the steps of all tiles, tile after tile, in equal runs per program.
        # A tile whose steps several programs share: each stores its partial sum in its slot, counted from the
        # tile's first program, and the last to arrive adds them in slot order and finishes the tile.
        tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(C_OUT_G, BLOCK_N)
        work = tiles * steps
        per = tl.cdiv(work, tl.num_programs(0))
        it_lo = tl.program_id(0) * per
        it_hi = tl.minimum(it_lo + per, work)
        for tile in range(it_lo // steps, tl.cdiv(it_hi, steps)):
            lo = tl.maximum(it_lo - tile * steps, 0)
            hi = tl.minimum(it_hi - tile * steps, steps)
            pid_m, pid_n = grouped_tile(tile, M, C_OUT_G, BLOCK_M, BLOCK_N, GROUP_M)
            acc, offs_m, m_ok, n_idx, oh, ow, channels, n_ok = _implicit_gemm_tile(
                pid_m, pid_n, 0, lo, hi, x_ptr, w_ref, ps_ptr, x2_ptr, H, W, C_IN_G, OH, OW, C_OUT_G, M, K_TOTAL,
                stride_h, stride_w, pad_top, pad_left, dil_h, dil_w, sx_n, sx_h, sx_w, sx_c, stride_wn, sps_n, sps_c,
                C_A, sx2_n, sx2_h, sx2_w, sx2_c, KH, KW, K_ORDER, PROLOGUE, VIRTUAL_CAT, UP, DOT_PRECISION, UPCAST,
                USE_DESC, BLOCK_M, BLOCK_N, BLOCK_K, BOX_W, TAP_SHIFT,
            )  # fmt: skip
            first = tile * steps // per
            slots = ((tile + 1) * steps - 1) // per - first + 1
            last = slots == 1
            if slots > 1:
                last, acc = arrive_and_sum(acc, ws_ptr, count_ptr, tile, tl.program_id(0) - first, slots, offs_m,
                                           channels, m_ok, n_ok, M, stride_wsm)  # fmt: skip
            if last:
                res_rows = row_offsets(n_idx, oh, ow, sr_n, sr_h, sr_w)
                epilogue_store(acc, out_ref, offs_m, channels, m_ok, n_ok, pid_m * BLOCK_M, pid_n * BLOCK_N,
                               stride_om, bias_ptr, res_ptr, res_rows, sr_c, alpha, scale, HAS_BIAS, ACT, RESIDUAL,
                               HAS_SCALE, ROUND_TF32, USE_DESC)  # fmt: skip
    elif PERSISTENT:
        # Persistent (whole tiles of one or more groups): each program walks tiles program, program + programs,
        # ... of its group; flattened with the reduction loop so that the next tile's loads can start early.
        rows_total = tile_rows_total(M, OH, OW, pad_top, pad_left, BLOCK_M, BOX_W, TAP_SHIFT)
        group = tl.program_id(1)
        tiles = tl.cdiv(rows_total, BLOCK_M) * tl.cdiv(C_OUT_G, BLOCK_N)
        for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
            pid_m, pid_n = grouped_tile(tile, rows_total, C_OUT_G, BLOCK_M, BLOCK_N, GROUP_M)
            acc, offs_m, m_ok, n_idx, oh, ow, channels, n_ok = _implicit_gemm_tile(
                pid_m, pid_n, group, 0, steps, x_ptr, w_ref, ps_ptr, x2_ptr, H, W, C_IN_G, OH, OW, C_OUT_G, M,
                K_TOTAL, stride_h, stride_w, pad_top, pad_left, dil_h, dil_w, sx_n, sx_h, sx_w, sx_c, stride_wn,
                sps_n, sps_c, C_A, sx2_n, sx2_h, sx2_w, sx2_c, KH, KW, K_ORDER, PROLOGUE, VIRTUAL_CAT, UP,
                DOT_PRECISION, UPCAST, USE_DESC, BLOCK_M, BLOCK_N, BLOCK_K, BOX_W, TAP_SHIFT,
            )  # fmt: skip
            res_rows = row_offsets(n_idx, oh, ow, sr_n, sr_h, sr_w)
            epilogue_store(acc, out_ref, offs_m, channels, m_ok, n_ok, pid_m * BLOCK_M, pid_n * BLOCK_N, stride_om,
                           bias_ptr, res_ptr, res_rows, sr_c, alpha, scale, HAS_BIAS, ACT, RESIDUAL, HAS_SCALE,
                           ROUND_TF32, USE_DESC and BOX_W == 0 and not TAP_SHIFT)  # fmt: skip
    else:
        rows_total = tile_rows_total(M, OH, OW, pad_top, pad_left, BLOCK_M, BOX_W, TAP_SHIFT)
        pid_m, pid_n = grouped_tile(tl.program_id(0), rows_total, C_OUT_G, BLOCK_M, BLOCK_N, GROUP_M)
        group = tl.program_id(1)
        split = tl.program_id(2)
        lo, hi = split_range(steps, split, 1, SPLIT_K)
        acc, offs_m, m_ok, n_idx, oh, ow, channels, n_ok = _implicit_gemm_tile(
            pid_m, pid_n, group, lo, hi, x_ptr, w_ref, ps_ptr, x2_ptr, H, W, C_IN_G, OH, OW, C_OUT_G, M, K_TOTAL,
            stride_h, stride_w, pad_top, pad_left, dil_h, dil_w, sx_n, sx_h, sx_w, sx_c, stride_wn, sps_n, sps_c,
            C_A, sx2_n, sx2_h, sx2_w, sx2_c, KH, KW, K_ORDER, PROLOGUE, VIRTUAL_CAT, UP, DOT_PRECISION, UPCAST,
            USE_DESC, BLOCK_M, BLOCK_N, BLOCK_K, BOX_W, TAP_SHIFT,
        )  # fmt: skip
        res_rows = row_offsets(n_idx, oh, ow, sr_n, sr_h, sr_w)
        tile_id = tl.program_id(0) + group * tl.num_programs(0)
        finish_tile(acc, out_ref, ws_ptr, count_ptr, tile_id, offs_m, channels, m_ok, n_ok, pid_m * BLOCK_M,
                    pid_n * BLOCK_N, split, M, stride_wsm, stride_om, bias_ptr, res_ptr, res_rows, sr_c, alpha,
                    scale, HAS_BIAS, ACT, RESIDUAL, HAS_SCALE, ROUND_TF32, USE_DESC and BOX_W == 0 and not TAP_SHIFT,
                    SPLIT_K,
                    SPLIT_TAIL)  # fmt: skip


def reduction_step_count(
    order: ConvKernel, kernel_size: tuple[int, int], c_in_g: int, k_total: int, block_k: int
) -> int:
    """The implicit GEMM's reduction steps per output tile in ``order``, as the kernel counts them
    (:func:`reduction_steps`)."""
    if order == ConvKernel.IMPLICIT_GEMM_ROW_RUNS:
        return kernel_size[0]
    if order == ConvKernel.IMPLICIT_GEMM_FLAT_K:
        return cdiv(k_total, block_k)
    return kernel_size[0] * kernel_size[1] * cdiv(c_in_g, block_k)


def conv2d_supported(in_channels: int, out_channels: int, groups: int) -> bool:
    """Whether :func:`conv2d_act` takes this convolution (False: the caller keeps the torch reference).

    Every grouping whose groups divide both channel counts is supported: depthwise by the direct
    kernel, any other grouping by the implicit GEMM with one grid row per group.
    """
    return groups >= 1 and in_channels % groups == 0 and out_channels % groups == 0 and in_channels > 0


def _pair(op: str, name: str, value: int | Sequence[int]) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or any(not isinstance(v, int) or v < 1 for v in pair):
        raise ValueError(f"{op}: {name} must be a positive int or a pair of them, got {value!r}")
    return pair  # type: ignore[return-value]


def _padding4(op: str, padding: int | Sequence[int]) -> tuple[int, int, int, int]:
    if isinstance(padding, int):
        padding = (padding,) * 4
    padding = tuple(padding)
    if len(padding) == 2:
        padding = (padding[0], padding[0], padding[1], padding[1])
    if len(padding) != 4 or any(not isinstance(p, int) or p < 0 for p in padding):
        raise ValueError(
            f"{op}: padding must be (top, bottom, left, right), (pad_h, pad_w) or an int >= 0, got {padding!r}"
        )
    return padding  # type: ignore[return-value]


K_ORDER = {ConvKernel.IMPLICIT_GEMM: 0, ConvKernel.IMPLICIT_GEMM_FLAT_K: 1, ConvKernel.IMPLICIT_GEMM_ROW_RUNS: 2}


def row_block(c_in_g: int, kw: int) -> int:
    """The filter-row order's K step: one whole row of ``kw * c_in_g`` weights, a power of two."""
    return max(16, triton.next_power_of_2(kw * c_in_g))


def conv_candidates(
    m: int, c_in_g: int, c_out_g: int, k_total: int, operand_bytes: int, order: ConvKernel, kh: int = 1, kw: int = 1
) -> list[TileConfig]:
    """Tile configs worth measuring for one convolution (first = default), small-grid split-K variants and,
    in the channel-block order, the widest tiles split in two included (splitk.py). ``order`` is the reduction
    order (conv_choice.reduction_order) and ``kh x kw`` the filter: the channel-block loop walks ``kh * kw``
    taps, the filter-row loop ``kh`` rows. Stream-K tiles are not listed: measured, they were no faster than
    these (kernels/NOTES.md version 13)."""
    if order == ConvKernel.IMPLICIT_GEMM_FLAT_K:
        bk = min(flat_k_width(c_in_g, operand_bytes), max(16, triton.next_power_of_2(k_total)))
        steps = lambda c: cdiv(k_total, c.block_k)
    elif order == ConvKernel.IMPLICIT_GEMM_ROW_RUNS:
        bk = row_block(c_in_g, kw)
        steps = lambda c: kh
    else:
        bk = channel_block(c_in_g) if operand_bytes == 2 else min(32, channel_block(c_in_g))
        steps = lambda c: kh * kw * cdiv(c_in_g, c.block_k)
    candidates = split_k_candidates(matmul_candidates(m, c_out_g, k_total, bk), m, c_out_g, steps)
    if order == ConvKernel.IMPLICIT_GEMM_FLAT_K:
        # Flat K's 64-wide step holds a float32 stage of 128x128 tiles in 64 KiB, and Triton pipelines both of its
        # operands: every stage is allocated (on the H200 128x128x64 at 4 stages asked for 262,176 bytes,
        # results/conv-tile-sweep-2026-12-04f.json). A config that cannot fit is no candidate.
        fitting = [c for c in candidates if pipeline_fits(c, operand_bytes)]
        return fitting or candidates
    return wide_split_candidates(candidates, m, c_out_g, steps) if order == ConvKernel.IMPLICIT_GEMM else candidates


def conv2d_tile_candidates(
    x_shape: Sequence[int],
    weight: PackedConvWeight,
    stride: int | Sequence[int] = (1, 1),
    padding: int | Sequence[int] = (0, 0, 0, 0),
    dilation: int | Sequence[int] = (1, 1),
) -> list[TileConfig]:
    """Every tile config the launcher may measure or default to for this convolution (first = default),
    from the candidate list of the kernel it routes to: what a GPU test sweeps to cover all of them. For a
    dense channels_last input of the packed weight's dtype on a GPU with tensor descriptors (where box
    tiles apply, conv_boxes.py); other inputs get the row tiles' list."""
    op = "conv2d_tile_candidates"
    stride, dilation, padding = _pair(op, "stride", stride), _pair(op, "dilation", dilation), _padding4(op, padding)
    n, c_in, h, w = x_shape
    (kh, kw), groups, c_out = weight.kernel_size, weight.groups, weight.out_channels
    oh = (h + padding[0] + padding[1] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (w + padding[2] + padding[3] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    c_in_g, elem = c_in // groups, weight.data.element_size()
    kernel = conv_kernel(c_in, c_out, groups, (kh, kw), stride, padding)
    if kernel == ConvKernel.DEPTHWISE:
        return depthwise_candidates(c_out, n * oh * ow)
    if kernel == ConvKernel.DIRECT:
        return direct_candidates(c_out // groups)
    if kernel == ConvKernel.GEMM_1X1:
        return gemm_candidates(n * h * w, c_out, c_in, elem)
    box_why_not = box_shape_refusal(c_in, c_out, h, w, groups, stride, dilation, elem)
    if box_why_not is None and kernel != ConvKernel.IMPLICIT_GEMM:
        box_why_not = f"the {kernel.value} kernel"
    shift_why_not = tap_shift_refusal(box_why_not, stride, padding, (h, w), (oh, ow))
    return implicit_gemm_candidates(box_why_not is None, shift_why_not, n * oh * ow, c_in_g, c_out // groups,
                                    weight.k_total, elem, kernel, (kh, kw), stride, (oh, ow))  # fmt: skip


def implicit_gemm_candidates(
    can_box: bool,
    shift_why_not: str | None,
    m: int,
    c_in_g: int,
    c_out_g: int,
    k_total: int,
    operand_bytes: int,
    order: ConvKernel,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    out_size: tuple[int, int],
) -> list[TileConfig]:
    """The implicit GEMM's candidate list (first = default), which the launcher and
    :func:`conv2d_tile_candidates` both take from here: the box tiles' where boxes can read the input
    (``can_box``) and :func:`conv_boxes.boxes_by_default` picks them, else the row tiles', followed on small
    images by their shifted-tap twins where shifted taps can read the input (``shift_why_not`` is None,
    :func:`conv_boxes.shifted_twins`), and those of the twins that leave SMs idle split in two
    (:func:`splitk.split_shifted_twins`), at stride 2 box tiles where boxes can read the input
    (:func:`conv_boxes.strided_box_twins`), and on grids of many tiles persistent twins last
    (:func:`persistent_twins`)."""
    ow = out_size[1]
    if can_box and boxes_by_default(m, c_in_g, stride, ow):
        return persistent_twins(box_candidates(c_in_g, c_out_g, ow, stride[1], operand_bytes), m, c_out_g)
    rows = conv_candidates(m, c_in_g, c_out_g, k_total, operand_bytes, order, *kernel_size)
    steps = lambda c: kernel_size[0] * kernel_size[1] * cdiv(c_in_g, c.block_k)
    twins = split_shifted_twins(shifted_twins(rows, shift_why_not, out_size), m, c_out_g, steps)
    twins = strided_box_twins(twins, can_box, m, c_in_g, c_out_g, stride, ow, operand_bytes)
    return persistent_twins(twins, m, c_out_g)


# Persistent twins (TileConfig.persistent) are offered where a grid has at least this many tiles (YOLOv8n's 64->64
# @80 at batch 32: 1600), on 2 and 3 programs per SM of the 4-warp whole tiles: there the 128x64 box tile on 2
# programs per SM ran 6-7% faster than the table's best without in fp16 and 1-5% in tf32, while every 8-warp twin
# and every twin on 1 program per SM ran slower (results/conv-tile-sweep-2026-12-04-persistent.json and -04b.json,
# layers-2026-12-04d.json).
PERSISTENT_MIN_TILES = 1024
PERSISTENT_PER_SM = (2, 3)


def persistent_twins(candidates: list[TileConfig], m: int, c_out_g: int) -> list[TileConfig]:
    """``candidates`` followed by the persistent twins of its whole 4-warp tiles (not split, not stream-K) where
    the grid of the list's first tile has at least ``PERSISTENT_MIN_TILES`` tiles; else ``candidates`` unchanged.
    The twins come last and the cost model gives a twin its original's time, so neither the list's first entry
    nor the model's pick moves: a twin becomes a default only where the shipped table measured it fastest."""
    first = candidates[0]
    if cdiv(m, first.block_m) * cdiv(c_out_g, first.block_n) < PERSISTENT_MIN_TILES:
        return candidates
    twins = persistent_variants([c for c in candidates if c.num_warps == 4], PERSISTENT_PER_SM)
    return list(dict.fromkeys([*candidates, *twins]))


def persistent_variants(configs: Sequence[TileConfig], per_sm: Sequence[int]) -> list[TileConfig]:
    """The whole tiles among ``configs`` (not split, not stream-K, not persistent already: what a persistent program
    walks) on persistent grids of each of ``per_sm`` programs per SM, in that order."""
    whole = [c for c in configs if c.split_k == 1 and not c.stream_k and not c.persistent]
    return [dataclasses.replace(c, persistent=p) for c in whole for p in per_sm]


VIRTUAL_CAT_ALIGN = 16  # the smallest channel block: the first source's channels must be a multiple of it

# Under the interpreter every op costs Python overhead per program: large M tiles, few programs.
INTERPRET_CONFIG = TileConfig(128, 32, 32, 2, 4, 1)
INTERPRET_CONFIG_NARROW = TileConfig(128, 32, 16, 2, 4, 1)


_plans = PlanCache()


def conv2d_act(
    x: torch.Tensor,
    weight: PackedConvWeight,
    bias: torch.Tensor | None = None,
    *,
    stride: int | Sequence[int] = (1, 1),
    padding: int | Sequence[int] = (0, 0, 0, 0),
    dilation: int | Sequence[int] = (1, 1),
    epilogue: Epilogue = NO_EPILOGUE,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    interpret: bool = False,
    path: str = "auto",
    tile: TileConfig | None = None,
    input_scale: torch.Tensor | None = None,
    cat_with: torch.Tensor | None = None,
    upsample: int = 1,
    input_affine: torch.Tensor | None = None,
    input_act: int = 0,
    pool: torch.Tensor | None = None,
) -> torch.Tensor:
    """``epilogue(conv2d(x, W) + bias)`` in one kernel; returns ``[N, C_out, OH, OW]``, channels_last.

    ``x`` is ``[N, C_in, H, W]`` with any strides (NCHW or channels_last; channels_last reads fastest)
    in float32, float16 or bfloat16; the output has ``x``'s dtype. ``padding`` is
    ``(top, bottom, left, right)`` so asymmetric ("same", ONNX) padding needs no extra pad op.
    ``residual`` broadcasts to the output. The precision comes with the packed weight.
    ``out``, when given, is written and returned instead of a new tensor: ``[N, C_out, OH, OW]`` of
    ``x``'s dtype, channels contiguous and pixels as rows of one stride, e.g. the channel slice
    ``buf[:, c0:c0 + C_out]`` of a channels_last ``buf`` that a concatenation would otherwise copy into.
    ``interpret=True`` runs the same kernels in Triton's interpreter on CPU tensors. ``path`` forces
    the tensor-descriptor or the pointer path and ``tile`` a tile config (tests, candidate sweeps).
    ``input_scale`` ``[N or 1, C_in, 1, 1]`` (the squeeze-excitation scale) computes ``conv2d(x * input_scale)``
    instead, the product formed as the kernel loads ``x``: no tensor of ``x``'s size is written. The
    direct kernel of the RGB stem (``C_in / groups <= 4``) has no such load and refuses it.
    ``cat_with`` (with ``upsample``) makes the conv's input the virtual ``cat([upsample_nearest(x, upsample),
    cat_with], 1)`` (YOLO's neck), which is never materialized: the implicit-GEMM gather reads channel blocks
    of ``x`` at ``(h // upsample, w // upsample)`` and of ``cat_with`` at ``(h, w)``, 1x1 convs included.
    ``x``'s channel count must be a multiple of ``VIRTUAL_CAT_ALIGN`` and the conv ungrouped.
    ``input_affine`` ``[C_in, 2]`` (float32 columns scale ``s`` and shift ``t``: a BatchNorm's) with ``input_act``
    (an :class:`Activation` without a parameter) computes ``conv2d(act(x * s + t))``, applied as the kernel
    loads ``x``, the padding zeros those of the activated input (DenseNet's BN -> ReLU -> conv); not with an
    ``input_scale``, and not on the direct kernel.
    ``pool``, a contiguous ``[N, C_out]`` tensor of ``x``'s dtype, is also written with the output's mean over
    (OH, OW) (squeeze-excitation's pool), summed in the epilogue of the depthwise kernel (depthwise.py), the
    only kernel that takes it.
    """
    plan = conv2d_act_plan(
        x, weight, bias, stride=stride, padding=padding, dilation=dilation, epilogue=epilogue, residual=residual,
        out=out, interpret=interpret, path=path, tile=tile, input_scale=input_scale, cat_with=cat_with,
        upsample=upsample, input_affine=input_affine, input_act=input_act, pool=pool,
    )  # fmt: skip
    return plan(x, weight.data, bias, residual, out, input_scale, cat_with, input_affine, pool)


def conv2d_act_plan(
    x: torch.Tensor,
    weight: PackedConvWeight,
    bias: torch.Tensor | None = None,
    *,
    stride: int | Sequence[int] = (1, 1),
    padding: int | Sequence[int] = (0, 0, 0, 0),
    dilation: int | Sequence[int] = (1, 1),
    epilogue: Epilogue = NO_EPILOGUE,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    interpret: bool = False,
    path: str = "auto",
    tile: TileConfig | None = None,
    input_scale: torch.Tensor | None = None,
    cat_with: torch.Tensor | None = None,
    upsample: int = 1,
    input_affine: torch.Tensor | None = None,
    input_act: int = 0,
    pool: torch.Tensor | None = None,
) -> Callable[..., torch.Tensor]:
    """The launch plan of :func:`conv2d_act` for calls like this one: ``plan(x, weight.data, bias, residual)``,
    or ``plan(x, weight.data, bias, residual, out)`` for a plan made with an ``out``, and
    ``plan(x, weight.data, bias, residual, out, input_scale, cat_with, input_affine, pool)`` for one made with
    an ``input_scale``, a ``cat_with``, an ``input_affine`` or a ``pool``.

    Valid for any tensors with the same shapes, strides, dtypes, devices and 16-byte alignment as the
    example ones. A caller that makes the same call many times (a fused module) keeps the plan and skips
    the signature lookup; the first call of a signature checks the inputs and measures the tile candidates.
    """
    key = lambda: (
        tensor_meta(x), tensor_meta(weight.data), weight.out_channels, weight.in_channels, weight.kernel_size,
        weight.groups, weight.precision, tensor_meta(bias), tensor_meta(residual), tensor_meta(out), stride,
        padding, dilation, epilogue, interpret, path, tile, tensor_meta(input_scale), tensor_meta(cat_with),
        upsample, tensor_meta(input_affine), input_act, tensor_meta(pool), halo_enabled(),
    )  # fmt: skip
    build = lambda: _plan_conv(
        x, weight, bias, stride, padding, dilation, epilogue, residual, out, interpret, path, tile, input_scale,
        cat_with, upsample, input_affine, input_act, pool,
    )  # fmt: skip
    return _plans.get(key, build)


def _plan_conv(
    x: torch.Tensor,
    weight: PackedConvWeight,
    bias: torch.Tensor | None,
    stride: int | Sequence[int],
    padding: int | Sequence[int],
    dilation: int | Sequence[int],
    epilogue: Epilogue,
    residual: torch.Tensor | None,
    out: torch.Tensor | None,
    interpret: bool,
    path: str,
    tile: TileConfig | None,
    input_scale: torch.Tensor | None = None,
    cat_with: torch.Tensor | None = None,
    upsample: int = 1,
    input_affine: torch.Tensor | None = None,
    input_act: int = 0,
    pool: torch.Tensor | None = None,
) -> Callable[..., torch.Tensor]:
    """Check one call's inputs (clear errors), pick the kernel (conv_choice.py) and build the plan for
    calls like it."""
    op = "conv2d_act"
    if not isinstance(weight, PackedConvWeight):
        raise TypeError(f"{op}: weight must be a PackedConvWeight (see pack_conv_weight), got {type(weight)}")
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{op}: x must be a 4-D [N, C, H, W] tensor, got {shape}")
    check_float(op, "x", x)
    check_path(op, path)
    stride = _pair(op, "stride", stride)
    dilation = _pair(op, "dilation", dilation)
    padding = _padding4(op, padding)
    n, c_in, h, w = _virtual_shape(op, x, cat_with, upsample)
    if c_in != weight.in_channels:
        what = "x" if cat_with is None else f"cat([upsample(x, {upsample}), cat_with], 1)"
        raise ValueError(
            f"{op}: {what} has {c_in} channels (shape {(n, c_in, h, w)}) but the packed weight expects "
            f"C_in={weight.in_channels}"
        )
    kh, kw = weight.kernel_size
    c_out, groups = weight.out_channels, weight.groups
    oh = (h + padding[0] + padding[1] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (w + padding[2] + padding[3] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    if oh < 1 or ow < 1:
        raise ValueError(
            f"{op}: a {kh}x{kw} kernel (dilation {dilation}, padding {padding}) does not fit the "
            f"{h}x{w} input: output would be {oh}x{ow}"
        )
    tensors = {"x": x, "weight": weight.data, "bias": bias, "residual": residual, "out": out}
    optional = {"input_scale": input_scale, "cat_with": cat_with, "input_affine": input_affine, "pool": pool}
    device = check_device(op, interpret, {**tensors, **optional})
    x_dtype = x.dtype  # the plan keeps no tensor of the call it was made for (a CUDA-graph pool's, say)
    if input_scale is not None and input_affine is not None:
        raise ValueError(f"{op}: input_scale and input_affine both transform x as it is loaded; give one")
    scale_rows = lambda t: check_input_scale(op, t, n, c_in, x_dtype)
    affine_rows = lambda t: check_input_affine(op, t, input_act, n, c_in, device)
    scale2 = scale_rows(input_scale) if input_affine is None else affine_rows(input_affine)
    affine_act = None if input_affine is None else input_act
    bias32 = check_bias(op, bias, c_out)
    convert_bias = bias32 is not None and bias32 is not bias
    float32_bias = FLOAT32_BIASES
    out4 = (n, c_out, oh, ow)
    res4 = check_residual(op, epilogue, residual, out4)
    dtype = x.dtype
    new_out = lambda: torch.empty((n, oh, ow, c_out), dtype=dtype, device=device).permute(0, 3, 1, 2)
    example = new_out() if out is None else out
    row_stride = check_out(op, example, out4, dtype, device, 1).stride(0)
    if pool is not None:
        _check_pool(op, pool, (n, c_out), dtype, conv_kernel(c_in, c_out, groups, (kh, kw), stride, padding))
    if example.numel() == 0:
        return lambda x, w, bias, residual, out=None, input_scale=None, cat_with=None, input_affine=None, pool=None: (
            new_out() if out is None else out
        )
    # NHWC view with the strides the kernels assume (size-1 dimensions may have had any)
    nhwc = lambda t: t.as_strided((n, oh, ow, c_out), (oh * ow * row_stride, ow * row_stride, row_stride, 1))
    out_nhwc = nhwc(example)
    kernel = conv_kernel(c_in, c_out, groups, (kh, kw), stride, padding)
    if kernel is None:
        raise ValueError(f"{op}: no kernel for groups={groups} with C_in={c_in}, C_out={c_out}")
    if path == "descriptor" and not kernel.tensor_cores:
        raise ValueError(
            f"{op}: the descriptor path does not exist for the {kernel.value} kernel "
            f"(C_in={c_in}, groups={groups}); it reads through pointers"
        )
    if scale2 is not None and kernel == ConvKernel.DIRECT:
        what = "input_scale" if input_affine is None else "input_affine"
        raise ValueError(
            f"{op}: {what} is not supported by the direct conv kernel (C_in={c_in}, groups={groups}: at most "
            "4 input channels per group); scale the input first"
        )
    if cat_with is not None:
        if groups != 1 or not kernel.tensor_cores:
            raise ValueError(
                f"{op}: a virtual concatenation input (cat_with) needs an ungrouped conv on the tensor-core "
                f"kernels, got groups={groups}, the {kernel.value} kernel"
            )
        kernel = ConvKernel.IMPLICIT_GEMM  # its gather reads the two sources; the 1x1 GEMM's rows cannot
    as_input = as_residual = as_output = lambda t: t
    precision = weight.precision
    # the halo kernel (conv_halo.py) takes plain 3x3 convs where it was measured faster; what it cannot fuse
    # (a virtual concatenation, an input scale or affine, a pool) and forced paths or tiles stay on the others
    plain = cat_with is None and scale2 is None and pool is None and path == "auto" and tile is None
    plain = plain and not interpret and kernel.tensor_cores and kernel != ConvKernel.GEMM_1X1
    halo = halo_route(x, weight, res4, out_nhwc, stride, padding, dilation) if plain else None
    if kernel == ConvKernel.DEPTHWISE:
        run = prepare_depthwise(x, weight.data, (kh, kw), bias32, epilogue, res4, out_nhwc, stride, padding,
                                dilation, interpret, precision.value, tile, scale2, affine_act, pool)  # fmt: skip
    elif kernel == ConvKernel.DIRECT:
        run = prepare_direct(x, weight.data, c_out, groups, (kh, kw), bias32, epilogue, res4, out_nhwc,
                             stride, padding, dilation, interpret, precision.value, tile)  # fmt: skip
    elif kernel == ConvKernel.GEMM_1X1:
        as_input = lambda t: t.permute(0, 2, 3, 1).reshape(n, h * w, c_in)
        as_residual = lambda t: t.permute(0, 2, 3, 1).reshape(n, h * w, c_out)
        as_output = lambda t: t.as_strided((n * h * w, c_out), (t.stride(2), 1))
        res3 = None if res4 is None else as_residual(res4)
        run = prepare_gemm(op, as_input(x), weight.data, c_out, precision, bias32, epilogue, res3,
                           as_output(out_nhwc), interpret, path, tile, scale2, affine_act)  # fmt: skip
    elif halo is not None:
        run = prepare_halo(weight, bias32, epilogue, halo, dtype)
    else:
        virtual = None if cat_with is None else (cat_with, upsample)
        run = prepare_implicit_gemm(op, x, weight, bias32, epilogue, res4, out_nhwc, stride, padding, dilation,
                                    interpret, path, tile, scale2, virtual, affine_act)  # fmt: skip

    def plan(
        x: torch.Tensor,
        w: torch.Tensor,
        bias: Any,
        residual: Any,
        out: torch.Tensor | None = None,
        input_scale: torch.Tensor | None = None,
        cat_with: torch.Tensor | None = None,
        input_affine: torch.Tensor | None = None,
        pool: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if out is None:
            out = new_out()
        res = None if residual is None else as_residual(residual.expand(out4))
        bias = float32_bias(bias) if convert_bias else bias
        if input_affine is not None:
            scale2 = affine_rows(input_affine)
        else:
            scale2 = None if input_scale is None else scale_rows(input_scale)
        if cat_with is not None:
            run(x, w, bias, res, nhwc(out), scale2, cat_with)  # the implicit GEMM: no views of the sources
        elif pool is not None:
            run(x, w, bias, res, nhwc(out), scale2, pool)  # the depthwise kernel
        elif scale2 is not None:
            run(as_input(x), w, bias, res, as_output(nhwc(out)), scale2)
        else:
            run(as_input(x), w, bias, res, as_output(nhwc(out)))
        return out

    return plan


def _check_pool(
    op: str, pool: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype, kernel: ConvKernel | None
) -> None:
    """A ``pool`` output the plan can write: the depthwise kernel, a contiguous ``[N, C_out]`` of the
    output's dtype (its device is checked with the other tensors)."""
    if kernel != ConvKernel.DEPTHWISE:
        name = kernel.value if kernel is not None else "torch reference"
        raise ValueError(f"{op}: pool (the output's mean) is summed by the depthwise kernel only, not the {name}")
    if not isinstance(pool, torch.Tensor) or tuple(pool.shape) != shape or pool.dtype != dtype:
        got = (tuple(pool.shape), pool.dtype) if isinstance(pool, torch.Tensor) else type(pool).__name__
        raise ValueError(f"{op}: pool must be a {list(shape)} tensor of {dtype} (the output's), got {got}")
    if not pool.is_contiguous():
        raise ValueError(f"{op}: pool must be contiguous, got strides {pool.stride()}")


def _virtual_shape(op: str, x: torch.Tensor, cat_with: torch.Tensor | None, upsample: int) -> tuple[int, int, int, int]:
    """The conv input's shape: ``x``'s, or that of ``cat([upsample_nearest(x, upsample), cat_with], 1)``
    after checking that the two concatenate (clear errors) and that each channel block reads one source."""
    if cat_with is None:
        if upsample != 1:
            raise ValueError(f"{op}: upsample={upsample} applies to a virtual concatenation only (cat_with)")
        return tuple(x.shape)  # type: ignore[return-value]
    if not isinstance(cat_with, torch.Tensor) or cat_with.dim() != 4:
        raise ValueError(
            f"{op}: cat_with must be a 4-D [N, C, H, W] tensor, got {getattr(cat_with, 'shape', cat_with)}"
        )
    if type(upsample) is not int or upsample < 1:
        raise ValueError(f"{op}: upsample must be an int >= 1, got {upsample!r}")
    n, c_a, h, w = x.shape
    expected = (n, h * upsample, w * upsample)
    got = (cat_with.shape[0], cat_with.shape[2], cat_with.shape[3])
    if got != expected or cat_with.dtype != x.dtype:
        raise ValueError(
            f"{op}: cat_with {tuple(cat_with.shape)} ({cat_with.dtype}) does not concatenate with x "
            f"{tuple(x.shape)} ({x.dtype}) upsampled {upsample}x: needs N, H, W = {expected} and x's dtype"
        )
    if c_a % VIRTUAL_CAT_ALIGN:
        raise ValueError(
            f"{op}: a virtual concatenation needs x's channel count to be a multiple of {VIRTUAL_CAT_ALIGN} "
            f"(each channel block reads one source), got {c_a}"
        )
    return n, c_a + cat_with.shape[1], expected[1], expected[2]


def _one_source_blocks(config: TileConfig, channels: int) -> TileConfig:
    """``config`` with the largest channel block (at most its own) that divides ``channels``: each block
    of a virtual concatenation then lies in one of its sources."""
    block_k = max(b for b in (64, 32, 16) if b <= max(16, config.block_k) and channels % b == 0)
    return dataclasses.replace(config, block_k=block_k)


def prepare_implicit_gemm(
    op: str,
    x: torch.Tensor,
    weight: PackedConvWeight,
    bias32: torch.Tensor | None,
    epilogue: Epilogue,
    res4: torch.Tensor | None,
    out_nhwc: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int, int, int],
    dilation: tuple[int, int],
    interpret: bool,
    path: str,
    tile: TileConfig | None = None,
    scale2: torch.Tensor | None = None,
    virtual: tuple[torch.Tensor, int] | None = None,
    affine_act: int | None = None,
) -> Callable[..., Any]:
    """Choose path and tile for checked example inputs; return ``run(x, w, bias32, res4, out_nhwc,
    scale2=None, x2=None)`` for every call of the same signature (``out_nhwc [N, OH, OW, C_out]``, unit
    channel stride, pixels as rows of one stride ``out_nhwc.stride(2)``; ``scale2 [N, C_in]`` the
    channel-scale prologue's factors, tiles.py, or with ``affine_act`` the scales of the affine prologue's
    pairs). ``virtual = (b, up)``: the conv's input is
    ``cat([upsample_nearest(x, up), b], 1)``, read from ``x`` and ``x2 = b`` without being materialized;
    ``x``'s channel count must be a multiple of 16 (each channel block then reads one source)."""
    n, c_in, h, w = x.shape
    c_a = c_in
    if virtual is not None:
        b, up = virtual
        n, c_in, h, w = n, c_in + b.shape[1], b.shape[2], b.shape[3]
    _, oh, ow, c_out = out_nhwc.shape
    kh, kw = weight.kernel_size
    groups, precision, w_data = weight.groups, weight.precision, weight.data
    c_in_g, c_out_g = c_in // groups, c_out // groups
    m = n * oh * ow
    k_total = weight.k_total
    # A virtual concatenation's gather lives in the channel-block loop (each block reads one source), whatever
    # the routing would pick for the channel count.
    order = ConvKernel.IMPLICIT_GEMM if virtual is not None else reduction_order(c_in_g, kh, kw)
    rows = lambda t: t.as_strided((m, c_out), (t.stride(2), 1))
    out2 = rows(out_nhwc)
    elem = w_data.element_size()
    # Each step reads the weights from a multiple of this many columns (flat K: of BLOCK_K, always aligned);
    # a descriptor load must start 16-byte aligned.
    k_unit = {ConvKernel.IMPLICIT_GEMM_FLAT_K: 16, ConvKernel.IMPLICIT_GEMM_ROW_RUNS: kw * c_in_g}.get(order, c_in_g)
    can_desc = (
        groups == 1
        and aligned_2d(w_data)
        and aligned_2d(out2)
        and (k_unit * elem) % 16 == 0
        and descriptors_available(x.device)
    )
    if path == "descriptor" and not can_desc:
        raise ValueError(
            f"{op}: the descriptor path needs groups == 1, 16-byte aligned output rows (C_out={c_out}, "
            f"{x.dtype}), and each K step's first weight column 16-byte aligned in {w_data.dtype} (C_in={c_in} "
            f"for channel blocks, KW * C_in = {kw * c_in_g} for filter rows, any for flat K), and a GPU with TMA"
        )
    use_desc = can_desc and path != "pointer"
    # Box tiles (conv_boxes.py) read the activations through a descriptor too: the default where measured faster.
    transformed = scale2 is not None or virtual is not None
    box_why_not = box_refusal(x, c_out, groups, stride, dilation, w_data.dtype, transformed)
    if box_why_not is None and (order != ConvKernel.IMPLICIT_GEMM or not use_desc):
        box_why_not = f"the {order.value} kernel on the {'descriptor' if use_desc else 'pointer'} path"
    if tile is not None and tile.box_w and box_why_not is not None:
        raise ValueError(f"{op}: box tiles (tile box_w={tile.box_w}) cannot read {box_why_not}")
    if tile is not None and tile.box_w and tile.split_k > 1:
        raise ValueError(f"{op}: box tiles are not split (tile split_k={tile.split_k})")
    shift_why_not = tap_shift_refusal(box_why_not, stride, padding, (h, w), (oh, ow))
    if tile is not None and tile.tap_shift and (shift_why_not is not None or tile.box_w):
        why = shift_why_not or f"box tiles (tile box_w={tile.box_w}): a tile is rows or a box"
        raise ValueError(f"{op}: shifted taps (tile tap_shift={tile.tap_shift}) cannot read {why}")
    if tile is not None and tile.stream_k and (tile.box_w or tile.tap_shift or tile.split_k > 1 or groups != 1):
        raise ValueError(
            f"{op}: stream-K (tile stream_k={tile.stream_k}) deals the row tiles of one group: not with box_w="
            f"{tile.box_w}, tap_shift={tile.tap_shift}, split_k={tile.split_k} or groups={groups}"
        )
    if tile is not None and tile.persistent and (tile.split_k > 1 or tile.stream_k):
        raise ValueError(
            f"{op}: a persistent grid (tile persistent={tile.persistent}) walks whole tiles: not with split_k="
            f"{tile.split_k} or stream_k={tile.stream_k}"
        )
    res_strides = res4.stride() if res4 is not None else (0, 0, 0, 0)
    scalars = (
        h, w, c_in_g, oh, ow, c_out_g, m, k_total,
        stride[0], stride[1], padding[0], padding[2], dilation[0], dilation[1],
        x.stride(0), x.stride(2), x.stride(3), x.stride(1),
        w_data.stride(0),
        *res_strides,
        out2.stride(0),
        c_out,
        *(scale2.stride() if scale2 is not None else (0, 0)),
        c_a,
        *((b.stride(0), b.stride(2), b.stride(3), b.stride(1)) if virtual is not None else (0, 0, 0, 0)),
        float(epilogue.alpha), float(epilogue.scale),
    )  # fmt: skip
    constexprs = {
        "KH": kh,
        "KW": kw,
        "K_ORDER": K_ORDER[order],
        "VIRTUAL_CAT": virtual is not None,
        "UP": virtual[1] if virtual is not None else 1,
        "HAS_BIAS": bias32 is not None,
        "ACT": int(epilogue.act),
        "RESIDUAL": int(epilogue.residual),
        "HAS_SCALE": epilogue.scale != 1.0,
        "ROUND_TF32": epilogue.round_tf32,
        "PROLOGUE": prologue_code(scale2, affine_act),
        "DOT_PRECISION": dot_precision(precision, w_data.dtype),
        "UPCAST": interpret,
        "USE_DESC": use_desc,
    }
    call = KernelCall(_conv2d_act_kernel, scalars, constexprs, interpret)
    # the residual as the reduction kernel reads it: (image, oh, ow, channel) strides
    res_rows = (res_strides[0], res_strides[2], res_strides[3], res_strides[1])
    # The runner outlives this call (with_fallback keeps it): it must not hold the example tensors, which a
    # plan first made inside a compiled forward has from that forward's CUDA-graph pool.
    out_row_stride, device, has_bias = out2.stride(0), x.device, bias32 is not None
    x_shape, x_strides = tuple(x.shape), x.stride()  # the runners keep these, not the example tensor
    facts = device_facts(device)
    sm_count = facts[2] if facts is not None and not interpret else STREAM_K_INTERPRETER_SMS

    def runner(config: TileConfig) -> Callable[..., Any]:
        if order == ConvKernel.IMPLICIT_GEMM_ROW_RUNS:  # one K step per filter row, whatever the config
            config = dataclasses.replace(config, block_k=row_block(c_in_g, kw))
        options = call.options(config, SPLIT_TAIL=reduces_in_tail(config))
        rows_total = n * (oh + padding[0]) * (ow + padding[2]) if config.tap_shift else m
        tiles, slots = cdiv(rows_total, config.block_m) * cdiv(c_out_g, config.block_n), None
        if config.box_w:
            boxes = n * cdiv(oh, config.block_m // config.box_w) * cdiv(ow, config.box_w)
            tiles = boxes * cdiv(c_out_g, config.block_n)
        if config.persistent:
            grid = (max(1, min(tiles, config.persistent * sm_count)), groups, 1)
        elif config.box_w:
            grid = (tiles, groups, 1)
        elif config.stream_k:
            steps = reduction_step_count(order, (kh, kw), c_in_g, k_total, config.block_k)
            programs, slots = stream_k_grid(config, tiles, steps, sm_count)
            grid = (programs, 1, 1)
        else:
            grid = (tiles, groups, config.split_k)
        w_block, out_block = [config.block_n, config.block_k], [config.block_m, config.block_n]
        x_block = box_block(config) if config.box_w else None
        shift_block = [config.block_m, config.block_k] if config.tap_shift else None
        bordered = (
            bordered_copy_plan(x_shape, x_strides, padding[0], padding[2], interpret=interpret)
            if config.tap_shift
            else None
        )
        out_desc = use_desc and not config.box_w and not config.tap_shift  # rows not one block of the output's
        split = None
        if config.split_k > 1 or config.stream_k:
            split = SplitK(config, m, c_out, tiles * groups, (oh, ow), res_rows, out_row_stride, epilogue, has_bias,
                           device, interpret, slots)  # fmt: skip

        def run(
            x: torch.Tensor,
            w: torch.Tensor,
            bias32: Any,
            res4: Any,
            out_nhwc: torch.Tensor,
            scale2: Any = None,
            x2: Any = None,
        ) -> Any:
            out2 = rows(out_nhwc)
            w_ref = make_descriptor(w, w_block) if use_desc else w
            out_ref = make_descriptor(out2, out_block) if out_desc else out2
            if x_block is not None:
                x = make_descriptor(box_descriptor_view(x, stride), x_block)
            elif bordered is not None:
                x = make_descriptor(bordered(x), shift_block)
            if split is not None:
                main = lambda ws, counts: call.launch(grid, (x, w_ref, bias32, res4, out_ref, scale2, x2, ws, counts),
                                                      options)  # fmt: skip
                return split(main, bias32, res4, out2)
            return call.launch(grid, (x, w_ref, bias32, res4, out_ref, scale2, x2, None, None), options)

        return run

    key = {
        "x": [n, c_in, h, w],
        "x_strides": list(x.stride()),
        "c_out": c_out,
        "kernel": [kh, kw],
        "stride": list(stride),
        "padding": list(padding),
        "dilation": list(dilation),
        "groups": groups,
        "x_dtype": str(x.dtype),
        "precision": precision.value,
        "descriptor": use_desc,
    }
    candidates = implicit_gemm_candidates(box_why_not is None, shift_why_not, m, c_in_g, c_out_g, k_total, elem, order,
                                          (kh, kw), stride, (oh, ow))  # fmt: skip
    if candidates[0].box_w:
        key["boxes"] = True
    across_taps = order != ConvKernel.IMPLICIT_GEMM  # flat K or filter rows: a K step spans taps
    interpret_config = INTERPRET_CONFIG if across_taps or c_in_g > 16 else INTERPRET_CONFIG_NARROW
    x2 = None
    if virtual is not None:
        key.update(virtual_cat=[c_a, up], x2_strides=list(b.stride()))
        candidates = list(dict.fromkeys(_one_source_blocks(c, c_a) for c in candidates))
        interpret_config = _one_source_blocks(interpret_config, c_a)
        x2 = b
    if tile is not None and virtual is not None and c_a % tile.block_k:
        raise ValueError(f"{op}: tile block_k={tile.block_k} does not divide the first source's {c_a} channels")
    config = choose_tile(
        "conv2d_act",
        key,
        candidates,
        lambda c: runner(c)(x, w_data, bias32, res4, out_nhwc, scale2, x2),
        interpret=interpret,
        interpret_config=interpret_config,
        forced=tile,
        device=x.device,
        problem=Problem(m, c_out_g, k_total, groups, elem, precision.value),
    )
    return with_fallback(runner, config, candidates, forced=tile is not None or interpret)
