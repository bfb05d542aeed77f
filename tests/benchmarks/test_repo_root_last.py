"""The repository root stays behind the installed distributions on ``sys.path`` (benchmarks/__init__.py): its
top-level ``kernels/`` folder must not shadow the PyPI ``kernels`` that transformers >= 5.25 imports."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import pytest

import benchmarks


def test_the_root_is_moved_behind_every_other_entry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    root = str(benchmarks.REPO_ROOT)
    monkeypatch.chdir(benchmarks.REPO_ROOT)
    monkeypatch.setattr(sys, "path", ["", str(tmp_path), root, "."])
    benchmarks.keep_repo_root_last()
    assert sys.path == [str(tmp_path), root]


def test_in_this_run_installed_packages_come_before_the_root() -> None:
    root = str(benchmarks.REPO_ROOT)
    # the distributions' own folders: a package may append a folder inside one later (setuptools appends its
    # site-packages/setuptools/_vendor when something imports it), which shadows nothing of the root's
    installed = [i for i, entry in enumerate(sys.path) if Path(entry).name in ("site-packages", "dist-packages")]
    assert installed and sys.path.index(root) > max(installed), sys.path
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return  # without the PyPI distribution only the order above can be checked
    spec = importlib.util.find_spec("kernels")
    assert spec is not None and Path(spec.origin).parent != benchmarks.REPO_ROOT / "kernels", spec
