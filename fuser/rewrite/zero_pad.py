"""A zero padding before a fused conv, folded into the conv's own padding: ``conv(F.pad(x, pads))`` as one kernel.

TensorFlow's "same" padding is asymmetric where the input's size and the stride call for it, and libraries that
reproduce it write a pad before a conv with no padding of its own: timm's Conv2dSame and transformers'
``tf_padding`` layers (``F.pad``, traced for the example's sizes by fuser.capture.specialize), transformers'
EfficientNet (``nn.ZeroPad2d``), and ONNX models whose Conv pads differ per side (the importer writes those as a
pad). Run as written, the pad is one more pass over the activation's memory. A fused conv's padding is
``(top, bottom, left, right)`` and every kernel reads the pixels outside the image as zeros, so the pad can be the
conv's padding; :func:`fold_zero_pads`, run right after the chains are rewritten, makes it so.

A pad qualifies when it adds zeros (``F.pad`` in constant mode with value 0, ``nn.ZeroPad2d``, ``nn.ConstantPad2d``
of 0) on the last two dimensions only, by amounts known now and not negative (a negative pad crops), and its one
user is a fused conv that reads it as its input and is called from that one place (the new padding is the
module's).
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fuser.lower.conv_geometry import ConvGeometry
from fuser.lower.fused_modules import FusedConv2d
from fuser.report import GraphRewrite
from fuser.rewrite.node_pass import candidates, finish

DESCRIPTION = "zero padding before the conv, done by the conv's own padding"


def _zero_pads(node: Any, modules: dict[str, Any]) -> tuple[int, int, int, int] | None:
    """``(top, bottom, left, right)`` zeros that ``node`` pads its input's last two dimensions by, or None where
    it is not such a pad."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_module":
        module = modules.get(str(node.target))
        if not isinstance(module, (nn.ZeroPad2d, nn.ConstantPad2d)) or module.value != 0:
            return None
        pads: Any = module.padding
    elif node.op == "call_function" and node.target in (F.pad, nn.functional.pad):
        if len(node.args) < 2:
            return None
        pads = node.args[1]
        mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
        value = node.args[3] if len(node.args) > 3 else node.kwargs.get("value")
        if mode != "constant" or value not in (None, 0):
            return None
    else:
        return None
    if not isinstance(pads, (tuple, list)) or not all(isinstance(p, int) and p >= 0 for p in pads):
        return None
    if len(pads) not in (2, 4) and any(pads[4:]):
        return None
    left, right, top, bottom = (*pads, 0, 0)[:4]
    return top, bottom, left, right


def _fold_one(node: fx.Node, modules: dict[str, Any]) -> tuple[fx.Node, tuple[int, int, int, int]] | None:
    """For a fused conv ``node`` whose input is a zero pad that qualifies: ``(pad, its amounts)``."""
    if node.op != "call_module" or not isinstance(modules.get(str(node.target)), FusedConv2d) or not node.args:
        return None
    pad = node.args[0]
    amounts = _zero_pads(pad, modules)
    if amounts is None or len(pad.users) != 1 or any(a is pad for a in (*node.args[1:], *node.kwargs.values())):
        return None
    calls = [n for n in node.graph.nodes if n.op == "call_module" and n.target == node.target]
    return (pad, amounts) if len(calls) == 1 else None


def _kernel_name(conv: FusedConv2d) -> str | None:
    """The kernel the report names for ``conv`` with its padding now, where Triton is here to name one."""
    try:
        from fuser.lower import kernel_dispatch
    except ImportError:
        return None
    return kernel_dispatch.conv_kernel_name(
        conv.weight.shape, conv.groups, conv.stride, conv.padding, conv.dilation, conv.backend
    )


def fold_zero_pads(gm: fx.GraphModule) -> list[GraphRewrite]:
    """Fold every qualifying zero pad into the fused conv that reads it (see the module docstring); returns
    what was folded (kind ``zero_pad``), each with the kernel its conv runs now for the report."""
    found: list[GraphRewrite] = []
    for node, (pad, (top, bottom, left, right)) in candidates(gm, _fold_one):
        conv = gm.get_submodule(str(node.target))
        t, b, lft, r = conv.geometry.padding
        conv.geometry = ConvGeometry(
            conv.stride, (t + top, b + bottom, lft + left, r + right), conv.dilation, conv.groups
        )
        conv._refresh()
        node.args = (pad.args[0], *node.args[1:])
        gm.graph.erase_node(pad)
        kernel = _kernel_name(conv)
        source = str(pad.meta.get("source_module") or pad.name)
        found.append(GraphRewrite("zero_pad", source, DESCRIPTION, [pad.name], {conv.source: kernel} if kernel else {}))
    finish(gm, bool(found))
    return found
