"""Benchmarks, run from the repository root as ``python -m benchmarks.<name>``.

Importing this package moves the repository root to the end of ``sys.path``. ``python -m`` (and pytest run
that way) puts the working directory first, and there the top-level ``kernels/`` folder, which is installed
as ``fuser.kernels``, would shadow the PyPI distribution ``kernels`` that transformers >= 5.25 requires and
imports (its ``is_kernels_available`` finds the folder, then fails on a name the folder lacks). Last on the
path, the root still provides ``benchmarks`` and ``tests``' helpers, and every installed distribution comes
first."""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def keep_repo_root_last() -> None:
    """Move every ``sys.path`` entry naming the repository root (``''`` or ``'.'`` when the working directory is
    the root) to the end, as one entry."""
    cwd = Path.cwd().resolve()
    names_root = lambda entry: (Path(entry).resolve() if entry not in ("", ".") else cwd) == REPO_ROOT
    sys.path[:] = [entry for entry in sys.path if not names_root(entry)] + [str(REPO_ROOT)]


keep_repo_root_last()
