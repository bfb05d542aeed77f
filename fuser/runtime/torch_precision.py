"""The precision policy for the unfused remainder of an optimized graph.

The fused kernels take the policy from their packed weights (fuser.kernels.precision). The ops that were
not fused (cuBLAS matmuls, cuDNN convs) follow torch's global flags; an optimized module sets those to
match its policy for the duration of its forward and puts them back afterwards, so the user's global
settings are the same before and after every call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from fuser.kernels.precision import Precision

# torch.set_float32_matmul_precision: "highest" is full float32, "high" allows TF32, "medium" allows bf16.
_MATMUL_PRECISION = {
    Precision.TF32: "high",
    Precision.TF32X3: "highest",
    Precision.IEEE: "highest",
    Precision.BF16: "medium",
    Precision.FP16: "medium",
}


@contextlib.contextmanager
def torch_precision(policy: Precision) -> Iterator[None]:
    """Set torch's float32 matmul and cuDNN flags to ``policy`` inside the block, restore them after."""
    saved_matmul = torch.get_float32_matmul_precision()
    saved_cudnn = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision(_MATMUL_PRECISION[policy])
    torch.backends.cudnn.allow_tf32 = policy in (Precision.TF32, Precision.BF16, Precision.FP16)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved_matmul)
        torch.backends.cudnn.allow_tf32 = saved_cudnn
