"""Max pools on NHWC CUDA tensors as fuser's own kernel (ResNet's stem pool, VGG's, ...).

PyTorch's channels_last max-pool kernel is slow on Hopper: ResNet-50's 3x3 stride-2 stem pool took 0.117 ms
at batch 32 fp16 on the H200 (about 0.4 TB/s) and 0.020 ms at batch 1, where the kernel of
``fuser.kernels.max_pool`` reads each window's channel runs as vectors. :func:`fuse_max_pools` makes each
2-D max pool that the pool-pyramid pass left a :class:`FusedMaxPool2d`, which runs that kernel where it
applies (channels_last CUDA input, floor mode, dilation 1, no indices) and ``F.max_pool2d`` everywhere else:
on the CPU, under torch.compile (Inductor lowers the pool itself), tracers and exporters (ONNX sees a
standard MaxPool).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fuser.graph_ops import MaxPoolCall, int_pair, read_max_pool
from fuser.lower.backends import KERNEL_DTYPES, check_backend, is_decomposed, resolve_backend
from fuser.lower.plan_table import KeepsPlans, PlanTable, input_signature
from fuser.report import GraphRewrite
from fuser.rewrite.node_pass import candidates, finish, replace_with_module

DESCRIPTION = "max_pool2d as an NHWC kernel (channel runs as vectors)"


class FusedMaxPool2d(KeepsPlans, nn.Module):
    """``F.max_pool2d(x, kernel_size, stride, padding)`` (dilation 1, floor mode)."""

    def __init__(
        self,
        kernel_size: tuple[int, int],
        stride: tuple[int, int],
        padding: tuple[int, int],
        backend: str = "auto",
        source: str = "",
    ) -> None:
        super().__init__()
        self.kernel_size, self.stride, self.padding = tuple(kernel_size), tuple(stride), tuple(padding)
        self.backend = check_backend(backend)
        self.source = source
        self._plans = PlanTable()

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(x, self.kernel_size, self.stride, self.padding)

    def _interpreted(self, x: torch.Tensor) -> bool | None:
        """Whether the kernel runs interpreted (True) or compiled (False) on ``x``, or None: it does not run."""
        if torch.compiler.is_compiling() or torch.jit.is_tracing() or is_decomposed():
            return None
        if type(x) is not torch.Tensor or x.dim() != 4 or x.dtype not in KERNEL_DTYPES or 0 in x.shape:
            return None
        if (torch.is_grad_enabled() and x.requires_grad) or x.stride(1) != 1:
            return None
        oh = (x.shape[2] + 2 * self.padding[0] - self.kernel_size[0]) // self.stride[0] + 1
        ow = (x.shape[3] + 2 * self.padding[1] - self.kernel_size[1]) // self.stride[1] + 1
        if oh < 1 or ow < 1:
            return None  # torch's own error names the problem
        chosen = resolve_backend(self.backend, x.device)
        if chosen == "interpret":
            return True
        return False if chosen in ("triton", "measured") else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        interpret = self._interpreted(x)
        if interpret is None:
            return self.reference(x)
        from fuser.kernels.max_pool import max_pool2d_plan

        build = lambda: max_pool2d_plan(x, self.kernel_size, self.stride, self.padding, interpret=interpret)
        return self._plans.get(input_signature(x), build)(x)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, backend={self.backend}"


Geometry = tuple[tuple[int, int], tuple[int, int], tuple[int, int]]


def _kernel_pool(node: fx.Node, modules: dict[str, nn.Module]) -> tuple[MaxPoolCall, Geometry] | None:
    """The pool and its (window, stride, padding) when the kernel computes it: a 4-D input (or unknown
    rank), no indices, floor mode, dilation 1, padding at most half the window (torch's own limit)."""
    pool = read_max_pool(node, modules)
    if pool is None or pool.return_indices is not False or pool.ceil_mode is not False:
        return None
    geometry = tuple(int_pair(v) for v in (pool.kernel_size, pool.stride, pool.padding, pool.dilation))
    if None in geometry or geometry[3] != (1, 1) or not isinstance(pool.input, fx.Node):
        return None
    (kh, kw), stride, (ph, pw), _ = geometry
    if 2 * ph > kh or 2 * pw > kw or min(kh, kw, *stride) < 1:
        return None
    meta = pool.input.meta.get("tensor_meta")
    if hasattr(meta, "shape") and len(meta.shape) != 4:
        return None
    return pool, geometry[:3]


def fuse_max_pools(gm: fx.GraphModule, backend: str = "auto") -> list[GraphRewrite]:
    """Make every 2-D max pool of ``gm`` that the kernel computes a :class:`FusedMaxPool2d` call. Run after
    the pool-pyramid pass, which takes SPPF's pools whole. Returns what was rewritten (empty: unchanged)."""
    found: list[GraphRewrite] = []
    for node, (pool, (kernel_size, stride, padding)) in candidates(gm, _kernel_pool):
        source = str(node.meta.get("source_module") or node.name)
        module = FusedMaxPool2d(kernel_size, stride, padding, backend, source)
        replace_with_module(gm, node, "fused_max_pool", module, (pool.input,))
        found.append(GraphRewrite("max_pool", source, DESCRIPTION, [node.name]))
    finish(gm, bool(found))
    return found
