"""fuser.tf32_emulation: the CPU model of the GPU's TF32 dots, checked op by op, and what it shows at the
model level: truncated activations cost about twice the error of rounded ones, and the rounded epilogue
stores (fuser.tf32_rounding) win most of that back."""

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
from fuser.fused_modules import FusedConv2d, FusedLinear
from fuser.kernels.precision import round_to_tf32
from fuser.tf32_emulation import emulate_tf32, truncate_to_tf32
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
    with pytest.raises(ValueError, match="fused_activations"), emulate_tf32(optimized, "down"):
        pass


def _without_rounded_stores(optimized: nn.Module) -> nn.Module:
    plain = copy.deepcopy(optimized)
    for m in plain.modules():
        if isinstance(m, (FusedConv2d, FusedLinear)) and m.epilogue.round_tf32:
            m.set_epilogue(replace(m.epilogue, round_tf32=False))
    return plain


@pytest.mark.slow
def test_rounding_halves_the_model_level_error_of_truncation() -> None:
    """ResNet-26 (fuser.models, BN statistics randomized) as the GPU runs it at tf32, against float64."""
    model = models.build("resnet26").eval()
    x = models.example_input("resnet26", batch=1, size=67)
    optimized = fuser.optimize(model, (x,), backend="torch", cuda_graphs=False)
    assert any(m.epilogue.round_tf32 for m in optimized.modules() if isinstance(m, (FusedConv2d, FusedLinear)))
    plain = _without_rounded_stores(optimized)
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(x.double())
        with emulate_tf32(model):
            cudnn = output_error(model(x), ref)[0]
        with emulate_tf32(plain):
            truncated = output_error(plain(x), ref)[0]
        with emulate_tf32(plain, "nearest"):
            nearest = output_error(plain(x), ref)[0]
        with emulate_tf32(optimized):
            stores = output_error(optimized(x), ref)[0]
    print(f"cuDNN {cudnn:.2e}, truncated {truncated:.2e}, nearest {nearest:.2e}, rounded stores {stores:.2e}")
    assert 0 < nearest <= truncated / 2, (nearest, truncated)
    assert stores <= 0.75 * truncated and stores <= 2 * cudnn, (stores, truncated, cudnn)
