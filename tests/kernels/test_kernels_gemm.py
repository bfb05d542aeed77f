"""gemm_act through Triton's interpreter on CPU tensors against a float64 matmul + epilogue."""

from __future__ import annotations

import pytest
import torch
from accuracy import GEMM_KN, GEMM_M, assert_close, rel_error
from kernels_reference import EPILOGUES, gemm_reference

from fuser.kernels import (
    Activation,
    Epilogue,
    PackedGemmWeight,
    Residual,
    gemm_act,
    pack_gemm_weight,
)

GELU = Epilogue(Activation.GELU)


def run_gemm(
    a: torch.Tensor,
    n: int,
    epilogue: Epilogue,
    precision: str = "ieee",
    bias: bool = True,
    residual_shape: tuple[int, ...] | None = None,
    path: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, a.shape[-1]) / a.shape[-1] ** 0.5
    b = torch.randn(n) if bias else None
    residual = None
    if epilogue.residual != Residual.NONE:
        residual = torch.randn(residual_shape or (*a.shape[:-1], n)).to(a.dtype)
    out = gemm_act(
        a, pack_gemm_weight(w, precision), b, epilogue=epilogue, residual=residual, interpret=True, path=path
    )
    assert out.shape == (*a.shape[:-1], n) and out.dtype == a.dtype
    return out, gemm_reference(a, w, b, epilogue, residual)


@pytest.mark.parametrize("kn", GEMM_KN, ids=lambda kn: f"k{kn[0]}n{kn[1]}")
@pytest.mark.parametrize("m", GEMM_M, ids=lambda m: f"m{m}")
def test_shapes(m: int, kn: tuple[int, int]) -> None:
    out, ref = run_gemm(torch.randn(m, kn[0]), kn[1], GELU)
    assert_close(out, ref, "ieee", f"m={m} k,n={kn}")


@pytest.mark.parametrize("epilogue", EPILOGUES, ids=lambda e: e.describe())
def test_epilogue(epilogue: Epilogue) -> None:
    out, ref = run_gemm(torch.randn(33, 45), 37, epilogue)
    assert_close(out, ref, "ieee", epilogue.describe())


@pytest.mark.parametrize(
    "layout", ["contiguous", "permuted", "sliced"], ids=["3d-contiguous", "3d-permuted", "3d-sliced"]
)
def test_batched_any_strides(layout: str) -> None:
    if layout == "contiguous":
        a = torch.randn(3, 11, 45)
    elif layout == "permuted":
        a = torch.randn(3, 45, 11).transpose(1, 2)
    else:
        a = torch.randn(3, 13, 50)[:, 1:12, 2:47]
    epilogue = Epilogue(Activation.TANH, residual=Residual.AFTER_ACT, scale=0.25)
    out, ref = run_gemm(a, 21, epilogue)
    assert_close(out, ref, "ieee", layout)


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
@pytest.mark.parametrize("m", [1, 33], ids=lambda m: f"m{m}")
def test_precision(m: int, precision: str, dtype: torch.dtype) -> None:
    epilogue = Epilogue(Activation.SILU, residual=Residual.BEFORE_ACT)
    out, ref = run_gemm(torch.randn(m, 64).to(dtype), 37, epilogue, precision)
    assert_close(out, ref, precision, f"{precision} {dtype}")


@pytest.mark.parametrize("m", [7, 33], ids=lambda m: f"m{m}")
def test_descriptor_and_pointer_paths_agree(m: int) -> None:
    """K=48, N=40 in float32 are 16-byte aligned, so both paths can run; both must match."""
    a = torch.randn(m, 48)
    for path in ("descriptor", "pointer"):
        torch.manual_seed(2)
        out, ref = run_gemm(a, 40, Epilogue(Activation.RELU6, residual=Residual.AFTER_ACT), path=path)
        assert_close(out, ref, "ieee", path)


def test_broadcast_residual_and_no_bias() -> None:
    epilogue = Epilogue(Activation.LEAKY_RELU, alpha=0.2, residual=Residual.BEFORE_ACT)
    out, ref = run_gemm(torch.randn(3, 7, 19), 21, epilogue, bias=False, residual_shape=(21,))
    assert_close(out, ref, "ieee", "row-broadcast residual")


def test_repeated_calls_use_each_calls_tensors() -> None:
    """Later calls of one signature reuse the launch plan, never the first call's tensors."""
    epilogue = Epilogue(Activation.GELU_TANH, residual=Residual.BEFORE_ACT)
    for _ in range(2):
        out, ref = run_gemm(torch.randn(3, 7, 45), 37, epilogue)
        assert_close(out, ref, "ieee", "repeated")


def test_nan_propagates() -> None:
    a = torch.randn(7, 45)
    a[3, 17] = float("nan")
    out = gemm_act(a, pack_gemm_weight(torch.randn(37, 45), "ieee"), interpret=True)
    assert torch.isnan(out[3]).all()
    assert not torch.isnan(out[[0, 1, 2, 4, 5, 6]]).any()
    assert rel_error(out, torch.zeros_like(out)) == float("inf")


def test_packed_weight_roundtrip() -> None:
    packed = pack_gemm_weight(torch.randn(21, 19), "bf16")
    assert packed.data.shape == (21, 32) and packed.data.dtype == torch.bfloat16
    assert PackedGemmWeight.from_parts(packed.data, 21, 19, "bf16") == packed
    with pytest.raises(ValueError, match="expected contiguous"):
        PackedGemmWeight.from_parts(packed.data, 21, 33, "bf16")


def test_errors() -> None:
    w = pack_gemm_weight(torch.randn(21, 19), "ieee")
    a = torch.randn(7, 19)
    with pytest.raises(ValueError, match=r"a has K=18 .* expects K=19"):
        gemm_act(torch.randn(7, 18), w, interpret=True)
    with pytest.raises(ValueError, match=r"2-D \[M, K\] or 3-D.*\(2, 3, 7, 19\)"):
        gemm_act(torch.randn(2, 3, 7, 19), w, interpret=True)
    with pytest.raises(ValueError, match=r"float32, float16 or bfloat16.*torch.float64"):
        gemm_act(a.double(), w, interpret=True)
    with pytest.raises(ValueError, match="need CUDA tensors, but a is on cpu"):
        gemm_act(a, w)
    with pytest.raises(ValueError, match=r"bias must have shape \(21,\)"):
        gemm_act(a, w, torch.randn(19), interpret=True)
    with pytest.raises(ValueError, match="does not broadcast"):
        gemm_act(a, w, epilogue=Epilogue(residual=Residual.BEFORE_ACT), residual=torch.randn(7, 19), interpret=True)
    with pytest.raises(ValueError, match="descriptor path needs"):
        gemm_act(a, w, path="descriptor", interpret=True)
    with pytest.raises(ValueError, match="path must be"):
        gemm_act(a, w, path="tma", interpret=True)
    with pytest.raises(TypeError, match="PackedGemmWeight"):
        gemm_act(a, torch.randn(21, 19), interpret=True)
    with pytest.raises(ValueError, match="epilogue alpha and scale not finite"):
        Epilogue(scale=float("nan"))
