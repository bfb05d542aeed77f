"""Many processes (the ranks of a data-parallel job) writing one tile cache file at once: the file stays
valid JSON and holds every entry each of them wrote."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
from tile_cache_worker import CANDIDATE_FIELDS, GPU, best_index, keys_of, write_choices

from fuser.kernels import autotune

WORKERS = 8


@pytest.mark.slow  # 8 interpreters importing torch
def test_eight_processes_writing_at_once_lose_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(WORKERS)
    processes = [context.Process(target=write_choices, args=(str(tmp_path), w, barrier)) for w in range(WORKERS)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=240)
    assert [p.exitcode for p in processes] == [0] * WORKERS

    autotune.set_cache_dir(tmp_path)
    entries = autotune.read_cache_file(autotune.cache_file(GPU))  # valid JSON of the current format, or this is {}
    expected = {tuple(sorted(k.items())) for w in range(WORKERS) for k in keys_of(w)}
    assert len(entries) == len(expected) == WORKERS * 6 + 4
    assert not list(tmp_path.glob("*.tmp")), "no temporary file is left behind"

    monkeypatch.delenv("FUSER_AUTOTUNE", raising=False)
    candidates = [autotune.TileConfig(*fields) for fields in CANDIDATE_FIELDS]

    def lost(config: autotune.TileConfig) -> float:
        pytest.fail("an entry was lost: choose measured instead of reading it")

    try:
        for key in (dict(k) for k in expected):
            with autotune.tuning(progress=False):  # tuning on: a missing entry would call the failing bench
                assert autotune.choose("gemm_act", key, candidates, lost) == candidates[best_index(key)], key
    finally:
        autotune.set_cache_dir(None)
