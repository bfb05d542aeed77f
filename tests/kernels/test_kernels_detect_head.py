"""The detect-head kernel (fuser.kernels.detect_head) against its float64 reference: odd level sizes and
class counts, NHWC / NCHW / channel-slice inputs, xywh and xyxy, with and without the raw outputs, a
reg_max that is not a power of two, more levels than one launch takes; bad input; the compiled kernel on a GPU.

The reference itself is checked against ultralytics' own Detect in tests/zoo/test_detect_head.py."""

from __future__ import annotations

import pytest
import torch
from accuracy import assert_close

from fuser.kernels.detect_head import MAX_LEVELS, detect_head, detect_head_reference, prepare_detect_head

LEVELS = [(5, 7), (3, 4), (2, 2)]


def head_inputs(
    levels: list[tuple[int, int]],
    batch: int = 2,
    nc: int = 13,
    reg_max: int = 16,
    layout: str = "nhwc",
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Branch outputs in ``layout`` ("nhwc", "nchw", or "slice": channel slices of a wider NHWC tensor, as a
    cat buffer holds them), anchors [2, A] and strides [1, A] laid out as ultralytics' transposes leave them,
    and bin weights that are not 0..R-1 (a kernel that assumed them would fail)."""
    g = torch.Generator().manual_seed(3)

    def branch(channels: int, h: int, w: int) -> torch.Tensor:
        if layout == "slice":
            wide = torch.randn(batch, h, w, channels + 5, generator=g) * 3
            return wide[..., 2 : 2 + channels].permute(0, 3, 1, 2).to(device, dtype)
        t = (torch.randn(batch, channels, h, w, generator=g) * 3).to(device, dtype)
        return t.contiguous(memory_format=torch.channels_last) if layout == "nhwc" else t

    boxes = [branch(4 * reg_max, h, w) for h, w in levels]
    scores = [branch(nc, h, w) for h, w in levels]
    total = sum(h * w for h, w in levels)
    anchors = (torch.rand(total, 2, generator=g) * 20).to(device, dtype).transpose(0, 1)
    strides = (torch.rand(total, 1, generator=g) * 32 + 1).to(device, dtype).transpose(0, 1)
    weight = (torch.arange(reg_max, dtype=torch.float32) + torch.rand(reg_max, generator=g)).to(device)
    return boxes, scores, anchors, strides, weight


def reference64(
    boxes: list[torch.Tensor],
    scores: list[torch.Tensor],
    anchors: torch.Tensor,
    strides: torch.Tensor,
    weight: torch.Tensor,
    xywh: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = [t.double() for t in boxes], [t.double() for t in scores]
    return detect_head_reference(*d, anchors.double(), strides.double(), weight.double(), xywh=xywh)


@pytest.mark.parametrize(
    ("layout", "dtype", "nc", "reg_max", "xywh"),
    [
        ("nhwc", torch.float32, 13, 16, True),
        ("nchw", torch.float32, 7, 16, True),
        ("slice", torch.float32, 13, 16, False),
        ("nhwc", torch.float32, 1, 7, True),
        ("nhwc", torch.float16, 13, 16, True),
        ("nchw", torch.bfloat16, 7, 16, False),
    ],
    ids=["nhwc-nc13", "nchw-nc7", "slice-xyxy", "nc1-reg7", "fp16", "bf16-xyxy"],
)
def test_kernel_matches_reference(layout: str, dtype: torch.dtype, nc: int, reg_max: int, xywh: bool) -> None:
    inputs = head_inputs(LEVELS, nc=nc, reg_max=reg_max, layout=layout, dtype=dtype)
    y, boxes, scores = detect_head(*inputs, xywh=xywh, interpret=True)
    ref_y, ref_boxes, ref_scores = reference64(*inputs, xywh=xywh)
    precision = "ieee" if dtype == torch.float32 else "fp16"
    assert y.dtype == dtype and y.is_contiguous() and boxes.is_contiguous() and scores.is_contiguous()
    assert_close(y, ref_y, precision, "decoded output")
    assert torch.equal(boxes.double(), ref_boxes) and torch.equal(scores.double(), ref_scores), "raw outputs are copies"


def test_without_raw_outputs() -> None:
    inputs = head_inputs(LEVELS, batch=1, nc=5)
    y, boxes, scores = detect_head(*inputs, raw=False, interpret=True)
    assert boxes is None and scores is None
    assert_close(y, reference64(*inputs)[0], "ieee", "decoded output")


def test_more_levels_than_one_launch() -> None:
    levels = [(7, 5), (4, 3), (3, 2), (2, 1), (1, 3), (1, 1)]
    assert len(levels) > MAX_LEVELS
    inputs = head_inputs(levels, nc=3, reg_max=4)
    y, boxes, _ = detect_head(*inputs, interpret=True)
    ref_y, ref_boxes, _ = reference64(*inputs)
    assert_close(y, ref_y, "ieee", "decoded output")
    assert torch.equal(boxes.double(), ref_boxes)


@pytest.mark.parametrize("block", [16, 32])
def test_level_blocks_cross_levels_exactly(block: int) -> None:
    """Blocks smaller than a level, and levels that do not fill their last block: each anchor once."""
    from fuser.kernels.autotune import TileConfig

    inputs = head_inputs([(5, 7), (3, 4), (4, 1)], batch=1, nc=19)
    plan = prepare_detect_head(*inputs, interpret=True, tile=TileConfig(block, 16, 1, 1, 4, 1))
    assert_close(plan(*inputs)[0], reference64(*inputs)[0], "ieee", "decoded output")


def test_bad_input_is_named() -> None:
    boxes, scores, anchors, strides, weight = head_inputs(LEVELS, nc=5)
    with pytest.raises(ValueError, match=r"level 1: the box output needs 4 \* reg_max = 64 channels"):
        detect_head([boxes[0], boxes[1][:, :60]], scores[:2], anchors, strides, weight, interpret=True)
    with pytest.raises(ValueError, match=r"anchors must be \[2, 51\]"):
        detect_head(boxes, scores, anchors[:, :50], strides, weight, interpret=True)
    with pytest.raises(ValueError, match=r"level 0: the class output is torch\.float16"):
        detect_head(boxes, [scores[0].half(), *scores[1:]], anchors, strides, weight, interpret=True)
    with pytest.raises(ValueError, match="level 2: the box output's pixels are not one run"):
        hw_swapped = boxes[2].transpose(2, 3).contiguous().transpose(2, 3)
        detect_head([*boxes[:2], hw_swapped], scores, anchors, strides, weight, interpret=True)
    with pytest.raises(ValueError, match="one box and one class tensor per level"):
        detect_head(boxes, scores[:2], anchors, strides, weight, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_compiled_kernel(dtype: torch.dtype, layout: str) -> None:
    """YOLOv8 at 640x640 (80x80, 40x40, 20x20 levels, 80 classes) and an odd size with 13 classes."""
    for levels, nc in (([(80, 80), (40, 40), (20, 20)], 80), ([(41, 53), (21, 27), (11, 14)], 13)):
        inputs = head_inputs(levels, batch=2, nc=nc, layout=layout, dtype=dtype, device="cuda")
        y, boxes, scores = detect_head(*inputs)
        torch.cuda.synchronize()
        ref_y, ref_boxes, ref_scores = reference64(*inputs)
        assert_close(y, ref_y, "ieee" if dtype == torch.float32 else "fp16", f"decoded output {levels}")
        assert torch.equal(boxes.double(), ref_boxes) and torch.equal(scores.double(), ref_scores)
