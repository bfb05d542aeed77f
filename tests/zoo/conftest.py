"""The zoo imports torchvision, timm and ultralytics: their NMS operators first (see torchvision_shim)."""

from __future__ import annotations

import os

import torchvision_shim

os.environ.setdefault("YOLO_OFFLINE", "1")  # ultralytics: no update checks (this machine has no network)
torchvision_shim.install()
