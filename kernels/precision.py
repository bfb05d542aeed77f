"""How a fused kernel does its dots: the precision policy, shared by the graph side and the kernels.

In Triton only the reduced-precision modes reach the tensor cores: ``tl.dot(..., input_precision="ieee")``
on float32 operands runs on the FMA units. So a float32 model gets "tf32" by default (about 10 mantissa
bits per operand, float32 accumulation), "tf32x3" for near-float32 accuracy on the tensor cores at about a
third of the speed, or "ieee" for exact float32 FMA. "bf16" and "fp16" cast the operands (weights once, when
they are packed; activations as they are loaded) and keep a float32 accumulator.
"""

from __future__ import annotations

import enum
import math

import torch
import triton
import triton.language as tl


class Precision(str, enum.Enum):
    TF32 = "tf32"
    TF32X3 = "tf32x3"
    IEEE = "ieee"
    BF16 = "bf16"
    FP16 = "fp16"

    @classmethod
    def parse(cls, value: str | Precision) -> Precision:
        """``Precision("tf32")`` with an error that lists the valid names."""
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(p.value) for p in cls)
            raise ValueError(f"unknown precision {value!r}; expected one of {names}") from None

    @property
    def operand_dtype(self) -> torch.dtype | None:
        """The dtype operands are cast to before the dot, or None to keep the input's dtype."""
        return {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}.get(self)

    @property
    def dot_precision(self) -> str:
        """The ``input_precision`` given to ``tl.dot`` for float32 operands."""
        return {Precision.TF32: "tf32", Precision.TF32X3: "tf32x3"}.get(self, "ieee")


# How much of its magnitude a float32 operand loses, on average, when the tensor cores truncate it to TF32:
# the 13 dropped bits are uniform in [0, 2^-10) of the exponent's unit, which is 2^-11 * E[1/m] relative
# (m the significand, in [1, 2)), and for scale-invariant data (log-uniform significands, Benford's law)
# E[1/m] = 1 / (2 ln 2). About 3.5e-4: small per dot, but the same sign in every layer, so it compounds.
TRUNCATION_BIAS = 2.0**-11 / (2 * math.log(2))
TRUNCATION_GAIN = 1 / (1 - TRUNCATION_BIAS)  # what undoes it, multiplied into the other operand


def round_to_tf32(t: torch.Tensor) -> torch.Tensor:
    """Float32 values rounded to TF32 (10 mantissa bits), to nearest with ties away from zero.

    The tensor cores read only the top 19 bits of a float32 operand: fed unrounded values they truncate,
    which biases every product toward zero (a relative bias of about 2^-12 per operand, adding up layer
    after layer). cuBLAS and cuDNN round first; fuser rounds the weights, once, at packing time (here),
    which halves the bias at no cost per call (see :func:`dot_acc` for the activations). Inf stays inf;
    NaN stays NaN.
    """
    if t.dtype != torch.float32:
        return t
    bits = t.contiguous().view(torch.int32)
    rounded = ((bits + 0x1000) & -0x2000).view(torch.float32)
    return torch.where(torch.isfinite(t), rounded, t)


@triton.jit
def dot_acc(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` with ``a`` cast to ``b``'s dtype (the packed weight carries the operand dtype).

    Under "tf32" the weights come rounded to nearest from packing (:func:`round_to_tf32`); the activations
    are not rounded here: doing it in the load path moved every A tile through the registers and cost
    17% on the 8192x4096x16384 GEMM and up to 27% on 3x3 convs (benchmarks/results/layers-2026-12-01.json),
    for an error that was within the tf32 tolerance without it (8e-4 with neither operand rounded).
    Instead the producer's epilogue stores them rounded where only TF32 dots read them, and elsewhere the
    weights make up truncation's mean (fuser.rewrite.tf32_rounding, kernels/NOTES.md version 6).
    ``UPCAST`` is set under the interpreter only: its ``tl.dot`` multiplies bfloat16 values as raw
    integers, so the operands, already rounded to their dtype, go to float32, where products of 16-bit
    values are exact and the numerics match the tensor cores' float32 accumulation.
    """
    a = a.to(b.dtype)
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)
