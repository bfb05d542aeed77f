"""The guards every fusion must pass. A guard returns None, or the reason in plain words.

Guards are data too: an ordered list, checked in order, the first failure being the reason the report
gives. A chain that fails stays unfused (and correct); a shorter pattern may still fuse part of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fuser.graph_ops import (
    BN_ARGS,
    BN_DEFAULTS,
    CONV_ARGS,
    CONV_DEFAULTS,
    LINEAR_ARGS,
    LINEAR_DEFAULTS,
    MUL_TARGETS,
    bind,
    cat_operands,
    classify,
    constant_tensor,
    read_activation,
    unsupported_successor,
)
from fuser.lower.backends import KERNEL_DTYPES
from fuser.match.chain import Chain, describe_node, value_users


@dataclass(frozen=True)
class Guard:
    name: str
    check: Callable[[Chain, fx.GraphModule], str | None]


def _module(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    if node.op != "call_module":
        return None
    return dict(gm.named_modules()).get(str(node.target))


def conv_form(chain: Chain, gm: fx.GraphModule) -> str | None:
    head = chain.head
    if chain.infos[0].kind != "conv2d":
        return None
    module = _module(gm, head)
    if module is not None:
        if getattr(module, "padding_mode", "zeros") != "zeros":
            return f"conv {describe_node(head)} uses padding_mode={module.padding_mode!r}; only zero padding is fused"
        return f"conv {describe_node(head)} is a {type(module).__name__} that was not converted to a plain conv2d"
    args = bind(head, CONV_ARGS, CONV_DEFAULTS)
    for name in ("stride", "padding", "dilation", "groups"):
        value = args[name]
        values = value if isinstance(value, (tuple, list)) else [value]
        if any(isinstance(v, fx.Node) for v in values):
            return f"conv {describe_node(head)} has a {name} computed at run time"
    return None


def batchnorm_eval(chain: Chain, gm: fx.GraphModule) -> str | None:
    found = chain.step("batch_norm")
    if found is None:
        return None
    bn, _ = found
    reason = _statistics_reason(bn, gm)
    if reason is not None:
        return reason
    module = _module(gm, bn)
    if module is not None:
        if chain.infos[0].kind != "linear" or type(module) is not nn.BatchNorm1d:
            return f"{type(module).__name__} {describe_node(bn)} is not folded into a 2-D conv"
        return _normalizes_the_features(chain, bn)
    return _normalizes_the_features(chain, bn) if chain.infos[0].kind == "linear" else None


def _statistics_reason(bn: fx.Node, gm: fx.GraphModule) -> str | None:
    """Why the BatchNorm ``bn`` (a module call or a canonical F.batch_norm) does not normalize with constant
    running statistics, or None when it does (it is in eval mode and can be folded somewhere)."""
    module = _module(gm, bn)
    if module is not None:
        if module.training:
            return (
                f"BatchNorm {describe_node(bn)} is in training mode: it normalizes with the batch's statistics, "
                "so it cannot be folded (call model.eval() first)"
            )
        if getattr(module, "running_mean", None) is None:
            return f"BatchNorm {describe_node(bn)} has no running statistics (track_running_stats=False)"
        return None
    args = bind(bn, BN_ARGS, BN_DEFAULTS)
    if args["training"] is not False:
        if isinstance(args["training"], fx.Node):
            return f"BatchNorm {describe_node(bn)} decides training mode at run time"
        return f"BatchNorm {describe_node(bn)} runs with training=True: batch statistics cannot be folded"
    if constant_tensor(gm, args["running_mean"]) is None or constant_tensor(gm, args["running_var"]) is None:
        return f"BatchNorm {describe_node(bn)} has no constant running statistics"
    return None


def _normalizes_the_features(chain: Chain, bn: fx.Node) -> str | None:
    """A BN after a linear folds into it only on a 2-D [rows, features] value: on 3-D input BatchNorm
    normalizes dimension 1, which is not the linear's output features."""
    meta = chain.head.meta.get("tensor_meta")
    if meta is None:
        return f"BatchNorm {describe_node(bn)} after a linear: its input's rank is unknown without example inputs"
    if len(meta.shape) != 2:
        return (
            f"BatchNorm {describe_node(bn)} normalizes dimension 1 of a {len(meta.shape)}-D value, not the "
            f"features of the linear {describe_node(chain.head)} before it"
        )
    return None


def constant_parameters(chain: Chain, gm: fx.GraphModule) -> str | None:
    head = chain.head
    kind = chain.infos[0].kind
    if kind == "conv2d":
        args, rank = bind(head, CONV_ARGS, CONV_DEFAULTS), 4
    else:
        args, rank = bind(head, LINEAR_ARGS, LINEAR_DEFAULTS), 2
    weight = constant_tensor(gm, args["weight"])
    if weight is None:
        what = args["weight"].name if isinstance(args["weight"], fx.Node) else repr(args["weight"])
        return f"{kind} {describe_node(head)} has a weight computed at run time ({what}), not a constant of the model"
    if weight.dim() != rank:
        return f"{kind} {describe_node(head)} has a {weight.dim()}-D weight; expected {rank}-D"
    if args["bias"] is not None and constant_tensor(gm, args["bias"]) is None:
        return f"{kind} {describe_node(head)} has a bias computed at run time, not a constant of the model"
    found = chain.step("batch_norm")
    if found is not None:
        bn_args = bind(found[0], BN_ARGS, BN_DEFAULTS)
        for name in ("weight", "bias"):
            if bn_args[name] is not None and constant_tensor(gm, bn_args[name]) is None:
                return f"BatchNorm {describe_node(found[0])} has a {name} computed at run time"
    return None


def data_flow(chain: Chain, gm: fx.GraphModule) -> str | None:
    if not isinstance(chain.infos[0].data, fx.Node):
        return f"{describe_node(chain.head)} has no tensor input"
    for i in range(1, len(chain.nodes)):
        previous, node, info = chain.nodes[i - 1], chain.nodes[i], chain.infos[i]
        if info.kind == "add":
            if previous not in (info.data, info.other):
                return f"{describe_node(node)} does not add the chain's value"
            if info.data is info.other:
                return f"{describe_node(node)} adds the chain's value to itself"
            if chain.residual in chain.nodes:
                return f"the residual of {describe_node(node)} comes from inside the chain"
        elif info.data is not previous:
            return f"{describe_node(previous)} feeds {describe_node(node)} through an argument other than its input"
    return None


def single_user(chain: Chain, gm: fx.GraphModule) -> str | None:
    for node in chain.nodes[:-1]:
        users = value_users(node)
        if len(users) != 1:
            names = ", ".join(f"`{u.name}`" for u in users)
            return f"the output of {describe_node(node)} has {len(users)} users ({names}), so it must be stored"
    readers = chain.metadata_readers
    residual = chain.residual
    if readers and residual is not None:
        # The fused node replaces the interior values for their metadata readers, so it must come before
        # the first of them, and its residual before it; and the add must provably keep the shape.
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        node, first = min(readers, key=lambda pair: order[pair[1]])
        if order[residual] > order[first]:
            return (
                f"{describe_node(first)} reads the metadata of {describe_node(node)} before the residual "
                f"{describe_node(residual)} is computed"
            )
        if residual.meta.get("tensor_meta") is None:
            return (
                f"{describe_node(first)} reads the metadata of {describe_node(node)}, and without example inputs "
                "the residual add may change it"
            )
    return None


def _tensors(chain: Chain, gm: fx.GraphModule) -> list[torch.Tensor]:
    tensors = []
    for node in chain.nodes:
        for arg in (*node.args, *node.kwargs.values()):
            t = constant_tensor(gm, arg)
            if t is not None:
                tensors.append(t)
    return tensors


def dtypes_and_devices(chain: Chain, gm: fx.GraphModule) -> str | None:
    tensors = _tensors(chain, gm)
    for t in tensors:
        if not t.is_floating_point():
            return f"{describe_node(chain.head)} has a {t.dtype} parameter; only floating-point chains are fused"
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        return f"the parameters of {describe_node(chain.head)}'s chain are on different devices ({names})"
    meta = chain.infos[0].data.meta.get("tensor_meta")
    weight = tensors[0] if tensors else None
    if meta is not None and weight is not None and meta.dtype != weight.dtype:
        return f"{describe_node(chain.head)} gets a {meta.dtype} input but has {weight.dtype} weights"
    return None


def residual_shape(chain: Chain, gm: fx.GraphModule) -> str | None:
    found = chain.step("add")
    if found is None:
        return None
    add = found[0]
    value = chain.nodes[chain.nodes.index(add) - 1]
    out_meta, res_meta = value.meta.get("tensor_meta"), chain.residual.meta.get("tensor_meta")
    if out_meta is None or res_meta is None:
        return None  # shapes unknown without example inputs: the fused op broadcasts at run time
    try:
        shape = torch.broadcast_shapes(out_meta.shape, res_meta.shape)
    except RuntimeError:
        shape = None
    if shape != out_meta.shape:
        return (
            f"{describe_node(add)} adds a {tuple(res_meta.shape)} tensor to the chain's {tuple(out_meta.shape)} "
            "value, which changes its shape"
        )
    if res_meta.dtype != out_meta.dtype:
        return (
            f"{describe_node(add)} adds a {res_meta.dtype} residual to a {out_meta.dtype} value: "
            "the add would promote the result's dtype"
        )
    return None


def _kind(node: Any, modules: dict[str, nn.Module]) -> str | None:
    info = classify(node, modules) if isinstance(node, fx.Node) else None
    return None if info is None else info.kind


def _feeds_fused_conv_input(node: Any, gm: fx.GraphModule, modules: dict[str, nn.Module]) -> bool:
    """Whether ``node``, a conv's input, is what a pass after the chains folds into a fused conv's operand
    load: a concatenation (fuser.rewrite.virtual_cat), a product (fuser.rewrite.input_scale), or an eval
    BatchNorm that no conv or linear before it absorbs, or an activation of one
    (fuser.rewrite.batchnorm_prologue)."""
    if not isinstance(node, fx.Node):
        return False
    if cat_operands(node) is not None:
        return True
    product = node.op == "call_function" and node.target in MUL_TARGETS
    if product or (node.op == "call_method" and node.target == "mul"):
        return True
    if read_activation(node) is not None and node.args:
        node = node.args[0]
    if _kind(node, modules) != "batch_norm" or _statistics_reason(node, gm) is not None:
        return False
    return _kind(node.args[0], modules) not in ("conv2d", "linear")  # else a chain folds it there


def _lone_conv_gain(chain: Chain, has_bias: bool, gm: fx.GraphModule) -> str | None:
    head, modules = chain.head, dict(gm.named_modules())
    users = value_users(head)
    bn = next((u for u in users if _kind(u, modules) == "batch_norm"), None)
    if bn is not None:  # the conv -> BN chain was refused, and that refusal is the reason the report gives
        return f"conv {describe_node(head)} feeds BatchNorm {describe_node(bn)}, which is not folded into it"
    if has_bias or _feeds_fused_conv_input(chain.infos[0].data, gm, modules) or any(cat_operands(u) for u in users):
        return None
    after = unsupported_successor(head, modules)
    return (
        f"conv {describe_node(head)} has no bias, activation or residual add to fuse"
        + (f" (it is followed by {after}, which no epilogue implements)" if after else "")
        + ", and no concatenation, channel scale or BatchNorm beside it that a fused conv would take: "
        "it stays a PyTorch conv"
    )


def conv_gain(chain: Chain, gm: fx.GraphModule) -> str | None:
    """A conv with no BatchNorm or activation to fold in (the lone conv, conv -> + residual) is fused only in
    a dtype the kernels take (a float64 model's fused module would run the same PyTorch conv); a lone conv
    not where it feeds a BatchNorm that its chain could not fold (training mode, say: the conv stays with its
    BatchNorm), and without bias only where a later pass needs it fused: cuDNN runs a bare conv as fast."""
    if chain.infos[0].kind != "conv2d" or chain.step("batch_norm") is not None or chain.step("act") is not None:
        return None
    args = bind(chain.head, CONV_ARGS, CONV_DEFAULTS)
    weight = constant_tensor(gm, args["weight"])
    if weight.dtype not in KERNEL_DTYPES:
        return (
            f"conv {describe_node(chain.head)} has {weight.dtype} weights, which no fused kernel takes: "
            "it stays as it is"
        )
    if chain.step("add") is not None:
        return None  # the add goes into the epilogue
    return _lone_conv_gain(chain, args["bias"] is not None, gm)


# Checked in order; the first failure is the reason given.
GUARDS: list[Guard] = [
    # the conv is a plain zero-padded conv2d with static attributes
    Guard("conv_form", conv_form),
    # BN is in eval mode with running statistics (never fold a BN that uses batch statistics)
    Guard("batchnorm_eval", batchnorm_eval),
    # weights, biases and BN parameters are constants of the model
    Guard("constant_parameters", constant_parameters),
    # the value flows through each op's data input; the residual comes from outside the chain
    Guard("data_flow", data_flow),
    # every interior value has exactly one user besides metadata reads (else it must be stored anyway)
    Guard("single_user", single_user),
    # floating point, one device, input dtype equal to the weight dtype
    Guard("dtypes_and_devices", dtypes_and_devices),
    # the residual neither broadcasts the output to a larger shape nor promotes its dtype
    Guard("residual_shape", residual_shape),
    # a conv with nothing but its bias and a residual to fuse: a kernel runs it, and it gains something
    Guard("conv_gain", conv_gain),
]


def first_failure(chain: Chain, gm: fx.GraphModule, guards: list[Guard] | None = None) -> str | None:
    """The reason the first failing guard gives, or None when the chain can be fused."""
    for guard in GUARDS if guards is None else guards:
        reason = guard.check(chain, gm)
        if reason is not None:
            return reason
    return None
