"""The models the benchmarks run, built as their own libraries build them, with random weights.

    model, x = build("yolov8n", batch=1, size=640)      # eval mode, BN statistics randomized

Third-party models come from their libraries' own code and configs (no weights can be downloaded on the
benchmark machines): ultralytics' ``DetectionModel("yolov8n.yaml")``, torchvision's builders with
``weights=None``, timm's ``create_model(pretrained=False)``. fuser's own reference models
(``fuser.models``) are listed too, as ``fuser.<name>``. Every model gets random BatchNorm statistics,
calibrated to the input's scale (``fuser.models.common``), since a fresh BatchNorm folds to an identity
and hides folding errors; building is deterministic by seed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fuser import models as fuser_models
from fuser.models.common import calibrate_batchnorm, randomize_batchnorm


@dataclass(frozen=True)
class Spec:
    """A benchmark model: its library (``source``), how to build it and its usual square input size.

    ``randomized``: the builder already gives realistic BN statistics (fuser's models also shrink each
    residual branch's last BN, which randomizing again would undo).
    """

    source: str
    build: Callable[[], nn.Module]
    size: int
    randomized: bool = False


_torchvision_stub: torch.library.Library | None = None


def import_torchvision() -> Any:
    """``import torchvision``, also where its C++ ops cannot load (PyPI's CUDA build next to a CPU torch).

    There torchvision's import fails registering fake kernels for ``torchvision::nms``/``qnms``, whose
    schemas its C++ library would have defined. The schemas are defined here instead, with a CPU kernel
    that says NMS is unavailable (no model forward benchmarked here calls it), and the import retried.
    """
    global _torchvision_stub
    try:
        import torchvision
    except RuntimeError as error:
        if "torchvision::nms" not in str(error) or _torchvision_stub is not None:
            raise
        _torchvision_stub = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            _torchvision_stub.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

            def unavailable(dets, scores, iou_threshold, op=op):
                raise NotImplementedError(f"torchvision::{op}: torchvision's C++ ops did not load with this torch")

            _torchvision_stub.impl(op, unavailable, "CPU")
        import torchvision
    return torchvision


def _ultralytics(yaml: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        os.environ.setdefault("YOLO_OFFLINE", "1")  # no update checks or downloads
        os.environ.setdefault("YOLO_CONFIG_DIR", "/tmp/ultralytics-config")
        import_torchvision()
        from ultralytics.nn.tasks import DetectionModel

        return DetectionModel(yaml, verbose=False)

    return build


def _torchvision(name: str) -> Callable[[], nn.Module]:
    return lambda: getattr(import_torchvision().models, name)(weights=None)


def _timm(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import_torchvision()
        import timm

        return timm.create_model(name, pretrained=False)

    return build


def _fuser(name: str) -> Callable[[], nn.Module]:
    return lambda: fuser_models.build(name)


MODELS: dict[str, Spec] = {
    "yolov8n": Spec("ultralytics", _ultralytics("yolov8n.yaml"), 640),
    "resnet50": Spec("torchvision", _torchvision("resnet50"), 224),
    "efficientnet_b0": Spec("torchvision", _torchvision("efficientnet_b0"), 224),
    "mobilenet_v3_large": Spec("torchvision", _torchvision("mobilenet_v3_large"), 224),
    "timm.resnet50": Spec("timm", _timm("resnet50"), 224),
    "timm.efficientnet_b0": Spec("timm", _timm("efficientnet_b0"), 224),
    "fuser.yolov8n": Spec("fuser.models", _fuser("yolov8n"), 640, randomized=True),
    "fuser.resnet50": Spec("fuser.models", _fuser("resnet50"), 224, randomized=True),
    "fuser.efficientnet_b0": Spec("fuser.models", _fuser("efficientnet_b0"), 224, randomized=True),
    "fuser.resnet26": Spec("fuser.models", _fuser("resnet26"), 224, randomized=True),
}


@torch.no_grad()
def randomize_bn(model: nn.Module, example: torch.Tensor, seed: int = 0) -> nn.Module:
    """Random BatchNorm statistics and affine parameters, put on the scale of ``example``; returns ``model``.

    ``example`` should be of the benchmark's input size: statistics calibrated at another size are off
    by up to 100x deep in the network (``calibrate_batchnorm`` says why).
    """
    generator = torch.Generator().manual_seed(seed)
    randomize_batchnorm(model, generator)
    return calibrate_batchnorm(model, example)


def build(name: str, batch: int, size: int | None = None, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """(model in eval mode on the CPU in float32, a random input of ``batch`` x 3 x size x size)."""
    spec = MODELS[name]
    size = size or spec.size
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = spec.build().eval()
        x = torch.randn(batch, 3, size, size)
        if not spec.randomized:
            randomize_bn(model, torch.randn(4, 3, size, size), seed)  # 4 images: see randomize_bn
    return model, x
