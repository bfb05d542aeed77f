"""Shifted taps of the implicit GEMM (kernels/conv_boxes.py, ``TileConfig.tap_shift``) in the
interpreter: the input copied into a zero-bordered buffer, each filter tap's activation tile one 2-D descriptor
load of consecutive bordered pixels with no mask; against float64 on odd shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from accuracy import assert_close
from kernels_reference import ConvCase, conv_inputs, conv_reference, record_launches

from fuser.kernels import Activation, Epilogue, Residual, autotune, conv2d_act, pack_conv_weight, tile_table
from fuser.kernels.autotune import TileConfig
from fuser.kernels.conv import conv2d_tile_candidates
from fuser.kernels.conv_boxes import SHIFT_MAX_PIXELS
from fuser.kernels.splitk import SM_COUNT, split_shifted_twins
from fuser.kernels.tile_config import Problem

SILU_ADD = Epilogue(Activation.SILU, residual=Residual.AFTER_ACT)
SHIFT_TILE = TileConfig(32, 16, 16, 2, 4, 1, tap_shift=1)

# Output the input's size, stride 1: odd sizes (tiles crossing rows and images, the first tile's taps before
# the buffer's first row, the last tile's past its end), padding only on the top and left (the borders the
# buffer has), a 5x5 and a 1x3 filter, small images that a 32-pixel tile spans several of, and channel counts
# that leave the last channel block partly past C (the descriptor's zero fill). Output channels are multiples
# of 8: 16-byte rows in 16-bit dtypes, as the descriptor path needs.
SHIFT_CASES = [
    ConvCase("c24_odd", 2, 24, 24, (11, 13), 3, padding=(1, 1, 1, 1)),
    ConvCase("c48_top_left", 1, 48, 24, (9, 7), 3, padding=(2, 0, 2, 0)),  # 48: channel blocks (40 is flat K)
    ConvCase("k5_c16", 1, 16, 56, (9, 11), 5, padding=(2, 2, 2, 2)),
    ConvCase("k1x3_c32", 2, 32, 16, (7, 9), (1, 3), padding=(0, 0, 1, 1)),
    ConvCase("small_images_c16", 5, 16, 24, (5, 3), 3, padding=(1, 1, 1, 1)),
]


def shift_call(case: ConvCase, precision: str, dtype: torch.dtype, tile: TileConfig, **kwargs):
    x, w, b, residual = conv_inputs(case, SILU_ADD, dtype)
    out = conv2d_act(
        x, pack_conv_weight(w, precision), b, stride=case.stride, padding=case.padding, dilation=case.dilation,
        epilogue=SILU_ADD, residual=residual, interpret=True, tile=tile, **kwargs,
    )  # fmt: skip
    return out, conv_reference(x, w, b, case, SILU_ADD, residual)


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("ieee", torch.float32), ("tf32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)],
    ids=["ieee", "tf32", "fp16", "bf16"],
)
@pytest.mark.parametrize("case", SHIFT_CASES, ids=str)
def test_shifted_taps_match_float64(
    monkeypatch: pytest.MonkeyPatch, case: ConvCase, precision: str, dtype: torch.dtype, split_k: int
) -> None:
    seen = record_launches(monkeypatch)
    tile = TileConfig(32, 16, 16, 2, 4, 1, split_k=split_k, tap_shift=1)
    out, ref = shift_call(case, precision, dtype, tile)
    assert ("_conv2d_act_kernel", True) in [(name, kwargs.get("TAP_SHIFT")) for name, kwargs in seen]
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_close(out, ref, precision, f"{case} shifted taps, split {split_k}")


REFUSED = {
    "stride 2": (ConvCase("s2", 1, 16, 16, (10, 10), 3, stride=2, padding=(1, 1, 1, 1)), "stride 1"),
    "output smaller": (ConvCase("valid", 1, 16, 16, (9, 9), 3), "the input's size"),
    "wider bottom": (ConvCase("bottom", 1, 16, 16, (9, 9), 3, padding=(0, 2, 1, 1)), "bottom <= top"),
    "dilation": (ConvCase("dil", 1, 16, 16, (9, 9), 3, padding=(2, 2, 2, 2), dilation=2), "undilated"),
    "groups": (ConvCase("grouped", 1, 32, 32, (9, 9), 3, padding=(1, 1, 1, 1), groups=2), "ungrouped"),
}


@pytest.mark.parametrize("what", REFUSED)
def test_shifted_taps_name_what_rules_them_out(what: str) -> None:
    case, reason = REFUSED[what]
    x, w, b, _ = conv_inputs(case, SILU_ADD, torch.float16)
    with pytest.raises(ValueError, match=f"shifted taps .*{reason}"):
        conv2d_act(x, pack_conv_weight(w, "fp16", groups=case.groups), b, stride=case.stride, padding=case.padding,
                   dilation=case.dilation, interpret=True, tile=SHIFT_TILE)  # fmt: skip


def test_shifted_taps_refuse_other_inputs_and_tiles() -> None:
    case = ConvCase("c16", 1, 16, 16, (9, 9), 3, padding=(1, 1, 1, 1))
    packed = lambda w: pack_conv_weight(w, "ieee")
    x, w, b, _ = conv_inputs(case, SILU_ADD, channels_last=False)
    call = lambda tile, **kwargs: conv2d_act(x, packed(w), b, padding=1, interpret=True, tile=tile, **kwargs)
    with pytest.raises(ValueError, match=r"shifted taps .*dense channels_last"):
        call(SHIFT_TILE)
    x, w, b, _ = conv_inputs(case, SILU_ADD)
    with pytest.raises(ValueError, match=r"shifted taps .*pointer path"):
        call(SHIFT_TILE, path="pointer")
    with pytest.raises(ValueError, match=r"shifted taps .*prologue"):
        call(SHIFT_TILE, input_scale=torch.rand(1, 16, 1, 1) + 0.5)
    with pytest.raises(ValueError, match=r"shifted taps .*rows or a box"):
        call(TileConfig(32, 16, 16, 2, 4, 1, box_w=8, tap_shift=1))
    with pytest.raises(ValueError, match=r"stream-K .*tap_shift=1"):
        call(TileConfig(32, 16, 16, 2, 4, 1, stream_k=1, tap_shift=1))


def late_layer_candidates(
    size: int, stride: int = 1, c: int = 256, batch: int = 32, precision: str = "tf32"
) -> list[TileConfig]:
    dtype = torch.float16 if precision == "fp16" else torch.float32
    packed = pack_conv_weight(torch.randn(c, c, 3, 3).to(dtype), precision)
    return conv2d_tile_candidates((batch, c, size, size), packed, stride, (1, 1, 1, 1))


def test_small_images_list_the_shifted_twins_after_the_row_tiles() -> None:
    candidates = late_layer_candidates(19)
    rows = [c for c in candidates if not c.tap_shift]
    twins = [c for c in candidates if c.tap_shift]
    assert rows and candidates[: len(rows)] == rows, "the row tiles come first: the default stays a row tile"
    expected = [dataclasses.replace(c, tap_shift=1) for c in rows if not (c.box_w or c.stream_k)]
    assert twins[: len(expected)] == expected
    under_a_wave = lambda c: -(-32 * 19 * 19 // c.block_m) * -(-256 // c.block_n) < SM_COUNT
    splits = [dataclasses.replace(c, split_k=2) for c in expected if c.split_k == 1 and under_a_wave(c)]
    assert twins[len(expected) :] == [c for c in dict.fromkeys(splits) if c not in expected]
    assert not any(c.tap_shift for c in late_layer_candidates(39)), f"{SHIFT_MAX_PIXELS} pixels at most"
    assert not any(c.tap_shift for c in late_layer_candidates(19, stride=2)), "stride 2 reads no shifted rows"


def test_the_shipped_table_picks_shifted_taps_only_where_they_ran_fastest() -> None:
    """results/conv-tile-sweep-2026-12-03e.json (the bordered copy one launch): at batch 32, 256->256 @20 ran
    fastest on shifted tiles (tf32: 128x256, 64.9 us copy included, against 82.3 for the best row tile; fp16:
    256x128, 38.2 against 46.7), ResNet's 512->512 @7 in tf32 on the shifted 64x128 split in two (36.1 against
    49.3); at batch 8 nothing was swept, and the row tiles stay."""
    tile_table.forget_loaded()
    chosen = {}
    for c, size, elem, precision, batch in [(256, 20, 4, "tf32", 32), (512, 7, 4, "tf32", 32),
                                            (256, 20, 2, "fp16", 32), (256, 20, 4, "tf32", 8)]:  # fmt: skip
        candidates = late_layer_candidates(size, c=c, precision=precision, batch=batch)
        problem = Problem(batch * size * size, c, 9 * c, 1, elem, precision)
        chosen[(c, precision, batch)] = autotune.default_config("conv2d_act", candidates, problem, "sm90")
    assert chosen[(256, "tf32", 32)] == TileConfig(128, 256, 32, 8, 8, 3, tap_shift=1)
    assert chosen[(512, "tf32", 32)] == TileConfig(64, 128, 32, 8, 4, 4, split_k=2, tap_shift=1)
    assert chosen[(256, "fp16", 32)] == TileConfig(256, 128, 64, 8, 8, 3, tap_shift=1)
    assert not chosen[(256, "tf32", 8)].tap_shift


def test_shifted_twins_under_a_wave_get_their_split_in_two() -> None:
    """Only shifted tiles, unsplit, whose grid leaves SMs idle and whose reduction is long get a split twin."""
    steps = lambda c: 9 * -(-512 // c.block_k)
    small = TileConfig(64, 128, 32, 8, 4, 4, tap_shift=1)  # 25 x 4 tiles on M = 1568, N = 512
    full = TileConfig(32, 64, 32, 8, 4, 3, tap_shift=1)  # 49 x 8 tiles
    row = TileConfig(64, 128, 32, 8, 4, 4)
    listed = split_shifted_twins([row, small, full], 1568, 512, steps)
    assert listed == [row, small, full, dataclasses.replace(small, split_k=2)]
    assert split_shifted_twins([small], 1568, 512, lambda c: 9) == [small], "a short reduction is not split"
