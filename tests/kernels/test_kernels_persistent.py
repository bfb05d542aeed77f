"""Persistent grids of the implicit GEMM (TileConfig.persistent, conv.py) in the interpreter: a few programs per
"SM" (the interpreter counts 3) each walk several whole output tiles, on row tiles, box tiles and shifted taps,
against float64 on odd shapes whose tile counts the programs do not divide.

No candidate list offers a persistent grid until the GPU has measured it; these tests force it, as
benchmarks/conv_tile_sweep.py does."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from accuracy import assert_close
from kernels_reference import ConvCase, conv_inputs, conv_output_hw, conv_reference, record_launches

from fuser.kernels import Activation, Epilogue, Residual, conv2d_act, pack_conv_weight
from fuser.kernels.autotune import TileConfig
from fuser.kernels.launch import cdiv
from fuser.kernels.splitk import STREAM_K_INTERPRETER_SMS

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
