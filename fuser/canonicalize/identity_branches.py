"""A BatchNorm of a conv's input, summed with that conv's BatchNorm output, folds into the conv's branch.

RepVGG and MobileOne blocks (timm) sum several conv -> BN branches of one input ``x`` with an identity
branch ``BN(x)``. Per channel ``BN_id(x) = s_id * x + t_id``, and a conv with as many outputs as inputs,
stride 1 and "same" padding computes ``s_id * x`` when its kernel is ``s_id`` at the centre tap of
channel c's own input and zero elsewhere. So, with the branch's ``BN(y) = s * y + t``:

    BN(conv(x, W)) + BN_id(x) = BN'(conv(x, W')),   W' = W + (s_id / s) at the centre of channel c,
                                                     BN' = BN with its bias raised by t_id

in float64, cast back. The identity BatchNorm and its add vanish; the branch stays a conv -> BN chain for
the matcher, and its BN node names the folded module (``meta["folded_modules"]``) for the report. A
branch BN with a zero scale cannot take the identity (``s_id / s``): it is left as it is.

A branch whose BatchNorm is already folded into its conv (what torch.onnx's dynamo exporter writes, or a model
fused by hand) takes the identity directly: ``conv(x, W, b) + BN_id(x) = conv(x, W + s_id at the centre, b + t_id)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from fuser.canonicalize.driver import Context, Rule, erase_if_dead, get_attr
from fuser.graph_ops import (
    ADD_TARGETS,
    BN_ARGS,
    BN_DEFAULTS,
    CONV_ARGS,
    CONV_DEFAULTS,
    bind,
    constant_tensor,
    unused_name,
)
from fuser.match.chain import value_users
from fuser.rewrite.batchnorm_fold import BatchNormParams, fold_batchnorm


def _is_add(node: Any) -> bool:
    return (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.target in ADD_TARGETS
        and not node.kwargs
        and len(node.args) == 2
    )


def _eval_batch_norm(node: Any, ctx: Context) -> dict[str, Any] | None:
    """The constants of an eval-mode F.batch_norm node (float64 scale and shift per channel), or None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is F.batch_norm):
        return None
    args = bind(node, BN_ARGS, BN_DEFAULTS)
    mean, var = constant_tensor(ctx.gm, args.get("running_mean")), constant_tensor(ctx.gm, args.get("running_var"))
    if args["training"] or mean is None or var is None or "input" not in args:
        return None
    tensors = {k: constant_tensor(ctx.gm, args[k]) for k in ("weight", "bias")}
    if any(args[k] is not None and tensors[k] is None for k in tensors):
        return None
    params = BatchNormParams(mean, var, tensors["weight"], tensors["bias"], float(args["eps"]))
    # The BN as a 1x1 "conv" of weight one per channel, folded in float64: its scale and its shift.
    scale, shift = fold_batchnorm(torch.ones(mean.numel(), 1, dtype=torch.float64, device=mean.device), None, params)
    return {"input": args["input"], "scale": scale.reshape(-1), "shift": shift, "bias": tensors["bias"]}


def _sum_leaves(root: fx.Node) -> list[Any]:
    """The operands of a tree of adds (interior adds used only inside the tree)."""
    leaves = []
    for operand in root.args:
        inner = _is_add(operand) and len(operand.users) == 1
        leaves += _sum_leaves(operand) if inner else [operand]
    return leaves


def _same_size_conv(node: Any, x: fx.Node, channels: int, ctx: Context) -> torch.Tensor | None:
    """The weight of ``node`` when it is conv2d(x, W) with ``channels`` inputs and outputs, stride 1, odd
    kernels and padding that keeps the size (so its centre tap reads the same pixel of x); else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is F.conv2d):
        return None
    args = bind(node, CONV_ARGS, CONV_DEFAULTS)
    w = constant_tensor(ctx.gm, args.get("weight"))
    if args.get("input") is not x or w is None or w.dim() != 4 or w.shape[0] != channels:
        return None
    pair = lambda v: tuple(v) if isinstance(v, (tuple, list)) else (v, v)
    stride, dilation, groups = pair(args["stride"]), pair(args["dilation"]), args["groups"]
    kernel = tuple(w.shape[2:])
    if w.shape[1] * groups != channels or stride != (1, 1) or any(k % 2 == 0 for k in kernel):
        return None
    same = tuple(d * (k // 2) for d, k in zip(dilation, kernel, strict=True))
    if args["padding"] != "same" and pair(args["padding"]) != same:
        return None
    return w


def _register(ctx: Context, base: str, value: torch.Tensor) -> str:
    name = unused_name(ctx.gm, base.replace(".", "_"))
    ctx.gm.register_buffer(name, value)
    return name


def rule_identity_batch_norm_into_branch(node: fx.Node, ctx: Context) -> bool:
    """BN_id(x) added to BN(conv(x)) (same x, a same-size conv) -> BN'(conv(x, W')): see the module doc."""
    identity = _eval_batch_norm(node, ctx)
    users = list(node.users)
    if identity is None or len(users) != 1 or not _is_add(users[0]) or not isinstance(identity["input"], fx.Node):
        return False
    if not all(isinstance(a, fx.Node) for a in users[0].args):
        return False  # the add's other operand replaces it: a scalar cannot
    x, channels = identity["input"], identity["scale"].numel()
    root = users[0]
    while len(root.users) == 1 and _is_add(next(iter(root.users))):
        root = next(iter(root.users))
    for leaf in _sum_leaves(root):
        alone = isinstance(leaf, fx.Node) and leaf is not node and len(leaf.users) == 1
        w = _same_size_conv(leaf, x, channels, ctx) if alone else None
        constant, bias = _constant_bias(leaf, ctx) if w is not None else (False, None)
        if w is not None and constant:
            _fold_into_conv(ctx, node, identity, leaf, w, bias)
            return True
        branch = _eval_batch_norm(leaf, ctx) if alone else None
        if branch is None or branch["scale"].numel() != channels or not isinstance(branch["input"], fx.Node):
            continue
        conv = branch["input"]
        w = _same_size_conv(conv, x, channels, ctx)
        if w is None or value_users(conv) != [leaf] or not bool((branch["scale"] != 0).all()):
            continue
        _fold(ctx, node, identity, leaf, branch, conv, w)
        return True
    return False


def _constant_bias(conv: fx.Node, ctx: Context) -> tuple[bool, torch.Tensor | None]:
    """(whether the conv's bias is absent or a constant, that constant or None)."""
    bias = bind(conv, CONV_ARGS, CONV_DEFAULTS).get("bias")
    if bias is None:
        return True, None
    value = constant_tensor(ctx.gm, bias)
    return value is not None, value


def _with_identity_centre(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``w`` in float64 with ``scale[c]`` added at the centre tap of output channel c's own input channel."""
    centre = w.detach().to(torch.float64)
    c = torch.arange(w.shape[0], device=w.device)
    centre[c, c % w.shape[1], w.shape[2] // 2, w.shape[3] // 2] += scale.to(w.device)
    return centre


def _with_identity_shift(identity: dict, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``bias + t_id`` computed in float64 (an absent bias: zero), in the bias's dtype, else ``dtype``."""
    beta = identity["shift"] + (bias.detach().to(torch.float64) if bias is not None else 0.0)
    return beta.to(dtype if bias is None else bias.dtype)


def _rebind(node: fx.Node, names: tuple[str, ...], defaults: dict[str, Any], **changes: Any) -> None:
    """Make ``node`` call its target with ``changes`` to its arguments, every argument passed by position."""
    args = bind(node, names, defaults) | changes
    node.args, node.kwargs = tuple(args[k] for k in names), {}


def _fold_into_conv(
    ctx: Context, node: fx.Node, identity: dict, conv: fx.Node, w: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """BN_id(x) + conv(x, W, b) -> conv(x, W', b + t_id), W' with s_id at the centre tap: the form a branch takes
    once its own BatchNorm is folded (an ONNX export's constant folding, a model fused by hand)."""
    new_w = _register(ctx, f"{conv.name}_weight_with_identity", _with_identity_centre(w, identity["scale"]).to(w.dtype))
    new_b = _register(ctx, f"{conv.name}_bias_with_identity", _with_identity_shift(identity, bias, w.dtype))
    old = [a for a in (*conv.args, *conv.kwargs.values()) if isinstance(a, fx.Node)]
    _rebind(conv, CONV_ARGS, CONV_DEFAULTS, weight=get_attr(ctx, conv, new_w), bias=get_attr(ctx, conv, new_b))
    _drop_identity(ctx, node, conv, old)


def _fold(
    ctx: Context, node: fx.Node, identity: dict, leaf: fx.Node, branch: dict, conv: fx.Node, w: torch.Tensor
) -> None:
    centre = _with_identity_centre(w, identity["scale"] / branch["scale"])
    new_w = _register(ctx, f"{conv.name}_weight_with_identity", centre.to(w.dtype))
    new_b = _register(ctx, f"{leaf.name}_bias_with_identity", _with_identity_shift(identity, branch["bias"], w.dtype))
    old = [a for a in (*conv.args, *leaf.args, *leaf.kwargs.values()) if isinstance(a, fx.Node)]
    _rebind(conv, CONV_ARGS, CONV_DEFAULTS, weight=get_attr(ctx, conv, new_w))
    _rebind(leaf, BN_ARGS, BN_DEFAULTS, bias=get_attr(ctx, leaf, new_b))
    _drop_identity(ctx, node, leaf, old)


def _drop_identity(ctx: Context, node: fx.Node, keeper: fx.Node, old: list[fx.Node]) -> None:
    """Remove the identity BatchNorm ``node`` and its add, now that ``keeper`` computes it; ``keeper`` names the
    folded module for the report; ``old`` are the inputs the rewrite replaced, erased once dead."""
    keeper.meta["folded_modules"] = [
        *keeper.meta.get("folded_modules", []),
        str(node.meta.get("source_module") or node.name),
        *node.meta.get("folded_modules", []),
    ]
    add = next(iter(node.users))
    add.replace_all_uses_with(add.args[1] if add.args[0] is node else add.args[0])
    ctx.gm.graph.erase_node(add)
    identity_inputs = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
    ctx.gm.graph.erase_node(node)
    erase_if_dead(*identity_inputs, *old)
    ctx.refresh_order()


RULES: list[Rule] = [
    # add(BN_id(x), BN(conv(x, W))) -> BN'(conv(x, W')), add(BN_id(x), conv(x, W, b)) -> conv(x, W', b'):
    # W' takes BN_id's scale at its centre tap
    Rule(
        "identity_batch_norm",
        "BatchNorm of a conv's input added to the conv's (BN) output -> folded into that conv (and BN)",
        rule_identity_batch_norm_into_branch,
    ),
]
