"""A CPU model of what the GPU does at precision "tf32", for tests and for diagnosing model-level error.

Triton's TF32 dot hands float32 bits to the tensor cores, which read the top 19 bits of each operand (sign,
exponent, 10 mantissa bits) and drop the low 13: a truncation toward zero. They multiply those exactly
(two 11-bit significands fit a float32 product) and accumulate in float32. cuDNN and cuBLAS round their
operands to nearest TF32 first. Neither happens on the CPU, in torch or in Triton's interpreter (its dot
is a float32 numpy matmul), so a CPU run of a fused model says nothing about the GPU's TF32 error. This
module does: within :func:`emulate_tf32` the convolutions and matrix products of a model run in float32
on operands rounded as the GPU rounds them.

- Inside a fused module (fuser.lower.fused_modules) whose kernel runs a tensor-core dot under "tf32": the input
  operand as ``fused_activations`` says ("truncate": what the kernels do; "nearest": what rounding every
  operand first would give), the weight scaled by its truncation compensation (``tf32_input_gain``,
  fuser.rewrite.tf32_rounding) and rounded to nearest, as packing stores it, and the output rounded to nearest
  where the epilogue says the kernel stores it so (``Epilogue.round_tf32``).
- Everywhere else (the original model, and the ops fuser left unfused, which run cuDNN / cuBLAS): both
  operands of every conv, linear and matmul rounded to nearest, except depthwise convs, which cuDNN runs
  on the FMA units in float32.

The fused modules run their torch reference while it is active (fuser.lower.backends.decomposed), so an
optimized model of any backend can be emulated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from fuser.kernels.conv_choice import is_depthwise
from fuser.kernels.packing import scale_input_channels
from fuser.kernels.precision import Precision, round_to_tf32
from fuser.lower.backends import decomposed
from fuser.lower.fused_modules import FusedConv2d, FusedLinear
from fuser.rewrite.tf32_rounding import reads_input_on_tensor_cores

ACTIVATION_ROUNDINGS = ("truncate", "nearest")


def truncate_to_tf32(t: torch.Tensor) -> torch.Tensor:
    """Float32 values with the low 13 mantissa bits cleared: what the tensor cores read of an unrounded
    float32 operand (toward zero; inf and NaN stay as they are)."""
    if t.dtype != torch.float32:
        return t
    cut = (t.contiguous().view(torch.int32) & -0x2000).view(torch.float32)
    return torch.where(torch.isfinite(t), cut, t)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


_MATMULS = {torch.matmul, torch.mm, torch.bmm, torch.Tensor.matmul, torch.Tensor.__matmul__}


class _Tf32Mode(TorchFunctionMode):
    """Rounds the operands of conv2d / linear / matmul calls; ``inside`` is the fused module running now."""

    def __init__(self, fused_activations: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fused_activations = fused_activations
        self.inside: list[nn.Module] = []

    def _roundings(self, depthwise: bool) -> tuple[Callable, Callable]:
        """(input operand, weight operand) roundings for a dot at this point of the forward."""
        if self.inside:
            module = self.inside[-1]
            if not reads_input_on_tensor_cores(module):
                return _identity, _identity
            gain = module.tf32_input_gain
            if gain is None:
                return self.fused_activations, round_to_tf32
            groups = module.groups if isinstance(module, FusedConv2d) else 1
            return self.fused_activations, lambda w: round_to_tf32(scale_input_channels(w, gain, groups))
        return (_identity, _identity) if depthwise else (round_to_tf32, round_to_tf32)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is F.conv2d and len(args) >= 2:
            x, w = args[0], args[1]
            groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
            a_round, w_round = self._roundings(is_depthwise(x.shape[-3], w.shape[0], groups))
            args = (a_round(x), w_round(w), *args[2:])
        elif func is F.linear and len(args) >= 2:
            a_round, w_round = self._roundings(False)
            args = (a_round(args[0]), w_round(args[1]), *args[2:])
        elif func in _MATMULS and len(args) == 2:
            a_round, w_round = self._roundings(False)
            args = (a_round(args[0]), w_round(args[1]))
        return func(*args, **kwargs)


@contextlib.contextmanager
def emulate_tf32(model: nn.Module, fused_activations: str = "truncate") -> Iterator[None]:
    """Within this context, ``model``'s forward computes as the GPU would at "tf32" (see the module
    docstring); ``fused_activations`` ("truncate" or "nearest") is how a fused kernel's dot reads an input
    that its producer did not store rounded ("nearest" models rounding the A operand in the kernels; on a
    model whose weights compensate truncation, ``tf32_input_gain``, it over-corrects: clear the gains first).
    The model runs in float32 on the CPU; it is not changed (hooks are removed on exit)."""
    if fused_activations not in ACTIVATION_ROUNDINGS:
        raise ValueError(f"fused_activations must be one of {ACTIVATION_ROUNDINGS}, got {fused_activations!r}")
    mode = _Tf32Mode(truncate_to_tf32 if fused_activations == "truncate" else round_to_tf32)

    def enter(module: nn.Module, args: tuple) -> None:
        mode.inside.append(module)

    def leave(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        mode.inside.pop()
        if module.epilogue.round_tf32 and module.kernel_precision == Precision.TF32:
            return round_to_tf32(output)
        return output

    handles = []
    for module in model.modules():
        if isinstance(module, (FusedConv2d, FusedLinear)):
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave))
    try:
        with decomposed(), mode:
            yield
    finally:
        for handle in handles:
            handle.remove()
