"""An independent count of fusable chains, read from torch.fx graphs rather than from the module tree.

The models count their chains from the modules they built (``fuser.models.common``); this walks the
traced data flow instead, so the two can disagree. Like a fusion library, it traces the largest
submodules that trace (recursing into the children of any that does not) and applies the rule of
``fusable_chain_heads`` to each graph:

- a Conv2d whose only user is a BatchNorm2d;
- a Conv2d with bias, whatever its users (an activation after it, or nothing fusable: its bias is the
  epilogue);
- a Linear whose only user is an activation or an add.
"""

from __future__ import annotations

import operator

import torch
from torch import fx, nn

from fuser.activations import module_activation, read_call_form

ADDS = {operator.add, operator.iadd, torch.add}


def traced_units(module: nn.Module, path: str = "") -> tuple[list[tuple[str, fx.GraphModule]], list[str]]:
    """(path, graph) for the largest submodules of ``module`` that trace, and the paths that did not."""
    try:
        return [(path, fx.symbolic_trace(module))], []
    except Exception:
        units: list[tuple[str, fx.GraphModule]] = []
        failed = [path]
        for name, child in module.named_children():
            child_units, child_failed = traced_units(child, f"{path}{name}.")
            units += child_units
            failed += child_failed
        return units, failed


def _is_activation(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """An activation of fuser.activations' table, read by the table's readers of its one-call forms."""
    if node.op == "call_module":
        return module_activation(modules[node.target]) is not None
    if node.op in ("call_function", "call_method"):
        return read_call_form(node.op, node.target, node.args, node.kwargs) is not None
    return False


def chain_heads_in_graph(gm: fx.GraphModule, prefix: str = "") -> list[str]:
    """Qualified names (``prefix`` + target) of the Conv2d / Linear modules that start a chain."""
    modules = dict(gm.named_modules())
    heads = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = modules[node.target]
        users = list(node.users)
        only = users[0] if len(users) == 1 else None
        if isinstance(module, nn.Conv2d):
            feeds_bn = only is not None and only.op == "call_module"
            feeds_bn = feeds_bn and isinstance(modules[only.target], nn.BatchNorm2d)
            if feeds_bn or module.bias is not None:
                heads.append(prefix + node.target)
        elif isinstance(module, nn.Linear) and only is not None:
            feeds_add = only.op == "call_function" and only.target in ADDS
            if _is_activation(only, modules) or feeds_add:
                heads.append(prefix + node.target)
    return heads


def chain_heads_by_tracing(model: nn.Module) -> list[str]:
    """Every chain head of ``model``, found in the graphs of its largest traceable submodules."""
    units, _ = traced_units(model)
    return [head for path, gm in units for head in chain_heads_in_graph(gm, path)]
