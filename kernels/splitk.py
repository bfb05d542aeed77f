"""Split-K: a small output grid spread over more SMs by splitting the reduction, in a fixed order.

A batch-1 layer or a late layer (ResNet's 512->512 3x3 at 7x7: 49 output rows) gives a handful of
output tiles, so most of the 132 SMs of an H200 idle while each tile walks a K of several thousand. With
``split_k = S`` the GEMM-style kernels launch ``S`` programs per output tile, each reducing one
contiguous range of whole K steps (``tiles.split_range``) into its own slice of a float32 workspace
``[S, M, N]``. The partials are then added in split order 0, 1, ..., S-1 and the fused epilogue runs, in
one of two places (:func:`reduces_in_tail`):

- the tile's last program to arrive, behind a per-tile arrival counter (``tiles.finish_tile``): no second
  launch (under CUDA graphs about 1.8 us each, 25 of them in YOLOv8n's batch-1 forward), but one SM reads
  all ``S`` partial tiles, so only where they are few bytes;
- a second, tiny kernel here (:func:`_split_k_reduce_kernel`), spread over the whole card.

Either way no float atomics: the sum of a given shape and config is the same bits on every run.

The counters are int32 zeros that the last program sets back to zero, so they are made once: per plan
and stream (two streams running one plan at once must not count on the same tile), cut from a per-device
arena (:data:`SPLIT_COUNTERS`) that the fused modules fill when they are made, outside any forward --
a tensor first allocated inside a compiled forward would belong to its CUDA-graph pool.

The candidates come from :func:`split_k_candidates`: for a grid under one wave, the split count that
brings it to about one wave while every split keeps at least ``MIN_STEPS_PER_SPLIT`` K steps.

Stream-K (``TileConfig.stream_k``, the implicit GEMM only, never a candidate) shares this host side: its grid and
workspace slots come from :func:`stream_k_grid`, its partial sums go through :class:`SplitK`'s workspace and
counters, and its kernel always reduces in the tail.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import triton
import triton.language as tl

from .autotune import TileConfig
from .epilogue import Epilogue
from .launch import KernelCall, cdiv
from .tiles import decode_rows, epilogue_tile, row_offsets, store_tile, sum_splits

SM_COUNT = 132  # H200; a smaller card gets the same candidates, measured there
MIN_STEPS_PER_SPLIT = 4  # below this a split is all prologue and epilogue
MAX_SPLIT_K = 16
PREFER_UNSPLIT_FILL = 0.5  # an unsplit default that keeps this share of the SMs busy beats a split one
# A split default only for reductions this long: a short one finishes in a few microseconds unsplit, about
# what the split's second launch or tail and its pass over the partials cost (split candidates are measured anyway).
MIN_STEPS_FOR_DEFAULT_SPLIT = 32
# The last program reduces where it reads at most this many bytes of partials (S tiles of float32): one SM
# reads them at about 100 GB/s, so 64 KiB is about 0.6 us; a second kernel costs a launch (about 1.8 us).
TAIL_MAX_BYTES = 64 * 1024
COUNTER_CHUNK = 1 << 16  # counters per arena chunk (256 KiB): a split layer takes under one wave's tiles


REDUCE_TILE = TileConfig(32, 64, 1, 1, 4, 1)
REDUCE_PROGRAMS = 2 * SM_COUNT  # the reduction is latency-bound: aim for about two programs per SM


def reduce_tile(m: int, n: int) -> TileConfig:
    """The reduction's tile: :data:`REDUCE_TILE`, halved (rows to 8, then channels to 32) while the grid
    has fewer than :data:`REDUCE_PROGRAMS` programs. Each program adds ``SPLIT_K`` partials per element;
    with 32x64 tiles a 49x512 layer (ResNet-50's 7x7 stage at batch 1) gave 16 programs on 132 SMs."""
    block_m, block_n = REDUCE_TILE.block_m, REDUCE_TILE.block_n
    while cdiv(m, block_m) * cdiv(n, block_n) < REDUCE_PROGRAMS and (block_m > 8 or block_n > 32):
        if block_m > 8:
            block_m //= 2
        else:
            block_n //= 2
    return TileConfig(block_m, block_n, 1, 1, max(1, min(4, block_m * block_n // 256)), 1)


@triton.jit(do_not_specialize=["M", "OH", "OW"])
def _split_k_reduce_kernel(
    # pointers: ws is the float32 [SPLIT_K, M, N] workspace
    ws_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    # sizes; rows decode as (image, oh, ow) for the residual (a GEMM passes OH = S, OW = 1)
    M,
    N,
    OH,
    OW,
    # strides (elements): residual (image, oh, ow, channel), output rows
    sr_n,
    sr_h,
    sr_w,
    sr_c,
    stride_om,
    # epilogue scalars
    alpha,
    scale,
    # constexprs
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ROUND_TF32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = sum_splits(ws_ptr, offs_m, M, N, offs_n, m_ok, n_ok, SPLIT_K)  # the tail's order, so the same bits
    n_idx, oh, ow = decode_rows(offs_m, m_ok, OH, OW)
    res_rows = row_offsets(n_idx, oh, ow, sr_n, sr_h, sr_w)
    y = epilogue_tile(acc, offs_n, n_ok, m_ok, bias_ptr, res_ptr, res_rows, sr_c, alpha, scale,
                      HAS_BIAS, ACT, RESIDUAL, HAS_SCALE, ROUND_TF32)  # fmt: skip
    store_tile(out_ptr, offs_m, stride_om, offs_n, m_ok, n_ok, y)


STREAM_K_INTERPRETER_SMS = 3  # the interpreter has no SMs: a few programs, so that runs cross tile boundaries


def stream_k_grid(config: TileConfig, tiles: int, steps: int, sm_count: int) -> tuple[int, int]:
    """``(programs, slots)`` of a stream-K launch (``config.stream_k`` programs per SM) over ``tiles`` output
    tiles of ``steps`` reduction steps each: the kernel deals each program ``cdiv(tiles * steps, programs)``
    consecutive steps, so a tile is shared by at most ``cdiv(steps, per) + 1`` programs, each writing one
    workspace slot."""
    work = tiles * steps
    programs = max(1, min(config.stream_k * sm_count, work))
    per = cdiv(work, programs)
    return programs, min(programs, cdiv(steps, per) + 1)


def reduces_in_tail(config: TileConfig) -> bool:
    """Whether the last program of each tile adds its partials (``SPLIT_TAIL``), else the reduction kernel."""
    return config.split_k * config.block_m * config.block_n * 4 <= TAIL_MAX_BYTES


def _device_key(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class CounterArena:
    """Zeroed int32 arrival counters, handed out as slices of one chunk per device (a new chunk when one
    runs out). :meth:`prewarm` makes a device's first chunk ahead of any forward."""

    def __init__(self) -> None:
        self._chunks: dict[torch.device, tuple[torch.Tensor, int]] = {}

    def prewarm(self, device: torch.device) -> None:
        """Make ``device``'s chunk now, where none exists."""
        device = _device_key(device)
        if device not in self._chunks:
            self._chunks[device] = (torch.zeros(COUNTER_CHUNK, dtype=torch.int32, device=device), 0)

    def take(self, device: torch.device, count: int) -> torch.Tensor:
        """``count`` zeroed counters on ``device`` that no other caller holds, 16-byte aligned: Triton
        specializes a pointer on that alignment, and a plan's launches on another stream (a CUDA graph's
        capture) must take the kernel the collecting forward listed for compiling ahead."""
        device = _device_key(device)
        chunk, used = self._chunks.get(device, (None, 0))
        if chunk is None or used + count > chunk.numel():
            chunk, used = torch.zeros(max(COUNTER_CHUNK, count), dtype=torch.int32, device=device), 0
        self._chunks[device] = (chunk, used + -(-count // 4) * 4)
        return chunk[used : used + count]


SPLIT_COUNTERS = CounterArena()


class SplitK:
    """The host side of one split-K plan: ``split(main, bias32, res, out2)`` allocates the float32
    ``[split_k, m, n]`` workspace (per call: a plan shared by two streams, or a CUDA graph and eager calls,
    must not share partial sums; the caching allocator makes it a free-list pop) and runs
    ``main(workspace, counters)``: the GEMM-style kernel. Where :func:`reduces_in_tail`, ``counters`` are
    the plan's ``tiles`` arrival counters for the current stream and the kernel reduces; else None, and
    the ordered reduction kernel runs next, with the epilogue, into ``out2`` (``[M, N]`` rows, any row
    stride). ``rows`` is ``(OH, OW)`` of the output-row decode and ``res_strides`` the residual's strides as
    ``(image, oh, ow, channel)``, both as :func:`tiles.decode_rows` reads them. A stream-K plan passes its
    workspace's ``slots`` (:func:`stream_k_grid`); its kernel always reduces in the tail.
    """

    def __init__(
        self,
        config: TileConfig,
        m: int,
        n: int,
        tiles: int,
        rows: tuple[int, int],
        res_strides: Sequence[int],
        out_row_stride: int,
        epilogue: Epilogue,
        has_bias: bool,
        device: torch.device,
        interpret: bool,
        slots: int | None = None,
    ) -> None:
        self.shape, self.tiles, self.device = (slots or config.split_k, m, n), tiles, device
        self.tail = slots is not None or reduces_in_tail(config)
        self._counters: dict[int, torch.Tensor] = {}
        if self.tail:
            return
        scalars = (m, n, *rows, *res_strides, out_row_stride, float(epilogue.alpha), float(epilogue.scale))
        constexprs = {
            "SPLIT_K": config.split_k,
            "HAS_BIAS": has_bias,
            "ACT": int(epilogue.act),
            "RESIDUAL": int(epilogue.residual),
            "HAS_SCALE": epilogue.scale != 1.0,
            "ROUND_TF32": epilogue.round_tf32,
        }
        self.call = KernelCall(_split_k_reduce_kernel, scalars, constexprs, interpret)
        tile = reduce_tile(m, n)
        self.options = self.call.options(tile)
        self.grid = (cdiv(m, tile.block_m), cdiv(n, tile.block_n))

    def counters(self) -> torch.Tensor:
        """This stream's counters (taken from :data:`SPLIT_COUNTERS` on the stream's first launch)."""
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0
        counters = self._counters.get(stream)
        if counters is None:
            counters = self._counters[stream] = SPLIT_COUNTERS.take(self.device, self.tiles)
        return counters

    def __call__(self, main: Callable[[torch.Tensor, Any], Any], bias32: Any, res: Any, out2: torch.Tensor) -> Any:
        workspace = torch.empty(self.shape, dtype=torch.float32, device=self.device)
        if self.tail:
            return main(workspace, self.counters())
        main(workspace, None)
        return self.call.launch(self.grid, (workspace, bias32, res, out2), self.options)


def split_k_for(tiles: int, k_steps: int, sm_count: int = SM_COUNT) -> int:
    """The split count that brings ``tiles`` output tiles to about one wave on ``sm_count`` SMs, each
    split keeping at least :data:`MIN_STEPS_PER_SPLIT` of the ``k_steps`` reduction steps (1: no split)."""
    split = 1
    while tiles * split * 2 <= sm_count and k_steps >= 2 * split * MIN_STEPS_PER_SPLIT and split < MAX_SPLIT_K:
        split *= 2
    return split


def split_k_candidates(
    candidates: Sequence[TileConfig],
    m: int,
    n: int,
    k_steps: Callable[[TileConfig], int],
    sm_count: int = SM_COUNT,
) -> list[TileConfig]:
    """``candidates`` plus small-grid variants: a 64x64 and a 32-row tile, and each of those and the default
    tile with its :func:`split_k_for` split. When the default tile gives under a quarter wave (batch-1
    rows, 7x7 layers, short GEMMs), the unsplit config that fills the waves best becomes the default if it
    fills at least :data:`PREFER_UNSPLIT_FILL` of them or the reduction is short (under
    :data:`MIN_STEPS_FOR_DEFAULT_SPLIT` steps), else the best-filling split (largest tile of equals): a
    handful of CTAs on the whole card cannot win.
    ``k_steps(config)`` is the reduction's step count under that config (``cdiv(K, block_k)`` for a
    GEMM; taps x channel blocks for a conv)."""
    if not candidates:
        return []
    first = candidates[0]
    tiles_of = lambda c: cdiv(m, c.block_m) * cdiv(n, c.block_n)
    if tiles_of(first) >= sm_count:
        return list(candidates)
    bn_small = min(64, first.block_n)
    shapes = [first, TileConfig(64, bn_small, first.block_k, 8, 4, 3), TileConfig(32, bn_small, first.block_k, 8, 4, 3)]
    extra: list[TileConfig] = []
    for shape in shapes:
        if shape.block_m < first.block_m or shape.block_n < first.block_n:
            extra.append(shape)
        split = split_k_for(tiles_of(shape), k_steps(shape), sm_count)
        if split > 1:
            extra.append(replace(shape, split_k=split))
    out = list(candidates)
    for config in extra:
        if config not in out:
            out.append(config)
    if tiles_of(first) * 4 < sm_count:
        # Fill the waves, with the largest tile of equals (max keeps the first); a split costs a second
        # launch and a pass over the partials, so an unsplit tile that fills half the card is preferred.
        fill = lambda c: wave_fill(tiles_of(c) * c.split_k, sm_count)
        best = max((c for c in out if c.split_k == 1), key=fill)
        long_splits = [c for c in out if c.split_k > 1 and k_steps(c) >= MIN_STEPS_FOR_DEFAULT_SPLIT]
        if fill(best) < PREFER_UNSPLIT_FILL and long_splits and fill(max(long_splits, key=fill)) > fill(best):
            best = max(long_splits, key=fill)
        out.remove(best)
        out.insert(0, best)
    return out


def wide_split_candidates(
    candidates: Sequence[TileConfig],
    m: int,
    n: int,
    k_steps: Callable[[TileConfig], int],
    sm_count: int = SM_COUNT,
) -> list[TileConfig]:
    """``candidates`` plus the widest unsplit tile split in two, and a 64-row tile as wide split in two, where
    that tile's grid is under one wave and its reduction at least :data:`MIN_STEPS_FOR_DEFAULT_SPLIT` steps
    long: the fastest configs measured on YOLO's 256->256 3x3 at 20x20 and ResNet's 512->512 at 7x7, batch 32
    (results/conv-tile-sweep-2026-12-03.json: 128x256 and 64x256 split in two). Appended, so the list's own
    default stands; the shipped table picks them where it measured them."""
    plain = [c for c in candidates if c.split_k == 1 and not c.box_w and not c.stream_k]
    if not plain:
        return list(candidates)
    widest = max(plain, key=lambda c: c.block_m * c.block_n)  # max keeps the first of equals
    if cdiv(m, widest.block_m) * cdiv(n, widest.block_n) >= sm_count or k_steps(widest) < MIN_STEPS_FOR_DEFAULT_SPLIT:
        return list(candidates)
    out = list(candidates)
    for config in (replace(widest, split_k=2), TileConfig(64, widest.block_n, widest.block_k, 8, 8, 3, split_k=2)):
        if config not in out:
            out.append(config)
    return out


def split_shifted_twins(
    candidates: Sequence[TileConfig],
    m: int,
    n: int,
    k_steps: Callable[[TileConfig], int],
    sm_count: int = SM_COUNT,
) -> list[TileConfig]:
    """``candidates`` plus, for each unsplit shifted-tap tile whose grid is under one wave and whose reduction
    is at least :data:`MIN_STEPS_FOR_DEFAULT_SPLIT` steps long, the same tile split in two. Once the bordered copy
    was one launch, ResNet's 512->512 @7 at batch 32 in tf32 ran fastest on a split 64x128 shifted tile, 11% ahead
    of the unsplit one (results/conv-tile-sweep-2026-12-03e.json). Appended, so the list's own default stands;
    the shipped table picks them where it measured them. ``m`` is the output's rows; a shifted tile's grid also
    covers the border rows (up to a third more on a 7x7 image), so a split may be listed where the bordered grid
    just fills a wave: listing it only lets the table or tuning measure it."""
    out = list(candidates)
    for config in candidates:
        if not config.tap_shift or config.split_k > 1 or k_steps(config) < MIN_STEPS_FOR_DEFAULT_SPLIT:
            continue
        split = replace(config, split_k=2)
        if cdiv(m, config.block_m) * cdiv(n, config.block_n) < sm_count and split not in out:
            out.append(split)
    return out


def wave_fill(ctas: int, sm_count: int = SM_COUNT) -> float:
    """The fraction of the SMs' time a grid of ``ctas`` equal programs keeps busy (1.0: whole waves)."""
    return ctas / (cdiv(ctas, sm_count) * sm_count)
