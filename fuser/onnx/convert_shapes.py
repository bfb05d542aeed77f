"""Converters for shapes and data movement: Shape, Gather, GatherElements, GatherND, ScatterND, Concat, Split, Slice,
Reshape, Flatten, Transpose, Squeeze, Unsqueeze, Expand, Constant, ConstantOfShape, Range.

Shape yields a :class:`~fuser.onnx.shape_values.ShapeValue` of ``x.size(i)`` nodes for the batch and the
dims the file leaves symbolic (numbers for the dims it fixes, see ``GraphBuilder.size``), and the others
work on such vectors entry by entry, so a reshape to ``(batch, -1)`` stays
``torch.reshape(x, (x.size(0), -1))`` and the batch stays dynamic.
"""

from __future__ import annotations

import operator
from typing import Any

import onnx
import torch
from torch import fx

from fuser.onnx.builder import NodeContext
from fuser.onnx.convert_elementwise import as_shape_value
from fuser.onnx.registry import converter
from fuser.onnx.shape_values import ShapeValue, normalize_index, slice_items


@converter("Shape", versions=(1, 13, 15, 19, 21, 23, 24, 25))
def shape(ctx: NodeContext) -> Any:
    x = ctx.input(0)
    window = slice(int(ctx.attr("start", 0)), ctx.attr("end"))
    if isinstance(x, fx.Node):
        return ShapeValue(tuple(ctx.size(x, i) for i in range(ctx.require_rank(0))[window]))
    dims = ([] if x.scalar else [len(x.items)]) if isinstance(x, ShapeValue) else list(x.shape)
    return ShapeValue(tuple(dims[window]))


@converter("Gather", versions=(11, 13))
def gather(ctx: NodeContext) -> Any:
    """``data[:, ..., indices]`` (advanced indexing has ONNX's output shape and negative indices); a
    scalar constant index is a Python int, which drops the axis as ONNX does."""
    data = ctx.input(0)
    axis = int(ctx.attr("axis", 0))
    indices = ctx.constant(1)
    if isinstance(data, ShapeValue) and not data.scalar and indices is not None and indices.dim() <= 1:
        n = len(data.items)
        picked = tuple(data.items[normalize_index(int(i), n)] for i in indices.reshape(-1).tolist())
        return ShapeValue(picked, scalar=indices.dim() == 0, dtype=data.dtype)
    if axis < 0:
        axis += ctx.require_rank(0)
    index: Any = int(indices) if indices is not None and indices.dim() == 0 else ctx.input(1)
    return ctx.call(operator.getitem, data, (slice(None),) * axis + (index,))


@converter("GatherElements", versions=(11, 13))
def gather_elements(ctx: NodeContext) -> Any:
    """``torch.gather(data, axis, indices)``. ONNX allows negative indices, torch does not: they are
    wrapped (at import time for constant indices, else with ``remainder`` by the run-time size)."""
    data, index = ctx.input(0), ctx.input(1)
    axis = int(ctx.attr("axis", 0))
    if axis < 0:
        axis += ctx.require_rank(0)
    known = ctx.constant(1)
    if ctx.dtype(1) != torch.int64:
        index = ctx.method("long", index)
    if known is None or bool((known < 0).any()):
        index = ctx.call(torch.remainder, index, ctx.size(data, axis))
    return ctx.call(torch.gather, data, axis, index)


@converter("GatherND", versions=(11, 12, 13))
def gather_nd(ctx: NodeContext) -> Any:
    """``data[tuple(indices.unbind(-1))]``: the last axis of ``indices`` indexes the leading dims of
    ``data``, and torch's advanced indexing gives ONNX's output shape and reads negative indices alike."""
    if int(ctx.attr("batch_dims", 0)) != 0:
        raise ctx.unsupported(f"batch_dims={ctx.attr('batch_dims')}")
    return ctx.call(operator.getitem, ctx.input(0), _nd_indices(ctx))


def _nd_indices(ctx: NodeContext) -> Any:
    """GatherND's / ScatterND's input 1 as a tuple of int64 index tensors, one per leading dim of the data."""
    depth = (ctx.static_shape(1) or [None])[-1]
    if depth == 0:
        raise ctx.unsupported("indices whose last dim is 0")
    index = ctx.input(1)
    if ctx.dtype(1) != torch.int64:
        index = ctx.method("long", index)
    return ctx.call(torch.unbind, index, -1)


# ScatterND's reductions, as torch.scatter_reduce names them
_SCATTER_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


@converter("ScatterND", versions=(11, 13, 16, 18))
def scatter_nd(ctx: NodeContext) -> Any:
    """A copy of ``data`` with ``data[tuple(indices.unbind(-1))]`` set to ``updates``: ``torch.index_put``, whose
    advanced indexing reads ONNX's index layout and negative indices as GatherND's does. ultralytics' pose head
    writes its decoded keypoints into a copy this way. A reduction (add, mul, max, min) goes through
    :func:`_scatter_nd_reduce`: ``index_put(accumulate=True)`` would add, but torch.onnx exports it as a scatter
    into zeros plus an add, which keeps one of the repeated indices' updates."""
    reduction = ctx.attr("reduction", "none")
    if reduction in _SCATTER_REDUCE:
        return _scatter_nd_reduce(ctx, _SCATTER_REDUCE[reduction])
    if reduction != "none":
        raise ctx.unsupported(f"reduction={reduction!r}")
    return ctx.call(torch.index_put, ctx.input(0), _nd_indices(ctx), ctx.input(2))


def _scatter_nd_reduce(ctx: NodeContext, reduce: str) -> Any:
    """ScatterND with a reduction ``torch.index_put`` lacks: the indexed leading dims of ``data`` flattened into one,
    each index tuple into its row number there (negative indices counted from the end), and
    ``torch.scatter_reduce`` over those rows with the data included, which applies the reduction once per update
    whatever the order, as ONNX's repeated indices need."""
    data, updates = ctx.input(0), ctx.input(2)
    depth = (ctx.static_shape(1) or [None])[-1]
    data_rank, index_rank = ctx.rank(0), ctx.rank(1)
    if depth is None or data_rank is None or index_rank is None:
        raise ctx.unsupported("a reduction over indices or data of unknown rank or index depth")
    if not 0 < depth <= data_rank:
        raise ctx.invalid(f"indices of depth {depth} into data of rank {data_rank}")
    index = _nd_indices(ctx)
    row: Any = None
    for d in range(depth):
        size = ctx.size(data, d)
        within = ctx.call(torch.remainder, ctx.call(operator.getitem, index, d), size)
        row = within if row is None else ctx.call(operator.add, ctx.call(operator.mul, row, size), within)
    rows = ctx.call(torch.flatten, data, 0, depth - 1)
    if index_rank > 1:
        sources = ctx.call(torch.flatten, updates, 0, index_rank - 2)
    else:  # one index tuple: one update of the trailing shape
        sources = ctx.method("unsqueeze", updates, 0)
    trailing = data_rank - depth
    where = ctx.method("expand_as", ctx.method("reshape", row, [-1] + [1] * trailing), sources)
    reduced = ctx.call(torch.scatter_reduce, rows, 0, where, sources, reduce, include_self=True)
    return ctx.method("reshape_as", reduced, data)


@converter("Concat", versions=(4, 11, 13))
def concat(ctx: NodeContext) -> Any:
    values = [ctx.input(i) for i in range(ctx.num_inputs) if ctx.has_input(i)]
    axis = int(ctx.attr("axis"))
    if any(isinstance(v, ShapeValue) for v in values) and axis in (0, -1):
        vectors = [as_shape_value(v) for v in values]
        if all(v is not None and not v.scalar for v in vectors):
            return ShapeValue(tuple(item for v in vectors for item in v.items), dtype=vectors[0].dtype)
    return ctx.call(torch.cat, values, dim=axis)


def _split(ctx: NodeContext, sizes: list[int] | None) -> list[Any]:
    x = ctx.input(0)
    axis = int(ctx.attr("axis", 0))
    count = len(ctx.node.output)
    if sizes is not None:
        if len(sizes) != count:
            raise ctx.invalid(f"{len(sizes)} split sizes for {count} outputs")
        parts = ctx.call(torch.split, x, sizes, dim=axis)
    else:
        count = int(ctx.attr("num_outputs", count))
        # ONNX splits into equal parts of ceil(size / count), the last one smaller: torch.chunk's rule.
        parts = ctx.call(torch.chunk, x, count, dim=axis)
    return [ctx.call(operator.getitem, parts, i) for i in range(count)]


@converter("Split", versions=(2, 11))
def split_attribute(ctx: NodeContext) -> Any:
    sizes = ctx.attr("split")
    return _split(ctx, list(sizes) if sizes else None)


@converter("Split", versions=(13, 18))
def split_input(ctx: NodeContext) -> Any:
    return _split(ctx, ctx.constant_ints(1, "split"))


@converter("Slice", versions=(10, 11, 13))
def slice_(ctx: NodeContext) -> Any:
    """Python slicing: ``x[:, a:b:c]``. Starts and ends may be run-time sizes (shape vectors with
    ``x.size(i)`` entries); a negative step flips the axis and slices the flipped tensor."""
    x = ctx.input(0)
    starts, ends = as_shape_value(ctx.input(1)), as_shape_value(ctx.input(2))
    if starts is None or ends is None:
        raise ctx.unsupported("starts or ends computed as run-time tensors")
    n = len(starts.items)
    axes = ctx.constant_ints(3, "axes") or list(range(n))
    steps = ctx.constant_ints(4, "steps") or [1] * n
    if not (len(ends.items) == len(axes) == len(steps) == n):
        raise ctx.invalid(f"starts, ends, axes, steps of lengths {n}, {len(ends.items)}, {len(axes)}, {len(steps)}")
    if 0 in steps:
        raise ctx.invalid("a step of 0")
    if isinstance(x, ShapeValue) and not x.scalar and starts.is_constant and ends.is_constant:
        return x.with_items(slice_items(x.items, int(starts.items[0]), int(ends.items[0]), steps[0]))
    if any(a < 0 for a in axes):
        rank = ctx.require_rank(0)
        axes = [a + rank if a < 0 else a for a in axes]
    key: list[Any] = [slice(None)] * (max(axes) + 1)
    flips = []
    for axis, start, end, step in zip(axes, starts.items, ends.items, steps, strict=True):
        if step > 0:
            key[axis] = slice(start, end, None if step == 1 else step)
            continue
        if isinstance(start, fx.Node) or isinstance(end, fx.Node):
            raise ctx.unsupported("a negative step with starts or ends computed at run time")
        # Index i of the axis is index n-1-i of the flipped axis; as Python negative indices that is
        # -(i+1), and Python's clamping of the bounds matches ONNX's, except for a start below -n:
        # ONNX clamps it to the first element, which is n-1 in the flipped axis.
        first: Any = -(start + 1)
        if start < 0:
            dims = ctx.static_shape(0)
            if dims is not None and dims[axis] is not None:
                first = min(first, dims[axis] - 1)
            else:
                items = ctx.builder.items
                first = items.minimum(first, items.binary("sub", ctx.size(x, axis), 1, integral=True))
        flips.append(axis)
        key[axis] = slice(first, -(end + 1), None if step == -1 else -step)
    if flips:
        x = ctx.call(torch.flip, x, flips)
    return ctx.call(operator.getitem, x, tuple(key))


@converter("Reshape", versions=(5, 13, 14, 19, 21, 23, 24, 25))
def reshape(ctx: NodeContext) -> Any:
    """``torch.reshape(x, shape)``; a 0 in the shape copies the input's size there (unless allowzero),
    which for the batch dim is ``x.size(0)`` at run time."""
    x = ctx.input(0)
    target = as_shape_value(ctx.input(1))
    if target is None:
        raise ctx.unsupported("a shape computed as a run-time tensor (not from Shape arithmetic)")
    allowzero = bool(ctx.attr("allowzero", 0))
    if isinstance(x, ShapeValue) and target.is_constant:
        flat = [int(v) for v in target.items]
        if flat in ([-1], [len(x.items)]) or (flat == [] and len(x.items) == 1):
            return x.with_items(x.items, scalar=flat == [])
    items = list(target.items)
    if not allowzero:
        for i, item in enumerate(items):
            if not isinstance(item, fx.Node) and item == 0:
                items[i] = ctx.size(x, i)
    result = ctx.call(torch.reshape, x, tuple(items))
    if isinstance(result, fx.Node):
        ctx.builder.note_dims(result, tuple(items))
    return result


@converter("Flatten", versions=(1, 9, 11, 13, 21, 23, 24, 25))
def flatten(ctx: NodeContext) -> Any:
    """2-D output [prod(dims before axis), prod(dims from axis)]."""
    x = ctx.input(0)
    axis = int(ctx.attr("axis", 1))
    rank = ctx.rank(0)
    if axis < 0:
        axis += ctx.require_rank(0)
    if axis == 0:
        return ctx.call(torch.reshape, x, (1, -1))
    if rank is not None and axis == rank:
        return ctx.call(torch.reshape, x, (-1, 1))
    if axis == 1:
        return ctx.call(torch.flatten, x, 1)
    leading = ctx.call(torch.flatten, x, 0, axis - 1)
    if rank is not None and axis == rank - 1:  # one trailing dim: already 2-D (LeViT's x.flatten(0, 1) stays one op)
        return leading
    return ctx.call(torch.flatten, leading, 1)


@converter("Transpose", versions=(1, 13, 21, 23, 24, 25))
def transpose(ctx: NodeContext) -> Any:
    x = ctx.input(0)
    perm = ctx.attr("perm")
    if perm is None:
        perm = list(reversed(range(ctx.require_rank(0))))
    if isinstance(x, ShapeValue):
        return x
    return ctx.call(torch.permute, x, tuple(perm))


def _squeeze(ctx: NodeContext, axes: list[int] | None) -> Any:
    x = ctx.input(0)
    if isinstance(x, ShapeValue) and not x.scalar and len(x.items) == 1 and axes in (None, [0], [-1]):
        return x.with_items(x.items, scalar=True)
    if axes is None:
        return ctx.call(torch.squeeze, x)
    return ctx.call(torch.squeeze, x, tuple(axes))


@converter("Squeeze", versions=(1, 11))
def squeeze_attribute(ctx: NodeContext) -> Any:
    axes = ctx.attr("axes")
    return _squeeze(ctx, list(axes) if axes else None)


@converter("Squeeze", versions=(13, 21, 23, 24, 25))
def squeeze_input(ctx: NodeContext) -> Any:
    return _squeeze(ctx, ctx.constant_ints(1, "axes"))


def _unsqueeze(ctx: NodeContext, axes: list[int]) -> Any:
    x = ctx.input(0)
    if isinstance(x, ShapeValue) and x.scalar and axes in ([0], [-1]):
        return x.with_items(x.items, scalar=False)
    if any(a < 0 for a in axes):
        out_rank = ctx.require_rank(0) + len(axes)
        axes = [a + out_rank if a < 0 else a for a in axes]
    for axis in sorted(axes):
        x = ctx.call(torch.unsqueeze, x, axis)
    return x


@converter("Unsqueeze", versions=(1, 11))
def unsqueeze_attribute(ctx: NodeContext) -> Any:
    return _unsqueeze(ctx, list(ctx.attr("axes")))


@converter("Unsqueeze", versions=(13, 21, 23, 24, 25))
def unsqueeze_input(ctx: NodeContext) -> Any:
    return _unsqueeze(ctx, ctx.constant_ints(1, "axes"))


@converter("Expand", versions=(8, 13))
def expand(ctx: NodeContext) -> Any:
    """``x.expand(sizes)``. ONNX broadcasts x against the shape, where a 1 keeps the input's size: that
    is torch's -1. A run-time entry over an input dim that is 1 is the new size; over any other known
    size it must be 1 or that size, so -1 again."""
    x = ctx.input(0)
    target = as_shape_value(ctx.input(1))
    if target is None:
        raise ctx.unsupported("a shape computed as a run-time tensor (not from Shape arithmetic)")
    x_shape = list(x.shape) if isinstance(x, torch.Tensor) else ctx.static_shape(0)
    if x_shape is None:
        x_shape = [None] * ctx.require_rank(0)
    rank = max(len(x_shape), len(target.items))
    sizes: list[Any] = []
    for j in range(rank):
        xi = j - (rank - len(x_shape))
        ti = j - (rank - len(target.items))
        item = target.items[ti] if ti >= 0 else -1
        if xi < 0 or (isinstance(item, fx.Node) and x_shape[xi] == 1):
            sizes.append(item)
        elif isinstance(item, fx.Node):
            sizes.append(-1 if x_shape[xi] is not None else ctx.builder.items.maximum(ctx.size(x, xi), item))
        else:
            sizes.append(-1 if item == 1 else item)
    return ctx.method("expand", x, tuple(sizes))


@converter("Constant", versions=(1, 9, 11, 12, 13, 19, 21, 23, 24, 25))
def constant(ctx: NodeContext) -> Any:
    for name, dtype in (("value_float", torch.float32), ("value_floats", torch.float32)):
        if name in ctx.attrs:
            return torch.tensor(ctx.attrs[name], dtype=dtype)
    for name in ("value_int", "value_ints"):
        if name in ctx.attrs:
            return torch.tensor(ctx.attrs[name], dtype=torch.int64)
    if "value" in ctx.attrs:
        return ctx.attrs["value"]
    raise ctx.unsupported(f"a Constant given as {', '.join(ctx.attrs) or 'nothing'}")


@converter("ConstantOfShape", versions=(9, 20, 21, 23, 24, 25))
def constant_of_shape(ctx: NodeContext) -> Any:
    value = ctx.attr("value")
    value = torch.zeros(1, dtype=torch.float32) if value is None else value
    target = as_shape_value(ctx.input(0))
    if target is None:
        raise ctx.unsupported("a shape computed as a run-time tensor (not from Shape arithmetic)")
    return ctx.create(torch.full, tuple(target.items), value.reshape(()).item(), dtype=value.dtype)


@converter("Range", versions=(11, 27))
def range_(ctx: NodeContext) -> Any:
    """``torch.arange``. Version 27 adds float16 and bfloat16 bounds, counted in float32 and cast back
    (``stash_type=1``, the default); counting by successive additions in the half type is not converted."""
    bounds = []
    for i in range(3):
        value = ctx.input(i)
        vector = as_shape_value(value) if not isinstance(value, fx.Node) else None
        bounds.append(vector.items[0] if vector is not None else value)
    dtype = ctx.dtype(0) or torch.int64
    if dtype in (torch.float16, torch.bfloat16):
        stash = int(ctx.attr("stash_type", onnx.TensorProto.FLOAT))
        if stash != onnx.TensorProto.FLOAT:
            raise ctx.unsupported(f"stash_type={stash} (accumulating in {dtype})")
        return ctx.method("to", ctx.create(torch.arange, *bounds, dtype=torch.float32), dtype)
    return ctx.create(torch.arange, *bounds, dtype=dtype)
