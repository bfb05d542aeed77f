"""Counting and timing a model's forward pass, for the demo and the benchmarks.

On CUDA a "launch" is a kernel the profiler saw run on the GPU. On the CPU there are no kernels; what is
counted there is every aten op executed, including the ones inside fused ops (the torch reference runs a
fused conv as conv-with-bias plus its epilogue ops), so the CPU count is an honest measure of work items.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def count_launches(fn: Callable[[], Any], device: torch.device) -> int:
    """GPU kernels launched by ``fn()`` on CUDA; aten ops executed on the CPU."""
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    # Outermost aten ops only (an aten op calling others counts once); fuser's ops are not aten, so the
    # ops inside them count as outermost.
    return sum(
        1
        for e in prof.events()
        if e.name.startswith("aten::") and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))
    )


def _call_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Wall time of one ``fn()`` in milliseconds (CUDA events on the GPU, perf_counter on the CPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def interleaved_ms(
    fns: dict[str, Callable[[], Any]], device: torch.device, repeats: int = 20, warmup: int = 3
) -> dict[str, list[float]]:
    """Each call's time in milliseconds, per name of ``fns``, the functions called in turn (repeat r of every one,
    then repeat r + 1) after ``warmup`` calls of each. Timed one after the other, a slower phase of a shared
    machine (another job starting) falls on one side only: a CPU demo once printed 11.8x for what measured as
    break-even interleaved. Compare with :func:`pairwise_ratio`."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(_call_ms(fn, device))
    return times


def pairwise_ratio(before: list[float], after: list[float]) -> float:
    """The median of ``before[r] / after[r]`` over the repeats of :func:`interleaved_ms`: each ratio compares two
    calls made next to each other, so load that drifts over the run cancels."""
    return statistics.median(b / a for b, a in zip(before, after, strict=True))
