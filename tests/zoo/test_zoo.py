"""Real third-party models (tests/zoo/zoo_models.py), optimized as a user would: the checks per model
(tests/zoo/zoo_checks.py says what each checks), and the share of all BatchNorms folded across the zoo.

Each model is built and optimized once per session (torch backend, ieee) and its checks are separate tests,
so a known bug marks one (model, check) pair xfail(strict=True) in KNOWN_FAILURES, not the model. The
README's table of these figures is written by benchmarks/zoo_cpu.py, from the same checks.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

for _library in ("torchvision", "timm", "ultralytics", "transformers"):
    pytest.importorskip(_library, reason=f"the zoo needs {_library}: `make test` installs it (Makefile, extra 'zoo')")

from zoo_checks import CHECKS, batch_norms_folded, evaluate  # noqa: E402
from zoo_models import ZOO  # noqa: E402

# (model, check) -> the bug that makes it fail today. strict: when a fix lands, the test says so.
KNOWN_FAILURES: dict[tuple[str, str], str] = {}

# The target for the whole zoo. DenseNet's BatchNorm -> ReLU after each concat (in its two DenseNet-121s) goes
# into the operand prologue of the conv after it and LeViT's head BatchNorm1d into its linear's weights
# (fuser.rewrite.batchnorm_prologue); what stays is each DenseNet's last BatchNorm -> ReLU before the pool.
MIN_BATCH_NORMS_FOLDED = 0.98
# What the zoo folds today (2289 of its 2291 BatchNorm calls): a change that folds fewer fails here.
MIN_BATCH_NORMS_FOLDED_NOW = 0.998


@functools.cache
def _evaluate(name: str) -> dict[str, Any]:
    return evaluate(next(z for z in ZOO if z.name == name))


def _cases() -> list[Any]:
    cases = []
    for zoo in ZOO:
        for check in CHECKS:
            reason = KNOWN_FAILURES.get((zoo.name, check))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            cases.append(pytest.param(zoo.name, check, marks=marks, id=f"{zoo.name}-{check}"))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize(("name", "check"), _cases())
def test_zoo(name: str, check: str):
    failure = _evaluate(name)["failures"][check]
    assert failure is None, f"{name}: {check}: {failure}"


def _share_folded() -> tuple[float, dict[str, str]]:
    results = [_evaluate(z.name) for z in ZOO]
    still_run = {r["model"]: f"{r['bn_ops_after']} of {r['bn_ops_before']}" for r in results if r["bn_ops_after"]}
    return batch_norms_folded(results), still_run


@pytest.mark.slow
def test_zoo_folds_batch_norms_overall():
    share, still_run = _share_folded()
    assert share >= MIN_BATCH_NORMS_FOLDED, f"{share:.1%} of the zoo's BatchNorms folded; still running: {still_run}"


@pytest.mark.slow
def test_zoo_folds_no_fewer_batch_norms_than_now():
    share, still_run = _share_folded()
    assert share >= MIN_BATCH_NORMS_FOLDED_NOW, f"{share:.1%} folded; still running: {still_run}"
