"""Concatenation elimination: fused convs store straight into the channel slices of the buffer a
``torch.cat(parts, 1)`` would copy them into (YOLOv8's C2f, CSP and DenseNet-style blocks).

:func:`eliminate_cats` is the graph pass, run after the chains are rewritten. For a channel concatenation of
4-D values with at least one part produced by a fused conv (or a ``split`` / ``chunk`` of one, whose pieces
are then views of the buffer too) it inserts, before the first such producer,

    buf = cat_buffer(x, channels, kernel_size, stride, padding, dilation, backend)   # fresh every forward
    y_i = producer_i(x_i, ..., out=cat_slot(buf, offset_i, channels_i))
    cat = cat_result(buf, parts, offsets)

Correctness never depends on a producer having written its slot: :func:`cat_result` copies in every part
that is not already the right view of ``buf`` and, where no buffer applies (torch.compile, tracers,
exporters, the torch reference backend, inputs that need gradients, parts of another shape or dtype), is
plain ``torch.cat``, so Inductor does its own thing and an exported ONNX graph has a plain Concat. The buffer
is allocated inside the forward, so it never aliases a tensor returned by an earlier call.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fuser.graph_ops import cat_operands
from fuser.lower.backends import KERNEL_DTYPES, is_decomposed, uses_kernels
from fuser.lower.fused_modules import FusedConv2d
from fuser.report import GraphRewrite

SPLITS = {"split", "chunk", torch.split, torch.chunk}
# Ops whose result may share memory with their input: a mutation or an output reached through them
# reaches the buffer too.
VIEW_METHODS = {
    "split", "chunk", "narrow", "view", "reshape", "flatten", "permute", "transpose", "unsqueeze", "squeeze",
    "expand", "contiguous", "detach", "to", "type", "type_as", "float", "half", "bfloat16", "view_as",
    "reshape_as", "expand_as", "unbind", "select", "t", "movedim", "unflatten", "tensor_split", "as_strided",
    "__getitem__",
}  # fmt: skip
VIEW_FUNCTIONS = {
    operator.getitem, torch.split, torch.chunk, torch.narrow, torch.reshape, torch.flatten, torch.permute,
    torch.transpose, torch.unsqueeze, torch.squeeze, torch.unbind, torch.select, torch.movedim,
    torch.tensor_split, torch.t, torch.as_strided, torch.detach,
}  # fmt: skip
INPLACE_FUNCTIONS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv}


def _buffers_apply() -> bool:
    return not (torch.compiler.is_compiling() or torch.jit.is_tracing() or is_decomposed())


def cat_buffer(
    x: torch.Tensor,
    channels: int,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    backend: str,
) -> torch.Tensor | None:
    """A new ``[N, channels, OH, OW]`` channels_last buffer for the concatenation whose first fused producer
    reads ``x`` (OH, OW from that conv's geometry), or None where no buffer applies (then every part is a
    new tensor and :func:`cat_result` is ``torch.cat``). The torch reference backend gets none: it would
    only copy into the slots what ``torch.cat`` copies, and change the layout of the result."""
    if not _buffers_apply() or type(x) is not torch.Tensor or x.dim() != 4 or x.dtype not in KERNEL_DTYPES:
        return None
    if (torch.is_grad_enabled() and x.requires_grad) or not uses_kernels(backend, x.device):
        return None
    from fuser.lower.conv_geometry import conv_output_size

    oh, ow = conv_output_size(x.shape[2:], kernel_size, stride, padding, dilation)
    return torch.empty((x.shape[0], oh, ow, channels), dtype=x.dtype, device=x.device).permute(0, 3, 1, 2)


def cat_slot(buf: torch.Tensor | None, offset: int, channels: int) -> torch.Tensor | None:
    """Channels ``offset:offset + channels`` of ``buf`` (a view), or None without a buffer."""
    return None if buf is None else buf.narrow(1, offset, channels)


def _in_place(part: torch.Tensor, slot: torch.Tensor) -> bool:
    return part.data_ptr() == slot.data_ptr() and part.shape == slot.shape and part.stride() == slot.stride()


def _fits(buf: torch.Tensor, parts: Sequence[Any], offsets: Sequence[int]) -> bool:
    """Whether the parts concatenate into ``buf`` at ``offsets`` (else ``torch.cat`` decides, and raises
    its own error where the parts do not concatenate at all)."""
    grad = torch.is_grad_enabled()
    expected = 0
    for part, offset in zip(parts, offsets, strict=True):
        if type(part) is not torch.Tensor or part.dim() != 4 or part.dtype != buf.dtype or part.device != buf.device:
            return False
        if offset != expected or part.shape[0] != buf.shape[0] or part.shape[2:] != buf.shape[2:]:
            return False
        if grad and part.requires_grad:
            return False
        expected += part.shape[1]
    return expected == buf.shape[1]


def cat_result(buf: torch.Tensor | None, parts: Sequence[torch.Tensor], offsets: Sequence[int]) -> torch.Tensor:
    """``torch.cat(parts, 1)``: ``buf`` with every part that is not already its slot's view copied in, or,
    where no buffer applies, ``torch.cat`` itself. A part that is a view of ``buf`` at another place (it
    could be overwritten before it is read) also leaves it to ``torch.cat``."""
    if buf is None or not _buffers_apply() or not _fits(buf, parts, offsets):
        return torch.cat(list(parts), 1)
    storage = buf.untyped_storage().data_ptr()
    copies = []
    for part, offset in zip(parts, offsets, strict=True):
        slot = buf.narrow(1, offset, part.shape[1])
        if not _in_place(part, slot):
            if part.untyped_storage().data_ptr() == storage:
                return torch.cat(list(parts), 1)
            copies.append((slot, part))
    for slot, part in copies:
        slot.copy_(part)
    return buf


# ---------------------------------------------------------------------------------------------------------
# The graph pass


@dataclass
class _Part:
    """One operand of the concatenation: its channels, and the fused conv whose output channels
    ``start:start + channels`` it is (None: any other value, copied in)."""

    node: Any
    channels: int | None
    producer: fx.Node | None = None
    start: int = 0
    split: fx.Node | None = None
    width: int = 0  # the producer's output channels


def _is_fused_conv(node: Any, modules: dict[str, Any]) -> bool:
    if not isinstance(node, fx.Node) or node.op != "call_module":
        return False
    virtual_input = set(node.kwargs) <= {
        "cat_with",
        "upsample",
    }  # fuser.rewrite.virtual_cat: it may store into a slot too
    return isinstance(modules.get(str(node.target)), FusedConv2d) and len(node.args) in (1, 2) and virtual_input


def _split_pieces(node: fx.Node, channels: int) -> list[int] | None:
    """The channel counts of the pieces of a ``split`` / ``chunk`` along dim 1 of a ``channels``-wide value."""
    args = list(node.args[1:])
    kwargs = dict(node.kwargs)
    first = "chunks" if node.target in ("chunk", torch.chunk) else "split_size_or_sections"
    if node.target == "split" and "split_size" in kwargs:
        kwargs[first] = kwargs.pop("split_size")
    values = dict(zip((first, "dim"), args, strict=False))
    values.update(kwargs)
    if set(values) - {first, "dim"} or values.get("dim", 0) not in (1, -3):
        return None
    how = values.get(first)
    if not isinstance(how, (int, list, tuple)) or isinstance(how, bool):
        return None
    probe = torch.empty(1, channels, 1, 1, device="meta")
    try:
        pieces = probe.chunk(how, 1) if first == "chunks" else probe.split(how, 1)
    except (RuntimeError, TypeError, ValueError):
        return None
    return [p.shape[1] for p in pieces]


def _tensor_meta(node: Any) -> Any:
    meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    return meta if hasattr(meta, "shape") else None


def _read_part(node: Any, modules: dict[str, Any]) -> _Part:
    meta = _tensor_meta(node)
    channels = int(meta.shape[1]) if meta is not None and len(meta.shape) == 4 else None
    if _is_fused_conv(node, modules):
        width = int(modules[str(node.target)].weight.shape[0])
        return _Part(node, width, node, width=width)
    is_piece = (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[1], int)
    )
    if is_piece:
        split = node.args[0]
        if isinstance(split, fx.Node) and split.op in ("call_method", "call_function") and split.target in SPLITS:
            source = split.args[0] if split.args else None
            if _is_fused_conv(source, modules):
                width = int(modules[str(source.target)].weight.shape[0])
                pieces = _split_pieces(split, width)
                index = node.args[1]
                if pieces is not None and -len(pieces) <= index < len(pieces):
                    index %= len(pieces)
                    return _Part(node, pieces[index], source, sum(pieces[:index]), split, width)
    return _Part(node, channels)


def _escapes(node: fx.Node, modules: dict[str, Any], returned_ok: bool = False) -> str | None:
    """Why ``node``'s memory must not be a view of a buffer that other values share: a user (directly or
    through views) writes it in place, or it is (a view of) a graph output (unless ``returned_ok``: the
    buffer itself may be returned). None: neither."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        for user in current.users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "output":
                if returned_ok:
                    continue
                return f"{current.name} is returned by the graph"
            target = user.target
            name = target if isinstance(target, str) else getattr(target, "__name__", "")
            inplace = (
                target in INPLACE_FUNCTIONS if user.op == "call_function" and not isinstance(target, str) else False
            )
            inplace = inplace or (name.endswith("_") and not name.startswith("_")) or "out" in user.kwargs
            if user.op == "call_module":
                inplace = bool(getattr(modules.get(str(target)), "inplace", False))
            if inplace:
                return f"{user.name} writes {current.name} in place"
            if (user.op == "call_method" and target in VIEW_METHODS) or (
                user.op == "call_function" and target in VIEW_FUNCTIONS
            ):
                stack.append(user)
    return None


def _producers_in_place(parts: list[_Part]) -> dict[fx.Node, int]:
    """Each fused conv whose whole output lies in the concatenation, in order and once: its channel offset
    there. A producer of which only some pieces are concatenated, or not next to each other, is copied in."""
    pieces: dict[fx.Node, list[tuple[int, _Part]]] = {}
    position = 0
    for part in parts:
        if part.producer is not None:
            pieces.setdefault(part.producer, []).append((position, part))
        position += part.channels or 0
    found = {}
    for producer, placed in pieces.items():
        offset = placed[0][0] - placed[0][1].start
        covered = 0
        for at, piece in placed:
            if at != offset + covered or piece.start != covered:
                break
            covered += piece.channels or 0
        else:
            if covered == placed[0][1].width:
                found[producer] = offset
    return found


def _twice(parts: list[_Part]) -> str | None:
    """The name of a fused conv's output (or piece of it) that the concatenation reads more than once."""
    nodes = [p.node for p in parts if p.producer is not None]
    doubled = [n for n in nodes if nodes.count(n) > 1]
    if doubled:
        return doubled[0].name
    by_producer: dict[fx.Node, set] = {}
    for p in parts:
        if p.producer is not None:
            by_producer.setdefault(p.producer, set()).add(p.split)
    return next((n.name for n, splits in by_producer.items() if len(splits) > 1), None)


def _rewrite_one(
    gm: fx.GraphModule,
    node: fx.Node,
    parts: list[_Part],
    dim: Any,
    claimed: set[fx.Node],
    modules: dict[str, Any],
) -> GraphRewrite | None:
    """Rewrite one concatenation (or say why not, if a fused conv feeds it); None: nothing to say."""
    if not any(p.producer is not None for p in parts):
        return None
    source = str(node.meta.get("source_module", node.name))
    kept = lambda why: GraphRewrite("cat_kept", source, f"{node.name} kept: {why}", [])
    meta = _tensor_meta(node)
    if meta is not None and len(meta.shape) != 4:
        return kept(f"it joins {len(meta.shape)}-D values, not 4-D")
    if dim not in (1, -3):
        return kept(f"it joins along dim {dim}, not the channels")
    twice = _twice(parts)
    if twice is not None:
        return kept(f"{twice} feeds it twice")
    unknown = [str(p.node) for p in parts if p.channels is None]
    if unknown:
        return kept(f"the channels of {', '.join(unknown)} are unknown (optimize with example inputs)")
    dtypes = {str(m.dtype) for m in (_tensor_meta(p.node) for p in parts) if m is not None}
    if len(dtypes) > 1:
        return kept(f"its parts have different dtypes ({', '.join(sorted(dtypes))})")
    escape = _escapes(node, modules, returned_ok=True)
    if escape is not None:
        return kept(escape)
    placed = _producers_in_place(parts)
    reasons = []
    for producer in list(placed):
        why = _escapes(producer, modules) if producer not in claimed else "it writes into another concatenation"
        if why is not None:
            reasons.append(f"{producer.name}: {why}")
            del placed[producer]
    if not placed:
        return kept("; ".join(reasons) or "no fused conv output lies in it whole")
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first = min(placed, key=order.__getitem__)
    conv = modules[str(first.target)]
    total = sum(p.channels for p in parts)  # type: ignore[misc]
    g = conv.geometry
    graph = gm.graph
    with graph.inserting_before(first):
        source_input = first.kwargs.get("cat_with", first.args[0])  # a virtual input has cat_with's size
        geometry = (tuple(conv.weight.shape[2:]), g.stride, g.padding, g.dilation, conv.backend)
        buf = graph.call_function(cat_buffer, (source_input, total, *geometry))
    slots = []
    for producer, offset in placed.items():
        channels = int(modules[str(producer.target)].weight.shape[0])
        with graph.inserting_before(producer):
            slot = graph.call_function(cat_slot, (buf, offset, channels))
        producer.kwargs = {**producer.kwargs, "out": slot}
        claimed.add(producer)
        slots.append(f"{producer.target} -> [{offset}:{offset + channels}]")
    offsets, position = [], 0
    for p in parts:
        offsets.append(position)
        position += p.channels  # type: ignore[operator]
    with graph.inserting_before(node):
        result = graph.call_function(cat_result, (buf, [p.node for p in parts], tuple(offsets)))
    result.meta = dict(node.meta)
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    copied = len([p for p in parts if p.producer not in placed])
    detail = f"cat of {len(parts)} parts, {total} channels: {', '.join(slots)}; {copied} part(s) copied in"
    if reasons:
        detail += f" ({'; '.join(reasons)})"
    return GraphRewrite("cat_buffer", source, detail, [node.name])


def eliminate_cats(gm: fx.GraphModule) -> list[GraphRewrite]:
    """Let the fused convs of ``gm`` store into the buffers of the channel concatenations they feed.

    Returns one :class:`GraphRewrite` per concatenation a fused conv feeds: kind "cat_buffer" where the cat
    node was replaced (``eliminated`` names it), "cat_kept" with the reason where it stays. ``gm`` is
    changed (and recompiled) only where a "cat_buffer" entry says so."""
    modules = dict(gm.named_modules())
    claimed: set[fx.Node] = set()
    found = []
    for node in list(gm.graph.nodes):
        operands = cat_operands(node)
        if operands is None:
            continue
        tensors, dim = operands
        parts = [_read_part(t, modules) for t in tensors]
        entry = _rewrite_one(gm, node, parts, dim, claimed, modules)
        if entry is not None:
            found.append(entry)
    if any(e.kind == "cat_buffer" for e in found):
        gm.graph.lint()
        gm.recompile()
    return found
