"""Which implementation of a fused op runs: the backend names, how "auto" resolves per device, and the
decomposed mode in which fused modules run plain torch code for exporters.

"auto" runs the compiled Triton kernels on CUDA tensors and the torch reference elsewhere; "measured" picks
per call signature between the kernel and cuDNN/cuBLAS (fuser.lower.path_choice); "interpret" runs the same
kernels in Triton's interpreter on CPU tensors; "torch" is the reference.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

BACKENDS = ("auto", "triton", "measured", "interpret", "torch")
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # float64 models run the reference

_state = threading.local()


@contextlib.contextmanager
def decomposed() -> Iterator[None]:
    """Within this context, fused modules run plain torch code instead of the custom ops (for exporters)."""
    previous = getattr(_state, "decomposed", False)
    _state.decomposed = True
    try:
        yield
    finally:
        _state.decomposed = previous


def is_decomposed() -> bool:
    return getattr(_state, "decomposed", False)


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(map(repr, BACKENDS))}")
    return backend


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that runs on ``device``: "auto" becomes "triton" on CUDA and "torch" elsewhere.

    "measured" (CUDA only) runs, per call signature, the faster of the Triton kernel and the vendor library
    on the folded weights (fuser.lower.path_choice); it is not the default because on the models of
    benchmarks/gpu_models.py the Triton kernels alone were faster (benchmarks/results)."""
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend in ("triton", "measured") and device.type != "cuda":
        raise ValueError(
            f"backend={backend!r} runs compiled kernels on CUDA tensors, but the input is on {device}; "
            "use backend='interpret' to run the same kernels on the CPU, or 'torch' for the reference"
        )
    if backend == "interpret" and device.type != "cpu":
        raise ValueError(f"backend='interpret' runs Triton's interpreter on CPU tensors, but the input is on {device}")
    return backend


def uses_kernels(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` runs the Triton kernels on ``device`` (False where it runs the reference, or
    cannot run there at all: the call itself then says why)."""
    try:
        return resolve_backend(backend, device) != "torch"
    except ValueError:
        return False


def conv_output_memory_format(x: torch.Tensor, backend: str) -> torch.memory_format:
    """The kernels write NHWC; the reference keeps the layout F.conv2d picks for ``x``."""
    if resolve_backend(backend, x.device) != "torch" or x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format
