"""Real third-party models (tests/zoo/zoo_models.py), optimized as a user would: the checks per model.

- bn: every BatchNorm that runs is folded into a fused chain, or named in the report's rejected chains;
- error: ``fuser.verify`` against a float64 run of the original, within the tolerance table (ieee);
  where float32 itself is further than that from float64 (a deep random net), within twice the original's
  own float32 error;
- untouched: the user's model has the same state and gives the same output after optimize();
- save_load: ``torch.save`` / ``torch.load`` of the optimized module gives the same output;
- no_dead_weights: the optimized module holds no more parameter and buffer elements than the original.

Each model is built and optimized once (torch backend, ieee) and its checks are separate tests, so a known
bug marks one (model, check) pair xfail(strict=True) in KNOWN_FAILURES, not the model. Set
FUSER_ZOO_RESULTS=path.jsonl to write one line of figures per model (the README's table comes from it).
"""

from __future__ import annotations

import functools
import io
import json
import os
from typing import Any

import pytest
import torch
from accuracy import TOLERANCE
from torch import nn
from torch.utils._pytree import tree_flatten

for _library in ("torchvision", "timm", "ultralytics", "transformers"):
    pytest.importorskip(_library, reason=f"the zoo needs {_library}: `make test` installs it (Makefile, extra 'zoo')")

from zoo_models import ZOO, ZooModel  # noqa: E402

import fuser  # noqa: E402

CHECKS = ["bn", "error", "untouched", "save_load", "no_dead_weights"]

# (model, check) -> the bug that makes it fail today. strict: when a fix lands, the test says so.
KNOWN_FAILURES: dict[tuple[str, str], str] = {}


def _leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _same(a: Any, b: Any) -> bool:
    la, lb = _leaves(a), _leaves(b)
    return len(la) == len(lb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(la, lb, strict=True))


def _numel(module: nn.Module) -> int:
    return sum(t.numel() for t in module.state_dict().values())


@functools.cache
def _evaluate(name: str) -> dict[str, Any]:
    """Build, optimize and check one zoo model on one thread (at batch 1-2 and these sizes two threads
    contend more than they share: on a busy 2-core machine a model took 25x longer)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _checks(name)
    finally:
        torch.set_num_threads(threads)


def _checks(name: str) -> dict[str, Any]:
    """The figures of one zoo model and, per check, None (passed) or what failed."""
    zoo: ZooModel = next(z for z in ZOO if z.name == name)
    model, x = zoo.build(), zoo.example_input()
    ran: list[str] = []
    bns = {n: m for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    handles = [m.register_forward_hook(lambda *_, n=n: ran.append(n)) for n, m in bns.items()]
    with torch.no_grad():
        expected = model(x)
    for h in handles:
        h.remove()
    state = {k: v.clone() for k, v in model.state_dict().items()}

    optimized = fuser.optimize(model, (x,), precision="ieee", backend="torch")
    report = optimized.fusion_report
    result = fuser.verify(model, optimized, (x,), layers=False)
    failures: dict[str, str | None] = dict.fromkeys(CHECKS)

    folded = {m for e in report.fused if "batch_norm" in e.ops for m in e.modules if m in bns}
    named = {m for e in report.rejected for m in e.modules if m in bns}
    missing = sorted(set(ran) - folded - named)
    if missing:
        failures["bn"] = f"{len(missing)} of {len(set(ran))} BatchNorms neither folded nor reported: {missing[:4]}"

    allowed = max(TOLERANCE["ieee"], 2 * result.baseline_error)
    if not result.rel_error <= allowed:
        failures["error"] = f"relative error {result.rel_error:.2e} > {allowed:.1e}\n{result}"

    with torch.no_grad():
        again = model(x)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, state[k])]
    if changed or not _same(again, expected) or model.training:
        failures["untouched"] = f"the user's model changed: {changed[:4]}, same output: {_same(again, expected)}"

    try:
        buffer = io.BytesIO()
        torch.save(optimized, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        with torch.no_grad():
            if not _same(loaded(x), optimized(x)):
                failures["save_load"] = "the loaded module gives another output"
    except Exception as error:
        failures["save_load"] = f"{type(error).__name__}: {str(error)[:300]}"

    before, after = _numel(model), _numel(optimized)
    if after > before:
        failures["no_dead_weights"] = f"state_dict holds {after} elements against {before} in the original"

    figures = {
        "model": name,
        "source": zoo.source,
        "task": zoo.task,
        "fused": len(report.fused),
        "bn_folded": len(folded & set(ran)),
        "bn_total": len(set(ran)),
        "rel_error": result.rel_error,
        "baseline_error": result.baseline_error,
        "top1_agreement": result.top1_agreement,
        "box_agreement": result.box_agreement,
        "failures": failures,
    }
    path = os.environ.get("FUSER_ZOO_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(figures) + "\n")
    return figures


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
