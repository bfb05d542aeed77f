"""The table of measured tile choices shipped with the package, one JSON file per GPU architecture
(``tile_table_sm90.json``), read the first time a kernel plans a launch on such a GPU.

The table is made from measurements, never by hand: ``benchmarks/tile_table.py`` tunes representative
models and GEMMs on the GPU (autotune's disk cache records every candidate's time) and :func:`build_table`
turns those cache entries into the table. Entries are keyed by shape class, :func:`shape_class`:
kernel, precision, operand size, and the power-of-two buckets of the problem's M, N, K and groups. An
entry ranks the configs measured on the shapes of its class (geometric mean over those shapes of each
config's time over the shape's best); a lookup returns the best-ranked config that is among the
launch's own candidates, so the table can only ever return a candidate, and a config a kernel no longer
offers is skipped. A config is stored as the :class:`TileConfig` fields it sets; a field it lacks takes
its default (``split_k`` = 1), so tables written before a field existed stay valid.

Format (``format`` 1)::

    {"format": 1, "arch": "sm90", "source": {...versions, GPU, date, command...},
     "entries": {"conv2d_act|tf32|b4|m16384|n64|k1024|g1":
                   {"ranked": [{"config": {"block_m": 128, ...}, "rel": 1.0}, ...],
                    "shapes": [[m, n, k, groups], ...], "model_rel": 1.07, "first_rel": 1.12}}}

``model_rel`` is how much slower the cost model's pick (tile_heuristic) was than the measured best on
that class, ``first_rel`` the same for the kernel's own default (its list's first candidate): the
evidence for trusting the model, and its margin over the list's order, where the table has no entry.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from . import tile_heuristic
from .tile_config import Problem, TileConfig

TABLE_FORMAT = 1
TABLE_DIR = Path(__file__).parent
_FIELDS = {f.name for f in fields(TileConfig)}
_loaded: dict[Path, dict[str, Any]] = {}


def _bucket(x: int) -> int:
    return 0 if x <= 0 else 1 << (x - 1).bit_length()


def shape_class(kernel: str, problem: Problem) -> str:
    """The table key of a problem: kernel, precision, operand bytes, and power-of-two buckets."""
    p = problem
    return (
        f"{kernel}|{p.precision}|b{p.operand_bytes}|m{_bucket(p.m)}|n{_bucket(p.n)}|k{_bucket(p.k)}"
        f"|g{_bucket(p.groups)}"
    )


def table_path(arch: str) -> Path:
    return TABLE_DIR / f"tile_table_{arch}.json"


def load(arch: str) -> dict[str, Any]:
    """The entries of ``arch``'s table ({} when none is shipped or it is unreadable), read once."""
    path = table_path(arch)
    if path not in _loaded:
        try:
            data = json.loads(path.read_text())
            entries = data["entries"] if data.get("format") == TABLE_FORMAT else {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            entries = {}
        _loaded[path] = entries if isinstance(entries, dict) else {}
    return _loaded[path]


def forget_loaded() -> None:
    """Read the table files again on the next lookup."""
    _loaded.clear()


def config_from_dict(data: Any) -> TileConfig | None:
    """A TileConfig from its stored fields, None when they do not describe one."""
    if not isinstance(data, dict) or not set(data) <= _FIELDS:
        return None
    try:
        return TileConfig(**{name: int(value) for name, value in data.items()})
    except (TypeError, ValueError):
        return None


def lookup(arch: str, kernel: str, problem: Problem, candidates: Sequence[TileConfig]) -> TileConfig | None:
    """The best-ranked config of the problem's class that is one of ``candidates``, or None."""
    entry = load(arch).get(shape_class(kernel, problem))
    if not isinstance(entry, dict):
        return None
    for ranked in entry.get("ranked", ()):
        config = config_from_dict(ranked.get("config") if isinstance(ranked, dict) else None)
        if config is not None and config in candidates:
            return config
    return None


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def build_table(
    cache_entries: Iterable[dict[str, Any]], arch: str, source: dict[str, Any], sm_count: int
) -> dict[str, Any]:
    """The table for ``arch`` from autotune cache entries (``read_cache_file(...).values()``) measured on
    a GPU of that architecture with ``sm_count`` SMs. Entries without a problem or timings are skipped.

    A config that failed to run on any shape of a class is left out of that class's ranking.
    """
    shapes: dict[str, list[dict[TileConfig, float]]] = defaultdict(list)
    problems: dict[str, list[Problem]] = defaultdict(list)
    seen: set[tuple[Problem, frozenset[TileConfig]]] = set()
    kernels: dict[str, str] = {}
    for entry in cache_entries:
        try:
            problem = Problem(**entry["problem"])
            timings = {config_from_dict(c): (math.inf if t is None else float(t)) for c, t in entry["timings_ms"]}
        except (KeyError, TypeError, ValueError):
            continue
        timings.pop(None, None)
        if not timings or not any(math.isfinite(t) for t in timings.values()):
            continue
        cls = shape_class(entry["kernel"], problem)
        # The same problem measured under another key (strides, epilogue) over the same candidates counts
        # once. Over other candidates it is a launch of its own: a stride-1 3x3 conv has the GEMM shape of
        # the stride-2 conv opening its stage, and only the stride-1 one can take shifted taps.
        if (problem, frozenset(timings)) in seen:
            continue
        seen.add((problem, frozenset(timings)))  # type: ignore[arg-type]
        shapes[cls].append(timings)  # type: ignore[arg-type]
        problems[cls].append(problem)
        kernels[cls] = entry["kernel"]

    table: dict[str, Any] = {}
    for cls, measured in sorted(shapes.items()):
        failed = {c for timings in measured for c, t in timings.items() if not math.isfinite(t)}
        ratios: dict[TileConfig, list[float]] = defaultdict(list)  # in the order candidates were listed
        model: list[float] = []
        first: list[float] = []
        for timings, problem in zip(measured, problems[cls], strict=True):
            best = min(timings.values())
            for config, t in timings.items():
                if config not in failed:
                    ratios[config].append(t / best)
            picked = tile_heuristic.pick(kernels[cls], list(timings), problem, sm_count)
            model.append(timings[picked] / best)
            first.append(next(iter(timings.values())) / best)
        order = {config: i for i, config in enumerate(ratios)}
        ranked = sorted(ratios.items(), key=lambda item: (_geomean(item[1]), order[item[0]]))
        table[cls] = {
            "ranked": [{"config": asdict(c), "rel": round(_geomean(r), 4)} for c, r in ranked],
            "shapes": [[p.m, p.n, p.k, p.groups] for p in problems[cls]],
            "model_rel": round(_geomean(model), 4) if all(math.isfinite(v) for v in model) else None,
            "first_rel": round(_geomean(first), 4) if all(math.isfinite(v) for v in first) else None,
        }
    return {"format": TABLE_FORMAT, "arch": arch, "source": source, "entries": table}
