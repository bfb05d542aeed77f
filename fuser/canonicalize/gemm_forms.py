"""GEMMs written other ways than F.linear (a matmul by a constant, addmm, linear plus a constant bias)
become one F.linear, the single GEMM form the matcher reads."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from fuser.canonicalize.driver import Context, Rule, erase_if_dead, get_attr, replace
from fuser.graph_ops import bind, constant_tensor, unused_name
from fuser.match.tree_patterns import OpFamily, Var, add, matches, op


def _register_constant(ctx: Context, base: str, value: torch.Tensor) -> str:
    """Register a new constant tensor on the graph module under a free name derived from ``base``."""
    name = unused_name(ctx.gm, base.replace(".", "_"))
    ctx.gm.register_buffer(name, value)
    return name


def _linear_by_constant(
    node: fx.Node, ctx: Context, x: fx.Node, w_node: fx.Node, w: torch.Tensor, bias: fx.Node | None
) -> bool:
    """Replace ``node`` (x times the constant ``w`` [K, N], plus ``bias``) by linear(x, W^T, bias), W^T a new
    buffer; ``w_node`` is erased when nothing else reads it."""
    name = _register_constant(ctx, f"{w_node.target}_t", w.detach().t().contiguous())
    replace(node, F.linear, (x, get_attr(ctx, node, name), bias))
    erase_if_dead(w_node)
    ctx.refresh_order()
    return True


def rule_matmul_constant_is_linear(node: fx.Node, ctx: Context) -> bool:
    """x @ W (W a constant [K, N]) becomes linear(x, W^T): one GEMM form for the matcher."""
    is_matmul = (node.op == "call_function" and node.target in (torch.matmul, operator.matmul, torch.mm)) or (
        node.op == "call_method" and node.target in ("matmul", "mm")
    )
    if not is_matmul or len(node.args) != 2 or node.kwargs:
        return False
    x, w_node = node.args
    w = constant_tensor(ctx.gm, w_node)
    if not isinstance(x, fx.Node) or w is None or w.dim() != 2:
        return False
    return _linear_by_constant(node, ctx, x, w_node, w, None)


def rule_addmm_is_linear(node: fx.Node, ctx: Context) -> bool:
    """addmm(b, x, W) with constant W [K, N] becomes linear(x, W^T, b)."""
    if not (node.op == "call_function" and node.target is torch.addmm and len(node.args) == 3 and not node.kwargs):
        return False
    b_node, x, w_node = node.args
    w = constant_tensor(ctx.gm, w_node)
    if not isinstance(x, fx.Node) or w is None or w.dim() != 2 or constant_tensor(ctx.gm, b_node) is None:
        return False
    return _linear_by_constant(node, ctx, x, w_node, w, b_node)


def _linear_without_bias(node: fx.Node, arity: int) -> tuple | None:
    args = bind(node, ("input", "weight", "bias"), {"bias": None})
    return (args["input"], args["weight"]) if args["bias"] is None and "input" in args else None


_LINEAR_NO_BIAS = OpFamily("linear", frozenset({F.linear}), arity=2, operands=_linear_without_bias)
# add is commutative: b + linear(x, W) matches too.
_LINEAR_PLUS_B = add(op(_LINEAR_NO_BIAS, Var("x"), Var("w")), Var("b"))


def rule_linear_plus_constant_is_bias(node: fx.Node, ctx: Context) -> bool:
    """linear(x, W) + b (b a constant of N elements along the last dim) becomes linear(x, W, b)."""
    for found in matches(_LINEAR_PLUS_B, node):
        lin, b_node = found.nodes[1], found["b"]
        bias, weight = constant_tensor(ctx.gm, b_node), constant_tensor(ctx.gm, found["w"])
        if bias is None or weight is None or len(lin.users) != 1:
            continue
        n = weight.shape[0]
        if bias.numel() != n or (bias.dim() > 0 and bias.shape[-1] != n) or bias.dtype != weight.dtype:
            continue
        target = str(b_node.target)
        if bias.dim() > 1:
            # A [1, ..., N] bias also broadcasts the output to its rank: fold it only when that changes nothing.
            if lin.meta.get("tensor_meta") is None or len(lin.meta["tensor_meta"].shape) < bias.dim():
                continue
            target = _register_constant(ctx, f"{target}_flat", bias.detach().reshape(n).clone())
        lin.args = (found["x"], found["w"], get_attr(ctx, lin, target))
        lin.kwargs = {}
        node.replace_all_uses_with(lin)
        ctx.gm.graph.erase_node(node)
        erase_if_dead(b_node)
        ctx.refresh_order()
        return True
    return False


RULES: list[Rule] = [
    # x @ W, torch.matmul(x, W), x.mm(W) with constant W -> F.linear(x, W^T)
    Rule("matmul_constant", "matmul by a constant matrix -> F.linear", rule_matmul_constant_is_linear),
    # torch.addmm(b, x, W) with constants b, W -> F.linear(x, W^T, b)
    Rule("addmm", "addmm with constant operands -> F.linear", rule_addmm_is_linear),
    # F.linear(x, W) + b with constant b over the last dim -> F.linear(x, W, b)
    Rule("linear_bias", "linear + constant bias -> linear with bias", rule_linear_plus_constant_is_bias),
]
