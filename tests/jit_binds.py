"""Counting JITFunction.run calls: the binding a plan's direct launch (kernels/launch.py, LaunchOptions)
skips after its first call."""

from __future__ import annotations

import pytest


def count_jit_binds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on (until ``monkeypatch`` undoes it) every ``JITFunction.run`` appends its kernel's name to
    the returned list, and then runs as before."""
    from triton.runtime.jit import JITFunction

    binds: list[str] = []
    real_run = JITFunction.run

    def counting_run(self, *args, **kwargs):
        binds.append(self.fn.__name__)
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", counting_run)
    return binds
