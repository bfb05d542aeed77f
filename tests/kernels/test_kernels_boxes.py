"""Box tiles of the implicit GEMM (kernels/conv_boxes.py) in the interpreter: the activation operand read
through a 5-D tensor descriptor whose zero fill is the conv's padding, against float64, on odd shapes."""

from __future__ import annotations

import pytest
import torch
from accuracy import assert_close
from kernels_reference import ConvCase, conv_inputs, conv_reference, record_launches

from fuser.kernels import Activation, Epilogue, Residual, conv2d_act, pack_conv_weight
from fuser.kernels.autotune import Problem, TileConfig
from fuser.kernels.conv import conv2d_tile_candidates
from fuser.kernels.conv_boxes import BOX_MIN_ROWS, STRIDED_BOX_TILES, box_candidates, box_width, boxes_by_default
from fuser.kernels.tile_heuristic import pick

SILU_ADD = Epilogue(Activation.SILU, residual=Residual.AFTER_ACT)
BOX_TILE = TileConfig(32, 16, 16, 2, 4, 1, box_w=8)  # boxes 4 rows x 8 columns

# Boxes cut by the image's right and bottom edges (odd sizes), asymmetric padding (negative and past-the-end
# descriptor coordinates), stride 2 in one or both directions (phases of the 5-D view), channel counts that
# leave the last channel block partly past C (stride 1: the descriptor's zero fill) or divide it (stride 2).
# Output channels are multiples of 8: 16-byte rows in 16-bit dtypes, as box tiles need.
BOX_CASES = [
    ConvCase("s1_c24_odd", 2, 24, 24, (11, 13), 3, padding=(1, 1, 1, 1)),
    ConvCase("s1_c48_asym", 1, 48, 24, (9, 7), 3, padding=(0, 2, 2, 0)),  # 48: channel blocks (40: flat K)
    ConvCase("s2_c32_even", 2, 32, 40, (14, 10), 3, stride=2, padding=(1, 1, 1, 1)),
    ConvCase("s21_c16", 1, 16, 8, (10, 9), 3, stride=(2, 1), padding=(1, 0, 1, 1)),
    ConvCase("s1_k5_c16", 1, 16, 56, (9, 11), 5, padding=(2, 2, 2, 2)),
]


def box_call(case: ConvCase, precision: str, dtype: torch.dtype, tile: TileConfig, epilogue: Epilogue = SILU_ADD):
    x, w, b, residual = conv_inputs(case, epilogue, dtype)
    out = conv2d_act(
        x, pack_conv_weight(w, precision), b, stride=case.stride, padding=case.padding, epilogue=epilogue,
        residual=residual, interpret=True, tile=tile,
    )  # fmt: skip
    return out, conv_reference(x, w, b, case, epilogue, residual)


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("ieee", torch.float32), ("tf32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)],
    ids=["ieee", "tf32", "fp16", "bf16"],
)
@pytest.mark.parametrize("case", BOX_CASES, ids=str)
def test_box_tiles_match_float64(monkeypatch: pytest.MonkeyPatch, case: ConvCase, precision: str, dtype) -> None:
    seen = record_launches(monkeypatch)
    out, ref = box_call(case, precision, dtype, BOX_TILE)
    assert [(name, kwargs["BOX_W"]) for name, kwargs in seen] == [("_conv2d_act_kernel", 8)]
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_close(out, ref, precision, f"{case} boxes")


REFUSED = {
    "dilation": (ConvCase("dil", 1, 16, 16, (9, 9), 3, padding=(2, 2, 2, 2), dilation=2), "undilated"),
    "groups": (ConvCase("grouped", 1, 32, 32, (9, 9), 3, padding=(1, 1, 1, 1), groups=2), "ungrouped"),
    "odd size, stride 2": (ConvCase("s2_odd", 1, 16, 16, (9, 10), 3, stride=2, padding=(1, 1, 1, 1)), "dividing"),
    "c_in 24, stride 2": (ConvCase("s2_c24", 1, 24, 16, (8, 8), 3, stride=2, padding=(1, 1, 1, 1)), "multiple of 16"),
    "c_out 13": (ConvCase("c13", 1, 16, 13, (8, 8), 3, padding=(1, 1, 1, 1)), "16-byte channel rows"),
}


@pytest.mark.parametrize("what", REFUSED)
def test_box_tiles_name_what_rules_them_out(what: str) -> None:
    case, reason = REFUSED[what]
    epilogue = Epilogue(Activation.RELU)
    x, w, b, _ = conv_inputs(case, epilogue, torch.float16)
    with pytest.raises(ValueError, match=f"box tiles .*{reason}"):
        conv2d_act(x, pack_conv_weight(w, "fp16", groups=case.groups), b, stride=case.stride, padding=case.padding,
                   dilation=case.dilation, epilogue=epilogue, interpret=True, tile=BOX_TILE)  # fmt: skip


def test_box_tiles_refuse_other_inputs_and_splits() -> None:
    case = ConvCase("c16", 1, 16, 16, (9, 9), 3, padding=(1, 1, 1, 1))
    epilogue = Epilogue(Activation.RELU)
    packed = lambda w: pack_conv_weight(w, "ieee")
    x, w, b, _ = conv_inputs(case, epilogue, channels_last=False)
    with pytest.raises(ValueError, match="dense channels_last"):
        conv2d_act(x, packed(w), b, padding=1, epilogue=epilogue, interpret=True, tile=BOX_TILE)
    x, w, b, _ = conv_inputs(case, epilogue)
    with pytest.raises(ValueError, match="pointer path"):
        conv2d_act(x, packed(w), b, padding=1, epilogue=epilogue, interpret=True, tile=BOX_TILE, path="pointer")
    with pytest.raises(ValueError, match="prologue"):
        conv2d_act(x, packed(w), b, padding=1, epilogue=epilogue, interpret=True, tile=BOX_TILE,
                   input_scale=torch.rand(1, 16, 1, 1) + 0.5)  # fmt: skip
    with pytest.raises(ValueError, match=r"input to torch\.float16 weights"):
        conv2d_act(x, pack_conv_weight(w, "fp16"), b, padding=1, epilogue=epilogue, interpret=True, tile=BOX_TILE)
    with pytest.raises(ValueError, match="not split"):
        conv2d_act(x, packed(w), b, padding=1, epilogue=epilogue, interpret=True,
                   tile=TileConfig(32, 16, 16, 2, 4, 1, split_k=2, box_w=8))  # fmt: skip


def test_boxes_are_the_default_where_they_were_measured_faster() -> None:
    """From BOX_MIN_ROWS output pixels, 64 input channels, stride 1 and 64 output columns, a conv lists box
    tiles (first = default); narrower images, fewer channels, fewer pixels, or shapes boxes cannot read list the
    row tiles, and stride 2 the row tiles first and STRIDED_BOX_TILES last."""
    w = pack_conv_weight(torch.randn(64, 64, 3, 3), "tf32")
    big = conv2d_tile_candidates((3, 64, 75, 77), w, 1, 1)
    assert BOX_MIN_ROWS <= 3 * 75 * 77 and big and all(c.box_w == 16 for c in big)
    assert all(c.box_w == 0 for c in conv2d_tile_candidates((1, 64, 75, 77), w, 1, 1))  # 5775 pixels
    assert all(c.box_w == 0 for c in conv2d_tile_candidates((3, 64, 75, 77), w, 1, 1, dilation=2))
    assert all(c.box_w == 0 for c in conv2d_tile_candidates((40, 64, 25, 25), w, 1, 1))  # 25 columns
    strided = conv2d_tile_candidates((4, 64, 130, 130), w, 2, 1)
    boxes = [c for c in strided if c.box_w]
    assert strided[0].box_w == 0 and strided[len(strided) - len(boxes) :] == boxes
    want = [(bm, min(bn, 64), warps, stages) for bm, bn, warps, stages in STRIDED_BOX_TILES]  # 64 output channels
    assert [(c.block_m, c.block_n, c.num_warps, c.num_stages) for c in boxes] == want
    problem = Problem(4 * 65 * 65, 64, 576, 1, 4, "tf32")
    assert pick("conv2d_act", strided, problem).box_w == 0, "the cost model does not model boxes: it must not pick one"
    assert all(c.box_w == 0 for c in conv2d_tile_candidates((4, 64, 131, 130), w, 2, 1))  # odd height at stride 2
    assert all(c.box_w == 0 for c in conv2d_tile_candidates((3, 64, 130, 130), w, 2, 1))  # 12675 pixels
    w32 = pack_conv_weight(torch.randn(64, 32, 3, 3), "tf32")
    assert all(c.box_w == 0 for c in conv2d_tile_candidates((3, 32, 75, 77), w32, 1, 1))  # 32 channels
    assert boxes_by_default(BOX_MIN_ROWS, 64, (1, 1), 64) and not boxes_by_default(BOX_MIN_ROWS - 1, 64, (1, 1), 64)


def test_box_candidates_shape() -> None:
    assert box_width(80) == 16 and box_width(64) == 16 and box_width(63) == 8 and box_width(7) == 8
    for config in box_candidates(64, 64, 80, 1, 2):
        assert config.block_k == 64 and config.block_n == 64 and config.box_w == 16
        assert config.block_m % config.box_w == 0
    assert box_candidates(64, 64, 80, 1, 2)[0] == TileConfig(128, 64, 64, 8, 8, 3, box_w=16)  # measured fastest
    assert {c.block_k for c in box_candidates(48, 96, 65, 2, 4)} == {16}  # 48 channels, stride 2: blocks of 16
    assert {c.block_k for c in box_candidates(24, 96, 65, 1, 4)} == {32}  # stride 1: the last block zero-filled
    assert {c.block_n for c in box_candidates(512, 512, 7, 1, 2)} <= {64, 128, 256}
