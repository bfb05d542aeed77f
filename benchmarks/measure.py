"""How the benchmarks time a forward and profile its kernels, on CUDA and on the CPU.

Timing: ``calls`` back-to-back calls between two CUDA events (perf_counter on the CPU), divided by
``calls``; the median of ``repeats`` such runs. A forward is timed as the caller gets it, CUDA-graph
replays and their output copies included.

Profile: one forward under torch.profiler. On CUDA every kernel the GPU ran is counted and its GPU time
split into conv / matmul kernels (cuDNN's, cuBLAS's, fuser's Triton conv and GEMM kernels, Inductor's
conv templates) and everything else (Inductor's pointwise / reduction kernels, cat copies, pooling,
upsampling, elementwise). On the CPU, where there are no kernels, the outermost aten ops are counted and
their CPU time split the same way, so the code path is the one the GPU run takes.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

# Inductor names its generated pointwise / persistent-reduction / reduction kernels after the ops they
# fuse ("triton_poi_fused_convolution_silu_0" is a conv's epilogue, not a conv), so those never count.
_GENERATED_OTHER = re.compile(r"^triton_(poi|per|red)_")
_CONV_OR_MATMUL = re.compile(
    r"conv|fprop|implicit_gemm|gemm|depthwise|winograd|cudnn|xmma|nvjet|cutlass|matmul|addmm|aten::mm\b|aten::linear",
    re.IGNORECASE,
)


def is_conv_or_matmul(name: str) -> bool:
    """Whether a kernel (or, on the CPU, an aten op) does a conv's or matmul's arithmetic."""
    return not _GENERATED_OTHER.match(name) and bool(_CONV_OR_MATMUL.search(name))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device: torch.device, calls: int = 50, repeats: int = 5, warmup: int = 3) -> float:
    """Median over ``repeats`` of the mean ms per call of ``calls`` back-to-back ``fn()`` calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    runs = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            runs.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(runs)


def profile_forward(fn: Callable[[], Any], device: torch.device, top: int = 5) -> dict[str, Any]:
    """Kernels of one ``fn()`` call: count, GPU ms in conv/matmul kernels and in the rest, the largest rest,
    and ``by_kernel``: every kernel name's launches and GPU ms (which of fuser's kernels the time is in).

    On the CPU: outermost aten ops and their CPU ms instead (``unit`` says which).
    """
    _sync(device)
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    if device.type == "cuda":
        events = [
            e
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
        ]
        durations = [(e.name, e.device_time_total / 1e3) for e in events]
        unit = "kernels"
    else:
        events = [
            e
            for e in prof.events()
            if e.name.startswith("aten::") and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))
        ]
        durations = [(e.name, e.cpu_time_total / 1e3) for e in events]
        unit = "aten ops"
    conv = sum(ms for name, ms in durations if is_conv_or_matmul(name))
    rest: dict[str, float] = {}
    for name, ms in durations:
        if not is_conv_or_matmul(name):
            rest[name] = rest.get(name, 0.0) + ms
    largest = sorted(rest.items(), key=lambda kv: -kv[1])[:top]
    by_kernel: dict[str, list[float]] = {}
    for name, ms in durations:
        entry = by_kernel.setdefault(name[:120], [0, 0.0])
        entry[0] += 1
        entry[1] += ms
    return {
        "unit": unit,
        "count": len(durations),
        "conv_ms": conv,
        "other_ms": sum(rest.values()),
        "other_largest": {name[:120]: ms for name, ms in largest},
        "by_kernel": {
            name: {"launches": int(n), "ms": ms}
            for name, (n, ms) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])
        },
    }
