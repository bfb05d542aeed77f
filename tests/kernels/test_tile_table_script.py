"""The parts of benchmarks/tile_table.py that need no GPU: how many launches per shape class it measures,
and its summary of the cost model against the measurements."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from fuser.kernels import autotune, tile_table
from fuser.kernels.tile_config import Problem, TileConfig

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tile_table.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("tile_table_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _entry(problem: Problem, timings: list[tuple[TileConfig, float]]) -> dict:
    return {
        "kernel": "gemm_act",
        "key": "{}",
        "problem": problem.__dict__,
        "timings_ms": [[c.__dict__, t] for c, t in timings],
    }


def test_per_class_limit_counts_the_cache(script, tmp_path: Path) -> None:
    cached, same_class, other = Problem(1000, 60, 300), Problem(1001, 61, 301), Problem(5, 60, 300)
    path = tmp_path / "tiles-x.json"
    assert autotune.merge_into_cache(path, {"a": _entry(cached, [(TileConfig(64, 64, 32), 1.0)])})
    should_measure = script._class_limit(path, per_class=2)
    rows = [TileConfig(64, 64, 32)]
    assert should_measure("gemm_act", same_class, rows) is True  # the class's second launch
    assert should_measure("gemm_act", same_class, rows) is False
    assert [should_measure("gemm_act", other, rows) for _ in range(3)] == [True, True, False]
    assert should_measure("gemm_act", None, rows) is True  # a launch without a problem cannot be classed


def test_per_class_limit_still_measures_a_launch_offering_other_kinds_of_tile(script, tmp_path: Path) -> None:
    """A stage's stride-1 3x3 conv has the GEMM shape of the stride-2 conv before it, but its list adds shifted
    taps: a full class still measures it (else the table never ranks shifted taps for that class)."""
    stride2, stride1 = Problem(25088, 128, 1152), Problem(25088, 128, 1152)
    rows = [TileConfig(128, 128, 64, 8, 8, 3), TileConfig(64, 128, 64, 8, 4, 4)]
    shifted = [*rows, dataclasses.replace(rows[0], tap_shift=1)]
    path = tmp_path / "tiles-x.json"
    measured = {**_entry(stride2, [(c, 1.0) for c in rows]), "kernel": "conv2d_act"}
    assert autotune.merge_into_cache(path, {"a": measured})
    should_measure = script._class_limit(path, per_class=1)
    assert should_measure("conv2d_act", stride2, rows) is False
    assert should_measure("conv2d_act", stride1, shifted) is True
    assert should_measure("conv2d_act", stride1, shifted) is False


def test_summary_says_how_far_the_model_is(script) -> None:
    candidates = [TileConfig(64, 64, 32), TileConfig(128, 128, 32, 8, 8, 4)]
    entries = [_entry(Problem(1000, 60, 300), [(candidates[0], 1.0), (candidates[1], 2.0)])]
    table = tile_table.build_table(entries, "sm90", {}, sm_count=132)
    text = script._summary(table)
    rel = next(iter(table["entries"].values()))["model_rel"]
    assert text.startswith("1 shape classes; the cost model's pick against the measured best: geomean")
    assert f"{rel:.3f}x" in text
