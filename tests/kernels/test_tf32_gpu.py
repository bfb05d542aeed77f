"""TF32 on the GPU: the compiled kernels store TF32-rounded values where asked (the epilogue's bit trick
compiles on the card's triton), and at the model level fuser's tf32 error is at most twice cuDNN's."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from accuracy import rel_error
from kernels_reference import ConvCase, conv_inputs

import fuser
from fuser import models
from fuser.kernels import Activation, Epilogue, Residual, conv2d_act, gemm_act, pack_conv_weight, pack_gemm_weight
from fuser.kernels.precision import Precision, round_to_tf32
from fuser.runtime.torch_precision import torch_precision


def assert_rounded(rounded: torch.Tensor, plain: torch.Tensor) -> None:
    """Stored rounded: the low 13 mantissa bits clear, and round_to_tf32 of the unrounded store (bit for
    bit; a separately compiled variant may contract the epilogue's float ops differently, so one TF32 step
    is allowed on a handful of elements)."""
    rounded, expected = rounded.contiguous(), round_to_tf32(plain.contiguous())
    assert not (rounded.view(torch.int32) & 0x1FFF).any()
    differ = rounded != expected
    assert differ.double().mean().item() < 1e-3
    assert ((rounded - expected).abs() <= expected.abs() * 2.0**-10 * 1.001)[differ].all()


SILU_ADD = Epilogue(Activation.SILU, residual=Residual.AFTER_ACT)
CONV_CASES = [
    ConvCase("implicit_c40", 2, 40, 37, (13, 11), 3, padding=(1, 1, 1, 1)),
    ConvCase("gemm_1x1_c64", 3, 64, 48, (9, 7), 1),
    ConvCase("depthwise_c40", 2, 40, 40, (13, 11), 3, padding=(1, 1, 1, 1), groups=40),
    ConvCase("direct_stem_c3", 1, 3, 16, (31, 29), 3, stride=2, padding=(1, 1, 1, 1)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CONV_CASES, ids=str)
def test_compiled_conv_stores_tf32_rounded(case: ConvCase) -> None:
    x, w, b, residual = (None if t is None else t.cuda() for t in conv_inputs(case, SILU_ADD))
    packed = pack_conv_weight(w, "tf32", groups=case.groups)
    rounded, plain = (
        conv2d_act(
            x,
            packed,
            b,
            stride=case.stride,
            padding=case.padding,
            dilation=case.dilation,
            epilogue=replace(SILU_ADD, round_tf32=r),
            residual=residual,
        )
        for r in (True, False)
    )
    assert_rounded(rounded, plain)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["pointer", "descriptor"])
def test_compiled_gemm_stores_tf32_rounded(path: str) -> None:
    a = torch.randn(3, 67, 96, device="cuda")
    w, b, residual = torch.randn(80, 96, device="cuda") / 96**0.5, torch.randn(80, device="cuda"), None
    packed = pack_gemm_weight(w, "tf32")
    rounded, plain = (
        gemm_act(a, packed, b, epilogue=Epilogue(Activation.GELU, round_tf32=r), residual=residual, path=path)
        for r in (True, False)
    )
    assert_rounded(rounded, plain)


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "batch", "size"), [("resnet50", 2, 224), ("efficientnet_b0", 2, 224)])
def test_model_tf32_error_within_twice_cudnn(name: str, batch: int, size: int) -> None:
    model = models.build(name).eval()
    x = models.example_input(name, batch=batch, size=size, seed=1)
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(x.double())
    model, x = model.cuda(), x.cuda()
    optimized = fuser.optimize(model, (x,), backend="triton", precision="tf32")
    with torch.no_grad():
        out = optimized(x)
        with torch_precision(Precision.TF32):
            cudnn = model(x)
    fuser_error, cudnn_error = rel_error(out, ref), rel_error(cudnn, ref)
    print(f"{name}: fuser tf32 {fuser_error:.2e}, cuDNN tf32 {cudnn_error:.2e}")
    assert fuser_error <= 2 * cudnn_error, f"{name}: fuser {fuser_error:.2e} against cuDNN {cudnn_error:.2e}"
