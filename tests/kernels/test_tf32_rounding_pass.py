"""fuser.rewrite.tf32_rounding: which fused outputs the kernels store rounded to TF32 (only those that nothing but a
TF32 tensor-core dot reads), that the flag reaches exactly those kernels' launches, and which input
channels of which dots get their truncation compensated in the packed weights."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from kernels_reference import record_launches
from torch import nn
from toy_models import seeded

import fuser
from fuser.kernels import pack_conv_weight
from fuser.kernels.precision import TRUNCATION_GAIN
from fuser.lower.fused_modules import FusedConv2d, FusedLinear
from fuser.rewrite.tf32_rounding import compensate_truncated_inputs, mark_tf32_rounded_outputs


def cba(c_in: int, c_out: int, k: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, k, padding=k // 2, groups=groups, bias=False), nn.BatchNorm2d(c_out), nn.SiLU()
    )


class Mixed(nn.Module):
    """Every case the analysis distinguishes, each producer named after what reads its output."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = cba(3, 18, 3)  # direct kernel; read by a 3x3 tensor-core conv only: rounded
        self.to_pool_cat = cba(18, 22, 3)  # -> max pool, cat, chunk -> tensor-core convs: rounded
        self.to_upsample = cba(18, 11)  # -> nearest upsample -> cat: rounded
        self.a = cba(33, 17)
        self.b = cba(33, 17)
        self.to_residual = cba(34, 21)  # read by self.with_residual as its residual too: as computed
        self.with_residual = cba(21, 21, 3)  # (its add fused) read by two 1x1 convs: rounded
        self.to_depthwise = cba(21, 19)  # the depthwise kernel multiplies in float32: as computed
        self.other = cba(21, 19)  # the depthwise conv's residual: as computed
        self.depthwise = cba(19, 19, 3, groups=19)  # read by a 1x1 conv and a sigmoid: as computed
        self.to_mul = cba(19, 19)  # read by a mul: as computed
        self.last = cba(19, 23)  # a graph output: as computed
        self.fc1 = nn.Linear(23, 29)  # (with its GELU) -> fc2 only: rounded
        self.fc2 = nn.Linear(29, 13)  # a graph output: as computed
        self.mixed = cba(11 + 19, 17)  # reads a rounded value and an unrounded one, concatenated

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.stem(x)
        p = self.to_pool_cat(s)
        pooled = F.max_pool2d(p, 3, 1, 1)
        up = F.interpolate(self.to_upsample(s)[:, :, ::2, ::2], size=(13, 11), mode="nearest")
        cat = torch.cat([pooled, up], 1)
        left, right = cat.chunk(2, 1)
        ab = torch.cat([self.a(torch.cat([left, right], 1)), self.b(cat)], 1)
        r = self.to_residual(ab)
        y = self.with_residual(r) + r
        d = self.depthwise(self.to_depthwise(y)) + self.other(y)
        z = self.last(self.to_mul(d) * torch.sigmoid(d))
        mixed = self.mixed(F.max_pool2d(torch.cat([up, d], 1), 3, 1, 1))
        return z, torch.tanh(self.fc2(F.gelu(self.fc1(z.mean((2, 3)))))), mixed


ROUNDED = {"stem", "to_pool_cat", "to_upsample", "a", "b", "with_residual", "fc1"}


def _fused(optimized: nn.Module) -> dict[str, FusedConv2d | FusedLinear]:
    """Fused module by the first module of the chain it replaced."""
    found = {}
    for m in optimized.modules():
        if isinstance(m, (FusedConv2d, FusedLinear)):
            found[m.source.split(".")[0].split(" ")[0].strip("{")] = m
    return found


def _marks(optimized: nn.Module) -> dict[str, bool]:
    return {name: m.epilogue.round_tf32 for name, m in _fused(optimized).items()}


def _optimized(precision: str = "tf32", backend: str = "torch") -> tuple[nn.Module, torch.Tensor]:
    model = seeded(Mixed()).eval()
    x = torch.randn(2, 3, 13, 11)
    return fuser.optimize(model, (x,), precision=precision, backend=backend, cuda_graphs=False), x


def test_marks_exactly_the_outputs_only_tf32_dots_read() -> None:
    optimized, _ = _optimized()
    marks = _marks(optimized)
    assert len(marks) == 15, marks
    assert {name for name, rounded in marks.items() if rounded} == ROUNDED
    assert "tf32 store" in repr(optimized)


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "bf16"])
def test_no_marks_outside_tf32(precision: str) -> None:
    optimized, _ = _optimized(precision)
    assert not any(_marks(optimized).values())


def test_flag_reaches_the_launches_of_the_marked_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    optimized, x = _optimized(backend="interpret")
    seen = record_launches(monkeypatch)
    with torch.no_grad():
        out = optimized(x)
    flags = [kwargs["ROUND_TF32"] for _, kwargs in seen if "ROUND_TF32" in kwargs]  # not the max pool's
    expected = [m.epilogue.round_tf32 for m in optimized.modules() if isinstance(m, (FusedConv2d, FusedLinear))]
    assert len(flags) == len(expected) == 15  # one launch per fused module
    assert sorted(flags) == sorted(expected) and sum(flags) == len(ROUNDED)
    # and the rounded stores change the result by TF32 rounding only
    with torch.no_grad():
        plain = fuser.optimize(seeded(Mixed()).eval(), (x,), precision="ieee", backend="interpret")(x)
    for o, p in zip(out, plain, strict=True):
        assert (o - p).norm() / p.norm() < 2e-3


def test_truncated_input_channels_get_the_gain() -> None:
    optimized, _ = _optimized()
    gains = {name: m.tf32_input_gain for name, m in _fused(optimized).items()}
    g = TRUNCATION_GAIN
    # every input channel stored rounded, or not read on the tensor cores (the direct stem, depthwise)
    for name in (
        "stem",
        "to_pool_cat",
        "to_upsample",
        "a",
        "b",
        "to_residual",
        "to_depthwise",
        "other",
        "depthwise",
        "fc2",
    ):
        assert gains[name] is None, name
    # inputs made by an add, a mul, a mean, or an unrounded producer: every channel
    for name, channels in (("with_residual", 21), ("to_mul", 19), ("last", 19), ("fc1", 23)):
        assert torch.equal(gains[name], torch.full((channels,), g)), name
    # a concatenation (through a max pool) of 11 rounded channels and 19 unrounded ones
    assert torch.equal(gains["mixed"], torch.tensor([1.0] * 11 + [g] * 19))
    # and the packed weight is the rounded, compensated one
    mixed = _fused(optimized)["mixed"]
    expected = pack_conv_weight(mixed.weight * gains["mixed"][None, :, None, None], "tf32").data
    assert torch.equal(fuser.kernels.pack_conv_weight(mixed.weight, "tf32", input_gain=gains["mixed"]).data, expected)


def test_gain_is_derived_data() -> None:
    """Not in the state dict; kept through torch.save; no gain outside tf32."""
    optimized, _ = _optimized()
    fc1 = _fused(optimized)["fc1"]
    assert not any("tf32_input_gain" in k for k in optimized.state_dict())
    buffer = io.BytesIO()
    torch.save(optimized, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(_fused(loaded)["fc1"].tf32_input_gain, fc1.tf32_input_gain)
    ieee, _ = _optimized("ieee")
    assert all(m.tf32_input_gain is None for m in _fused(ieee).values())


def test_original_model_untouched_and_reference_ignores_the_flag() -> None:
    model = seeded(Mixed()).eval()
    x = torch.randn(2, 3, 13, 11)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimized = fuser.optimize(model, (x,), backend="torch", cuda_graphs=False)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        for o, r in zip(optimized(x), model(x), strict=True):
            assert (o - r).norm() / r.norm() < 1e-5  # the torch reference stores exact values


def test_passes_report_no_change_when_run_again() -> None:
    optimized, _ = _optimized()
    gm = optimized.module
    assert mark_tf32_rounded_outputs(gm) == [] and compensate_truncated_inputs(gm) == []
    gm.graph.lint()
    fc1 = _fused(optimized)["fc1"]
    fc1.set_epilogue(replace(fc1.epilogue, round_tf32=False))
    fc1.set_tf32_input_gain(None)
    assert mark_tf32_rounded_outputs(gm) == [fc1_name(gm, fc1)]
    assert compensate_truncated_inputs(gm) == [fc1_name(gm, fc1)]
    assert fc1.epilogue.round_tf32 and fc1.tf32_input_gain is not None


def fc1_name(gm: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in gm.named_modules() if m is module)
