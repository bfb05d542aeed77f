"""fuser: compiler-style graph fusion for PyTorch inference.

    fast = fuser.optimize(model, example_inputs=(x,))     # conv->BN->act and GEMM->epilogue chains fused
    print(fuser.explain(model, example_inputs=(x,)))      # what would be fused, what not, and why
    fast = fuser.optimize("model.onnx")                   # ONNX in, runnable PyTorch module out
    fuser.export_onnx(fast, (x,), "model.opt.onnx")       # optimized graph out, runs in onnxruntime
    print(fuser.verify(model, fast, (x,)))                # float64 reference, labels/boxes, first bad layer

The public names are loaded on first use, so ``import fuser.kernels`` (the Triton side) does not pull in
the graph side.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "optimize": "fuser.api",
    "explain": "fuser.api",
    "OptimizedModule": "fuser.api",
    "FusionReport": "fuser.report",
    "export_onnx": "fuser.onnx.exporter",
    "Precision": "fuser.kernels.precision",
    "verify": "fuser.verification",
    "VerifyResult": "fuser.verification",
    "TOLERANCE": "fuser.verification",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'fuser' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
