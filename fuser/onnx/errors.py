"""The errors the ONNX importer raises besides FileNotFoundError and NotImplementedError.

Each message names the file (or "<ModelProto>") and, where one is at fault, the ONNX node.
"""

from __future__ import annotations


class OnnxModelError(ValueError):
    """The input is not a usable ONNX model: not ONNX, a truncated protobuf, or rejected by onnx.checker."""


class OnnxConversionError(ValueError):
    """A node could not be converted although a converter exists (bad attribute, inconsistent inputs)."""


class OnnxExportError(RuntimeError):
    """torch.onnx could not export the module, or the file it wrote fails onnx.checker."""
