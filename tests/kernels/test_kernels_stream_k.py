"""Stream-K tiles of the implicit GEMM (conv.py, splitk.stream_k_grid) in the interpreter: every program runs an
equal run of the reduction steps of all output tiles, a tile whose steps several programs share is summed by
the last of them. Against float64 on odd shapes whose runs cross tile boundaries, in each reduction order.

No candidate list offers stream-K (kernels/NOTES.md version 13: measured no faster than split-K); these tests
force it, as benchmarks/conv_tile_sweep.py does."""

from __future__ import annotations

import pytest
import torch
from accuracy import assert_close
from kernels_reference import ConvCase, conv_inputs, conv_output_hw, conv_reference, record_launches

from fuser.kernels import Activation, Epilogue, Residual, conv2d_act, pack_conv_weight
from fuser.kernels.autotune import TileConfig
from fuser.kernels.conv import reduction_step_count
from fuser.kernels.conv_choice import reduction_order
from fuser.kernels.launch import cdiv
from fuser.kernels.splitk import STREAM_K_INTERPRETER_SMS, stream_k_grid

SILU_ADD = Epilogue(Activation.SILU, residual=Residual.AFTER_ACT)

# (case, stream_k): 3 programs per stream_k (the interpreter's SM count) over tiles of 32 x 16 whose step counts
# the runs do not divide.
STREAM_CASES = [
    (ConvCase("c20_7x7", 1, 20, 24, (7, 7), 3, padding=(1, 1, 1, 1)), 1),
    (ConvCase("c37_s2_odd", 2, 37, 24, (11, 9), 3, stride=2, padding=(1, 0, 1, 1)), 1),
    (ConvCase("c24_many_slots", 1, 24, 40, (9, 7), 3, padding=(1, 1, 0, 2)), 5),
    (ConvCase("flat_c5", 2, 5, 24, (9, 11), 3, padding=(1, 1, 1, 1)), 2),
    (ConvCase("rows_c8", 1, 8, 24, (10, 9), 3, padding=(1, 1, 1, 1)), 5),
]


def programs_per_tile(tiles: int, steps: int, programs: int) -> list[int]:
    """How many programs share each tile when runs of ``cdiv(tiles * steps, programs)`` steps are dealt out."""
    per = cdiv(tiles * steps, programs)
    return [((t + 1) * steps - 1) // per - t * steps // per + 1 for t in range(tiles)]


def shared_tiles(case: ConvCase, config: TileConfig) -> tuple[int, int, int]:
    """(tiles whose steps two or more programs share, most programs on one tile, the launch's slots)."""
    oh, ow = conv_output_hw(case)
    tiles = cdiv(case.batch * oh * ow, config.block_m) * cdiv(case.c_out, config.block_n)
    steps = reduction_step_count(reduction_order(case.c_in, 3, 3), (3, 3), case.c_in, case.c_in * 9, config.block_k)
    programs, slots = stream_k_grid(config, tiles, steps, STREAM_K_INTERPRETER_SMS)
    counts = programs_per_tile(tiles, steps, programs)
    return sum(c > 1 for c in counts), max(counts), slots


def stream_call(case: ConvCase, precision: str, dtype: torch.dtype, config: TileConfig, **kwargs):
    x, w, b, residual = conv_inputs(case, SILU_ADD, dtype)
    packed = pack_conv_weight(w, precision)
    run = lambda: conv2d_act(x, packed, b, stride=case.stride, padding=case.padding, epilogue=SILU_ADD,
                             residual=residual, interpret=True, tile=config, **kwargs)  # fmt: skip
    scale = kwargs.get("input_scale")
    ref = conv_reference(x if scale is None else x * scale, w, b, case, SILU_ADD, residual)
    return run, ref


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("ieee", torch.float32), ("tf32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)],
    ids=["ieee", "tf32", "fp16", "bf16"],
)
@pytest.mark.parametrize(("case", "stream_k"), STREAM_CASES, ids=[str(c) for c, _ in STREAM_CASES])
def test_stream_k_matches_float64(monkeypatch: pytest.MonkeyPatch, case: ConvCase, stream_k: int, precision, dtype):
    config = TileConfig(32, 16, 16, 2, 4, 1, stream_k=stream_k)
    shared, most, slots = shared_tiles(case, config)
    assert shared > 0 and most <= slots, f"{case}: the case does not exercise shared tiles ({shared}, {most}, {slots})"
    seen = record_launches(monkeypatch)
    run, ref = stream_call(case, precision, dtype, config)
    out = run()
    assert [(name, kwargs["STREAM_K"]) for name, kwargs in seen] == [("_conv2d_act_kernel", True)]
    assert_close(out, ref, precision, f"{case} stream-K {stream_k}")


def test_stream_k_is_deterministic_and_resets_its_counters() -> None:
    """A second launch of the same plan finds its arrival counters at zero again (else its shared tiles would
    never finish) and adds the shared tiles' partial sums in the same order: the same bits."""
    case, stream_k = STREAM_CASES[2]
    run, ref = stream_call(case, "ieee", torch.float32, TileConfig(32, 16, 16, 2, 4, 1, stream_k=stream_k))
    first, second = run(), run()
    assert torch.equal(first, second)
    assert_close(second, ref, "ieee", "second launch")


def test_stream_k_with_the_channel_scale_prologue() -> None:
    case = ConvCase("c20_se", 2, 20, 24, (7, 9), 3, padding=(1, 1, 1, 1))
    scale = torch.rand(2, 20, 1, 1) + 0.5
    run, ref = stream_call(case, "fp16", torch.float16, TileConfig(32, 16, 16, 2, 4, 1, stream_k=1),
                           input_scale=scale.half())  # fmt: skip
    assert_close(run(), ref, "fp16", "stream-K with the SE scale")


@pytest.mark.parametrize(
    ("tile", "groups", "reason"),
    [(TileConfig(32, 16, 16, stream_k=1, split_k=2), 1, "split_k=2"),
     (TileConfig(32, 16, 16, stream_k=1), 2, "groups=2")],
    ids=["split", "grouped"],
)  # fmt: skip
def test_stream_k_refuses_what_it_cannot_deal(tile: TileConfig, groups: int, reason: str) -> None:
    case = ConvCase("c32", 1, 32, 32, (9, 9), 3, padding=(1, 1, 1, 1), groups=groups)
    x, w, b, _ = conv_inputs(case, Epilogue(Activation.RELU))
    with pytest.raises(ValueError, match=f"stream-K .*{reason}"):
        conv2d_act(x, pack_conv_weight(w, "ieee", groups=groups), b, padding=1, epilogue=Epilogue(Activation.RELU),
                   interpret=True, tile=tile)  # fmt: skip


def test_stream_k_grid_bounds_the_programs_on_one_tile() -> None:
    for tiles, steps, sms in [(100, 36, 132), (52, 144, 132), (7, 5, 3), (1, 1, 132), (13, 17, 11)]:
        for stream_k in (1, 2):
            programs, slots = stream_k_grid(TileConfig(128, 128, 32, stream_k=stream_k), tiles, steps, sms)
            most = max(programs_per_tile(tiles, steps, programs))
            assert programs <= stream_k * sms and programs <= tiles * steps and most <= slots
