"""The chains fuser fuses, declared as data.

A pattern is a report name, the kinds of its nodes in data-flow order (the kinds of fuser.graph_ops; each
node feeds the next), what a match becomes (:class:`Builds`: the fused module and the arguments of the head
node it reads) and where its residual add sits in the epilogue. The list is ordered by priority: where two
patterns match overlapping nodes, the earlier (longer) one wins, and a chain that fails a guard in a long
form can still fuse in a shorter one (conv -> BN -> SiLU whose output also feeds a concat still fuses,
without the residual add).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import networkx as nx

from fuser.epilogue import Residual
from fuser.graph_ops import CONV_ARGS, CONV_DEFAULTS, LINEAR_ARGS, LINEAR_DEFAULTS


@dataclass(frozen=True)
class Builds:
    """What the rewrite makes of a match: the fused module (``module``, a class of fuser.lower.fused_modules),
    the kind of node the chain must start with, and the argument names the head's call is bound to, in
    positional order, with the defaults of those it may omit (fuser.graph_ops.bind)."""

    module: str
    head: str
    args: tuple[str, ...]
    defaults: Mapping[str, Any]


FUSED_CONV = Builds("FusedConv2d", "conv2d", CONV_ARGS, CONV_DEFAULTS)
FUSED_LINEAR = Builds("FusedLinear", "linear", LINEAR_ARGS, LINEAR_DEFAULTS)


def _residual_of(steps: tuple[str, ...]) -> Residual:
    if "add" not in steps:
        return Residual.NONE
    before = "act" in steps and steps.index("add") < steps.index("act")
    return Residual.BEFORE_ACT if before else Residual.AFTER_ACT


@dataclass(frozen=True)
class ChainPattern:
    """``builds`` None: a candidate only reported (a lone BatchNorm, a conv before an op no epilogue has),
    never rewritten. ``residual`` is declared, and checked against the steps' order, so what a match
    computes is read from the pattern rather than re-derived by each reader."""

    name: str
    steps: tuple[str, ...]
    builds: Builds | None = None
    residual: Residual = Residual.NONE

    def __post_init__(self) -> None:
        if self.builds is not None and self.steps[:1] != (self.builds.head,):
            raise ValueError(f"pattern {self.name} {self.steps}: a {self.builds.module} starts at a {self.builds.head}")
        if self.residual != _residual_of(self.steps):
            raise ValueError(
                f"pattern {self.name} {self.steps}: declares residual {self.residual.name}, but its steps put "
                f"the add {_residual_of(self.steps).name}"
            )

    def graph(self) -> nx.DiGraph:
        """The pattern as a path DiGraph whose nodes carry their ``kind``, for networkx's matcher."""
        g = nx.DiGraph()
        for i, kind in enumerate(self.steps):
            g.add_node(i, kind=kind)
        g.add_edges_from((i, i + 1) for i in range(len(self.steps) - 1))
        return g


# A conv with nothing after it to fuse: its bias goes into the epilogue, and a fused conv is what the passes after
# the chains (cat buffers, virtual inputs, BatchNorm prologues) work on. Last of the conv patterns.
LONE_CONV = ChainPattern("conv", ("conv2d",), FUSED_CONV)

PATTERNS: list[ChainPattern] = [
    # conv -> BN -> act -> + residual (YOLO bottleneck, MBConv projection with act): all four in one kernel
    ChainPattern("conv_bn_act", ("conv2d", "batch_norm", "act", "add"), FUSED_CONV, Residual.AFTER_ACT),
    # conv -> BN -> + residual -> act (ResNet bottleneck: add, then ReLU)
    ChainPattern("conv_bn_act", ("conv2d", "batch_norm", "add", "act"), FUSED_CONV, Residual.BEFORE_ACT),
    # conv -> BN -> act (the Conv block of every CNN)
    ChainPattern("conv_bn_act", ("conv2d", "batch_norm", "act"), FUSED_CONV),
    # conv -> BN -> + residual (MBConv projection, ResNet-style without activation)
    ChainPattern("conv_bn_act", ("conv2d", "batch_norm", "add"), FUSED_CONV, Residual.AFTER_ACT),
    # conv -> BN (BN folded away; downsample branches, MBConv projections)
    ChainPattern("conv_bn_act", ("conv2d", "batch_norm"), FUSED_CONV),
    # conv(+bias) -> act -> + residual (already-folded models, ONNX exports)
    ChainPattern("conv_act", ("conv2d", "act", "add"), FUSED_CONV, Residual.AFTER_ACT),
    # conv(+bias) -> + residual -> act (already-folded ResNet)
    ChainPattern("conv_act", ("conv2d", "add", "act"), FUSED_CONV, Residual.BEFORE_ACT),
    # conv(+bias) -> act (squeeze-excitation convs, folded exports)
    ChainPattern("conv_act", ("conv2d", "act"), FUSED_CONV),
    # conv(+bias) -> + residual, no act (the downsample add of already-folded exports)
    ChainPattern("conv", ("conv2d", "add"), FUSED_CONV, Residual.AFTER_ACT),
    # a lone conv(+bias) (YOLO detect head outputs, ViT / Swin patch embeddings); guards say where it gains nothing
    LONE_CONV,
    # linear -> BN over its features -> act (timm LeViT's LinearNorm, MLP heads with BatchNorm1d): BN folded
    ChainPattern("gemm_bn_act", ("linear", "batch_norm", "act"), FUSED_LINEAR),
    # linear -> BN over its features (BN folded into the linear's weight and bias)
    ChainPattern("gemm_bn_act", ("linear", "batch_norm"), FUSED_LINEAR),
    # linear -> act -> + residual -> * scale
    ChainPattern("gemm_epilogue", ("linear", "act", "add", "scale"), FUSED_LINEAR, Residual.AFTER_ACT),
    # linear -> act -> + residual (transformer MLP written as one block)
    ChainPattern("gemm_epilogue", ("linear", "act", "add"), FUSED_LINEAR, Residual.AFTER_ACT),
    # linear -> + residual -> act
    ChainPattern("gemm_epilogue", ("linear", "add", "act"), FUSED_LINEAR, Residual.BEFORE_ACT),
    # linear -> act -> * scale
    ChainPattern("gemm_epilogue", ("linear", "act", "scale"), FUSED_LINEAR),
    # linear -> + residual -> * scale
    ChainPattern("gemm_epilogue", ("linear", "add", "scale"), FUSED_LINEAR, Residual.AFTER_ACT),
    # linear -> act (MLP up-projection: Linear -> GELU)
    ChainPattern("gemm_epilogue", ("linear", "act"), FUSED_LINEAR),
    # linear -> + residual (attention output and MLP down-projection)
    ChainPattern("gemm_epilogue", ("linear", "add"), FUSED_LINEAR, Residual.AFTER_ACT),
    # linear -> * scale (q projection times 1/sqrt(d))
    ChainPattern("gemm_epilogue", ("linear", "scale"), FUSED_LINEAR),
]
