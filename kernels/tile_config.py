"""The two values tile selection works on: a launch configuration and the problem it is chosen for.

Kept apart from the cache (autotune.py, which re-exports both), the cost model (tile_heuristic.py) and
the shipped table (tile_table.py) so that each of those imports them without importing the others.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration: the tile shape (constexprs), the compiler's warps and stages, and the
    number of slices the reduction is split into (``split_k``, 1 = no split; a kernel without a
    ``SPLIT_K`` parameter only ever lists configs with 1).

    ``box_w`` > 0 (the implicit GEMM only, conv_boxes.py): the ``block_m`` output pixels of a tile are a
    box ``block_m // box_w`` rows by ``box_w`` columns of one image, and the activation tile of each filter
    tap is read through a tensor descriptor (TMA) instead of gathered through pointers. 0: the tile is
    ``block_m`` consecutive output rows.

    ``tap_shift`` = 1 (the implicit GEMM's row tiles of a stride-1 conv whose output has
    its input's size, conv_boxes.py): the input is copied into a zero-bordered buffer and each filter tap's
    activation tile is one 2-D tensor-descriptor (TMA) load of consecutive bordered pixels, with no mask; the
    tiles cover the bordered grid, whose border outputs are not stored. Candidate lists offer it on small images
    (conv_boxes.shifted_twins), where the shipped table picks it when measured fastest.

    ``stream_k`` > 0 (the implicit GEMM's row tiles only): stream-K. The grid is ``stream_k`` programs per SM,
    and the reduction steps of all output tiles together are dealt out to them in equal contiguous runs, so
    a grid of, say, 100 tiles keeps all 132 SMs busy to the end; a tile whose steps two or more programs
    share is summed in a fixed order by the last of them to finish (conv.py). No candidate list offers it:
    on the layers it was built for it measured no faster than split-K, and its 128x256 tiles do not fit in
    the H200's shared memory (kernels/NOTES.md version 13); a caller can force it with ``tile=``.

    ``persistent`` > 0 (the implicit GEMM, whole tiles: not split, not stream-K): the grid is ``persistent``
    programs per SM, each walking the output tiles ``program, program + programs, ...`` in one loop that Triton
    flattens with the reduction loop inside it, so that the next tile's first loads can be issued while this
    tile's epilogue runs. Built for many short tiles (YOLOv8n's 64->64 @80 at batch 32: 1600 tiles of 9 steps,
    latency-bound, kernels/NOTES.md version 18), where it measured 7% faster in fp16: the implicit GEMM's lists
    offer it last on grids of many tiles (conv.persistent_twins), for the shipped table or tuning to choose."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    box_w: int = 0
    stream_k: int = 0
    tap_shift: int = 0
    persistent: int = 0

    def stage_bytes(self, operand_bytes: int) -> int:
        """The bytes of one reduction step's operand tiles, A and B, each pipeline stage's shared-memory buffer."""
        return (self.block_m + self.block_n) * self.block_k * operand_bytes

    def constexprs(self) -> dict[str, int]:
        """The tile's kernel parameters (a launcher passes those its kernel declares; ``split_k`` is the
        launcher's to pass, since a split also changes the grid and adds a reduction)."""
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "GROUP_M": self.group_m,
            "BOX_W": self.box_w,
            "STREAM_K": self.stream_k > 0,
            "TAP_SHIFT": self.tap_shift > 0,
            "PERSISTENT": self.persistent > 0,
        }


@dataclass(frozen=True)
class Problem:
    """A kernel launch seen as the GEMM it computes, which is what tile choice depends on.

    ``m`` output rows (pixels for convolutions), ``n`` output columns per group (channels), ``k`` the
    reduction per output (``c_in_g * kh * kw`` for an implicit-GEMM or direct conv, the filter taps
    ``kh * kw`` for a depthwise conv), ``groups`` independent problems of that size side by side,
    ``operand_bytes`` the size of one operand element as the kernel loads it, and ``precision`` the
    dot's policy (``Precision.value``: "tf32", "tf32x3", "ieee", "fp16", "bf16").
    """

    m: int
    n: int
    k: int
    groups: int = 1
    operand_bytes: int = 4
    precision: str = "tf32"

    def __post_init__(self) -> None:
        for name in ("m", "n", "k", "groups", "operand_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (1 if name in ("groups", "operand_bytes") else 0):
                raise ValueError(f"Problem.{name} must be an int >= 0 (groups, operand_bytes >= 1), got {value!r}")
