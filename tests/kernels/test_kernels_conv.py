"""conv2d_act through Triton's interpreter on CPU tensors against float64 F.conv2d + epilogue."""

from __future__ import annotations

import pytest
import torch
from accuracy import assert_close, rel_error
from kernels_reference import EPILOGUES, ConvCase, conv_inputs, conv_reference

from fuser.kernels import (
    Activation,
    Epilogue,
    PackedConvWeight,
    Residual,
    conv2d_act,
    conv2d_supported,
    pack_conv_weight,
)
from fuser.kernels.autotune import TileConfig

SILU = Epilogue(Activation.SILU)

# Odd channels (3, 5, 19), odd images (7, 13, 21x19), stride 2, dilation 2, padding 0 / 1 / "same"-style
# asymmetric, batch 1 and 3; each kernel path: direct (C_in <= 4, the stem), flat K (C_in < 16), channel
# blocks, 1x1 GEMM, grouped (implicit GEMM and direct), depthwise.
GEOMETRIES = [
    ConvCase("stem_c3_s2_p1", 1, 3, 16, (13, 13), 3, stride=2, padding=(1, 1, 1, 1)),
    ConvCase("c5_k3_p0_b3", 3, 5, 7, (7, 7), 3),
    ConvCase("c19_21x19_p1", 1, 19, 21, (21, 19), 3, padding=(1, 1, 1, 1)),
    ConvCase("c5_dil2_b3", 3, 5, 11, (13, 13), 3, padding=(2, 2, 2, 2), dilation=2),
    ConvCase("c19_k2_same_asym", 1, 19, 9, (13, 13), 2, padding=(0, 1, 0, 1)),
    ConvCase("c19_s2_asym_b3", 3, 19, 13, (21, 19), 3, stride=2, padding=(0, 1, 1, 0)),
    ConvCase("c40_multi_tile", 3, 40, 37, (9, 11), 3, padding=(1, 1, 1, 1)),
    ConvCase("k5_c5", 1, 5, 7, (13, 13), 5, padding=(2, 2, 2, 2)),  # filter rows of 25 weights
    ConvCase("stem7_c3_s2_b2", 2, 3, 9, (23, 21), 7, stride=2, padding=(3, 3, 3, 3)),  # the 7x7 RGB stem: rows
    ConvCase("pointwise_gemm_b3", 3, 19, 21, (7, 7), 1),
    ConvCase("pointwise_s2", 1, 19, 5, (13, 13), 1, stride=2),
    ConvCase("grouped_4", 3, 20, 8, (13, 13), 3, stride=2, padding=(1, 1, 1, 1), groups=4),
    ConvCase("grouped_direct_multiplier", 3, 8, 12, (13, 11), 3, padding=(1, 1, 1, 1), groups=4),
    ConvCase("depthwise_c19_b3", 3, 19, 19, (13, 13), 3, padding=(1, 1, 1, 1), groups=19),
    ConvCase("depthwise_s2_dil2", 1, 5, 5, (21, 19), 3, stride=2, padding=(2, 2, 2, 2), dilation=2, groups=5),
    # 12 and 6 channels: NHWC strides are multiples of 4 and 2, so the kernel receives them as such (VEC).
    ConvCase("depthwise_c12_k5_s2", 2, 12, 12, (11, 9), 5, stride=2, padding=(2, 2, 2, 2), groups=12),
    ConvCase("depthwise_c6_b3", 3, 6, 6, (9, 7), 3, padding=(1, 1, 1, 1), groups=6),
]
BY_NAME = {case.name: case for case in GEOMETRIES}
KERNEL_PATHS = [
    BY_NAME["c19_s2_asym_b3"],
    BY_NAME["stem_c3_s2_p1"],
    BY_NAME["pointwise_gemm_b3"],
    BY_NAME["depthwise_c19_b3"],
    BY_NAME["grouped_4"],
    BY_NAME["stem7_c3_s2_b2"],
]


def run_conv(
    case: ConvCase,
    epilogue: Epilogue,
    precision: str = "ieee",
    dtype: torch.dtype = torch.float32,
    channels_last: bool = True,
    bias: bool = True,
    path: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    x, w, b, residual = conv_inputs(case, epilogue, dtype, channels_last=channels_last)
    b = b if bias else None
    packed = pack_conv_weight(w, precision, groups=case.groups)
    out = conv2d_act(
        x,
        packed,
        b,
        stride=case.stride,
        padding=case.padding,
        dilation=case.dilation,
        epilogue=epilogue,
        residual=residual,
        interpret=True,
        path=path,
    )
    return out, conv_reference(x, w, b, case, epilogue, residual)


@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("case", GEOMETRIES, ids=str)
def test_geometry(case: ConvCase, channels_last: bool) -> None:
    out, ref = run_conv(case, SILU, channels_last=channels_last)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert out.dtype == torch.float32
    assert_close(out, ref, "ieee", f"{case} {'nhwc' if channels_last else 'nchw'}")


@pytest.mark.parametrize("epilogue", EPILOGUES, ids=lambda e: e.describe())
@pytest.mark.parametrize("case", KERNEL_PATHS, ids=str)
def test_epilogue(case: ConvCase, epilogue: Epilogue) -> None:
    out, ref = run_conv(case, epilogue)
    assert_close(out, ref, "ieee", f"{case} {epilogue.describe()}")


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [
        ("tf32", torch.float32),
        ("tf32x3", torch.float32),
        ("bf16", torch.float32),
        ("fp16", torch.float32),
        ("fp16", torch.float16),
        ("bf16", torch.bfloat16),
    ],
    ids=["tf32", "tf32x3", "bf16", "fp16", "fp16-model", "bf16-model"],
)
@pytest.mark.parametrize("case", KERNEL_PATHS[:5], ids=str)
def test_precision(case: ConvCase, precision: str, dtype: torch.dtype) -> None:
    epilogue = Epilogue(Activation.HARDSWISH, residual=Residual.AFTER_ACT)
    out, ref = run_conv(case, epilogue, precision, dtype)
    assert out.dtype == dtype
    assert_close(out, ref, precision, f"{case} {precision} {dtype}")


@pytest.mark.parametrize(
    "case",
    [
        ConvCase("aligned_rows_c8", 3, 8, 8, (13, 11), 3, stride=2, padding=(1, 1, 1, 1)),
        ConvCase("aligned_flat_k_c5", 3, 5, 8, (13, 11), 3, stride=2, padding=(1, 1, 1, 1)),
        ConvCase("aligned_rows_7x7_c4", 2, 4, 16, (17, 15), 7, stride=2, padding=(3, 3, 3, 3)),
        ConvCase("aligned_c20", 3, 20, 8, (13, 11), 3, stride=2, padding=(1, 1, 1, 1)),
    ],
    ids=str,
)
def test_descriptor_and_pointer_paths_agree(case: ConvCase) -> None:
    """Aligned shapes can take either path; both must match the reference (indexing of each path)."""
    epilogue = Epilogue(Activation.GELU, residual=Residual.BEFORE_ACT)
    for path in ("descriptor", "pointer"):
        torch.manual_seed(1)
        out, ref = run_conv(case, epilogue, path=path)
        assert_close(out, ref, "ieee", f"{case} {path}")


def test_no_bias_and_broadcast_residual() -> None:
    case = BY_NAME["c19_s2_asym_b3"]
    x, w, _, _ = conv_inputs(case, SILU)
    residual = torch.randn(1, case.c_out, 1, 1)  # broadcast over batch and space: stride-0 loads
    epilogue = Epilogue(Activation.RELU, residual=Residual.BEFORE_ACT)
    out = conv2d_act(
        x,
        pack_conv_weight(w, "ieee"),
        None,
        stride=2,
        padding=case.padding,
        epilogue=epilogue,
        residual=residual,
        interpret=True,
    )
    assert_close(out, conv_reference(x, w, None, case, epilogue, residual.expand(out.shape)), "ieee", "broadcast")


@pytest.mark.parametrize(
    "case", [BY_NAME["c19_s2_asym_b3"], BY_NAME["pointwise_gemm_b3"], BY_NAME["stem_c3_s2_p1"]], ids=str
)
def test_repeated_calls_use_each_calls_tensors(case: ConvCase) -> None:
    """Later calls of one signature reuse the launch plan, never the first call's weights, bias or data.
    A bfloat16 bias also exercises the per-call float32 conversion."""
    epilogue = Epilogue(Activation.SILU, residual=Residual.AFTER_ACT)
    for _ in range(2):
        x, w, b, residual = conv_inputs(case, epilogue)
        b = b.bfloat16()
        out = conv2d_act(
            x,
            pack_conv_weight(w, "ieee", groups=case.groups),
            b,
            stride=case.stride,
            padding=case.padding,
            epilogue=epilogue,
            residual=residual,
            interpret=True,
        )
        assert_close(out, conv_reference(x, w, b, case, epilogue, residual), "ieee", f"{case} repeated")


def test_nan_propagates() -> None:
    """A NaN in the input must reach the output (no masked-away reads), and NaN never passes the check."""
    case = BY_NAME["c19_21x19_p1"]
    x, w, b, _ = conv_inputs(case, SILU)
    x[0, 4, 10, 9] = float("nan")
    out = conv2d_act(x, pack_conv_weight(w, "ieee"), b, padding=case.padding, epilogue=SILU, interpret=True)
    assert torch.isnan(out[0, :, 9:12, 8:11]).all()
    assert not torch.isnan(out[0, :, 0, 0]).any()
    assert rel_error(out, conv_reference(x, w, b, case, SILU, None).nan_to_num()) == float("inf")


def test_user_tensors_unchanged() -> None:
    case = BY_NAME["c5_k3_p0_b3"]
    x, w, b, _ = conv_inputs(case, SILU)
    copies = [t.clone() for t in (x, w, b)]
    packed = pack_conv_weight(w, "bf16")
    conv2d_act(x, packed, b, epilogue=SILU, interpret=True)
    for before, after in zip(copies, (x, w, b), strict=True):
        assert torch.equal(before, after)


def test_packed_weight_roundtrip() -> None:
    w = torch.randn(8, 5, 3, 3)
    packed = pack_conv_weight(w, "fp16")
    assert packed.data.shape == (8, 48) and packed.data.dtype == torch.float16
    rebuilt = PackedConvWeight.from_parts(packed.data, 8, 5, 3, 3, 1, "fp16")
    assert rebuilt == packed
    with pytest.raises(ValueError, match="expected contiguous"):
        PackedConvWeight.from_parts(packed.data, 8, 6, 3, 3, 1, "fp16")
    with pytest.raises(ValueError, match="expected contiguous"):
        PackedConvWeight.from_parts(packed.data.float(), 8, 5, 3, 3, 1, "fp16")


def test_direct_weight_layout() -> None:
    """The direct kernel's packed weight: float32 rows ``(group, kh, kw, c)`` of the group's output channels, the
    values rounded to the operand dtype, zero columns up to whole channel tiles; refused in the GEMM layout."""
    w = torch.randn(10, 3, 3, 2)  # 2 groups of 5 output channels, 3 input channels each
    packed = pack_conv_weight(w, "fp16", groups=2)
    assert packed.data.shape == (2 * 3 * 2 * 3, 16) and packed.data.dtype == torch.float32
    g, kh, kw, c, n = 1, 2, 1, 0, 3
    assert packed.data[g * 18 + (kh * 2 + kw) * 3 + c, n] == w[g * 5 + n, c, kh, kw].half().float()
    assert not packed.data[:, 5:].any() and packed.data[:, :5].all()
    assert PackedConvWeight.from_parts(packed.data, 10, 6, 3, 2, 2, "fp16") == packed
    gemm_layout = torch.zeros(10, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"expected contiguous \(36, 16\) torch.float32"):
        PackedConvWeight.from_parts(gemm_layout, 10, 6, 3, 2, 2, "fp16")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_direct_kernel_rounds_float32_pixels_to_the_operand_dtype(precision: str) -> None:
    """Under a 16-bit policy on a float32 input the direct kernel multiplies the pixels rounded to that dtype, as the
    GEMM kernels do (its weights come rounded from packing): exactly the float64 conv of the rounded operands, where
    unrounded pixels would be off by about 2^-9 (fp16) or 2^-7 (bf16) relative."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 11, 13, generator=gen)
    w = torch.randn(7, 3, 3, 3, generator=gen)
    out = conv2d_act(x, pack_conv_weight(w, precision), stride=(2, 2), padding=1, interpret=True)
    ref = torch.nn.functional.conv2d(x.to(dtype).double(), w.to(dtype).double(), stride=2, padding=1)
    assert rel_error(out, ref) < 1e-6
    assert rel_error(torch.nn.functional.conv2d(x.double(), w.to(dtype).double(), stride=2, padding=1), ref) > 1e-4


def test_supported() -> None:
    assert conv2d_supported(19, 21, 1)
    assert conv2d_supported(32, 32, 32)  # depthwise
    assert conv2d_supported(20, 8, 4)  # grouped
    assert not conv2d_supported(20, 9, 4)
    assert not conv2d_supported(5, 5, 0)


def test_errors() -> None:
    w = pack_conv_weight(torch.randn(7, 5, 3, 3), "ieee")
    x = torch.randn(1, 5, 9, 9)
    with pytest.raises(ValueError, match=r"x has 4 channels .* expects C_in=5"):
        conv2d_act(torch.randn(1, 4, 9, 9), w, interpret=True)
    with pytest.raises(ValueError, match=r"4-D \[N, C, H, W\].*\(1, 5, 9, 9, 2\)"):
        conv2d_act(torch.randn(1, 5, 9, 9, 2), w, interpret=True)
    with pytest.raises(ValueError, match=r"float32, float16 or bfloat16.*torch.int32"):
        conv2d_act(x.int(), w, interpret=True)
    with pytest.raises(ValueError, match="need CUDA tensors, but x is on cpu"):
        conv2d_act(x, w, interpret=False)
    with pytest.raises(ValueError, match=r"bias must have shape \(7,\)"):
        conv2d_act(x, w, torch.randn(5), interpret=True)
    with pytest.raises(ValueError, match="does not fit the 2x2 input"):
        conv2d_act(torch.randn(1, 5, 2, 2), w, interpret=True)
    with pytest.raises(ValueError, match="needs a residual tensor"):
        conv2d_act(x, w, epilogue=Epilogue(residual=Residual.AFTER_ACT), interpret=True)
    with pytest.raises(ValueError, match="has no residual step"):
        conv2d_act(x, w, residual=torch.randn(1, 7, 7, 7), interpret=True)
    with pytest.raises(ValueError, match=r"residual of shape \(1, 7, 6, 6\) does not broadcast"):
        conv2d_act(
            x, w, epilogue=Epilogue(residual=Residual.AFTER_ACT), residual=torch.randn(1, 7, 6, 6), interpret=True
        )
    with pytest.raises(ValueError, match="padding must be"):
        conv2d_act(x, w, padding=(1, 1, 1), interpret=True)
    with pytest.raises(ValueError, match="descriptor path needs"):
        conv2d_act(x, w, padding=1, path="descriptor", interpret=True)  # C_out=7: rows not 16-byte aligned
    with pytest.raises(ValueError, match="descriptor path does not exist for the direct conv kernel"):
        conv2d_act(
            torch.randn(1, 3, 9, 9),
            pack_conv_weight(torch.randn(8, 3, 3, 3), "ieee"),
            path="descriptor",
            interpret=True,
        )
    with pytest.raises(TypeError, match="PackedConvWeight"):
        conv2d_act(x, torch.randn(7, 5, 3, 3), interpret=True)
    with pytest.raises(ValueError, match="groups=4 must divide"):
        pack_conv_weight(torch.randn(7, 5, 3, 3), "ieee", groups=4)
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        pack_conv_weight(torch.randn(7, 5, 3, 3), "fp8")


# Height and width told apart: a kernel that ignores dilation, or swaps (h, w) for (h, h), fails one of
# these on every path. Non-square kernels and images keep the two axes from coinciding.
ANISOTROPIC = [("dil21", {"dilation": (2, 1)}), ("dil12", {"dilation": (1, 2)}), ("s12", {"stride": (1, 2)})]
PATHS_2D = [
    ("direct", dict(c_in=3, c_out=7, kernel=(3, 2)), None),
    ("depthwise", dict(c_in=5, c_out=5, kernel=(3, 2), groups=5), None),
    ("flat_k", dict(c_in=5, c_out=7, kernel=(3, 2)), None),
    ("channel_blocks", dict(c_in=19, c_out=7, kernel=(3, 2)), None),
    ("grouped_flat_k", dict(c_in=20, c_out=8, kernel=(3, 2), groups=4), None),
    ("pointwise", dict(c_in=19, c_out=7, kernel=1, padding=(0, 0, 0, 0)), None),  # the 1x1 GEMM unless strided
    ("split_k", dict(c_in=19, c_out=7, kernel=(3, 2)), TileConfig(32, 16, 16, 2, 4, 1, split_k=3)),
    ("filter_rows", dict(c_in=3, c_out=7, kernel=(7, 6)), None),
    # a forced block_k below the row is widened to the row; 5 rows over 3 splits: 2, 2, 1
    ("filter_rows_split", dict(c_in=5, c_out=9, kernel=(5, 4)), TileConfig(32, 16, 16, 2, 4, 1, split_k=3)),
]


@pytest.mark.parametrize(("geometry", "changes"), ANISOTROPIC, ids=[g for g, _ in ANISOTROPIC])
@pytest.mark.parametrize(("kernel_path", "shape", "tile"), PATHS_2D, ids=[p for p, _, _ in PATHS_2D])
def test_anisotropic_stride_and_dilation(
    kernel_path: str, shape: dict, tile: TileConfig | None, geometry: str, changes: dict
) -> None:
    case = ConvCase(f"{kernel_path}_{geometry}", 2, hw=(11, 13), **{"padding": (2, 1, 1, 2), **shape, **changes})
    x, w, b, _ = conv_inputs(case, SILU)
    out = conv2d_act(
        x, pack_conv_weight(w, "ieee", groups=case.groups), b, stride=case.stride, padding=case.padding,
        dilation=case.dilation, epilogue=SILU, interpret=True, tile=tile,
    )  # fmt: skip
    assert_close(out, conv_reference(x, w, b, case, SILU, None), "ieee", case.name)


@pytest.mark.parametrize(("geometry", "changes"), ANISOTROPIC, ids=[g for g, _ in ANISOTROPIC])
@pytest.mark.parametrize(("c_in", "groups"), [(3, 1), (19, 1), (5, 5)], ids=["direct", "channel_blocks", "depthwise"])
def test_anisotropic_geometry_through_the_rewrite(c_in: int, groups: int, geometry: str, changes: dict) -> None:
    """fuser.optimize must carry (h, w) stride and dilation from the model to the kernel unchanged."""
    from accuracy import reference64
    from toy_models import ConvBnAct, seeded

    import fuser

    c_out = c_in if groups > 1 else 7
    model = seeded(
        ConvBnAct(torch.nn.SiLU(), c_in, c_out, kernel_size=(3, 2), padding=(2, 1), groups=groups, **changes)
    )
    x = torch.randn(2, c_in, 11, 13)
    opt = fuser.optimize(model, (x,), backend="interpret", precision="ieee")
    assert [e.fused for e in opt.fusion_report.entries] == [True]
    with torch.no_grad():
        out = opt(x)
    assert_close(out, reference64(model, x), "ieee", f"{geometry} c_in={c_in}")


@pytest.mark.parametrize(
    ("element_size", "values", "expected"),
    [(4, (72, 4032, 225792), 4), (4, (6, 42), 2), (4, (19, 76), 1), (2, (72, 4032), 8), (2, (12, 36), 4)],
)
def test_alignment_unit_is_the_largest_common_vector(element_size: int, values: tuple[int, ...], expected: int) -> None:
    from fuser.kernels.launch import alignment_unit

    assert alignment_unit(element_size, values) == expected


def test_depthwise_reads_a_channel_slice_input_at_its_own_alignment() -> None:
    """An NHWC input whose pixel stride (14) is not a multiple of its channel count's unit (12 -> 4): the
    kernel must fall back to the common divisor, not the channel count's."""
    case = ConvCase("depthwise_c12_slice", 2, 12, 12, (9, 7), 3, padding=(1, 1, 1, 1), groups=12)
    x, w, b, _ = conv_inputs(case, SILU, torch.float32, channels_last=True)
    wide = torch.randn(2, 9, 7, 14).permute(0, 3, 1, 2)[:, 1:13]  # channels 1..12 of a 14-channel NHWC buffer
    wide.copy_(x)
    packed = pack_conv_weight(w, "ieee", groups=12)
    out = conv2d_act(wide, packed, b, padding=case.padding, epilogue=SILU, interpret=True)
    assert_close(out, conv_reference(wide, w, b, case, SILU, None), "ieee")
