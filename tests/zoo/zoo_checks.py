"""One zoo model built, optimized and checked as a user would: the figures that test_zoo asserts on and that
benchmarks/zoo_cpu.py writes to the README's table. Both call :func:`evaluate`, so the two cannot disagree.

The checks per model (None: passed, else what failed):

- bn: every BatchNorm that runs is folded into a fused chain or into the layer after it (the report's
  ``BATCH_NORM_FOLDS`` rewrites), or named in the report's rejected chains, and
  the optimized module runs exactly the BatchNorms the report leaves unfolded (counted as batch_norm ops);
- error: ``fuser.verify`` against a float64 run of the original, within the tolerance table (ieee);
  where float32 itself is further than that from float64 (a deep random net), within twice the original's
  own float32 error;
- untouched: the user's model has the same state and gives the same output after optimize();
- save_load: ``torch.save`` / ``torch.load`` of the optimized module gives the same output;
- no_dead_weights: the optimized module holds no more parameter and buffer elements than the original.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from accuracy import TOLERANCE
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from zoo_models import ZooModel

import fuser
from fuser.report import BATCH_NORM_FOLDS

CHECKS = ["bn", "error", "untouched", "save_load", "no_dead_weights"]


def prepare() -> None:
    """Make the zoo's libraries importable here (call before importing them): torchvision's NMS operators
    (see torchvision_shim), and ultralytics without update checks (the test machines have no network)."""
    import torchvision_shim

    os.environ.setdefault("YOLO_OFFLINE", "1")
    torchvision_shim.install()


class _BatchNormCount(TorchDispatchMode):
    """Counts the batch_norm ops a forward runs, whoever calls them (a module, F.batch_norm, a graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if "batch_norm" in str(func):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _batch_norms_run(module: nn.Module, x: torch.Tensor) -> int:
    with torch.no_grad(), _BatchNormCount() as counter:
        module(x)
    return counter.count


def _leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _same(a: Any, b: Any) -> bool:
    la, lb = _leaves(a), _leaves(b)
    return len(la) == len(lb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(la, lb, strict=True))


def _numel(module: nn.Module) -> int:
    """The elements of the module's state dict, a tensor stored under several names (a layer used at several
    places, ALBERT's) counted once, as torch.save stores it."""
    return sum({t.data_ptr(): t.numel() for t in module.state_dict().values()}.values())


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread inside: at the zoo's batch sizes of 1-2 and its input sizes two threads contend more
    than they share (on a busy 2-core machine a model took 25x longer)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def evaluate(zoo: ZooModel) -> dict[str, Any]:
    """Build, optimize and check one zoo model (on :func:`one_thread`). JSON-ready figures."""
    with one_thread():
        return _checks(zoo)


def _checks(zoo: ZooModel) -> dict[str, Any]:
    model, x = zoo.build(), zoo.example_input()
    calls: Counter[str] = Counter()
    bns = {n: m for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    handles = [m.register_forward_hook(lambda *_, n=n: calls.update([n])) for n, m in bns.items()]
    with torch.no_grad():
        expected = model(x)
    for h in handles:
        h.remove()
    state = {k: v.clone() for k, v in model.state_dict().items()}

    start = time.perf_counter()
    optimized = fuser.optimize(model, (x,), precision="ieee", backend="torch")
    optimize_s = time.perf_counter() - start
    report = optimized.fusion_report
    result = fuser.verify(model, optimized, (x,), layers=False)
    failures: dict[str, str | None] = dict.fromkeys(CHECKS)

    folded = {m for e in report.fused if "batch_norm" in e.ops for m in e.modules if m in calls}
    folded |= {r.location for r in report.rewrites if r.kind in BATCH_NORM_FOLDS and r.location in calls}
    reasons = {m: e.reason for e in report.rejected for m in e.modules if m in calls and m not in folded}
    unfolded = sorted(set(calls) - folded)
    missing = [m for m in unfolded if m not in reasons]
    bn_ops_before, bn_ops_after = _batch_norms_run(model, x), _batch_norms_run(optimized, x)
    left = sum(calls[m] for m in unfolded)
    if missing:
        failures["bn"] = f"{len(missing)} of {len(calls)} BatchNorms neither folded nor reported: {missing[:4]}"
    elif bn_ops_after != left:
        failures["bn"] = f"the report leaves {left} BatchNorm calls unfolded, the optimized module runs {bn_ops_after}"

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

    return {
        "model": zoo.name,
        "library": zoo.source,
        "task": zoo.task,
        "input_shape": list(zoo.input_shape),
        "chains_fused": len(report.fused),
        "chains_rejected": len(report.rejected),
        "untraced": len(report.untraced),
        "bn_total": len(calls),
        "bn_folded": len(folded),
        "bn_ops_before": bn_ops_before,
        "bn_ops_after": bn_ops_after,
        "bn_unfolded": {m: reasons.get(m) for m in unfolded},
        "rel_error": result.rel_error,
        "baseline_error": result.baseline_error,
        "top1_agreement": result.top1_agreement,
        "box_agreement": result.box_agreement,
        "elements_before": before,
        "elements_after": after,
        "optimize_s": round(optimize_s, 3),
        "failures": failures,
    }


def batch_norms_folded(results: list[dict[str, Any]]) -> float:
    """The share of all batch_norm ops the originals run that their optimized modules no longer run."""
    before = sum(r["bn_ops_before"] for r in results)
    return (before - sum(r["bn_ops_after"] for r in results)) / before
