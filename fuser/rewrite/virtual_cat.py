"""Nearest upsampling and a concatenation read by the conv after them: nothing materialized.

YOLO's neck computes ``conv(cat([upsample_nearest(a, 2), b], 1))``: an upsampled copy of ``a`` and a
concatenated copy of both, written only for the next 1x1 conv (C2f's cv1) to read once. :func:`fuse_virtual_cats`,
run after the chains are rewritten (and before concatenation elimination, which would otherwise give the cat
a buffer), makes ``a`` and ``b`` the fused conv's inputs instead (``fused(a, ..., cat_with=b, upsample=2)``):
the implicit-GEMM gather reads channel blocks below ``C_a`` from ``a`` at ``(h // 2, w // 2)`` and the rest
from ``b`` (fuser.kernels.tiles.virtual_cat_pointers; 1x1 convs take that kernel too). The torch reference,
torch.compile's custom op and ONNX export (Resize, Concat, Conv) compute the concatenation itself.

A match needs: a fused conv (ungrouped, on a tensor-core kernel) whose input is a channel concatenation of
exactly ``[upsample(a), b]``, the upsample an ``nn.Upsample`` or ``F.interpolate`` with ``scale_factor=2``
and ``mode="nearest"``; the upsample read by nothing else, the cat by nothing but such convs (YOLOv5's C3
reads it with two, each then reads ``a`` and ``b``); the shapes known from the example
inputs, with ``C_a`` a multiple of ``VIRTUAL_CAT_ALIGN`` (each channel block then reads one source) and one
dtype. A concatenation that feeds a fused conv but misses one of these is reported with the reason (kind
``virtual_cat_kept``) and left to the other passes.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fuser.graph_ops import cat_operands
from fuser.kernels.conv import VIRTUAL_CAT_ALIGN
from fuser.kernels.conv_choice import ConvKernel, conv_kernel
from fuser.lower.fused_modules import FusedConv2d
from fuser.report import GraphRewrite
from fuser.rewrite.node_pass import candidates, finish

FACTOR = 2  # powers of two only: nearest's source index floor(dst / factor) is then exact in float
OTHER_USERS = "the concatenation or the upsample has other users"
DESCRIPTION = (
    "conv(cat([upsample_nearest(a, 2), b])): the conv reads a and b, nothing materialized (on the implicit GEMM's "
    "channel blocks, the kernel its chain's line names)"
)


def _upsample_input(node: Any, modules: dict[str, nn.Module]) -> fx.Node | str | None:
    """``a`` when ``node`` is a 2x nearest upsample of ``a``; a reason when it is another upsample; None
    when it is no upsample at all."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_module" and isinstance(modules.get(str(node.target)), nn.Upsample):
        m = modules[str(node.target)]
        if len(node.args) != 1 or node.kwargs:
            return "the upsample has extra arguments"
        x, size, factor, mode = node.args[0], m.size, m.scale_factor, m.mode
    elif node.op == "call_function" and node.target is F.interpolate:
        names = ("input", "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias")
        values = dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
        if any(values.get(k) not in (None, False) for k in ("align_corners", "recompute_scale_factor", "antialias")):
            return "the interpolation has arguments that change nearest sampling"
        x, size, factor, mode = values.get("input"), values.get("size"), values.get("scale_factor"), values.get("mode")
        mode = "nearest" if mode is None else mode
    else:
        return None
    factors = factor if isinstance(factor, (tuple, list)) else (factor, factor)
    if size is not None or mode != "nearest" or any(f != FACTOR for f in factors) or not isinstance(x, fx.Node):
        return f"the upsample is not nearest with scale_factor={FACTOR} (mode={mode!r}, scale_factor={factor!r})"
    return x


def _meta(node: fx.Node) -> Any:
    meta = node.meta.get("tensor_meta")
    return meta if hasattr(meta, "shape") else None


def _conv_refusal(conv_node: fx.Node, cat: fx.Node, modules: dict[str, Any]) -> str | None:
    """Why the user ``conv_node`` of ``cat`` cannot read it as a virtual input, or None when it can."""
    conv = modules.get(str(conv_node.target)) if conv_node.op == "call_module" else None
    if not isinstance(conv, FusedConv2d) or conv_node.args[0] is not cat or conv_node.kwargs:
        return OTHER_USERS
    if any(arg is cat for arg in conv_node.args[1:]):
        return OTHER_USERS
    c_out, c_in, kh, kw = conv.weight.shape
    kernel = conv_kernel(c_in * conv.groups, c_out, conv.groups, (kh, kw), conv.stride, conv.padding)
    if conv.groups != 1 or kernel is None or not kernel.tensor_cores:
        return f"the conv (groups={conv.groups}) does not run on the implicit-GEMM kernel"
    return None


def _match(
    conv_node: fx.Node, modules: dict[str, Any]
) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node, list[fx.Node]] | str | None:
    """``(cat, up, a, b, convs)`` for a fused conv that reads ``cat([up(a), b], 1)`` (``convs``: every
    user of the cat, all fused convs that can read it virtually, as C3's cv1 and cv2 both do), a reason
    when it reads a concatenation that does not qualify, None when it reads none."""
    if conv_node.op != "call_module" or not isinstance(modules.get(str(conv_node.target)), FusedConv2d):
        return None
    cat = conv_node.args[0] if conv_node.args else None
    parts = cat_operands(cat) if isinstance(cat, fx.Node) else None
    if parts is None or conv_node.kwargs:
        return None
    assert isinstance(cat, fx.Node)
    if next((u for u in cat.users if _conv_refusal(u, cat, modules) != OTHER_USERS), conv_node) is not conv_node:
        return None  # judged (and reported) once, at the first fused conv that reads the cat
    tensors, dim = parts
    if not tensors or _upsample_input(tensors[0], modules) is None:
        return None  # no upsample first: a concatenation of other things, fuser.rewrite.cat_buffers' business
    if len(tensors) != 2 or dim not in (1, -3):
        return f"the concatenation is not of two values along the channels ({len(tensors)} values, dim {dim})"
    up, b = tensors
    a = _upsample_input(up, modules)
    if isinstance(a, str) or a is None:
        return a
    if len(up.users) != 1:
        return OTHER_USERS
    convs = list(cat.users)
    refusal = next((r for r in (_conv_refusal(c, cat, modules) for c in convs) if r is not None), None)
    if refusal is not None:
        return refusal
    metas = [_meta(n) for n in (a, b)] if isinstance(b, fx.Node) else [None]
    if any(m is None for m in metas):
        return "the shapes are unknown (optimize without example inputs)"
    ma, mb = metas
    if len(ma.shape) != 4 or len(mb.shape) != 4 or ma.dtype != mb.dtype:
        return "the sources are not 4-D tensors of one dtype"
    if int(ma.shape[1]) % VIRTUAL_CAT_ALIGN:
        return f"the upsampled value has {int(ma.shape[1])} channels, not a multiple of {VIRTUAL_CAT_ALIGN}"
    return cat, up, a, b, convs


def fuse_virtual_cats(gm: fx.GraphModule) -> list[GraphRewrite]:
    """Make every qualifying ``conv(cat([upsample_nearest(a, 2), b], 1))`` read ``a`` and ``b`` directly.
    Returns what was rewritten (kind ``virtual_cat``) and the near misses (``virtual_cat_kept``, nothing
    eliminated); ``gm`` is changed only where something was rewritten."""
    found: list[GraphRewrite] = []
    for node, match in candidates(gm, _match):
        cat = node.args[0]
        assert isinstance(cat, fx.Node)
        source = str(cat.meta.get("source_module") or cat.name)
        if isinstance(match, str):
            found.append(GraphRewrite("virtual_cat_kept", source, f"{cat.name} kept: {match}", []))
            continue
        cat, up, a, b, convs = match
        for conv in convs:
            conv.args = (a, *conv.args[1:])
            conv.kwargs = {"cat_with": b, "upsample": FACTOR}
        gm.graph.erase_node(cat)
        gm.graph.erase_node(up)
        # only the channel-block loop gathers from the two sources (conv.py), whatever the routing picked
        moved = {gm.get_submodule(str(conv.target)).source: ConvKernel.IMPLICIT_GEMM.value for conv in convs}
        found.append(GraphRewrite("virtual_cat", source, DESCRIPTION, [up.name, cat.name], moved))
    finish(gm, any(r.eliminated for r in found))
    return found
