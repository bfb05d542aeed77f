"""Persistent grids of the implicit GEMM (TileConfig.persistent, conv.py) in the interpreter: a few programs per
"SM" (the interpreter counts 3) each walk several whole output tiles, on row tiles, box tiles and shifted taps,
against float64 on odd shapes whose tile counts the programs do not divide.

These tests force it, as benchmarks/conv_tile_sweep.py does; the candidate lists offer it on grids of many tiles
(conv.persistent_twins), which the last tests check."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from accuracy import assert_close
from kernels_reference import ConvCase, conv_inputs, conv_output_hw, conv_reference, record_launches

from fuser.kernels import Activation, Epilogue, Residual, conv2d_act, pack_conv_weight
from fuser.kernels.autotune import Problem, TileConfig
from fuser.kernels.conv import PERSISTENT_PER_SM, conv2d_tile_candidates
from fuser.kernels.launch import cdiv
from fuser.kernels.packing import PackedConvWeight
from fuser.kernels.splitk import STREAM_K_INTERPRETER_SMS
from fuser.kernels.tile_heuristic import pick

SILU_ADD = Epilogue(Activation.SILU, residual=Residual.AFTER_ACT)
ROWS = TileConfig(32, 16, 16, 2, 4, 1, persistent=1)

# (case, tile): row tiles in each reduction order (channel blocks, flat K, filter rows), two groups, box tiles cut
# by the image's edges, shifted taps over the bordered grid.
PERSISTENT_CASES = [
    (ConvCase("c20_7x7", 1, 20, 24, (7, 7), 3, padding=(1, 1, 1, 1)), ROWS),
    (ConvCase("c37_s2_odd", 2, 37, 24, (11, 9), 3, stride=2, padding=(1, 0, 1, 1)), ROWS),
    (ConvCase("flat_c5", 2, 5, 24, (9, 11), 3, padding=(1, 1, 1, 1)), ROWS),
    (ConvCase("rows_c8", 1, 8, 24, (11, 9), 3, padding=(1, 1, 1, 1)), ROWS),
    (ConvCase("groups2_c32", 1, 32, 48, (9, 7), 3, padding=(1, 1, 1, 1), groups=2), ROWS),
    (ConvCase("box_c24_odd", 2, 24, 24, (13, 13), 3, padding=(1, 1, 1, 1)), dataclasses.replace(ROWS, box_w=8)),
    (ConvCase("shift_c24_odd", 2, 24, 24, (11, 13), 3, padding=(1, 1, 1, 1)), dataclasses.replace(ROWS, tap_shift=1)),
]


def grid_tiles(case: ConvCase, tile: TileConfig) -> int:
    """The output tiles of one group the persistent programs walk: row tiles over the output pixels, boxes per
    image, or row tiles over the zero-bordered images (shifted taps)."""
    oh, ow = conv_output_hw(case)
    if tile.box_w:
        rows = case.batch * cdiv(oh, tile.block_m // tile.box_w) * cdiv(ow, tile.box_w) * tile.block_m
    elif tile.tap_shift:
        rows = case.batch * (oh + case.padding[0]) * (ow + case.padding[2])
    else:
        rows = case.batch * oh * ow
    return cdiv(rows, tile.block_m) * cdiv(case.c_out // case.groups, tile.block_n)


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("ieee", torch.float32), ("tf32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)],
    ids=["ieee", "tf32", "fp16", "bf16"],
)
@pytest.mark.parametrize(("case", "tile"), PERSISTENT_CASES, ids=[str(c) for c, _ in PERSISTENT_CASES])
def test_persistent_grid_matches_float64(
    monkeypatch: pytest.MonkeyPatch, case: ConvCase, tile: TileConfig, precision: str, dtype: torch.dtype
) -> None:
    programs, tiles = STREAM_K_INTERPRETER_SMS * tile.persistent, grid_tiles(case, tile)
    assert tiles > programs and tiles % programs, f"{case}: every program must walk tiles, unevenly ({tiles} tiles)"
    x, w, b, residual = conv_inputs(case, SILU_ADD, dtype)
    seen = record_launches(monkeypatch)
    out = conv2d_act(x, pack_conv_weight(w, precision, groups=case.groups), b, stride=case.stride,
                     padding=case.padding, epilogue=SILU_ADD, residual=residual, interpret=True, tile=tile)  # fmt: skip
    conv_launches = [kwargs for name, kwargs in seen if name == "_conv2d_act_kernel"]
    assert [k["PERSISTENT"] for k in conv_launches] == [True]
    assert_close(out, conv_reference(x, w, b, case, SILU_ADD, residual), precision, f"{case} persistent")


def test_persistent_grid_refuses_split_and_stream_k() -> None:
    """A persistent program walks whole tiles: a split reduction or stream-K with it is refused by name."""
    case = PERSISTENT_CASES[0][0]
    x, w, b, residual = conv_inputs(case, SILU_ADD, torch.float32)
    packed = pack_conv_weight(w, "ieee")
    for other, named in ((dict(split_k=2), "split_k=2 or stream_k=0"), (dict(stream_k=1), "split_k=1 or stream_k=1")):
        with pytest.raises(ValueError, match=rf"persistent=1\) walks whole tiles: not with {named}"):
            conv2d_act(x, packed, b, stride=case.stride, padding=case.padding, epilogue=SILU_ADD, residual=residual,
                       interpret=True, tile=dataclasses.replace(ROWS, **other))  # fmt: skip


def cout_packed(c_in: int, stride: int) -> PackedConvWeight:
    """YOLO's 64 -> 64 (stride 1) or 64 -> 128 (stride 2) 3x3 weight, packed for fp16."""
    return pack_conv_weight(torch.randn(64 * stride, c_in, 3, 3).half(), "fp16")


# (input shape, stride): odd batches and sizes whose grids have over 1024 tiles
MANY_TILES = [((31, 64, 79, 83), 1), ((29, 64, 157, 161), 2)]


@pytest.mark.parametrize(("shape", "stride"), MANY_TILES, ids=[str(c[0]) for c in MANY_TILES])
def test_lists_offer_persistent_twins_last_on_grids_of_many_tiles(
    shape: tuple[int, int, int, int], stride: int
) -> None:
    """Twins on 2 and 3 programs per SM of the 4-warp whole tiles come after every other candidate, so that the
    list's first entry (the untuned default) is not one; the cost model, which gives a twin its original's time,
    never picks one over it."""
    listed = conv2d_tile_candidates(shape, cout_packed(shape[1], stride), stride, (1, 1, 1, 1))
    twins = [c for c in listed if c.persistent]
    others = listed[: len(listed) - len(twins)]
    assert twins and not any(c.persistent for c in others), f"{shape}: twins must come last: {listed}"
    originals = [c for c in others if c.num_warps == 4 and c.split_k == 1 and not c.stream_k]
    assert twins == [dataclasses.replace(c, persistent=p) for c in originals for p in PERSISTENT_PER_SM]
    case = ConvCase("list", shape[0], shape[1], 64 * stride, shape[2:], 3, stride=stride, padding=(1, 1, 1, 1))
    oh, ow = conv_output_hw(case)
    problem = Problem(shape[0] * oh * ow, 64 * stride, 9 * shape[1], 1, 2, "fp16")
    assert not pick("conv2d_act", listed, problem).persistent


def test_lists_offer_no_persistent_twin_on_small_grids() -> None:
    """At batch 1 the same layer has 52 tiles of 128 rows: a persistent grid would only add its loop."""
    listed = conv2d_tile_candidates((1, 64, 79, 83), cout_packed(64, 1), 1, (1, 1, 1, 1))
    assert listed and not any(c.persistent for c in listed), listed
