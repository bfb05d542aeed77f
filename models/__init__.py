"""Reference models for accuracy tests, the demo and benchmarks: random weights, realistic statistics.

    from fuser.models import build, example_input, MODELS
    model = build("yolov8n", seed=0)              # nn.Module in eval mode, deterministic by seed
    x = example_input("yolov8n", batch=2, size=64)
    model.expected_fusions                         # chains a fusion library should fuse in it

Every model is built inside ``torch.random.fork_rng`` (the caller's RNG is untouched), has its
BatchNorm statistics randomized and calibrated to the data (``common.calibrate_batchnorm``), and
carries ``expected_fusions`` and ``expected_chain_heads`` (the qualified names of the Conv2d / Linear
modules that start each fusable chain), counted from the architecture by the rule documented in
``common.fusable_chain_heads``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# The submodules, not their builder functions, are this package's names: fuser.models.resnet is
# the module resnet.py (a builder imported here as `resnet` would shadow it).
from . import efficientnet, resnet, vit, yolo


@dataclass(frozen=True)
class ModelSpec:
    """How to build one registered model and what its example input looks like.

    ``input_kind`` is "image" ([B, 3, H, W], ``size`` an int or (H, W)) or "embeddings" ([B, S, dim],
    ``size`` the sequence length S).
    """

    builder: Callable[..., nn.Module]
    kwargs: dict[str, Any] = field(default_factory=dict)
    input_kind: str = "image"
    default_size: int | tuple[int, int] = 224
    embedding_dim: int = 0
    description: str = ""


MODELS: dict[str, ModelSpec] = {
    "yolov8n": ModelSpec(yolo.yolov8, {"scale": "n"}, "image", 640, description="YOLOv8n detector, 80 classes"),
    "yolov8s": ModelSpec(yolo.yolov8, {"scale": "s"}, "image", 640, description="YOLOv8s detector, 80 classes"),
    "efficientnet_b0": ModelSpec(
        efficientnet.efficientnet_b0, {}, "image", 224, description="EfficientNet-B0 classifier"
    ),
    "resnet50": ModelSpec(resnet.resnet, {"layers": (3, 4, 6, 3)}, "image", 224, description="ResNet-50 classifier"),
    "resnet26": ModelSpec(
        resnet.resnet, {"layers": (2, 2, 2, 2)}, "image", 224, description="ResNet-26 (2 bottlenecks per stage)"
    ),
    "vit_tiny": ModelSpec(vit.vit, {}, "image", 224, description="ViT-Tiny/16 classifier (input size fixed at build)"),
    "bert_tiny": ModelSpec(
        vit.bert, {}, "embeddings", 128, embedding_dim=128, description="BERT-tiny encoder over token embeddings"
    ),
}


def _spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return MODELS[name]


def build(name: str, *, seed: int = 0, **kwargs: Any) -> nn.Module:
    """Build the registered model ``name`` with random weights deterministic by ``seed``, in eval mode.

    ``kwargs`` override the registry's defaults and go to the builder (e.g. ``num_classes``,
    ``width_mult``, ``layers``, ``img_size`` for ViT, ``dim`` for BERT). Unknown name -> KeyError
    listing the known ones.
    """
    spec = _spec(name)
    return spec.builder(**{**spec.kwargs, **kwargs}, seed=seed)


def example_input(name: str, batch: int = 1, size: int | tuple[int, int] | None = None, seed: int = 0) -> torch.Tensor:
    """A random (standard normal, never zero) float32 input for model ``name``, deterministic by ``seed``.

    Images: [batch, 3, H, W] with ``size`` an int or (H, W) (default: the model's usual size; YOLO needs
    multiples of 32, a ViT exactly the img_size it was built with). Embeddings: [batch, S, dim] with
    ``size`` the sequence length S (``dim`` is the registry default; pass your own tensor for another).
    """
    spec = _spec(name)
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    size = spec.default_size if size is None else size
    generator = torch.Generator().manual_seed(seed)
    if spec.input_kind == "embeddings":
        if not isinstance(size, int):
            raise TypeError(f"{name} takes a sequence length as size, got {size!r}")
        return torch.randn(batch, size, spec.embedding_dim, generator=generator)
    h, w = (size, size) if isinstance(size, int) else size
    return torch.randn(batch, 3, h, w, generator=generator)


__all__ = ["MODELS", "ModelSpec", "build", "example_input"]
