"""Test-wide setup: GPU tests are skipped, with the reason printed (-rs), where there is no CUDA; fuser runs
in strict mode (an internal error in a pass raises instead of leaving the graph unoptimized); torchvision
imports beside the CPU torch (tests/torchvision_shim.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# The repository root last on the path (benchmarks/__init__.py says why: its kernels/ folder would shadow the
# PyPI `kernels` that transformers imports), whether pytest ran as `python -m pytest` or as `pytest`.
sys.path.append(str(Path(__file__).resolve().parent.parent))
import torchvision_shim

import benchmarks  # noqa: F401  (importing it reorders sys.path)

# torchvision (imported by timm, ultralytics and transformers) needs its NMS operators defined first where its
# compiled ops do not load beside the CPU torch: any test file that imports one of them then runs on its own.
torchvision_shim.install()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: run `pytest -m gpu` on a machine with one")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test draws from a known seed, so a failure reproduces."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _default_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Correctness tests take each kernel's default tile config: measuring the candidates of every shape a
    whole model has would compile and time dozens of kernels per test. Tests of the tuning set it back."""
    monkeypatch.setenv("FUSER_AUTOTUNE", "0")


@pytest.fixture(autouse=True)
def _no_compile_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each optimize() on CUDA would start one compile worker per core; with pytest-xdist's processes
    that is a few hundred interpreters importing torch. The workers' own tests set the variable back."""
    monkeypatch.setenv("FUSER_COMPILE_WORKERS", "0")


@pytest.fixture(autouse=True)
def _strict(monkeypatch: pytest.MonkeyPatch) -> None:
    """FUSER_STRICT=1: a bug inside a pass fails the test instead of quietly leaving its graph unfused."""
    monkeypatch.setenv("FUSER_STRICT", "1")
