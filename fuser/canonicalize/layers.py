"""Layer modules become functional calls with their parameters read through get_attr (nn.Conv2d -> F.conv2d,
eval nn.BatchNorm2d -> F.batch_norm, nn.Linear -> F.linear): the forms fuser.graph_ops names."""

from __future__ import annotations

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fuser.canonicalize.driver import Context, Rule, get_attr, replace


def rule_conv_module(node: fx.Node, ctx: Context) -> bool:
    if node.op != "call_module":
        return False
    m = ctx.modules.get(str(node.target))
    if type(m) is not nn.Conv2d or m.padding_mode != "zeros" or len(node.args) != 1 or node.kwargs:
        return False
    w = get_attr(ctx, node, f"{node.target}.weight")
    b = get_attr(ctx, node, f"{node.target}.bias") if m.bias is not None else None
    replace(node, F.conv2d, (node.args[0], w, b, m.stride, m.padding, m.dilation, m.groups))
    ctx.refresh_order()
    return True


def rule_batchnorm_module(node: fx.Node, ctx: Context) -> bool:
    if node.op != "call_module":
        return False
    m = ctx.modules.get(str(node.target))
    if type(m) not in (nn.BatchNorm2d, nn.SyncBatchNorm) or len(node.args) != 1 or node.kwargs:
        return False
    if m.training or m.running_mean is None or m.running_var is None:
        return False  # uses batch statistics: left as is, and reported by the BN guard
    names = ["running_mean", "running_var"] + (["weight", "bias"] if m.affine else [])
    attrs = [get_attr(ctx, node, f"{node.target}.{n}") for n in names]
    weight, bias = (attrs[2], attrs[3]) if m.affine else (None, None)
    replace(node, F.batch_norm, (node.args[0], attrs[0], attrs[1], weight, bias, False, 0.0, m.eps))
    ctx.refresh_order()
    return True


def rule_linear_module(node: fx.Node, ctx: Context) -> bool:
    if node.op != "call_module":
        return False
    m = ctx.modules.get(str(node.target))
    if type(m) is not nn.Linear or len(node.args) != 1 or node.kwargs:
        return False
    w = get_attr(ctx, node, f"{node.target}.weight")
    b = get_attr(ctx, node, f"{node.target}.bias") if m.bias is not None else None
    replace(node, F.linear, (node.args[0], w, b))
    ctx.refresh_order()
    return True


RULES: list[Rule] = [
    # nn.Conv2d (zeros padding) -> F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    Rule("conv_module", "nn.Conv2d -> F.conv2d with get_attr parameters", rule_conv_module),
    # nn.BatchNorm2d in eval with running stats -> F.batch_norm(x, mean, var, w, b, False, 0, eps)
    Rule("batchnorm_module", "eval nn.BatchNorm2d -> F.batch_norm(training=False)", rule_batchnorm_module),
    # nn.Linear -> F.linear(x, weight, bias)
    Rule("linear_module", "nn.Linear -> F.linear with get_attr parameters", rule_linear_module),
]
