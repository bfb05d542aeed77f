"""The tile choice without measuring: the cost model (tile_heuristic) and the shipped table (tile_table)
only ever return one of the kernel's own candidates, deterministically, on any shape."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import pytest

from fuser.kernels import autotune, depthwise, tile_heuristic, tile_table
from fuser.kernels.conv import conv_candidates
from fuser.kernels.conv_choice import ConvKernel, reduction_order
from fuser.kernels.depthwise import depthwise_candidates
from fuser.kernels.direct_conv import direct_candidates
from fuser.kernels.gemm import gemm_candidates
from fuser.kernels.tile_config import Problem, TileConfig

ODD_M = [1, 3, 17, 127, 1001, 12799, 10_000_019]
ODD_N = [1, 7, 61, 255, 3071, 50257]
ODD_K = [1, 5, 27, 257, 2305, 1_000_003]
REPO = Path(__file__).resolve().parents[2]
PRECISIONS = [("tf32", 4), ("ieee", 4), ("tf32x3", 4), ("fp16", 2), ("bf16", 2)]


def cases():
    """(kernel, candidates, problem) over odd, tiny and huge shapes for every kernel's candidate list."""
    for m, n, k, (precision, elem) in itertools.product(ODD_M, ODD_N, ODD_K, PRECISIONS):
        yield "gemm_act", gemm_candidates(m, n, k, elem), Problem(m, n, k, 1, elem, precision)
    for m, c_in_g, c_out_g, taps, groups, (precision, elem) in itertools.product(
        ODD_M[:6], [3, 19, 259], [5, 61, 515], [1, 9, 49], [1, 3], PRECISIONS[::2]
    ):
        k_total = c_in_g * taps
        kw = math.isqrt(taps)
        for order in dict.fromkeys(
            (ConvKernel.IMPLICIT_GEMM, ConvKernel.IMPLICIT_GEMM_FLAT_K, reduction_order(c_in_g, kw, kw))
        ):
            candidates = conv_candidates(m, c_in_g, c_out_g, k_total, elem, order, kw, kw)
            yield "conv2d_act", candidates, Problem(m, c_out_g, k_total, groups, elem, precision)
        yield "direct_conv_act", direct_candidates(c_out_g), Problem(m, c_out_g, k_total, groups, elem, precision)
    for m, c, taps in itertools.product(ODD_M, [1, 17, 61, 1001], [1, 9, 25]):
        yield "depthwise_act", depthwise_candidates(c, m), Problem(m, c, taps, 1, 4, "tf32")


def test_every_pick_is_a_candidate_and_deterministic() -> None:
    count = 0
    for kernel, candidates, problem in cases():
        first = tile_heuristic.pick(kernel, candidates, problem)
        assert first in candidates, (kernel, problem)
        assert tile_heuristic.pick(kernel, list(candidates), problem) == first
        assert tile_heuristic.pick(kernel, candidates, problem, sm_count=132) == first
        assert math.isfinite(tile_heuristic.estimate_us(kernel, problem, first)), (kernel, problem, first)
        count += 1
    assert count > 1500


def test_default_config_is_a_candidate_with_or_without_a_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a table whose entries name configs that are not candidates, and without one."""
    monkeypatch.setattr(tile_table, "TABLE_DIR", tmp_path)
    tile_table.forget_loaded()
    entries = {}
    for kernel, candidates, problem in itertools.islice(cases(), 0, None, 37):
        foreign = TileConfig(candidates[0].block_m + 1, 16, 16)
        entries[tile_table.shape_class(kernel, problem)] = {
            "ranked": [{"config": foreign.__dict__}, {"config": {"block_m": 64, "unknown_field": 2}}]
        }
    (tmp_path / "tile_table_sm90.json").write_text(json.dumps({"format": 1, "entries": entries}))
    try:
        for kernel, candidates, problem in itertools.islice(cases(), 0, None, 37):
            for arch in ("sm90", "sm80", None):
                config = autotune.default_config(kernel, candidates, problem, arch)
                assert config == tile_heuristic.pick(kernel, candidates, problem), "no table entry applies"
            assert autotune.default_config(kernel, candidates, None, "sm90") == candidates[0]
    finally:
        tile_table.forget_loaded()


def test_model_agrees_with_the_h200_measurements_it_was_built_from() -> None:
    """kernels/NOTES.md: 128x768x3072 in TF32 was fastest with 64x64 tiles (96 CTAs on 132 SMs); the big
    GEMMs run their full waves on the wide tiles."""
    small = tile_heuristic.pick("gemm_act", gemm_candidates(128, 3072, 768, 4), Problem(128, 3072, 768))
    assert (small.block_m, small.block_n) == (64, 64)
    big = tile_heuristic.pick(
        "gemm_act", gemm_candidates(8192, 16384, 4096, 2), Problem(8192, 16384, 4096, 1, 2, "bf16")
    )
    assert big.block_m * big.block_n == 128 * 256
    assert 2900 < tile_heuristic.estimate_us("gemm_act", Problem(8192, 16384, 4096), big) < 3300  # measured 2.985 ms


def test_a_second_resident_cta_wins_on_the_implicit_gemm() -> None:
    """results/conv-tile-sweep-2026-12-03.json, YOLO's 64->128 3x3 stride 2 at 160x160, batch 32, TF32: 128x128
    tiles at 3 stages (two CTAs per SM) ran 186 us, 256x128 at 3 stages 240 and 128x128 at 4 stages 246 (one CTA
    per SM each). The model ranks them in that order, where without the overlap of two CTAs it took 256x128."""
    problem = Problem(32 * 80 * 80, 128, 576, 1, 4, "tf32")
    candidates = conv_candidates(problem.m, 64, 128, 576, 4, reduction_order(64, 3, 3), 3, 3)
    two, wide = TileConfig(128, 128, 32, 8, 8, 3), TileConfig(256, 128, 32, 8, 8, 3)
    deep = TileConfig(128, 128, 32, 8, 8, 4)
    assert {two, wide, deep} <= set(candidates)
    assert all(c.split_k == 1 for c in candidates), "1600 tiles of 128x128: no split variants"
    assert tile_heuristic.pick("conv2d_act", candidates, problem) == two
    estimate = lambda c: tile_heuristic.estimate_us("conv2d_act", problem, c)
    assert estimate(two) < estimate(wide) < estimate(deep)


def test_split_k_wins_where_the_grid_is_small_and_only_there() -> None:
    plain = TileConfig(64, 64, 32, 8, 4, 4)
    candidates = [plain, *(TileConfig(64, 64, 32, 8, 4, 4, split_k=s) for s in (2, 4, 8))]
    late_batch1 = Problem(400, 256, 2304)  # YOLO's 20x20 layer at batch 1: 28 CTAs of 64x64 on 132 SMs
    assert tile_heuristic.pick("conv2d_act", candidates, late_batch1).split_k > 1
    assert tile_heuristic.pick("conv2d_act", candidates, Problem(32 * 6400, 64, 576)) == plain
    assert tile_heuristic.pick("conv2d_act", candidates, Problem(400, 256, 9)) == plain  # nothing to split


def test_configs_that_cannot_run_are_not_picked() -> None:
    too_big = TileConfig(256, 256, 128, 8, 8, 6)  # 1.5 MiB of shared memory
    fits = TileConfig(32, 32, 32, 8, 4, 2)
    assert tile_heuristic.estimate_us("gemm_act", Problem(4096, 4096, 4096), too_big) == math.inf
    assert tile_heuristic.pick("gemm_act", [too_big, fits], Problem(4096, 4096, 4096)) == fits
    assert tile_heuristic.pick("gemm_act", [too_big], Problem(4096, 4096, 4096)) == too_big  # nothing else: the first
    assert tile_heuristic.pick("a_new_kernel", [fits, too_big], Problem(5, 5, 5)) == fits  # no model: the first
    assert tile_heuristic.pick("gemm_act", [fits], Problem(0, 5, 5)) == fits  # an empty problem


def test_problem_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match=r"Problem\.m"):
        Problem(-1, 2, 3)
    with pytest.raises(ValueError, match=r"Problem\.groups"):
        Problem(1, 2, 3, groups=0)


def _entry(kernel: str, problem: Problem, timings: list[tuple[TileConfig, float | None]]) -> dict:
    return {
        "kernel": kernel,
        "key": "{}",
        "problem": problem.__dict__,
        "timings_ms": [[c.__dict__, t] for c, t in timings],
    }


def test_build_table_ranks_by_geometric_mean_and_drops_failures() -> None:
    a, b, c, d = (TileConfig(bm, 64, 32) for bm in (16, 32, 64, 128))
    p1, p2 = Problem(1000, 60, 300), Problem(1001, 61, 301)  # one shape class
    assert tile_table.shape_class("gemm_act", p1) == tile_table.shape_class("gemm_act", p2)
    other = Problem(100_000, 60, 300)
    entries = [
        _entry("gemm_act", p1, [(a, 1.0), (b, 2.0), (c, 1.1), (d, None)]),  # d failed to compile
        _entry("gemm_act", p2, [(a, 3.0), (b, 1.0), (c, 1.2), (d, 0.5)]),
        _entry("gemm_act", other, [(a, 4.0), (b, 2.0)]),
        {"kernel": "gemm_act", "problem": None, "timings_ms": []},  # measured without a problem: skipped
    ]
    table = tile_table.build_table(entries, "sm90", {"gpu": "test"}, sm_count=132)
    assert table["format"] == 1 and table["arch"] == "sm90" and len(table["entries"]) == 2
    entry = table["entries"][tile_table.shape_class("gemm_act", p1)]
    # geomeans of time / best: a sqrt(1 * 3/0.5)... but d failed on p1, so bests are 1.0 and 0.5
    ranked = [tile_table.config_from_dict(r["config"]) for r in entry["ranked"]]
    assert ranked == [c, b, a]  # c: sqrt(1.1 * 2.4) = 1.62, b: sqrt(2 * 2) = 2, a: sqrt(1 * 6) = 2.45
    assert entry["ranked"][0]["rel"] == pytest.approx(math.sqrt(1.1 * 2.4), abs=1e-4)
    assert entry["shapes"] == [[1000, 60, 300, 1], [1001, 61, 301, 1]]
    assert entry["model_rel"] is None or entry["model_rel"] >= 1.0


def test_build_table_keeps_a_problem_measured_again_over_other_candidates() -> None:
    """The stride-2 conv opening a ResNet stage and the stride-1 3x3 convs after it share (M, N, K); only the
    latter's list has shifted taps. Both measurements count, so the class ranks the shifted tile first and a
    stride-2 launch, whose list lacks it, falls through to the best row tile."""
    rows = [TileConfig(128, 128, 64, 8, 8, 3), TileConfig(64, 128, 64, 8, 4, 4)]
    shifted = dataclasses.replace(rows[0], tap_shift=1)
    problem = Problem(25088, 128, 1152, 1, 2, "fp16")
    entries = [
        _entry("conv2d_act", problem, [(rows[0], 27.0), (rows[1], 29.0)]),  # the stride-2 conv
        _entry("conv2d_act", problem, [(rows[0], 26.0), (rows[1], 28.0), (shifted, 21.5)]),  # a stride-1 one
        _entry("conv2d_act", problem, [(rows[0], 26.5), (rows[1], 28.5), (shifted, 22.0)]),  # the same list again
    ]
    entry = tile_table.build_table(entries, "sm90", {}, sm_count=132)["entries"][
        tile_table.shape_class("conv2d_act", problem)
    ]
    ranked = [tile_table.config_from_dict(r["config"]) for r in entry["ranked"]]
    assert ranked == [shifted, *rows] and len(entry["shapes"]) == 2
    assert entry["ranked"][1]["rel"] == pytest.approx(math.sqrt(1.0 * 26.0 / 21.5), abs=1e-4)


def test_built_table_round_trips_through_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    candidates = gemm_candidates(1001, 3071, 257, 4)
    problem = Problem(1001, 3071, 257)
    slowest_for_model = max(candidates, key=lambda c: tile_heuristic.estimate_us("gemm_act", problem, c))
    timings = [(c, 1.0 if c == slowest_for_model else 2.0) for c in candidates]
    table = tile_table.build_table([_entry("gemm_act", problem, timings)], "sm90", {}, sm_count=132)
    monkeypatch.setattr(tile_table, "TABLE_DIR", tmp_path)
    tile_table.table_path("sm90").write_text(json.dumps(table))
    tile_table.forget_loaded()
    try:
        assert tile_table.lookup("sm90", "gemm_act", Problem(1010, 3000, 300), candidates) == slowest_for_model
        others = [c for c in candidates if c != slowest_for_model]
        assert tile_table.lookup("sm90", "gemm_act", Problem(1010, 3000, 300), others) == others[0]  # ties: list order
        assert tile_table.lookup("sm90", "conv2d_act", problem, candidates) is None
        assert tile_table.lookup("sm80", "gemm_act", problem, candidates) is None
    finally:
        tile_table.forget_loaded()


def test_the_lists_default_stands_unless_the_model_expects_a_clear_win() -> None:
    problem = Problem(12799, 255, 2305)
    candidates = gemm_candidates(12799, 255, 2305, 4)
    times = [tile_heuristic.estimate_us("gemm_act", problem, c) for c in candidates]
    fastest = candidates[times.index(min(times))]
    assert min(times) * 1.10 < times[0], "this shape must have a clear model win for the test to mean anything"
    assert tile_heuristic.pick("gemm_act", candidates, problem) == fastest
    wide_margin = times[0] / min(times) - 1 + 1e-6
    assert tile_heuristic.pick("gemm_act", candidates, problem, margin=wide_margin) == candidates[0]
    close = [c for c, t in zip(candidates, times, strict=True) if abs(t - times[0]) <= 0.05 * times[0]]
    assert len(close) >= 2 and tile_heuristic.pick("gemm_act", close, problem) == close[0]


def test_table_entries_say_how_the_lists_first_candidate_did() -> None:
    a, b = TileConfig(64, 64, 32), TileConfig(128, 64, 32)
    entries = [_entry("gemm_act", Problem(1000, 60, 300), [(a, 3.0), (b, 1.5)])]
    (entry,) = tile_table.build_table(entries, "sm90", {}, sm_count=132)["entries"].values()
    assert entry["first_rel"] == 2.0
    assert entry["model_rel"] in (1.0, 2.0)


def test_depthwise_default_is_the_measured_best_on_the_sweep() -> None:
    """On the depthwise layers the H200 sweep measured (benchmarks/results/depthwise-sweep-*.json), the
    untuned default costs at most 3% over the best configuration of the same tap loop, layers weighted by
    how often the models have them. The sweep's 128x64 tiles took up to 17x the best: a default that
    drifted back to such tiles fails here."""
    sweep = json.loads(sorted((REPO / "benchmarks" / "results").glob("depthwise-sweep-*.json"))[-1].read_text())
    chosen = best = 0.0
    for row in sweep["rows"]:
        k, stride, size, batch = row["k"], row["stride"], row["size"], row["batch"]
        rows = batch * ((size + 2 * (k // 2) - k) // stride + 1) ** 2
        elem = 4 if row["dtype"] == "float32" else 2
        problem = Problem(rows, row["c"], k * k, 1, elem, "tf32" if elem == 4 else "fp16")
        config = autotune.default_config("depthwise_act", depthwise_candidates(row["c"], rows), problem, "sm90")
        loop = "u" if k * k <= depthwise.UNROLL_MAX_TAPS else "r"
        timed = {name: v["ms"] for name, v in row["configs"].items() if name.endswith(loop) and "ms" in v}
        chosen += timed[f"{config.block_m}x{config.block_n}w{config.num_warps}{loop}"] * row["count"]
        best += min(timed.values()) * row["count"]
    assert chosen <= 1.03 * best, (chosen, best)
