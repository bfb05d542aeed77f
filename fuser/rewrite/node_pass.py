"""What the per-node rewrite passes share: walking the graph with one table of its modules, and finishing.

A pass (channel_mean, input_scale, virtual_cat) is a reader ``read(node, modules)`` that says what a node
offers (None: nothing) and a body that rewrites it; :func:`candidates` walks the nodes,
:func:`replace_with_module` puts a fused module's call in a node's place, and :func:`finish`
drops what the rewrite left unused and keeps ``graph.lint()`` clean, only where something changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.fx as fx

from fuser.graph_ops import unused_name

T = TypeVar("T")


def candidates(gm: fx.GraphModule, read: Callable[[fx.Node, dict[str, Any]], T | None]) -> Iterator[tuple[fx.Node, T]]:
    """``(node, read(node, modules))`` for every node of ``gm`` (a snapshot: the body may erase nodes)
    whose reading is not None; ``modules`` is ``gm``'s submodule table, read once."""
    modules = dict(gm.named_modules())
    for node in list(gm.graph.nodes):
        found = read(node, modules)
        if found is not None:
            yield node, found


def finish(gm: fx.GraphModule, changed: bool) -> None:
    """After a pass: where it changed ``gm``, drop the submodules nothing calls, lint and recompile."""
    if changed:
        gm.delete_all_unused_submodules()
        gm.graph.lint()
        gm.recompile()


def replace_with_module(gm: fx.GraphModule, node: fx.Node, stem: str, module: Any, args: tuple[Any, ...]) -> fx.Node:
    """Make ``node`` a call of ``module`` (added to ``gm`` under a free name starting with ``stem``) on ``args``:
    the call takes the node's place, metadata and users, and the node is erased."""
    name = unused_name(gm, stem)
    gm.add_submodule(name, module)
    with gm.graph.inserting_before(node):
        fused = gm.graph.call_module(name, args)
    fused.meta = dict(node.meta)
    node.replace_all_uses_with(fused)
    gm.graph.erase_node(node)
    return fused
