"""Pool pyramids: ``cat([x, pool(x), pool(pool(x)), ...], dim=1)`` as one kernel (YOLO's SPPF and SPP).

Stride-1 max pools padded by ``k // 2`` (with ``-inf``, as torch pads) compose exactly:
``pool_a(pool_b(x)) == pool_(a+b-1)(x)``. So each element of such a concatenation is one centred window of
the same ``x``, and the whole concatenation is what ``fuser.kernels.pool.max_pool_pyramid`` computes in one
launch: SPPF's three pooling kernels and the copy into the concatenation become one kernel.

:func:`fuse_pool_pyramids` is the graph pass; :class:`FusedPoolPyramid` is the module a match becomes. Its
reference (the torch backend, tracers and exporters) is plain ``max_pool2d`` + ``cat``, so an exported ONNX graph
stays standard (MaxPool, Concat); under torch.compile the kernel runs as the opaque custom op
``fuser::max_pool_pyramid`` (fuser.lower.ops).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fuser.graph_ops import cat_operands, int_pair, read_max_pool
from fuser.lower import ops
from fuser.lower.plan_table import KeepsPlans, PlanTable, input_signature
from fuser.report import GraphRewrite
from fuser.rewrite.node_pass import replace_with_module

MAX_SLICES = 4  # the kernel's limit; SPPF and SPP have four slices


def describe(radii: tuple[int, ...]) -> str:
    """``cat(x, maxpool5, maxpool9, maxpool13)``: the windows, as the report shows them."""
    return "cat(" + ", ".join("x" if r == 0 else f"maxpool{2 * r + 1}" for r in radii) + ")"


class FusedPoolPyramid(KeepsPlans, nn.Module):
    """``cat([max_pool2d(x, 2r+1, 1, r) for r in radii], dim)`` (radius 0: ``x`` itself)."""

    def __init__(self, radii: tuple[int, ...], dim: int, backend: str = "auto", source: str = "") -> None:
        super().__init__()
        self.radii = tuple(int(r) for r in radii)
        self.dim = int(dim)
        self.backend = ops.check_backend(backend)
        self.source = source
        self._plans = PlanTable()

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Plain torch: each window grown from the previous one by the difference of radii (exact)."""
        pooled: dict[int, torch.Tensor] = {0: x}
        last, current = 0, x
        for r in sorted(set(self.radii)):
            if r > last:
                step = r - last
                current = F.max_pool2d(current, 2 * step + 1, 1, step)
                pooled[r], last = current, r
        return torch.cat([pooled[r] for r in self.radii], self.dim)

    def _kernel_applies(self, x: torch.Tensor) -> bool:
        """Whether the kernel takes ``x`` here; under torch.compile ``x`` is a fake tensor, and the kernel then
        runs as the opaque custom op ``fuser::max_pool_pyramid``."""
        compiling = torch.compiler.is_compiling()
        if (type(x) is not torch.Tensor and not compiling) or x.dim() != 4 or self.dim not in (1, -3):
            return False
        if torch.jit.is_tracing() or ops.is_decomposed():
            return False
        if torch.is_grad_enabled() and x.requires_grad:
            return False
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return False
        return ops.resolve_backend(self.backend, x.device) in ("triton", "measured", "interpret")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._kernel_applies(x):
            return self.reference(x)
        if torch.compiler.is_compiling():
            return torch.ops.fuser.max_pool_pyramid(x, list(self.radii))
        from fuser.kernels.pool import max_pool_pyramid_plan

        build = lambda: max_pool_pyramid_plan(x, self.radii, interpret=x.device.type == "cpu")
        return self._plans.get(input_signature(x), build)(x)

    def extra_repr(self) -> str:
        return f"radii={self.radii}, dim={self.dim}, backend={self.backend}"


def _same_padded_pool_radius(node: fx.Node, modules: dict[str, nn.Module]) -> int | None:
    """``(k - 1) / 2`` when ``node`` is a stride-1 max pool padded by ``k // 2`` with an odd square ``k``."""
    pool = read_max_pool(node, modules)
    if pool is None or pool.ceil_mode or pool.return_indices:
        return None
    k, stride, padding, dilation = (_square(v) for v in (pool.kernel_size, pool.stride, pool.padding, pool.dilation))
    if None in (k, stride, padding, dilation):
        return None
    if k % 2 == 0 or stride != 1 or dilation != 1 or padding != k // 2:
        return None
    return k // 2


def _square(value: Any) -> int | None:
    """An int for ``v`` or ``(v, v)``; None for anything else (a node, an uneven pair)."""
    pair = int_pair(value)
    return pair[0] if pair is not None and pair[0] == pair[1] else None


def _window_of(node: Any, modules: dict[str, nn.Module]) -> tuple[fx.Node, int, list[fx.Node]] | None:
    """(base, radius, pool nodes) of ``node`` = a chain of same-padded stride-1 max pools of ``base``."""
    if not isinstance(node, fx.Node):
        return None
    radius, pools = 0, []
    while True:
        r = _same_padded_pool_radius(node, modules)
        if r is None:
            return node, radius, pools
        radius += r
        pools.append(node)
        node = node.args[0]
        if not isinstance(node, fx.Node):
            return None


def _rank(node: fx.Node) -> int | None:
    meta = node.meta.get("tensor_meta")
    return len(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def fuse_pool_pyramids(gm: fx.GraphModule, backend: str = "auto") -> list[GraphRewrite]:
    """Rewrite every pool-pyramid concatenation of ``gm`` into one :class:`FusedPoolPyramid` call.

    A concatenation qualifies when it joins (along the channel dimension of a 4-D tensor) between 2 and
    ``MAX_SLICES`` tensors that are each ``x`` or a chain of stride-1, ``k // 2``-padded max pools of the
    same ``x``, at least one of them pooled. Pools that nothing else reads afterwards are erased. Returns
    what was rewritten (empty: ``gm`` is unchanged)."""
    modules = dict(gm.named_modules())
    found: list[GraphRewrite] = []
    for node in list(gm.graph.nodes):
        parts = cat_operands(node)
        if parts is None or not isinstance(parts[1], int):
            continue
        tensors, dim = parts
        windows = [_window_of(t, modules) for t in tensors]
        if not 2 <= len(windows) <= MAX_SLICES or any(w is None for w in windows):
            continue
        bases = {w[0] for w in windows}
        radii = tuple(w[1] for w in windows)
        if len(bases) != 1 or max(radii) == 0:
            continue
        base = bases.pop()
        rank = _rank(base)
        if rank not in (None, 4) or dim not in (1, -3) or (dim == -3 and rank is None):
            continue
        pools = list(dict.fromkeys(p for w in windows for p in w[2]))
        source = str(node.meta.get("source_module", node.name))
        replace_with_module(gm, node, "fused_pool_pyramid", FusedPoolPyramid(radii, dim, backend, source), (base,))
        eliminated = [node.name]
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for pool in sorted(pools, key=order.__getitem__, reverse=True):  # consumers before producers
            if not pool.users:
                eliminated.append(pool.name)
                gm.graph.erase_node(pool)
        found.append(GraphRewrite("pool_pyramid", source, describe(radii), eliminated))
    if found:
        gm.delete_all_unused_submodules()
        gm.graph.lint()
        gm.recompile()
    return found
