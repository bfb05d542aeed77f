"""Tuning as a per-call and per-model choice: ``optimize(..., tune=True)`` and ``fuser tune MODEL``;
without it nothing is measured (the default tile configs of fuser.kernels.autotune)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accuracy import assert_close, reference64
from torch import nn
from toy_models import ConvBnAct, seeded

import fuser
from fuser import cli, models
from fuser.kernels import autotune, set_cache_dir


class TuningProbe(nn.Module):
    """Records, on every call, whether the kernels would measure their tile candidates."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(autotune.tuning_enabled())
        return x * 1.5


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FUSER_AUTOTUNE", raising=False)


def test_tune_is_per_model(no_env: None) -> None:
    x = torch.randn(2, 5, 9, 11)
    model = seeded(ConvBnAct(nn.SiLU()))
    tuned, untuned = fuser.optimize(model, x, tune=True), fuser.optimize(model, x)
    assert tuned.tune and not untuned.tune
    with torch.no_grad():
        assert_close(tuned(x), reference64(model, x), "tf32", "tuned model on the CPU")
    for optimized, expected in ((tuned, True), (untuned, False)):
        probe = TuningProbe()
        optimized.module = probe
        optimized.replay = None  # the CUDA-graph replayer holds the module it was made for
        optimized(x)
        assert probe.seen == [expected]
    with autotune.tuning():  # a caller's own tuning context reaches the untuned model's kernels too
        untuned(x)
    assert probe.seen == [False, True]


def test_tune_survives_save_and_old_pickles_load_untuned(no_env: None, tmp_path: Path) -> None:
    x = torch.randn(1, 5, 9, 11)
    tuned = fuser.optimize(seeded(ConvBnAct(nn.ReLU())), x, tune=True)
    torch.save(tuned, tmp_path / "m.pt")
    assert torch.load(tmp_path / "m.pt", weights_only=False).tune
    del tuned.__dict__["tune"]  # as a module saved before the option existed
    assert tuned.tune is False


def test_tune_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="tune must be True or False, got 'yes'"):
        fuser.optimize(seeded(ConvBnAct(nn.ReLU())), torch.randn(1, 5, 9, 11), tune="yes")


def test_cli_tune_needs_a_gpu_and_kernels() -> None:
    with pytest.raises(SystemExit, match="needs a CUDA GPU, but --device is cpu"):
        cli.main(["tune", "resnet26", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--backend torch runs no compiled kernels"):
        cli.main(["tune", "resnet26", "--device", "cuda", "--backend", "torch"])


@pytest.mark.gpu
def test_untuned_optimize_measures_nothing_and_tuning_is_cached(
    no_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the GPU: optimize() measures nothing; `fuser tune` measures and caches every launch signature,
    with a progress line on stderr; a later optimize(tune=True) of the same shapes reads the cache."""
    real_bench = autotune.do_bench_ms
    measured: list[int] = []
    monkeypatch.setattr(autotune, "do_bench_ms", lambda fn: measured.append(1) or real_bench(fn))
    set_cache_dir(tmp_path)
    try:
        model = seeded(ConvBnAct(nn.SiLU(), c_in=19, c_out=45)).cuda()
        x = torch.randn(2, 19, 33, 31, device="cuda")
        fuser.optimize(model, x)
        assert measured == [] and not list(tmp_path.glob("tiles-*.json"))

        assert cli.main(["tune", "resnet26", "--input-shape", "1,3,35,33", "--cache-dir", str(tmp_path)]) == 0
        assert measured and "fuser tune:" in capsys.readouterr().err
        (cache,) = tmp_path.glob("tiles-*.json")
        entries = json.loads(cache.read_text())["entries"].values()
        assert entries and all(sum(t is not None for _, t in e["timings_ms"]) >= 1 for e in entries)

        measured.clear()
        set_cache_dir(tmp_path)
        model26 = models.build("resnet26").cuda()
        tuned = fuser.optimize(model26, models.example_input("resnet26", 1, (35, 33)).cuda(), tune=True)
        assert measured == [], "every launch signature was read from the cache"
        assert tuned.tune
    finally:
        set_cache_dir(None)
