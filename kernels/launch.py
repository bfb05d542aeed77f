"""What every launcher shares: input checks with clear errors, the compiled/interpreted launch switch,
and the choice between the tensor-descriptor (TMA) path and the pointer path."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from triton.runtime.jit import JITFunction

from .autotune import TileConfig
from .epilogue import Epilogue, Residual
from .interpret import run_interpreted
from .precision import Precision

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def cdiv(a: int, b: int) -> int:
    """Ceiling division (``triton.cdiv`` is a constexpr function in newer triton, slow on the host)."""
    return -(-a // b)


def check_device(op: str, interpret: bool, tensors: dict[str, torch.Tensor | None]) -> torch.device:
    """All tensors on one device, CPU under ``interpret=True`` and CUDA otherwise; returns it."""
    device: torch.device | None = None
    for name, t in tensors.items():
        if t is None:
            continue
        if interpret and t.device.type != "cpu":
            raise ValueError(f"{op}: interpret=True runs on the CPU, but {name} is on {t.device}")
        if not interpret and t.device.type != "cuda":
            raise ValueError(
                f"{op}: compiled Triton kernels need CUDA tensors, but {name} is on {t.device} "
                "(use interpret=True for CPU tensors)"
            )
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device}, other inputs on {device}")
    assert device is not None
    return device


def check_float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: {name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_bias(op: str, bias: torch.Tensor | None, channels: int) -> torch.Tensor | None:
    """The bias as a contiguous float32 vector (the epilogue adds it in float32)."""
    if bias is None:
        return None
    if bias.dim() != 1 or bias.shape[0] != channels:
        raise ValueError(f"{op}: bias must have shape ({channels},), got {tuple(bias.shape)}")
    if not bias.is_floating_point():
        raise ValueError(f"{op}: bias must be floating point, got {bias.dtype}")
    return bias.to(torch.float32).contiguous()


def check_residual(
    op: str, epilogue: Epilogue, residual: torch.Tensor | None, out_shape: Sequence[int]
) -> torch.Tensor | None:
    """The residual expanded (stride 0 where broadcast) to the output's logical shape."""
    if (residual is None) != (epilogue.residual == Residual.NONE):
        raise ValueError(
            f"{op}: epilogue {epilogue.describe()!r} "
            + ("needs a residual tensor" if residual is None else "has no residual step, but got a residual")
        )
    if residual is None:
        return None
    if not residual.is_floating_point():
        raise ValueError(f"{op}: residual must be floating point, got {residual.dtype}")
    try:
        return residual.expand(*out_shape)
    except RuntimeError:
        raise ValueError(
            f"{op}: residual of shape {tuple(residual.shape)} does not broadcast to the output shape {tuple(out_shape)}"
        ) from None


def dot_precision(precision: Precision, operand: torch.dtype) -> str:
    """``input_precision`` for ``tl.dot``: the policy's for float32 operands; 16-bit ones ignore it."""
    return precision.dot_precision if operand == torch.float32 else "tf32"


@functools.cache
def _descriptors_on(device_index: int) -> bool:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def descriptors_available(device: torch.device) -> bool:
    """Whether host-side tensor descriptors (TMA, Hopper and later) can be used on ``device``.

    The interpreter understands them too, so CPU tests cover the descriptor path's indexing.
    """
    if device.type == "cpu":
        try:
            from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
        except ImportError:
            return False
        return True
    return _descriptors_on(device.index if device.index is not None else torch.cuda.current_device())


def aligned_2d(t: torch.Tensor) -> bool:
    """A 2-D tensor a descriptor can address: unit inner stride, 16-byte aligned base and row stride."""
    size = t.element_size()
    return (
        t.dim() == 2
        and t.stride(1) == 1
        and (t.stride(0) * size) % 16 == 0
        and t.data_ptr() % 16 == 0
        and t.shape[0] > 0
        and t.shape[1] > 0
    )


def _descriptor_defaults() -> dict[str, Any]:
    import dataclasses

    from triton.tools.tensor_descriptor import TensorDescriptor

    return {f.name: f.default for f in dataclasses.fields(TensorDescriptor) if f.default is not dataclasses.MISSING}


_DESCRIPTOR_DEFAULTS: dict[str, Any] | None = None


def make_descriptor(t: torch.Tensor, block_shape: Sequence[int]) -> Any:
    """A host-side tensor descriptor of ``t`` (which :func:`aligned_2d` has already accepted).

    Built without the dataclass's own validation: it repeats our alignment checks and costs more
    than the rest of the launch on small problems, where the launcher's CPU time is the runtime.
    """
    global _DESCRIPTOR_DEFAULTS
    from triton.tools.tensor_descriptor import TensorDescriptor

    if _DESCRIPTOR_DEFAULTS is None:
        _DESCRIPTOR_DEFAULTS = _descriptor_defaults()
    desc = object.__new__(TensorDescriptor)
    for name, value in _DESCRIPTOR_DEFAULTS.items():
        object.__setattr__(desc, name, value)
    object.__setattr__(desc, "base", t)
    object.__setattr__(desc, "shape", list(t.shape))
    object.__setattr__(desc, "strides", list(t.stride()))
    object.__setattr__(desc, "block_shape", list(block_shape))
    return desc


def check_path(op: str, path: str) -> None:
    if path not in ("auto", "descriptor", "pointer"):
        raise ValueError(f"{op}: path must be 'auto', 'descriptor' or 'pointer', got {path!r}")


def launch_options(kernel: JITFunction, constexprs: dict[str, Any], config: TileConfig) -> dict[str, Any]:
    """Keyword arguments of one launch: the kernel's constexprs, its tile constexprs, warps and stages."""
    tile = {name: value for name, value in config.constexprs().items() if name in kernel.arg_names}
    return {**constexprs, **tile, "num_warps": config.num_warps, "num_stages": config.num_stages}


def launch(
    kernel: JITFunction,
    grid: tuple[int, ...],
    args: Sequence[Any],
    options: dict[str, Any],
    interpret: bool,
) -> Any:
    """Launch compiled (returns Triton's compiled kernel, whose ``asm`` holds the PTX), or run the same
    kernel in the interpreter (returns None; it ignores ``num_warps`` / ``num_stages``)."""
    if interpret:
        run_interpreted(kernel, grid, *args, **options)
        return None
    return kernel[grid](*args, **options)
