"""The chains fuser fuses, declared as data.

A pattern is a report name and the kinds of its nodes in data-flow order (the kinds of fuser.graph_ops);
each node feeds the next. The list is ordered by priority: where two patterns match overlapping nodes, the
earlier (longer) one wins, and a chain that fails a guard in a long form can still fuse in a shorter one
(conv -> BN -> SiLU whose output also feeds a concat still fuses, without the residual add).
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx


@dataclass(frozen=True)
class ChainPattern:
    name: str
    steps: tuple[str, ...]

    def graph(self) -> nx.DiGraph:
        """The pattern as a path DiGraph whose nodes carry their ``kind``, for networkx's matcher."""
        g = nx.DiGraph()
        for i, kind in enumerate(self.steps):
            g.add_node(i, kind=kind)
        g.add_edges_from((i, i + 1) for i in range(len(self.steps) - 1))
        return g


PATTERNS: list[ChainPattern] = [
    # conv -> BN -> act -> + residual (YOLO bottleneck, MBConv projection with act): all four in one kernel
    ChainPattern("conv_bn_act", ("conv2d", "batch_norm", "act", "add")),
    # conv -> BN -> + residual -> act (ResNet bottleneck: add, then ReLU)
    ChainPattern("conv_bn_act", ("conv2d", "batch_norm", "add", "act")),
    # conv -> BN -> act (the Conv block of every CNN)
    ChainPattern("conv_bn_act", ("conv2d", "batch_norm", "act")),
    # conv -> BN -> + residual (MBConv projection, ResNet-style without activation)
    ChainPattern("conv_bn_act", ("conv2d", "batch_norm", "add")),
    # conv -> BN (BN folded away; downsample branches, MBConv projections)
    ChainPattern("conv_bn_act", ("conv2d", "batch_norm")),
    # conv(+bias) -> act -> + residual (already-folded models, ONNX exports)
    ChainPattern("conv_act", ("conv2d", "act", "add")),
    # conv(+bias) -> + residual -> act (already-folded ResNet)
    ChainPattern("conv_act", ("conv2d", "add", "act")),
    # conv(+bias) -> act (squeeze-excitation convs, folded exports)
    ChainPattern("conv_act", ("conv2d", "act")),
    # linear -> BN over its features -> act (timm LeViT's LinearNorm, MLP heads with BatchNorm1d): BN folded
    ChainPattern("gemm_bn_act", ("linear", "batch_norm", "act")),
    # linear -> BN over its features (BN folded into the linear's weight and bias)
    ChainPattern("gemm_bn_act", ("linear", "batch_norm")),
    # linear -> act -> + residual -> * scale
    ChainPattern("gemm_epilogue", ("linear", "act", "add", "scale")),
    # linear -> act -> + residual (transformer MLP written as one block)
    ChainPattern("gemm_epilogue", ("linear", "act", "add")),
    # linear -> + residual -> act
    ChainPattern("gemm_epilogue", ("linear", "add", "act")),
    # linear -> act -> * scale
    ChainPattern("gemm_epilogue", ("linear", "act", "scale")),
    # linear -> + residual -> * scale
    ChainPattern("gemm_epilogue", ("linear", "add", "scale")),
    # linear -> act (MLP up-projection: Linear -> GELU)
    ChainPattern("gemm_epilogue", ("linear", "act")),
    # linear -> + residual (attention output and MLP down-projection)
    ChainPattern("gemm_epilogue", ("linear", "add")),
    # linear -> * scale (q projection times 1/sqrt(d))
    ChainPattern("gemm_epilogue", ("linear", "scale")),
]
