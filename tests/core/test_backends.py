"""The same optimized graph on every backend: the torch reference, and the Triton kernels.

On the CPU the kernels run in Triton's interpreter ("interpret"); on a GPU ("triton", marked gpu) they are
compiled. Either way the fused ops must agree with a float64 run of the original model.
"""

from __future__ import annotations

import pytest
import torch
from accuracy import assert_close, reference64
from torch import nn
from toy_models import ConvBiasAct, ConvBnAct, ConvBnActAdd, ConvBnAddAct, LinearAct, Untraceable, seeded

import fuser
from fuser.lower.fused_modules import FusedConv2d

CASES = {
    "conv_bn_silu_add": (lambda: ConvBnActAdd(5), lambda: (torch.randn(2, 5, 9, 7),)),
    "conv_bn_add_relu": (lambda: ConvBnAddAct(19), lambda: (torch.randn(1, 19, 7, 13),)),
    "conv_stride2_same": (
        lambda: ConvBnAct(nn.Hardswish(), 3, 5, stride=2, padding=(1, 2), kernel_size=(3, 5)),
        lambda: (torch.randn(3, 3, 13, 11),),
    ),
    "depthwise": (
        lambda: ConvBnAct(nn.ReLU6(), 5, 5, groups=5, dilation=2, padding=2),
        lambda: (torch.randn(2, 5, 9, 7),),
    ),
    "grouped": (lambda: ConvBnAct(nn.LeakyReLU(0.1), 6, 9, groups=3), lambda: (torch.randn(1, 6, 7, 7),)),
    "conv_bias_relu6_add": (lambda: ConvBiasAct(5, residual=True), lambda: (torch.randn(2, 5, 7, 9),)),
    "linear_gelu_add_scale_3d": (
        lambda: LinearAct(act=nn.GELU(), residual=True, scale=0.7),
        lambda: (torch.randn(2, 7, 19), torch.randn(2, 7, 21)),
    ),
    "linear_tanh_m1": (lambda: LinearAct(act=torch.tanh), lambda: (torch.randn(1, 19),)),
    "untraceable_model": (lambda: Untraceable(), lambda: (torch.randn(1, 3, 21, 19),)),
}


def run_case(name: str, backend: str, device: str, precision: str) -> None:
    make_model, make_inputs = CASES[name]
    model = seeded(make_model()).to(device)
    inputs = tuple(t.to(device) for t in make_inputs())
    opt = fuser.optimize(model, inputs, backend=backend, precision=precision)
    assert opt.fusion_report.fused
    with torch.no_grad():
        out = opt(*inputs)
    assert_close(out, reference64(model.cpu(), *(t.cpu() for t in inputs)), precision, f"{name} on {backend}")


@pytest.mark.parametrize("name", CASES)
def test_interpret_backend_matches_float64(name):
    run_case(name, "interpret", "cpu", "ieee")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_interpret_backend_reduced_precision(precision):
    run_case("conv_bn_silu_add", "interpret", "cpu", precision)
    run_case("linear_gelu_add_scale_3d", "interpret", "cpu", precision)


def test_interpret_agrees_with_torch_backend_layout_and_dtype():
    model = seeded(ConvBnActAdd(5))
    x = torch.randn(2, 5, 9, 7).to(memory_format=torch.channels_last)
    a = fuser.optimize(model, (x,), backend="interpret")(x)
    b = fuser.optimize(model, (x,), backend="torch")(x)
    assert a.dtype == b.dtype == torch.float32
    assert a.is_contiguous(memory_format=torch.channels_last)
    assert_close(a, b, "tf32")  # the default policy: the interpreted kernels round operands to TF32


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["tf32", "tf32x3", "ieee", "bf16", "fp16"])
@pytest.mark.parametrize("name", CASES)
def test_triton_backend_matches_float64(name, precision):
    run_case(name, "triton", "cuda", precision)


def test_half_model_keeps_16_bit_operands_under_the_default_policy():
    model = seeded(ConvBnActAdd(5)).half()
    x = torch.randn(2, 5, 9, 7).half()
    opt = fuser.optimize(model, (x,), backend="interpret")  # precision="tf32": a float32 policy
    fused = next(m for m in opt.modules() if isinstance(m, FusedConv2d))
    assert fused.kernel_precision.value == "fp16"
    with torch.no_grad():
        out = opt(x)
    assert out.dtype == torch.float16
    assert_close(out, reference64(model.float(), x.float()), "fp16")
