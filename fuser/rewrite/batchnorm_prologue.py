"""BatchNorms no chain folds, folded into the fused conv or linear that reads them.

A chain folds a BatchNorm into the conv or linear *before* it. A pre-activation network puts it *after* a
concatenation instead: each DenseNet layer is ``cat -> BN -> ReLU -> 1x1 conv``, each transition
``BN -> ReLU -> 1x1 conv -> pool``, and LeViT's head is ``mean -> BatchNorm1d -> Linear``. No weight can
absorb a BatchNorm whose activation comes before the conv, but the conv's kernel can apply it:
:func:`fold_batch_norms_forward`, run after the chains are rewritten, makes ``x -> BN -> act -> fused conv``
the fused conv of ``x`` with the affine + activation operand prologue (``act(x * s + t)`` per input channel
as it loads ``x``, the padding zeros those of the activated tensor: fuser.kernels.tiles), so neither the BN
nor the activation is written. A BatchNorm read directly by an unpadded ungrouped conv or by a linear layer
(BatchNorm1d on ``[N, C]``) goes into that layer's weights instead (``W' = W * s`` along its input,
``b' = b + W t``: exact, in float64), and one read directly by any other fused conv takes the prologue with
no activation.

A BatchNorm qualifies when it is in eval mode with constant statistics, its only user is the activation (one
without a parameter) or the layer, the activation's only user is the layer, which reads it as its input and
is called nowhere else, and the conv's kernel has the operand prologue (all but the direct kernel of the RGB
stem) and no other prologue (a channel scale). Every other eval BatchNorm still in the graph is reported with
the reason (kind ``batch_norm_kept``), such as DenseNet's last ``BN -> ReLU -> pool``. The torch reference,
the custom op and ONNX export (a Mul and an Add, then the activation, before the Conv) compute the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fuser.activations import Activation, spec
from fuser.graph_ops import BN_ARGS, BN_DEFAULTS, OpInfo, bind, read_activation
from fuser.kernels.conv_choice import ConvKernel, conv_kernel
from fuser.kernels.precision import Precision
from fuser.lower.fused_modules import FusedConv2d, FusedLinear
from fuser.match.chain import Chain, describe_node
from fuser.match.guards import first_failure
from fuser.match.patterns import FUSED_LINEAR, LONE_CONV, ChainPattern
from fuser.report import BATCH_NORM_INTO_WEIGHTS, BATCH_NORM_KEPT, BATCH_NORM_PROLOGUE, GraphRewrite
from fuser.rewrite.batchnorm_fold import BatchNormParams, batchnorm_scale_shift, fold_batchnorm_before
from fuser.rewrite.cat_buffers import cat_buffer
from fuser.rewrite.chains import batchnorm_params, build_fused_module, delete_unread_tensors, rewrite_chains
from fuser.rewrite.node_pass import candidates, finish

# A conv or linear that no chain fused, fused alone so that it can take the BatchNorm before it (the matcher
# fuses such a conv already, unless a guard refuses it; asking again gives the reason).
_LONE = {
    F.conv2d: LONE_CONV,
    F.linear: ChainPattern("gemm", ("linear",), FUSED_LINEAR),
}


@dataclass(frozen=True)
class _Fold:
    """A BatchNorm ``bn`` (constants ``params``), its activation node (None: the layer reads the BN), and the
    ``layer`` node: a fused module's call, or a lone conv or linear that ``lone`` fuses first;
    ``into_weights``: folded into the layer's weights rather than its prologue."""

    bn: fx.Node
    params: BatchNormParams
    act_node: fx.Node | None
    act: Activation
    layer: fx.Node
    into_weights: bool
    lone: Chain | None = None


def _rank(node: fx.Node) -> int | None:
    meta = node.meta.get("tensor_meta")
    return len(meta.shape) if hasattr(meta, "shape") else None


def _eval_batch_norm(node: fx.Node, gm: fx.GraphModule) -> tuple[fx.Node, BatchNormParams] | None:
    """``(input, constants)`` of an eval BatchNorm: a canonical F.batch_norm, or a BatchNorm1d module (which
    canonicalization leaves to the linear -> BN chains); None for every other node."""
    if node.op == "call_function" and node.target is F.batch_norm:
        args = bind(node, BN_ARGS, BN_DEFAULTS)
        return None if args["training"] else (args["input"], batchnorm_params(node, gm))
    if node.op == "call_module" and len(node.args) == 1 and not node.kwargs:
        module = gm.get_submodule(str(node.target))
        if type(module) in (nn.BatchNorm1d, nn.BatchNorm2d) and not module.training:
            return node.args[0], batchnorm_params(node, gm)
    return None


def _layer_reason(fold: _Fold, module: Any, gm: fx.GraphModule) -> str | None:
    """Why the fused ``module`` at ``fold.layer`` cannot take the BatchNorm (None: it can)."""
    layer, read = fold.layer, fold.act_node or fold.bn
    if layer.args[:1] != (read,) or read in layer.args[1:] or read in layer.kwargs.values():
        return f"{describe_node(layer)} reads it other than as its input"
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == layer.target]
    if len(calls) > 1:
        return f"the fused layer of {describe_node(layer)} is called at {len(calls)} places"
    if isinstance(module, FusedLinear):
        if fold.act_node is not None:
            return f"an activation lies between it and the linear {describe_node(layer)}: a GEMM has no affine prologue"
        if _rank(fold.bn) != 2:
            return "a BatchNorm before a linear folds only on [N, C] inputs (the linear reads the last dim)"
        return None
    if "input_scale" in layer.kwargs or "cat_with" in layer.kwargs or module.input_affine is not None:
        return f"the conv {describe_node(layer)} already transforms its input as it loads it"
    if _rank(fold.bn) != 4:
        return "the conv's input is not known to be 4-D (optimize without example inputs?)"
    if fold.into_weights:
        return None
    c_out, c_in_g, kh, kw = module.weight.shape
    groups = module.groups
    kernel = conv_kernel(c_in_g * groups, c_out, groups, (kh, kw), module.stride, module.padding)
    if kernel in (None, ConvKernel.DIRECT):
        where = kernel.value if kernel else "torch reference"
        return f"the conv {describe_node(layer)} runs on the {where}, which has no operand prologue"
    return None


def _shape_readers(node: fx.Node) -> list[fx.Node]:
    """The users of ``node`` that read only its shape, dtype and device: the concatenation buffer that
    fuser.rewrite.cat_buffers allocates from a fused conv's input (any tensor of that shape will do)."""
    return [u for u in node.users if u.op == "call_function" and u.target is cat_buffer]


def _only_user(node: fx.Node) -> fx.Node | str:
    shape_readers = _shape_readers(node)
    users = [u for u in node.users if u not in shape_readers]
    if len(users) == 1:
        return users[0]
    names = ", ".join(f"`{u.name}`" for u in users) or "none: it is an output"
    return f"the output of {describe_node(node)} has {len(users)} users ({names}): no one layer can absorb it"


def _fused_layer(layer: fx.Node, gm: fx.GraphModule, precision: Precision, backend: str) -> tuple[Any, Chain | None]:
    """The fused module that ``layer`` calls, or the one a lone conv or linear would become (with the chain
    that fuses it), or ``(reason, None)`` where it is neither or a guard refuses the lone layer."""
    if layer.op == "call_module":
        module = gm.get_submodule(str(layer.target))
        if isinstance(module, (FusedConv2d, FusedLinear)):
            return module, None
    pattern = _LONE.get(layer.target) if layer.op == "call_function" else None
    if pattern is None:
        return f"{describe_node(layer)}, not a conv or linear that could absorb it", None
    chain = Chain(pattern, [layer], [OpInfo(pattern.steps[0], layer.args[0])])
    refused = first_failure(chain, gm)
    if refused is not None:
        return f"{describe_node(layer)}, which is not fused: {refused}", None
    return build_fused_module(chain, gm, precision, backend), chain


def _read(node: fx.Node, gm: fx.GraphModule, precision: Precision, backend: str) -> _Fold | str | None:
    """For an eval BatchNorm ``node``: the fold, or why there is none; None for every other node."""
    found = _eval_batch_norm(node, gm)
    if found is None:
        return None
    params = found[1]
    if params.running_mean is None or params.running_var is None:
        return "its statistics are not constants"
    layer = _only_user(node)
    if isinstance(layer, str):
        return layer
    act_node, act = None, Activation.NONE
    activation = read_activation(layer)
    if activation is not None:
        act_node, act = layer, activation[0]
        if spec(act).alpha_arg is not None:
            return f"its activation {act.name.lower()} has a parameter, which the operand prologue does not take"
        layer = _only_user(act_node)
        if isinstance(layer, str):
            return layer
    module, lone = _fused_layer(layer, gm, precision, backend)
    if isinstance(module, str):
        what = "it" if act_node is None else f"its activation {describe_node(act_node)}"
        return f"{what} feeds {module}"
    into_weights = act_node is None and (
        isinstance(module, FusedLinear) or (module.groups == 1 and not any(module.padding))
    )
    fold = _Fold(node, params, act_node, act, layer, into_weights, lone)
    reason = _layer_reason(fold, module, gm)
    return fold if reason is None else reason


def _apply(fold: _Fold, gm: fx.GraphModule, precision: Precision, backend: str) -> GraphRewrite:
    """Fuse a lone layer, rewire it to read the BatchNorm's input, fold the constants into it, and erase the
    BatchNorm and its activation."""
    bn, layer = fold.bn, fold.layer
    if fold.lone is not None:
        (name,) = rewrite_chains(gm, [fold.lone], precision, backend)
        layer = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == name)
    module = gm.get_submodule(str(layer.target))
    source = _eval_batch_norm(bn, gm)[0]  # type: ignore[index]
    for node in [n for n in (bn, fold.act_node) if n is not None]:
        for reader in [layer, *_shape_readers(node)]:
            reader.replace_input_with(node, source)  # the layer, and the buffers sized by what it reads
    if fold.into_weights:
        module.set_weights(*fold_batchnorm_before(module.weight, module.bias, fold.params))
        kind, what = BATCH_NORM_INTO_WEIGHTS, f"folded into the weights of {describe_node(layer)}"
    else:
        scale, shift = batchnorm_scale_shift(fold.params)
        module.set_input_affine(torch.stack([scale, shift], 1), fold.act)
        act = "" if fold.act_node is None else f" -> {fold.act.name.lower()}"
        kind, what = BATCH_NORM_PROLOGUE, f"BatchNorm{act} applied as {describe_node(layer)} loads its input"
    if fold.lone is not None:
        what += f" (the lone {fold.lone.pattern.steps[0]} `{fold.lone.head.name}`, fused for it)"
    eliminated = [bn.name] + ([] if fold.act_node is None else [fold.act_node.name])
    for node in (fold.act_node, bn):
        if node is not None:
            gm.graph.erase_node(node)
    source = str(bn.meta.get("source_module") or bn.name)
    return GraphRewrite(kind, source, f"{describe_node(bn)}: {what}", eliminated)


def fold_batch_norms_forward(gm: fx.GraphModule, precision: Precision, backend: str) -> list[GraphRewrite]:
    """Fold every qualifying eval BatchNorm into the fused layer after it (see the module docstring); a lone
    layer that takes one becomes a fused module of ``precision`` and ``backend``. Returns what was folded
    (kinds in fuser.report's ``BATCH_NORM_FOLDS``) and every eval BatchNorm left, with the reason (kind
    ``batch_norm_kept``, nothing eliminated); ``gm`` is changed only where something was folded."""
    found: list[GraphRewrite] = []
    for node, fold in candidates(gm, lambda n, _: _read(n, gm, precision, backend)):
        if isinstance(fold, str):
            source = str(node.meta.get("source_module") or node.name)
            found.append(GraphRewrite(BATCH_NORM_KEPT, source, f"{describe_node(node)} kept: {fold}", []))
            continue
        found.append(_apply(fold, gm, precision, backend))
    changed = any(r.eliminated for r in found)
    if changed:
        for node in list(gm.graph.nodes):
            if node.op == "get_attr" and not node.users:
                gm.graph.erase_node(node)
        delete_unread_tensors(gm)
    finish(gm, changed)
    return found
