"""``detect_head``: the inference tail of a YOLO detect head (ultralytics' ``Detect``) in one kernel.

Per level ``i`` the head has a box branch output ``[N, 4 * R, H_i, W_i]`` (``R = reg_max`` bins per box side)
and a class branch output ``[N, nc, H_i, W_i]``. Eager ultralytics then runs a dozen small kernels: the
per-level views and the two concatenations over levels, DFL (softmax over the bins of each side, then the
expectation as a 1x1 conv with weights ``0 .. R-1``), ``dist2bbox`` (anchor minus / plus distances, centre and
size), the multiplication by each anchor's stride, the sigmoid of the class scores and the final
concatenation ``[N, 4 + nc, A]`` (``A = sum H_i * W_i``).

This kernel reads each level's branch outputs once, whatever their memory format (the fused convs write
NHWC), and writes the final ``[N, 4 + nc, A]`` directly; with ``raw=True`` it also writes the two
concatenations ``[N, 4 * R, A]`` and ``[N, nc, A]`` of the raw branch outputs, which ultralytics returns
beside the decoded boxes. One launch handles up to ``MAX_LEVELS`` levels (YOLO heads have three or four):
each program owns a block of one level's anchors of one image, found from the level's block range.

The anchor points ``[2, A]`` and strides ``[1, A]`` are inputs: the head computes them (ultralytics'
``make_anchors``) when the input shape changes. :func:`detect_head_reference` is the same function in plain
torch, in the order ultralytics computes it (the CPU path and the oracle of the tests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from .autotune import TileConfig
from .launch import FLOAT_DTYPES, KernelCall, PlanCache, cdiv, check_device, choose_tile, tensor_meta

MAX_LEVELS = 4  # levels per launch; a head with more takes several launches


@triton.jit
def _side_distance(box_rows, sb_c, boxes_rows, A, a_ok, bins, b_ok, weight, SIDE: tl.constexpr, R: tl.constexpr,
                   RAW: tl.constexpr):  # fmt: skip
    """DFL of one box side: softmax over its ``R`` bins, then the expectation under the bin weights (and,
    with ``RAW``, the bins copied into the concatenation of raw box outputs)."""
    channel = SIDE * R + bins
    ok = a_ok[:, None] & b_ok[None, :]
    raw = tl.load(box_rows + channel[None, :] * sb_c, mask=ok, other=0.0)
    if RAW:
        tl.store(boxes_rows + channel[None, :].to(tl.int64) * A, raw, mask=ok)
    logits = tl.where(b_ok[None, :], raw.to(tl.float32), float("-inf"))
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    return tl.sum(e * weight[None, :], axis=1) / tl.sum(e, axis=1)


@triton.jit
def _decode_level(
    block,
    n,
    box_ptr,
    sb_n,
    sb_a,
    sb_c,
    cls_ptr,
    sc_n,
    sc_a,
    sc_c,
    A_LEVEL,
    A_OFFSET,
    anchor_ptr,
    sa_r,
    sa_a,
    stride_ptr,
    ss_a,
    dfl_ptr,
    y_ptr,
    boxes_ptr,
    scores_ptr,
    A,
    NC,
    R: tl.constexpr,
    R_PAD: tl.constexpr,
    XYWH: tl.constexpr,
    RAW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One block of ``BLOCK_M`` anchors of level ``(box_ptr, cls_ptr)`` of image ``n``."""
    offs = block * BLOCK_M + tl.arange(0, BLOCK_M)
    a_ok = offs < A_LEVEL
    local = tl.where(a_ok, offs, 0).to(tl.int64)
    anchor = local + A_OFFSET  # index into the concatenation over levels
    ax = tl.load(anchor_ptr + anchor * sa_a, mask=a_ok, other=0.0).to(tl.float32)
    ay = tl.load(anchor_ptr + sa_r + anchor * sa_a, mask=a_ok, other=0.0).to(tl.float32)
    stride = tl.load(stride_ptr + anchor * ss_a, mask=a_ok, other=0.0).to(tl.float32)
    dtype = y_ptr.dtype.element_ty

    bins = tl.arange(0, R_PAD)
    b_ok = bins < R
    weight = tl.load(dfl_ptr + bins, mask=b_ok, other=0.0).to(tl.float32)
    box_rows = box_ptr + n * sb_n + local[:, None] * sb_a
    boxes_rows = boxes_ptr + n * (4 * R) * A + anchor[:, None]
    d_left = _side_distance(box_rows, sb_c, boxes_rows, A, a_ok, bins, b_ok, weight, 0, R, RAW)
    d_top = _side_distance(box_rows, sb_c, boxes_rows, A, a_ok, bins, b_ok, weight, 1, R, RAW)
    d_right = _side_distance(box_rows, sb_c, boxes_rows, A, a_ok, bins, b_ok, weight, 2, R, RAW)
    d_bottom = _side_distance(box_rows, sb_c, boxes_rows, A, a_ok, bins, b_ok, weight, 3, R, RAW)
    # dist2bbox: ltrb distances from the anchor point to a box, in grid units, then scaled by the stride.
    x1 = ax - d_left
    y1 = ay - d_top
    x2 = ax + d_right
    y2 = ay + d_bottom
    if XYWH:
        b0 = (x1 + x2) / 2
        b1 = (y1 + y2) / 2
        b2 = x2 - x1
        b3 = y2 - y1
    else:
        b0 = x1
        b1 = y1
        b2 = x2
        b3 = y2
    y_rows = y_ptr + n * (4 + NC) * A + anchor
    tl.store(y_rows, (b0 * stride).to(dtype), mask=a_ok)
    tl.store(y_rows + A, (b1 * stride).to(dtype), mask=a_ok)
    tl.store(y_rows + 2 * A, (b2 * stride).to(dtype), mask=a_ok)
    tl.store(y_rows + 3 * A, (b3 * stride).to(dtype), mask=a_ok)

    cls_rows = cls_ptr + n * sc_n + local[:, None] * sc_a
    scores_rows = scores_ptr + n * NC * A + anchor[:, None]
    for c0 in range(0, NC, BLOCK_N):
        classes = c0 + tl.arange(0, BLOCK_N)
        ok = a_ok[:, None] & (classes < NC)[None, :]
        raw = tl.load(cls_rows + classes[None, :] * sc_c, mask=ok, other=0.0)
        if RAW:
            tl.store(scores_rows + classes[None, :].to(tl.int64) * A, raw, mask=ok)
        score = tl.sigmoid(raw.to(tl.float32))
        tl.store(y_rows[:, None] + (4 + classes[None, :]).to(tl.int64) * A, score.to(dtype), mask=ok)


@triton.jit
def _detect_head_kernel(
    box0,
    cls0,
    box1,
    cls1,
    box2,
    cls2,
    box3,
    cls3,
    anchor_ptr,
    stride_ptr,
    dfl_ptr,
    y_ptr,
    boxes_ptr,
    scores_ptr,
    # per level: box strides (image, anchor, channel), class strides, anchors, first anchor, end block
    sb0_n, sb0_a, sb0_c, sc0_n, sc0_a, sc0_c, A0, OFF0, END0,
    sb1_n, sb1_a, sb1_c, sc1_n, sc1_a, sc1_c, A1, OFF1, END1,
    sb2_n, sb2_a, sb2_c, sc2_n, sc2_a, sc2_c, A2, OFF2, END2,
    sb3_n, sb3_a, sb3_c, sc3_n, sc3_a, sc3_c, A3, OFF3, END3,
    sa_r,
    sa_a,
    ss_a,
    A,
    NC,
    LEVELS: tl.constexpr,
    R: tl.constexpr,
    R_PAD: tl.constexpr,
    XYWH: tl.constexpr,
    RAW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    # The level of this program's block selects its arguments, then one decode runs: one inlined copy of
    # the decode, not one per level (YOLO's three levels: a third of the code; sm90 compile 2.5 -> 0.8 s).
    block = pid
    box, sb_n, sb_a, sb_c, cls, sc_n, sc_a, sc_c, a_level, a_offset = (
        box0, sb0_n, sb0_a, sb0_c, cls0, sc0_n, sc0_a, sc0_c, A0, OFF0
    )  # fmt: skip
    if LEVELS > 1:
        box, sb_n, sb_a, sb_c, cls, sc_n, sc_a, sc_c, a_level, a_offset, block = _level_if(
            pid >= END0, pid - END0, box1, sb1_n, sb1_a, sb1_c, cls1, sc1_n, sc1_a, sc1_c, A1, OFF1,
            box, sb_n, sb_a, sb_c, cls, sc_n, sc_a, sc_c, a_level, a_offset, block,
        )  # fmt: skip
    if LEVELS > 2:
        box, sb_n, sb_a, sb_c, cls, sc_n, sc_a, sc_c, a_level, a_offset, block = _level_if(
            pid >= END1, pid - END1, box2, sb2_n, sb2_a, sb2_c, cls2, sc2_n, sc2_a, sc2_c, A2, OFF2,
            box, sb_n, sb_a, sb_c, cls, sc_n, sc_a, sc_c, a_level, a_offset, block,
        )  # fmt: skip
    if LEVELS > 3:
        box, sb_n, sb_a, sb_c, cls, sc_n, sc_a, sc_c, a_level, a_offset, block = _level_if(
            pid >= END2, pid - END2, box3, sb3_n, sb3_a, sb3_c, cls3, sc3_n, sc3_a, sc3_c, A3, OFF3,
            box, sb_n, sb_a, sb_c, cls, sc_n, sc_a, sc_c, a_level, a_offset, block,
        )  # fmt: skip
    _decode_level(block, n, box, sb_n, sb_a, sb_c, cls, sc_n, sc_a, sc_c, a_level, a_offset,
                  anchor_ptr, sa_r, sa_a, stride_ptr, ss_a, dfl_ptr, y_ptr, boxes_ptr, scores_ptr, A, NC,
                  R, R_PAD, XYWH, RAW, BLOCK_M, BLOCK_N)  # fmt: skip


@triton.jit
def _level_if(inside, level_block, box, sb_n, sb_a, sb_c, cls, sc_n, sc_a, sc_c, a_level, a_offset,
              box_, sb_n_, sb_a_, sb_c_, cls_, sc_n_, sc_a_, sc_c_, a_level_, a_offset_, block_):  # fmt: skip
    """A level's arguments where ``inside`` (the program's block lies at or past the level's first block),
    else the arguments chosen so far (the trailing-underscore ones): selects, no branch."""
    return (
        tl.where(inside, box, box_), tl.where(inside, sb_n, sb_n_), tl.where(inside, sb_a, sb_a_),
        tl.where(inside, sb_c, sb_c_), tl.where(inside, cls, cls_), tl.where(inside, sc_n, sc_n_),
        tl.where(inside, sc_a, sc_a_), tl.where(inside, sc_c, sc_c_), tl.where(inside, a_level, a_level_),
        tl.where(inside, a_offset, a_offset_), tl.where(inside, level_block, block_),
    )  # fmt: skip


def detect_head_reference(
    box_levels: Sequence[torch.Tensor],
    cls_levels: Sequence[torch.Tensor],
    anchors: torch.Tensor,
    strides: torch.Tensor,
    dfl_weight: torch.Tensor,
    *,
    xywh: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, boxes, scores)`` in plain torch, computed as ultralytics' ``Detect`` computes them in eval.

    ``boxes`` / ``scores`` are the concatenations over levels of the raw branch outputs (``[N, 4R, A]``,
    ``[N, nc, A]``); ``y`` is ``cat(dist2bbox(DFL(boxes), anchors) * strides, sigmoid(scores))``."""
    bs = box_levels[0].shape[0]
    r = dfl_weight.numel()
    boxes = torch.cat([b.view(bs, b.shape[1], -1) for b in box_levels], dim=-1)
    scores = torch.cat([c.view(bs, c.shape[1], -1) for c in cls_levels], dim=-1)
    a = boxes.shape[-1]
    p = boxes.view(bs, 4, r, a).transpose(2, 1).softmax(1)
    dist = (p * dfl_weight.to(p.dtype).view(1, r, 1, 1)).sum(1)
    lt, rb = dist.chunk(2, 1)
    x1y1 = anchors.unsqueeze(0) - lt
    x2y2 = anchors.unsqueeze(0) + rb
    box = torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), 1) if xywh else torch.cat((x1y1, x2y2), 1)
    return torch.cat((box * strides, scores.sigmoid()), 1), boxes, scores


def _anchor_strides(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(image, anchor, channel) strides of an ``[N, C, H, W]`` level whose pixels are one run of anchors
    (``h * W + w`` at one stride: NHWC, NCHW and slices of either), or None."""
    _, _, h, w = t.shape
    s_n, s_c, s_h, s_w = t.stride()
    if h > 1 and w > 1 and s_h != w * s_w:
        return None
    return s_n, (s_w if w > 1 else s_h), s_c


def unsupported(
    box_levels: Sequence[torch.Tensor],
    cls_levels: Sequence[torch.Tensor],
    anchors: torch.Tensor,
    strides: torch.Tensor,
    dfl_weight: torch.Tensor,
) -> str | None:
    """Why these inputs are not what the kernel takes (naming the level, the input and its shape), or None."""
    if not box_levels or len(box_levels) != len(cls_levels):
        return f"one box and one class tensor per level, got {len(box_levels)} and {len(cls_levels)}"
    r = dfl_weight.numel()
    if dfl_weight.dim() != 1 or r < 1:
        return f"dfl_weight must be a vector of the reg_max bin weights, got shape {tuple(dfl_weight.shape)}"
    n = box_levels[0].shape[0] if box_levels[0].dim() == 4 else -1
    nc = cls_levels[0].shape[1] if cls_levels[0].dim() == 4 else -1
    sizes = []
    for i, (b, c) in enumerate(zip(box_levels, cls_levels, strict=True)):
        if b.dim() != 4 or c.dim() != 4 or b.shape[0] != n or c.shape[0] != n or b.shape[2:] != c.shape[2:]:
            return (
                f"level {i}: box and class outputs must be [N, C, H, W] of one N, H and W, "
                f"got {tuple(b.shape)} and {tuple(c.shape)}"
            )
        if b.shape[1] != 4 * r or c.shape[1] != nc:
            return (
                f"level {i}: the box output needs 4 * reg_max = {4 * r} channels and the class output {nc}, "
                f"got {b.shape[1]} and {c.shape[1]}"
            )
        for name, t in (("box", b), ("class", c)):
            if t.dtype != box_levels[0].dtype or t.dtype not in FLOAT_DTYPES:
                return f"level {i}: the {name} output is {t.dtype}; all must be one of float32, float16, bfloat16"
            if _anchor_strides(t) is None:
                return f"level {i}: the {name} output's pixels are not one run of strides (strides {t.stride()})"
        sizes.append(b.shape[2] * b.shape[3])
    total = sum(sizes)
    if tuple(anchors.shape) != (2, total) or tuple(strides.shape) != (1, total):
        return (
            f"anchors must be [2, {total}] and strides [1, {total}] for levels of {sizes} anchors, "
            f"got {tuple(anchors.shape)} and {tuple(strides.shape)}"
        )
    return None


def _check(
    box_levels: Sequence[torch.Tensor],
    cls_levels: Sequence[torch.Tensor],
    anchors: torch.Tensor,
    strides: torch.Tensor,
    dfl_weight: torch.Tensor,
    interpret: bool,
) -> tuple[int, int, int, list[int]]:
    """(N, R, nc, anchors per level), or a ValueError saying what is wrong."""
    reason = unsupported(box_levels, cls_levels, anchors, strides, dfl_weight)
    if reason is not None:
        raise ValueError(f"detect_head: {reason}")
    tensors = {f"level {i} box": b for i, b in enumerate(box_levels)}
    tensors.update({f"level {i} class": c for i, c in enumerate(cls_levels)})
    check_device(
        "detect_head", interpret, {**tensors, "anchors": anchors, "strides": strides, "dfl_weight": dfl_weight}
    )
    sizes = [b.shape[2] * b.shape[3] for b in box_levels]
    return box_levels[0].shape[0], dfl_weight.numel(), cls_levels[0].shape[1], sizes


INTERPRET_CONFIG = TileConfig(64, 32, 1, 1, 4, 1)


def detect_head_candidates(classes: int) -> list[TileConfig]:
    """Tiles of (anchors, classes per step) worth measuring (first = default)."""
    bn = min(64, max(16, triton.next_power_of_2(classes)))
    return [TileConfig(64, bn, 1, 1, 4, 1), TileConfig(32, bn, 1, 1, 4, 1), TileConfig(128, bn, 1, 1, 8, 1)]


def prepare_detect_head(
    box_levels: Sequence[torch.Tensor],
    cls_levels: Sequence[torch.Tensor],
    anchors: torch.Tensor,
    strides: torch.Tensor,
    dfl_weight: torch.Tensor,
    *,
    xywh: bool = True,
    raw: bool = True,
    interpret: bool = False,
    tile: TileConfig | None = None,
) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """Check example inputs and choose the tile; return ``run(box_levels, cls_levels, anchors, strides,
    dfl_weight) -> (y, boxes, scores)`` for every call with the same shapes, strides and dtypes (``boxes``
    and ``scores`` are None unless ``raw``)."""
    n, r, nc, sizes = _check(box_levels, cls_levels, anchors, strides, dfl_weight, interpret)
    total = sum(sizes)
    constexprs = {"R": r, "R_PAD": triton.next_power_of_2(r), "XYWH": bool(xywh), "RAW": bool(raw)}
    dtype, device = box_levels[0].dtype, box_levels[0].device
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    chunks = [range(i, min(i + MAX_LEVELS, len(sizes))) for i in range(0, len(sizes), MAX_LEVELS)]
    level_strides = [(_anchor_strides(b), _anchor_strides(c)) for b, c in zip(box_levels, cls_levels, strict=True)]

    def runner(config: TileConfig) -> Callable[..., Any]:
        launches = []
        for chunk in chunks:
            slots = [*chunk, *[chunk[0]] * (MAX_LEVELS - len(chunk))]  # unused slots repeat a level
            scalars: list[int] = []
            end = 0
            for slot, i in enumerate(slots):
                end += cdiv(sizes[i], config.block_m) if slot < len(chunk) else 0
                scalars += [*level_strides[i][0], *level_strides[i][1], sizes[i], offsets[i], end]
            scalars += [anchors.stride(0), anchors.stride(1), strides.stride(1), total, nc]
            call = KernelCall(_detect_head_kernel, scalars, {**constexprs, "LEVELS": len(chunk)}, interpret)
            launches.append((slots, call, call.options(config), (end, n)))

        def run(
            box_levels: Sequence[torch.Tensor],
            cls_levels: Sequence[torch.Tensor],
            anchors: torch.Tensor,
            strides: torch.Tensor,
            dfl_weight: torch.Tensor,
        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
            y = torch.empty((n, 4 + nc, total), dtype=dtype, device=device)
            boxes = torch.empty((n, 4 * r, total), dtype=dtype, device=device) if raw else y
            scores = torch.empty((n, nc, total), dtype=dtype, device=device) if raw else y
            for slots, call, options, grid in launches:
                levels = [t for i in slots for t in (box_levels[i], cls_levels[i])]
                call.launch(grid, (*levels, anchors, strides, dfl_weight, y, boxes, scores), options)
            return (y, boxes, scores) if raw else (y, None, None)

        return run

    key = {
        "levels": [list(b.shape[2:]) for b in box_levels],
        "batch": n,
        "reg_max": r,
        "classes": nc,
        "strides": [list(s) for s in level_strides],
        "dtype": str(dtype),
        "raw": bool(raw),
    }
    config = choose_tile(
        "detect_head",
        key,
        detect_head_candidates(nc),
        lambda cfg: runner(cfg)(box_levels, cls_levels, anchors, strides, dfl_weight),
        interpret=interpret,
        interpret_config=INTERPRET_CONFIG,
        forced=tile,
        device=device,
    )
    return runner(config)


_PLANS = PlanCache()


def detect_head(
    box_levels: Sequence[torch.Tensor],
    cls_levels: Sequence[torch.Tensor],
    anchors: torch.Tensor,
    strides: torch.Tensor,
    dfl_weight: torch.Tensor,
    *,
    xywh: bool = True,
    raw: bool = True,
    interpret: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """What :func:`detect_head_reference` computes, in one launch per ``MAX_LEVELS`` levels.

    ``box_levels[i]`` is ``[N, 4 * R, H_i, W_i]``, ``cls_levels[i]`` ``[N, nc, H_i, W_i]`` (any memory format
    whose pixels are one run of anchors: NHWC or NCHW), ``anchors`` ``[2, A]``, ``strides`` ``[1, A]`` and
    ``dfl_weight`` the ``R`` bin weights (float32). Returns ``(y [N, 4 + nc, A], boxes [N, 4R, A], scores
    [N, nc, A])``, contiguous, in the branch outputs' dtype; ``boxes`` and ``scores`` are None unless ``raw``.
    CUDA tensors, or CPU tensors with ``interpret=True`` (Triton's interpreter)."""
    levels = (*box_levels, *cls_levels)
    plan = _PLANS.get(
        lambda: (
            tuple(tensor_meta(t) for t in (*levels, anchors, strides, dfl_weight)),
            len(box_levels),
            bool(xywh),
            bool(raw),
            interpret,
        ),
        lambda: prepare_detect_head(
            box_levels, cls_levels, anchors, strides, dfl_weight, xywh=xywh, raw=raw, interpret=interpret
        ),
    )
    return plan(box_levels, cls_levels, anchors, strides, dfl_weight)
