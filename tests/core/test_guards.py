"""Chains that fail a guard stay unfused, stay correct, and are reported with the reason in plain words."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from accuracy import assert_close, optimize_and_compare, reference64
from torch import nn
from toy_models import ConvBnAct, SharedConv, seeded

import fuser


def only_rejection(opt: fuser.OptimizedModule):
    report = opt.fusion_report
    assert len(report.rejected) == 1, str(report)
    return report.rejected[0]


def test_training_mode_batchnorm_is_never_folded():
    model = seeded(ConvBnAct(nn.SiLU()))
    model.bn.train()
    x = torch.randn(4, 5, 9, 9)
    opt = fuser.optimize(model, backend="torch")  # no example inputs: a training BN would update its stats
    assert not opt.fusion_report.fused
    entry = only_rejection(opt)
    assert "training mode" in entry.reason and "bn" in entry.reason
    assert entry.pattern == "conv_bn_act" and entry.ops[:2] == ["conv2d", "batch_norm"]
    # still correct: the BN normalizes with batch statistics, as in eager
    with torch.no_grad():
        expected = model(x)
        assert_close(opt(x), expected, "ieee")


def test_functional_batch_norm_in_training_mode():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 5, 3)
            self.register_buffer("m", torch.zeros(5))
            self.register_buffer("v", torch.ones(5))

        def forward(self, x):
            return F.relu(F.batch_norm(self.conv(x), self.m, self.v, training=True))

    entry = only_rejection(fuser.optimize(seeded(M()).train(), backend="torch"))
    assert "training=True" in entry.reason


def test_batchnorm_without_running_stats():
    model = seeded(ConvBnAct(nn.ReLU()))
    model.bn = nn.BatchNorm2d(7, track_running_stats=False).eval()
    entry = only_rejection(optimize_and_compare(model, torch.randn(3, 5, 7, 9)))
    assert "running statistics" in entry.reason


def test_interior_value_with_two_users():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(5, 7, 3, padding=1, bias=False)
            self.bn = nn.BatchNorm2d(7)

        def forward(self, x):
            y = self.conv(x)
            return F.silu(self.bn(y)), y.mean()

    entry = only_rejection(optimize_and_compare(seeded(M()), torch.randn(2, 5, 9, 7)))
    assert "2 users" in entry.reason and "conv" in entry.reason


def test_longer_form_fails_shorter_form_fuses_with_a_note():
    class M(nn.Module):  # the SiLU output feeds both the residual add and a concat: store it, fuse the rest
        def __init__(self):
            super().__init__()
            self.block = ConvBnAct(nn.SiLU(), 5, 5)

        def forward(self, x):
            y = self.block(x)
            return torch.cat([y + x, y], 1)

    opt = optimize_and_compare(seeded(M()), torch.randn(2, 5, 9, 7))
    report = opt.fusion_report
    assert len(report.fused) == 1 and not report.rejected
    assert report.fused[0].ops == ["conv2d", "batch_norm", "silu"]
    assert any("2 users" in note for note in report.fused[0].notes)


def test_weight_computed_from_the_input_is_not_a_constant():
    """A dynamic conv (CondConv-style: the weight mixes experts by the input's mean) computes its weight at run
    time; a weight computed from parameters alone is folded instead (tests/core/test_constant_folding.py)."""

    class ExpertMixture(nn.Conv2d):
        def __init__(self, c_in: int, c_out: int) -> None:
            super().__init__(c_in, c_out, 3, padding=1, bias=False)
            self.experts = nn.Parameter(torch.randn(2, c_out, c_in, 3, 3))

        def forward(self, x):
            mix = torch.sigmoid(x.mean())
            w = self.weight + mix * self.experts[0] + (1 - mix) * self.experts[1]
            return F.conv2d(x, w, self.bias, self.stride, self.padding)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = ExpertMixture(5, 7)
            self.bn = nn.BatchNorm2d(7)

        def forward(self, x):
            return F.relu(self.bn(self.conv(x)))

    entry = only_rejection(optimize_and_compare(seeded(M()), torch.randn(2, 5, 9, 7)))
    assert "computed at run time" in entry.reason


def test_reflect_padding_is_reported():
    model = ConvBnAct(nn.ReLU(), padding_mode="reflect")
    entry = only_rejection(optimize_and_compare(seeded(model), torch.randn(2, 5, 9, 7)))
    assert "padding_mode='reflect'" in entry.reason


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_unsupported_activation_is_reported(bias: bool):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = ConvBnAct(nn.SELU(), 5, 5)
            self.conv = nn.Conv2d(5, 5, 1, bias=bias)

        def forward(self, x):
            return F.elu(self.conv(self.a(x)))

    opt = optimize_and_compare(seeded(M()), torch.randn(2, 5, 9, 7))
    fused, rejected = opt.fusion_report.fused, opt.fusion_report.rejected
    assert fused[0].ops == ["conv2d", "batch_norm"]
    assert "selu" in fused[0].notes[0]
    if bias:  # the lone conv fuses its bias; the elu runs after it
        assert [e.ops for e in fused][1:] == [["conv2d"]] and not rejected
        assert "followed by elu" in fused[1].notes[0]
    else:  # nothing to fuse into the conv: it stays, and the report says what follows it
        assert len(fused) == 1 and len(rejected) == 1
        assert "followed by elu" in rejected[0].reason and "no bias" in rejected[0].reason


def test_residual_that_broadcasts_the_output_is_rejected():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = ConvBnAct(nn.SiLU(), 5, 5, kernel_size=1, padding=0)

        def forward(self, x, r):
            return self.block(x) + r

    x, r = torch.randn(1, 5, 7, 7), torch.randn(3, 5, 7, 7)  # r broadcasts the batch dim 1 -> 3
    opt = optimize_and_compare(seeded(M()), x, r)
    assert len(opt.fusion_report.fused) == 1 and opt.fusion_report.fused[0].ops[-1] == "silu"
    assert any("changes its shape" in note for note in opt.fusion_report.fused[0].notes)


def test_residual_that_promotes_dtype_is_rejected():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = ConvBnAct(nn.SiLU(), 5, 5)

        def forward(self, x, r):
            return self.block(x) + r

    x, r = torch.randn(1, 5, 7, 7), torch.randn(1, 5, 7, 7, dtype=torch.float64)
    model = seeded(M())
    opt = fuser.optimize(model, (x, r), backend="torch")
    assert any("promote" in note for note in opt.fusion_report.fused[0].notes)
    with torch.no_grad():
        out = opt(x, r)
        assert out.dtype == torch.float64
        assert_close(out, model(x, r), "ieee")


def test_shared_conv_is_folded_per_path():
    model = seeded(SharedConv())
    x = torch.randn(2, 5, 9, 7)
    opt = optimize_and_compare(model, x)
    assert sorted(e.activation for e in opt.fusion_report.fused) == ["relu", "silu"]
    assert {e.pattern for e in opt.fusion_report.fused} == {"conv_bn_act", "conv_act"}


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_positions_match_eager(value):
    model = seeded(ConvBnAct(nn.ReLU6(), 5, 7, kernel_size=1, padding=0))
    x = torch.randn(2, 5, 9, 7)
    x[0, :, 3, 4] = value
    x[1, 2, 0, 0] = value
    opt = fuser.optimize(model, (torch.randn(2, 5, 9, 7),), backend="torch")
    with torch.no_grad():
        out, expected = opt(x), model(x)
    assert torch.equal(torch.isnan(out), torch.isnan(expected))
    assert torch.equal(torch.isinf(out), torch.isinf(expected))
    finite = torch.isfinite(expected)
    assert_close(out[finite], expected[finite], "ieee")


# ---------------------------------------------------------------------------------------------------------
# Tests that catch planted bugs: each failed with its bug planted (fold in float32, a guard removed).


@pytest.mark.parametrize("eps", [1e-5, 0.7], ids=["eps-1e-5", "large-eps"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_batchnorm_fold_is_the_float64_fold_cast_once(eps, dtype):
    from fuser.rewrite.batchnorm_fold import BatchNormParams, fold_batchnorm

    g = torch.Generator().manual_seed(3)
    c_out = 37
    weight = (torch.randn(c_out, 19, 3, 3, generator=g) * 0.3).to(dtype)
    bias = (torch.randn(c_out, generator=g) * 0.5).to(dtype)
    bn = BatchNormParams(
        running_mean=(torch.randn(c_out, generator=g) * 0.7).to(dtype),
        running_var=(torch.rand(c_out, generator=g) * 3 + 0.01).to(dtype),
        weight=(torch.randn(c_out, generator=g) + 0.2).to(dtype),
        bias=(torch.randn(c_out, generator=g) * 0.4).to(dtype),
        eps=eps,
    )
    w64, b64 = weight.double(), bias.double()
    scale = bn.weight.double() / torch.sqrt(bn.running_var.double() + eps)
    expected_w = (w64 * scale.reshape(-1, 1, 1, 1)).to(dtype)
    expected_b = ((b64 - bn.running_mean.double()) * scale + bn.bias.double()).to(dtype)
    folded_w, folded_b = fold_batchnorm(weight, bias, bn)
    assert folded_w.dtype == dtype and folded_b.dtype == dtype
    assert torch.equal(folded_w, expected_w), "the fold is not the float64 fold cast to the weight dtype"
    assert torch.equal(folded_b, expected_b), "the folded bias is not the float64 fold cast to the weight dtype"


def test_bf16_input_under_autocast_with_float32_weights_is_rejected():
    model = seeded(ConvBnAct(nn.SiLU()))
    x = torch.randn(2, 5, 9, 11).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        opt = fuser.optimize(model, (x,), backend="torch")
        with torch.no_grad():
            out, expected = opt(x), model(x)
    entry = only_rejection(opt)
    assert "torch.bfloat16 input" in entry.reason and "torch.float32 weights" in entry.reason
    assert out.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(out, expected)  # the unfused ops run exactly as eager does
    assert_close(out, reference64(model, x), "bf16")


def test_value_added_to_itself_fuses_without_the_add():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(5, 7, 3, padding=1, bias=False)
            self.bn = nn.BatchNorm2d(7)

        def forward(self, x):
            y = self.bn(self.conv(x))
            return y + y

    opt = optimize_and_compare(seeded(M()), torch.randn(2, 5, 9, 7))
    report = opt.fusion_report
    assert [e.ops for e in report.fused] == [["conv2d", "batch_norm"]], str(report)
    assert not report.untraced, str(report)
