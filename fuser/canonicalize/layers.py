"""Layer modules become functional calls with their parameters read through get_attr (nn.Conv2d -> F.conv2d,
eval nn.BatchNorm2d -> F.batch_norm, nn.Linear -> F.linear): the forms fuser.graph_ops names.

A conv (1-d, 2-d or 3-d) or linear under a parametrization (``torch.nn.utils.parametrizations.weight_norm``,
``spectral_norm``) computes its weight from the parametrization's tensors at every call; in eval mode that
weight is a constant, so it is computed once here and read through a get_attr like any other."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from fuser.canonicalize.driver import Context, Rule, get_attr, replace
from fuser.graph_ops import unused_name


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


def _parametrized(node: fx.Node, ctx: Context, bases: tuple[type[nn.Module], ...]) -> nn.Module | None:
    """The eval-mode module a ``call_module`` node calls on one input, when it is one of ``bases`` under a
    parametrization (torch makes its class ``Parametrized<Base>``, a subclass of exactly the base)."""
    if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
        return None
    m = ctx.modules.get(str(node.target))
    if m is None or m.training or not parametrize.is_parametrized(m) or type(m).__bases__ not in [(b,) for b in bases]:
        return None
    return m


def _read(node: fx.Node, ctx: Context, m: nn.Module, name: str) -> fx.Node | None:
    """A get_attr of ``m``'s tensor ``name`` registered on the graph module as a buffer: where a
    parametrization computes it, its value now; else the module's own tensor (the same storage). Either way
    nothing is left to read through ``m``, which can go. None where the module has no such tensor."""
    value = getattr(m, name)
    if value is None:
        return None
    with torch.no_grad():
        value = value.detach()
        if parametrize.is_parametrized(m, name):
            value = value.clone(memory_format=torch.contiguous_format)
    buffer = unused_name(ctx.gm, f"{str(node.target).replace('.', '_')}_{name}")
    ctx.gm.register_buffer(buffer, value)
    return get_attr(ctx, node, buffer)


# The functional call of each layer type a parametrization may wrap.
_PARAMETRIZED_CALLS: dict[type[nn.Module], Callable[..., Any]] = {
    nn.Conv1d: F.conv1d,
    nn.Conv2d: F.conv2d,
    nn.Conv3d: F.conv3d,
    nn.Linear: F.linear,
}


def rule_parametrized_layer(node: fx.Node, ctx: Context) -> bool:
    m = _parametrized(node, ctx, tuple(_PARAMETRIZED_CALLS))
    if m is None or getattr(m, "padding_mode", "zeros") != "zeros":
        return False
    weight, bias = _read(node, ctx, m, "weight"), _read(node, ctx, m, "bias")
    call = _PARAMETRIZED_CALLS[type(m).__bases__[0]]
    target = str(node.target)
    if isinstance(m, nn.Linear):
        replace(node, call, (node.args[0], weight, bias))
    else:
        replace(node, call, (node.args[0], weight, bias, m.stride, m.padding, m.dilation, m.groups))
    # The parametrized module itself goes once nothing reads it: it holds the tensors the weight was computed
    # from, and torch.save refuses a module that holds a parametrization.
    reads = (str(n.target) for n in ctx.gm.graph.nodes if n.op in ("call_module", "get_attr"))
    if not any(r == target or r.startswith(f"{target}.") for r in reads):
        ctx.gm.delete_submodule(target)
        ctx.modules = dict(ctx.gm.named_modules())
    ctx.refresh_order()
    return True


RULES: list[Rule] = [
    # weight_norm(nn.Conv2d) in eval -> F.conv2d(x, its weight computed once, bias, ...); Conv1d/3d, Linear alike
    Rule(
        "parametrized_layer",
        "eval nn.ConvNd / nn.Linear under a parametrization (weight norm) -> F.convNd / F.linear of its weight",
        rule_parametrized_layer,
    ),
    # nn.Conv2d (zeros padding) -> F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    Rule("conv_module", "nn.Conv2d -> F.conv2d with get_attr parameters", rule_conv_module),
    # nn.BatchNorm2d in eval with running stats -> F.batch_norm(x, mean, var, w, b, False, 0, eps)
    Rule("batchnorm_module", "eval nn.BatchNorm2d -> F.batch_norm(training=False)", rule_batchnorm_module),
    # nn.Linear -> F.linear(x, weight, bias)
    Rule("linear_module", "nn.Linear -> F.linear with get_attr parameters", rule_linear_module),
]
