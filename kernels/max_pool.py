"""``max_pool2d`` of an NHWC tensor: one window per output, every channel of a pixel in one vector load.

ResNet's stem pools its 64-channel 112x112 map with a 3x3 stride-2 window. PyTorch's NHWC max-pool kernel
ran it at about 0.4 TB/s on the H200 (0.117 ms at batch 32 fp16, 0.020 ms at batch 1: a launch of 28
blocks); this is the depthwise kernel's layout without weights: programs over (output pixels, channels),
the window a loop, masked taps reading ``-inf`` as torch pads. The output is channels_last.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from .depthwise import depthwise_candidates
from .launch import FLOAT_DTYPES, LaunchOptions, alignment_unit, cdiv, launch
from .tiles import decode_rows, store_tile


@triton.jit(do_not_specialize=["H", "W", "OH", "OW", "M", "stride_h", "stride_w", "pad_h", "pad_w"])
def _max_pool2d_kernel(
    # pointers
    x_ptr,
    out_ptr,
    # sizes; C_V is C / VEC
    H,
    W,
    C_V,
    OH,
    OW,
    M,
    # window geometry
    stride_h,
    stride_w,
    pad_h,
    pad_w,
    # strides (elements) of x [N, H, W, C] divided by VEC (channels are unit-stride); out is [M, C]
    sx_n_v,
    sx_h_v,
    sx_w_v,
    # constexprs
    KH: tl.constexpr,
    KW: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Sizes and strides arrive as multiples of VEC so channel runs are known aligned (see depthwise.py).
    C = C_V * VEC
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    c_ok = offs_c < C
    n_idx, oh, ow = decode_rows(offs_m, m_ok, OH, OW)
    x_rows = x_ptr + n_idx.to(tl.int64) * (sx_n_v * VEC)
    ih0 = oh * stride_h - pad_h
    iw0 = ow * stride_w - pad_w
    acc = tl.full((BLOCK_M, BLOCK_N), float("-inf"), tl.float32)
    for kh in range(KH):
        ih = ih0 + kh
        h_ok = m_ok & (ih >= 0) & (ih < H)
        for kw in tl.static_range(KW):
            iw = iw0 + kw
            ok = h_ok & (iw >= 0) & (iw < W)
            pix = ih.to(tl.int64) * (sx_h_v * VEC) + iw.to(tl.int64) * (sx_w_v * VEC)
            ptrs = (x_rows + pix)[:, None] + offs_c[None, :]
            v = tl.load(ptrs, mask=ok[:, None] & c_ok[None, :], other=float("-inf"))
            acc = tl.maximum(acc, v.to(tl.float32))
    store_tile(out_ptr, offs_m, C, offs_c, m_ok, c_ok, acc)


def _pair(value: Any) -> tuple[int, int]:
    return (int(value), int(value)) if isinstance(value, int) else (int(value[0]), int(value[1]))


def _unsupported(x: torch.Tensor, kernel_size: Any, padding: Any) -> str | None:
    """Why the kernel does not compute ``F.max_pool2d(x, kernel_size, padding=padding)`` (floor mode,
    dilation 1), or None when it does."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        return "the input is not a 4-D [N, C, H, W] tensor"
    if x.dtype not in FLOAT_DTYPES:
        return f"dtype {x.dtype} (the kernel reads float32, float16 and bfloat16)"
    if x.stride(1) != 1:
        return f"the input is not channels_last (strides {tuple(x.stride())})"
    kh, kw = _pair(kernel_size)
    ph, pw = _pair(padding)
    if 2 * ph > kh or 2 * pw > kw:
        return f"padding {(ph, pw)} over half the window {(kh, kw)}"
    return None


def max_pool2d_plan(
    x: torch.Tensor,
    kernel_size: Any,
    stride: Any = None,
    padding: Any = 0,
    *,
    interpret: bool = False,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``run(x) -> F.max_pool2d(x, kernel_size, stride, padding)`` (dilation 1, floor mode) for every
    input of ``x``'s shape, strides and dtype; the output is channels_last. ``x`` is channels_last
    ``[N, C, H, W]`` on CUDA, or on the CPU with ``interpret=True`` (Triton's interpreter)."""
    reason = _unsupported(x, kernel_size, padding)
    if reason is not None:
        raise ValueError(f"max_pool2d: {reason}")
    want = "cpu" if interpret else "cuda"
    if x.device.type != want:
        raise ValueError(f"max_pool2d: interpret={interpret} runs on {want} tensors, x is on {x.device}")
    kh, kw = _pair(kernel_size)
    sh, sw = _pair(stride if stride is not None and stride != [] else kernel_size)
    ph, pw = _pair(padding)
    n, c, h, w = x.shape
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    if oh < 1 or ow < 1:
        raise ValueError(f"max_pool2d: window {(kh, kw)} with padding {(ph, pw)} does not fit a {h}x{w} input")
    m = n * oh * ow
    vec = alignment_unit(x.element_size(), (c, x.stride(0), x.stride(2), x.stride(3)))
    # The depthwise conv's tile rule: the same stencil over channel runs, without the multiply.
    tile = depthwise_candidates(c, m)[0]
    grid = (cdiv(m, tile.block_m), cdiv(c, tile.block_n))
    options = LaunchOptions(
        {"KH": kh, "KW": kw, "VEC": vec, "BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n,
         "num_warps": tile.num_warps, "num_stages": 1}
    )  # fmt: skip
    scalars = (h, w, c // vec, oh, ow, m, sh, sw, ph, pw, x.stride(0) // vec, x.stride(2) // vec, x.stride(3) // vec)

    def run(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((n, c, oh, ow), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
        launch(_max_pool2d_kernel, grid, (x, out, *scalars), options, interpret)
        return out

    return run
