"""Tile configurations chosen by measurement, cached on disk.

Each kernel offers a short list of candidate :class:`TileConfig` for a problem. On the first call for
a key (problem shape, dtypes, precision, GPU, triton version) every candidate is timed with
``triton.testing.do_bench`` on the call's own tensors, the fastest is kept in memory and written to
``<cache dir>/<kernel>-<hash>.json``. Later processes read the file instead of measuring again. A
file that cannot be read or does not describe this key is ignored and rewritten.

The cache directory is ``set_cache_dir(path)``, else ``$FUSER_CACHE_DIR``, else
``~/.cache/fuser/autotune``. ``FUSER_AUTOTUNE=0`` skips measuring and takes each list's first entry
(the hand-picked default), for quick runs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, astuple, dataclass
from pathlib import Path
from typing import Any

_CACHE_FORMAT = 1


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration: the tile shape (constexprs) and the compiler's warps and stages."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # reduction splits (kernels/splitk.py); 1 = the whole K in one program

    def constexprs(self) -> dict[str, int]:
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "GROUP_M": self.group_m,
        }


_cache_dir_override: Path | None = None
_memory: dict[str, TileConfig] = {}
_lock = threading.Lock()
_warned_unwritable = False


_plan_caches: list[dict[Any, Any]] = []


def register_plan_cache(cache: dict[Any, Any]) -> None:
    """A launcher's memo of launch plans (which embed tile choices): emptied with the choices."""
    _plan_caches.append(cache)


def set_cache_dir(path: str | os.PathLike[str] | None) -> None:
    """Where measured tile choices are stored (None: back to $FUSER_CACHE_DIR or the default).

    Forgets the choices held in memory, so the next call of each shape reads (or measures) again.
    """
    global _cache_dir_override
    _cache_dir_override = Path(path) if path is not None else None
    with _lock:
        _memory.clear()
        for cache in _plan_caches:
            cache.clear()


def cache_dir() -> Path:
    """The directory tile choices are read from and written to."""
    if _cache_dir_override is not None:
        return _cache_dir_override
    env = os.environ.get("FUSER_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "fuser" / "autotune"


def tuning_enabled() -> bool:
    return os.environ.get("FUSER_AUTOTUNE", "1") != "0"


def cache_path(kernel: str, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(_key_text(kernel, key).encode()).hexdigest()[:20]
    return cache_dir() / f"{kernel}-{digest}.json"


def _key_text(kernel: str, key: dict[str, Any]) -> str:
    return json.dumps({"kernel": kernel, "format": _CACHE_FORMAT, **key}, sort_keys=True, default=str)


def _read(path: Path, key_text: str) -> TileConfig | None:
    try:
        entry = json.loads(path.read_text())
        if entry["key"] != key_text:
            return None
        return TileConfig(**{name: int(value) for name, value in entry["config"].items()})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(path: Path, key_text: str, config: TileConfig, timings: list[tuple[TileConfig, float]]) -> None:
    global _warned_unwritable
    entry = {
        "key": key_text,
        "config": asdict(config),
        "timings_ms": [[asdict(c), t if math.isfinite(t) else None] for c, t in timings],
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f, indent=1)
        os.replace(tmp, path)
    except OSError as err:
        if not _warned_unwritable:
            warnings.warn(
                f"fuser: cannot write the autotune cache at {path.parent} ({err}); "
                "tile choices are kept in memory only",
                stacklevel=3,
            )
            _warned_unwritable = True


def choose(
    kernel: str,
    key: dict[str, Any],
    candidates: Sequence[TileConfig],
    bench: Callable[[TileConfig], float],
) -> TileConfig:
    """The fastest of ``candidates`` for ``key``: from memory, from disk, or measured with ``bench``.

    ``bench(config)`` returns milliseconds; a candidate that fails to compile or launch (too much
    shared memory, say) counts as infinitely slow. If every candidate fails, the error of the first
    is raised.
    """
    if not candidates:
        raise ValueError(f"{kernel}: no tile candidates for {key}")
    # The candidate list is part of the key: a choice made among other candidates is not trusted.
    key_text = _key_text(kernel, {**key, "candidates": [astuple(c) for c in candidates]})
    if key_text in _memory:
        return _memory[key_text]
    if not tuning_enabled() or len(candidates) == 1:
        _memory[key_text] = candidates[0]
        return candidates[0]
    path = cache_path(kernel, key)
    config = _read(path, key_text)
    if config is None:
        timings: list[tuple[TileConfig, float]] = []
        first_error: Exception | None = None
        for candidate in candidates:
            try:
                timings.append((candidate, float(bench(candidate))))
            except Exception as err:  # compile errors (out of resources) and launch failures alike
                first_error = first_error or err
                timings.append((candidate, math.inf))
        config, best = min(timings, key=lambda item: item[1])
        if not math.isfinite(best):
            raise RuntimeError(f"{kernel}: every tile candidate failed for {key}") from first_error
        _write(path, key_text, config, timings)
    with _lock:
        _memory[key_text] = config
    return config


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def matmul_candidates(m: int, n: int, k: int, block_k: int, sm_count: int = 132) -> list[TileConfig]:
    """Tile configs worth measuring for an ``m x n`` output with reduction ``k`` (first = default).

    Shaped by three facts of the measured H200 runs: a short reduction (k <= 256) leaves the software
    pipeline no steady state, so several small CTAs per SM must hide the load latency instead (2
    stages, small tiles); when 128x128 tiles give under two waves of CTAs, smaller tiles fill the SMs;
    a tile wider than ``n`` only wastes registers and shared memory.
    """
    bn_cap = max(16, _pow2_at_least(n))
    out: list[TileConfig] = []

    def add(bm: int, bn: int, bk: int, warps: int, stages: int) -> None:
        config = TileConfig(bm, min(bn, bn_cap), bk, 8, warps, stages)
        if config not in out:
            out.append(config)

    if k <= 256:
        add(128, 128, block_k, 4, 2)
        add(64, 128, block_k, 4, 2)
        add(128, 64, block_k, 4, 2)
        add(64, 64, block_k, 4, 2)
        add(256, 128, block_k, 8, 2)
    else:
        add(128, 128, block_k, 8, 4)
        add(128, 256, block_k, 8, 3)
        add(128, 128, block_k, 4, 4)
        add(256, 128, block_k, 8, 3)
        add(128, 64, 2 * block_k, 8, 3)
    if -(-m // 128) * -(-n // 128) < 2 * sm_count:
        add(64, 64, block_k, 4, 4)
        add(64, 128, block_k, 4, 4)
    return out


def do_bench_ms(fn: Callable[[], Any]) -> float:
    """Median milliseconds of ``fn`` (short runs: this is called once per candidate per new shape)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median"))
