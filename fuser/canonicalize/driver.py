"""The one driver of canonicalization: rules are data, applied node by node until none fires.

A :class:`Rule` is a name, a one-line description and a function that rewrites one node and says whether it
did. A tree-pattern rule (:func:`pattern_rule`) is the same thing made from a pattern of fuser.match.tree_patterns
and the call that replaces a match. :func:`run_rules` sweeps the graph in order, trying the rules on each
node, until a sweep changes nothing, so a rule never needs to know about the others; it returns how often
each rule fired. The helpers here are the only places that edit the graph.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fuser.graph_ops import ADD_TARGETS, CANONICAL_ACTIVATION, DIV_TARGETS, MUL_TARGETS
from fuser.match.tree_patterns import Match, Pattern, match


@dataclass
class Context:
    gm: fx.GraphModule
    modules: dict[str, nn.Module]
    order: dict[fx.Node, int]

    def refresh_order(self) -> None:
        self.order = {n: i for i, n in enumerate(self.gm.graph.nodes)}


@dataclass(frozen=True)
class Rule:
    name: str
    description: str
    apply: Callable[[fx.Node, Context], bool]


def run_rules(gm: fx.GraphModule, rules: list[Rule]) -> dict[str, int]:
    """Rewrite ``gm`` in place with ``rules`` until none applies; {rule name: times fired}, in firing order.

    The graph is linted and recompiled when anything changed.
    """
    ctx = Context(gm, dict(gm.named_modules()), {})
    ctx.refresh_order()
    fired: dict[str, int] = {}
    changed = True
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            if node.graph is not gm.graph or node not in ctx.order:
                continue  # erased by an earlier rewrite in this sweep
            for rule in rules:
                if rule.apply(node, ctx):
                    fired[rule.name] = fired.get(rule.name, 0) + 1
                    changed = True
                    ctx.refresh_order()
                    break
    if fired:
        gm.graph.lint()
        gm.recompile()
    return fired


# ---------------------------------------------------------------------------------------------------------
# Graph edits


def replace(node: fx.Node, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` before ``node``, move node's users and meta to it, erase node."""
    graph = node.graph
    with graph.inserting_before(node):
        new = graph.call_function(target, args, kwargs or {})
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


def erase_if_dead(*nodes: Any) -> None:
    """Erase those of ``nodes`` nobody uses any more (in the order given: users before their inputs)."""
    for n in nodes:
        if isinstance(n, fx.Node) and not n.users and n.op in ("call_function", "call_method", "get_attr"):
            n.graph.erase_node(n)


def get_attr(ctx: Context, before: fx.Node, target: str) -> fx.Node:
    with ctx.gm.graph.inserting_before(before):
        return ctx.gm.graph.get_attr(target)


def pattern_rule(
    name: str, description: str, pattern: Pattern, build: Callable[[Match], tuple[Any, tuple, dict]]
) -> Rule:
    """A rule that replaces the root of every match of ``pattern`` by the call ``build(match)`` returns and
    erases the matched nodes nothing else uses (a node another user still reads stays)."""

    def apply(node: fx.Node, ctx: Context) -> bool:
        found = match(pattern, node)
        if found is None:
            return False
        target, args, kwargs = build(found)
        replace(node, target, args, kwargs)
        pending = list(dict.fromkeys(found.nodes[1:]))
        while dead := [n for n in pending if not n.users]:
            erase_if_dead(*dead)
            pending = [n for n in pending if n not in dead]
        return True

    return Rule(name, description, apply)


# ---------------------------------------------------------------------------------------------------------
# In-place ops made out of place

# Producers whose output is a fresh tensor: an in-place op on it cannot be seen through another alias.
_FRESH_FUNCTIONS = {
    F.conv2d,
    F.batch_norm,
    F.linear,
    *ADD_TARGETS,
    *MUL_TARGETS,
    *DIV_TARGETS,
    operator.sub,
    torch.sub,
    torch.cat,
    *CANONICAL_ACTIVATION.values(),
}
_FRESH_METHODS = {"add", "sub", "mul", "div", "relu", "sigmoid", "tanh", "clamp", "clip"}
_FRESH_MODULES = (nn.Conv2d, nn.Linear, nn.modules.batchnorm._BatchNorm)


def is_fresh(node: fx.Node, ctx: Context) -> bool:
    if node.op == "call_function":
        return node.target in _FRESH_FUNCTIONS
    if node.op == "call_method":
        return node.target in _FRESH_METHODS
    if node.op == "call_module":
        return isinstance(ctx.modules.get(str(node.target)), _FRESH_MODULES)
    return False


def make_out_of_place(node: fx.Node, x: fx.Node, target: Any, args: tuple, kwargs: dict, ctx: Context) -> bool:
    """Rewrite an in-place op on ``x`` out of place; later readers of ``x`` read the new value instead.

    Refused (returns False) when ``x`` may share memory with another tensor (a view, an input, a
    parameter), or when an earlier user of ``x`` might be a view that sees the mutation.
    """
    if not is_fresh(x, ctx):
        return False
    here = ctx.order[node]
    earlier = [u for u in x.users if u is not node and ctx.order[u] < here]
    if any(not is_fresh(u, ctx) for u in earlier):
        return False
    later = [u for u in x.users if u is not node and ctx.order[u] > here]
    new = replace(node, target, args, kwargs)
    for u in later:
        u.replace_input_with(x, new)
    ctx.refresh_order()
    return True
