"""Global average pools (squeeze-excitation's, a classifier head's) as one Triton reduction on NHWC inputs.

``x.mean((2, 3), keepdim=True)``, ``F.adaptive_avg_pool2d(x, 1)`` and ``nn.AdaptiveAvgPool2d(1)`` on a
channels_last CUDA tensor run torch's generic reduction kernel, which at batch 1 spreads a few hundred
outputs over few threads (measured on an H200: 16 of them are 0.12 ms of EfficientNet-B0's 0.67 ms).
:func:`fuse_channel_means` makes each such node a :class:`FusedChannelMean`, which runs
``fuser.kernels.channel_mean`` (parallel over channels, split over pixels, deterministic) where it applies
and the original op everywhere else (CPU, NCHW inputs, torch.compile, tracers and exporters: Inductor and
ONNX see a plain mean / adaptive pool).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fuser.lower.backends import KERNEL_DTYPES, check_backend, is_decomposed, resolve_backend
from fuser.report import GraphRewrite
from fuser.rewrite.node_pass import candidates, finish, replace_with_module

DESCRIPTION = "mean over H, W: one NHWC reduction kernel (split over pixels)"
_SPATIAL_DIMS = ({2, 3}, {-2, -1}, {2, -1}, {-2, 3})


@dataclass(frozen=True)
class MeanForm:
    """How the graph wrote the pool: ``dims`` and ``keepdim`` of a ``mean``, or ``dims=None`` for an
    adaptive average pool to 1x1 (which also takes 3-D inputs)."""

    dims: tuple[int, ...] | None
    keepdim: bool = True


class FusedChannelMean(nn.Module):
    """The mean over the spatial dims of an ``[N, C, H, W]`` tensor, written as ``form``."""

    def __init__(self, form: MeanForm, backend: str = "auto", source: str = "") -> None:
        super().__init__()
        self.form = form
        self.backend = check_backend(backend)
        self.source = source

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        if self.form.dims is None:
            return F.adaptive_avg_pool2d(x, 1)
        return x.mean(self.form.dims, keepdim=self.form.keepdim)

    def _interpreted(self, x: torch.Tensor) -> bool | None:
        """Whether the kernel runs interpreted (True) or compiled (False) on ``x``, or None: it does not run."""
        if torch.compiler.is_compiling() or torch.jit.is_tracing() or is_decomposed():
            return None
        if type(x) is not torch.Tensor or x.dim() != 4 or x.dtype not in KERNEL_DTYPES or 0 in x.shape:
            return None
        if torch.is_grad_enabled() and x.requires_grad:
            return None
        chosen = resolve_backend(self.backend, x.device)
        if chosen == "interpret":
            return True
        # NCHW (and spatially 1x1) inputs: torch's reduction is already contiguous along the pixels
        return False if chosen in ("triton", "measured") and x.stride(1) == 1 and x.shape[2] * x.shape[3] > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        interpret = self._interpreted(x)
        if interpret is None:
            return self.reference(x)
        from fuser.kernels.channel_mean import channel_mean_plan

        out = channel_mean_plan(x, interpret=interpret)(x)
        return out if self.form.keepdim else out.view(x.shape[0], x.shape[1])

    def extra_repr(self) -> str:
        return f"{self.form}, backend={self.backend}"


def _is_one(size: Any) -> bool:
    return size == 1 or (isinstance(size, (tuple, list)) and list(size) == [1, 1])


def _mean_dims(dims: Any, keepdim: Any, rank: int | None) -> MeanForm | None:
    if not isinstance(dims, (tuple, list)) or not all(type(d) is int for d in dims) or type(keepdim) is not bool:
        return None
    if len(dims) != 2 or set(dims) not in _SPATIAL_DIMS or rank not in (None, 4):
        return None
    if rank is None and any(d < 0 for d in dims):
        return None  # dims counted from the end name the spatial dims of a 4-D tensor only
    return MeanForm(tuple(dims), keepdim)


def _rank(node: Any) -> int | None:
    meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    return len(meta.shape) if hasattr(meta, "shape") else None


def read_mean(node: fx.Node, modules: dict[str, nn.Module]) -> tuple[fx.Node, MeanForm] | None:
    """``(x, form)`` when ``node`` averages ``x`` over its spatial dims, in any of the forms above."""
    if node.op == "call_module" and type(modules.get(str(node.target))) is nn.AdaptiveAvgPool2d:
        size = modules[str(node.target)].output_size
        if len(node.args) == 1 and not node.kwargs and _is_one(size) and isinstance(node.args[0], fx.Node):
            return node.args[0], MeanForm(None)
        return None
    if node.op == "call_function" and node.target is F.adaptive_avg_pool2d:
        values = dict(zip(("input", "output_size"), node.args, strict=False)) | dict(node.kwargs)
        if set(values) == {"input", "output_size"} and _is_one(values["output_size"]):
            x = values["input"]
            return (x, MeanForm(None)) if isinstance(x, fx.Node) else None
        return None
    is_method = node.op == "call_method" and node.target == "mean"
    if is_method or (node.op == "call_function" and node.target is torch.mean):
        values = dict(zip(("input", "dim", "keepdim"), node.args, strict=False)) | dict(node.kwargs)
        values.setdefault("keepdim", False)
        x = values.get("input")
        if set(values) != {"input", "dim", "keepdim"} or not isinstance(x, fx.Node):
            return None
        form = _mean_dims(values["dim"], values["keepdim"], _rank(x))
        return (x, form) if form is not None else None
    return None


def fuse_channel_means(gm: fx.GraphModule, backend: str = "auto") -> list[GraphRewrite]:
    """Make every spatial mean of ``gm`` a :class:`FusedChannelMean` call. Returns what was rewritten
    (empty: ``gm`` is unchanged)."""
    found: list[GraphRewrite] = []
    for node, (x, form) in candidates(gm, read_mean):
        source = str(node.meta.get("source_module") or node.name)
        replace_with_module(gm, node, "fused_channel_mean", FusedChannelMean(form, backend, source), (x,))
        found.append(GraphRewrite("channel_mean", source, DESCRIPTION, [node.name]))
    finish(gm, bool(found))
    return found
