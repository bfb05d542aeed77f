"""benchmarks/tf32_layers.py on the CPU: the four emulated runs of a small model, each error printed."""

from __future__ import annotations

import re
import sys

import pytest

from benchmarks import tf32_layers


@pytest.mark.slow
def test_prints_the_errors_of_every_run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(sys, "argv", ["tf32_layers", "fuser.resnet26", "--size", "67"])
    tf32_layers.main()
    text = capsys.readouterr().out
    errors = {m[0].strip(): float(m[1]) for m in re.findall(r"^  (.+?)\s+([0-9.]+e[-+][0-9]+)$", text, re.M)}
    assert len(errors) == 6, text
    truncated, compensated = errors["fuser, activations truncated"], errors["fuser, stores + compensation"]
    assert 0 < compensated < truncated / 1.5 and compensated < 2 * errors["cuDNN tf32 (operands to nearest)"], text
    assert re.search(r"\d+ store TF32-rounded outputs, \d+ compensate truncated inputs", text)
