"""The fused epilogue on the Triton side: the formulas of fuser.activations on a float32 tile.

The description (:class:`Activation`, :class:`Residual`, :class:`Epilogue`) and the torch reference live in
the triton-free modules fuser.activations and fuser.epilogue, so the graph side reads them without loading
triton; they are re-exported here for the kernels and their callers. Each row of the activation table names
its ``@triton.jit`` function below and the ``tl.constexpr`` (``ACT_<NAME>``) that selects it in
:func:`apply_activation`; the tests check both for every row.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fuser.activations import Activation, apply_activation_torch
from fuser.epilogue import NO_EPILOGUE, Epilogue, Residual, apply_epilogue_torch

__all__ = [
    "NO_EPILOGUE",
    "Activation",
    "Epilogue",
    "Residual",
    "apply_activation",
    "apply_activation_torch",
    "apply_epilogue",
    "apply_epilogue_torch",
    "round_tf32_tile",
]

ACT_NONE = tl.constexpr(int(Activation.NONE))
ACT_RELU = tl.constexpr(int(Activation.RELU))
ACT_RELU6 = tl.constexpr(int(Activation.RELU6))
ACT_LEAKY_RELU = tl.constexpr(int(Activation.LEAKY_RELU))
ACT_SILU = tl.constexpr(int(Activation.SILU))
ACT_HARDSWISH = tl.constexpr(int(Activation.HARDSWISH))
ACT_GELU = tl.constexpr(int(Activation.GELU))
ACT_GELU_TANH = tl.constexpr(int(Activation.GELU_TANH))
ACT_SIGMOID = tl.constexpr(int(Activation.SIGMOID))
ACT_TANH = tl.constexpr(int(Activation.TANH))
ACT_HARDSIGMOID = tl.constexpr(int(Activation.HARDSIGMOID))
ACT_MISH = tl.constexpr(int(Activation.MISH))


# The exponential and the reciprocal of the activations, as single SFU instructions with subnormals flushed to zero.
# ``tl.exp`` and ``/`` compile to ex2.approx.f32 and div.full.f32 (the same approximations), but without ftz each
# gets range fix-ups around its MUFU instruction: SiLU took 12 instructions per output against these 5, and timed
# 8-27% of a tensor-core conv's time at batch 32 (benchmarks/results/epilogue-cost-2026-12-04.json). Flushing costs
# only results below 1.2e-38 in magnitude (sigmoid of x < -87 becomes 0 instead of about 1e-38). The interpreter
# has no assembler: kernels/interpret.py runs these two strings as numpy.
EX2_APPROX_FTZ = tl.constexpr("ex2.approx.ftz.f32 $0, $1;")
RCP_APPROX_FTZ = tl.constexpr("rcp.approx.ftz.f32 $0, $1;")
LOG2_E = tl.constexpr(1.4426950408889634)


@triton.jit
def _exp(x):
    """e^x of a float32 tile: 2^(x log2 e) on the SFU, about 2 ulp from e^x where |x log2 e| stays small."""
    return tl.inline_asm_elementwise(EX2_APPROX_FTZ, "=f,f", [x * LOG2_E], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _reciprocal(x):
    """1 / x of a float32 tile on the SFU (1 ulp); 1 / inf = 0, as the activations below rely on."""
    return tl.inline_asm_elementwise(RCP_APPROX_FTZ, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _sigmoid(x, alpha):
    return _reciprocal(1.0 + _exp(-x))


@triton.jit
def _tanh(x, alpha):
    # 1 - 2 / (exp(2x) + 1): saturates to +-1 without inf/inf (triton.language has no tanh builtin).
    return 1.0 - 2.0 * _reciprocal(_exp(2.0 * x) + 1.0)


@triton.jit
def _identity(x, alpha):
    return x


@triton.jit
def _relu(x, alpha):
    return tl.maximum(x, 0.0)


@triton.jit
def _relu6(x, alpha):
    return tl.minimum(tl.maximum(x, 0.0), 6.0)


@triton.jit
def _leaky_relu(x, alpha):
    return tl.where(x >= 0.0, x, x * alpha)


@triton.jit
def _silu(x, alpha):
    return x * _sigmoid(x, alpha)


@triton.jit
def _hardsigmoid(x, alpha):
    return tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0) * (1.0 / 6.0)


@triton.jit
def _hardswish(x, alpha):
    return x * _hardsigmoid(x, alpha)


@triton.jit
def _gelu(x, alpha):
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def _gelu_tanh(x, alpha):
    return 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x), alpha))


@triton.jit
def _mish(x, alpha):
    # tanh(softplus(x)) = n / (n + 2) with n = e^x (e^x + 2): no log, accurate for very negative x (where
    # log(1 + e^x) rounds to 0), and x itself past 20, where torch's softplus returns x and tanh is 1.
    e = _exp(tl.minimum(x, 20.0))
    n = e * (e + 2.0)
    return tl.where(x > 20.0, x, x * (n * _reciprocal(n + 2.0)))


@triton.jit
def apply_activation(x, alpha, ACT: tl.constexpr):
    """Apply :class:`Activation` ``ACT`` to a float32 tile ``x``; ``alpha`` is LEAKY_RELU's slope."""
    if ACT == ACT_NONE:
        x = _identity(x, alpha)
    elif ACT == ACT_RELU:
        x = _relu(x, alpha)
    elif ACT == ACT_RELU6:
        x = _relu6(x, alpha)
    elif ACT == ACT_LEAKY_RELU:
        x = _leaky_relu(x, alpha)
    elif ACT == ACT_SILU:
        x = _silu(x, alpha)
    elif ACT == ACT_HARDSWISH:
        x = _hardswish(x, alpha)
    elif ACT == ACT_GELU:
        x = _gelu(x, alpha)
    elif ACT == ACT_GELU_TANH:
        x = _gelu_tanh(x, alpha)
    elif ACT == ACT_SIGMOID:
        x = _sigmoid(x, alpha)
    elif ACT == ACT_TANH:
        x = _tanh(x, alpha)
    elif ACT == ACT_HARDSIGMOID:
        x = _hardsigmoid(x, alpha)
    elif ACT == ACT_MISH:
        x = _mish(x, alpha)
    else:
        tl.static_assert(False, "apply_activation: ACT is no Activation of fuser.activations")
    return x


@triton.jit
def apply_epilogue(
    acc, bias, residual, alpha, scale, ACT: tl.constexpr, RESIDUAL: tl.constexpr, HAS_SCALE: tl.constexpr
):
    """The whole epilogue on a float32 tile, in the order of :func:`apply_epilogue_torch`.

    ``bias`` is already broadcast-ready (or the scalar 0.0 when there is none); ``residual`` is a
    float32 tile of ``acc``'s shape when ``RESIDUAL`` is not :attr:`Residual.NONE` (ignored otherwise).
    """
    y = acc + bias
    if RESIDUAL == 1:
        y = y + residual
    y = apply_activation(y, alpha, ACT)
    if RESIDUAL == 2:
        y = y + residual
    if HAS_SCALE:
        y = y * scale
    return y


@triton.jit
def round_tf32_tile(y):
    """Float32 tile ``y`` rounded to nearest TF32 (10 mantissa bits), ties away from zero: add half a
    TF32 ulp to the magnitude bits, clear the low 13 (what ``cvt.rna.tf32.f32``, cuDNN's and cuBLAS'
    conversion, does, and :func:`fuser.kernels.precision.round_to_tf32` on the host). A carry out of the
    mantissa bumps the exponent, which is the right rounding; inf stays inf. NaN is kept by the select: its
    bits could carry into the sign. Two integer ops, a compare and a select per element, on registers."""
    bits = y.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x1000) & -0x2000).to(tl.float32, bitcast=True)
    return tl.where(y == y, rounded, y)
