"""Squeeze-excitation's global average pool summed by the depthwise conv whose output it averages.

In an MBConv block the depthwise conv's output feeds both the SE branch's ``mean over (H, W)`` and the
projection conv. After fuser.rewrite.channel_mean the mean is a :class:`FusedChannelMean`, one more kernel that
reads the whole output again. :func:`fuse_depthwise_pools`, run after the chains are rewritten, makes the
pair one :class:`PooledDepthwise` call returning both: eagerly, the depthwise kernel sums each tile's stored
values per channel and the mean is the fixed-order sum of those partial sums (fuser.kernels.depthwise, POOL),
so the output is written once and not read again for the pool. Under torch.compile, exporters and tracers
the module is the conv's custom op followed by the original mean (Inductor and ONNX see a plain mean).

A pair qualifies when the mean reads a fused conv that runs the depthwise kernel (``groups == C_in == C_out``),
called on its input alone (no residual, preallocated output, channel scale or virtual input), with a 4-D
output: the kernel writes that output NHWC, and the mean is over exactly its spatial dims (the forms
channel_mean reads). The conv's other users (the projection) read the same output as before.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fuser.kernels.conv_choice import is_depthwise
from fuser.lower.fused_modules import FusedConv2d
from fuser.report import GraphRewrite
from fuser.rewrite.channel_mean import FusedChannelMean
from fuser.rewrite.node_pass import candidates, finish

DESCRIPTION = "mean over H, W summed in the depthwise conv's epilogue: its separate reduction kernel eliminated"


class PooledDepthwise(nn.Module):
    """``(conv(x), mean(conv(x)))`` of a depthwise :class:`FusedConv2d` and the :class:`FusedChannelMean` that
    read its output, in one kernel where :meth:`FusedConv2d.conv_and_mean` gives both."""

    def __init__(self, conv: FusedConv2d, mean: FusedChannelMean) -> None:
        super().__init__()
        self.conv = conv
        self.mean = mean

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, m = self.conv.conv_and_mean(x)
        if m is None:
            return y, self.mean(y)
        form = self.mean.form
        return y, (m.view(*m.shape, 1, 1) if form.keepdim or form.dims is None else m)


def _is_depthwise(conv: FusedConv2d) -> bool:
    c_out, c_in_g = conv.weight.shape[:2]
    return is_depthwise(c_in_g * conv.groups, c_out, conv.groups)


def _read_pair(node: fx.Node, modules: dict[str, Any]) -> fx.Node | None:
    """The conv's node when ``node`` is a fused channel mean of a depthwise fused conv's output, the conv
    called as ``conv(x)`` with a 4-D output (see the module docstring), else None."""
    if node.op != "call_module" or not isinstance(modules.get(str(node.target)), FusedChannelMean):
        return None
    if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
        return None
    conv_node = node.args[0]
    conv = modules.get(str(conv_node.target)) if conv_node.op == "call_module" else None
    if not isinstance(conv, FusedConv2d) or not _is_depthwise(conv):
        return None
    if len(conv_node.args) != 1 or conv_node.kwargs or not isinstance(conv_node.args[0], fx.Node):
        return None
    meta = conv_node.meta.get("tensor_meta")
    if meta is not None and len(getattr(meta, "shape", ())) != 4:
        return None
    return conv_node


def _split_outputs(gm: fx.GraphModule, both: fx.Node, mean_node: fx.Node) -> None:
    """After ``both`` (the conv's node) became a call of the pair: ``both[0]`` for the conv's users, ``both[1]``
    for the mean's, which is erased."""
    graph = gm.graph
    with graph.inserting_after(both):
        y = graph.call_function(operator.getitem, (both, 0))
    both.replace_all_uses_with(y, delete_user_cb=lambda user: user is not y)
    y.meta = dict(both.meta)
    both.meta.pop("tensor_meta", None)  # a pair now, not a tensor
    with graph.inserting_after(y):
        m = graph.call_function(operator.getitem, (both, 1))
    m.meta = dict(mean_node.meta)
    mean_node.replace_all_uses_with(m)
    graph.erase_node(mean_node)


def fuse_depthwise_pools(gm: fx.GraphModule) -> list[GraphRewrite]:
    """Make every qualifying depthwise conv and its spatial mean one :class:`PooledDepthwise` call (see the
    module docstring). Returns what was fused (kind ``depthwise_pool``; empty: ``gm`` is unchanged).

    The pair takes the conv's name and node, so ``gm``'s fused layers stay in the order of the report's chains
    (fuser.verification ties them up by that order)."""
    found: list[GraphRewrite] = []
    modules = dict(gm.named_modules())
    # A second mean of one conv's output reads the first's getitem by the time it is read: left as it is.
    for mean_node, conv_node in candidates(gm, _read_pair):
        name = str(conv_node.target)
        gm.add_submodule(name, PooledDepthwise(modules[name], modules[str(mean_node.target)]))
        source = str(mean_node.meta.get("source_module") or mean_node.name)
        _split_outputs(gm, conv_node, mean_node)
        found.append(GraphRewrite("depthwise_pool", source, DESCRIPTION, [mean_node.name]))
    finish(gm, bool(found))
    return found
