"""Rewriting: each accepted chain becomes one call of a fused module with its folded parameters.

The fused module is registered on the graph module under a name derived from the chain's source module
(``fused_layer1_0_conv1``), called where the chain's last node was, with the chain's input and, if any, the
residual. The chain's nodes are erased, then the parameters and submodules nothing reads any more. The
folded tensors are new: the tensors the graph module shared with the user's model are only read.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx as fx

from fuser.graph_ops import BN_ARGS, BN_DEFAULTS, bind, constant_tensor, unused_name
from fuser.kernels.precision import Precision
from fuser.lower.fused_modules import FusedConv2d, FusedLinear
from fuser.lower.ops import conv_padding
from fuser.match.chain import Chain, is_metadata_read
from fuser.match.patterns import FUSED_LINEAR
from fuser.rewrite.batchnorm_fold import BatchNormParams, fold_batchnorm


def _pair(value: int | tuple[int, ...] | list[int]) -> tuple[int, int]:
    if isinstance(value, int):
        return (value, value)
    values = tuple(int(v) for v in value)
    return (values[0], values[0]) if len(values) == 1 else (values[0], values[1])


# Folded (weight, bias) by the identity of the tensors they were folded from, so that chains reading the same
# layer and BatchNorm (a block called at several places: RetinaNet's head over the feature levels) share one
# folded copy rather than each holding its own. Without a BatchNorm a fused module holds the layer's own
# tensors, shared already (ALBERT's layers, one set for all its calls).
FoldedTensors = dict[tuple, tuple[torch.Tensor, torch.Tensor | None]]


def build_fused_module(
    chain: Chain, gm: fx.GraphModule, precision: Precision, backend: str, folded: FoldedTensors | None = None
) -> FusedConv2d | FusedLinear:
    """The fused module that computes ``chain`` (BN folded in float64; from ``folded`` where the same tensors were
    folded before, and added to it otherwise)."""
    builds = chain.pattern.builds
    if builds is None:
        raise ValueError(f"pattern {chain.pattern.name} {chain.pattern.steps} is report-only: it builds nothing")
    source = chain.modules[0] if chain.modules else chain.head.name
    linear = builds is FUSED_LINEAR
    args = bind(chain.head, builds.args, builds.defaults)
    weight = constant_tensor(gm, args["weight"])
    bias = constant_tensor(gm, args["bias"])
    found = chain.step("batch_norm")
    if found is not None:
        params = batchnorm_params(found[0], gm)
        sources = (weight, bias, params.running_mean, params.running_var, params.weight, params.bias)
        key = (*(None if t is None else id(t) for t in sources), params.eps)
        if folded is not None and key in folded:
            weight, bias = folded[key]
        else:
            weight, bias = fold_batchnorm(weight, bias, params)
            if folded is not None:
                folded[key] = (weight, bias)
    if linear:
        return FusedLinear(weight, bias, epilogue=chain.epilogue, precision=precision, backend=backend, source=source)
    dilation = _pair(args["dilation"])
    return FusedConv2d(
        weight,
        bias,
        stride=_pair(args["stride"]),
        padding=conv_padding(args["padding"], weight.shape[2:], dilation),
        dilation=dilation,
        groups=int(args["groups"]),
        epilogue=chain.epilogue,
        precision=precision,
        backend=backend,
        source=source,
    )


def batchnorm_params(node: fx.Node, gm: fx.GraphModule) -> BatchNormParams:
    """The constants of an eval BatchNorm: a canonical F.batch_norm call, or a BatchNorm1d module after a linear."""
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        return BatchNormParams(m.running_mean, m.running_var, m.weight, m.bias, float(m.eps))
    bn = bind(node, BN_ARGS, BN_DEFAULTS)
    return BatchNormParams(
        running_mean=constant_tensor(gm, bn["running_mean"]),
        running_var=constant_tensor(gm, bn["running_var"]),
        weight=constant_tensor(gm, bn["weight"]),
        bias=constant_tensor(gm, bn["bias"]),
        eps=float(bn["eps"]),
    )


def _free_name(gm: fx.GraphModule, source: str) -> str:
    stem = "fused_" + (re.sub(r"[^0-9a-zA-Z_]", "_", source).strip("_") or "chain")
    return unused_name(gm, stem)


def rewrite_chains(gm: fx.GraphModule, chains: list[Chain], precision: Precision, backend: str) -> list[str]:
    """Replace every chain by a call of its fused module; returns the new submodules' names.

    Returns an empty list when there was nothing to rewrite (and then leaves ``gm`` untouched).
    """
    if not chains:
        return []
    graph = gm.graph
    names = []
    folded: FoldedTensors = {}
    for chain in chains:
        module = build_fused_module(chain, gm, precision, backend, folded)
        head_args = bind(chain.head, chain.pattern.builds.args, chain.pattern.builds.defaults)
        name = _free_name(gm, module.source)
        gm.add_submodule(name, module)
        args = (chain.input,) if chain.residual is None else (chain.input, chain.residual)
        readers = chain.metadata_readers
        order = {n: i for i, n in enumerate(graph.nodes)} if readers else {}
        # Before the chain's last node, or before the first metadata read of an interior value (which then
        # reads the fused node: it has the same shape, dtype and device).
        where = min([chain.last, *(u for _, u in readers)], key=lambda n: order.get(n, 0))
        with graph.inserting_before(where):
            fused = graph.call_module(name, args)
        fused.meta = dict(chain.last.meta)
        fused.meta["fused_chain"] = " -> ".join(chain.ops)
        for interior, reader in readers:
            reader.replace_input_with(interior, fused)
        chain.last.replace_all_uses_with(fused)
        for node in reversed(chain.nodes):
            graph.erase_node(node)
        _move_metadata_reads(gm, head_args, name)
        names.append(name)
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    gm.delete_all_unused_submodules()
    delete_unread_tensors(gm)
    graph.lint()
    gm.recompile()
    return names


def _move_metadata_reads(gm: fx.GraphModule, head_args: dict[str, Any], name: str) -> None:
    """Point the reads of the chain's weight and bias that only ask for metadata (EdgeNeXt's positional
    encoding takes its device and dtype from ``token_projection.weight``) at the fused module's own: else they
    alone keep the original tensors in the model. Only where shape, dtype, device and layout are the same."""
    fused = gm.get_submodule(name)
    for role in ("weight", "bias"):
        old, new = constant_tensor(gm, head_args.get(role)), getattr(fused, role, None)
        if old is None or not isinstance(new, torch.Tensor):
            continue
        if (old.shape, old.dtype, old.device, old.layout) != (new.shape, new.dtype, new.device, new.layout):
            continue
        target = head_args[role].target
        for node in [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == target and n.users]:
            if all(is_metadata_read(u, node) for u in node.users):
                with gm.graph.inserting_before(node):
                    replacement = gm.graph.get_attr(f"{name}.{role}")
                node.replace_all_uses_with(replacement)
                gm.graph.erase_node(node)


def delete_unread_tensors(gm: fx.GraphModule) -> None:
    """Drop the parameters and buffers that no get_attr reads any more and no called submodule owns.

    That includes the graph module's attribute stubs (torch.fx keeps ``c_proj.weight`` as a parameter of an
    empty ``c_proj`` module): a canonical form may read a new tensor in place of one of them (addmm's weight,
    transposed for F.linear), and the one it replaced is dead weight.
    """
    read = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}

    def used(name: str) -> bool:
        prefixes = [name.rsplit(".", i)[0] for i in range(name.count(".") + 1)]
        return any(p in read for p in prefixes) or any(p in called for p in prefixes[1:])

    tensors = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
    for name in {n for n, _ in tensors if not used(n)}:
        owner, _, attr = name.rpartition(".")
        delattr(gm.get_submodule(owner), attr)
