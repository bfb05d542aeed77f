"""Building the fx graph for an ONNX graph: values, constants as buffers, constant folding, and the
view of one ONNX node that a converter works through (:class:`NodeContext`).

An ONNX value becomes one of three things while the graph is built:

- an ``fx.Node``: a tensor computed at run time;
- a ``torch.Tensor``: known at import time (an initializer, a Constant, or anything computed only from
  those). It enters the graph as a buffer of the GraphModule's root, read through ``get_attr``, when a
  run-time operation uses it;
- a :class:`~fuser.onnx.shape_values.ShapeValue`: a short integer vector with run-time entries, the
  output of shape arithmetic (see that module).

Every operation goes through :meth:`GraphBuilder.call`: when none of its arguments is known only at run
time it runs now, in torch, and its result is a constant. That is the importer's constant folding, and
it is exact because the folded call is the very call the graph would have made.
"""

from __future__ import annotations

import keyword
import operator
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import fx, nn

from fuser.onnx.errors import OnnxConversionError
from fuser.onnx.registry import domain_label
from fuser.onnx.shape_values import Item, ItemOps, ShapeValue

Value = fx.Node | torch.Tensor | ShapeValue

ONNX_TO_TORCH_DTYPE: dict[int, torch.dtype] = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.INT16: torch.int16,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.UINT8: torch.uint8,
    onnx.TensorProto.BOOL: torch.bool,
}


def torch_dtype(onnx_type: int, what: str) -> torch.dtype:
    """The torch dtype of an ONNX TensorProto data type; OnnxConversionError naming ``what`` otherwise."""
    try:
        return ONNX_TO_TORCH_DTYPE[onnx_type]
    except KeyError:
        known = onnx_type in onnx.TensorProto.DataType.values()
        name = onnx.TensorProto.DataType.Name(onnx_type) if known else str(onnx_type)
        raise OnnxConversionError(f"{what}: ONNX data type {name} has no supported torch dtype") from None


def tensor_from_proto(proto: onnx.TensorProto) -> torch.Tensor:
    """An initializer or Constant value as a torch tensor (a copy: the ModelProto is not aliased)."""
    if proto.data_type == onnx.TensorProto.BFLOAT16:
        bits = np.asarray(numpy_helper.to_array(proto)).view(np.uint16)
        return torch.from_numpy(bits.copy()).view(torch.bfloat16)
    torch_dtype(proto.data_type, f"tensor {proto.name!r}")
    return torch.from_numpy(np.array(numpy_helper.to_array(proto), copy=True))


_NOT_IDENTIFIER = re.compile(r"\W")
# Attribute names an nn.Module already has (training, forward, ...) cannot hold a buffer.
_MODULE_ATTRIBUTES = frozenset(dir(nn.Module()))


def python_name(name: str, fallback: str) -> str:
    """An ONNX value name made a Python identifier: ``"/conv1/Conv.weight"`` -> ``"conv1_Conv_weight"``."""
    ident = _NOT_IDENTIFIER.sub("_", name).strip("_") or fallback
    if ident[0].isdigit():
        ident = f"{fallback}_{ident}"
    if keyword.iskeyword(ident) or ident in _MODULE_ATTRIBUTES:
        ident = f"{ident}_"
    return ident


def _map_args(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """Apply ``leaf`` to every leaf of nested tuples, lists, dicts and slices."""
    if isinstance(value, tuple):
        return tuple(_map_args(v, leaf) for v in value)
    if isinstance(value, list):
        return [_map_args(v, leaf) for v in value]
    if isinstance(value, dict):
        return {k: _map_args(v, leaf) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(*(_map_args(v, leaf) for v in (value.start, value.stop, value.step)))
    return leaf(value)


def _is_runtime(value: Any) -> bool:
    found = False

    def visit(leaf: Any) -> Any:
        nonlocal found
        if isinstance(leaf, fx.Node) or (isinstance(leaf, ShapeValue) and not leaf.is_constant):
            found = True
        return leaf

    _map_args(value, visit)
    return found


class BufferTracer(fx.Tracer):
    """The tracer torch uses to rebuild the graph from its code (torch.save / torch.load of a GraphModule
    re-trace it): buffers read as graph values, since constants are buffers here and are indexed by
    run-time sizes (``pos_embedding[:x.size(1)]``), which a plain tensor cannot be with a traced size."""

    proxy_buffer_attributes = True


class GraphBuilder:
    """Owns the fx graph, the root module holding buffers, and the ONNX value -> :data:`Value` map."""

    def __init__(self, types: dict[str, onnx.TypeProto]) -> None:
        self.graph = fx.Graph(tracer_cls=BufferTracer)
        self.root = nn.Module()
        self.types = types
        self.values: dict[str, Value] = {}
        # The ONNX node being converted and its first output: for node.meta and for naming buffers.
        self.current_node = ""
        self.current_output = "const"
        self._nonnegative: set[fx.Node] = set()
        self._buffers: dict[int, tuple[torch.Tensor, fx.Node]] = {}
        self._sizes: dict[tuple[fx.Node, int], fx.Node] = {}
        self._static_shapes: dict[fx.Node, list[int | None]] = {}
        self._dtypes: dict[fx.Node, torch.dtype] = {}
        self._meta: dict[fx.Node, tuple[list[int | None], torch.dtype] | None] = {}
        self._known_dims: dict[fx.Node, tuple[Item | None, ...]] = {}
        self._attr_names: set[str] = set()
        self._constant_names: dict[int, tuple[torch.Tensor, str]] = {}
        self._placeholders: list[fx.Node] = []
        self._device: fx.Node | None = None
        self.items = ItemOps(emit=self._emit_item, is_nonnegative=self.is_nonnegative)

    # -- names and buffers -----------------------------------------------------------------------

    def _unique_attr(self, hint: str) -> str:
        base = python_name(hint, "const")
        name, k = base, 1
        while name in self._attr_names:
            name, k = f"{base}_{k}", k + 1
        self._attr_names.add(name)
        return name

    def placeholder(self, onnx_name: str) -> fx.Node:
        node = self.graph.placeholder(python_name(onnx_name, "input"))
        node.meta["onnx_value"] = onnx_name
        self._placeholders.append(node)
        return node

    def device(self) -> fx.Node | None:
        """``x.device`` of the first graph input, read at run time: where tensors created at run time
        (arange, full, shape vectors) must live, so that the module still works after ``.to(device)``."""
        if self._device is None and self._placeholders:
            with self.graph.inserting_after(self._placeholders[-1]):
                self._device = self._create("call_function", getattr, (self._placeholders[0], "device"), {})
        return self._device

    def name_constant(self, tensor: torch.Tensor, name: str) -> None:
        """Remember ``name`` (an ONNX value name) for ``tensor``'s buffer, should it become one."""
        self._constant_names.setdefault(id(tensor), (tensor, name))

    def buffer(self, tensor: torch.Tensor, hint: str | None = None) -> fx.Node:
        """A get_attr node reading ``tensor`` as a buffer of the root; one buffer per tensor object,
        named after the ONNX value it came from where known."""
        known = self._buffers.get(id(tensor))
        if known is not None:
            return known[1]
        named = self._constant_names.get(id(tensor))
        name = self._unique_attr(named[1] if named else hint or "const")
        self.root.register_buffer(name, tensor)
        node = self.graph.get_attr(name)
        self._buffers[id(tensor)] = (tensor, node)
        return node

    def as_node(self, value: Value, hint: str | None = None) -> fx.Node:
        """``value`` as a graph node: constants become buffers, ShapeValues tensors built at run time."""
        if isinstance(value, fx.Node):
            return value
        if isinstance(value, torch.Tensor):
            return self.buffer(value, hint)
        if isinstance(value, ShapeValue):
            if value.is_constant:
                return self.buffer(value.to_tensor(), hint)
            items = value.items[0] if value.scalar else list(value.items)
            kwargs = {"dtype": value.dtype, "device": self.device()}
            return self._create("call_function", torch.tensor, (items,), kwargs)
        raise TypeError(f"not a tensor value: {value!r}")

    # -- emitting --------------------------------------------------------------------------------

    def _create(self, kind: str, target: Any, args: tuple, kwargs: dict) -> fx.Node:
        node = self.graph.create_node(kind, target, args, kwargs)
        node.meta["onnx_node"] = self.current_node
        return node

    def _emit_item(self, target: Any, args: tuple) -> fx.Node:
        return self._create("call_function", target, args, {})

    def call(
        self, kind: str, target: Any, args: tuple, kwargs: dict | None = None, *, creates_tensor: bool = False
    ) -> Any:
        """Emit ``target(*args, **kwargs)`` (kind "call_function") or ``args[0].target(...)`` ("call_method").

        Runs it now when every argument is known at import time (constant folding); otherwise constant
        tensors among the arguments become buffers and ShapeValues run-time tensors. A call that
        ``creates_tensor`` from sizes (arange, full) gets ``device=`` the graph inputs' device.
        """
        kwargs = kwargs or {}
        if creates_tensor and _is_runtime((args, kwargs)):
            kwargs = {**kwargs, "device": self.device()}
        if not _is_runtime((args, kwargs)):
            cargs, ckwargs = _map_args((args, kwargs), lambda v: v.to_tensor() if isinstance(v, ShapeValue) else v)
            with torch.no_grad():
                if kind == "call_method":
                    return getattr(cargs[0], target)(*cargs[1:], **ckwargs)
                return target(*cargs, **ckwargs)
        gargs, gkwargs = _map_args(
            (args, kwargs),
            lambda v: self.as_node(v, self.current_output) if isinstance(v, (torch.Tensor, ShapeValue)) else v,
        )
        return self._create(kind, target, gargs, gkwargs)

    def note_static_shape(self, node: fx.Node, onnx_name: str) -> None:
        """Remember the dims shape inference found for the ONNX value ``node`` computes (see :meth:`size`);
        where it left some unknown, those that the graph built so far fixes (:meth:`_propagated`)."""
        if node in self._static_shapes:
            return
        dims, dtype = self.static_shape_of(onnx_name), self.dtype_of(onnx_name)
        if dtype is not None:
            self._dtypes[node] = dtype
        if dims is None or None in dims[1:]:
            propagated = self._propagated(node)
            if propagated is not None and (dims is None or len(dims) == len(propagated[0])):
                dims = [d if d is not None else p for d, p in zip(dims or propagated[0], propagated[0], strict=True)]
        if dims is not None:
            self._static_shapes[node] = dims

    def _known(self, node: fx.Node) -> tuple[list[int | None], torch.dtype] | None:
        """``node``'s dims (all known past the batch) and dtype, or None."""
        dims, dtype = self._static_shapes.get(node), self._dtypes.get(node)
        if dims is not None and dtype is not None and None not in dims[1:]:
            return dims, dtype
        propagated = self._propagated(node)
        return propagated if propagated is not None and None not in propagated[0][1:] else None

    def _propagated(self, node: fx.Node) -> tuple[list[int | None], torch.dtype] | None:
        """The dims (dim 0 unknown: the batch) and dtype of the tensor ``node`` computes, found by running its
        op on meta tensors of its inputs' known dims at two batch sizes: a dim that comes out the same at both
        is fixed by the model. ONNX shape inference cannot follow what it cannot evaluate (the pads that
        TorchScript's export of a "same" padding computes with Ceil on float sizes), while the graph here holds
        such values folded already. None where an input's dims past the batch are not all known, or the op
        fails on meta tensors."""
        if node in self._meta:
            return self._meta[node]
        self._meta[node] = None  # while it is worked out, and where it cannot be
        if node.op not in ("call_function", "call_method"):
            return None
        a, b = (self._meta_run(node, batch) for batch in (7, 11))
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim() and a.dim():
            dims = [None] + [int(x) if x == y else None for x, y in zip(a.shape[1:], b.shape[1:], strict=True)]
            self._meta[node] = (dims, a.dtype)
        return self._meta[node]

    def _meta_run(self, node: fx.Node, batch: int) -> Any:
        """``node``'s op on meta tensors of its inputs, whose batch is ``batch``; None where it cannot run."""
        missing = []

        def meta(arg: Any) -> Any:
            if not isinstance(arg, fx.Node):
                return arg
            if arg.op == "get_attr":
                return getattr(self.root, str(arg.target)).to("meta")
            known = self._known(arg)
            if known is None or not known[0]:
                missing.append(arg)
                return None
            dims, dtype = known
            return torch.empty([batch, *dims[1:]], dtype=dtype, device="meta")

        args, kwargs = fx.node.map_aggregate(node.args, meta), fx.node.map_aggregate(node.kwargs, meta)
        if missing:
            return None
        try:
            with torch.no_grad():
                if node.op == "call_method":
                    return getattr(args[0], str(node.target))(*args[1:], **kwargs)
                return node.target(*args, **kwargs)
        except Exception:  # an op without a meta kernel, a size read back: not known
            return None

    def note_dims(self, node: fx.Node, dims: tuple[Item, ...]) -> None:
        """Record that ``node`` has exactly ``dims`` (a reshape's target): :meth:`size` answers from them
        instead of reading the size back at run time. Entries that may be -1 (inferred) are ignored."""
        self._known_dims[node] = tuple(d if self.is_nonnegative(d) else None for d in dims)

    def size(self, x: fx.Node, dim: int) -> Item:
        """``x.size(dim)``: the number when shape inference (or :meth:`note_static_shape`'s propagation) knows
        it and ``dim`` is not 0, else a run-time ``x.size(dim)`` node, once per (x, dim), known to be
        non-negative.

        A dim the model fixes (``[N, 3, 640, 640]`` makes every feature map's height a number) is the
        same at every valid input, so shape arithmetic over it folds at import time and leaves nothing to
        compute, or to export, at run time. Dim 0 is the batch of nearly every tensor and stays dynamic
        even where the file fixes it: a file exported at batch 1 still runs at any batch.
        """
        dims = self._static_shapes.get(x)
        if dim > 0 and dims is not None and dim < len(dims) and dims[dim] is not None:
            return int(dims[dim])
        known = self._known_dims.get(x, ())
        if dim < len(known) and known[dim] is not None:
            return known[dim]
        key = (x, dim)
        if key not in self._sizes:
            node = self._create("call_method", "size", (x, dim), {})
            self._nonnegative.add(node)
            self._sizes[key] = node
        return self._sizes[key]

    def is_nonnegative(self, item: Item) -> bool:
        if isinstance(item, fx.Node):
            if item in self._nonnegative:
                return True
            # Sums and products of sizes are sizes too.
            if item.target in (operator.add, operator.mul):
                return all(self.is_nonnegative(a) for a in item.args)
            return False
        return not isinstance(item, bool) and item >= 0

    # -- facts from shape inference --------------------------------------------------------------

    def rank_of(self, name: str) -> int | None:
        value = self.values.get(name)
        if isinstance(value, torch.Tensor):
            return value.dim()
        if isinstance(value, ShapeValue):
            return value.rank
        t = self.types.get(name)
        if t is not None and t.HasField("tensor_type") and t.tensor_type.HasField("shape"):
            return len(t.tensor_type.shape.dim)
        return None

    def static_shape_of(self, name: str) -> list[int | None] | None:
        """Dims from shape inference, None for symbolic ones; for import-time decisions that no run-time
        size can change (the caller says why), never for the batch dimension."""
        value = self.values.get(name)
        if isinstance(value, torch.Tensor):
            return list(value.shape)
        t = self.types.get(name)
        if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
            return None
        return [d.dim_value if d.HasField("dim_value") else None for d in t.tensor_type.shape.dim]

    def dtype_of(self, name: str) -> torch.dtype | None:
        value = self.values.get(name)
        if isinstance(value, torch.Tensor):
            return value.dtype
        if isinstance(value, ShapeValue):
            return value.dtype
        t = self.types.get(name)
        if t is not None and t.HasField("tensor_type") and t.tensor_type.elem_type in ONNX_TO_TORCH_DTYPE:
            return ONNX_TO_TORCH_DTYPE[t.tensor_type.elem_type]
        return None

    # -- the result ------------------------------------------------------------------------------

    def finish(self, outputs: list[fx.Node], class_name: str) -> fx.GraphModule:
        """The GraphModule: dead nodes and unused buffers dropped, graph linted."""
        self.graph.output(outputs[0] if len(outputs) == 1 else tuple(outputs))
        self.graph.eliminate_dead_code()
        used = {n.target for n in self.graph.nodes if n.op == "get_attr"}
        for name in list(self.root._buffers):
            if name not in used:
                del self.root._buffers[name]
        self.graph.lint()
        return fx.GraphModule(self.root, self.graph, class_name=class_name)


class NodeContext:
    """What a converter sees of its ONNX node: inputs as values, attributes, facts, and emitters."""

    def __init__(self, builder: GraphBuilder, node: onnx.NodeProto, opset: int) -> None:
        self.builder = builder
        self.node = node
        self.opset = opset
        self.name = node.name or (node.output[0] if node.output else "<unnamed>")
        self.attrs = {a.name: _attribute_value(a) for a in node.attribute}

    def describe(self) -> str:
        return f"ONNX node {self.name!r} ({domain_label(self.node.domain)}::{self.node.op_type}, opset {self.opset})"

    def unsupported(self, what: str) -> NotImplementedError:
        """The error to raise for a form of this op that is not converted."""
        return NotImplementedError(f"{self.describe()}: {what} is not supported")

    def invalid(self, what: str) -> OnnxConversionError:
        """The error to raise for a node that breaks the op's specification."""
        return OnnxConversionError(f"{self.describe()}: {what}")

    # -- inputs ----------------------------------------------------------------------------------

    @property
    def num_inputs(self) -> int:
        return len(self.node.input)

    def has_input(self, i: int) -> bool:
        return i < len(self.node.input) and self.node.input[i] != ""

    def input(self, i: int) -> Value:
        if not self.has_input(i):
            raise self.invalid(f"required input {i} is missing")
        return self.builder.values[self.node.input[i]]

    def optional_input(self, i: int) -> Value | None:
        return self.input(i) if self.has_input(i) else None

    def constant(self, i: int) -> torch.Tensor | None:
        """Input ``i`` as a tensor when it is known at import time, else None (also when absent)."""
        if not self.has_input(i):
            return None
        value = self.input(i)
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, ShapeValue) and value.is_constant:
            return value.to_tensor()
        return None

    def constant_ints(self, i: int, what: str) -> list[int] | None:
        """Input ``i`` as a list of ints when present (an import-time constant is required)."""
        if not self.has_input(i):
            return None
        t = self.constant(i)
        if t is None:
            raise self.unsupported(f"{what} (input {i}, {self.node.input[i]!r}) computed at run time")
        return [int(v) for v in t.reshape(-1).tolist()]

    def rank(self, i: int) -> int | None:
        return self.builder.rank_of(self.node.input[i]) if self.has_input(i) else None

    def require_rank(self, i: int) -> int:
        rank = self.rank(i)
        if rank is None:
            raise self.unsupported(f"input {i} ({self.node.input[i]!r}) of unknown rank")
        return rank

    def static_shape(self, i: int) -> list[int | None] | None:
        return self.builder.static_shape_of(self.node.input[i]) if self.has_input(i) else None

    def dtype(self, i: int) -> torch.dtype | None:
        return self.builder.dtype_of(self.node.input[i]) if self.has_input(i) else None

    def output_rank(self, j: int = 0) -> int | None:
        return self.builder.rank_of(self.node.output[j])

    def output_dtype(self, j: int = 0) -> torch.dtype | None:
        return self.builder.dtype_of(self.node.output[j])

    # -- attributes ------------------------------------------------------------------------------

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    # -- emitting --------------------------------------------------------------------------------

    def call(self, target: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``target(*args, **kwargs)`` as a graph node, or its value when all arguments are constants."""
        return self.builder.call("call_function", target, args, kwargs)

    def create(self, target: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A tensor-creating call (``torch.arange``, ``torch.full``): folded like :meth:`call`, else made on
        the device of the graph inputs (torch would make it on the default device)."""
        return self.builder.call("call_function", target, args, kwargs, creates_tensor=True)

    def method(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``args[0].name(*args[1:], **kwargs)``, folded like :meth:`call`."""
        return self.builder.call("call_method", name, args, kwargs)

    def node(self, value: Value) -> fx.Node:
        return self.builder.as_node(value, self._hint())

    def size(self, value: Value, dim: int) -> Item:
        """The run-time size of ``value`` along ``dim`` (an int when ``value`` is a constant)."""
        if isinstance(value, torch.Tensor):
            return int(value.shape[dim])
        if isinstance(value, ShapeValue):
            return len(value.items)
        return self.builder.size(value, dim)

    def _hint(self) -> str:
        return self.node.output[0] if self.node.output else self.name


def _attribute_value(attr: onnx.AttributeProto) -> Any:
    value = onnx.helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, onnx.TensorProto):
        return tensor_from_proto(value)
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode("utf-8") for v in value]
    return value
