"""Make torchvision (and timm and ultralytics, which import it) importable where its C++ ops do not load.

PyPI's torchvision wheel for Linux is built against the CUDA torch; next to the CPU torch its compiled
ops (``torchvision._C``) fail to load, and ``import torchvision`` then fails at
``register_fake("torchvision::nms")``, as that operator was never defined. :func:`install` defines the
schemas of ``torchvision::nms`` and ``torchvision::qnms`` with torch.library, implemented by a plain-torch
greedy NMS, before torchvision is imported, and lets ``torchvision.ops.nms`` call it. Where the compiled
ops do load (a matching torchvision), nothing is changed. Other compiled ops (roi_align, deform_conv2d)
stay unavailable: models that need them are not in the zoo.
"""

from __future__ import annotations

import glob
import importlib.util
import os

import torch

_LIBRARY: torch.library.Library | None = None


def _compiled_ops_load() -> bool:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    for folder in spec.submodule_search_locations:
        for path in glob.glob(os.path.join(folder, "_C*.so")):
            try:
                torch.ops.load_library(path)
                return True
            except OSError:
                return False
    return False


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Indices of the boxes (x1, y1, x2, y2) that greedy NMS keeps, by decreasing score, like torchvision's."""
    if boxes.numel() == 0:
        return torch.empty(0, dtype=torch.long, device=boxes.device)
    order = scores.argsort(descending=True, stable=True)
    b = boxes[order].double()
    area = (b[:, 2] - b[:, 0]).clamp_min(0) * (b[:, 3] - b[:, 1]).clamp_min(0)
    lt = torch.maximum(b[:, None, :2], b[None, :, :2])
    rb = torch.minimum(b[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp_min(0).prod(2)
    overlaps = (inter / (area[:, None] + area[None, :] - inter)) > iou_threshold
    removed = torch.zeros(len(order), dtype=torch.bool, device=boxes.device)
    keep = []
    for i in range(len(order)):
        if not removed[i]:
            keep.append(i)
            removed |= overlaps[i]
    return order[torch.tensor(keep, dtype=torch.long, device=boxes.device)]


def _qnms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    return nms(boxes.dequantize(), scores.dequantize(), iou_threshold)


def install() -> bool:
    """Define the NMS operators where torchvision is installed but its compiled ops do not load; True when the
    shim is in use."""
    global _LIBRARY
    if _LIBRARY is not None:
        return True
    if importlib.util.find_spec("torchvision") is None or _compiled_ops_load():
        return False
    _LIBRARY = torch.library.Library("torchvision", "DEF")
    for name, impl in (("nms", nms), ("qnms", _qnms)):
        _LIBRARY.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
    import torchvision.ops.boxes

    torchvision.ops.boxes._assert_has_ops = lambda: None  # nms is defined now; the other ops still are not
    return True
