"""An EfficientNet-B0-style classifier: B0's stage table, MBConv blocks with squeeze-excitation.

Faithful to torchvision's ``efficientnet_b0`` (same layers, channels, kernel sizes, strides and
parameter count, 5,288,548 at width 1.0). The activation is written in several forms, as real code
mixes them: ``nn.SiLU(inplace=True)`` in the stem and in SE, ``F.silu`` after the expansion conv,
``x * torch.sigmoid(x)`` (the original "swish") after the depthwise conv, ``F.silu(..., inplace=True)``
in the head, and the SE gate as ``torch.sigmoid``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .common import RESIDUAL_SCALE, build_seeded, randomize_batchnorm, scale_batchnorm


@dataclass(frozen=True)
class Stage:
    """One row of the stage table: ``layers`` MBConv blocks, the first with ``stride``."""

    expand_ratio: int
    kernel: int
    stride: int
    in_channels: int
    out_channels: int
    layers: int


# EfficientNet-B0 (Tan & Le 2019, table 1), after the 3x3/2 stem of 32 channels.
B0_STAGES: tuple[Stage, ...] = (
    Stage(1, 3, 1, 32, 16, 1),
    Stage(6, 3, 2, 16, 24, 2),
    Stage(6, 5, 2, 24, 40, 2),
    Stage(6, 3, 2, 40, 80, 3),
    Stage(6, 5, 1, 80, 112, 3),
    Stage(6, 5, 2, 112, 192, 4),
    Stage(6, 3, 1, 192, 320, 1),
)


def make_divisible(v: float, divisor: int = 8) -> int:
    """Round ``v`` to a multiple of ``divisor``, never more than 10% down (the TF/torchvision rule)."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


class ConvBN(nn.Sequential):
    """Conv2d (no bias, 'same' padding) -> BatchNorm2d; the activation, if any, is the caller's."""

    def __init__(self, c_in: int, c_out: int, kernel: int = 1, stride: int = 1, groups: int = 1) -> None:
        super().__init__(
            nn.Conv2d(c_in, c_out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(c_out),
        )


class DepthwiseConvSwish(nn.Module):
    """Depthwise k x k conv -> BN -> swish written as ``x * torch.sigmoid(x)``."""

    def __init__(self, channels: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel, stride, (kernel - 1) // 2, groups=channels, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn(self.conv(x))
        return x * torch.sigmoid(x)

    def declared_chain_heads(self) -> list[str]:
        return ["conv"]


class SqueezeExcitation(nn.Module):
    """Global average pool -> 1x1 conv (bias) -> SiLU -> 1x1 conv (bias) -> sigmoid, scaling the input."""

    def __init__(self, channels: int, squeeze: int) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.act = nn.SiLU(inplace=True)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = F.adaptive_avg_pool2d(x, 1)
        scale = torch.sigmoid(self.fc2(self.act(self.fc1(scale))))
        return x * scale

    def declared_chain_heads(self) -> list[str]:
        return ["fc1", "fc2"]


class MBConv(nn.Module):
    """Inverted residual: [1x1 expand conv-BN-SiLU], depthwise conv-BN-SiLU, SE, 1x1 project conv-BN
    (no activation), plus the input when the stride is 1 and the channels match."""

    def __init__(self, c_in: int, c_out: int, expand_ratio: int, kernel: int, stride: int) -> None:
        super().__init__()
        hidden = make_divisible(c_in * expand_ratio)
        self.expand = ConvBN(c_in, hidden) if hidden != c_in else None
        self.depthwise = DepthwiseConvSwish(hidden, kernel, stride)
        self.se = SqueezeExcitation(hidden, max(1, c_in // 4))
        self.project = ConvBN(hidden, c_out)
        self.use_residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.silu(self.expand(x)) if self.expand is not None else x
        out = self.project(self.se(self.depthwise(out)))
        return out + x if self.use_residual else out


class EfficientNet(nn.Module):
    """Stem 3x3/2 conv-BN-SiLU, the MBConv stages, head 1x1 conv-BN-SiLU, pool, dropout, Linear."""

    def __init__(
        self,
        stages: tuple[Stage, ...] = B0_STAGES,
        width_mult: float = 1.0,
        depth_mult: float = 1.0,
        num_classes: int = 1000,
        dropout: float = 0.2,
    ) -> None:
        super().__init__()
        stem_channels = make_divisible(stages[0].in_channels * width_mult)
        self.stem = nn.Sequential(
            nn.Conv2d(3, stem_channels, 3, 2, 1, bias=False),
            nn.BatchNorm2d(stem_channels),
            nn.SiLU(inplace=True),
        )
        blocks: list[nn.Module] = []
        for stage in stages:
            c_in = make_divisible(stage.in_channels * width_mult)
            c_out = make_divisible(stage.out_channels * width_mult)
            repeats = math.ceil(stage.layers * depth_mult)
            blocks.append(
                nn.Sequential(
                    *(
                        MBConv(
                            c_in if i == 0 else c_out,
                            c_out,
                            stage.expand_ratio,
                            stage.kernel,
                            stage.stride if i == 0 else 1,
                        )
                        for i in range(repeats)
                    )
                )
            )
        self.blocks = nn.Sequential(*blocks)
        last = make_divisible(stages[-1].out_channels * width_mult)
        head_channels = 4 * last
        self.head = ConvBN(last, head_channels)
        self.dropout = nn.Dropout(dropout, inplace=True)
        self.classifier = nn.Linear(head_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        x = F.silu(self.head(x), inplace=True)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.classifier(self.dropout(x))


def _random_efficientnet(width_mult: float, depth_mult: float, num_classes: int, residual_scale: float) -> EfficientNet:
    model = randomize_batchnorm(EfficientNet(B0_STAGES, width_mult, depth_mult, num_classes))
    for block in model.modules():
        if isinstance(block, MBConv) and block.use_residual:
            scale_batchnorm(block.project[1], residual_scale)
    return model


def efficientnet_b0(
    width_mult: float = 1.0,
    depth_mult: float = 1.0,
    num_classes: int = 1000,
    *,
    seed: int = 0,
    residual_scale: float = RESIDUAL_SCALE,
    calibration_batch: int = 2,
    calibration_size: int = 224,
) -> EfficientNet:
    """EfficientNet-B0 (or a width/depth-scaled variant), in eval mode.

    Random weights deterministic by ``seed``; randomized BN statistics calibrated on
    ``calibration_batch`` random images of ``calibration_size``^2 (``common.calibrate_batchnorm``);
    the projection BN of each residual MBConv scaled by ``residual_scale``
    (``common.scale_batchnorm``). Input [B, 3, H, W] of any size; output [B, num_classes] logits.
    """
    return build_seeded(
        lambda: _random_efficientnet(width_mult, depth_mult, num_classes, residual_scale),
        seed,
        (calibration_batch, 3, calibration_size, calibration_size),
    )
