"""Kernel variants in the interpreter against float64: split-K, every tile candidate of small grids,
the dot precision a launch really gets, and the kernel each conv is routed to."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from accuracy import assert_close
from kernels_reference import ConvCase, conv_inputs, conv_reference, gemm_reference, record_launches
from triton.runtime import interpreter

from fuser.kernels import Activation, Epilogue, Residual, conv2d_act, gemm_act, pack_conv_weight, pack_gemm_weight
from fuser.kernels.autotune import TileConfig
from fuser.kernels.conv import conv2d_tile_candidates, conv_candidates
from fuser.kernels.conv_choice import ConvKernel, conv_kernel
from fuser.kernels.gemm import gemm_candidates
from fuser.kernels.splitk import split_k_candidates, split_k_for, wave_fill

SILU_ADD = Epilogue(Activation.SILU, residual=Residual.AFTER_ACT)


def conv_call(
    case: ConvCase,
    epilogue: Epilogue,
    precision: str = "ieee",
    tile: TileConfig | None = None,
    path: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    x, w, b, residual = conv_inputs(case, epilogue)
    out = conv2d_act(
        x, pack_conv_weight(w, precision, groups=case.groups), b, stride=case.stride, padding=case.padding,
        dilation=case.dilation, epilogue=epilogue, residual=residual, interpret=True, path=path, tile=tile,
    )  # fmt: skip
    return out, conv_reference(x, w, b, case, epilogue, residual)


def gemm_call(
    a: torch.Tensor, n: int, epilogue: Epilogue, tile: TileConfig | None = None, path: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, a.shape[-1]) / a.shape[-1] ** 0.5
    b = torch.randn(n)
    residual = torch.randn(*a.shape[:-1], n) if epilogue.residual != Residual.NONE else None
    out = gemm_act(
        a, pack_gemm_weight(w, "ieee"), b, epilogue=epilogue, residual=residual, interpret=True, path=path, tile=tile
    )
    return out, gemm_reference(a, w, b, epilogue, residual)


# Channel blocks (27 steps of 16 channels), flat K (3 steps of 16), grouped (in either order), and a non-square
# stride / dilation; split counts that divide the steps unevenly and (5 on flat K) leave splits empty.
# (Channel counts whose blocks pad more than a quarter, as 40 or 19, take flat K: conv_choice.FLAT_K_PAD_ABOVE.)
SPLIT_CASES = [
    ConvCase("cblock_c48_b1", 1, 48, 37, (5, 7), 3, padding=(1, 1, 1, 1)),
    ConvCase("flat_c5", 1, 5, 11, (7, 9), 3, padding=(1, 1, 1, 1)),
    ConvCase("grouped_c48_g2", 1, 48, 22, (5, 7), 3, padding=(0, 1, 1, 0), groups=2),
    ConvCase("grouped_flat_c40_g2", 1, 40, 22, (5, 7), 3, padding=(0, 1, 1, 0), groups=2),  # 20 per group pad 37.5%
    ConvCase("s12_d21_c25_b3", 3, 25, 13, (9, 11), 3, stride=(1, 2), padding=(2, 2, 1, 1), dilation=(2, 1)),
    ConvCase("s12_d21_flat_c19", 2, 19, 13, (9, 11), 3, stride=(1, 2), padding=(2, 2, 1, 1), dilation=(2, 1)),
]


REDUCE = "_split_k_reduce_kernel"


def reduce_in(monkeypatch: pytest.MonkeyPatch, where: str) -> list[str]:
    """Where the split partials are added: "tail" (each tile's last program) or "kernel" (the reduction
    kernel, forced by allowing the tail no bytes). Returns the kernels a split launch runs besides the
    split kernel. The plans made so far are forgotten: they hold the choice."""
    from fuser.kernels import autotune, splitk

    autotune._clear_plans()
    if where == "kernel":
        monkeypatch.setattr(splitk, "TAIL_MAX_BYTES", 0)
        return [REDUCE]
    return []


@pytest.mark.parametrize("where", ["tail", "kernel"])
@pytest.mark.parametrize("split_k", [2, 3, 5])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
def test_conv_split_k(monkeypatch: pytest.MonkeyPatch, case: ConvCase, split_k: int, where: str) -> None:
    reduction = reduce_in(monkeypatch, where)
    seen = record_launches(monkeypatch)
    out, ref = conv_call(case, SILU_ADD, tile=TileConfig(32, 32, 16, 2, 4, 1, split_k=split_k))
    assert [name for name, _ in seen] == ["_conv2d_act_kernel", *reduction]
    assert seen[0][1]["SPLIT_K"] == split_k and seen[0][1]["SPLIT_TAIL"] == (where == "tail")
    assert_close(out, ref, "ieee", f"{case} split_k={split_k}")


def test_conv_split_k_descriptor_path_and_fixed_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Descriptor loads with a split store; two runs of one shape give the same bits (ordered sum), and
    the tile's last program adds the same bits as the reduction kernel (the same order)."""
    case = ConvCase("aligned_c32", 1, 32, 16, (5, 7), 3, padding=(1, 1, 1, 1))
    tile = TileConfig(32, 16, 16, 2, 4, 1, split_k=3)
    epilogue = Epilogue(Activation.GELU, residual=Residual.BEFORE_ACT)
    torch.manual_seed(3)
    first, ref = conv_call(case, epilogue, tile=tile, path="descriptor")
    torch.manual_seed(3)
    again, _ = conv_call(case, epilogue, tile=tile, path="descriptor")
    assert_close(first, ref, "ieee", "descriptor split-K")
    assert torch.equal(first, again)
    reduce_in(monkeypatch, "kernel")
    torch.manual_seed(3)
    by_kernel, _ = conv_call(case, epilogue, tile=tile, path="descriptor")
    assert torch.equal(first, by_kernel)


@pytest.mark.parametrize("where", ["tail", "kernel"])
@pytest.mark.parametrize("path", ["pointer", "descriptor"])
@pytest.mark.parametrize("split_k", [2, 3])
def test_gemm_split_k(monkeypatch: pytest.MonkeyPatch, split_k: int, path: str, where: str) -> None:
    reduction = reduce_in(monkeypatch, where)
    seen = record_launches(monkeypatch)
    a = torch.randn(3, 7, 200) if path == "pointer" else torch.randn(21, 200)  # 200 fp32 = 16-byte rows
    epilogue = Epilogue(Activation.TANH, residual=Residual.BEFORE_ACT, scale=0.5)
    out, ref = gemm_call(a, 40, epilogue, tile=TileConfig(16, 32, 32, 1, 4, 1, split_k=split_k), path=path)
    assert [name for name, _ in seen] == ["_gemm_act_kernel", *reduction]
    assert_close(out, ref, "ieee", f"gemm split_k={split_k} {path}")


def test_split_k_for() -> None:
    assert split_k_for(tiles=4, k_steps=144) == 16  # ResNet 512->512 3x3 @7, batch 1: 4 tiles of 128x128
    assert split_k_for(tiles=96, k_steps=24) == 1  # 96 tiles: already most of a wave
    assert split_k_for(tiles=8, k_steps=7) == 1  # too short a reduction to split
    assert split_k_for(tiles=8, k_steps=16) == 4  # each split keeps 4 steps


def test_small_grid_default_is_split() -> None:
    """A handful of tiles on 132 SMs: the default (first) candidate splits K and fills more of the card."""
    for n, k in [(3072, 768), (768, 3072)]:  # BERT-base FFN at 128 tokens, tf32: 24 tiles of 128x128
        default = gemm_candidates(128, n, k, 4)[0]
        assert wave_fill(-(-128 // default.block_m) * -(-n // default.block_n) * default.split_k) >= 0.7, default
    late = conv_candidates(49, 512, 512, 9 * 512, 4, ConvKernel.IMPLICIT_GEMM, 3, 3)  # ResNet 3x3 @7, batch 1
    assert late[0].split_k > 1
    grid = -(-49 // late[0].block_m) * -(-512 // late[0].block_n) * late[0].split_k
    assert grid >= 64
    big = conv_candidates(32 * 80 * 80, 64, 64, 576, 4, ConvKernel.IMPLICIT_GEMM, 3, 3)
    assert all(c.split_k == 1 for c in big)
    assert split_k_candidates([], 1, 1, lambda c: 1) == []


def test_flat_k_steps_as_wide_as_the_channel_blocks_it_stands_in_for() -> None:
    """Flat K in place of padded channel blocks (80 channels) steps 32 wide on float32 operands, the blocks' own
    width there: a 128x128 tile's three stages then leave room for a second program per SM (kernels/NOTES.md
    version 22). 16-bit operands, and flat K over fewer than FLAT_K_BELOW channels, keep 64-wide steps."""
    from fuser.kernels.tile_heuristic import SMEM_BYTES

    flat = ConvKernel.IMPLICIT_GEMM_FLAT_K
    for m in (6400, 32 * 6400):  # YOLOv8n's detect head @80, batch 1 and 32
        wide = {elem: {c.block_k for c in conv_candidates(m, 80, 80, 720, elem, flat, 3, 3) if c.block_n == 128}
                for elem in (4, 2)}  # fmt: skip
        assert wide == {4: {32}, 2: {64}}, m
    b32 = conv_candidates(32 * 6400, 80, 80, 720, 4, flat, 3, 3)
    tile = next(c for c in b32 if (c.block_m, c.num_stages) == (128, 3))
    assert 2 * tile.num_stages * tile.stage_bytes(4) <= SMEM_BYTES
    assert conv_kernel(5, 16, 1, (3, 3)) == flat  # 5 channels: flat K below FLAT_K_BELOW (rows too short)
    narrow = conv_candidates(32 * 6400, 5, 16, 45, 4, flat, 3, 3)
    assert max(c.block_k for c in narrow) == 64


# Small grids, so every candidate list holds split and small-tile variants: each config must compute
# the same convolution (issue: num_warps / stages are ignored here, the GPU test sweeps those).
SWEEP_CONVS = [
    ConvCase("late_c48_5x7", 1, 48, 37, (5, 7), 3, padding=(1, 1, 1, 1)),  # channel blocks: 48 pads 25%
    ConvCase("late_flat_c15_k5x9", 1, 15, 11, (7, 9), (5, 9), padding=(2, 2, 4, 4)),  # 11 flat-K steps of 64
    # 7 filter rows of 84 weights: too few steps to split, small tiles still listed
    ConvCase("late_rows_c12_k7", 1, 12, 11, (7, 9), 7, padding=(3, 3, 3, 3)),
]


def candidates_of(case: ConvCase) -> list[TileConfig]:
    packed = pack_conv_weight(torch.randn(case.c_out, case.c_in // case.groups, *case.kernel_hw), "ieee", case.groups)
    x_shape = (case.batch, case.c_in, *case.hw)
    return conv2d_tile_candidates(x_shape, packed, case.stride, case.padding, case.dilation)


@pytest.mark.parametrize("case", SWEEP_CONVS, ids=str)
def test_every_conv_candidate(case: ConvCase) -> None:
    configs = candidates_of(case)
    assert any(c.split_k > 1 for c in configs) == ("rows" not in case.name)
    assert any(c.block_m == 32 for c in configs)
    for config in configs:
        torch.manual_seed(5)
        out, ref = conv_call(case, SILU_ADD, tile=config)
        assert_close(out, ref, "ieee", f"{case} {config}")


@pytest.mark.parametrize("mkn", [(7, 600, 45), (33, 520, 37)], ids=lambda t: "x".join(map(str, t)))
def test_every_gemm_candidate(mkn: tuple[int, int, int]) -> None:
    m, k, n = mkn
    configs = gemm_candidates(m, n, k, 4)
    assert any(c.split_k > 1 for c in configs)
    for config in configs:
        torch.manual_seed(6)
        out, ref = gemm_call(torch.randn(m, k), n, SILU_ADD, tile=config)
        assert_close(out, ref, "ieee", f"{mkn} {config}")


def record_dot_precision(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ``input_precision`` every interpreted ``tl.dot`` receives (the interpreter then ignores it)."""
    seen: list[str] = []
    real = interpreter.InterpreterBuilder.create_dot

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, *rest: Any) -> Any:
        seen.append(getattr(input_precision, "name", str(input_precision)))
        return real(self, a, b, d, input_precision, *rest)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    return seen


@pytest.mark.parametrize(("precision", "expected"), [("tf32", "TF32"), ("tf32x3", "TF32x3"), ("ieee", "IEEE")])
def test_dot_precision_reaches_the_dot(monkeypatch: pytest.MonkeyPatch, precision: str, expected: str) -> None:
    """tf32 must reach tl.dot as TF32 (not IEEE, which the interpreter would compute identically) on the
    implicit GEMM, the 1x1 GEMM, a split-K launch and a linear layer."""
    seen = record_dot_precision(monkeypatch)
    convs = [
        (ConvCase("c19_3x3", 1, 19, 13, (7, 9), 3, padding=(1, 1, 1, 1)), None),
        (ConvCase("pointwise", 1, 19, 13, (7, 9), 1), None),
        (ConvCase("c19_split", 1, 19, 13, (7, 9), 3), TileConfig(32, 16, 16, 2, 4, 1, split_k=2)),
    ]
    for case, tile in convs:
        seen.clear()
        out, ref = conv_call(case, SILU_ADD, precision, tile=tile)
        assert seen and set(seen) == {expected}, f"{case}: dots got {sorted(set(seen))}, expected {expected}"
        assert_close(out, ref, precision, str(case))
    seen.clear()
    a = torch.randn(7, 45)
    gemm_act(a, pack_gemm_weight(torch.randn(13, 45), precision), interpret=True)
    assert seen and set(seen) == {expected}


# The report's kernel name against the kernel the launcher runs, for each routing rule and its edges:
# the RGB stem (direct, not implicit GEMM), a padded 1x1 (implicit GEMM, not the 1x1 GEMM), a 1x1 with 3
# input channels (direct), a strided 1x1, depthwise, flat K (few channels, or channel blocks padding more than a
# quarter of their lanes) and channel blocks.
ROUTES = {
    "stem_3x3_s2": (dict(in_channels=3, out_channels=16, kernel_size=3, stride=2, padding=1), ConvKernel.DIRECT),
    "padded_1x1": (dict(in_channels=19, out_channels=7, kernel_size=1, padding=1), ConvKernel.IMPLICIT_GEMM),
    "pointwise": (dict(in_channels=19, out_channels=7, kernel_size=1), ConvKernel.GEMM_1X1),
    "pointwise_c3": (dict(in_channels=3, out_channels=7, kernel_size=1), ConvKernel.DIRECT),
    "strided_1x1": (dict(in_channels=5, out_channels=7, kernel_size=1, stride=(1, 2)), ConvKernel.IMPLICIT_GEMM_FLAT_K),
    "depthwise": (dict(in_channels=5, out_channels=5, kernel_size=3, padding=1, groups=5), ConvKernel.DEPTHWISE),
    "flat_k_c5": (dict(in_channels=5, out_channels=7, kernel_size=3, padding=1), ConvKernel.IMPLICIT_GEMM_FLAT_K),
    "cblock_c24": (dict(in_channels=24, out_channels=7, kernel_size=3, dilation=(1, 2)), ConvKernel.IMPLICIT_GEMM),
    "flat_k_padded_c37": (
        dict(in_channels=37, out_channels=7, kernel_size=3, padding=1),
        ConvKernel.IMPLICIT_GEMM_FLAT_K,
    ),
    "rows_7x7_c3": (
        dict(in_channels=3, out_channels=9, kernel_size=7, stride=2, padding=3),
        ConvKernel.IMPLICIT_GEMM_ROW_RUNS,
    ),
    "rows_5x5_c5_dilated": (
        dict(in_channels=5, out_channels=6, kernel_size=5, padding=(3, 2), dilation=(2, 1)),
        ConvKernel.IMPLICIT_GEMM_ROW_RUNS,
    ),
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_report_names_the_launched_kernel(monkeypatch: pytest.MonkeyPatch, route: str) -> None:
    from toy_models import seeded

    import fuser

    conv, expected = ROUTES[route]
    c_in, c_out = conv.pop("in_channels"), conv.pop("out_channels")
    model = seeded(
        torch.nn.Sequential(
            torch.nn.Conv2d(c_in, c_out, bias=False, **conv), torch.nn.BatchNorm2d(c_out), torch.nn.SiLU()
        )
    )
    x = torch.randn(1, c_in, 9, 11)
    seen = record_launches(monkeypatch)
    opt = fuser.optimize(model, (x,), backend="interpret", precision="ieee")
    with torch.no_grad():
        out = opt(x)
    (entry,) = [e for e in opt.fusion_report.entries if e.fused]
    assert entry.kernel == expected.value
    launched = {name for name, _ in seen if name != REDUCE}
    assert launched == {expected.triton_function}, f"report says {entry.kernel}, launched {launched}"
    from accuracy import reference64

    assert_close(out, reference64(model, x), "ieee", route)


def test_conv_kernel_rules() -> None:
    assert conv_kernel(20, 9, 4, (3, 3)) is None  # groups do not divide C_out: the torch reference
    assert conv_kernel(3, 16, 1, (7, 7)) == ConvKernel.IMPLICIT_GEMM_ROW_RUNS  # 147 taps: too many to unroll
    assert conv_kernel(5, 16, 1, (3, 3)) == ConvKernel.IMPLICIT_GEMM_FLAT_K  # rows of 15 weights
    assert conv_kernel(15, 16, 1, (1, 9)) == ConvKernel.IMPLICIT_GEMM_FLAT_K  # a row of 135: over one K step
    assert conv_kernel(8, 12, 4, (3, 3)) == ConvKernel.DIRECT  # 2 channels per group
    assert conv_kernel(19, 7, 1, (1, 1), padding="same") == ConvKernel.GEMM_1X1
    # channel blocks unless they pad more than a quarter of each tap's lanes (conv_choice.FLAT_K_PAD_ABOVE)
    assert conv_kernel(80, 80, 1, (3, 3)) == ConvKernel.IMPLICIT_GEMM_FLAT_K  # 2 blocks of 64: 37.5% zeros
    assert conv_kernel(160, 80, 2, (3, 3)) == ConvKernel.IMPLICIT_GEMM_FLAT_K  # 80 per group
    assert conv_kernel(96, 80, 1, (3, 3)) == ConvKernel.IMPLICIT_GEMM  # 25%: not more than a quarter
    assert conv_kernel(64, 80, 1, (3, 3)) == ConvKernel.IMPLICIT_GEMM
    assert conv_kernel(24, 80, 1, (3, 3)) == ConvKernel.IMPLICIT_GEMM  # one block of 32, 25%
    assert conv_kernel(80, 80, 1, (1, 1), padding=1) == ConvKernel.IMPLICIT_GEMM  # one tap: flat K pads alike
    assert conv_kernel(80, 80, 1, (1, 1)) == ConvKernel.GEMM_1X1
    assert not ConvKernel.DIRECT.tensor_cores and ConvKernel.GEMM_1X1.tensor_cores


def test_split_counters_are_back_at_zero_after_each_launch() -> None:
    """The last program of each tile sets its arrival counter back to zero: a second launch of the same
    plan (a CUDA graph's replay) counts from zero again and reduces, with the same bits."""
    from fuser.kernels.splitk import SPLIT_COUNTERS

    case = ConvCase("c19_b2", 2, 19, 13, (7, 9), 3, padding=(1, 1, 1, 1))
    tile = TileConfig(32, 16, 16, 2, 4, 1, split_k=3)
    outs = []
    for _ in range(2):
        torch.manual_seed(5)
        out, ref = conv_call(case, SILU_ADD, tile=tile)
        outs.append(out)
        chunk, used = SPLIT_COUNTERS._chunks[torch.device("cpu")]
        assert used > 0 and not chunk.any(), "a counter was left non-zero"
    assert_close(outs[0], ref, "ieee", "split-K, first launch")
    assert torch.equal(outs[0], outs[1])


def test_counter_arena_hands_out_disjoint_zeroed_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    from fuser.kernels import splitk

    monkeypatch.setattr(splitk, "COUNTER_CHUNK", 12)
    arena = splitk.CounterArena()
    cpu = torch.device("cpu")
    arena.prewarm(cpu)
    first, second = arena.take(cpu, 6), arena.take(cpu, 3)
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()  # one chunk
    first.fill_(1)
    assert not second.any() and second.data_ptr() == first.data_ptr() + 8 * 4  # 16-byte aligned
    third = arena.take(cpu, 2)  # 8 + 4 + 2 > 12: a new chunk
    assert third.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() and not third.any()
    assert arena.take(cpu, 25).numel() == 25  # larger than a chunk


@pytest.mark.parametrize(("m", "n"), [(49, 512), (49, 2048), (6400, 256), (1, 24), (196, 1024)])
def test_split_reduce_tile_fills_the_card_on_small_outputs(m: int, n: int) -> None:
    """Two programs per SM where the output allows it, the smallest tile where it does not, and the
    default tile on outputs that fill the card with it."""
    from fuser.kernels.splitk import REDUCE_PROGRAMS, REDUCE_TILE, reduce_tile

    programs = lambda t: -(-m // t.block_m) * -(-n // t.block_n)
    tile = reduce_tile(m, n)
    if programs(REDUCE_TILE) >= REDUCE_PROGRAMS:
        assert tile == REDUCE_TILE
    else:
        assert programs(tile) >= REDUCE_PROGRAMS or (tile.block_m, tile.block_n) == (8, 32)
        assert tile.block_m * tile.block_n >= 256 or tile.num_warps == 1


def test_the_tail_reduces_only_small_partials() -> None:
    from fuser.kernels.splitk import TAIL_MAX_BYTES, reduces_in_tail

    assert reduces_in_tail(TileConfig(64, 64, 32, 8, 4, 3, split_k=4))  # 64 KiB of partials
    assert not reduces_in_tail(TileConfig(64, 64, 32, 8, 4, 3, split_k=8))
    assert not reduces_in_tail(TileConfig(128, 128, 32, 8, 4, 3, split_k=2))
    assert TAIL_MAX_BYTES == 64 * 1024
