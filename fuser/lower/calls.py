"""Call construction: the function that computes one fused op for every call shaped like an example one.

Every decision that depends only on a call's signature (backend, kernel or library, launch plan) is taken
here, once. The custom ops (fuser.lower.ops) build the call on every invocation; the fused modules keep it per
input signature so that a repeated eager forward only launches (on a small layer the custom op's dispatch
costs more host time than the kernel takes on the GPU). Both run the same code, so they give the same answer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fuser.kernels.epilogue import Epilogue
from fuser.kernels.precision import Precision
from fuser.lower import kernel_dispatch, path_choice
from fuser.lower.backends import conv_output_memory_format, resolve_backend
from fuser.lower.conv_geometry import ConvGeometry
from fuser.lower.references import conv2d_reference, gemm_reference

# call(x, residual); a conv's call(x, residual, out=None, input_scale=None) (fuser.lower.calls.conv2d_call)
Call = Callable[..., torch.Tensor]


def _as_output(y: torch.Tensor, dtype: torch.dtype, memory_format: torch.memory_format) -> torch.Tensor:
    """``y`` in the op's promised dtype and layout, copying only when it is not already so."""
    if y.dtype != dtype:
        y = y.to(dtype)
    if not y.is_contiguous(memory_format=memory_format):
        y = y.contiguous(memory_format=memory_format)
    return y


def _pick(
    backend: str,
    kernel: Call | None,
    library: Call,
    signature: Callable[[], tuple],
    x: torch.Tensor,
    residual: torch.Tensor | None,
    *extra: torch.Tensor | None,
) -> Call:
    """The call a resolved ``backend`` runs: the library where no kernel covers the call, under "measured"
    whichever of the two path_choice finds faster for ``signature()`` (timed on ``(x, residual, *extra)``),
    otherwise the kernel."""
    if kernel is None:
        return library
    if backend == "measured":
        args = (x, residual, *extra)
        chosen = path_choice.choose(signature(), lambda: kernel(*args), lambda: library(*args))
        return library if chosen == path_choice.LIBRARY else kernel
    return kernel


def conv2d_call(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    packed_weight: torch.Tensor | None,
    geometry: ConvGeometry,
    epilogue: Epilogue,
    precision: Precision,
    backend: str,
    out: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
    cat_with: torch.Tensor | None = None,
    upsample: int = 1,
    input_affine: torch.Tensor | None = None,
    input_act: int = 0,
    pool: torch.Tensor | None = None,
) -> Call:
    """``call(x, residual, out=None, input_scale=None, cat_with=None, pool=None)`` computing
    ``fuser::conv2d_act`` for every call shaped like this one.

    With an example ``out`` (a tensor of the output's shape, dtype and device, channels contiguous and
    pixels as rows of one stride: a channel slice of a channels_last buffer) the call takes an ``out`` like
    it and writes its result into ``out`` and returns it; an ``out`` that does not fit is ignored (the call
    returns a new tensor), so a caller must use what the call returns. ``out`` must not overlap ``x`` or
    ``residual``. With an example ``input_scale`` the call takes one like it and computes the conv of
    ``x * input_scale`` (the kernels multiply as they load ``x``; see fuser.rewrite.input_scale). With an example
    ``cat_with`` the conv's input is ``cat([upsample_nearest(x, upsample), cat_with], 1)``, which the
    kernels read without materializing it (fuser.rewrite.virtual_cat). ``input_affine`` ``[C_in, 2]`` and
    ``input_act``, constants of the call, make the input ``input_act(x * s + t)`` first, which the kernels
    apply as they load ``x`` (fuser.rewrite.batchnorm_prologue). With an example ``pool`` (``[N, C_out]``
    of the output's dtype) the call takes one like it and also writes the output's mean over its pixels
    there, summed by the depthwise kernel as it stores the output (fuser.rewrite.depthwise_pool), else
    computed from the output."""
    if out is not None and not _fits_output(out, x if cat_with is None else cat_with, weight, geometry):
        fresh = conv2d_call(
            x, weight, bias, residual, packed_weight, geometry, epilogue, precision, backend, None, input_scale,
            cat_with, upsample, input_affine, input_act, pool,
        )  # fmt: skip
        return lambda x, residual, out=None, input_scale=None, cat_with=None, pool=None: fresh(
            x, residual, None, input_scale, cat_with, pool
        )
    chosen = resolve_backend(backend, x.device)
    memory_format = conv_output_memory_format(x, backend)

    def library(
        x: torch.Tensor,
        residual: torch.Tensor | None,
        out: torch.Tensor | None = None,
        input_scale: torch.Tensor | None = None,
        cat_with: torch.Tensor | None = None,
        pool: torch.Tensor | None = None,
    ) -> torch.Tensor:
        y = conv2d_reference(
            x, weight, bias, residual, geometry, epilogue, precision, input_scale, cat_with, upsample, input_affine,
            input_act,
        )  # fmt: skip
        y = _as_output(y, x.dtype, memory_format) if out is None else out.copy_(y)
        if pool is not None:
            pool.copy_(y.mean((2, 3)))
        return y

    if chosen == "torch":
        return library
    kernel = kernel_dispatch.conv2d(
        x, weight, bias, residual, packed_weight, geometry, epilogue, precision, interpret=chosen == "interpret",
        out=out, input_scale=input_scale, cat_with=cat_with, upsample=upsample, input_affine=input_affine,
        input_act=input_act, pool=pool,
    )  # fmt: skip
    extra = ("conv2d", geometry, epilogue, precision.value) + (() if upsample == 1 else (upsample,))
    extra += () if input_affine is None else ("input_affine", int(input_act))
    optional = tuple(t for t in (input_scale, cat_with, input_affine, pool) if t is not None)
    signature = lambda: path_choice.signature(x, weight, residual, *optional, extra=extra)
    return _pick(chosen, kernel, library, signature, x, residual, out, input_scale, cat_with, pool)


def _fits_output(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, geometry: ConvGeometry) -> bool:
    """Whether the conv of an input of ``x``'s batch, size, dtype and device can be written into ``out``:
    its shape, dtype and device, unit channel stride and the pixels as rows of one stride (NHWC order)."""
    if type(out) is not torch.Tensor or x.dim() != 4 or out.dtype != x.dtype or out.device != x.device:
        return False
    oh, ow = geometry.output_size(x.shape[2:], weight.shape[2:])
    if tuple(out.shape) != (x.shape[0], weight.shape[0], oh, ow):
        return False
    row = out.stride(3)
    return out.stride(1) == 1 and row >= out.shape[1] and out.stride(2) == ow * row and out.stride(0) == oh * ow * row


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
    kernel = kernel_dispatch.gemm(
        a, weight, bias, residual, packed_weight, epilogue, precision, interpret=chosen == "interpret"
    )
    extra = ("gemm", epilogue, precision.value)
    return _pick(chosen, kernel, library, lambda: path_choice.signature(a, weight, residual, extra=extra), a, residual)
