"""Box tiles of the implicit GEMM: the activation operand read through a tensor descriptor (TMA).

The implicit GEMM's row tiles (conv.py) gather each filter tap's activation tile through pointers, one
row address and mask per output pixel and step (triton issues them as cp.async copies into shared
memory). A box tile instead covers ``BLOCK_M // BOX_W`` output rows by ``BOX_W`` output columns of one
image. For a filter tap ``(kh, kw)`` the inputs those pixels read form a box of the NHWC input too,
shifted by the tap: one tensor-descriptor load brings it into shared memory, and the copy engine's
out-of-bounds zero fill is the conv's zero padding (negative coordinates included). No per-pixel
addresses, no masks. (Triton 3.6-3.9 then reshape a box of several rows to the dot's tile in the
registers; a box of one row reaches wgmma from shared memory: benchmarks/box_tiles.py --operands-on-cpu.)

A stride ``s`` conv reads every ``s``-th column: the input is viewed as ``[N, H / sh, sh, W / sw, sw * C]``
(a free reshape of NHWC when ``sh`` divides H and ``sw`` divides W), so the inputs of a tap lie at a fixed
row phase and a fixed channel offset ``phase * C`` of a dense box. With ``sw > 1`` a channel block must not
run past ``C`` into the next phase's channels, so ``BLOCK_K`` divides ``C`` there; with ``sw == 1`` the
descriptor ends at ``C`` and fills zeros. Dilation, groups, a virtual concatenation and an operand
prologue keep the row tiles (conv.py).

``box_w`` is a field of the tile config (tile_config.py); :func:`box_candidates` lists the box configs a
launch may measure, :func:`strided_box_twins` offers some after the row tiles at stride 2, and
:func:`box_refusal` says why a launch cannot use them.

Shifted taps (``tap_shift``). The input is first copied (bordered_copy.py) into a zero-bordered
buffer ``[N, H + pad_top, W + pad_left, C]`` (the conv's pixel ``(h, w)`` at ``(h + pad_top, w + pad_left)``; the
zero rows and columns on top and left double as the previous image's bottom and the previous row's right
border). The GEMM then runs over the bordered grid's rows: bordered pixel ``q`` reads, for tap ``(kh, kw)``, bordered
pixel ``q + (kh - pad_top) * (W + pad_left) + kw - pad_left``, which is zero wherever the conv pads. So a tile's
activation tile per tap is one 2-D descriptor load of consecutive rows with no mask (the operand can reach wgmma
from shared memory, as in a plain GEMM), at the cost of the border rows' and columns' wasted outputs (10% on a
20x20 image, 31% on 7x7) and the copy. :func:`tap_shift_refusal` says which convs allow it, and
:func:`shifted_twins` adds the shifted twin of each row tile to the candidate lists of small images, where the
shipped table (measured, copy included) picks one when it ran fastest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .tile_config import TileConfig

# Below this many output pixels a layer has few tiles either way, and the row tiles' split-K candidates
# fill the SMs instead (box tiles are never split).
BOX_MIN_ROWS = 16384
BOX_MIN_CHANNELS = 64  # fewer input channels per tap: slower than the row tiles where measured (boxes_by_default)
# Shifted taps pay a copy of the input into the bordered buffer at each launch. On the H200
# (results/conv-tile-sweep-2026-12-03d.json, batch 32) they beat the row tiles, copy included, on three of the
# four rows of 20x20 and 7x7 images with 256-512 channels (the fourth 1.5% slower), and lost by 1.2-1.4x on an
# 80x80 image with 64, where the copy alone took 45-62% of the row tile's time. Larger images are not offered them.
SHIFT_MAX_PIXELS = 32 * 32


@triton.jit
def box_rows(pid_m, OH, OW, BLOCK_M: tl.constexpr, BOX_W: tl.constexpr):
    """Box tile ``pid_m`` (images, then box rows, then box columns) as output rows: ``offs_m, m_ok, n_idx,
    oh, ow`` per tile row (``n_idx`` the image, broadcast), then the box's image, first output row and first
    output column. Pixels of a box past the image's bottom or right edge are masked (``m_ok``); their rows
    decode inside the image."""
    BOX_H: tl.constexpr = BLOCK_M // BOX_W
    boxes_w = tl.cdiv(OW, BOX_W)
    per_image = tl.cdiv(OH, BOX_H) * boxes_w
    image = pid_m // per_image
    within = pid_m - image * per_image
    oh0 = (within // boxes_w) * BOX_H
    ow0 = (within - (within // boxes_w) * boxes_w) * BOX_W
    i = tl.arange(0, BLOCK_M)
    oh = oh0 + i // BOX_W
    ow = ow0 + i % BOX_W
    m_ok = (oh < OH) & (ow < OW)
    oh = tl.where(m_ok, oh, 0)
    ow = tl.where(m_ok, ow, 0)
    offs_m = (image * OH + oh) * OW + ow
    n_idx = tl.zeros_like(i) + image
    return offs_m, m_ok, n_idx, oh, ow, image, oh0, ow0


@triton.jit
def load_tap_box(
    x_desc,
    image,
    oh0,
    ow0,
    kh,
    kw,
    c0,
    C_IN,
    stride_h,
    stride_w,
    pad_top,
    pad_left,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The ``[BLOCK_M, BLOCK_K]`` activation tile of filter tap ``(kh, kw)``, channels ``c0..``, for the box
    at output ``(oh0, ow0)`` of ``image``: one load of the 5-D descriptor over ``[N, H / sh, sh, W / sw,
    sw * C]`` (:func:`box_descriptor_view`). Input row ``oh * sh + kh - pad_top`` is view row ``oh + qh`` of
    phase ``rh`` (``qh, rh`` the floor quotient and remainder of ``kh - pad_top`` by ``sh``); columns
    alike, the column phase selecting a channel offset. Out-of-range view coordinates read zeros."""
    dh = kh - pad_top
    dw = kw - pad_left
    qh = (dh + pad_top * stride_h) // stride_h - pad_top  # floor division: dh >= -pad_top
    qw = (dw + pad_left * stride_w) // stride_w - pad_left
    rh = dh - qh * stride_h
    rw = dw - qw * stride_w
    a = x_desc.load([image, oh0 + qh, rh, ow0 + qw, rw * C_IN + c0])
    return tl.reshape(a, [BLOCK_M, BLOCK_K])


@triton.jit
def bordered_rows(pid_m, M, OH, OW, pad_top, pad_left, BLOCK_M: tl.constexpr):
    """Tile ``pid_m`` of the zero-bordered grid (shifted taps) as output rows: ``offs_m, m_ok, n_idx, oh, ow``, the
    border's rows and those past the last image masked (``m_ok``) and decoded to row 0."""
    q = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row = OW + pad_left
    per_image = (OH + pad_top) * row
    image = q // per_image
    hp = (q - image * per_image) // row
    wp = q - image * per_image - hp * row
    m_ok = (image < M // (OH * OW)) & (hp >= pad_top) & (wp >= pad_left)
    n_idx = tl.where(m_ok, image, 0)
    oh = tl.where(m_ok, hp - pad_top, 0)
    ow = tl.where(m_ok, wp - pad_left, 0)
    return (n_idx * OH + oh) * OW + ow, m_ok, n_idx, oh, ow


def box_shape_refusal(
    c_in: int, c_out: int, h: int, w: int, groups: int, stride: Sequence[int], dilation: Sequence[int], elem: int
) -> str | None:
    """Why a conv's shape rules out box tiles (for a dense channels_last input of ``elem``-byte values), or
    None: they need an ungrouped, undilated conv, stride 1 or 2 dividing the input's height and width (and a
    multiple of 16 input channels for stride 2 across), and 16-byte rows of input and output channels."""
    sh, sw = stride
    if groups != 1:
        return f"groups={groups} (box tiles are ungrouped)"
    if tuple(dilation) != (1, 1):
        return f"dilation {tuple(dilation)} (box tiles are undilated)"
    if sh not in (1, 2) or sw not in (1, 2) or h % sh or w % sw:
        return f"stride {tuple(stride)} on a {h}x{w} input (box tiles need stride 1 or 2 dividing the size)"
    if sw > 1 and c_in % 16:
        return f"{c_in} input channels with stride 2 across (box tiles need a multiple of 16)"
    if (c_in * elem) % 16 or (c_out * elem) % 16:
        return f"{c_in} input / {c_out} output channels of {elem} bytes (box tiles need 16-byte channel rows)"
    return None


def box_refusal(
    x: torch.Tensor,
    c_out: int,
    groups: int,
    stride: Sequence[int],
    dilation: Sequence[int],
    weight_dtype: torch.dtype,
    transformed: bool,
) -> str | None:
    """Why this input cannot be read in box tiles, or None: :func:`box_shape_refusal`, and a dense
    channels_last ``x`` of the packed weight's dtype (the tile goes to the dot as loaded) at a 16-byte
    aligned address, with no transformation as it is loaded (``transformed``: a prologue or a virtual
    concatenation, which need the registers)."""
    _, c, h, w = x.shape
    shape = box_shape_refusal(c, c_out, h, w, groups, stride, dilation, x.element_size())
    if shape is not None:
        return shape
    if x.stride() != (h * w * c, 1, w * c, c) or x.data_ptr() % 16:
        return f"an input with strides {x.stride()} (box tiles read a dense channels_last input, 16-byte aligned)"
    if x.dtype != weight_dtype:
        return f"a {x.dtype} input to {weight_dtype} weights (box tiles feed the dot the input as loaded)"
    if transformed:
        return "an input prologue or a virtual concatenation (box tiles do not transform the input)"
    return None


def tap_shift_refusal(
    box_why_not: str | None,
    stride: Sequence[int],
    padding: Sequence[int],
    in_size: tuple[int, int],
    out_size: tuple[int, int],
) -> str | None:
    """Why shifted taps cannot read this input, or None: whatever rules out box tiles (``box_why_not``, a dense
    channels_last input of the weights' dtype), stride 1, an output of the input's size (else consecutive output
    pixels do not read consecutive input pixels), and padding no wider at the bottom and right than at the top and
    left (the bordered buffer's top and left borders serve both sides)."""
    if box_why_not is not None:
        return box_why_not
    if tuple(stride) != (1, 1):
        return f"stride {tuple(stride)} (shifted taps need stride 1)"
    if tuple(out_size) != tuple(in_size):
        sizes = f"a {in_size[0]}x{in_size[1]} input with a {out_size[0]}x{out_size[1]} output"
        return f"{sizes} (shifted taps need the input's size)"
    top, bottom, left, right = padding
    if bottom > top or right > left:
        return f"padding {tuple(padding)} (shifted taps need bottom <= top and right <= left)"
    return None


def shifted_twins(candidates: list[TileConfig], why_not: str | None, out_size: tuple[int, int]) -> list[TileConfig]:
    """``candidates`` followed by the shifted-tap twin of each of its row tiles (neither boxes nor stream-K), where
    shifted taps can read the input (``why_not``, :func:`tap_shift_refusal`, is None) and the output has at most
    ``SHIFT_MAX_PIXELS`` pixels per image; else ``candidates`` unchanged. The twins come last: the list's first
    entry and the cost model (which does not model the copy, so ranks a twin level with its row tile and keeps the
    earlier) stay on row tiles, and a twin becomes a default only where the shipped table measured it fastest."""
    if why_not is not None or out_size[0] * out_size[1] > SHIFT_MAX_PIXELS:
        return candidates
    twins = [dataclasses.replace(c, tap_shift=1) for c in candidates if not (c.box_w or c.stream_k or c.tap_shift)]
    return list(dict.fromkeys([*candidates, *twins]))


def box_descriptor_view(x: torch.Tensor, stride: Sequence[int]) -> torch.Tensor:
    """The 5-D view ``[N, H / sh, sh, W / sw, sw * C]`` of a dense channels_last ``x`` that the box loads
    address (no copy)."""
    n, c, h, w = x.shape
    sh, sw = stride
    return x.as_strided((n, h // sh, sh, w // sw, sw * c), (h * w * c, sh * w * c, w * c, sw * c, 1))


def box_block(config: TileConfig) -> list[int]:
    """The descriptor's block for ``config``: one image, ``block_m // box_w`` view rows of one phase,
    ``box_w`` view columns, ``block_k`` channels."""
    return [1, config.block_m // config.box_w, 1, config.box_w, config.block_k]


def box_width(ow: int) -> int:
    """The box's width for an output ``ow`` columns wide: 16 from 64 columns, else 8 (a multiple of 8 keeps
    the box's rows whole 128-byte swizzle periods)."""
    return 16 if ow >= 64 else 8


def boxes_by_default(m: int, c_in: int, stride: Sequence[int], ow: int) -> bool:
    """Whether a conv that box tiles can read takes them by default (else the row tiles): where they were
    measured faster (benchmarks/box_tiles.py, results/box-tiles-2026-12-03.json, H200, triton 3.6). At stride 1
    with 64 input channels on an 80-column image, 16-column boxes ran 1.1-1.65x the row tiles' default (batch
    8 and 32, fp16 and tf32); on narrow images (20x20, 7x7: 8-column boxes) 0.3-0.9x, and at stride 2
    0.84-1.13x, slower in fp16. With 16 and 32 input channels (YOLOv8n's 160x160 and 80x80 bottlenecks) they
    made the model's conv time 7% longer at batch 32 fp16 (results/gpu-models-2026-12-03b.json). So: stride 1,
    at least ``BOX_MIN_CHANNELS`` input channels, 64 output columns and ``BOX_MIN_ROWS`` output pixels."""
    return m >= BOX_MIN_ROWS and c_in >= BOX_MIN_CHANNELS and tuple(stride) == (1, 1) and box_width(ow) == 16


# (block_m, block_n, warps, stages) of the box candidates, first = default
BOX_TILES = ((128, 128, 8, 3), (128, 64, 4, 4), (64, 128, 4, 4), (128, 256, 8, 3))
# The box tiles offered after the row tiles at stride 2 (strided_box_twins): on YOLOv8n's 64->128 stride-2 conv
# at 160x160, batch 32, 64x128 boxes of 4 warps and 3 stages ran 12% under the row tiles' best in fp16 and 128x128
# of 4 warps and 4 stages 11% in tf32 (results/conv-tile-sweep-2026-12-04b.json).
STRIDED_BOX_TILES = ((64, 128, 4, 3), (128, 128, 4, 4), (128, 128, 8, 3))


def box_candidates(
    c_in: int,
    c_out: int,
    ow: int,
    stride_w: int,
    operand_bytes: int,
    shapes: Sequence[tuple[int, int, int, int]] = BOX_TILES,
) -> list[TileConfig]:
    """The box configs a launch may measure (first = default, the fastest of them on every measured layer
    that boxes are the default for), of ``shapes`` (block_m, block_n, warps, stages).

    ``block_k`` is 64 channels for 16-bit operands, 32 for float32 (128-byte rows, the widest swizzle),
    smaller where the input has fewer channels, and a divisor of ``c_in`` for ``stride_w > 1`` (a block must
    not cross into the next column phase's channels)."""
    bk = 64 if operand_bytes == 2 else 32
    while bk > 16 and (bk > triton.next_power_of_2(c_in) or (stride_w > 1 and c_in % bk)):
        bk //= 2
    bw = box_width(ow)
    bn_cap = max(16, triton.next_power_of_2(c_out))
    out: list[TileConfig] = []
    for bm, bn, warps, stages in shapes:
        config = TileConfig(bm, min(bn, bn_cap), bk, 8, warps, stages, box_w=bw)
        if config not in out:
            out.append(config)
    return out


def strided_box_twins(
    candidates: list[TileConfig],
    can_box: bool,
    m: int,
    c_in: int,
    c_out: int,
    stride: Sequence[int],
    ow: int,
    operand_bytes: int,
) -> list[TileConfig]:
    """``candidates`` (the row tiles' list) followed by the box tiles of ``STRIDED_BOX_TILES`` for a strided conv that
    boxes can read (``can_box``) and that :func:`boxes_by_default` would give them but for its stride; else
    ``candidates`` unchanged. At stride 2 boxes measured 0.84-1.13x the row tiles' default on the layers of
    results/box-tiles-2026-12-03.json and 1.12x on YOLOv8n's 64->128 @160 (STRIDED_BOX_TILES), so they come last:
    the list's first entry stays a row tile, and a box becomes a default only where the shipped table measured it
    fastest (the cost model, which does not model boxes, never picked one on YOLO's strided shapes)."""
    if not can_box or tuple(stride) == (1, 1) or not boxes_by_default(m, c_in, (1, 1), ow):
        return candidates
    boxes = box_candidates(c_in, c_out, ow, stride[1], operand_bytes, STRIDED_BOX_TILES)
    return list(dict.fromkeys([*candidates, *boxes]))
