"""A ResNet-50-style classifier (torchvision's layout, v1.5: the stride sits on the 3x3 conv).

Stem 7x7/2 conv-BN-ReLU and a 3x3/2 max pool; four stages of bottlenecks (1x1 conv-BN-ReLU,
3x3 conv-BN-ReLU, 1x1 conv-BN, a 1x1 conv-BN downsample on the first block of a stage, the add, then
ReLU: the residual comes before the activation); global average pool; fc. As in torchvision, a
bottleneck calls one ``nn.ReLU(inplace=True)`` module three times and adds the residual in place.
``layers`` and ``width`` give smaller variants; the defaults are ResNet-50 (25,557,032 parameters).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .common import (
    RESIDUAL_SCALE,
    build_seeded,
    fusable_chain_heads,
    randomize_batchnorm,
    scale_batchnorm,
)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4; residual add, then ReLU."""

    expansion = 4

    def __init__(self, c_in: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        c_out = planes * self.expansion
        self.conv1 = nn.Conv2d(c_in, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
            if stride != 1 or c_in != c_out
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)

    def declared_chain_heads(self) -> list[str]:
        heads = ["conv1", "conv2", "conv3"]
        if self.downsample is not None:
            heads.append("downsample.0")
        return heads


class ResNet(nn.Module):
    """Bottleneck ResNet; ``width`` is the first stage's bottleneck width (64 in ResNet-50)."""

    def __init__(self, layers: Sequence[int] = (3, 4, 6, 3), width: int = 64, num_classes: int = 1000) -> None:
        super().__init__()
        if len(layers) != 4 or min(layers) < 1:
            raise ValueError(f"layers must be four stage depths of at least 1, got {list(layers)}")
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        c_in = width
        stages = []
        for i, depth in enumerate(layers):
            planes = width * 2**i
            blocks = [Bottleneck(c_in, planes, 1 if i == 0 else 2)]
            c_in = planes * Bottleneck.expansion
            blocks += [Bottleneck(c_in, planes) for _ in range(depth - 1)]
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))

    def declared_chain_heads(self) -> list[str]:
        # The stem's conv1 -> bn1 -> relu is in this forward; the stages are Sequentials of blocks.
        stages = ("layer1", "layer2", "layer3", "layer4")
        return ["conv1"] + [h for name in stages for h in fusable_chain_heads(getattr(self, name), f"{name}.")]


def _random_resnet(layers: Sequence[int], width: int, num_classes: int, residual_scale: float) -> ResNet:
    model = randomize_batchnorm(ResNet(layers, width, num_classes))
    for block in model.modules():
        if isinstance(block, Bottleneck):
            scale_batchnorm(block.bn3, residual_scale)
    return model


def resnet(
    layers: Sequence[int] = (3, 4, 6, 3),
    width: int = 64,
    num_classes: int = 1000,
    *,
    seed: int = 0,
    residual_scale: float = RESIDUAL_SCALE,
    calibration_batch: int = 4,
    calibration_size: int = 128,
) -> ResNet:
    """A bottleneck ResNet (ResNet-50 by default), in eval mode.

    Random weights deterministic by ``seed``; randomized BN statistics calibrated on
    ``calibration_batch`` random images of ``calibration_size``^2 (``common.calibrate_batchnorm``);
    each bottleneck's bn3 scaled by ``residual_scale`` (``common.scale_batchnorm``). Input
    [B, 3, H, W] of any size; output [B, num_classes] logits.
    """
    return build_seeded(
        lambda: _random_resnet(layers, width, num_classes, residual_scale),
        seed,
        (calibration_batch, 3, calibration_size, calibration_size),
    )
