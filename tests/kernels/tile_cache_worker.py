"""A process that writes tile choices into a shared cache (run by test_tile_cache_concurrency under spawn)."""

from __future__ import annotations

import os
from typing import Any

CANDIDATE_FIELDS = [(64, 64, 32), (128, 64, 32), (32, 32, 32), (16, 64, 64)]
DISTINCT_PER_WORKER = 6
SHARED = 4
GPU = "Test GPU 8x"


def keys_of(worker: int) -> list[dict[str, Any]]:
    """Each worker's own keys, then the keys every worker writes."""
    own = [{"worker": worker, "i": i, "gpu": GPU} for i in range(DISTINCT_PER_WORKER)]
    return own + [{"shared": i, "gpu": GPU} for i in range(SHARED)]


def best_index(key: dict[str, Any]) -> int:
    """Which candidate the fake measurement makes fastest for ``key`` (the same in every process)."""
    return (7 * key.get("worker", 3) + 5 * key.get("i", 0) + 11 * key.get("shared", 0)) % len(CANDIDATE_FIELDS)


def write_choices(cache: str, worker: int, barrier: Any) -> None:
    os.environ.pop("FUSER_AUTOTUNE", None)
    from fuser.kernels import autotune

    candidates = [autotune.TileConfig(*fields) for fields in CANDIDATE_FIELDS]
    autotune.set_cache_dir(cache)
    barrier.wait()  # all processes start writing at once
    with autotune.tuning(progress=False, rounds=1):
        for key in keys_of(worker):
            fastest = candidates[best_index(key)]
            autotune.choose("gemm_act", key, candidates, lambda c, fastest=fastest: 1.0 if c == fastest else 2.0)
