"""Split-K: a small output grid spread over more SMs by splitting the reduction, in a fixed order.

A batch-1 layer or a late layer (ResNet's 512->512 3x3 at 7x7: 49 output rows) gives a handful of
output tiles, so most of the 132 SMs of an H200 idle while each tile walks a K of several thousand. With
``split_k = S`` the GEMM-style kernels launch ``S`` programs per output tile, each reducing one
contiguous range of whole K steps (``tiles.split_range``) into its own slice of a float32 workspace
``[S, M, N]``. Each program then counts its arrival on the tile's counter, and the last to arrive adds
the ``S`` partials in split order 0, 1, ..., S-1 and runs the fused epilogue (``tiles.finish_tile``).
One launch per layer: under CUDA graphs a second, reduction kernel cost about 1.8 us per split layer (25
of them, 0.044 ms of YOLOv8n's batch-1 forward). The sum of a given shape and config is the same bits on
every run, whichever program adds it.

The counters are int32 zeros that the last program sets back to zero, so they are made once: per plan
and stream (two streams running one plan at once must not count on the same tile), cut from a per-device
arena (:data:`SPLIT_COUNTERS`) that the fused modules fill when they are made, outside any forward --
a tensor first allocated inside a compiled forward would belong to its CUDA-graph pool.

The candidates come from :func:`split_k_candidates`: for a grid under one wave, the split count that
brings it to about one wave while every split keeps at least ``MIN_STEPS_PER_SPLIT`` K steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from .autotune import TileConfig
from .launch import cdiv

SM_COUNT = 132  # H200; a smaller card gets the same candidates, measured there
MIN_STEPS_PER_SPLIT = 4  # below this a split is all prologue and epilogue
MAX_SPLIT_K = 16
PREFER_UNSPLIT_FILL = 0.5  # an unsplit default that keeps this share of the SMs busy beats a split one
# A split default only for reductions this long: a short one finishes in a few microseconds unsplit, about
# what the split's pass over the partials costs (split candidates are measured anyway).
MIN_STEPS_FOR_DEFAULT_SPLIT = 32
COUNTER_CHUNK = 1 << 16  # counters per arena chunk (256 KiB): a split layer takes under one wave's tiles


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
        """``count`` zeroed counters on ``device`` that no other caller holds."""
        device = _device_key(device)
        chunk, used = self._chunks.get(device, (None, 0))
        if chunk is None or used + count > chunk.numel():
            chunk, used = torch.zeros(max(COUNTER_CHUNK, count), dtype=torch.int32, device=device), 0
        self._chunks[device] = (chunk, used + count)
        return chunk[used : used + count]


SPLIT_COUNTERS = CounterArena()


class SplitWorkspace:
    """What one split-K plan's launch needs besides the kernel's own arguments: ``workspace(main)`` runs
    ``main(workspace, counters)`` with a fresh float32 ``[split_k, m, n]`` workspace and the plan's
    ``tiles`` arrival counters for the current stream."""

    def __init__(self, split_k: int, m: int, n: int, tiles: int, device: torch.device) -> None:
        self.shape, self.tiles, self.device = (split_k, m, n), tiles, device
        self._counters: dict[int, torch.Tensor] = {}

    def counters(self) -> torch.Tensor:
        """This stream's counters (taken from :data:`SPLIT_COUNTERS` on the stream's first launch)."""
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0
        counters = self._counters.get(stream)
        if counters is None:
            counters = self._counters[stream] = SPLIT_COUNTERS.take(self.device, self.tiles)
        return counters

    def __call__(self, main: Callable[[torch.Tensor, torch.Tensor], Any]) -> Any:
        # The workspace per call, not per plan: a plan shared by two streams (or a CUDA graph and eager
        # calls) must not share partial sums. The caching allocator makes this a free-list pop.
        workspace = torch.empty(self.shape, dtype=torch.float32, device=self.device)
        return main(workspace, self.counters())


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


def wave_fill(ctas: int, sm_count: int = SM_COUNT) -> float:
    """The fraction of the SMs' time a grid of ``ctas`` equal programs keeps busy (1.0: whole waves)."""
    return ctas / (cdiv(ctas, sm_count) * sm_count)
