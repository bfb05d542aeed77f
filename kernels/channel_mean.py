"""``channel_mean``: the global average pool ``x.mean((2, 3), keepdim=True)`` of an ``[N, C, H, W]`` tensor.

Squeeze-excitation pools every block's activation to one value per (image, channel). At batch 1 the output
is a few hundred values, so a reduction parallel over the outputs alone runs a handful of programs, each
looping over all pixels. This one is parallel over (image, channel block) and split over pixels: each
program sums its share of the pixels of a ``[pixels, channels]`` tile (channels contiguous in NHWC, one
vector load per pixel), and where the pixels are split a second launch adds the splits' float32 partial
sums in a fixed order. Each program sums in a fixed order too, so the result is the same bits on every run
(no atomics), whatever the launch order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from .interpret import run_interpreted
from .launch import FLOAT_DTYPES, PlanCache, cdiv, tensor_meta
from .splitk import SM_COUNT

# A program's pixel loop waits on one load per step, so a range of 256 pixels (8 steps) took 4-6 us on the
# H200 for the 14x14 and 28x28 SE pools of EfficientNet-B0 (benchmarks/kernel_timeline.py): ranges of 64 make
# 4x the programs and 2 steps each. At most MAX_SPLITS ranges: the second launch adds them.
MIN_PIXELS_PER_SPLIT = 64
MAX_SPLITS = 64
# Splits the second launch reads per step (a [ADD_SPLITS_STEP, BLOCK_C] tile of partial sums).
ADD_SPLITS_STEP = 32


@triton.jit(do_not_specialize=["HW", "W", "PER_SPLIT"])
def _channel_sum_kernel(
    x_ptr,
    dst_ptr,  # the output [N, C] (FINAL) or the float32 partial sums [N, SPLITS, C]
    C,
    HW,
    W,
    PER_SPLIT,
    sx_n,
    sx_c,
    sx_h,
    sx_w,
    inv_hw,
    FINAL: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    n = tl.program_id(0)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    base = x_ptr + n.to(tl.int64) * sx_n + offs_c.to(tl.int64)[None, :] * sx_c
    p_lo = split * PER_SPLIT
    p_hi = tl.minimum(p_lo + PER_SPLIT, HW)
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for p0 in range(p_lo, p_hi, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        p_ok = p < p_hi
        pix = (p // W).to(tl.int64) * sx_h + (p % W).to(tl.int64) * sx_w
        acc += tl.load(base + pix[:, None], mask=p_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
    total = tl.sum(acc, axis=0)
    if FINAL:
        tl.store(dst_ptr + n.to(tl.int64) * C + offs_c, (total * inv_hw).to(dst_ptr.dtype.element_ty), mask=c_ok)
    else:
        tl.store(dst_ptr + (n.to(tl.int64) * splits + split) * C + offs_c, total, mask=c_ok)


@triton.jit
def _add_splits_kernel(part_ptr, out_ptr, C, SPLITS, inv_hw, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    n = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    rows = part_ptr + n.to(tl.int64) * SPLITS * C + offs_c[None, :]
    acc = tl.zeros((BLOCK_S, BLOCK_C), dtype=tl.float32)
    for s0 in range(0, SPLITS, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        acc += tl.load(rows + s.to(tl.int64)[:, None] * C, mask=(s < SPLITS)[:, None] & c_ok[None, :], other=0.0)
    total = tl.sum(acc, axis=0)
    tl.store(out_ptr + n.to(tl.int64) * C + offs_c, (total * inv_hw).to(out_ptr.dtype.element_ty), mask=c_ok)


def add_splits(part: torch.Tensor, out: torch.Tensor, count: int, *, interpret: bool = False) -> None:
    """``out[n, c] = sum over s of part[n, s, c] / count``: the second step of a split mean, here and in the
    depthwise kernel's fused pool (depthwise.py). ``part`` is contiguous float32 ``[N, SPLITS, C]``, ``out``
    contiguous ``[N, C]`` (any strides of trailing size-1 dims), written in its own dtype.

    Each program reads ``BLOCK_S`` splits per step as one tile (the depthwise pool's split count is its pixel
    tiles per image, several hundred on a 112x112 layer: one load per split in a chain would wait on each)
    and reduces the tile's rows at the end; the order depends only on the shapes, so every run gives the
    same bits."""
    n, splits, c = part.shape
    block_c = 64 if interpret else min(64, max(16, triton.next_power_of_2(c)))
    block_s = min(ADD_SPLITS_STEP, triton.next_power_of_2(splits))
    grid = (n, cdiv(c, block_c))
    args = (part, out, c, splits, 1.0 / count)
    if interpret:
        run_interpreted(_add_splits_kernel, grid, *args, BLOCK_S=block_s, BLOCK_C=block_c)
    else:
        _add_splits_kernel[grid](*args, BLOCK_S=block_s, BLOCK_C=block_c, num_warps=4, num_stages=2)


def _layout(x: torch.Tensor, interpret: bool) -> tuple[int, int, int]:
    """(BLOCK_P, BLOCK_C, num_warps): channels along the contiguous axis of NHWC, pixels along NCHW's."""
    if interpret:
        return 128, 64, 4
    if x.stride(1) == 1:
        return 32, min(64, max(16, triton.next_power_of_2(x.shape[1]))), 4
    return 128, 8, 4


def splits_for(n: int, channel_blocks: int, pixels: int, block_p: int) -> int:
    """How many pixel ranges each (image, channel block) is split into: about two programs per SM, each
    range at least ``MIN_PIXELS_PER_SPLIT`` pixels (whole ``block_p`` steps), at most ``MAX_SPLITS``."""
    wanted = cdiv(2 * SM_COUNT, n * channel_blocks)
    most = max(1, pixels // max(MIN_PIXELS_PER_SPLIT, block_p))
    return max(1, min(wanted, most, MAX_SPLITS))


_plans = PlanCache()


def channel_mean_plan(
    x: torch.Tensor, *, interpret: bool = False, splits: int | None = None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``run(x) -> x.mean((2, 3), keepdim=True)`` for every ``x`` of this one's shape, strides and dtype
    (kept per signature: a repeated call only looks the plan up).

    ``x`` is ``[N, C, H, W]`` with any strides (channels_last reads fastest), on CUDA or, with
    ``interpret=True``, on the CPU (Triton's interpreter). The output ``[N, C, 1, 1]`` (contiguous, which
    is channels_last too) has ``x``'s dtype; sums are float32. ``splits`` forces the pixel split (tests)."""
    return _plans.get(lambda: (tensor_meta(x), interpret, splits), lambda: _plan(x, interpret, splits))


def _plan(x: torch.Tensor, interpret: bool, splits: int | None) -> Callable[[torch.Tensor], torch.Tensor]:
    op = "channel_mean"
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{op}: x must be a 4-D [N, C, H, W] tensor, got {shape}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: x must be float32, float16 or bfloat16, got {x.dtype}")
    want = "cpu" if interpret else "cuda"
    if x.device.type != want:
        raise ValueError(f"{op}: interpret={interpret} runs on {want} tensors, x is on {x.device}")
    n, c, h, w = x.shape
    hw = h * w
    if hw == 0 or n * c == 0:
        raise ValueError(f"{op}: the mean of an empty tensor (shape {tuple(x.shape)}) is not defined here")
    block_p, block_c, warps = _layout(x, interpret)
    c_blocks = cdiv(c, block_c)
    split = splits if splits is not None else splits_for(n, c_blocks, hw, block_p)
    per_split = cdiv(cdiv(hw, split), block_p) * block_p
    split = cdiv(hw, per_split)  # no empty ranges
    strides = (x.stride(0), x.stride(1), x.stride(2), x.stride(3))
    grid = (n, c_blocks, split)
    inv_hw = 1.0 / hw

    def launch(kernel: Any, grid: tuple[int, ...], args: tuple, **constexprs: Any) -> None:
        if interpret:
            run_interpreted(kernel, grid, *args, **constexprs)
        else:
            kernel[grid](*args, **constexprs, num_warps=warps, num_stages=2)

    def run(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((n, c, 1, 1), dtype=x.dtype, device=x.device)
        final = split == 1
        dst = out if final else torch.empty((n, split, c), dtype=torch.float32, device=x.device)
        launch(_channel_sum_kernel, grid, (x, dst, c, hw, w, per_split, *strides, inv_hw),
               FINAL=final, BLOCK_P=block_p, BLOCK_C=block_c)  # fmt: skip
        if not final:
            add_splits(dst, out, hw, interpret=interpret)
        return out

    return run


def channel_mean(x: torch.Tensor, *, interpret: bool = False) -> torch.Tensor:
    """One call of :func:`channel_mean_plan` (checks, allocates, launches)."""
    return channel_mean_plan(x, interpret=interpret)(x)
