"""The tile-choice cache: measured once, reused from disk, unreadable entries ignored and rewritten."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fuser.kernels import autotune, set_cache_dir
from fuser.kernels.autotune import TileConfig

CANDIDATES = [TileConfig(64, 64, 32), TileConfig(128, 64, 32), TileConfig(32, 32, 32)]
KEY = {"m": 33, "n": 21, "gpu": "test"}
TIMES = {CANDIDATES[0]: 2.0, CANDIDATES[1]: 0.5, CANDIDATES[2]: 1.0}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FUSER_AUTOTUNE", "1")
    set_cache_dir(tmp_path)
    yield tmp_path
    set_cache_dir(None)


def counting_bench(calls: list[TileConfig]):
    def bench(config: TileConfig) -> float:
        calls.append(config)
        return TIMES[config]

    return bench


def test_measures_once_then_reads_disk(cache: Path) -> None:
    calls: list[TileConfig] = []
    assert autotune.choose("k", KEY, CANDIDATES, counting_bench(calls)) == CANDIDATES[1]
    assert calls == CANDIDATES
    path = autotune.cache_path("k", KEY)
    assert path.parent == cache and path.exists()
    entry = json.loads(path.read_text())
    assert entry["config"]["block_m"] == 128 and len(entry["timings_ms"]) == 3

    set_cache_dir(cache)  # drops the in-memory choices: the next lookup must come from disk
    calls.clear()
    assert autotune.choose("k", KEY, CANDIDATES, counting_bench(calls)) == CANDIDATES[1]
    assert calls == []


def test_corrupt_entry_is_ignored_and_rewritten(cache: Path) -> None:
    path = autotune.cache_path("k", KEY)
    path.write_text("{not json")
    calls: list[TileConfig] = []
    assert autotune.choose("k", KEY, CANDIDATES, counting_bench(calls)) == CANDIDATES[1]
    assert calls == CANDIDATES
    assert json.loads(path.read_text())["config"]["block_m"] == 128


def test_entry_for_another_key_is_not_trusted(cache: Path) -> None:
    other = {**KEY, "m": 34}
    autotune.choose("k", other, CANDIDATES, counting_bench([]))
    path, other_path = autotune.cache_path("k", KEY), autotune.cache_path("k", other)
    path.write_text(other_path.read_text())  # a file under the wrong name (hash collision, copy)
    calls: list[TileConfig] = []
    autotune.choose("k", KEY, CANDIDATES, counting_bench(calls))
    assert calls == CANDIDATES


def test_failing_candidates_are_skipped(cache: Path) -> None:
    def bench(config: TileConfig) -> float:
        if config.block_m == 128:
            raise RuntimeError("out of resources: shared memory")
        return TIMES[config]

    assert autotune.choose("k", KEY, CANDIDATES, bench) == CANDIDATES[2]

    def all_fail(config: TileConfig) -> float:
        raise RuntimeError("out of resources")

    with pytest.raises(RuntimeError, match="every tile candidate failed"):
        autotune.choose("k", {**KEY, "m": 1}, CANDIDATES, all_fail)


def test_env_dir_and_disabled_tuning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    set_cache_dir(None)
    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path / "env"))
    assert autotune.cache_dir() == tmp_path / "env"
    monkeypatch.setenv("FUSER_AUTOTUNE", "0")
    calls: list[TileConfig] = []
    assert autotune.choose("k", {**KEY, "m": 2}, CANDIDATES, counting_bench(calls)) == CANDIDATES[0]
    assert calls == []
