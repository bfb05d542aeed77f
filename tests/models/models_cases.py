"""The registered models at sizes small enough for CPU tests, built and run once per test session."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from fuser.models import MODELS, build, example_input

# Small, odd (non-square, non-power-of-two) inputs: YOLO needs multiples of 32, a ViT its build size.
TEST_SIZES: dict[str, Any] = {
    "yolov8n": (64, 96),
    "yolov8s": (96, 64),
    "efficientnet_b0": (67, 61),
    "resnet50": (67, 61),
    "resnet26": (61, 67),
    "vit_tiny": (67, 61),
    "bert_tiny": 37,
}
# Build options the tests need (a ViT's position embedding fixes its input size).
TEST_KWARGS: dict[str, dict[str, Any]] = {"vit_tiny": {"img_size": (67, 61)}}
# Options that make a build cheap without changing its code path (a tiny BN calibration batch), for
# tests that build a model several times.
CHEAP_KWARGS: dict[str, dict[str, Any]] = {
    "yolov8n": {"calibration_batch": 2, "calibration_size": 32},
    "yolov8s": {"calibration_batch": 2, "calibration_size": 32},
    "efficientnet_b0": {"calibration_batch": 2, "calibration_size": 32},
    "resnet50": {"calibration_batch": 2, "calibration_size": 32},
    "resnet26": {"calibration_batch": 2, "calibration_size": 32},
    "vit_tiny": {"img_size": 32},
    "bert_tiny": {},
}
BATCH = 2

assert set(TEST_SIZES) == set(MODELS) == set(CHEAP_KWARGS), "every registered model needs test settings"


@functools.cache
def built(name: str) -> nn.Module:
    """The model ``name`` built with seed 0 and the test's build options (shared: do not modify)."""
    return build(name, seed=0, **TEST_KWARGS.get(name, {}))


def input_for(name: str, batch: int = BATCH, seed: int = 1) -> torch.Tensor:
    """A random input of the test size for model ``name``."""
    return example_input(name, batch=batch, size=TEST_SIZES[name], seed=seed)


@functools.cache
def output_of(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, float32 output) of ``built(name)`` on ``input_for(name)`` (shared: do not modify)."""
    x = input_for(name)
    with torch.no_grad():
        return x, built(name)(x)
