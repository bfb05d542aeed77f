"""The zoo imports torchvision, timm and ultralytics: their NMS operators first (see zoo_checks.prepare)."""

from __future__ import annotations

import zoo_checks

zoo_checks.prepare()
