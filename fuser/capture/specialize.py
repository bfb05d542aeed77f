"""Shape-specialized tracing: a forward that reads its input's sizes as Python numbers, traced for the example
inputs' sizes and run behind a guard on them.

Why: torch.fx traces symbolically, so ``int(x.shape[-1])``, ``if h % s == 0`` or ``max(k - h % s, 0)`` on a
size fails, and every model that computes TensorFlow's "same" padding in its forward does that: timm's
Conv2dSame (the tf_* models), transformers' MobileNetV1/V2 (``tf_padding``). Each such conv used to run
unfused. Given example inputs, fuser traces the model again with every traced value carrying a fake tensor of
its example shape (torch's FakeTensorMode: shapes and dtypes, no data), so a size read gives a Python number
and the graph holds the result as a constant. Values computed from the data stay symbolic, so branching on them
still fails, as it must. The forward is traced as called with the example inputs alone: its later parameters
take their defaults as constants (``return_dict=None``), as such a call does.

The batch is a symbol in that trace, so a size of the batch stays a traced ``x.size(0)`` and ``int()`` of it
fails; a second trace one batch larger checks that the graph holds no batch all the same (a fake op may fix
it). Such a graph computes the model only for inputs of the traced sizes past the batch: :class:`ShapeGuard`
runs it for those and a CPU copy of the model as it was for any other, with a warning that names both shapes.
It is used only for image models (floating-point inputs of four or more dimensions), whose size is fixed where
they are deployed, and only where it leaves fewer modules untraced (:func:`prefer_specialized`).
"""

from __future__ import annotations

import copy
import inspect
import itertools
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext, is_concrete_int
from torch.fx.node import map_aggregate

try:  # private to torch.fx (since torch 2.1): lets a fake run inside a trace call the real nn.Module methods
    from torch.fx._symbolic_trace import _maybe_revert_all_patches
except ImportError:  # a torch without it keeps the symbolic capture (capture_specialized gives None)
    _maybe_revert_all_patches = None

from fuser.capture.tracing import (
    Capture,
    CapturedGraph,
    SequenceProxy,
    SourceTracer,
    _named_parameters_only,
    _trace,
    _visit,
    _worth_tracing,
    trace_around_failures,
)
from fuser.graph_ops import fetch_attr

EXAMPLE_VALUE = "fuser_example_value"  # node.meta key: the fake value a node computes on the example inputs
SIZE_READ = "fuser_size_read"  # node.meta key: a size of the batch read by a ShapeProxy
_UNKNOWN = object()  # a value the fake run could not compute (a data-dependent shape, an unsupported op)


class ShapeProxy(fx.Proxy):
    """A traced value whose sizes are known: ``shape``, ``size()``, ``dim()``, ``ndim`` and ``numel()`` give
    Python numbers (and ``len`` and iteration where the first dimension is not the batch); a size that follows
    the batch stays a traced ``x.size(i)``, so the graph works for any batch. Everything else is traced as usual.
    """

    def _value(self) -> Any:
        return self.node.meta.get(EXAMPLE_VALUE, _UNKNOWN)

    def _tensor(self) -> torch.Tensor | None:
        value = self._value()
        return value if isinstance(value, torch.Tensor) else None

    def _size(self, t: torch.Tensor, i: int) -> Any:
        size = t.shape[i]
        if is_concrete_int(size):
            return int(size)
        proxy = self.tracer.create_proxy("call_method", "size", (self, i), {})
        proxy.node.meta[SIZE_READ] = True  # erased after the trace where unused (x.shape[-2:] reads all)
        return proxy

    def _sizes(self, t: torch.Tensor) -> Any:
        sizes = tuple(self._size(t, i) for i in range(t.dim()))
        return torch.Size(sizes) if all(isinstance(s, int) for s in sizes) else sizes

    @property
    def shape(self) -> Any:
        t = self._tensor()
        return fx.Proxy.__getattr__(self, "shape") if t is None else self._sizes(t)

    @property
    def ndim(self) -> Any:
        t = self._tensor()
        return fx.Proxy.__getattr__(self, "ndim") if t is None else t.ndim

    def size(self, *dim: Any) -> Any:
        t = self._tensor()
        if t is None:
            return fx.Proxy.__getattr__(self, "size")(*dim)
        return self._sizes(t) if not dim else self._size(t, dim[0])

    def dim(self) -> Any:
        t = self._tensor()
        return fx.Proxy.__getattr__(self, "dim")() if t is None else t.dim()

    def numel(self) -> Any:
        t = self._tensor()
        if t is None or not is_concrete_int(t.numel()):
            return fx.Proxy.__getattr__(self, "numel")()
        return int(t.numel())

    def _length(self) -> int | None:
        value = self._value()
        if isinstance(value, (tuple, list)):
            return len(value)
        if isinstance(value, torch.Tensor) and value.dim() and is_concrete_int(value.shape[0]):
            return int(value.shape[0])
        return None

    def __len__(self) -> int:
        length = self._length()
        return super().__len__() if length is None else length

    def __iter__(self) -> Iterator[Any]:
        length = self._length()
        return super().__iter__() if length is None else iter([self[i] for i in range(length)])


def make_shape_tracer(examples: Sequence[torch.Tensor]) -> Callable[..., fx.Tracer]:
    """A factory of tracers (``(path, leaves)`` as :class:`~fuser.capture.tracing.SourceTracer`'s) whose
    values carry fake tensors of ``examples``' shapes: what :func:`~fuser.capture.tracing.trace_around_failures`
    calls for a shape-specialized trace of the module that ``examples`` are the inputs of."""
    # the batch (every input's first dimension) a symbol, the other sizes the example's: a size read of
    # those is a number, the batch's stays in the graph; batch 1 is not special-cased as torch.compile does
    # (parameters and buffers keep their sizes: static by default)
    shape_env = ShapeEnv(specialize_zero_one=False)
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=shape_env, static_shapes=True)
    fakes = [mode.from_tensor(t, static_shapes=False, symbolic_context=_batch_symbolic(t)) for t in examples]

    class ShapeTracer(SourceTracer):
        def __init__(self, prefix: str = "", leaves: frozenset[int] = frozenset()) -> None:
            super().__init__(prefix, leaves)
            self._placeholders = 0

        def create_args_for_root(self, root_fn: Any, is_module: bool, concrete_args: Any = None) -> Any:
            # traced as called with the example inputs alone: the parameters after them take their defaults
            # (return_dict=None) as constants, as such a call does, and the guard sends any other call elsewhere
            code = getattr(inspect.unwrap(root_fn), "__code__", None)
            count = int(is_module) + len(fakes)
            if code is not None and code.co_argcount >= count and concrete_args is None:
                root_fn = _named_parameters_only(root_fn, code.co_varnames[:count], keep_defaults=False)
            return fx.Tracer.create_args_for_root(self, root_fn, is_module, concrete_args)

        def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
            graph = super().trace(root, concrete_args)
            for node in list(graph.nodes):
                if node.meta.get(SIZE_READ) and not node.users:
                    graph.erase_node(node)
                node.meta.pop(EXAMPLE_VALUE, None)  # fake tensors belong to this trace only
                node.meta.pop(SIZE_READ, None)
            return graph

        def proxy(self, node: fx.Node) -> fx.Proxy:
            made = super().proxy(node)
            return made if isinstance(made, SequenceProxy) else ShapeProxy(node, self)

        def create_proxy(self, kind: str, target: Any, args: Any, kwargs: Any, *rest: Any, **named: Any) -> fx.Proxy:
            proxy = super().create_proxy(kind, target, args, kwargs, *rest, **named)
            proxy.node.meta[EXAMPLE_VALUE] = self._example(kind, target, args, kwargs)
            return proxy

        def _example(self, kind: str, target: Any, args: Any, kwargs: Any) -> Any:
            if kind == "placeholder":
                index, self._placeholders = self._placeholders, self._placeholders + 1
                return fakes[index] if index < len(fakes) else _UNKNOWN
            if kind == "get_attr":
                with _maybe_revert_all_patches():  # the patched nn.Module.__getattr__ would trace this read
                    value = fetch_attr(self.root, target)
                return mode.from_tensor(value) if isinstance(value, torch.Tensor) else value
            if kind not in ("call_function", "call_method", "call_module"):
                return _UNKNOWN
            if kind == "call_module" and not _is_torch_layer(self.root.get_submodule(target)):
                return _UNKNOWN  # a leaf of the model's own code is not run: its Python may have side effects
            missing = []

            def example(a: Any) -> Any:
                if isinstance(a, fx.Proxy):
                    value = a.node.meta.get(EXAMPLE_VALUE, _UNKNOWN)
                    if value is _UNKNOWN:
                        missing.append(a)
                    return value
                return a

            args, kwargs = map_aggregate(args, example), map_aggregate(kwargs, example)
            if missing:
                return _UNKNOWN
            try:
                # the tracer patches nn.Module's __call__ and __getattr__ while it traces: a leaf module's fake
                # run must call the real ones, or it would trace itself into the graph
                with _maybe_revert_all_patches(), mode:
                    if kind == "call_function":
                        return target(*args, **kwargs)
                    if kind == "call_method":
                        return getattr(args[0], target)(*args[1:], **kwargs)
                    return self.root.get_submodule(target)(*args, **kwargs)
            except Exception:  # a data-dependent size, an op without a fake kernel: the value stays unknown
                return _UNKNOWN

    return ShapeTracer


def _batch_symbolic(t: torch.Tensor) -> StatelessSymbolicContext:
    batch = [DimDynamic.DYNAMIC] if t.dim() else []
    return StatelessSymbolicContext(dynamic_sizes=batch + [DimDynamic.STATIC] * (t.dim() - 1))


def _is_torch_layer(module: nn.Module) -> bool:
    return type(module).__module__.startswith("torch.nn.")


@dataclass(frozen=True)
class Specialization:
    """The input shapes a shape-specialized graph computes the model for: ``shapes`` the example inputs'; with
    ``batch_free`` their first dimension may be any size, the same for every input."""

    shapes: tuple[tuple[int, ...], ...]
    batch_free: bool

    def accepts(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether a call with ``args`` and ``kwargs`` is one the graph computes."""
        if kwargs or len(args) != len(self.shapes):
            return False
        if not all(isinstance(a, torch.Tensor) and a.dim() == len(s) for a, s in zip(args, self.shapes, strict=True)):
            return False
        if not self.batch_free:
            return all(tuple(a.shape) == s for a, s in zip(args, self.shapes, strict=True))
        batch = args[0].shape[0]
        return all(a.shape[0] == batch and tuple(a.shape[1:]) == s[1:] for a, s in zip(args, self.shapes, strict=True))

    def describe(self, shapes: Sequence[Sequence[int]] | None = None) -> str:
        """``(*, 3, 67, 61)``-style text of the accepted shapes (or of ``shapes``), the batch a ``*`` where free."""
        if shapes is not None:
            return ", ".join(str(tuple(s)) for s in shapes)
        star = lambda s: "(" + ", ".join(["*", *map(str, s[1:])]) + ")" if self.batch_free else str(s)
        return ", ".join(star(s) for s in self.shapes)


def specialization_of(
    examples: Sequence[torch.Tensor], traced: fx.GraphModule, trace: Callable[[Sequence[torch.Tensor]], fx.GraphModule]
) -> Specialization:
    """The guard of ``traced``, the graph that ``trace`` made of ``examples``: batch-free where tracing inputs
    with a batch one larger gives the same code and the same constants."""
    shapes = tuple(tuple(t.shape) for t in examples)
    if any(t.dim() == 0 for t in examples) or len({s[0] for s in shapes}) != 1:
        return Specialization(shapes, False)
    with FakeTensorMode():
        larger = [torch.empty((t.shape[0] + 1, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in examples]
    try:
        second = trace(larger)
    except Exception:  # the forward refuses the other batch: keep the example's
        return Specialization(shapes, False)
    return Specialization(shapes, _same_graph(traced, second))


def _same_graph(a: fx.GraphModule, b: fx.GraphModule) -> bool:
    """Same code and the same trace-time constants (a size read can make a constant tensor: ``arange(h)``)."""
    if a.code != b.code:
        return False
    constants = lambda gm: {n: t for n, t in gm.named_buffers() if n.rpartition(".")[2].startswith("_tensor_constant")}
    ca, cb = constants(a), constants(b)
    return ca.keys() == cb.keys() and all(
        ca[n].shape == cb[n].shape and ca[n].dtype == cb[n].dtype and torch.equal(ca[n], cb[n]) for n in ca
    )


class ShapeGuard(nn.Module):
    """Runs ``graph`` (the optimized shape-specialized trace) on the calls ``specialization`` accepts, and the
    model as it was before optimizing on any other, warning once per new set of shapes.

    ``original`` is a copy of the model on the CPU (:func:`cpu_copy`), kept outside the state dict and outside
    ``.to()``: it costs host memory only, until a call of another shape needs it on that call's device (then
    it is copied there once, in the dtype the graph has by then)."""

    def __init__(self, graph: nn.Module, original: nn.Module, specialization: Specialization, name: str) -> None:
        super().__init__()
        self.graph = graph
        self.specialization = specialization
        self.name = name
        self._warned: set[tuple[Any, ...]] = set()
        # plain attributes, not submodules: out of state_dict(), parameters() and .to()
        object.__setattr__(self, "_original", original)
        object.__setattr__(self, "_dtype", _floating_dtype(graph))
        object.__setattr__(self, "_placed", {})

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.specialization.accepts(args, kwargs):
            return self.graph(*args)
        shapes = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args)
        if (shapes, tuple(kwargs)) not in self._warned:
            self._warned.add((shapes, tuple(kwargs)))
            called = self.specialization.describe([s for s in shapes if isinstance(s, tuple)])
            keywords = f" with keyword arguments {', '.join(kwargs)}" if kwargs else ""
            warnings.warn(
                f"fuser: {self.name} was optimized for inputs of shape {self.specialization.describe()} (its forward "
                f"reads their sizes, so its graph holds them); this call's {called}{keywords} runs the original "
                "model, unoptimized. Pass example inputs of the shape you run to fuser.optimize().",
                RuntimeWarning,
                stacklevel=2,
            )
        return self._original_on(args)(*args, **kwargs)

    def _original_on(self, args: tuple[Any, ...]) -> nn.Module:
        """The original model on the device of the call's first tensor, in the graph's floating dtype now."""
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        dtype = _floating_dtype(self.graph)
        placed = self._placed.get((device, dtype))
        if placed is None:
            placed = copy.deepcopy(self._original).to(device)
            if dtype is not None and dtype != self._dtype:  # the optimized model was converted since
                placed = placed.to(dtype)
            self._placed[(device, dtype)] = placed
        return placed

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        self._placed.clear()  # placed for the device and dtype before
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"inputs {self.specialization.describe()}"


def _floating_dtype(module: nn.Module) -> torch.dtype | None:
    tensors = itertools.chain(module.parameters(), module.buffers())
    return next((t.dtype for t in tensors if t.is_floating_point()), None)


def cpu_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` with its parameters and buffers on the CPU, copied there directly (a copy on
    the GPU first would hold the model's memory twice there)."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        copied = t.detach().to("cpu", copy=True)
        memo[id(t)] = nn.Parameter(copied, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else copied
    return copy.deepcopy(module, memo)


def capture_specialized(model: nn.Module, example_inputs: tuple[Any, ...], keep: frozenset[int]) -> Capture | None:
    """The capture of ``model`` whose root graph is traced shape-specialized on ``example_inputs`` (its leaves
    as :func:`~fuser.capture.tracing.capture` would), with the submodules whose ids are in ``keep`` left leaves
    (the detect heads, which fuser rewrites in place); None where the inputs are not all tensors or the root
    still fails to trace."""
    if _maybe_revert_all_patches is None or not example_inputs:
        return None
    if not all(isinstance(t, torch.Tensor) for t in example_inputs):
        return None
    try:
        gm, leaves = trace_around_failures(model, "", make_shape_tracer(example_inputs), keep)
    except Exception:
        return None
    leaf_ids = frozenset(id(m) for _, m in leaves)
    retrace = lambda examples: _trace(make_shape_tracer(examples)("", leaf_ids), model)
    result = Capture(root=model, specialization=specialization_of(example_inputs, gm, retrace))
    result.graphs.append(CapturedGraph("", model, gm))
    for name, leaf in leaves:
        if _worth_tracing(leaf):
            _visit(result, leaf, name)
    return result


def prefer_specialized(generic: Capture, model: nn.Module, example_inputs: Any, keep: frozenset[int]) -> Capture:
    """``generic`` (the symbolic capture), unless the inputs are images and a shape-specialized capture leaves
    fewer modules untraced and the batch free. Only where tracing failed somewhere is a graph worth tying to
    the example's sizes, and only for inputs whose sizes past the batch are fixed where the model is deployed:
    an image model runs one image size (floating-point inputs of four or more dimensions), while a text or
    audio model's sequence length changes from call to call, and its calls would mostly run unoptimized."""
    kept = {name or "(model)" for name, m in model.named_modules() if id(m) in keep}
    if example_inputs is None or all(u.path in kept for u in generic.untraced):
        return generic  # traced whole, or only the kept leaves (ultralytics' heads) were not
    if not all(isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 4 for t in example_inputs):
        return generic
    specialized = capture_specialized(model, tuple(example_inputs), keep)
    if specialized is None or specialized.specialization is None or not specialized.specialization.batch_free:
        return generic
    return specialized if len(specialized.untraced) < len(generic.untraced) else generic
