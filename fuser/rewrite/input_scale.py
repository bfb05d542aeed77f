"""Channel scales folded into the next conv: ``conv(x * s)`` with ``s`` of shape ``[N, C, 1, 1]`` as one kernel.

Squeeze-excitation (EfficientNet, MobileNetV3) ends in ``x * s``: a factor per image and channel, computed
by the excitation conv (its sigmoid / hardsigmoid already in that conv's epilogue), multiplied into a
tensor of ``x``'s full size that only the 1x1 projection conv reads. :func:`fold_input_scales`, run after
the chains are rewritten, makes ``s`` an input of that conv's fused module instead
(``fused(x, ..., input_scale=s)``): the kernels multiply each element of ``x`` by its factor as they load it
(the operand prologue of fuser.kernels.tiles), and the product is never written. The torch reference,
torch.compile's custom op and ONNX export (a standard Mul before the Conv) compute ``conv(x * s)`` itself.

A multiply qualifies when its only user is a fused conv that reads it as its input, the example inputs gave
both operands' shapes (one ``[N, C, H, W]``, the other ``[N or 1, C, 1, 1]``, same dtype, either order), and
the conv's kernel has the prologue (all but the direct kernel of the RGB stem). Near misses, a multiply that
feeds a fused conv but does not qualify, are reported with the reason (kind ``input_scale_kept``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from fuser.graph_ops import MUL_TARGETS
from fuser.kernels.conv_choice import ConvKernel, conv_kernel
from fuser.lower.fused_modules import FusedConv2d
from fuser.report import GraphRewrite
from fuser.rewrite.node_pass import candidates, finish

DESCRIPTION = "conv(x * s), s [N, C, 1, 1] multiplied as the conv loads x"


def _mul_operands(node: Any) -> tuple[fx.Node, fx.Node] | None:
    """The two tensor operands of ``a * b`` (operator.mul, torch.mul, Tensor.mul), or None."""
    if not isinstance(node, fx.Node) or node.kwargs or len(node.args) != 2:
        return None
    is_mul = (node.op == "call_function" and node.target in MUL_TARGETS) or (
        node.op == "call_method" and node.target == "mul"
    )
    a, b = node.args
    if not is_mul or not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
        return None
    return a, b


def _shape(node: fx.Node) -> tuple[tuple[int, ...], torch.dtype] | None:
    meta = node.meta.get("tensor_meta")
    if not hasattr(meta, "shape") or not hasattr(meta, "dtype"):
        return None
    return tuple(int(d) for d in meta.shape), meta.dtype


def _is_channel_scale(scale: tuple[int, ...], data: tuple[int, ...]) -> bool:
    return len(scale) == 4 and scale[0] in (1, data[0]) and scale[1] == data[1] and scale[2:] == (1, 1)


def _split_operands(mul: fx.Node, a: fx.Node, b: fx.Node) -> tuple[fx.Node, fx.Node] | str:
    """``(x, s)`` of ``x * s`` or ``s * x``, or why the multiply is not a channel scale of ``x``."""
    shapes = {n: _shape(n) for n in (a, b, mul)}
    if any(v is None for v in shapes.values()):
        return "the operands' shapes are unknown (optimize without example inputs)"
    (sa, da), (sb, db), (sm, _) = shapes[a], shapes[b], shapes[mul]  # type: ignore[misc]
    if da != db:
        return f"its operands have different dtypes ({da}, {db})"
    for x, s, sx, ss in ((a, b, sa, sb), (b, a, sb, sa)):
        if len(sx) == 4 and sm == sx and _is_channel_scale(ss, sx):
            return x, s
    return f"it is not a per-(image, channel) scale: shapes {list(sa)} * {list(sb)}"


def _fold_one(node: fx.Node, modules: dict[str, Any]) -> tuple[fx.Node, str | None] | None:
    """For a fused conv ``node`` whose input is a multiply: ``(mul, None)`` after folding it into ``node``,
    ``(mul, reason)`` where it stays; None when the input is no multiply at all."""
    if node.op != "call_module" or not isinstance(modules.get(str(node.target)), FusedConv2d):
        return None
    if not node.args or "input_scale" in node.kwargs or "x" in node.kwargs:
        return None
    mul = node.args[0]
    operands = _mul_operands(mul)
    if operands is None:
        return None
    assert isinstance(mul, fx.Node)
    if len(mul.users) != 1:
        others = ", ".join(sorted(u.name for u in mul.users if u is not node))
        return mul, f"the product has other users ({others}): it is computed anyway"
    if any(arg is mul for arg in (*node.args[1:], *node.kwargs.values())):
        return mul, "the conv reads the product twice"
    split = _split_operands(mul, *operands)
    if isinstance(split, str):
        return mul, split
    x, s = split
    conv = modules[str(node.target)]
    c_out, c_in_g, kh, kw = conv.weight.shape
    kernel = conv_kernel(c_in_g * conv.groups, c_out, conv.groups, (kh, kw), conv.stride, conv.padding)
    if kernel in (None, ConvKernel.DIRECT):
        return (
            mul,
            f"the conv runs on the {kernel.value if kernel else 'torch reference'}, which has no operand prologue",
        )
    node.args = (x, *node.args[1:])
    node.kwargs = {**node.kwargs, "input_scale": s}
    return mul, None


def fold_input_scales(gm: fx.GraphModule) -> list[GraphRewrite]:
    """Fold every qualifying ``x * s`` into the fused conv that reads it (see the module docstring).
    Returns what was folded (kind ``input_scale``) and the near misses (``input_scale_kept``, nothing
    eliminated); ``gm`` is changed only where something was folded."""
    found: list[GraphRewrite] = []
    for _, (mul, reason) in candidates(gm, _fold_one):
        source = str(mul.meta.get("source_module") or mul.name)
        if reason is not None:
            found.append(GraphRewrite("input_scale_kept", source, f"{mul.name} kept: {reason}", []))
            continue
        gm.graph.erase_node(mul)
        found.append(GraphRewrite("input_scale", source, DESCRIPTION, [mul.name]))
    finish(gm, any(r.eliminated for r in found))
    return found
