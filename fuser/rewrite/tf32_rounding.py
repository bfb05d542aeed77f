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

Where a dot's input is not stored rounded (it comes from an add, a mul, a mean, the network's input...),
the tensor cores still truncate it. Its average loss, ``TRUNCATION_BIAS`` (about 3.5e-4 of the magnitude),
is then made up in the weights, per input channel, at packing time (:func:`compensate_truncated_inputs`):
what is left is a zero-mean error of the size rounding leaves. On EfficientNet-B0 and MobileNetV3, whose
1x1 convs mostly read the products of the squeeze-excitation gates and the sums of residual adds, that is
what brings the model-level error from 18x and 4x cuDNN's to cuDNN's (fuser.lower.tf32_emulation measures it).
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fuser.graph_ops import MAX_POOL_FUNCTIONS
from fuser.kernels.conv_choice import conv_kernel
from fuser.kernels.precision import TRUNCATION_GAIN, Precision
from fuser.lower.fused_modules import FusedConv2d, FusedLinear
from fuser.rewrite.cat_buffers import cat_buffer, cat_result
from fuser.rewrite.max_pool import FusedMaxPool2d
from fuser.rewrite.pool_pyramid import FusedPoolPyramid

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
    cat_result,  # torch.cat(parts, 1) once fuser.rewrite.cat_buffers has run
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
_MOVING_MODULES = (nn.MaxPool2d, nn.Identity, nn.Flatten, FusedPoolPyramid, FusedMaxPool2d)
_CHANNEL_SPLITS = {"chunk", "split", torch.chunk, torch.split}


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
            if user.target is cat_buffer:
                continue  # reads only the shape and device
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


# ---------------------------------------------------------------------------------------------------------
# Inputs that reach the tensor cores unrounded: their truncation's mean is made up in the weights

Rounded = bool | torch.Tensor  # one answer for every channel, or one per channel


def _channels(node: fx.Node) -> int | None:
    meta = node.meta.get("tensor_meta")
    shape = getattr(meta, "shape", None)
    return int(shape[1]) if shape is not None and len(shape) == 4 else None


def _per_channel(node: fx.Node, rounded: Rounded) -> torch.Tensor | None:
    if isinstance(rounded, torch.Tensor):
        return rounded
    c = _channels(node)
    return None if c is None else torch.full((c,), rounded)


def _dim_arg(node: fx.Node, position: int) -> Any:
    """The ``dim`` argument of a cat (``position`` 1) or a chunk / split (2); 0 where it is not given."""
    return node.kwargs.get("dim", node.args[position] if len(node.args) > position else 0)


def _stored_rounded(node: Any, modules: dict[str, nn.Module]) -> Rounded:
    """Whether ``node``'s value was stored rounded to TF32: True or False for all of it, or a bool per
    channel (a channel concatenation of rounded and unrounded parts). Walks back through the ops that
    only move values; anything else made new, unrounded values."""
    if not isinstance(node, fx.Node):
        return False
    module = modules.get(str(node.target)) if node.op == "call_module" else None
    if isinstance(module, (FusedConv2d, FusedLinear)):
        return module.epilogue.round_tf32 and module.kernel_precision == Precision.TF32
    if isinstance(module, FusedPoolPyramid):
        inner = _stored_rounded(node.args[0], modules)
        return inner if isinstance(inner, bool) or module.dim != 1 else inner.repeat(len(module.radii))
    if node.op == "call_function" and node.target in (torch.cat, torch.concat, cat_result):
        inputs = node.args[1] if node.target is cat_result else node.args[0]
        parts = [_stored_rounded(p, modules) for p in inputs]
        if all(isinstance(p, bool) for p in parts) and len(set(parts)) == 1:
            return parts[0]
        if node.target is not cat_result and _dim_arg(node, 1) not in (1, -3):
            return False
        per = [_per_channel(n, p) for n, p in zip(inputs, parts, strict=True)]
        return False if any(p is None for p in per) else torch.cat(per)
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        split = node.args[0]
        if split.target in _CHANNEL_SPLITS and isinstance(node.args[1], int):
            source = _stored_rounded(split.args[0], modules)
            if isinstance(source, bool):
                return source
            if _dim_arg(split, 2) not in (1, -3):
                return False
            how = torch.chunk if split.target in ("chunk", torch.chunk) else torch.split
            size = split.args[1] if len(split.args) > 1 else next(v for k, v in split.kwargs.items() if k != "dim")
            return how(source, size)[node.args[1]]
    if not _only_moves_values(node, modules) or not node.args:
        return False
    source = _stored_rounded(node.args[0], modules)
    if isinstance(source, bool) or _keeps_channels(node, modules):
        return source
    return False  # a view that moves channels around: compensated all through


def _keeps_channels(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """Whether a value-moving op keeps each channel where it was (pools, nearest upsampling, copies)."""
    if node.op == "call_function":
        return node.target in MAX_POOL_FUNCTIONS or _is_nearest_upsample(node, modules)
    if node.op == "call_method":
        return node.target == "contiguous"
    module = modules.get(str(node.target))
    return isinstance(module, (nn.MaxPool2d, nn.Identity, FusedMaxPool2d)) or _is_nearest_upsample(node, modules)


def compensate_truncated_inputs(gm: fx.GraphModule) -> list[str]:
    """The graph pass after :func:`mark_tf32_rounded_outputs`: give every fused module of ``gm`` whose kernel
    reads its input on the tensor cores under "tf32" the input gain (``set_tf32_input_gain``) that makes up
    truncation's mean: TRUNCATION_GAIN for the input channels not stored rounded, 1 for the others (None
    where all are). Returns the names of the modules whose gain changed."""
    modules = dict(gm.named_modules())
    gains: dict[str, torch.Tensor | None] = {}
    for node in gm.graph.nodes:
        module = modules.get(str(node.target)) if node.op == "call_module" else None
        if module is None or not reads_input_on_tensor_cores(module):
            continue
        channels = module.weight.shape[1] * (module.groups if isinstance(module, FusedConv2d) else 1)
        rounded = _stored_rounded(node.args[0], modules)
        if isinstance(rounded, torch.Tensor) and (isinstance(module, FusedLinear) or rounded.numel() != channels):
            rounded = bool(rounded.all())
        mask = rounded if isinstance(rounded, torch.Tensor) else torch.full((channels,), rounded)
        gain = None if mask.all() else torch.where(mask, 1.0, TRUNCATION_GAIN).to(torch.float32)
        name = str(node.target)
        if gains.get(name) is not None:  # one module called at several nodes: every channel any call truncates
            gain = gains[name] if gain is None else torch.maximum(gains[name], gain)
        gains[name] = gain
    changed = []
    for name, gain in gains.items():
        module = modules[name]
        current = module.tf32_input_gain
        if (current is None) != (gain is None) or (gain is not None and not torch.equal(current, gain)):
            module.set_tf32_input_gain(gain)
            changed.append(name)
    return changed
