"""The timing helpers of the demo and the CPU benchmark (fuser/runtime/profiling.py), and the demo's run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fuser import demo
from fuser.runtime.profiling import interleaved_ms, pairwise_ratio

CPU = torch.device("cpu")


def test_interleaved_calls_every_function_in_turn_after_its_warmup() -> None:
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("eager", "fused", "third")}
    times = interleaved_ms(fns, CPU, repeats=5, warmup=2)
    assert calls[:6] == ["eager"] * 2 + ["fused"] * 2 + ["third"] * 2
    assert calls[6:] == ["eager", "fused", "third"] * 5
    assert {name: len(t) for name, t in times.items()} == dict.fromkeys(fns, 5)
    assert all(t >= 0 for ts in times.values() for t in ts)


def test_pairwise_ratio_cancels_load_that_arrives_mid_run() -> None:
    """Both sides slowed tenfold from the third pair on (another job started): each pair still compares calls made
    next to each other."""
    assert pairwise_ratio([3.1, 2.9, 31.0, 29.0, 30.0], [3.0, 3.0, 30.0, 30.0, 31.0]) == pytest.approx(1.0, abs=0.04)
    assert pairwise_ratio([4.0, 4.2, 40.0, 41.0, 39.0], [2.0, 2.0, 20.0, 20.0, 20.0]) == pytest.approx(2.0, abs=0.06)


def test_demo_runs_on_the_cpu_and_reports_the_paired_speedup(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert demo.main(["--model", "resnet26", "--size", "35", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "eager and fused in turn" in out and "the fused ops run their torch reference" in out
    summary = json.loads((tmp_path / "demo-resnet26-cpu.json").read_text())
    assert summary["fused"] > 0 and summary["rel_error"] < 1e-5
    assert 0 < summary["speedup_pairwise"] < 100 and summary["eager_ms"] > 0 and summary["fused_ms"] > 0
    assert (tmp_path / "demo-resnet26-cpu-layer-error.png").stat().st_size > 0
