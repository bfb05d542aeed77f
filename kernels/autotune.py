"""Tile configurations for every launch: a default that measures nothing, and measured choices cached
on disk when tuning is asked for.

Each kernel offers a short list of candidate :class:`TileConfig` for a problem and calls :func:`choose`
once per launch signature. The choice comes from, in order:

1. this process's memory;
2. the disk cache: choices measured by an earlier tuning run (this machine's, or a copied file);
3. when tuning is on: every candidate timed with ``bench`` on the call's own tensors, the fastest kept
   and merged into the disk cache;
4. otherwise the default, measuring nothing: the table of measured choices shipped for the GPU's
   architecture (tile_table.py), else the cost model (tile_heuristic.py), else the list's first entry.

Tuning is off unless asked for, so a new machine's first ``optimize()`` measures nothing: per call with
``with tuning(): ...`` (what ``optimize(..., tune=True)`` and ``fuser tune MODEL`` do), or for the whole
process with ``FUSER_AUTOTUNE``, which overrides both ways ("1": always measure, "0": never).

The cache is one JSON file per GPU model, ``<cache dir>/tiles-<gpu>.json``, holding one entry per key
(kernel, problem, dtypes, precision, GPU, triton version, candidate list). Many processes (the ranks of
a data-parallel job) may share it: a writer takes a file lock, re-reads the file, merges its entries and
replaces the file atomically, so no entry is lost and a reader never sees a partial file. The lock is
held only for that merge, never while measuring, and readers take no lock: a process that finds no
cached choice never waits for another, it measures (tuning) or takes the default. An unreadable file
is ignored and, on the next write, replaced.

The cache directory is ``set_cache_dir(path)``, else ``$FUSER_CACHE_DIR``, else ``~/.cache/fuser/autotune``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, astuple, dataclass
from pathlib import Path
from typing import Any, TextIO

import filelock

from . import tile_heuristic, tile_table
from .tile_config import Problem, TileConfig

__all__ = [
    "Problem",
    "TileConfig",
    "cache_dir",
    "cache_file",
    "choose",
    "default_config",
    "do_bench_ms",
    "matmul_candidates",
    "register_plan_cache",
    "set_cache_dir",
    "tuning",
    "tuning_enabled",
]

_CACHE_FORMAT = 2
LOCK_TIMEOUT_S = 30.0  # a writer that cannot get the lock in this long keeps its choice in memory only


@dataclass
class _Choice:
    config: TileConfig
    measured: bool


_cache_dir_override: Path | None = None
_memory: dict[str, _Choice] = {}
_disk: dict[Path, dict[str, dict[str, Any]]] = {}  # the cache files read by this process, by path
_lock = threading.RLock()
_warned: set[str] = set()
_plan_caches: list[dict[Any, Any]] = []


def register_plan_cache(cache: dict[Any, Any]) -> None:
    """A launcher's memo of launch plans (which embed tile choices): emptied with the choices."""
    _plan_caches.append(cache)


def _clear_plans() -> None:
    for cache in _plan_caches:
        cache.clear()


def set_cache_dir(path: str | os.PathLike[str] | None) -> None:
    """Where measured tile choices are stored (None: back to $FUSER_CACHE_DIR or the default).

    Forgets the choices held in memory, so the next call of each shape reads (or measures) again.
    """
    global _cache_dir_override
    _cache_dir_override = Path(path) if path is not None else None
    with _lock:
        _memory.clear()
        _disk.clear()
        _clear_plans()


def cache_dir() -> Path:
    """The directory tile choices are read from and written to."""
    if _cache_dir_override is not None:
        return _cache_dir_override
    env = os.environ.get("FUSER_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "fuser" / "autotune"


def cache_file(gpu: str) -> Path:
    """The cache file of one GPU model (``gpu`` as ``torch.cuda.get_device_name`` spells it)."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "any"
    return cache_dir() / f"tiles-{slug}.json"


# --- tuning on or off -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tuning:
    enabled: bool
    progress: Progress | None
    rounds: int
    rep_ms: int
    should_measure: Callable[[str, Problem | None, Sequence[TileConfig]], bool] | None = None


_OFF = _Tuning(False, None, rounds=2, rep_ms=20)
_tuning: contextvars.ContextVar[_Tuning] = contextvars.ContextVar("fuser_tuning")


def tuning_enabled() -> bool:
    """Whether :func:`choose` measures: ``FUSER_AUTOTUNE`` when set ("0" no, anything else yes), else
    whether the caller is inside ``tuning(True)``."""
    env = os.environ.get("FUSER_AUTOTUNE")
    if env is not None and env != "":
        return env != "0"
    return _tuning.get(_OFF).enabled


@contextlib.contextmanager
def tuning(
    enabled: bool = True,
    *,
    progress: bool | Progress = True,
    rounds: int = 2,
    rep_ms: int = 20,
    drop_defaults: bool = True,
    should_measure: Callable[[str, Problem | None, Sequence[TileConfig]], bool] | None = None,
) -> Iterator[Progress | None]:
    """Within this context, kernels measure their candidates for every launch signature not in the disk
    cache (``enabled=False``: they take the default, even where an outer context tunes).

    ``progress``: a line on stderr while measuring (or a :class:`Progress` to report to). Each candidate
    is timed ``rounds`` times (``do_bench`` for ``rep_ms`` each, interleaved over the candidates) and its
    best time kept: one short measurement right after compiling moved by up to 2x on the H200.

    With ``drop_defaults`` the choices this process already took by default are dropped on entry (with
    the launch plans that embed them), so that shapes another model of the same process planned untuned
    are measured too; a context entered on every forward call passes False, since dropping the plans
    costs every model of the process its plans. ``should_measure(kernel, problem, candidates)``, where given,
    can decline a measurement (the launch then takes the default, which is not cached): a table-making run
    uses it to measure a few shapes per shape class and kind of tile offered, not every one.
    """
    if rounds < 1 or rep_ms < 1:
        raise ValueError(f"tuning: rounds and rep_ms must be >= 1, got {rounds} and {rep_ms}")
    outer = _tuning.get(_OFF)
    owned = False
    if isinstance(progress, Progress):
        reporter: Progress | None = progress
    elif progress and enabled and outer.progress is not None:
        reporter = outer.progress  # nested (optimize's first call of a tuned module): one progress line
    elif progress and enabled:
        reporter, owned = Progress(), True
    else:
        reporter = None
    if enabled and drop_defaults:
        with _lock:
            defaults = [key for key, choice in _memory.items() if not choice.measured]
            for key in defaults:
                del _memory[key]
            if defaults:
                _clear_plans()
    token = _tuning.set(_Tuning(enabled, reporter, rounds, rep_ms, should_measure))
    try:
        yield reporter
    finally:
        _tuning.reset(token)
        if owned and reporter is not None:
            reporter.close()


class Progress:
    """The tuning progress line: shapes measured and taken from the cache, the current shape's
    candidates as a bar, elapsed time. Redrawn in place on a terminal, one line per shape otherwise."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.perf_counter()
        self.measured = 0
        self.cached = 0
        self.candidates = 0
        self._live = bool(getattr(self.stream, "isatty", lambda: False)())
        self._drawn = False

    def _write(self, text: str, final: bool) -> None:
        if self._live:
            self.stream.write("\r" + text.ljust(100) + ("\n" if final else ""))
        elif final:
            self.stream.write(text + "\n")
        self.stream.flush()
        self._drawn = self._live and not final

    def from_cache(self) -> None:
        self.cached += 1

    def step(self, label: str, done: int, total: int) -> None:
        """``done`` of ``total`` measurements of the shape ``label`` taken."""
        width = 20
        filled = width * done // max(1, total)
        elapsed = time.perf_counter() - self.start
        text = (
            f"fuser tune: shape {self.measured + 1} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
            f"{label} | {self.cached} cached | {elapsed:.1f} s"
        )
        self._write(text, final=False)

    def shape_done(self, label: str, config: TileConfig, best_ms: float, candidates: int) -> None:
        self.measured += 1
        self.candidates += candidates
        elapsed = time.perf_counter() - self.start
        text = (
            f"fuser tune: shape {self.measured} {label}: {_describe(config)} {best_ms:.4f} ms "
            f"({candidates} candidates) | {self.cached} cached | {elapsed:.1f} s"
        )
        self._write(text, final=not self._live)

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
        elapsed = time.perf_counter() - self.start
        if self.measured or self.cached:
            self.stream.write(
                f"fuser tune: {self.measured} shapes measured ({self.candidates} candidates), "
                f"{self.cached} from the cache, {elapsed:.1f} s\n"
            )
        self.stream.flush()


def _describe(config: TileConfig) -> str:
    text = f"{config.block_m}x{config.block_n}x{config.block_k} w{config.num_warps} s{config.num_stages}"
    text += f" split{config.split_k}" if config.split_k != 1 else ""
    text += f" box{config.box_w}" if config.box_w else ""
    text += " shift" if config.tap_shift else ""
    text += f" persistent{config.persistent}" if config.persistent else ""
    return text + (f" streamk{config.stream_k}" if config.stream_k else "")


# --- the disk cache ---------------------------------------------------------------------------------------


def _warn_once(topic: str, message: str) -> None:
    if topic not in _warned:
        _warned.add(topic)
        warnings.warn(message, stacklevel=4)


def _key_text(kernel: str, key: dict[str, Any]) -> str:
    return json.dumps({"kernel": kernel, "format": _CACHE_FORMAT, **key}, sort_keys=True, default=str)


def _entry_id(key_text: str) -> str:
    return hashlib.sha256(key_text.encode()).hexdigest()[:24]


def read_cache_file(path: Path) -> dict[str, dict[str, Any]]:
    """The entries of one cache file by id ({} when it is missing, unreadable or of another format)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        _warn_once(f"unreadable {path}", f"fuser: ignoring the unreadable tile cache {path}; it is rewritten")
        return {}
    if not isinstance(data, dict) or data.get("format") != _CACHE_FORMAT or not isinstance(data.get("entries"), dict):
        return {}
    return {k: v for k, v in data["entries"].items() if isinstance(v, dict)}


def _config_of(entry: dict[str, Any], key_text: str) -> TileConfig | None:
    try:
        if entry["key"] != key_text:
            return None
        return TileConfig(**{name: int(value) for name, value in entry["config"].items()})
    except (KeyError, TypeError, ValueError):
        return None


def _cached(path: Path, key_text: str, reread: bool) -> TileConfig | None:
    """The cached choice for ``key_text``; ``reread``: look at the file again if this process's copy
    lacks it (another process may have measured it since)."""
    entry_id = _entry_id(key_text)
    with _lock:
        entries = _disk.get(path)
    if entries is None or (reread and entry_id not in entries):
        entries = read_cache_file(path)
        with _lock:
            _disk[path] = entries
    entry = entries.get(entry_id)
    return _config_of(entry, key_text) if entry is not None else None


def merge_into_cache(path: Path, new: dict[str, dict[str, Any]]) -> bool:
    """Add ``new`` entries to the cache file at ``path`` under its lock: re-read, merge, replace
    atomically. False (with a warning, once) when the file cannot be written or locked in time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with filelock.FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S):
            entries = read_cache_file(path)
            entries.update(new)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"format": _CACHE_FORMAT, "entries": entries}, f, indent=1, sort_keys=True)
                    f.flush()
                    os.fsync(f.fileno())
                os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep other users of a shared cache out
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
    except filelock.Timeout:
        _warn_once(
            f"lock {path}",
            f"fuser: the tile cache {path} stayed locked for {LOCK_TIMEOUT_S:.0f} s; choices kept in memory only",
        )
        return False
    except OSError as err:
        _warn_once(
            f"write {path.parent}",
            f"fuser: cannot write the tile cache at {path.parent} ({err}); choices kept in memory only",
        )
        return False
    with _lock:
        _disk[path] = entries
    return True


# --- the device ------------------------------------------------------------------------------------------


@functools.cache
def _device_facts(index: int) -> tuple[str, str, int]:
    import torch

    props = torch.cuda.get_device_properties(index)
    return props.name, f"sm{props.major}{props.minor}", props.multi_processor_count


def device_facts(device: Any) -> tuple[str, str, int] | None:
    """(GPU name, architecture such as "sm90", SM count) of a CUDA device, None for anything else."""
    if device is None or getattr(device, "type", None) != "cuda":
        return None
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_facts(index)


@functools.cache
def _triton_version() -> str:
    import triton

    return triton.__version__


# --- the choice ------------------------------------------------------------------------------------------


def default_config(
    kernel: str,
    candidates: Sequence[TileConfig],
    problem: Problem | None,
    arch: str | None = None,
    sm_count: int = tile_heuristic.SM_COUNT,
) -> TileConfig:
    """The choice without measuring: the shipped table's for ``arch``, else the cost model's, else the
    first candidate (no ``problem``). Always one of ``candidates``."""
    if not candidates:
        raise ValueError(f"{kernel}: no tile candidates")
    if problem is None:
        return candidates[0]
    if arch is not None:
        from_table = tile_table.lookup(arch, kernel, problem, candidates)
        if from_table is not None:
            return from_table
    return tile_heuristic.pick(kernel, candidates, problem, sm_count)


def choose(
    kernel: str,
    key: dict[str, Any],
    candidates: Sequence[TileConfig],
    bench: Callable[[TileConfig], float],
    *,
    device: Any = None,
    problem: Problem | None = None,
) -> TileConfig:
    """The tile config for one launch signature, described by ``key`` (JSON-able; shapes, strides,
    dtypes, precision...). See the module docstring for where it comes from.

    ``device`` (the launch's CUDA device) adds the GPU model, architecture and triton version to the
    key and selects the shipped table and the SM count; ``problem`` lets the default be the table's
    or the cost model's choice instead of the first candidate. ``bench(config)`` returns milliseconds
    and is only called while tuning; a candidate that fails to compile or launch (too much shared
    memory, say) counts as infinitely slow. If every candidate fails, the error of the first is raised.
    """
    if not candidates:
        raise ValueError(f"{kernel}: no tile candidates for {key}")
    facts = device_facts(device)
    if facts is not None:
        key = {**key, "gpu": facts[0], "arch": facts[1], "triton": _triton_version()}
    # The candidate list is part of the key: a choice made among other candidates is not trusted.
    key_text = _key_text(kernel, {**key, "candidates": [astuple(c) for c in candidates]})
    tune = tuning_enabled()
    with _lock:
        held = _memory.get(key_text)
    if held is not None and (held.measured or not tune):
        return held.config
    if len(candidates) == 1:
        return _remember(key_text, candidates[0], measured=True)
    path = cache_file(str(key.get("gpu", "any")))
    settings = _tuning.get(_OFF)
    config = _cached(path, key_text, reread=tune)
    if config is not None:
        if settings.progress is not None and tune:
            settings.progress.from_cache()
        return _remember(key_text, config, measured=True)
    if not tune or (settings.should_measure is not None and not settings.should_measure(kernel, problem, candidates)):
        arch, sm_count = (facts[1], facts[2]) if facts is not None else (None, tile_heuristic.SM_COUNT)
        return _remember(key_text, default_config(kernel, candidates, problem, arch, sm_count), measured=False)
    config, timings = _measure(kernel, key, candidates, bench, problem, settings)
    entry = {
        "kernel": kernel,
        "key": key_text,
        "config": asdict(config),
        "problem": asdict(problem) if problem is not None else None,
        "timings_ms": [[asdict(c), t if math.isfinite(t) else None] for c, t in timings],
    }
    merge_into_cache(path, {_entry_id(key_text): entry})
    return _remember(key_text, config, measured=True)


def _remember(key_text: str, config: TileConfig, measured: bool) -> TileConfig:
    with _lock:
        _memory[key_text] = _Choice(config, measured)
    return config


def _measure(
    kernel: str,
    key: dict[str, Any],
    candidates: Sequence[TileConfig],
    bench: Callable[[TileConfig], float],
    problem: Problem | None,
    settings: _Tuning,
) -> tuple[TileConfig, list[tuple[TileConfig, float]]]:
    label = kernel + (f" {problem.m}x{problem.n}x{problem.k}" if problem is not None else "")
    best = dict.fromkeys(candidates, math.inf)
    failed: dict[TileConfig, Exception] = {}
    total, done = settings.rounds * len(candidates), 0
    token = _bench_rep.set(settings.rep_ms)
    try:
        for _ in range(settings.rounds):
            for candidate in candidates:
                if candidate not in failed:
                    try:
                        best[candidate] = min(best[candidate], float(bench(candidate)))
                    except Exception as err:  # compile errors (out of resources) and launch failures alike
                        failed[candidate] = err
                done += 1
                if settings.progress is not None:
                    settings.progress.step(label, done, total)
    finally:
        _bench_rep.reset(token)
    timings = [(c, math.inf if c in failed else best[c]) for c in candidates]
    config, best_ms = min(timings, key=lambda item: item[1])
    if not math.isfinite(best_ms):
        first_error = next(iter(failed.values()), None)
        raise RuntimeError(f"{kernel}: every tile candidate failed for {key}") from first_error
    if settings.progress is not None:
        settings.progress.shape_done(label, config, best_ms, len(candidates))
    return config, timings


# --- candidates and measuring ---------------------------------------------------------------------------


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


_bench_rep: contextvars.ContextVar[int] = contextvars.ContextVar("fuser_bench_rep", default=20)


def do_bench_ms(fn: Callable[[], Any]) -> float:
    """Median milliseconds of ``fn`` over ``rep_ms`` of repeats (the tuning context's; 20 by default).

    Replayed from a CUDA graph, as fused models run by default: timed with plain launches, a small
    kernel measures the host's launch cost (about 10 us on the H200 for every candidate alike) instead
    of the kernel, and the choice among candidates is noise. A function that cannot be captured is
    timed with plain launches."""
    import triton.testing
    from triton.runtime.errors import OutOfResources

    rep = _bench_rep.get()
    try:
        # do_bench_cudagraph replays its graph of about ``rep`` ms ten times: a tenth keeps the time spent
        # per candidate what ``rep_ms`` says.
        return float(triton.testing.do_bench_cudagraph(fn, rep=max(1, rep // 10), return_mode="median"))
    except OutOfResources:
        raise
    except RuntimeError:
        return float(triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="median"))
