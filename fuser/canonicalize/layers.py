"""Layer modules become functional calls with their parameters read through get_attr (nn.Conv2d -> F.conv2d,
eval nn.BatchNorm2d -> F.batch_norm, nn.Linear -> F.linear): the forms fuser.graph_ops names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fuser.canonicalize.driver import Context, Rule, get_attr, replace


def _module(node: fx.Node, ctx: Context, types: tuple[type[nn.Module], ...]) -> nn.Module | None:
    """The module a ``call_module`` node calls, when it is exactly one of ``types`` and called on one input."""
    if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
        return None
    m = ctx.modules.get(str(node.target))
    return m if type(m) in types else None


def _replace_by_call(node: fx.Node, ctx: Context, function: Callable[..., Any], params: list[str], *rest: Any) -> bool:
    """Replace the module call ``node`` by ``function(x, *its params, *rest)``, each parameter read through a
    get_attr (None where the module has none, e.g. a conv without bias)."""
    m = ctx.modules[str(node.target)]
    attrs = [get_attr(ctx, node, f"{node.target}.{p}") if getattr(m, p) is not None else None for p in params]
    replace(node, function, (node.args[0], *attrs, *rest))
    ctx.refresh_order()
    return True


def rule_conv_module(node: fx.Node, ctx: Context) -> bool:
    m = _module(node, ctx, (nn.Conv2d,))
    if m is None or m.padding_mode != "zeros":
        return False
    return _replace_by_call(node, ctx, F.conv2d, ["weight", "bias"], m.stride, m.padding, m.dilation, m.groups)


def rule_batchnorm_module(node: fx.Node, ctx: Context) -> bool:
    m = _module(node, ctx, (nn.BatchNorm2d, nn.SyncBatchNorm))
    if m is None or m.training or m.running_mean is None or m.running_var is None:
        return False  # uses batch statistics: left as is, and reported by the BN guard
    params = ["running_mean", "running_var", "weight", "bias"]  # weight and bias are None unless affine
    return _replace_by_call(node, ctx, F.batch_norm, params, False, 0.0, m.eps)


def rule_linear_module(node: fx.Node, ctx: Context) -> bool:
    return _module(node, ctx, (nn.Linear,)) is not None and _replace_by_call(node, ctx, F.linear, ["weight", "bias"])


RULES: list[Rule] = [
    # nn.Conv2d (zeros padding) -> F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    Rule("conv_module", "nn.Conv2d -> F.conv2d with get_attr parameters", rule_conv_module),
    # nn.BatchNorm2d in eval with running stats -> F.batch_norm(x, mean, var, w, b, False, 0, eps)
    Rule("batchnorm_module", "eval nn.BatchNorm2d -> F.batch_norm(training=False)", rule_batchnorm_module),
    # nn.Linear -> F.linear(x, weight, bias)
    Rule("linear_module", "nn.Linear -> F.linear with get_attr parameters", rule_linear_module),
]
