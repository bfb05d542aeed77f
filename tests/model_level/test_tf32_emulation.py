"""fuser.lower.tf32_emulation: the CPU model of the GPU's TF32 dots, checked op by op, and what it shows at the
model level: truncated activations cost at least twice the error of rounded ones; the rounded epilogue
stores and the weights' truncation compensation (fuser.rewrite.tf32_rounding) bring fuser to cuDNN's error."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fuser
from fuser import models
from fuser.kernels.precision import TRUNCATION_GAIN, round_to_tf32
from fuser.lower.fused_modules import FusedConv2d, FusedLinear
from fuser.lower.tf32_emulation import emulate_tf32, truncate_to_tf32
from fuser.verification import output_error


def test_truncation_clears_the_low_bits_toward_zero() -> None:
    x = torch.randn(10_001) * 5.3
    t = truncate_to_tf32(x)
    assert not (t.view(torch.int32) & 0x1FFF).any()
    assert (t.abs() <= x.abs()).all() and (torch.sign(t) == torch.sign(x)).all()
    rel = (x.abs() - t.abs()) / x.abs()
    assert rel.max().item() < 2.0**-10 and 2.0**-13 < rel.mean().item() < 2.0**-11  # a bias, not noise
    specials = truncate_to_tf32(torch.tensor([math.inf, -math.inf, math.nan]))
    assert specials[0] == math.inf and specials[1] == -math.inf and math.isnan(specials[2].item())


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(19, 23, 3, padding=1, bias=False), nn.BatchNorm2d(23), nn.ReLU())
        self.dw = nn.Conv2d(23, 23, 3, padding=1, groups=23)
        self.fc = nn.Linear(23, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.dw(self.conv(x)).mean((2, 3)))


def test_library_ops_round_both_operands_and_depthwise_stays_exact() -> None:
    model = Block().eval()
    x = torch.randn(2, 19, 9, 7)
    with torch.no_grad(), emulate_tf32(model):
        out = model(x)
    c, bn = model.conv[0], model.conv[1]
    with torch.no_grad():
        y = F.relu(bn(F.conv2d(round_to_tf32(x), round_to_tf32(c.weight), None, 1, 1)))
        y = model.dw(y)  # exact: cuDNN's depthwise kernels multiply in float32
        expected = F.linear(round_to_tf32(y.mean((2, 3))), round_to_tf32(model.fc.weight), model.fc.bias)
    assert torch.equal(out, expected)


def test_fused_conv_truncates_its_input_and_rounds_a_marked_store() -> None:
    model = nn.Sequential(nn.Conv2d(19, 23, 3, padding=1), nn.BatchNorm2d(23), nn.SiLU()).eval()
    x = torch.randn(2, 19, 9, 7)
    optimized = fuser.optimize(model, (x,), backend="torch", cuda_graphs=False)
    fused = next(m for m in optimized.modules() if isinstance(m, FusedConv2d))
    assert torch.equal(fused.tf32_input_gain, torch.full((19,), TRUNCATION_GAIN))  # it reads the network input
    fused.set_tf32_input_gain(None)
    with torch.no_grad():
        expected = F.silu(F.conv2d(truncate_to_tf32(x), round_to_tf32(fused.weight), fused.bias, 1, 1))
        nearest = F.silu(F.conv2d(round_to_tf32(x), round_to_tf32(fused.weight), fused.bias, 1, 1))
        with emulate_tf32(optimized):
            assert torch.equal(optimized(x), expected)
        with emulate_tf32(optimized, "nearest"):
            assert torch.equal(optimized(x), nearest)
        fused.set_epilogue(replace(fused.epilogue, round_tf32=True))
        with emulate_tf32(optimized):
            assert torch.equal(optimized(x), round_to_tf32(expected))
        assert torch.equal(optimized(x), F.silu(F.conv2d(x, fused.weight, fused.bias, 1, 1)))  # hooks gone
    gain = torch.linspace(1.0, 1.01, 19)
    fused.set_tf32_input_gain(gain)
    with torch.no_grad(), emulate_tf32(optimized):
        w = round_to_tf32(fused.weight * gain[None, :, None, None])
        assert torch.equal(optimized(x), round_to_tf32(F.silu(F.conv2d(truncate_to_tf32(x), w, fused.bias, 1, 1))))
    with pytest.raises(ValueError, match="fused_activations"), emulate_tf32(optimized, "down"):
        pass


def _variant(optimized: nn.Module, stores: bool, gains: bool) -> nn.Module:
    """A copy of ``optimized`` keeping its TF32-rounded stores and / or its truncation gains."""
    variant = copy.deepcopy(optimized)
    for m in variant.modules():
        if isinstance(m, (FusedConv2d, FusedLinear)):
            if not stores:
                m.set_epilogue(replace(m.epilogue, round_tf32=False))
            if not gains:
                m.set_tf32_input_gain(None)
    return variant


@pytest.mark.slow
@pytest.mark.parametrize(("name", "size"), [("resnet26", 67), ("efficientnet_b0", 97)])
def test_rounding_halves_the_model_level_error_of_truncation(name: str, size: int) -> None:
    """A ResNet and an EfficientNet (fuser.models, BN statistics randomized) as the GPU runs them at tf32,
    against float64: the kernels as they were (activations truncated), with every operand rounded to
    nearest, with the rounded epilogue stores, and with those and the weights' truncation compensation
    (what optimize() builds), against the original as cuDNN runs it."""
    model = models.build(name).eval()
    x = models.example_input(name, batch=1, size=size)
    optimized = fuser.optimize(model, (x,), backend="torch", cuda_graphs=False)
    fused = [m for m in optimized.modules() if isinstance(m, (FusedConv2d, FusedLinear))]
    assert any(m.epilogue.round_tf32 for m in fused) and any(m.tf32_input_gain is not None for m in fused)
    before = _variant(optimized, stores=False, gains=False)
    stores_only = _variant(optimized, stores=True, gains=False)
    errors = {}
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(x.double())
        with emulate_tf32(model):
            errors["cudnn"] = output_error(model(x), ref)[0]
        for label, module, activations in [
            ("truncated", before, "truncate"),
            ("nearest", before, "nearest"),
            ("stores", stores_only, "truncate"),
            ("compensated", optimized, "truncate"),
        ]:
            with emulate_tf32(module, activations):
                errors[label] = output_error(module(x), ref)[0]
    print(name, {k: f"{v:.2e}" for k, v in errors.items()})
    assert 0 < errors["nearest"] <= errors["truncated"] / 2, errors
    assert errors["stores"] <= 0.75 * errors["truncated"], errors
    assert errors["compensated"] <= 1.5 * errors["cudnn"], errors
