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


def median_ms(fn: Callable[[], Any], device: torch.device, repeats: int = 20, warmup: int = 3) -> float:
    """Median wall time of ``fn()`` in milliseconds (CUDA events on the GPU, perf_counter on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
