"""backend="measured" on CUDA: each fused op runs the faster of its two implementations, measured once.

A fused chain has two correct implementations on a GPU: the fused Triton kernel, and the vendor library
(cuDNN / cuBLAS) on the folded parameters followed by the epilogue in torch. Which is faster depends on the
layer: the Triton kernels win where the epilogue, the layout and the launch count dominate (the stem, strided
layers, memory-bound shapes), cuDNN's tuned convolutions win on some large 3x3 layers. On the first call with
a given signature both run on the call's own tensors and the faster is kept for the process.

The measure is the wall time per call of back-to-back calls, synchronized once at the end: what a forward
pays for a layer, the GPU time where the layer is GPU-bound and the host time (launches, Python) where it is
launch-bound, as small layers at batch 1 are. A GPU-only timing (do_bench) ignores the library path's extra
launches and chose it where the model then ran slower (benchmarks/results/gpu-models-2026-12-01a.json).

Nothing is measured while a CUDA graph is being recorded (the kernel runs then); fuser.runtime.cuda_graphs warms up
before it records, so the choice is made by then.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch

KERNEL, LIBRARY = "kernel", "library"

_choices: dict[Hashable, str] = {}
_timings: dict[Hashable, tuple[float, float]] = {}
_lock = threading.Lock()


def _time_ms(fn: Callable[[], Any], calls: int = 10, rounds: int = 3) -> float:
    """Best over ``rounds`` of the wall ms per call of ``calls`` back-to-back calls; inf when ``fn`` fails
    (then the other implementation is taken)."""
    try:
        fn()
        torch.cuda.synchronize()
        best = math.inf
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - start) / calls * 1e3)
        return best
    except Exception:
        return math.inf


def choose(key: Hashable, kernel: Callable[[], Any], library: Callable[[], Any]) -> str:
    """KERNEL or LIBRARY for the call signature ``key``, measuring both the first time it is seen."""
    choice = _choices.get(key)
    if choice is not None:
        return choice
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return KERNEL
    t_kernel, t_library = _time_ms(kernel), _time_ms(library)
    choice = KERNEL if t_kernel <= t_library else LIBRARY
    with _lock:
        _choices[key] = choice
        _timings[key] = (t_kernel, t_library)
    return choice


def choices() -> dict[Hashable, tuple[str, float, float]]:
    """Every choice made in this process: key -> (choice, kernel ms, library ms)."""
    with _lock:
        return {k: (c, *_timings.get(k, (math.nan, math.nan))) for k, c in _choices.items()}


def clear() -> None:
    """Forget every choice (they are measured again on the next calls)."""
    with _lock:
        _choices.clear()
        _timings.clear()


def signature(*tensors: torch.Tensor | None, extra: tuple = ()) -> tuple:
    """A hashable call signature: each tensor's shape, strides, dtype and device, plus ``extra``."""
    parts: list[Any] = [None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors]
    return (*parts, *extra)
