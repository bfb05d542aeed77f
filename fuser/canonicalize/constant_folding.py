"""Canonicalization of computations on parameters and buffers alone: each is computed once, at optimize time.

A weight computed from parameters in every forward (timm's ``ScaledStdConv2d`` and ``StdConv2d`` standardize
theirs with ``F.batch_norm(weight.reshape(1, C, -1), None, None, training=True)``; a weight-norm
parametrization computes ``g * v / ||v||``) hides the conv's weight behind a chain of ops, so the conv matches
no pattern, and the chain runs again at each call. Folding the chain leaves a ``get_attr`` of its value: the
conv then fuses as any other, and the parameters it was computed from are dropped.

A node is constant when it is a ``get_attr`` of a tensor that the graph never changes in place, or a pure call
(a function or tensor method: nothing random, nothing in place, no ``out=``) of constant nodes and plain
values. Each constant computation is folded at its last op, and only when its value is a tensor no larger
than the parameters and buffers it frees: a gather that expands a table (LeViT's attention biases), or a
slice of a tensor that other ops still read, stays in the graph rather than growing the model.

This is a pass over the whole graph, not a rule of the driver: a node's constness depends on its whole
ancestry, which one pass in graph order settles for every node at once.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from fuser.canonicalize.driver import erase_if_dead
from fuser.graph_ops import fetch_attr, unused_name

# Ops that draw random numbers: never folded, whatever their inputs (nor ops with "dropout" or "empty" in their
# names: dropouts, and memory left uninitialized).
_RANDOM = frozenset(
    {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal", "bernoulli",
     "multinomial", "poisson"}
)  # fmt: skip
# Functions that write into one of their inputs (the in-place operator forms).
_IN_PLACE_OPERATORS = frozenset(
    {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ipow}
)
_BATCH_NORMS = frozenset({F.batch_norm, torch.batch_norm})


def _name(target: Any) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def _writes_in_place(node: fx.Node) -> bool:
    """Whether ``node`` may change one of its inputs: an in-place method or function (``add_``,
    ``x[i] = v``, ``F.relu(x, inplace=True)``), an ``out=`` tensor, or a batch norm that updates running
    statistics."""
    if node.op not in ("call_function", "call_method"):
        return node.op == "call_module"  # a module may update its own buffers from its input
    name = _name(node.target)
    if (name.endswith("_") and not name.endswith("__")) or node.target in _IN_PLACE_OPERATORS:
        return True
    if node.kwargs.get("out") is not None or node.kwargs.get("inplace") is True:  # fx records out=None defaults
        return True
    if node.target in _BATCH_NORMS:
        running = [*node.args[1:3], node.kwargs.get("running_mean"), node.kwargs.get("running_var")]
        return any(isinstance(r, fx.Node) for r in running)
    return False


def _is_pure(node: fx.Node) -> bool:
    if node.op not in ("call_function", "call_method"):
        return False
    name = _name(node.target).lower()
    return not _writes_in_place(node) and name not in _RANDOM and "dropout" not in name and "empty" not in name


def _written_targets(gm: fx.GraphModule) -> set[str]:
    """The tensors some node of ``gm`` writes into, through any ``get_attr`` of them. A write through a view
    (``w.t().mul_(2)``) needs no check of its own: where the view is folded, the size rule has freed ``w``
    (nothing else reads it), so the write goes to the folded copy, the one tensor the graph then reads."""
    return {str(n.target) for n in gm.graph.nodes if n.op == "get_attr" and any(_writes_in_place(u) for u in n.users)}


def _constant_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose values depend on unchanging parameters and buffers alone, in one pass over the graph."""
    written = _written_targets(gm)
    constant: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            if str(node.target) not in written and isinstance(fetch_attr(gm, str(node.target)), torch.Tensor):
                constant.add(node)
        elif _is_pure(node) and all(n in constant for n in node.all_input_nodes):
            constant.add(node)
    return constant


def _evaluate(node: fx.Node, gm: fx.GraphModule, values: dict[fx.Node, Any]) -> Any:
    """The value of ``node``, whose ancestry is constant, computed from the module's tensors."""
    if node not in values:
        if node.op == "get_attr":
            values[node] = fetch_attr(gm, str(node.target))
        else:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: _evaluate(n, gm, values))
            if node.op == "call_method":
                values[node] = getattr(args[0], str(node.target))(*args[1:], **kwargs)
            else:
                values[node] = node.target(*args, **kwargs)
    return values[node]


def _freed_elements(node: fx.Node, ancestry: list[fx.Node], gm: fx.GraphModule) -> int:
    """The elements of the parameters and buffers that nothing reads once ``node`` is folded: those whose every
    read is in ``node``'s ancestry (``ancestry``: users before their inputs) with only dead users."""
    dead = {node}
    for n in ancestry:
        if all(u in dead for u in n.users):
            dead.add(n)
    freed = 0
    for target in {str(n.target) for n in dead if n.op == "get_attr"}:
        if all(r in dead for r in gm.graph.nodes if r.op == "get_attr" and r.target == target):
            freed += fetch_attr(gm, target).numel()
    return freed


def _persistent(gm: fx.GraphModule, target: str) -> bool:
    """Whether the tensor at ``target`` is in the state dict (a parameter, or a buffer not registered with
    ``persistent=False``)."""
    owner, _, name = target.rpartition(".")
    return name not in gm.get_submodule(owner)._non_persistent_buffers_set


def fold_constants(gm: fx.GraphModule) -> int:
    """Replace each computation on parameters and buffers alone by a ``get_attr`` of its value; returns how many
    were folded. Each is folded at its last op (the one whose users read other values too), and only where the
    tensors it frees hold at least as many elements as its value. A value computed from a tensor the model keeps
    out of its state dict (EVA-02's zero ``k_bias`` in ``cat((q_bias, k_bias, v_bias))``) stays out of it too.
    The graph is linted and recompiled when anything changed."""
    constant = _constant_nodes(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    last_ops = [n for n in constant if n.op != "get_attr" and any(u not in constant for u in n.users)]
    folded = 0
    for node in sorted(last_ops, key=order.__getitem__):
        values: dict[fx.Node, Any] = {}
        try:
            with torch.no_grad():
                value = _evaluate(node, gm, values)
        except Exception:  # what cannot be computed here runs as the model wrote it
            continue
        ancestry = sorted(set(values) - {node}, key=lambda n: -order[n])
        tensors = [n for n in ancestry if n.op == "get_attr"]
        if not tensors or not isinstance(value, torch.Tensor) or value.numel() > _freed_elements(node, ancestry, gm):
            continue  # made from nothing (torch.arange(5)), not a tensor, or larger than what it frees
        largest = max(tensors, key=lambda n: values[n].numel())
        name = unused_name(gm, str(largest.target).replace(".", "_") + "_folded")
        persistent = all(_persistent(gm, str(n.target)) for n in tensors)
        gm.register_buffer(name, value.detach().clone(memory_format=torch.contiguous_format), persistent=persistent)
        with gm.graph.inserting_before(node):
            replacement = gm.graph.get_attr(name)
        replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        gm.graph.erase_node(node)
        erase_if_dead(*ancestry)
        folded += 1
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded
