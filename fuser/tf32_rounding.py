"""Which fused outputs are stored rounded to TF32: those that only ever reach the tensor cores as a dot operand.

Under the "tf32" policy the tensor cores read the top 19 bits of a float32 operand: fed an unrounded value
they truncate it, which shrinks every product toward zero by about 2^-12 on average, a bias that adds up
layer after layer (ResNet-50's model-level error was several times cuDNN's, which rounds to nearest
first). The weights are rounded at packing time (fuser.kernels.packing); the activations are rounded for
free by the kernel that produces them, in its epilogue, before the single store, where the value is
already in registers (``Epilogue.round_tf32``). That changes the stored value, so it is done only where
nobody but a TF32 dot ever reads it: every path from the producer, through ops that only move or select
values (concatenation, chunks, views, max pools, nearest upsampling: the max or copy of rounded values is
rounded), ends as the input operand of a fused conv or linear whose kernel runs a TF32 tensor-core dot. A
value that is also a residual, a graph output, the input of a depthwise or direct conv (those multiply in
float32 on the FMA units) or of any other op (an add or a mul makes new values, which are not rounded) is
stored as computed.

The network's input is not rounded by anyone: where it enters a tensor-core conv (a stem the direct kernel
does not take, such as ResNet's 7x7) that conv truncates it; the RGB stems of most CNNs run the direct
kernel, which reads it exactly.
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fuser.fused_modules import FusedConv2d, FusedLinear
from fuser.kernels.conv_choice import conv_kernel
from fuser.kernels.precision import Precision
from fuser.pool_pyramid import MAX_POOL_FUNCTIONS, FusedPoolPyramid

# Functions and methods whose output holds only values of their tensor inputs (or exact zeros).
_MOVING_FUNCTIONS: set[Any] = {
    torch.cat,
    torch.concat,
    torch.chunk,
    torch.split,
    torch.narrow,
    torch.flatten,
    torch.reshape,
    torch.permute,
    torch.transpose,
    torch.squeeze,
    torch.unsqueeze,
    operator.getitem,
    *MAX_POOL_FUNCTIONS,
}
_MOVING_METHODS = {
    "chunk",
    "split",
    "narrow",
    "view",
    "reshape",
    "flatten",
    "permute",
    "transpose",
    "squeeze",
    "unsqueeze",
    "contiguous",
}
_MOVING_MODULES = (nn.MaxPool2d, nn.Identity, nn.Flatten, FusedPoolPyramid)


def _is_nearest_upsample(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        m = modules.get(str(node.target))
        return isinstance(m, nn.Upsample) and m.mode == "nearest"
    if node.op == "call_function" and node.target is F.interpolate:
        return node.kwargs.get("mode", node.args[3] if len(node.args) > 3 else "nearest") == "nearest"
    return False


def _only_moves_values(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_function":
        return node.target in _MOVING_FUNCTIONS or _is_nearest_upsample(node, modules)
    if node.op == "call_method":
        return node.target in _MOVING_METHODS
    if node.op == "call_module":
        return isinstance(modules.get(str(node.target)), _MOVING_MODULES) or _is_nearest_upsample(node, modules)
    return False


def reads_input_on_tensor_cores(module: nn.Module) -> bool:
    """Whether ``module`` is a fused conv or linear whose kernel reads its input operand on the tensor cores
    under "tf32" (the kernel routing of fuser.kernels.conv_choice: depthwise and direct convs multiply in
    float32 on the FMA units)."""
    if not isinstance(module, (FusedConv2d, FusedLinear)) or module.kernel_precision != Precision.TF32:
        return False
    if isinstance(module, FusedLinear):
        return True
    c_out, c_in_g, kh, kw = module.weight.shape
    g = module.geometry
    kernel = conv_kernel(c_in_g * g.groups, c_out, g.groups, (kh, kw), g.stride, g.padding)
    return kernel is not None and kernel.tensor_cores


def only_tf32_dots_read(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """True when every path from ``node``'s value ends as the input operand (argument 0, read once) of a
    fused module for which :func:`reads_input_on_tensor_cores` holds, through value-moving ops only."""
    seen: set[fx.Node] = set()
    stack = [node]
    reached_a_dot = False
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if not current.users:
            return False  # a value nobody reads is not a TF32 operand
        for user in current.users:
            if user.op == "output":
                return False
            module = modules.get(str(user.target)) if user.op == "call_module" else None
            if isinstance(module, (FusedConv2d, FusedLinear)):
                if user.args[0] is not current or current in user.args[1:] or current in user.kwargs.values():
                    return False  # read as a residual (or twice)
                if not reads_input_on_tensor_cores(module):
                    return False
                reached_a_dot = True
            elif _only_moves_values(user, modules):
                stack.append(user)
            else:
                return False
    return reached_a_dot


def mark_tf32_rounded_outputs(gm: fx.GraphModule) -> list[str]:
    """The graph pass: set ``epilogue.round_tf32`` on every fused module of ``gm`` running under "tf32" whose
    output only TF32 dots read (:func:`only_tf32_dots_read`), clear it on the others; returns the names of
    the modules whose flag changed (empty: nothing changed). Run after the chains are rewritten, before the
    concatenation buffers (which it reads as plain ``torch.cat``). A module called at several nodes is
    marked only if every call's output qualifies."""
    modules = dict(gm.named_modules())
    wanted: dict[str, bool] = {}
    for node in gm.graph.nodes:
        module = modules.get(str(node.target)) if node.op == "call_module" else None
        if isinstance(module, (FusedConv2d, FusedLinear)):
            name = str(node.target)
            ok = module.kernel_precision == Precision.TF32 and only_tf32_dots_read(node, modules)
            wanted[name] = wanted.get(name, True) and ok
    changed = []
    for name, flag in wanted.items():
        module = modules[name]
        if module.epilogue.round_tf32 != flag:
            module.set_epilogue(replace(module.epilogue, round_tf32=flag))
            changed.append(name)
    return changed
