"""``max_pool_pyramid``: the concatenation of stride-1 max pools of one input, in one kernel.

YOLO's SPPF block computes ``cat([x, m(x), m(m(x)), m(m(m(x)))], dim=1)`` with ``m`` a 5x5 stride-1
max pool padded by 2 (YOLOv5's SPP computes ``cat([x, pool5(x), pool9(x), pool13(x)])``). Max pools with
stride 1 and ``-inf`` padding compose exactly: ``pool_a(pool_b(x)) == pool_(a+b-1)(x)``, so every slice of
the concatenation is one centred window of ``x``: radius 0 (the input itself), 2, 4 and 6 for SPPF. Eager
PyTorch runs three pooling kernels and a copy; this kernel reads each input element's neighbourhood once
and writes all slices of the concatenated output, whatever its memory format.

Each program handles a tile of output pixels x channels; ``SLICES`` radii are constexprs, so the window
loop is unrolled and each tap updates exactly the slices whose window contains it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from .launch import FLOAT_DTYPES, LaunchOptions, PlanCache, cdiv, launch, tensor_meta

MAX_SLICES = 4


@triton.jit
def _window_max(acc, v, row_in, TAP_W: tl.constexpr, R_MAX: tl.constexpr, R: tl.constexpr):
    """``acc`` updated with ``v`` when column tap TAP_W of the largest window lies in the window of radius R
    and the current row does (``row_in``, a runtime flag: rows are a loop, columns unrolled).

    Nested constexpr ifs, resolved at compile time (no boolean operators on constexprs: older triton
    versions do not fold them)."""
    if TAP_W >= R_MAX - R:  # noqa: SIM102
        if TAP_W <= R_MAX + R:
            acc = tl.where(row_in, tl.maximum(acc, v), acc)
    return acc


@triton.jit
def _max_pool_pyramid_kernel(
    # pointers
    x_ptr,
    out_ptr,
    # sizes
    H,
    W,
    C,
    M,
    # strides (elements) of x [N, C, H, W] and of out [N, SLICES * C, H, W]
    sx_n,
    sx_c,
    sx_h,
    sx_w,
    so_n,
    so_c,
    so_h,
    so_w,
    # constexprs: the radius of each slice's window (slices past SLICES are ignored)
    R0: tl.constexpr,
    R1: tl.constexpr,
    R2: tl.constexpr,
    R3: tl.constexpr,
    R_MAX: tl.constexpr,
    SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m_ok = offs_m < M
    c_ok = offs_c < C
    rows = tl.where(m_ok, offs_m, 0)
    hw = H * W
    n_idx = rows // hw
    h = (rows % hw) // W
    w = rows % W
    x_base = x_ptr + n_idx.to(tl.int64)[:, None] * sx_n + offs_c.to(tl.int64)[None, :] * sx_c

    m0 = tl.full((BLOCK_M, BLOCK_C), float("-inf"), tl.float32)
    m1 = m0
    m2 = m0
    m3 = m0
    # Rows of the window are a runtime loop, its columns unrolled: unrolling all (2 R_MAX + 1)^2 taps made
    # SPPF's kernel (13 x 13) take 18 s to compile on the H200 machine, the longest of any fuser kernel.
    for i in range(2 * R_MAX + 1):
        ih = h + (i - R_MAX)
        h_ok = m_ok & (ih >= 0) & (ih < H)
        d = tl.abs(i - R_MAX)
        for j in tl.static_range(2 * R_MAX + 1):
            iw = w + (j - R_MAX)
            ok = h_ok & (iw >= 0) & (iw < W)
            pix = ih.to(tl.int64) * sx_h + iw.to(tl.int64) * sx_w
            v = tl.load(x_base + pix[:, None], mask=ok[:, None] & c_ok[None, :], other=float("-inf"))
            v = v.to(tl.float32)
            m0 = _window_max(m0, v, d <= R0, j, R_MAX, R0)
            if SLICES > 1:
                m1 = _window_max(m1, v, d <= R1, j, R_MAX, R1)
            if SLICES > 2:
                m2 = _window_max(m2, v, d <= R2, j, R_MAX, R2)
            if SLICES > 3:
                m3 = _window_max(m3, v, d <= R3, j, R_MAX, R3)

    out_rows = n_idx.to(tl.int64) * so_n + h.to(tl.int64) * so_h + w.to(tl.int64) * so_w
    out_base = out_ptr + out_rows[:, None] + offs_c.to(tl.int64)[None, :] * so_c
    ok = m_ok[:, None] & c_ok[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(out_base, m0.to(dtype), mask=ok)
    if SLICES > 1:
        tl.store(out_base + C * so_c, m1.to(dtype), mask=ok)
    if SLICES > 2:
        tl.store(out_base + 2 * C * so_c, m2.to(dtype), mask=ok)
    if SLICES > 3:
        tl.store(out_base + 3 * C * so_c, m3.to(dtype), mask=ok)


def _tile(pixels: int, channels: int, channels_last: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_C, num_warps): channels along the contiguous axis of NHWC, pixels for NCHW.

    Each program reads a (2 R_MAX + 1)^2 window per output, serially: the kernel is latency-bound, so
    the tile is small enough to give about two programs per SM on late, small feature maps (SPPF sits on
    the 20x20 map of a 640 input: 32x64 tiles gave 26 programs on 132 SMs)."""
    if not channels_last:
        return 64, 16, 4
    block_c = min(32, max(16, triton.next_power_of_2(channels)))
    block_m = 16
    if cdiv(pixels, block_m) * cdiv(channels, block_c) < 264:
        block_m = 8
    return block_m, block_c, max(1, block_m * block_c // 128)


def max_pool_pyramid_plan(
    x: torch.Tensor, radii: Sequence[int], *, interpret: bool = False
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A call ``run(x) -> out`` for every input with ``x``'s shape, strides, dtype, device and 16-byte
    alignment (its launches after the first call the compiled kernel directly, :class:`LaunchOptions`);
    ``out[:, i*C:(i+1)*C]`` is the stride-1 max pool of ``x`` with a ``(2 r_i + 1)``-square window padded by
    ``-inf`` (``r_i = 0``: ``x`` itself).

    ``x`` is ``[N, C, H, W]`` on CUDA (``interpret=False``) or on the CPU (``interpret=True``, Triton's
    interpreter); the output keeps ``x``'s memory format (channels_last stays channels_last)."""
    radii = tuple(int(r) for r in radii)
    if not 1 <= len(radii) <= MAX_SLICES or min(radii) < 0:
        raise ValueError(f"max_pool_pyramid: 1 to {MAX_SLICES} window radii >= 0 expected, got {radii}")
    if x.dim() != 4:
        raise ValueError(f"max_pool_pyramid: x must be [N, C, H, W], got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"max_pool_pyramid: x must be float32, float16 or bfloat16, got {x.dtype}")
    want = "cpu" if interpret else "cuda"
    if x.device.type != want:
        raise ValueError(f"max_pool_pyramid: interpret={interpret} runs on {want} tensors, x is on {x.device}")
    n, c, h, w = x.shape
    memory_format = pyramid_memory_format(x)
    channels_last = memory_format == torch.channels_last
    m = n * h * w
    block_m, block_c, warps = _tile(m, c, channels_last)
    grid = (cdiv(m, block_m), cdiv(c, block_c))
    padded = radii + (0,) * (MAX_SLICES - len(radii))
    constexprs = {
        "R0": padded[0],
        "R1": padded[1],
        "R2": padded[2],
        "R3": padded[3],
        "R_MAX": max(radii),
        "SLICES": len(radii),
        "BLOCK_M": block_m,
        "BLOCK_C": block_c,
    }
    options = LaunchOptions({**constexprs, "num_warps": warps, "num_stages": 1})

    def run(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((n, len(radii) * c, h, w), device=x.device, dtype=x.dtype, memory_format=memory_format)
        args: tuple[Any, ...] = (x, out, h, w, c, m, *_nchw_strides(x), *_nchw_strides(out))
        launch(_max_pool_pyramid_kernel, grid, args, options, interpret)
        return out

    return run


_pyramid_plans = PlanCache()


def max_pool_pyramid(x: torch.Tensor, radii: Sequence[int], *, interpret: bool = False) -> torch.Tensor:
    """:func:`max_pool_pyramid_plan`'s result for ``x`` (checks, allocates, launches), through a plan kept per
    input signature: what the ``fuser::max_pool_pyramid`` custom op runs (it has no module to keep plans in)."""
    radii = tuple(int(r) for r in radii)
    return _pyramid_plans.get(
        lambda: (tensor_meta(x), radii, interpret), lambda: max_pool_pyramid_plan(x, radii, interpret=interpret)
    )(x)


def pyramid_memory_format(x: torch.Tensor) -> torch.memory_format:
    """The memory format of the pyramid of ``x``: channels_last where ``x`` is (and not also contiguous)."""
    channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    return torch.channels_last if channels_last else torch.contiguous_format


def _nchw_strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    s = t.stride()
    return (s[0], s[1], s[2], s[3])
