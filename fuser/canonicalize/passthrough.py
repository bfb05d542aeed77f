"""Canonicalization of ops that pass their value through: they vanish (or move aside) before matching.

An ``nn.Identity``, a dropout that does not drop (eval mode, ``training=False``, ``p=0``) and the flatten /
unflatten pair a GPT-2 ``Conv1D`` writes around its GEMM compute nothing, but each sits between two ops
of a chain (BERT's ``dense -> dropout -> + residual``, timm's ``BatchNormAct2d`` with its
``drop = nn.Identity()`` before the activation) and stops the match; so does the flatten timm's LeViT
puts between a linear and its BatchNorm1d, which can move before the linear. Each rule rewrites one such
op and says whether it did; the rules run first in fuser.canonicalize's list, so the other rules see the
graph without them.

The rules only read ``ctx.gm`` and ``ctx.modules`` of the canonicalizer's context.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fuser.canonicalize.driver import Context, Rule
from fuser.graph_ops import bind, constant_tensor

# The functional dropouts, with their signatures' defaults for p and training.
_DROPOUT_FUNCTIONS: dict[Any, dict[str, Any]] = {
    F.dropout: {"p": 0.5, "training": True},
    F.dropout1d: {"p": 0.5, "training": True},
    F.dropout2d: {"p": 0.5, "training": True},
    F.dropout3d: {"p": 0.5, "training": True},
    F.alpha_dropout: {"p": 0.5, "training": False},
    F.feature_alpha_dropout: {"p": 0.5, "training": False},
    torch.dropout: {},
    torch.alpha_dropout: {},
    torch.feature_dropout: {},
    torch.feature_alpha_dropout: {},
}
_DROPOUT_ARGS = ("input", "p", "training", "inplace")
_TORCH_DROPOUT_ARGS = ("input", "p", "train")


def _bypass(node: fx.Node, value: Any) -> bool:
    """Make every user of ``node`` read ``value`` instead, and erase ``node``."""
    if not isinstance(value, fx.Node):
        return False
    node.replace_all_uses_with(value)
    node.graph.erase_node(node)
    return True


def rule_identity_module(node: fx.Node, ctx: Context) -> bool:
    """``nn.Identity()(x)`` is ``x``."""
    if node.op != "call_module" or type(ctx.modules.get(str(node.target))) is not nn.Identity or not node.args:
        return False
    return _bypass(node, node.args[0])


def _drops_nothing(p: Any, training: Any) -> bool:
    return training is False or (isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0)


def rule_inactive_dropout(node: fx.Node, ctx: Context) -> bool:
    """A dropout module in eval mode, or a dropout call with ``training=False`` or ``p=0``, is its input."""
    if node.op == "call_module":
        module = ctx.modules.get(str(node.target))
        if not isinstance(module, nn.modules.dropout._DropoutNd) or len(node.args) != 1 or node.kwargs:
            return False
        return _drops_nothing(module.p, module.training) and _bypass(node, node.args[0])
    if node.op != "call_function" or node.target not in _DROPOUT_FUNCTIONS:
        return False
    defaults = _DROPOUT_FUNCTIONS[node.target]
    if defaults:
        args = bind(node, _DROPOUT_ARGS, defaults)
        p, training = args["p"], args["training"]
    else:
        args = bind(node, _TORCH_DROPOUT_ARGS, {})
        p, training = args.get("p"), args.get("train")
    return _drops_nothing(p, training) and _bypass(node, args.get("input"))


def _is_stochastic_depth(target: Any) -> bool:
    """torchvision.ops.stochastic_depth, recognized without importing torchvision (torchvision marks it
    ``torch.fx.wrap``, so a traced graph calls it as a leaf function)."""
    return getattr(target, "__name__", None) == "stochastic_depth" and str(
        getattr(target, "__module__", "")
    ).startswith("torchvision.ops")


def rule_inactive_stochastic_depth(node: fx.Node, ctx: Context) -> bool:
    """torchvision's ``stochastic_depth(x, p, mode, training=False)`` (or ``p=0``) is ``x``: in eval mode
    the residual branch of EfficientNet's MBConv reaches its ``+ x`` through it, which kept the add out of
    the projection conv's epilogue."""
    if node.op != "call_function" or not _is_stochastic_depth(node.target):
        return False
    args = bind(node, ("input", "p", "mode", "training"), {"training": True})
    return _drops_nothing(args.get("p"), args.get("training")) and _bypass(node, args.get("input"))


def _is_method(node: Any, names: tuple[str, ...]) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target in names


def _is_size_of(node: Any, x: fx.Node, dim: int | None) -> bool:
    """True when ``node`` is ``x.size()`` / ``x.shape`` (dim None) or ``x.size(dim)``."""
    if not isinstance(node, fx.Node):
        return False
    if dim is None and node.op == "call_function" and node.target is getattr:
        return node.args == (x, "shape")
    if not _is_method(node, ("size",)) or node.args[:1] != (x,):
        return False
    given = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    return given == dim


def _is_leading_dims_plus(node: Any, x: fx.Node, n: int) -> bool:
    """True when ``node`` is ``x.size()[:-1] + (n,)`` (GPT-2's ``size_out``)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.add):
        return False
    lead, tail = node.args if len(node.args) == 2 else (None, None)
    if not isinstance(tail, (tuple, list)) or tuple(tail) != (n,):
        return False
    return (
        isinstance(lead, fx.Node)
        and lead.op == "call_function"
        and lead.target is operator.getitem
        and lead.args[1] == slice(None, -1, None)
        and _is_size_of(lead.args[0], x, None)
    )


def rule_flattened_linear(node: fx.Node, ctx: Context) -> bool:
    """``linear(x.view(-1, K), W, b).view(x.size()[:-1] + (N,))`` is ``linear(x, W, b)``: a linear layer
    maps the last dimension and keeps the leading ones, so the flatten and the unflatten cancel."""
    if not _is_method(node, ("view", "reshape")) or len(node.args) != 2 or node.kwargs:
        return False
    linear = node.args[0]
    if not (isinstance(linear, fx.Node) and linear.op == "call_function" and linear.target is F.linear):
        return False
    if len(linear.users) != 1 or not linear.args:
        return False
    weight = constant_tensor(ctx.gm, bind(linear, ("input", "weight", "bias"), {"bias": None})["weight"])
    flat = linear.args[0]
    if weight is None or weight.dim() != 2 or not _is_method(flat, ("view", "reshape")) or flat.kwargs:
        return False
    if len(flat.args) != 3 or flat.args[1] != -1 or not isinstance(flat.args[0], fx.Node):
        return False
    x, k = flat.args[0], flat.args[2]
    if not (k == weight.shape[1] or _is_size_of(k, x, -1)):
        return False
    if not _is_leading_dims_plus(node.args[1], x, weight.shape[0]):
        return False
    linear.args = (x, *linear.args[1:])
    if "tensor_meta" in node.meta:
        linear.meta["tensor_meta"] = node.meta["tensor_meta"]
    size_out = node.args[1]
    node.replace_all_uses_with(linear)
    node.graph.erase_node(node)
    _erase_dead(flat, k, size_out)
    return True


_BATCH_NORM_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")


def _token_batch_norm_input(bn: Any, ctx: Context) -> fx.Node | None:
    """The input of ``bn`` when it is a BatchNorm1d over features: an ``nn.BatchNorm1d`` call, or an eval-mode
    ``F.batch_norm`` (what an ONNX import writes); else None."""
    if not isinstance(bn, fx.Node) or len(bn.users) != 1:
        return None
    if bn.op == "call_module" and len(bn.args) == 1 and not bn.kwargs:
        return bn.args[0] if type(ctx.modules.get(str(bn.target))) is nn.BatchNorm1d else None
    if bn.op == "call_function" and bn.target is F.batch_norm:
        args = bind(bn, _BATCH_NORM_ARGS, {"training": False})
        return args["input"] if args.get("training") is False else None
    return None


def _is_token_flatten(node: Any) -> bool:
    """``v.flatten(0, 1)`` or ``torch.flatten(v, 0, 1)``, read by one node."""
    if not isinstance(node, fx.Node) or node.kwargs or len(node.users) != 1 or tuple(node.args[1:]) != (0, 1):
        return False
    return _is_method(node, ("flatten",)) or (node.op == "call_function" and node.target is torch.flatten)


def _restores_shape_of(node: fx.Node, v: fx.Node, bn: fx.Node) -> list[fx.Node] | None:
    """The ``v.size(d)`` reads of ``node`` when it gives ``bn`` the shape of the 3-D ``v`` back: ``bn.reshape_as(v)``
    (timm's form, none), or ``torch.reshape(bn, (v.size(0), v.size(1), n))`` / ``bn.reshape(...)`` / ``bn.view(...)``
    with ``n`` the features, -1 or ``v.size(2)`` (an ONNX import's form, the reads, each read by nothing else);
    else None."""
    if _is_method(node, ("reshape_as",)) and node.args == (bn, v) and not node.kwargs:
        return []
    is_reshape = _is_method(node, ("reshape", "view")) or (node.op == "call_function" and node.target is torch.reshape)
    if not is_reshape or node.kwargs or len(node.args) != 2 or node.args[0] is not bn:
        return None
    shape, meta = node.args[1], v.meta.get("tensor_meta")
    if not isinstance(shape, (tuple, list)) or len(shape) != 3 or meta is None or len(meta.shape) != 3:
        return None
    if not (_is_size_of(shape[0], v, 0) and _is_size_of(shape[1], v, 1)):
        return None
    reads = [shape[0], shape[1]] + ([shape[2]] if _is_size_of(shape[2], v, 2) else [])
    if any(len(read.users) != 1 for read in reads) or not (len(reads) == 3 or shape[2] in (-1, meta.shape[2])):
        return None
    return reads


def rule_batchnorm_over_flattened_tokens(node: fx.Node, ctx: Context) -> bool:
    """``bn(v.flatten(0, 1)).reshape_as(v)`` with ``v = linear(x)`` 3-D and ``bn`` a BatchNorm1d (timm LeViT's
    LinearNorm; from ONNX, a functional batch norm and a reshape to ``v``'s sizes) becomes
    ``bn(linear(x.flatten(0, 1))).reshape(x.shape[:-1] + (N,))``: the same values, the flatten moved before the
    linear (it merges leading dimensions only), so the BN directly follows the linear on a 2-D value and the
    matcher can fold it."""
    if node.op not in ("call_method", "call_function") or not node.args:
        return False
    bn = node.args[0]
    flat = _token_batch_norm_input(bn, ctx)
    if not _is_token_flatten(flat):
        return False
    v = flat.args[0]
    if not (isinstance(v, fx.Node) and v.op == "call_function" and v.target is F.linear):
        return False
    size_reads = _restores_shape_of(node, v, bn)
    if size_reads is None or set(v.users) != {flat, *size_reads, *([node] if not size_reads else [])}:
        return False
    meta = v.meta.get("tensor_meta")
    weight = constant_tensor(ctx.gm, bind(v, ("input", "weight", "bias"), {"bias": None})["weight"])
    if meta is None or len(meta.shape) != 3 or weight is None or not isinstance(v.args[0], fx.Node):
        return False
    graph, x = node.graph, v.args[0]
    _merge_before_linear(flat, v)
    with graph.inserting_before(node):
        shape = graph.call_function(getattr, (x, "shape"))
        lead = graph.call_function(operator.getitem, (shape, slice(None, -1, None)))
        size = graph.call_function(operator.add, (lead, (int(weight.shape[0]),)))
        out = graph.call_method("reshape", (bn, size))
    out.meta = dict(node.meta)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    _erase_dead(*size_reads)
    return True


def rule_token_reshape_before_linear(node: fx.Node, ctx: Context) -> bool:
    """``bn(linear(x).reshape(-1, N))`` -> ``bn(linear(x.reshape(-1, K)))``: merging the leading dimensions of a
    linear's output merges them in its input, so the BatchNorm1d over features directly follows the linear and
    folds into it. torch.onnx's dynamo exporter writes timm LeViT's LinearNorm this way (a MatMul, a Reshape to
    ``(-1, N)``, the BatchNormalization, a Reshape to whatever comes next)."""
    is_reshape = _is_method(node, ("reshape", "view")) or (node.op == "call_function" and node.target is torch.reshape)
    if not is_reshape or node.kwargs or len(node.args) != 2 or len(node.users) != 1:
        return False
    v, shape = node.args
    if not (isinstance(v, fx.Node) and v.op == "call_function" and v.target is F.linear and len(v.users) == 1):
        return False
    weight = constant_tensor(ctx.gm, bind(v, ("input", "weight", "bias"), {"bias": None})["weight"])
    if weight is None or weight.dim() != 2 or not isinstance(v.args[0], fx.Node):
        return False
    if not isinstance(shape, (tuple, list)) or len(shape) != 2 or tuple(shape) != (-1, weight.shape[0]):
        return False
    if _token_batch_norm_input(next(iter(node.users)), ctx) is not node:
        return False
    _merge_before_linear(node, v)
    return True


def _merge_before_linear(merge: fx.Node, v: fx.Node) -> None:
    """Replace ``merge``, the linear ``v``'s output with its leading dimensions merged into one, by ``v`` computed
    from its input merged the same way (``torch.flatten(x, 0, -2)``): a linear maps the last dimension only."""
    with v.graph.inserting_before(v):
        flat_x = v.graph.call_function(torch.flatten, (v.args[0], 0, -2))
    v.args = (flat_x, *v.args[1:])
    v.meta.pop("tensor_meta", None)  # v's shape is now merge's: known where merge's is, else not at all
    if "tensor_meta" in merge.meta:
        v.meta["tensor_meta"] = merge.meta["tensor_meta"]
    merge.replace_all_uses_with(v)
    v.graph.erase_node(merge)


def _erase_dead(*nodes: Any) -> None:
    """Erase the given nodes, and what only they read, once nothing reads them."""
    pending, erased = [n for n in nodes if isinstance(n, fx.Node)], set()
    while pending:
        n = pending.pop()
        if n not in erased and not n.users and n.op in ("call_function", "call_method"):
            pending += n.all_input_nodes
            n.graph.erase_node(n)
            erased.add(n)


# fuser.canonicalize runs these before the other families.
RULES: list[Rule] = [
    Rule("identity", "nn.Identity()(x) -> x", rule_identity_module),
    Rule("inactive_dropout", "eval-mode dropout, dropout(training=False) or p=0 -> x", rule_inactive_dropout),
    Rule(
        "inactive_stochastic_depth",
        "torchvision stochastic_depth(training=False) or p=0 -> x",
        rule_inactive_stochastic_depth,
    ),
    Rule("flattened_linear", "linear(x.view(-1, K)).view(x.size()[:-1] + (N,)) -> linear(x)", rule_flattened_linear),
    Rule(
        "batchnorm_over_flattened_tokens",
        "bn1d(linear(x).flatten(0, 1)).reshape_as(linear(x)) -> bn1d(linear(x.flatten(0, 1))).reshape(...)",
        rule_batchnorm_over_flattened_tokens,
    ),
    Rule(
        "token_reshape_before_linear",
        "bn1d(linear(x).reshape(-1, N)) -> bn1d(linear(x.reshape(-1, K)))",
        rule_token_reshape_before_linear,
    ),
]
