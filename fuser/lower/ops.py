"""The fused ops as ``torch.library`` custom ops: ``fuser::conv2d_act``, ``fuser::gemm_act`` and
``fuser::max_pool_pyramid``.

A fused module (fuser.lower.fused_modules) calls one of these wherever its op must be visible as one opaque op:
under torch.compile, torch.export and torch.jit.trace, and for inputs that need gradients. Each op has
- a fake (meta) implementation, so torch.compile and torch.export see the output's shape, dtype and layout
  without running it (Inductor keeps the op opaque and fuses what lies around it);
- a real implementation that builds the same call the fused module's eager shortcut runs (fuser.lower.calls);
- an autograd formula that says, in fuser's words, that the fused ops are for inference.

A schema holds only tensors, ints, floats and strings, so the spec objects a fused module carries (its
:class:`ConvGeometry`, :class:`Epilogue` and :class:`Precision`, and the backend name) are flattened into
the op's arguments by :func:`conv2d_op_args` / :func:`gemm_op_args` and restored by :func:`_conv2d_spec` /
:func:`_gemm_spec`: the only place that knows the order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fuser.kernels.epilogue import Activation, Epilogue, Residual
from fuser.kernels.precision import Precision
from fuser.lower import calls
from fuser.lower.backends import (
    BACKENDS,
    check_backend,
    conv_output_memory_format,
    decomposed,
    is_decomposed,
    resolve_backend,
)
from fuser.lower.conv_geometry import ConvGeometry, conv_output_size, conv_padding

# Names other modules import from here; they live in fuser.lower.backends and fuser.lower.conv_geometry.
__all__ = [
    "BACKENDS",
    "check_backend",
    "conv2d_op_args",
    "conv_output_size",
    "conv_padding",
    "decomposed",
    "gemm_op_args",
    "is_decomposed",
    "resolve_backend",
]

# ---------------------------------------------------------------------------------------------------------
# The spec objects <-> the schema's flat arguments


def gemm_op_args(epilogue: Epilogue, precision: Precision, backend: str) -> tuple:
    """The non-tensor arguments of ``fuser::gemm_act``, in its schema's order (the tail of conv2d_act's)."""
    e = epilogue
    return int(e.act), float(e.alpha), int(e.residual), float(e.scale), e.round_tf32, precision.value, backend


def _gemm_spec(
    act: int, alpha: float, residual_mode: int, scale: float, round_tf32: bool, precision: str, backend: str
) -> tuple[Epilogue, Precision, str]:
    epilogue = Epilogue(Activation(act), alpha, Residual(residual_mode), scale, round_tf32)
    return epilogue, Precision(precision), backend


def conv2d_op_args(geometry: ConvGeometry, epilogue: Epilogue, precision: Precision, backend: str) -> tuple:
    """The non-tensor arguments of ``fuser::conv2d_act``, in its schema's order."""
    g = geometry
    return (g.stride, g.padding, g.dilation, g.groups, *gemm_op_args(epilogue, precision, backend))


def _conv2d_spec(
    stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], groups: int, *epilogue_args: Any
) -> tuple[ConvGeometry, Epilogue, Precision, str]:
    geometry = ConvGeometry(tuple(stride), tuple(padding), tuple(dilation), groups)  # type: ignore[arg-type]
    return (geometry, *_gemm_spec(*epilogue_args))


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
    scale: float,
    round_tf32: bool,
    precision: str,
    backend: str,
    input_scale: torch.Tensor | None = None,
    cat_with: torch.Tensor | None = None,
    upsample: int = 1,
    input_affine: torch.Tensor | None = None,
    input_act: int = 0,
) -> torch.Tensor:
    """``epilogue(conv2d(x, weight) + bias)``; padding is (top, bottom, left, right).

    ``packed_weight`` is ``weight`` packed for the kernels (fuser.kernels.pack_conv_weight), or None; the
    reference path ignores it. ``input_scale`` (``[N or 1, C_in, 1, 1]``, optional, last so that calls
    without it keep their form) makes it the conv of ``x * input_scale``, multiplied as the kernel loads
    ``x`` (fuser.rewrite.input_scale). ``cat_with`` (optional) makes the input ``cat([upsample_nearest(x, upsample),
    cat_with], 1)``, read by the kernels without being materialized (fuser.rewrite.virtual_cat). ``input_affine``
    (``[C_in, 2]`` float32, optional) with ``input_act`` makes the conv's input ``input_act(x * s + t)``, a
    BatchNorm and its activation applied as the kernel loads ``x`` (fuser.rewrite.batchnorm_prologue). Output
    layout: see :func:`fuser.lower.backends.conv_output_memory_format`.
    """
    geometry, epilogue, policy, backend = _conv2d_spec(
        stride, padding, dilation, groups, act, alpha, residual_mode, scale, round_tf32, precision, backend
    )
    call = calls.conv2d_call(
        x, weight, bias, residual, packed_weight, geometry, epilogue, policy, backend, None, input_scale, cat_with,
        upsample, input_affine, input_act,
    )  # fmt: skip
    return call(x, residual, None, input_scale, cat_with)


@conv2d_act.register_fake
def _conv2d_act_fake(
    x, weight, bias, residual, packed_weight, stride, padding, dilation, groups, act, alpha, residual_mode, scale,
    round_tf32, precision, backend, input_scale=None, cat_with=None, upsample=1, input_affine=None, input_act=0,
):  # fmt: skip
    spatial = x.shape[2:] if cat_with is None else cat_with.shape[2:]
    oh, ow = conv_output_size(spatial, weight.shape[2:], stride, padding, dilation)
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
    round_tf32: bool,
    precision: str,
    backend: str,
) -> torch.Tensor:
    """``epilogue(a @ weight.T + bias)`` for ``a`` of shape [..., K] and ``weight`` [N, K]."""
    epilogue, policy, backend = _gemm_spec(act, alpha, residual_mode, scale, round_tf32, precision, backend)
    call = calls.gemm_call(a, weight, bias, residual, packed_weight, epilogue, policy, backend)
    return call(a, residual)


@gemm_act.register_fake
def _gemm_act_fake(a, weight, *rest):
    return a.new_empty((*a.shape[:-1], weight.shape[0]))


# ---------------------------------------------------------------------------------------------------------
# fuser::max_pool_pyramid


@torch.library.custom_op("fuser::max_pool_pyramid", mutates_args=())
def max_pool_pyramid(x: torch.Tensor, radii: Sequence[int]) -> torch.Tensor:
    """``cat([max_pool2d(x, 2r+1, 1, r) for r in radii], 1)`` in one Triton launch (fuser.kernels.pool),
    on CUDA, or on the CPU in Triton's interpreter. What FusedPoolPyramid runs under torch.compile: Inductor
    would otherwise lower the pools itself, as one kernel per pool (YOLOv8n's SPPF at batch 32: 0.38 ms
    against 0.08 for this one)."""
    from fuser.kernels.pool import max_pool_pyramid as run

    return run(x, radii, interpret=x.device.type == "cpu")


@max_pool_pyramid.register_fake
def _max_pool_pyramid_fake(x, radii):
    from fuser.kernels.pool import pyramid_memory_format

    n, c, h, w = x.shape
    return x.new_empty((n, len(radii) * c, h, w)).contiguous(memory_format=pyramid_memory_format(x))


# ---------------------------------------------------------------------------------------------------------
# Autograd: the fused ops are for inference


INFERENCE_ONLY = (
    "fuser: backward through {op}: an optimized model is for inference (its batch norms are folded into "
    "constant weights and its fused kernels have no gradient). Train the original model, and call "
    "fuser.optimize() on it after training; where gradients are needed, run the original model."
)


@torch.library.custom_op("fuser::inference_only", mutates_args=())
def _inference_only(grad: torch.Tensor, shape: Sequence[int], op: str) -> torch.Tensor:
    """Raises :data:`INFERENCE_ONLY`: the gradient of every input of a fused op. An op (rather than a raise
    in the formula) so that torch.compile can trace a backward graph and the error comes when it runs."""
    raise RuntimeError(INFERENCE_ONLY.format(op=op))


@_inference_only.register_fake
def _inference_only_fake(grad, shape, op):
    return grad.new_empty(shape)


def _register_inference_only(op: Any, name: str) -> None:
    """An autograd formula for ``op`` whose gradients all come from :func:`_inference_only`."""

    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.shapes = [t.shape if isinstance(t, torch.Tensor) else None for t in inputs]

    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grads: list[torch.Tensor | None] = [None] * len(ctx.needs_input_grad)
        for i, shape in enumerate(ctx.shapes):
            if shape is not None and ctx.needs_input_grad[i]:
                grads[i] = torch.ops.fuser.inference_only(grad, shape, name)
        return tuple(grads)

    torch.library.register_autograd(op, backward, setup_context=setup_context)


_register_inference_only(conv2d_act, "fuser::conv2d_act")
_register_inference_only(gemm_act, "fuser::gemm_act")
_register_inference_only(max_pool_pyramid, "fuser::max_pool_pyramid")
