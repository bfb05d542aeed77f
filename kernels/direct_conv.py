"""Convolutions with very few input channels per group (the 3-channel RGB stem) as a direct kernel.

With ``C_in / groups * KH * KW`` around 27, an implicit GEMM has a K too short to feed the tensor
cores and spends its time gathering a [pixels, K] patch tile scattered over three image rows. Here
each program keeps a float32 accumulator and walks the taps one by one (``C_IN_G``, ``KH``, ``KW`` are
compile-time; a filter row's taps are unrolled, the rows are a loop, which keeps the compile short: 0.5 s
against 1.1 s unrolled for a 3x3 stem, the longest compile of a cold optimize()): per tap one load of a
pixel vector (neighbouring taps hit the same cache lines), one load of a weight row, one outer-product
multiply-add. The result is computed in full float32 whatever the precision policy (bf16 / fp16 policies
round the operands to their dtype first, as the GEMM kernels do: the packed weights already, the pixels as
they are loaded).

The accumulator is ``[channels, pixels]``: every output channel of a pixel sits in one lane, so a tap's pixel
vector multiplies the weight row without leaving the lane's registers, and the weight row (float32, padded:
kernels/packing.py's direct layout) is one unmasked load that all lanes share. The first version held
``[pixels, channels]``, which spread the channels over the lanes and moved every tap's pixel vector through
shared memory (18 barriers per filter row); under Nsight Compute the fp16 stem issued on 74% of its cycles,
bound by instruction count (kernels/NOTES.md version 18), and this layout takes about 18% fewer instructions
per output in the compiled code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from .autotune import Problem, TileConfig
from .epilogue import Epilogue
from .launch import KernelCall, cdiv, choose_tile
from .packing import direct_block_n, direct_columns, operand_dtype
from .precision import Precision
from .tiles import decode_rows, epilogue_tile, row_offsets, store_tile


@triton.jit
def _round_to_bf16(x):
    """Float32 ``x`` rounded to the nearest bfloat16 (ties to even), kept in float32, by integer ops: the GPU's
    ``.to(tl.bfloat16)`` rounds so too, but the interpreter's truncates, and the CPU tests check this rounding
    exactly. NaN stays NaN (its bits could carry into the sign)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(x == x, rounded, x)


# Image sizes and the conv geometry vary per layer: not specialized, so layers that differ only in them share
# one compile. (Triton would compile a stride, padding or dilation of 1 in as a constant and mark a 0 as
# divisible by 16: that buys nothing here, they enter only the pixel decode, not the channel-contiguous loads.)
@triton.jit(
    do_not_specialize=["H", "W", "OH", "OW", "M", "stride_h", "stride_w", "pad_top", "pad_left", "dil_h", "dil_w"]
)
def _direct_conv_act_kernel(
    # pointers; w is the direct-layout packed weight, float32 [groups * K, W_COLS], K ordered (kh, kw, c)
    x_ptr,
    w_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    # sizes
    H,
    W,
    OH,
    OW,
    C_OUT_G,
    M,
    # conv geometry
    stride_h,
    stride_w,
    pad_top,
    pad_left,
    dil_h,
    dil_w,
    # strides (elements): x as NHWC logical, residual as NCHW logical, out rows
    sx_n,
    sx_h,
    sx_w,
    sx_c,
    sr_n,
    sr_c,
    sr_h,
    sr_w,
    stride_om,
    # epilogue scalars
    alpha,
    scale,
    # constexprs
    KH: tl.constexpr,
    KW: tl.constexpr,
    C_IN_G: tl.constexpr,
    W_COLS: tl.constexpr,
    ROUND_X: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ROUND_TF32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    group = tl.program_id(2)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < C_OUT_G
    channels = group * C_OUT_G + offs_n
    n_idx, oh, ow = decode_rows(offs_m, m_ok, OH, OW)
    ih0 = oh * stride_h - pad_top
    iw0 = ow * stride_w - pad_left
    x_rows = x_ptr + n_idx.to(tl.int64) * sx_n + (group * C_IN_G).to(tl.int64) * sx_c
    w_rows = w_ptr + group * (KH * KW * C_IN_G * W_COLS) + offs_n  # columns past C_OUT_G are zeros: no mask

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kh in range(KH):
        ih = ih0 + kh * dil_h
        h_ok = m_ok & (ih >= 0) & (ih < H)
        for kw in tl.static_range(KW):
            iw = iw0 + kw * dil_w
            ok = h_ok & (iw >= 0) & (iw < W)
            pix = x_rows + ih.to(tl.int64) * sx_h + iw.to(tl.int64) * sx_w
            for c in tl.static_range(C_IN_G):
                wv = tl.load(w_rows + ((kh * KW + kw) * C_IN_G + c) * W_COLS)
                xv = tl.load(pix + c * sx_c, mask=ok, other=0.0)
                if ROUND_X == 1:
                    xv = xv.to(tl.float16)
                elif ROUND_X == 2:
                    xv = _round_to_bf16(xv)
                acc += wv[:, None] * xv.to(tl.float32)[None, :]

    res_rows = row_offsets(n_idx, oh, ow, sr_n, sr_h, sr_w)
    y = epilogue_tile(tl.trans(acc), channels, n_ok, m_ok, bias_ptr, res_ptr, res_rows, sr_c, alpha, scale,
                      HAS_BIAS, ACT, RESIDUAL, HAS_SCALE, ROUND_TF32)  # fmt: skip
    store_tile(out_ptr, offs_m, stride_om, channels, m_ok, n_ok, y)


INTERPRET_CONFIG = TileConfig(128, 16, 1, 1, 4, 1)


def direct_candidates(c_out_g: int) -> list[TileConfig]:
    """Programs of 32 accumulators per lane (2 pixels of 16 channels, 1 of 32; 1 pixel of 64 holds 64), on 2, 4 and
    8 warps, then 4 pixels of 16 channels. On the YOLOv8n stem at batch 32
    (benchmarks/results/conv-tile-sweep-2026-12-04-stem.json) 2 pixels per lane ran in 152 us (fp16) and 171 us
    (tf32), 4 pixels in 179 and 196 us, 1 pixel in 215 and 238 us; smaller programs come first, as they also fill
    the SMs at batch 1."""
    bn = direct_block_n(c_out_g)
    pixels = max(1, 32 // bn)  # per lane
    return [
        TileConfig(64 * pixels, bn, 1, 1, 2, 1),
        TileConfig(128 * pixels, bn, 1, 1, 4, 1),
        TileConfig(256 * pixels, bn, 1, 1, 8, 1),
        TileConfig(256 * pixels, bn, 1, 1, 4, 1),
    ]


def prepare_direct(
    x: torch.Tensor,
    w: torch.Tensor,
    c_out: int,
    groups: int,
    kernel_size: tuple[int, int],
    bias32: torch.Tensor | None,
    epilogue: Epilogue,
    res4: torch.Tensor | None,
    out: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int, int, int],
    dilation: tuple[int, int],
    interpret: bool,
    precision_name: str,
    tile: TileConfig | None = None,
) -> Callable[..., Any]:
    """Choose the tile for checked example inputs; return ``run(x, w, bias32, res4, out)`` for every call
    of the same signature. ``out`` is ``[N, OH, OW, C_out]`` NHWC with unit channel stride and pixels as
    rows of one stride (``out.stride(2)``: more than C_out for a channel slice of a wider buffer)."""
    n, c_in, h, wd = x.shape
    _, oh, ow, _ = out.shape
    m = n * oh * ow
    c_in_g, c_out_g = c_in // groups, c_out // groups
    res_strides = res4.stride() if res4 is not None else (0, 0, 0, 0)
    scalars = (
        h, wd, oh, ow, c_out_g, m,
        stride[0], stride[1], padding[0], padding[2], dilation[0], dilation[1],
        x.stride(0), x.stride(2), x.stride(3), x.stride(1),
        *res_strides,
        out.stride(2),
        float(epilogue.alpha), float(epilogue.scale),
    )  # fmt: skip
    w_cols = direct_columns(c_out_g)
    if tuple(w.shape) != (groups * c_in_g * kernel_size[0] * kernel_size[1], w_cols) or w.dtype != torch.float32:
        raise ValueError(
            f"direct conv: packed weight is {tuple(w.shape)} {w.dtype}, not the direct layout "
            f"({groups * c_in_g * kernel_size[0] * kernel_size[1]}, {w_cols}) float32 (kernels/packing.py)"
        )
    operand = operand_dtype(Precision.parse(precision_name))
    round_x = 0 if operand in (torch.float32, x.dtype) else {torch.float16: 1, torch.bfloat16: 2}[operand]
    constexprs = {
        "KH": kernel_size[0],
        "KW": kernel_size[1],
        "C_IN_G": c_in_g,
        "W_COLS": w_cols,
        "ROUND_X": round_x,
        "HAS_BIAS": bias32 is not None,
        "ACT": int(epilogue.act),
        "RESIDUAL": int(epilogue.residual),
        "HAS_SCALE": epilogue.scale != 1.0,
        "ROUND_TF32": epilogue.round_tf32,
    }
    call = KernelCall(_direct_conv_act_kernel, scalars, constexprs, interpret)

    def runner(config: TileConfig) -> Callable[..., Any]:
        if w_cols % config.block_n:
            raise ValueError(f"direct conv: block_n={config.block_n} does not divide the {w_cols} weight columns")
        options = call.options(config)
        grid = (cdiv(m, config.block_m), cdiv(c_out_g, config.block_n), groups)
        return lambda x, w, bias32, res4, out: call.launch(grid, (x, w, bias32, res4, out), options)

    key = {
        "x": list(x.shape),
        "x_strides": list(x.stride()),
        "c_out": c_out,
        "groups": groups,
        "kernel": list(kernel_size),
        "stride": list(stride),
        "padding": list(padding),
        "dilation": list(dilation),
        "x_dtype": str(x.dtype),
        "precision": precision_name,
    }
    config = choose_tile(
        "direct_conv_act",
        key,
        direct_candidates(c_out_g),
        lambda c: runner(c)(x, w, bias32, res4, out),
        interpret=interpret,
        interpret_config=INTERPRET_CONFIG,
        forced=tile,
        device=x.device,
        problem=Problem(m, c_out_g, c_in_g * kernel_size[0] * kernel_size[1], groups, x.element_size(), precision_name),
    )
    return runner(config)
