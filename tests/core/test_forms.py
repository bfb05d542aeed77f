"""Every written form of every chain fuses, and the fused module computes what the original did."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from accuracy import assert_close, reference64
from torch import nn
from toy_models import (
    AddmmTanh,
    ConvBiasAct,
    ConvBnAct,
    ConvBnActAdd,
    ConvBnActSubclass,
    ConvBnAddAct,
    FunctionalBatchNorm,
    LinearAct,
    MatmulAddAct,
    seeded,
)

import fuser


def check(model: nn.Module, inputs: tuple[torch.Tensor, ...], fused: int, **kw) -> fuser.OptimizedModule:
    """Optimize with the torch backend; assert the fused count, no BN left, and float64 agreement."""
    model = seeded(model)
    opt = fuser.optimize(model, inputs, backend="torch", **kw)
    report = opt.fusion_report
    assert len(report.fused) == fused, str(report)
    graph_targets = [str(n.target) for m in opt.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]
    assert not any("batch_norm" in t for t in graph_targets), graph_targets
    with torch.no_grad():
        assert_close(opt(*inputs), reference64(model, *inputs), "ieee", type(model).__name__)
    return opt


def erf_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * (1.0 + torch.erf(x / math.sqrt(2.0))) * 0.5


def half_x_erf_gelu(x: torch.Tensor) -> torch.Tensor:
    return (x * 0.5) * (torch.erf(x * (1 / math.sqrt(2.0))) + 1.0)


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's "new GELU", written out as many models do."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def tanh_gelu_cubed_by_products(x: torch.Tensor) -> torch.Tensor:
    return (x * 0.5) * (1.0 + (((x * (x * x)) * 0.044715 + x) * math.sqrt(2.0 / math.pi)).tanh())


# (written form, the activation the report must name)
ACTIVATION_FORMS = [
    (nn.SiLU(), "silu"),
    (nn.SiLU(inplace=True), "silu"),
    (F.silu, "silu"),
    (lambda x: F.silu(x, inplace=True), "silu"),
    (lambda x: torch.nn.functional.silu(x, inplace=True), "silu"),
    (lambda x: x * torch.sigmoid(x), "silu"),
    (lambda x: x.sigmoid() * x, "silu"),
    (nn.ReLU(), "relu"),
    (nn.ReLU(inplace=True), "relu"),
    (F.relu, "relu"),
    (torch.relu, "relu"),
    (lambda x: x.relu(), "relu"),
    (lambda x: x.relu_(), "relu"),
    (lambda x: torch.relu_(x), "relu"),
    (nn.ReLU6(), "relu6"),
    (F.relu6, "relu6"),
    (lambda x: F.hardtanh(x, 0.0, 6.0), "relu6"),
    (nn.Hardtanh(0.0, 6.0), "relu6"),
    (lambda x: x.clamp(0, 6), "relu6"),
    (lambda x: torch.clamp(x, min=0.0, max=6.0), "relu6"),
    (nn.LeakyReLU(0.13), "leaky_relu"),
    (lambda x: F.leaky_relu(x, 0.2, inplace=True), "leaky_relu"),
    (nn.Hardswish(), "hardswish"),
    (F.hardswish, "hardswish"),
    (lambda x: x * F.hardsigmoid(x), "hardswish"),
    (nn.GELU(), "gelu"),
    (lambda x: F.gelu(x, approximate="tanh"), "gelu_tanh"),
    (erf_gelu, "gelu"),
    (half_x_erf_gelu, "gelu"),
    (tanh_gelu, "gelu_tanh"),
    (tanh_gelu_cubed_by_products, "gelu_tanh"),
    (nn.Sigmoid(), "sigmoid"),
    (torch.sigmoid, "sigmoid"),
    (nn.Tanh(), "tanh"),
    (lambda x: x.tanh(), "tanh"),
]


@pytest.mark.parametrize(
    ("act", "name"), ACTIVATION_FORMS, ids=[f"{i}-{n}" for i, (_, n) in enumerate(ACTIVATION_FORMS)]
)
def test_conv_bn_activation_forms(act, name):
    x = torch.randn(3, 5, 13, 11) * 2
    opt = check(ConvBnAct(act), (x,), fused=1)
    entry = opt.fusion_report.fused[0]
    assert entry.pattern == "conv_bn_act"
    assert entry.activation == name
    assert entry.ops[:2] == ["conv2d", "batch_norm"]


@pytest.mark.parametrize(
    "conv",
    [
        dict(stride=2),
        dict(padding=(0, 2), kernel_size=(3, 5)),
        dict(padding="same", kernel_size=4),
        dict(dilation=2, padding=2),
        dict(bias=True),
        dict(kernel_size=1, padding=0),
        dict(groups=5, c_out=5),  # depthwise
        dict(groups=5, c_out=10),  # grouped, channel multiplier 2
    ],
    ids=["stride2", "pad-tuple", "same-even-kernel", "dilation2", "bias", "1x1", "depthwise", "grouped"],
)
def test_conv_variants(conv):
    c_out = conv.pop("c_out", 7)
    x = torch.randn(1, 5, 21, 19)
    check(ConvBnAct(nn.SiLU(), 5, c_out, **conv), (x,), fused=1)


def test_conv_bn_without_activation_folds():
    x = torch.randn(2, 5, 9, 7)
    opt = check(ConvBnAct(nn.Identity()), (x,), fused=1)
    assert opt.fusion_report.fused[0].activation is None


@pytest.mark.parametrize("residual_first", [False, True])
def test_conv_bn_act_then_residual(residual_first):
    x = torch.randn(3, 5, 7, 7)
    opt = check(ConvBnActAdd(5, residual_first), (x,), fused=1)
    e = opt.fusion_report.fused[0]
    assert e.ops == ["conv2d", "batch_norm", "silu", "add"] and e.residual


def test_resnet_order_residual_then_relu():
    x = torch.randn(3, 5, 7, 7)
    opt = check(ConvBnAddAct(5), (x,), fused=1)
    assert opt.fusion_report.fused[0].ops == ["conv2d", "batch_norm", "add", "relu"]


def test_functional_batch_norm():
    check(FunctionalBatchNorm(), (torch.randn(2, 5, 9, 11),), fused=1)


def test_batchnorm_subclass_with_activation_inside():
    opt = check(ConvBnActSubclass(), (torch.randn(2, 5, 9, 11),), fused=1)
    assert opt.fusion_report.fused[0].activation == "hardswish"


@pytest.mark.parametrize("residual", [False, True])
def test_conv_with_bias_no_bn(residual):
    opt = check(ConvBiasAct(5, residual), (torch.randn(2, 5, 9, 11),), fused=1)
    assert opt.fusion_report.fused[0].pattern == "conv_act"
    assert opt.fusion_report.fused[0].residual == residual


@pytest.mark.parametrize(
    ("kw", "ops"),
    [
        (dict(act=nn.GELU()), ["linear", "gelu"]),
        (dict(act=lambda y: F.gelu(y, approximate="tanh")), ["linear", "gelu_tanh"]),
        (dict(act=F.silu, residual=True), ["linear", "silu", "add"]),
        (dict(act=torch.relu, residual=True, scale=0.37), ["linear", "relu", "add", "scale"]),
        (dict(scale=3.0, divide=True), ["linear", "scale"]),
        (dict(residual=True), ["linear", "add"]),
        (dict(act=nn.LeakyReLU(0.3), scale=1.7), ["linear", "leaky_relu", "scale"]),
    ],
)
@pytest.mark.parametrize("shape", [(7, 19), (3, 5, 19)], ids=["2d", "3d"])
def test_linear_epilogues(kw, ops, shape):
    x = torch.randn(*shape)
    r = torch.randn(*shape[:-1], 21)
    inputs = (x, r) if kw.get("residual") else (x,)
    opt = check(LinearAct(**kw), inputs, fused=1)
    e = opt.fusion_report.fused[0]
    assert e.pattern == "gemm_epilogue" and e.ops == ops
    if kw.get("scale"):
        expected = 1 / kw["scale"] if kw.get("divide") else kw["scale"]
        assert e.scale == pytest.approx(expected)


def test_bare_linear_is_not_a_chain():
    opt = check(LinearAct(), (torch.randn(7, 19),), fused=0)
    assert not opt.fusion_report.rejected


@pytest.mark.parametrize("shape", [(7, 19), (2, 3, 19)])
def test_matmul_plus_bias(shape):
    opt = check(MatmulAddAct(), (torch.randn(*shape),), fused=1)
    assert opt.fusion_report.fused[0].ops == ["linear", "gelu"]


def test_addmm():
    opt = check(AddmmTanh(), (torch.randn(33, 19),), fused=1)
    assert opt.fusion_report.fused[0].ops == ["linear", "tanh"]
