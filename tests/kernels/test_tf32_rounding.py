"""TF32 rounding to nearest (as cuBLAS and cuDNN round), not truncation: the weights at packing time, the
epilogue's store of values that only TF32 dots read (every kernel, in the interpreter), and the packed
weights' compensation of the truncation the tensor cores apply to the other inputs."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from accuracy import rel_error
from kernels_reference import ConvCase, conv_inputs, conv_reference, gemm_reference

from fuser.kernels import (
    Activation,
    Epilogue,
    Precision,
    Residual,
    conv2d_act,
    gemm_act,
    pack_conv_weight,
    pack_gemm_weight,
)
from fuser.kernels.autotune import TileConfig
from fuser.kernels.conv_choice import conv_kernel
from fuser.kernels.packing import scale_input_channels
from fuser.kernels.precision import TRUNCATION_GAIN, round_to_tf32


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


# The epilogue's TF32-rounded store (Epilogue.round_tf32), on every kernel that runs an epilogue: the
# implicit GEMM over channel blocks and over flat K, the 1x1 GEMM, depthwise, the direct stem kernel, and
# the split-K reduction (conv and GEMM). Odd shapes; a residual and an activation in the epilogue.
ROUNDED_CASES = [
    (ConvCase("implicit_c19", 2, 19, 21, (9, 11), 3, padding=(1, 1, 1, 1)), None),
    (ConvCase("flat_k_c5_s2", 1, 5, 13, (13, 11), 3, stride=2, padding=(1, 0, 0, 1)), None),
    (ConvCase("gemm_1x1_c37", 3, 37, 19, (5, 7), 1), None),
    (ConvCase("depthwise_c19", 2, 19, 19, (9, 7), 3, padding=(1, 1, 1, 1), groups=19), None),
    (ConvCase("direct_stem_c3", 1, 3, 17, (11, 13), 3, stride=2, padding=(1, 1, 1, 1)), None),
    (ConvCase("split_k_c40", 1, 40, 37, (5, 7), 3, padding=(1, 1, 1, 1)), TileConfig(32, 32, 16, 2, 4, 1, split_k=3)),
]
SILU_ADD = Epilogue(Activation.SILU, residual=Residual.AFTER_ACT)


def _conv_both(case: ConvCase, tile: TileConfig | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(stored with round_tf32, stored without, the float64 reference on the operands the kernel reads)."""
    x, w, b, residual = conv_inputs(case, SILU_ADD)
    packed = pack_conv_weight(w, "tf32", groups=case.groups)
    outs = [
        conv2d_act(
            x,
            packed,
            b,
            stride=case.stride,
            padding=case.padding,
            epilogue=replace(SILU_ADD, round_tf32=r),
            residual=residual,
            interpret=True,
            tile=tile,
        )
        for r in (True, False)
    ]
    tensor_cores = conv_kernel(case.c_in, case.c_out, case.groups, case.kernel_hw).tensor_cores
    w_read = round_to_tf32(w) if tensor_cores else w  # what packing stored (the interpreter's dot is exact)
    return outs[0], outs[1], conv_reference(x, w_read, b, case, SILU_ADD, residual)


def assert_rounded_store(rounded: torch.Tensor, plain: torch.Tensor, ref64: torch.Tensor) -> None:
    assert not mantissa_low_bits(rounded).any(), "a stored value keeps mantissa bits below TF32's ten"
    # the same arithmetic, then the rounding: bit for bit what round_to_tf32 makes of the unrounded store
    assert torch.equal(rounded.contiguous(), round_to_tf32(plain.contiguous()))
    # and the TF32 value nearest to the float64 result: float32 accumulation (an absolute error, which
    # matters where a value cancels to near zero) moves a value across a rounding boundary now and then
    # (one TF32 step), never further
    nearest = round_to_tf32(ref64.float().contiguous())
    step = nearest.abs() * 2.0**-10 * (1 + 1e-6) + 1e-6 * ref64.abs().max().item()
    assert ((rounded - nearest).abs() <= step).all()
    assert (rounded == nearest).double().mean().item() > 0.99
    assert rel_error(rounded, ref64) < 2.0**-11


@pytest.mark.parametrize(("case", "tile"), ROUNDED_CASES, ids=[str(c) for c, _ in ROUNDED_CASES])
def test_conv_epilogue_stores_tf32_rounded(case: ConvCase, tile: TileConfig | None) -> None:
    assert_rounded_store(*_conv_both(case, tile))


@pytest.mark.parametrize("split_k", [1, 2])
def test_gemm_epilogue_stores_tf32_rounded(split_k: int) -> None:
    a = torch.randn(3, 29, 45)
    w, b, residual = torch.randn(37, 45) / 45**0.5, torch.randn(37), torch.randn(3, 29, 37)
    packed = pack_gemm_weight(w, "tf32")
    tile = TileConfig(16, 32, 16, 1, 4, 1, split_k=split_k)
    rounded, plain = (
        gemm_act(a, packed, b, epilogue=replace(SILU_ADD, round_tf32=r), residual=residual, interpret=True, tile=tile)
        for r in (True, False)
    )
    assert_rounded_store(rounded, plain, gemm_reference(a, round_to_tf32(w), b, SILU_ADD, residual))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, on the NaN row
def test_rounded_store_keeps_inf_nan_and_signs() -> None:
    """Infinite and NaN values pass the rounding as they are, the largest floats and subnormals round like
    any other; ties go away from zero. (A -0.0 cannot be checked here: the accumulator starts at +0.0.)"""
    one = torch.tensor(1.0).view(torch.int32)
    ties = torch.stack([(one + 0x1000), (one + 0x3000)]).view(torch.float32)  # halfway above 1 and above 1 + 2^-10
    x = torch.tensor([math.inf, -math.inf, math.nan, 3.0e38, -1.5e-39, *ties.tolist(), *(-ties).tolist()])
    a = x[:, None]  # a [k=1] GEMM with the weight 1: the epilogue sees exactly these values
    out = gemm_act(a, pack_gemm_weight(torch.ones(1, 1), "tf32"), None, epilogue=Epilogue(round_tf32=True),
                   interpret=True)[:, 0]  # fmt: skip
    expected = round_to_tf32(x)
    assert torch.equal(out[:2], x[:2]) and math.isnan(out[2].item())
    assert torch.equal(out[3:], expected[3:])
    assert not mantissa_low_bits(out[3:]).any()
    assert out[5].item() == 1.0 + 2.0**-10 and out[6].item() == 1.0 + 2.0**-9  # ties away from zero
    assert out[7].item() == -(1.0 + 2.0**-10)


def test_input_gain_scales_the_columns_of_each_input_channel() -> None:
    w = torch.randn(10, 3, 3, 3)  # a grouped conv: 6 input channels in 2 groups, 5 output channels each
    gain = torch.tensor([1.0, 2.0, 3.0, 5.0, 7.0, 11.0])
    scaled = scale_input_channels(w, gain, groups=2)
    for o in range(10):
        for c in range(3):
            assert torch.equal(scaled[o, c], w[o, c] * gain[(o // 5) * 3 + c])
    assert torch.equal(scale_input_channels(torch.ones(4, 6), gain), gain.expand(4, 6))
    with pytest.raises(ValueError, match="input gain has 5 entries for a weight of 6 input channels"):
        scale_input_channels(w, gain[:5], groups=2)


def test_input_gain_is_packed_only_where_the_tensor_cores_truncate() -> None:
    w = torch.randn(21, 19, 3, 3)
    gain = torch.where(torch.arange(19) % 2 == 0, 1.0, TRUNCATION_GAIN)
    compensated = pack_conv_weight(w, "tf32", input_gain=gain).data
    assert torch.equal(compensated, pack_conv_weight(w * gain[None, :, None, None], "tf32").data)
    assert not torch.equal(compensated, pack_conv_weight(w, "tf32").data)
    for precision in ("ieee", "tf32x3", "bf16"):  # nothing truncates there
        assert torch.equal(pack_conv_weight(w, precision, input_gain=gain).data, pack_conv_weight(w, precision).data)
    stem, dw = torch.randn(16, 3, 3, 3), torch.randn(19, 1, 3, 3)  # direct and depthwise kernels: FMA units
    assert torch.equal(pack_conv_weight(stem, "tf32", input_gain=gain[:3]).data, pack_conv_weight(stem, "tf32").data)
    assert torch.equal(pack_conv_weight(dw, "tf32", 19, input_gain=gain).data, pack_conv_weight(dw, "tf32", 19).data)
    lin = torch.randn(37, 19)
    packed = pack_gemm_weight(lin, "tf32", input_gain=gain).data
    assert torch.equal(packed, pack_gemm_weight(lin * gain, "tf32").data)
    assert abs((1 - 1 / TRUNCATION_GAIN) - 2.0**-11 / (2 * math.log(2))) < 1e-12  # about 3.5e-4
