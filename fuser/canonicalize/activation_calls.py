"""Activations written as one call (a module, a function or a method, in place or not) become the canonical
call of their row of fuser.activations; in-place arithmetic on a fresh value becomes out of place, so the
written-out forms (``x.add_(3.).clamp_(0., 6.).div_(6.)``) read as plain trees."""

from __future__ import annotations

import operator

import torch.fx as fx

from fuser.activations import module_activation, read_call_form, spec
from fuser.canonicalize.driver import Context, Rule, make_out_of_place, replace
from fuser.graph_ops import read_activation
from fuser.match.tree_patterns import is_number


def rule_activation_one_call(node: fx.Node, ctx: Context) -> bool:
    if node.op == "call_module":
        module = ctx.modules.get(str(node.target))
        found = module_activation(module) if module is not None else None
        if found is None:
            return False
        act, alpha = found
        inplace = bool(getattr(module, "inplace", False))
    elif node.op in ("call_function", "call_method"):
        if read_activation(node) is not None:
            return False  # already canonical
        found3 = read_call_form(node.op, node.target, node.args, node.kwargs)
        if found3 is None:
            return False
        act, alpha, inplace = found3
    else:
        return False
    x = node.args[0] if node.args else node.kwargs.get("input")
    if not isinstance(x, fx.Node):
        return False
    target, args, kwargs = spec(act).canonical_call(x, alpha)
    if inplace:
        return make_out_of_place(node, x, target, args, kwargs, ctx)
    replace(node, target, args, kwargs)
    return True


_IN_PLACE_ARITHMETIC = {"add_": operator.add, "sub_": operator.sub, "mul_": operator.mul, "div_": operator.truediv}


def rule_in_place_arithmetic(node: fx.Node, ctx: Context) -> bool:
    """x.add_(3.), x.mul_(c), ... with a Python number, on a fresh x -> x + 3., x * c (later readers follow).

    Only number operands: with one, the result has x's dtype and shape either way, so nothing else changes.
    """
    if node.op != "call_method" or node.target not in _IN_PLACE_ARITHMETIC or node.kwargs or len(node.args) != 2:
        return False
    x, other = node.args
    if not isinstance(x, fx.Node) or not is_number(other):
        return False
    return make_out_of_place(node, x, _IN_PLACE_ARITHMETIC[node.target], (x, other), {}, ctx)


RULES: list[Rule] = [
    # nn.SiLU(), F.relu(x, inplace=True), x.relu_(), F.hardtanh(x, 0, 6), x.clamp(0, 6), ... -> canonical call
    Rule("activation_call", "any one-call activation form -> its canonical call", rule_activation_one_call),
    # timm's hard_sigmoid(inplace=True): x.add_(3.).clamp_(0., 6.).div_(6.)
    Rule("in_place_arithmetic", "x.add_(c), mul_, ... on a fresh x -> out of place", rule_in_place_arithmetic),
]
