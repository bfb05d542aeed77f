"""TF32 weights are rounded to nearest at packing time (as cuBLAS and cuDNN round), not truncated."""

from __future__ import annotations

import math

import torch
from accuracy import rel_error

from fuser.kernels import Precision, pack_conv_weight, pack_gemm_weight
from fuser.kernels.precision import round_to_tf32


def mantissa_low_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) & 0x1FFF


def test_rounds_to_ten_mantissa_bits_to_nearest():
    x = torch.randn(100_003) * 7.3
    r = round_to_tf32(x)
    assert not mantissa_low_bits(r).any()
    rel = ((r - x) / x).abs()
    assert rel.max().item() <= 2.0**-11 * (1 + 1e-6)  # half a TF32 ulp at most
    # to nearest: the signed error averages out; truncation would bias every value toward zero
    signed = ((r.abs() - x.abs()) / x.abs()).mean().item()
    assert abs(signed) < 2e-5, signed


def test_ties_go_away_from_zero_and_specials_survive():
    one = torch.tensor([1.0])
    half_ulp = one.view(torch.int32) + 0x1000  # exactly halfway between two TF32 values
    tie = half_ulp.view(torch.float32)
    assert round_to_tf32(tie).item() == 1.0 + 2.0**-10
    assert round_to_tf32(-tie).item() == -(1.0 + 2.0**-10)
    specials = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0])
    out = round_to_tf32(specials)
    assert out[0] == math.inf and out[1] == -math.inf and math.isnan(out[2].item())
    assert out[3].item() == 0.0 and math.copysign(1, out[4].item()) == -1


def test_only_tf32_packing_rounds():
    w = torch.randn(21, 19, 3, 3)
    for precision, rounded in [("tf32", True), ("ieee", False), ("tf32x3", False)]:
        data = pack_conv_weight(w, precision).data
        assert bool((mantissa_low_bits(data) == 0).all()) == rounded, precision
    gemm = pack_gemm_weight(torch.randn(37, 45), Precision.TF32).data
    assert not mantissa_low_bits(gemm).any()
    # few input channels: the direct kernel multiplies on the FMA units, so its weights stay exact
    stem = pack_conv_weight(torch.randn(16, 3, 3, 3), "tf32").data
    assert mantissa_low_bits(stem).any()
    assert rel_error(round_to_tf32(w), w) < 2.0**-11
