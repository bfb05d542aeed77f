"""Every written form of every chain fuses, and the fused module computes what the original did."""

from __future__ import annotations

import math
from collections.abc import Callable

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
from fuser.activations import ACTIVATIONS, Activation
from fuser.canonicalize import canonicalize


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


def hard_sigmoid_timm(x: torch.Tensor) -> torch.Tensor:
    """timm's and ghostnet's hard_sigmoid(x, inplace=True)."""
    return x.add_(3.0).clamp_(0.0, 6.0).div_(6.0)


def hard_swish_timm(x: torch.Tensor) -> torch.Tensor:
    """timm's hard_swish(x): the gate divided in place, then multiplied."""
    return x.mul(F.relu6(x + 3.0).div_(6.0))


# (written form, the activation the report must name). Every row of fuser.activations' table needs at least one
# entry here, and every one-call form and written-out pattern of the table must be exercised by one
# (test_every_form_of_the_table_is_exercised).
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
    (lambda x: F.relu_(x), "relu"),
    (nn.ReLU6(), "relu6"),
    (F.relu6, "relu6"),
    (lambda x: F.hardtanh(x, 0.0, 6.0), "relu6"),
    (lambda x: F.hardtanh_(x, 0.0, 6.0), "relu6"),
    (nn.Hardtanh(0.0, 6.0), "relu6"),
    (lambda x: x.clamp(0, 6), "relu6"),
    (lambda x: x.clip(0, 6), "relu6"),
    (lambda x: x.clamp_(0, 6), "relu6"),
    (lambda x: x.clip_(min=0, max=6.0), "relu6"),
    (lambda x: torch.clamp(x, min=0.0, max=6.0), "relu6"),
    (lambda x: torch.clip(x, 0.0, 6.0), "relu6"),
    (lambda x: torch.clamp_(x, 0.0, 6.0), "relu6"),
    (lambda x: torch.clip_(x, 0, 6), "relu6"),
    (nn.LeakyReLU(0.13), "leaky_relu"),
    (lambda x: F.leaky_relu(x, 0.2, inplace=True), "leaky_relu"),
    (lambda x: F.leaky_relu_(x, 0.07), "leaky_relu"),
    (nn.Hardswish(), "hardswish"),
    (F.hardswish, "hardswish"),
    (lambda x: x * F.hardsigmoid(x), "hardswish"),
    (lambda x: x * F.relu6(x + 3) / 6, "hardswish"),
    (lambda x: x * (F.relu6(x + 3) / 6), "hardswish"),
    (hard_swish_timm, "hardswish"),
    (nn.GELU(), "gelu"),
    (F.gelu, "gelu"),
    (nn.GELU(approximate="tanh"), "gelu_tanh"),
    (lambda x: F.gelu(x, approximate="tanh"), "gelu_tanh"),
    (erf_gelu, "gelu"),
    (half_x_erf_gelu, "gelu"),
    (tanh_gelu, "gelu_tanh"),
    (tanh_gelu_cubed_by_products, "gelu_tanh"),
    (nn.Sigmoid(), "sigmoid"),
    (torch.sigmoid, "sigmoid"),
    (F.sigmoid, "sigmoid"),
    (lambda x: torch.sigmoid_(x), "sigmoid"),
    (lambda x: x.sigmoid_(), "sigmoid"),
    (nn.Tanh(), "tanh"),
    (torch.tanh, "tanh"),
    (F.tanh, "tanh"),
    (lambda x: x.tanh(), "tanh"),
    (lambda x: x.tanh_(), "tanh"),
    (lambda x: torch.tanh_(x), "tanh"),
    (nn.Hardsigmoid(), "hardsigmoid"),
    (nn.Hardsigmoid(inplace=True), "hardsigmoid"),
    (F.hardsigmoid, "hardsigmoid"),
    (lambda x: F.hardsigmoid(x, inplace=True), "hardsigmoid"),
    (lambda x: F.relu6(x + 3) / 6, "hardsigmoid"),
    (lambda x: F.relu6(3.0 + x) * (1 / 6), "hardsigmoid"),
    (lambda x: (x + 3).clamp(0, 6) / 6, "hardsigmoid"),
    (lambda x: x.add(3).clamp_(0, 6).div(6), "hardsigmoid"),
    (lambda x: x.add(3.0).clamp_(0.0, 6.0).mul(1.0 / 6.0), "hardsigmoid"),
    (lambda x: F.hardtanh(x + 3.0, 0.0, 6.0) / 6.0, "hardsigmoid"),
    (hard_sigmoid_timm, "hardsigmoid"),
    (nn.Mish(), "mish"),
    (nn.Mish(inplace=True), "mish"),
    (F.mish, "mish"),
    (lambda x: F.mish(x, inplace=True), "mish"),
    (lambda x: x * torch.tanh(F.softplus(x)), "mish"),
    (lambda x: x * F.softplus(x).tanh(), "mish"),
    (lambda x: x.mul(F.softplus(x).tanh()), "mish"),
    (lambda x: torch.tanh(F.softplus(x, beta=1.0, threshold=20.0)) * x, "mish"),
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


@pytest.mark.parametrize("conv_bias", [False, True], ids=["conv-no-bias", "conv-bias"])
@pytest.mark.parametrize("affine", [False, True], ids=["bn-not-affine", "bn-affine"])
def test_layer_modules_with_and_without_optional_parameters(conv_bias, affine):
    """The module rules read only the parameters a layer has: a conv without bias, a BN without weight and
    bias (affine=False) still fuse, and fold exactly what the layer computes."""
    model = ConvBnAct(nn.ReLU(), c_in=5, c_out=11, bias=conv_bias)
    model.bn = nn.BatchNorm2d(11, affine=affine)
    opt = check(model, (torch.randn(2, 5, 9, 13),), fused=1)
    assert opt.fusion_report.fused[0].ops == ["conv2d", "batch_norm", "relu"]


def test_addmm():
    opt = check(AddmmTanh(), (torch.randn(33, 19),), fused=1)
    assert opt.fusion_report.fused[0].ops == ["linear", "tanh"]


@pytest.mark.parametrize(
    ("act", "ops"),
    [
        (nn.Hardsigmoid(), ["linear", "hardsigmoid"]),
        (lambda y: F.relu6(y + 3) / 6, ["linear", "hardsigmoid"]),
        (nn.Mish(), ["linear", "mish"]),
        (lambda y: y * torch.tanh(F.softplus(y)), ["linear", "mish"]),
    ],
    ids=["hardsigmoid", "hardsigmoid-written", "mish", "mish-written"],
)
def test_linear_new_activations(act, ops):
    opt = check(LinearAct(act=act), (torch.randn(3, 5, 19),), fused=1)
    assert opt.fusion_report.fused[0].ops == ops


class SqueezeExcitation(nn.Module):
    """torchvision.ops.SqueezeExcitation as MobileNetV3 builds it (scale_activation=nn.Hardsigmoid), with the
    gate given as any written form (timm and ghostnet write it out)."""

    def __init__(self, c: int, squeeze: int, gate: Callable[[torch.Tensor], torch.Tensor] | nn.Module) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(c, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, c, 1)
        self.activation = nn.ReLU()
        self.scale_activation = gate

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.avgpool(x)
        scale = self.fc1(scale)
        scale = self.activation(scale)
        scale = self.fc2(scale)
        return self.scale_activation(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._scale(x) * x


@pytest.mark.parametrize(
    "gate", [nn.Hardsigmoid(), lambda s: F.relu6(s + 3.0) / 6.0, hard_sigmoid_timm], ids=["module", "timm", "inplace"]
)
def test_squeeze_excitation_convs_fuse_with_hardsigmoid(gate):
    opt = check(SqueezeExcitation(21, 5, gate), (torch.randn(2, 21, 9, 7),), fused=2)
    assert [(e.pattern, e.activation) for e in opt.fusion_report.fused] == [
        ("conv_act", "relu"),
        ("conv_act", "hardsigmoid"),
    ]


def _traced_forms(act) -> tuple[set, set, set]:
    """(function targets, method names, module types) in the traced graph of ConvBnAct(act), before rewriting."""
    gm = torch.fx.symbolic_trace(ConvBnAct(act))
    modules = dict(gm.named_modules())
    nodes = list(gm.graph.nodes)
    functions = {n.target for n in nodes if n.op == "call_function"}
    methods = {n.target for n in nodes if n.op == "call_method"}
    return functions, methods, {type(modules[n.target]) for n in nodes if n.op == "call_module"}


def test_every_form_of_the_table_is_exercised():
    """A new row of fuser.activations (or a new form of a row) without a written form above fails here."""
    functions, methods, module_types, fired = set(), set(), set(), set()
    for act, _ in ACTIVATION_FORMS:
        f, m, t = _traced_forms(act)
        functions |= f
        methods |= m
        module_types |= t
        gm = torch.fx.symbolic_trace(ConvBnAct(act))
        fired |= set(canonicalize(gm))
    names = {name for _, name in ACTIVATION_FORMS}
    for row in ACTIVATIONS:
        if row.act == Activation.NONE:
            continue
        assert row.name in names, f"no written form of {row.name} in ACTIVATION_FORMS"
        assert set(row.functions) <= functions, (row.name, set(row.functions) - functions)
        assert set(row.methods) <= methods, (row.name, set(row.methods) - methods)
        assert set(row.modules) <= module_types, (row.name, set(row.modules) - module_types)
        assert {w.name for w in row.written_out} <= fired, (row.name, {w.name for w in row.written_out} - fired)


def test_fired_rules_are_in_the_report():
    x = torch.randn(2, 5, 9, 7)
    opt = check(ConvBnAct(lambda y: y * F.softplus(y).tanh()), (x,), fused=1)
    fired = opt.fusion_report.rules_fired
    assert fired["mish_written_out"] == 1 and fired["conv_module"] == 1 and fired["batchnorm_module"] == 1
    assert "mish_written_out x1" in str(opt.fusion_report)
    assert opt.fusion_report.to_dict()["rules_fired"] == fired


# Near misses: each looks like an activation but computes something else. The activation must stay unfused
# (conv -> BN still folds) and the optimized model must still compute the written function.
NEAR_MISSES = [
    (lambda y: y.clamp(0, 5), "clamp(0, 5)"),
    (lambda y: torch.clamp(y, 0.0, 6.5), "clamp(0, 6.5)"),
    (lambda y: F.hardtanh(y, 0.0, 1.0), "hardtanh(0, 1)"),
    (lambda y: y.clamp(-1.0, 6.0), "clamp(-1, 6)"),
    (lambda y: y * (1.0 + torch.erf(y / 1.5)) * 0.5, "erf(x / 1.5)"),
    (lambda y: y * (1.0 + torch.erf(y / (math.sqrt(2.0) * 1.001))) * 0.5, "erf(x / 1.001 sqrt(2))"),
    (lambda y: y * (1.0 + torch.erf(y / math.sqrt(2.0))) * 0.4, "0.4 instead of 0.5"),
    (lambda y: 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.04 * torch.pow(y, 3.0)))), "0.04"),
    (lambda y: 0.4 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * y**3))), "tanh 0.4"),
    (lambda y: F.relu6(y + 2) / 6, "relu6(x + 2) / 6"),
    (lambda y: F.relu6(y + 3) / 5, "relu6(x + 3) / 5"),
    (lambda y: (y + 3).clamp(0, 6) * 0.2, "(x + 3).clamp(0, 6) * 0.2"),
    (lambda y: y * F.relu6(y + 3) / 7, "x * relu6(x + 3) / 7"),
    (lambda y: y * torch.tanh(F.softplus(y, beta=2.0)), "softplus beta 2"),
    (lambda y: y * torch.sigmoid(F.softplus(y)), "x * sigmoid(softplus(x))"),
]


@pytest.mark.parametrize(("act", "what"), NEAR_MISSES, ids=[w for _, w in NEAR_MISSES])
def test_near_miss_forms_stay_unfused_and_correct(act, what):
    x = torch.randn(3, 5, 13, 11) * 3
    opt = check(ConvBnAct(act), (x,), fused=1)
    entry = opt.fusion_report.fused[0]
    assert entry.ops == ["conv2d", "batch_norm"] and entry.activation is None, (what, entry.ops)


def test_a_pattern_whose_declaration_disagrees_with_its_steps_is_refused() -> None:
    from fuser.epilogue import Residual
    from fuser.match.patterns import FUSED_CONV, FUSED_LINEAR, PATTERNS, ChainPattern

    with pytest.raises(ValueError, match="declares residual AFTER_ACT"):
        ChainPattern("conv_act", ("conv2d", "add", "act"), FUSED_CONV, Residual.AFTER_ACT)
    with pytest.raises(ValueError, match="declares residual NONE"):
        ChainPattern("conv_act", ("conv2d", "act", "add"), FUSED_CONV)
    with pytest.raises(ValueError, match="a FusedLinear starts at a linear"):
        ChainPattern("gemm_epilogue", ("conv2d", "act"), FUSED_LINEAR)
    assert all(p.builds is not None for p in PATTERNS), "every listed pattern builds a fused module"
