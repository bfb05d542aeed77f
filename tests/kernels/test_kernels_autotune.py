"""The tile choice: a default that measures nothing unless tuning is asked for; measured choices cached
on disk, reused, unreadable ones ignored and rewritten; FUSER_AUTOTUNE overriding both ways."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path

import filelock
import pytest

from fuser.kernels import autotune, set_cache_dir, tile_heuristic, tile_table
from fuser.kernels.autotune import Problem, TileConfig

CANDIDATES = [TileConfig(64, 64, 32), TileConfig(128, 64, 32), TileConfig(32, 32, 32)]
KEY = {"m": 33, "n": 21, "gpu": "test"}
TIMES = {CANDIDATES[0]: 2.0, CANDIDATES[1]: 0.5, CANDIDATES[2]: 1.0}
PROBLEM = Problem(333, 21, 61)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("FUSER_AUTOTUNE", raising=False)
    set_cache_dir(tmp_path)
    yield tmp_path
    set_cache_dir(None)


def counting_bench(calls: list[TileConfig]):
    def bench(config: TileConfig) -> float:
        calls.append(config)
        return TIMES[config]

    return bench


def no_bench(config: TileConfig) -> float:
    pytest.fail(f"measured {config} although tuning is off")


def test_untuned_choice_measures_nothing_and_is_the_models(cache: Path) -> None:
    config = autotune.choose("gemm_act", KEY, CANDIDATES, no_bench, problem=PROBLEM)
    assert config == tile_heuristic.pick("gemm_act", CANDIDATES, PROBLEM)
    assert autotune.choose("gemm_act", {**KEY, "m": 2}, CANDIDATES, no_bench) == CANDIDATES[0]  # no problem given
    assert not list(cache.iterdir()), "an untuned choice is not a measurement: nothing is written"


def test_measures_once_then_reads_disk(cache: Path) -> None:
    calls: list[TileConfig] = []
    with autotune.tuning(progress=False, rounds=1):
        assert autotune.choose("k", KEY, CANDIDATES, counting_bench(calls), problem=PROBLEM) == CANDIDATES[1]
    assert calls == CANDIDATES
    path = autotune.cache_file("test")
    assert path == cache / "tiles-test.json"
    (entry,) = autotune.read_cache_file(path).values()
    assert entry["config"]["block_m"] == 128 and len(entry["timings_ms"]) == 3
    assert entry["problem"] == {"m": 333, "n": 21, "k": 61, "groups": 1, "operand_bytes": 4, "precision": "tf32"}

    set_cache_dir(cache)  # drops the in-memory choices: the next lookup must come from disk
    with autotune.tuning(progress=False):
        assert autotune.choose("k", KEY, CANDIDATES, no_bench) == CANDIDATES[1]
    set_cache_dir(cache)
    assert autotune.choose("k", KEY, CANDIDATES, no_bench) == CANDIDATES[1], "untuned calls use measured choices"


def test_rounds_keep_each_candidates_best_time(cache: Path) -> None:
    seen: dict[TileConfig, int] = {}

    def noisy(config: TileConfig) -> float:  # candidate 0 is slow on its first measurement only
        seen[config] = seen.get(config, 0) + 1
        return (
            5.0 if config == CANDIDATES[0] and seen[config] == 1 else {0: 0.1, 1: 0.3, 2: 0.2}[CANDIDATES.index(config)]
        )

    with autotune.tuning(progress=False, rounds=3):
        assert autotune.choose("k", KEY, CANDIDATES, noisy) == CANDIDATES[0]
    assert seen == dict.fromkeys(CANDIDATES, 3)


def test_corrupt_file_is_ignored_and_rewritten(cache: Path) -> None:
    path = autotune.cache_file("test")
    path.write_text("{not json")
    calls: list[TileConfig] = []
    with pytest.warns(UserWarning, match="unreadable"), autotune.tuning(progress=False, rounds=1):
        assert autotune.choose("k", KEY, CANDIDATES, counting_bench(calls)) == CANDIDATES[1]
    assert calls == CANDIDATES
    (entry,) = json.loads(path.read_text())["entries"].values()
    assert entry["config"]["block_m"] == 128


def test_entry_for_another_key_is_not_trusted(cache: Path) -> None:
    other = {**KEY, "m": 34}
    with autotune.tuning(progress=False, rounds=1):
        autotune.choose("k", other, CANDIDATES, counting_bench([]))
    path = autotune.cache_file("test")
    data = json.loads(path.read_text())
    (other_entry,) = data["entries"].values()
    candidates = [tuple(c.__dict__.values()) for c in CANDIDATES]
    this_id = autotune._entry_id(autotune._key_text("k", {**KEY, "candidates": candidates}))
    data["entries"][this_id] = other_entry  # another key's choice under this key's id (a bad copy)
    path.write_text(json.dumps(data))
    set_cache_dir(cache)
    calls: list[TileConfig] = []
    with autotune.tuning(progress=False, rounds=1):
        autotune.choose("k", KEY, CANDIDATES, counting_bench(calls))
    assert calls == CANDIDATES


def test_failing_candidates_are_skipped(cache: Path) -> None:
    def bench(config: TileConfig) -> float:
        if config.block_m == 128:
            raise RuntimeError("out of resources: shared memory")
        return TIMES[config]

    with autotune.tuning(progress=False):
        assert autotune.choose("k", KEY, CANDIDATES, bench) == CANDIDATES[2]

    def all_fail(config: TileConfig) -> float:
        raise RuntimeError("out of resources")

    with pytest.raises(RuntimeError, match="every tile candidate failed"), autotune.tuning(progress=False):
        autotune.choose("k", {**KEY, "m": 1}, CANDIDATES, all_fail)


def test_env_overrides_the_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    set_cache_dir(None)
    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path / "env"))
    assert autotune.cache_dir() == tmp_path / "env"
    monkeypatch.setenv("FUSER_AUTOTUNE", "0")
    with autotune.tuning(progress=False):
        assert not autotune.tuning_enabled()
        assert autotune.choose("k", {**KEY, "m": 2}, CANDIDATES, no_bench) == CANDIDATES[0]
    monkeypatch.setenv("FUSER_AUTOTUNE", "1")
    calls: list[TileConfig] = []
    assert autotune.choose("k", {**KEY, "m": 3}, CANDIDATES, counting_bench(calls)) == CANDIDATES[1]
    assert len(calls) == 2 * len(CANDIDATES)  # the default two rounds
    with autotune.tuning(False):
        assert autotune.tuning_enabled(), "FUSER_AUTOTUNE=1 measures even where the call says not to"


def test_tuning_measures_what_was_planned_untuned(cache: Path) -> None:
    plans = {"some plan": object()}
    autotune.register_plan_cache(plans)
    assert autotune.choose("k", KEY, CANDIDATES, no_bench) == CANDIDATES[0]
    calls: list[TileConfig] = []
    with autotune.tuning(progress=False, rounds=1):
        assert not plans, "plans holding an untuned choice are rebuilt"
        assert autotune.choose("k", KEY, CANDIDATES, counting_bench(calls)) == CANDIDATES[1]
    assert calls == CANDIDATES
    with autotune.tuning(progress=False, rounds=1):
        assert autotune.choose("k", KEY, CANDIDATES, no_bench) == CANDIDATES[1]
    with autotune.tuning(False):
        assert not autotune.tuning_enabled()
        assert autotune.choose("k", {**KEY, "m": 7}, CANDIDATES, no_bench) == CANDIDATES[0]


def test_progress_line(cache: Path) -> None:
    stream = io.StringIO()
    with autotune.tuning(progress=autotune.Progress(stream), rounds=1) as progress:
        autotune.choose("gemm_act", KEY, CANDIDATES, counting_bench([]), problem=PROBLEM)
        autotune.choose("gemm_act", KEY, CANDIDATES, no_bench, problem=PROBLEM)  # in memory: not counted
        set_cache_dir(cache)
        autotune.choose("gemm_act", KEY, CANDIDATES, no_bench, problem=PROBLEM)  # from the disk cache
    progress.close()
    text = stream.getvalue()
    assert "shape 1 gemm_act 333x21x61: 128x64x32 w4 s3 0.5000 ms (3 candidates)" in text
    assert "1 shapes measured (3 candidates), 1 from the cache" in text


def test_device_is_folded_into_the_key_and_selects_the_table(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class FakeCuda:
        type = "cuda"

    monkeypatch.setattr(autotune, "device_facts", lambda device: ("NVIDIA H200", "sm90", 132) if device else None)
    monkeypatch.setattr(autotune, "_triton_version", lambda: "3.6.0")
    monkeypatch.setattr(tile_table, "TABLE_DIR", tmp_path)
    tile_table.forget_loaded()
    slow_for_model = next(c for c in CANDIDATES if c != tile_heuristic.pick("gemm_act", CANDIDATES, PROBLEM))
    table = {
        "format": 1,
        "entries": {
            tile_table.shape_class("gemm_act", PROBLEM): {
                "ranked": [{"config": {"block_m": 1, "block_n": 1, "block_k": 1}}, {"config": slow_for_model.__dict__}]
            }
        },
    }
    (tmp_path / "tile_table_sm90.json").write_text(json.dumps(table))
    try:
        assert autotune.choose("gemm_act", {"m": 1}, CANDIDATES, no_bench, device=FakeCuda(), problem=PROBLEM) == (
            slow_for_model
        ), "the table's best config among the candidates (the first ranked one is not a candidate)"
        with autotune.tuning(progress=False, rounds=1):
            autotune.choose("gemm_act", {"m": 1}, CANDIDATES, counting_bench([]), device=FakeCuda())
        (entry,) = autotune.read_cache_file(cache / "tiles-nvidia-h200.json").values()
        key = json.loads(entry["key"])
        assert (key["gpu"], key["arch"], key["triton"]) == ("NVIDIA H200", "sm90", "3.6.0")
    finally:
        tile_table.forget_loaded()


def test_untuned_choice_does_not_wait_for_a_held_lock(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process holding the cache lock: an untuned call needs no lock, a tuned one gives up
    writing after the lock timeout and keeps its choice in memory."""
    monkeypatch.setattr(autotune, "LOCK_TIMEOUT_S", 0.2)
    path = autotune.cache_file("test")
    held = filelock.FileLock(str(path) + ".lock")
    with held:
        assert autotune.choose("k", KEY, CANDIDATES, no_bench) == CANDIDATES[0]
        with pytest.warns(UserWarning, match="stayed locked"), autotune.tuning(progress=False, rounds=1):
            assert autotune.choose("k", {**KEY, "m": 9}, CANDIDATES, counting_bench([])) == CANDIDATES[1]
    assert not path.exists()


def test_should_measure_can_decline_a_measurement(cache: Path) -> None:
    asked: list[tuple[str, Problem | None, list[TileConfig]]] = []

    def only_big(kernel: str, problem: Problem | None, candidates: Sequence[TileConfig]) -> bool:
        asked.append((kernel, problem, list(candidates)))
        return problem is not None and problem.m > 1000

    calls: list[TileConfig] = []
    with autotune.tuning(progress=False, rounds=1, should_measure=only_big):
        small = autotune.choose("gemm_act", KEY, CANDIDATES, no_bench, problem=PROBLEM)
        autotune.choose(
            "gemm_act", {**KEY, "m": 5000}, CANDIDATES, counting_bench(calls), problem=Problem(5000, 21, 61)
        )
    assert small == tile_heuristic.pick("gemm_act", CANDIDATES, PROBLEM)
    assert calls == CANDIDATES and len(asked) == 2 and all(seen == CANDIDATES for *_, seen in asked)
    assert len(autotune.read_cache_file(autotune.cache_file("test"))) == 1, "a declined measurement is not cached"


def _runner_failing_for(too_big: set[TileConfig], launched: list[TileConfig]):
    from triton.runtime.errors import OutOfResources

    def runner(config: TileConfig):
        def run(x: int) -> int:
            if config in too_big:
                raise OutOfResources(299008, 232448, "shared memory")
            launched.append(config)
            return x + config.block_m

        return run

    return runner


def test_a_default_that_does_not_fit_falls_back_to_the_next_candidate_that_does() -> None:
    from fuser.kernels.launch import with_fallback

    big, bigger, small = TileConfig(256, 128, 64), TileConfig(128, 128, 64), TileConfig(64, 32, 32)
    launched: list[TileConfig] = []
    run = with_fallback(_runner_failing_for({big, bigger}, launched), big, [bigger, big, small], forced=False)
    assert run(1) == 65 and run(2) == 66  # small's plan, kept for later calls
    assert launched == [small, small]


def test_a_forced_tile_or_no_fitting_candidate_raises_the_resource_error() -> None:
    from triton.runtime.errors import OutOfResources

    from fuser.kernels.launch import with_fallback

    big, small = TileConfig(256, 128, 64), TileConfig(64, 32, 32)
    with pytest.raises(OutOfResources):
        with_fallback(_runner_failing_for({big}, []), big, [big, small], forced=True)(1)
    with pytest.raises(OutOfResources):
        with_fallback(_runner_failing_for({big, small}, []), big, [big, small], forced=False)(1)


def test_float32_bias_copies_are_made_once_per_tensor_and_version() -> None:
    import torch

    from fuser.kernels.launch import Float32Copies

    copies = Float32Copies()
    a, b = torch.randn(7).half(), torch.randn(7).half()
    first = copies(a)
    assert first.dtype == torch.float32 and torch.equal(first, a.float())
    assert copies(a) is first and copies(b) is not first  # one plan, several layers: each its own copy
    assert copies(a) is first
    a.add_(1)  # an in-place edit is seen
    assert torch.equal(copies(a), a.float()) and copies(a) is not first
    del b
    assert len(copies._copies) == 1  # a freed bias's copy is dropped


def test_plans_of_one_bias_share_its_float32_copy() -> None:
    """Two plans of one fp16 bias (two input shapes) read one float32 copy: a plan first built inside a
    compiled forward then makes none in that forward's CUDA-graph pool."""
    import torch

    from fuser.kernels import Precision, conv2d_act, pack_conv_weight
    from fuser.kernels.launch import FLOAT32_BIASES

    gen = torch.Generator().manual_seed(11)
    weight = pack_conv_weight(torch.randn(9, 5, 3, 3, generator=gen).half(), Precision("fp16"))
    bias = torch.randn(9, generator=gen).half()
    conv2d_act(torch.randn(1, 5, 7, 9, generator=gen).half(), weight, bias, padding=1, interpret=True)
    assert id(bias) in FLOAT32_BIASES._copies, "the plan's copy is not in the shared table"
    first = FLOAT32_BIASES._copies[id(bias)][2][-1]
    conv2d_act(torch.randn(2, 5, 11, 13, generator=gen).half(), weight, bias, padding=1, interpret=True)
    kept = FLOAT32_BIASES._copies[id(bias)][2]
    assert len(kept) == 1 and kept[0] is first


def test_fused_modules_make_the_split_counters_before_any_forward(monkeypatch) -> None:
    """The split-K arrival counters come from a chunk the fused module made when it was built: a split
    plan first built inside a compiled forward then allocates nothing in that forward's CUDA-graph pool."""
    import torch
    from torch import nn

    import fuser
    from fuser.kernels import Precision, conv2d_act, pack_conv_weight, splitk

    monkeypatch.setattr(splitk, "SPLIT_COUNTERS", splitk.CounterArena())
    gen = torch.Generator().manual_seed(12)
    model = nn.Sequential(nn.Conv2d(5, 9, 3, padding=1), nn.BatchNorm2d(9), nn.SiLU()).eval()
    fuser.optimize(model, (torch.randn(1, 5, 7, 9, generator=gen),), backend="interpret")
    assert torch.device("cpu") in splitk.SPLIT_COUNTERS._chunks, "the module made no counters"
    chunk = splitk.SPLIT_COUNTERS._chunks[torch.device("cpu")][0]
    weight = pack_conv_weight(torch.randn(9, 5, 3, 3, generator=gen), Precision("ieee"))
    split = TileConfig(32, 16, 16, 2, 4, 1, split_k=3)
    conv2d_act(torch.randn(1, 5, 7, 9, generator=gen), weight, padding=1, tile=split, interpret=True)
    after, used = splitk.SPLIT_COUNTERS._chunks[torch.device("cpu")]
    assert after is chunk and used > 0, "the split plan allocated its own counters"
