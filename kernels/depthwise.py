"""Depthwise convolution (``groups == C_in == C_out``) as a direct kernel with the fused epilogue.

A depthwise conv does KH*KW multiply-adds per output value: it is memory-bound, and forcing it
through a GEMM would waste the tensor cores on a 1-wide reduction. Each program computes a tile of
output pixels x channels on NHWC data; channels are contiguous, so every tap is one vector load per
pixel row, and the KH*KW taps of neighbouring pixels hit the same cache lines.

With a pool (``POOL``, squeeze-excitation's global average pool of this conv's output fused in) each program
also sums its tile's stored values per channel, and the mean over (H, W) is the fixed-order sum of those
partial sums: the output is never read again for the pool. The pixel tiles are then per image (a grid axis
over images, tiles of ``OH * OW`` rows each) rather than over all ``N * OH * OW`` rows, so that a tile's sum
belongs to one image. Splitting a straddling tile's sum by image instead would keep the tiling but cost a
masked sum per image the tile touches (up to three for a 7x7 layer's 64-row tile) and a reduction that must
find each image's programs; the per-image tiles cost only the idle rows of each image's last tile, whose
lanes are masked (they load and store nothing, but their programs still walk the taps).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from .autotune import Problem, TileConfig
from .channel_mean import add_splits
from .epilogue import Epilogue
from .launch import KernelCall, alignment_unit, cdiv, choose_tile
from .splitk import SM_COUNT
from .tiles import (
    decode_rows,
    epilogue_tile,
    load_operand,
    prologue_code,
    row_offsets,
    store_tile,
)

# The POOL constexpr: no pool; each program's per-channel sums into the float32 partials [N, TILES, C] that
# kernels/channel_mean.py's add_splits reduces; or, with one tile per image, the mean itself into [N, C].
POOL_NONE = tl.constexpr(0)
POOL_PARTIAL = tl.constexpr(1)
POOL_FINAL = tl.constexpr(2)


@triton.jit
def _tap(acc, x_rows, c_off, ih0, iw0, kh, kw, m_ok, c_ok, offs_c, w_ptr, ps_ptr, ps_img, ps_chan,
         H, W, C, sx_h, sx_w, dil_h, dil_w, KW: tl.constexpr, PROLOGUE: tl.constexpr):  # fmt: skip
    """``acc`` plus filter tap ``(kh, kw)``'s products: the input pixel each output row reads through that
    tap (zero outside the image: the padding), times the tap's weight per channel."""
    ih = ih0 + kh * dil_h
    iw = iw0 + kw * dil_w
    ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    w = tl.load(w_ptr + (kh * KW + kw) * C + offs_c, mask=c_ok, other=0.0)
    x_ptrs = (x_rows + ih.to(tl.int64) * sx_h + iw.to(tl.int64) * sx_w)[:, None] + c_off[None, :]
    x = load_operand(x_ptrs, ok[:, None] & c_ok[None, :], ps_ptr, ps_img, ps_chan, PROLOGUE)
    # Round the activation to the weights' (operand) dtype first, as the GEMM kernels do.
    return acc + x.to(w.dtype).to(tl.float32) * w.to(tl.float32)[None, :]


# Image sizes and the conv geometry vary per layer: not specialized, so layers that differ only in them share
# one compile. (Triton would compile a stride, padding or dilation of 1 in as a constant and mark a 0 as
# divisible by 16: that buys nothing here, they enter only the pixel decode, not the channel-contiguous loads.)
@triton.jit(
    do_not_specialize=["H", "W", "OH", "OW", "M", "stride_h", "stride_w", "pad_top", "pad_left", "dil_h", "dil_w"]
)
def _depthwise_act_kernel(
    # pointers
    x_ptr,
    w_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    ps_ptr,  # the prologue's [N, C] factors (tiles.py)
    pool_ptr,  # POOL: the partial sums [N, TILES, C] (float32) or the mean [N, C]
    # sizes; C_V is C / VEC
    H,
    W,
    C_V,
    OH,
    OW,
    M,
    # conv geometry
    stride_h,
    stride_w,
    pad_top,
    pad_left,
    dil_h,
    dil_w,
    # strides (elements); w is [KH * KW, C], out is [M, C] with row stride VEC * stride_om_v; x's
    # pixel strides are VEC * sx_*_v (VEC > 1 only where its channel stride sx_c is 1)
    sx_n_v,
    sx_h_v,
    sx_w_v,
    sx_c,
    sr_n,
    sr_c,
    sr_h,
    sr_w,
    stride_om_v,
    sps_n,
    sps_c,
    # epilogue scalars
    alpha,
    scale,
    # constexprs
    KH: tl.constexpr,
    KW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ROUND_TF32: tl.constexpr,
    PROLOGUE: tl.constexpr,
    POOL: tl.constexpr,
    VEC: tl.constexpr,
    UNROLL_TAPS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # A size or stride passed as a multiple of the constexpr VEC tells the compiler that channel runs
    # of VEC elements are aligned, so loads and stores are vectorized when C is, say, 72 or 120: Triton
    # itself only specializes integers divisible by 16, and without this such layers ran 4-8x slower.
    C = C_V * VEC
    sx_n = sx_n_v * VEC
    sx_h = sx_h_v * VEC
    sx_w = sx_w_v * VEC
    stride_om = stride_om_v * VEC
    if POOL == POOL_NONE:
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
    else:  # tiles per image: program (tile, channel block, image)
        in_image = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = in_image < OH * OW
        offs_m = tl.program_id(2) * (OH * OW) + in_image
    offs_c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = offs_c < C
    n_idx, oh, ow = decode_rows(offs_m, m_ok, OH, OW)
    ih0 = oh * stride_h - pad_top
    iw0 = ow * stride_w - pad_left
    x_rows = x_ptr + n_idx.to(tl.int64) * sx_n
    c_off = offs_c.to(tl.int64) * sx_c
    ps_img = n_idx.to(tl.int64)[:, None] * sps_n
    ps_chan = (offs_c.to(tl.int64) * sps_c)[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if UNROLL_TAPS:
        for kh in tl.static_range(KH):
            for kw in tl.static_range(KW):
                acc = _tap(acc, x_rows, c_off, ih0, iw0, kh, kw, m_ok, c_ok, offs_c, w_ptr, ps_ptr, ps_img,
                           ps_chan, H, W, C, sx_h, sx_w, dil_h, dil_w, KW, PROLOGUE)  # fmt: skip
    else:
        # Filter rows as a runtime loop: the fully unrolled 5x5 issues all 25 taps' loads at once and
        # spills (255 registers per thread on sm90), and compiles 5-7x longer.
        for kh in range(KH):
            for kw in tl.static_range(KW):
                acc = _tap(acc, x_rows, c_off, ih0, iw0, kh, kw, m_ok, c_ok, offs_c, w_ptr, ps_ptr, ps_img,
                           ps_chan, H, W, C, sx_h, sx_w, dil_h, dil_w, KW, PROLOGUE)  # fmt: skip

    res_rows = row_offsets(n_idx, oh, ow, sr_n, sr_h, sr_w)
    y = epilogue_tile(acc, offs_c, c_ok, m_ok, bias_ptr, res_ptr, res_rows, sr_c, alpha, scale,
                      HAS_BIAS, ACT, RESIDUAL, HAS_SCALE, ROUND_TF32)  # fmt: skip
    store_tile(out_ptr, offs_m, stride_om, offs_c, m_ok, c_ok, y)
    if POOL != POOL_NONE:
        # The sum of what was stored (rounded to the output's dtype), as a mean of the output would read it;
        # rows past the image decode as row 0 and hold its values: masked out.
        stored = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        total = tl.sum(tl.where(m_ok[:, None], stored, 0.0), axis=0)
        image = tl.program_id(2).to(tl.int64)
        if POOL == POOL_FINAL:
            mean = total / (OH * OW)
            tl.store(pool_ptr + image * C + offs_c, mean.to(pool_ptr.dtype.element_ty), mask=c_ok)
        else:
            tile = image * tl.num_programs(0) + tl.program_id(0)
            tl.store(pool_ptr + tile * C + offs_c, total, mask=c_ok)


INTERPRET_CONFIG = TileConfig(128, 32, 1, 1, 4, 1)

# Filters with more taps than this walk their rows in a runtime loop (UNROLL_TAPS off): see the kernel.
UNROLL_MAX_TAPS = 9


def depthwise_candidates(channels: int, rows: int) -> list[TileConfig]:
    """Tiles of (pixels, channels) worth measuring; the first is the default.

    All three hold 2048 outputs over 4 warps: on the H200 they were the fastest on each of 42 depthwise
    layers of EfficientNet-B0 and MobileNetV3-Large at batch 1 (fp32) and 32 (fp16), and larger tiles ran
    1.5-10x slower (register spills, idle SMs; benchmarks/results/depthwise-sweep-2026-12-01.json).
    64x32 when it gives two waves of programs over the SMs, else 16x64, which makes four times as many:
    over those layers that pick was within 1% of the best of the three.
    """
    wide, narrow = TileConfig(64, 32, 1, 1, 4, 1), TileConfig(16, 64, 1, 1, 4, 1)
    first = [wide, narrow] if cdiv(rows, 64) * cdiv(channels, 32) >= 2 * SM_COUNT else [narrow, wide]
    return [*first, TileConfig(32, 64, 1, 1, 4, 1)]


def prepare_depthwise(
    x: torch.Tensor,
    w: torch.Tensor,
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
    scale2: torch.Tensor | None = None,
    affine_act: int | None = None,
    pool: torch.Tensor | None = None,
) -> Callable[..., Any]:
    """Choose the tile for checked example inputs; return ``run(x, w, bias32, res4, out, scale2=None,
    pool=None)`` for every call of the same signature. ``out`` is ``[N, OH, OW, C]`` NHWC with unit channel
    stride and pixels as rows of one stride (``out.stride(2)``), ``res4`` the residual expanded to
    ``[N, C, OH, OW]``, ``scale2 [N, C]`` the channel-scale prologue's factors (tiles.py), or with
    ``affine_act`` (an activation) the scales of the affine prologue's pairs. With an example ``pool`` (a
    contiguous ``[N, C]`` tensor of ``out``'s dtype) every call takes one like it and also writes the mean of
    its output over (OH, OW) there: summed by the conv's programs, then, where an image has several pixel
    tiles, added in a fixed order by a second launch (deterministic, no atomics)."""
    n, c, h, wd = x.shape
    _, oh, ow, _ = out.shape
    m = n * oh * ow
    res_strides = res4.stride() if res4 is not None else (0, 0, 0, 0)
    # Aligned channel runs only for NHWC input; the output is NHWC (rows of out.stride(2)) always.
    aligned = (c, x.stride(0), x.stride(2), x.stride(3), out.stride(2)) if x.stride(1) == 1 else (1,)
    vec = alignment_unit(x.element_size(), aligned)
    scalars = (
        h, wd, c // vec, oh, ow, m,
        stride[0], stride[1], padding[0], padding[2], dilation[0], dilation[1],
        x.stride(0) // vec, x.stride(2) // vec, x.stride(3) // vec, x.stride(1),
        *res_strides,
        out.stride(2) // vec,
        *(scale2.stride() if scale2 is not None else (0, 0)),
        float(epilogue.alpha), float(epilogue.scale),
    )  # fmt: skip
    constexprs = {
        "KH": kernel_size[0],
        "KW": kernel_size[1],
        "HAS_BIAS": bias32 is not None,
        "ACT": int(epilogue.act),
        "RESIDUAL": int(epilogue.residual),
        "HAS_SCALE": epilogue.scale != 1.0,
        "ROUND_TF32": epilogue.round_tf32,
        "PROLOGUE": prologue_code(scale2, affine_act),
        "VEC": vec,
        "UNROLL_TAPS": kernel_size[0] * kernel_size[1] <= UNROLL_MAX_TAPS,
    }

    def runner(config: TileConfig) -> Callable[..., Any]:
        if pool is None:
            call = KernelCall(_depthwise_act_kernel, scalars, {**constexprs, "POOL": int(POOL_NONE)}, interpret)
            options = call.options(config)
            grid = (cdiv(m, config.block_m), cdiv(c, config.block_n))
            return lambda x, w, bias32, res4, out, scale2=None, pool=None: call.launch(
                grid, (x, w, bias32, res4, out, scale2, None), options
            )
        tiles = cdiv(oh * ow, config.block_m)
        mode = POOL_FINAL if tiles == 1 else POOL_PARTIAL
        call = KernelCall(_depthwise_act_kernel, scalars, {**constexprs, "POOL": int(mode)}, interpret)
        options = call.options(config)
        grid = (tiles, cdiv(c, config.block_n), n)

        def run(x: Any, w: Any, bias32: Any, res4: Any, out: Any, scale2: Any = None, pool: Any = None) -> None:
            if tiles == 1:
                call.launch(grid, (x, w, bias32, res4, out, scale2, pool), options)
                return
            partials = torch.empty((n, tiles, c), dtype=torch.float32, device=out.device)
            call.launch(grid, (x, w, bias32, res4, out, scale2, partials), options)
            add_splits(partials, pool, oh * ow, interpret=interpret)

        return run

    key = {
        "x": [n, c, h, wd],
        "x_strides": list(x.stride()),
        "kernel": list(kernel_size),
        "stride": list(stride),
        "padding": list(padding),
        "dilation": list(dilation),
        "x_dtype": str(x.dtype),
        "precision": precision_name,
    } | ({"pool": True} if pool is not None else {})
    config = choose_tile(
        "depthwise_act",
        key,
        depthwise_candidates(c, m),
        lambda cfg: runner(cfg)(x, w, bias32, res4, out, scale2, pool),
        interpret=interpret,
        interpret_config=INTERPRET_CONFIG,
        forced=tile,
        device=x.device,
        problem=Problem(m, c, kernel_size[0] * kernel_size[1], 1, x.element_size(), precision_name),
    )
    return runner(config)
