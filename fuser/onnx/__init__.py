"""ONNX in and out.

    gm = fuser.onnx.import_onnx("model.onnx")          # an fx GraphModule of plain torch calls
    fuser.onnx.export_onnx(module, (x,), "out.onnx")    # standard ONNX, dynamic batch, atomic write

``import_onnx`` feeds ``fuser.optimize``; converters live in a registry keyed by (domain, op_type,
schema version), see :mod:`fuser.onnx.registry`. Names load on first use, so importing the exporter
does not load the converters.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "import_onnx": "fuser.onnx.importer",
    "export_onnx": "fuser.onnx.exporter",
    "OnnxModelError": "fuser.onnx.errors",
    "OnnxConversionError": "fuser.onnx.errors",
    "OnnxExportError": "fuser.onnx.errors",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'fuser.onnx' has no attribute {name!r}")
