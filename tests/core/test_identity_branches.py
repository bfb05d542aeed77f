"""Identity-branch BatchNorms (timm's RepVGG and MobileOne blocks) fold into a conv branch of the same input.

The replicas copy the forwards of timm.models.byobnet.RepVggBlock and timm.models.mobileone's block (timm is
not needed). Each test compares with a float64 run of the original and checks what the report says.
"""

from __future__ import annotations

import pytest
import torch
from accuracy import assert_close, reference64
from torch import nn
from toy_models import seeded

import fuser


def conv_bn(c: int, kernel: int, groups: int = 1, dilation: int = 1) -> nn.Sequential:
    padding = dilation * (kernel // 2)
    conv = nn.Conv2d(c, c, kernel, padding=padding, dilation=dilation, groups=groups, bias=False)
    return nn.Sequential(conv, nn.BatchNorm2d(c))


class RepVggBlock(nn.Module):
    """timm's RepVggBlock (not reparameterized): 1x1 and kxk branches, the identity BN added last."""

    def __init__(self, c: int = 13) -> None:
        super().__init__()
        self.identity = nn.BatchNorm2d(c)
        self.conv_kxk = conv_bn(c, 3)
        self.conv_1x1 = conv_bn(c, 1)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.identity(x)
        x = self.conv_1x1(x) + self.conv_kxk(x)
        x += identity
        return self.act(x)


class MobileOneBlock(nn.Module):
    """timm's MobileOne depthwise block: a 1x1 scale branch plus the identity first, then the kxk branches."""

    def __init__(self, c: int = 11, dilation: int = 1) -> None:
        super().__init__()
        self.identity = nn.BatchNorm2d(c)
        self.conv_scale = conv_bn(c, 1, groups=c)
        self.conv_kxk = nn.ModuleList(conv_bn(c, 3, groups=c, dilation=dilation) for _ in range(2))
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv_scale(x) + self.identity(x)
        for ck in self.conv_kxk:
            out += ck(x)
        return self.act(out)


def optimize_and_compare(model: nn.Module, x: torch.Tensor) -> fuser.FusionReport:
    opt = fuser.optimize(model, (x,), backend="torch")
    with torch.no_grad():
        assert_close(opt(x), reference64(model, x), "ieee")
    return opt.fusion_report


def folded(report: fuser.FusionReport) -> set[str]:
    return {m for e in report.fused if "batch_norm" in e.ops for m in e.modules}


@pytest.mark.parametrize(
    "model",
    [RepVggBlock(), MobileOneBlock(), MobileOneBlock(dilation=2)],
    ids=["repvgg", "mobileone", "mobileone-dilated"],
)
def test_identity_batch_norm_folds_into_a_conv_branch(model: nn.Module):
    model = seeded(model)
    report = optimize_and_compare(model, torch.randn(2, model.identity.num_features, 11, 9))
    bns = {n for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)}
    assert folded(report) >= bns, str(report)
    assert not report.rejected, str(report)
    assert report.rules_fired.get("identity_batch_norm") == 1


class OtherInput(RepVggBlock):
    """The identity BN reads x, the conv branches relu(x): no conv computes the identity's input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x)
        return self.act(self.conv_1x1(y) + self.conv_kxk(y) + self.identity(x))


def test_identity_of_another_input_stays_and_is_reported():
    model = seeded(OtherInput())
    report = optimize_and_compare(model, torch.randn(2, 13, 11, 9))
    assert "identity" not in folded(report)
    assert any("identity" in e.modules and e.reason for e in report.rejected), str(report)


def test_branches_with_zero_batch_norm_scale_do_not_take_the_identity():
    model = seeded(RepVggBlock())
    with torch.no_grad():
        model.conv_kxk[1].weight.zero_()
        model.conv_1x1[1].weight.zero_()
    report = optimize_and_compare(model, torch.randn(2, 13, 11, 9))
    assert "identity" not in folded(report)
    assert any("identity" in e.modules and e.reason for e in report.rejected), str(report)


class FoldedRepVggBlock(nn.Module):
    """A RepVGG or MobileOne block whose branch BatchNorms are already in their convs' weights and biases (what
    torch.onnx's dynamo exporter writes): only the identity BatchNorm is left."""

    def __init__(self, c: int = 13, groups: int = 1, dilation: int = 1) -> None:
        super().__init__()
        self.identity = nn.BatchNorm2d(c)
        self.conv_kxk = nn.Conv2d(c, c, 3, padding=dilation, dilation=dilation, groups=groups)
        self.conv_1x1 = nn.Conv2d(c, c, 1, groups=groups)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv_1x1(x) + self.conv_kxk(x) + self.identity(x))


@pytest.mark.parametrize(
    "model",
    [FoldedRepVggBlock(), FoldedRepVggBlock(c=12, groups=4, dilation=2)],
    ids=["repvgg", "grouped-dilated"],
)
def test_identity_batch_norm_folds_into_a_conv_whose_batch_norm_is_already_folded(model: nn.Module):
    model = seeded(model)
    report = optimize_and_compare(model, torch.randn(2, model.identity.num_features, 11, 9))
    assert report.rules_fired.get("identity_batch_norm") == 1, str(report)
    assert not report.rejected, str(report)
    assert any("identity" in e.modules for e in report.fused), str(report)


def test_an_identity_beside_a_conv_with_a_run_time_bias_stays():
    """A bias computed at run time cannot absorb the identity's shift: the BatchNorm stays, and is reported."""

    class RunTimeBias(FoldedRepVggBlock):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            conv = torch.nn.functional.conv2d(x, self.conv_kxk.weight, x.mean((0, 2, 3)), padding=1)
            return self.act(conv + self.identity(x))

    model = seeded(RunTimeBias())
    report = optimize_and_compare(model, torch.randn(2, 13, 11, 9))
    assert "identity_batch_norm" not in report.rules_fired
    assert any("identity" in e.modules and e.reason for e in report.rejected), str(report)
