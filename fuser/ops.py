"""The fused ops: ``fuser::conv2d_act`` and ``fuser::gemm_act``, as ``torch.library`` custom ops.

A rewritten chain calls one of these through its fused module (fuser.fused_modules). Each op has
- a fake (meta) implementation, so torch.compile and torch.export see the output's shape, dtype and layout;
- a reference implementation in plain torch (the "torch" backend and the oracle of the tests);
- the Triton kernels of ``fuser.kernels``, compiled ("triton", CUDA tensors) or run by Triton's interpreter
  ("interpret", CPU tensors).

The backend is chosen per call: "auto" runs the compiled kernels on CUDA tensors and the reference on CPU
tensors; "measured" picks per call signature between the kernel and cuDNN/cuBLAS (fuser.path_choice).
Inside :func:`decomposed` the fused modules skip the custom ops and run the reference code directly, so an
exporter (torch.onnx) records standard ops.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from fuser import path_choice
from fuser.kernels.epilogue import Activation, Epilogue, Residual, apply_epilogue_torch
from fuser.kernels.precision import Precision

BACKENDS = ("auto", "triton", "measured", "interpret", "torch")

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
    on the folded weights (fuser.path_choice); it is not the default because on the models of
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


def conv_padding(
    padding: str | int | Sequence[int], kernel_size: Sequence[int], dilation: Sequence[int]
) -> tuple[int, int, int, int]:
    """Any conv padding (int, pair, 4-tuple, "same", "valid") as (top, bottom, left, right)."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0, 0, 0)
        if padding != "same":
            raise ValueError(f"unknown conv padding {padding!r}")
        pads = []
        for k, d in zip(kernel_size, dilation, strict=True):
            total = d * (k - 1)  # torch's "same": the extra pixel of an even kernel goes bottom/right
            pads += [total // 2, total - total // 2]
        return (pads[0], pads[1], pads[2], pads[3])
    if isinstance(padding, int):
        return (padding, padding, padding, padding)
    padding = tuple(int(p) for p in padding)
    if len(padding) == 2:
        return (padding[0], padding[0], padding[1], padding[1])
    if len(padding) == 4:
        return padding  # type: ignore[return-value]
    raise ValueError(f"conv padding must have 1, 2 or 4 values, got {padding!r}")


def conv_output_size(
    size: Sequence[int],
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding4: Sequence[int],
    dilation: Sequence[int],
) -> tuple[int, int]:
    """(OH, OW) of a conv with (top, bottom, left, right) padding."""
    out = []
    for i in range(2):
        padded = size[i] + padding4[2 * i] + padding4[2 * i + 1]
        out.append((padded - dilation[i] * (kernel_size[i] - 1) - 1) // stride[i] + 1)
    return out[0], out[1]


def _round_operands(precision: Precision, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Round float32 operands the way the kernels do under bf16/fp16 (cast, then compute in float32)."""
    dtype = precision.operand_dtype
    if dtype is None:
        return list(tensors)
    return [t.to(dtype).to(t.dtype) if t.dtype == torch.float32 else t for t in tensors]


def conv2d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    epilogue: Epilogue,
    precision: Precision = Precision.IEEE,
) -> torch.Tensor:
    """``epilogue(conv2d(x, weight) + bias)`` in plain torch; padding is (top, bottom, left, right)."""
    x_, w_ = _round_operands(precision, x, weight)
    top, bottom, left, right = padding
    if top == bottom and left == right:
        y = F.conv2d(x_, w_, bias, tuple(stride), (top, left), tuple(dilation), groups)
    else:
        y = F.conv2d(F.pad(x_, (left, right, top, bottom)), w_, bias, tuple(stride), 0, tuple(dilation), groups)
    return apply_epilogue_torch(y, None, epilogue, residual)  # the bias went into the conv: one op fewer


def gemm_reference(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    epilogue: Epilogue,
    precision: Precision = Precision.IEEE,
) -> torch.Tensor:
    """``epilogue(a @ weight.T + bias)`` in plain torch."""
    a_, w_ = _round_operands(precision, a, weight)
    return apply_epilogue_torch(F.linear(a_, w_, bias), None, epilogue, residual)


def _as_output(y: torch.Tensor, dtype: torch.dtype, memory_format: torch.memory_format) -> torch.Tensor:
    """``y`` in the op's promised dtype and layout, copying only when it is not already so."""
    if y.dtype != dtype:
        y = y.to(dtype)
    if not y.is_contiguous(memory_format=memory_format):
        y = y.contiguous(memory_format=memory_format)
    return y


def _epilogue(act: int, alpha: float, residual_mode: int, scale: float) -> Epilogue:
    return Epilogue(Activation(act), alpha, Residual(residual_mode), scale)


def conv_output_memory_format(x: torch.Tensor, backend: str) -> torch.memory_format:
    """The kernels write NHWC; the reference keeps the layout F.conv2d picks for ``x``."""
    if resolve_backend(backend, x.device) != "torch" or x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


Call = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def _pick(
    backend: str,
    kernel: Call | None,
    library: Call,
    signature: Callable[[], tuple],
    x: torch.Tensor,
    residual: torch.Tensor | None,
) -> Call:
    """The call a resolved ``backend`` runs: the library where no kernel covers the call, under "measured"
    whichever of the two path_choice finds faster for ``signature()``, otherwise the kernel."""
    if kernel is None:
        return library
    if backend == "measured":
        chosen = path_choice.choose(signature(), lambda: kernel(x, residual), lambda: library(x, residual))
        return library if chosen == path_choice.LIBRARY else kernel
    return kernel


def conv2d_call(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    packed_weight: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    epilogue: Epilogue,
    precision: Precision,
    backend: str,
) -> Call:
    """``call(x, residual)`` computing ``fuser::conv2d_act`` for every call shaped like this one.

    Every decision that depends only on the call's signature (backend, kernel or library, launch plan) is
    taken here, once; the fused modules keep the call per input signature so that a repeated forward
    only launches (the custom op builds it on every call)."""
    chosen = resolve_backend(backend, x.device)
    memory_format = conv_output_memory_format(x, backend)

    def library(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        y = conv2d_reference(x, weight, bias, residual, stride, padding, dilation, groups, epilogue, precision)
        return _as_output(y, x.dtype, memory_format)

    if chosen == "torch":
        return library
    from fuser import kernel_dispatch

    kernel = kernel_dispatch.conv2d(
        x,
        weight,
        bias,
        residual,
        packed_weight,
        stride,
        padding,
        dilation,
        groups,
        epilogue,
        precision,
        interpret=chosen == "interpret",
    )
    extra = ("conv2d", *stride, *padding, *dilation, groups, epilogue, precision.value)
    return _pick(chosen, kernel, library, lambda: path_choice.signature(x, weight, residual, extra=extra), x, residual)


def gemm_call(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    packed_weight: torch.Tensor | None,
    epilogue: Epilogue,
    precision: Precision,
    backend: str,
) -> Call:
    """``call(a, residual)`` computing ``fuser::gemm_act`` for every call shaped like this one (see
    :func:`conv2d_call`)."""
    chosen = resolve_backend(backend, a.device)

    def library(a: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        y = gemm_reference(a, weight, bias, residual, epilogue, precision)
        return _as_output(y, a.dtype, torch.contiguous_format)

    if chosen == "torch":
        return library
    from fuser import kernel_dispatch

    kernel = kernel_dispatch.gemm(
        a, weight, bias, residual, packed_weight, epilogue, precision, interpret=chosen == "interpret"
    )
    extra = ("gemm", epilogue, precision.value)
    return _pick(chosen, kernel, library, lambda: path_choice.signature(a, weight, residual, extra=extra), a, residual)


# ---------------------------------------------------------------------------------------------------------
# fuser::conv2d_act


@torch.library.custom_op("fuser::conv2d_act", mutates_args=())
def conv2d_act(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    packed_weight: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    act: int,
    alpha: float,
    residual_mode: int,
    precision: str,
    backend: str,
) -> torch.Tensor:
    """``epilogue(conv2d(x, weight) + bias)``; padding is (top, bottom, left, right).

    ``packed_weight`` is ``weight`` packed for the kernels (fuser.kernels.pack_conv_weight), or None; the
    reference path ignores it. Output layout: see :func:`conv_output_memory_format`.
    """
    call = conv2d_call(
        x,
        weight,
        bias,
        residual,
        packed_weight,
        stride,
        padding,
        dilation,
        groups,
        _epilogue(act, alpha, residual_mode, 1.0),
        Precision(precision),
        backend,
    )
    return call(x, residual)


@conv2d_act.register_fake
def _conv2d_act_fake(
    x,
    weight,
    bias,
    residual,
    packed_weight,
    stride,
    padding,
    dilation,
    groups,
    act,
    alpha,
    residual_mode,
    precision,
    backend,
):
    oh, ow = conv_output_size(x.shape[2:], weight.shape[2:], stride, padding, dilation)
    out = x.new_empty((x.shape[0], weight.shape[0], oh, ow))
    return out.contiguous(memory_format=conv_output_memory_format(x, backend))


# ---------------------------------------------------------------------------------------------------------
# fuser::gemm_act


@torch.library.custom_op("fuser::gemm_act", mutates_args=())
def gemm_act(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    packed_weight: torch.Tensor | None,
    act: int,
    alpha: float,
    residual_mode: int,
    scale: float,
    precision: str,
    backend: str,
) -> torch.Tensor:
    """``epilogue(a @ weight.T + bias)`` for ``a`` of shape [..., K] and ``weight`` [N, K]."""
    call = gemm_call(
        a,
        weight,
        bias,
        residual,
        packed_weight,
        _epilogue(act, alpha, residual_mode, scale),
        Precision(precision),
        backend,
    )
    return call(a, residual)


@gemm_act.register_fake
def _gemm_act_fake(a, weight, bias, residual, packed_weight, act, alpha, residual_mode, scale, precision, backend):
    return a.new_empty((*a.shape[:-1], weight.shape[0]))
