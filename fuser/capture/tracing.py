"""Capture: the model as torch.fx graphs, the whole model when it traces, else its largest traceable parts.

Real models often do not trace as a whole (a detection head that compares shapes, data-dependent control
flow). Where the failure lies inside a submodule's forward, that submodule becomes a leaf (one opaque call)
and the module is traced again, so the code around it (ultralytics' routing of a backbone and neck by
``m.f``) stays one graph and the rewrites that span blocks (a neck's upsample -> concat -> conv) see it;
each leaf is then captured on its own, the same way. Where the module's own code fails, every child module
is tried in turn, recursing into those that fail, so each conv -> BN -> act block still lands in some
graph; what could not be traced is recorded with the reason.

The tracer also knows how many values a ``chunk(n)``, ``split([sizes])`` or ``tensor_split`` returns, so a
forward may iterate over them (``list(x.chunk(2, 1))``, as ultralytics' C2f does), which plain torch.fx
refuses. ``chunk(n)`` returns fewer than ``n`` pieces where the dimension is shorter than ``n``: the traced
graph then raises an IndexError where it takes a piece that is not there, and shape propagation checks the
count on the example inputs.

A traced submodule is installed back into its parent by replacing that module's ``forward`` (an instance
attribute pointing at the graph module, which is registered as its child ``fused_graph``): the module keeps
its class, its plain attributes and its methods, so the parent's Python code (routing by ``m.f``,
``isinstance`` checks) runs exactly as before. Its own parameters, buffers and children go: the graph
module holds what the new forward reads, so the optimized model carries no dead weights.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import keyword
import operator
import pkgutil
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from fuser.graph_ops import unused_name

if TYPE_CHECKING:
    from fuser.capture.specialize import Specialization


@dataclass(frozen=True)
class UntracedModule:
    """A module torch.fx could not trace (its traceable children were traced instead).

    ``reason`` says in plain words why and what was done instead; ``detail`` is the first line of the
    underlying error, for a bug report.
    """

    path: str
    type_name: str
    reason: str
    detail: str = ""


# What the common torch.fx failures mean for the user's code: (a piece of the error's text, the sentence).
TRACE_FAILURES: list[tuple[str, str]] = [
    ("cannot be used as inputs to control flow", "its forward branches on a computed value (if, while, and, or)"),
    ("Proxy object cannot be iterated", "its forward loops over or unpacks a computed value (for, a, b = x, *x)"),
    ("'len' is not supported", "its forward calls len() on a computed value"),
    ("not 'Proxy'", "its forward turns a computed value into a Python number (int(), float(), a shape as int)"),
    ("co_varnames is too small", "its forward takes *args or **kwargs in a form torch.fx cannot trace"),
    ("is not installed as a submodule", "its forward calls a module that is not one of its submodules"),
    ("forward was replaced on the instance", "its forward was replaced on the instance by a function it cannot read"),
    ("writes into its buffer", "its forward writes into a buffer, which a traced graph would read as a constant"),
]


def explain_trace_failure(error: BaseException) -> str:
    """The plain sentence for a torch.fx failure, or a generic one naming the exception type."""
    text = str(error)
    for needle, sentence in TRACE_FAILURES:
        if needle in text:
            return sentence
    return f"torch.fx could not trace its forward ({type(error).__name__})"


@dataclass
class CapturedGraph:
    """One traced graph: the module at ``path`` of the working model (``""`` is the root)."""

    path: str
    module: nn.Module
    gm: fx.GraphModule
    example_inputs: tuple[Any, ...] | None = None


@dataclass
class Capture:
    """The traced graphs of a model and what could not be traced; ``specialization`` set where the root's
    graph holds the example inputs' sizes (fuser.capture.specialize)."""

    root: nn.Module
    graphs: list[CapturedGraph] = field(default_factory=list)
    untraced: list[UntracedModule] = field(default_factory=list)
    specialization: Specialization | None = None


def _positive(n: Any) -> int | None:
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def _sizes(sizes: Any) -> int | None:
    exact = isinstance(sizes, (list, tuple)) and all(isinstance(s, int) for s in sizes)
    return len(sizes) if exact else None


def _tensor_split(sections: Any) -> int | None:
    indices = _sizes(sections)
    return _positive(sections) if indices is None else indices + 1


# How many values a splitting call returns, from the argument after the tensor (by position or keyword).
# chunk's count is an upper bound taken as exact (the module's docstring says what guards it); the rest are
# exact; a split by one size depends on the shape and is not known.
_SPLIT_COUNTS: dict[Any, tuple[tuple[str, ...], Any]] = {
    torch.chunk: (("chunks",), _positive),
    "chunk": (("chunks",), _positive),
    torch.split: (("split_size_or_sections",), _sizes),
    "split": (("split_size", "split_size_or_sections"), _sizes),
    "split_with_sizes": (("split_sizes",), _sizes),
    torch.tensor_split: (("indices_or_sections", "sections", "indices"), _tensor_split),
    "tensor_split": (("indices_or_sections", "sections", "indices"), _tensor_split),
}


def split_count(node: fx.Node) -> int | None:
    """How many values ``node`` (a chunk, split or tensor_split with constant arguments) returns, else None."""
    if node.op not in ("call_function", "call_method"):
        return None
    try:
        names, count = _SPLIT_COUNTS[node.target]
    except (KeyError, TypeError):  # TypeError: a target that cannot be a key
        return None
    if len(node.args) > 1:
        return count(node.args[1])
    return next((count(node.kwargs[k]) for k in names if k in node.kwargs), None)


_VARARGS = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS


def _named_parameters_only(fn: Any, names: tuple[str, ...], keep_defaults: bool = True) -> Any:
    """A function of exactly the parameters ``names`` (with ``fn``'s defaults, where ``keep_defaults``) that
    calls ``fn`` with them: torch.fx reads a root's placeholders from its code object, so it must be a real
    function."""
    if not all(name.isidentifier() for name in names):
        return fn
    namespace: dict[str, Any] = {"_forward": fn}
    params = ", ".join(names)
    exec(f"def forward({params}):\n    return _forward({params})\n", namespace)
    forward = namespace["forward"]
    if keep_defaults:
        forward.__defaults__ = getattr(inspect.unwrap(fn), "__defaults__", None)
    return forward


class SequenceProxy(fx.Proxy):
    """A traced value known to be a sequence of ``length`` tensors: ``len`` and iteration give its items."""

    def __init__(self, node: fx.Node, tracer: fx.Tracer, length: int) -> None:
        super().__init__(node, tracer)
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[fx.Proxy]:
        return (self.tracer.create_proxy("call_function", operator.getitem, (self, i), {}) for i in range(self.length))


class SourceTracer(fx.Tracer):
    """A symbolic tracer that records, on each node, the qualified name of the module that created it.

    The modules in ``leaves`` are called, not traced into; ``failed`` is the innermost module whose forward
    raised during tracing (None when the traced module's own code did)."""

    def __init__(self, prefix: str = "", leaves: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self._scope: list[str] = [prefix]
        self._prefix = prefix
        self._leaves = leaves
        self.failed: nn.Module | None = None

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        try:
            path = self.path_of_module(m)
        except NameError:
            path = type(m).__name__
        self._scope.append(f"{self._prefix}.{path}" if self._prefix and path else (path or self._prefix))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed is None:
                self.failed = m
            raise
        finally:
            self._scope.pop()

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if id(m) in self._leaves:
            return True
        # A torch.nn layer whose forward was replaced on the instance does not compute what its type says.
        return "forward" not in m.__dict__ and super().is_leaf_module(m, module_qualified_name)

    def create_args_for_root(self, root_fn: Any, is_module: bool, concrete_args: Any = None) -> Any:
        # A forward(self, x, *args, **kwargs) (ultralytics' models) is traced as called with its named
        # parameters only: torch.fx would pass the rest as one value that the forward then unpacks.
        code = getattr(inspect.unwrap(root_fn), "__code__", None)
        if code is not None and code.co_flags & _VARARGS and not code.co_kwonlyargcount and concrete_args is None:
            root_fn = _named_parameters_only(root_fn, code.co_varnames[: code.co_argcount])
        return super().create_args_for_root(root_fn, is_module, concrete_args)

    def create_arg(self, a: Any) -> Any:
        # torch.fx stores a dict of traced values as a plain dict: a model returning transformers' ModelOutput
        # (a dataclass that is a dict) or an OrderedDict would lose its type, and outputs.last_hidden_state
        # would fail on the optimized model. Such a value is built again by build_mapping.
        name = _importable_name(type(a)) if isinstance(a, dict) and type(a) is not dict else None
        rebuilt = name is not None and (type(a) is OrderedDict or dataclasses.is_dataclass(a))
        if rebuilt and all(isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k) for k in a):
            fields = {k: self.create_arg(v) for k, v in a.items()}
            return self.create_node("call_function", build_mapping, (name,), fields)
        return super().create_arg(a)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        length = split_count(node)
        if length is not None:
            node.meta["split_count"] = length
            return SequenceProxy(node, self, length)
        return super().proxy(node)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        node.meta["source_module"] = self._scope[-1]
        return node


def _importable_name(cls: type) -> str | None:
    """``module.qualname`` of ``cls`` where importing it gives ``cls`` back, else None."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    return name if "<locals>" not in name and _import_name(name) is cls else None


@functools.cache
def _import_name(name: str) -> Any:
    """What the dotted ``name`` (a module, then attributes) refers to, or None (cached: build_mapping asks at
    every call of the graph)."""
    try:
        return pkgutil.resolve_name(name)
    except (ImportError, AttributeError, ValueError):
        return None


def build_mapping(type_name: str, **fields: Any) -> Any:
    """``cls(**fields)`` for the dict class named ``type_name`` (see SourceTracer.create_arg). Called with
    traced values (a GraphModule's unpickling traces its code again) it records itself, as torch.fx.wrap does."""
    proxies: list[fx.Proxy] = []
    fx.node.map_aggregate(fields, lambda v: proxies.append(v) if isinstance(v, fx.Proxy) else None)
    if proxies:
        return proxies[0].tracer.create_proxy("call_function", build_mapping, (type_name,), fields)
    return _import_name(type_name)(**fields)


class ReplacedForward(TypeError):
    """The module's instance runs a forward that is not a method of its class: fuser cannot trace it."""


class BufferWritten(RuntimeError):
    """The forward wrote into a buffer while being traced: torch.fx ran that write on the real tensor and
    recorded what the forward computed from it as a constant, so the graph would not compute the function."""


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter, which every in-place write moves; None for an inference tensor, which has
    none (and which nothing outside ``torch.inference_mode`` can write)."""
    return None if tensor.is_inference() else tensor._version


def _restore_written_buffers(before: list[tuple[str, torch.Tensor, int | None, torch.Tensor]]) -> str | None:
    """Put back the buffers written since ``before`` (name, buffer, its :func:`_version` then, a copy).
    Returns the first one's name, or None when none was."""
    written = None
    for name, buffer, version, value in before:
        if version is not None and buffer._version != version:
            with torch.no_grad():
                buffer.copy_(value)
            written = written or name
    return written


def forward_method_name(module: nn.Module) -> str:
    """The name of the method ``module`` runs when called: ``forward``, or the method of its class that was
    assigned to the instance (``m.forward = m.forward_fuse``, as ultralytics' ``fuse()`` does).

    torch.fx traces the class's ``forward`` of a root module; tracing that when the instance runs another
    method would optimize a function the model does not compute. Any other instance-level forward (a lambda,
    a method of another object) raises :class:`ReplacedForward`.
    """
    forward = module.__dict__.get("forward")
    if forward is None:
        return "forward"
    func = getattr(forward, "__func__", None)
    if getattr(forward, "__self__", None) is module and func is not None:
        name = getattr(func, "__name__", "")
        if getattr(type(module), name, None) is func:
            return name
    raise ReplacedForward(
        f"its forward was replaced on the instance by {forward!r}, which is not a method of "
        f"{type(module).__name__}, so fuser cannot tell what it computes"
    )


def trace(module: nn.Module, path: str = "", leaves: frozenset[int] = frozenset()) -> fx.GraphModule:
    """``torch.fx.symbolic_trace`` of the forward the instance runs, with source-module names on the nodes;
    the submodules whose ids are in ``leaves`` are called, not traced into.

    Attributes that a forward assigns while being traced (a cache of anchors, a remembered shape) would
    hold proxies afterwards; every module's attributes are put back as they were, traced or not.
    """
    return _trace(SourceTracer(path, leaves), module)


def _trace(tracer: SourceTracer, module: nn.Module) -> fx.GraphModule:
    saved = save_attributes(module)
    buffers = [(n, b, _version(b), b.detach().clone()) for n, b in module.named_buffers(remove_duplicate=False)]
    try:
        tracer.traced_func_name = forward_method_name(module)
        graph = tracer.trace(module)
        for node in graph.nodes:
            if isinstance(node.type, str):
                # A postponed annotation ("torch.Tensor" under `from __future__ import annotations`) would
                # reach the generated code's globals as a bare string, which GraphModule cannot pickle.
                node.type = None
        written = _restore_written_buffers(buffers)
        if written is not None:
            owner = written.rpartition(".")[0]
            tracer.failed = module.get_submodule(owner) if owner else None  # made a leaf, where it is not the root
            raise BufferWritten(f"the forward writes into its buffer `{written}` (in place, at every call)")
        gm = fx.GraphModule(tracer.root, graph, type(module).__name__)
        _keep_non_persistent(module, gm)
        _merge_trace_constants(gm)
        return gm
    finally:
        restore_attributes(saved)
        _restore_written_buffers(buffers)  # a trace that failed part way may have written one too


SavedAttributes = list[tuple[nn.Module, dict[str, Any], dict[str, Any]]]


def save_attributes(model: nn.Module) -> SavedAttributes:
    """What :func:`restore_attributes` needs to put every module's attributes back as they are now: each
    module's ``__dict__``, and the contents of its dicts, lists and sets, which a forward fills in place
    (timm's ``attention_bias_cache``: traced, it would keep a proxy, which then cannot be pickled)."""
    return [
        (m, dict(m.__dict__), {k: copy.copy(v) for k, v in m.__dict__.items() if type(v) in (dict, list, set)})
        for m in model.modules()
    ]


def restore_attributes(saved: SavedAttributes) -> None:
    """Put back what :func:`save_attributes` saved: the same containers, with their contents of then."""
    for m, attributes, contents in saved:
        m.__dict__.clear()
        m.__dict__.update(attributes)
        for name, content in contents.items():
            container = attributes[name]
            container.clear()
            if isinstance(container, list):
                container.extend(content)
            else:
                container.update(content)


def _keep_non_persistent(module: nn.Module, gm: fx.GraphModule) -> None:
    """Leave out of ``gm``'s state dict the buffers that ``module`` leaves out of its own (timm's LeViT index
    tables, torchvision's anchors): fx.GraphModule registers every tensor it copies as a persistent buffer."""
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for name in owner._non_persistent_buffers_set:
            target = f"{prefix}.{name}" if prefix else name
            holder_path, _, attr = target.rpartition(".")
            try:
                holder = gm.get_submodule(holder_path)
            except AttributeError:
                continue  # the graph does not read it
            if attr in holder._buffers:
                holder._non_persistent_buffers_set.add(attr)


def _merge_trace_constants(gm: fx.GraphModule) -> None:
    """Store equal trace-time constants once, out of the state dict.

    torch.fx keeps each tensor that the forward computes while traced (from a buffer, which it does not
    proxy, or from Python numbers) as a new ``_tensor_constantN`` of the graph module, one per tensor object:
    EVA-02's rotary sin and cos tables, computed again in every block, would be stored once per block. Equal
    ones become one attribute. They stay out of the state dict, as the buffers they come from mostly do
    (EVA-02's are ``persistent=False``): they are derived from what the model holds, not held by it.
    """
    kept: dict[tuple, list[str]] = {}
    merged: dict[str, str] = {}
    for name, tensor in list(gm.named_buffers(recurse=False)):
        if not name.startswith("_tensor_constant"):
            continue
        key = (tensor.shape, tensor.dtype, tensor.device, tensor.stride())
        same = next((k for k in kept.get(key, []) if torch.equal(gm.get_buffer(k), tensor)), None)
        if same is None:
            kept.setdefault(key, []).append(name)
            gm._non_persistent_buffers_set.add(name)
        else:
            merged[name] = same
    if merged:
        for node in gm.graph.nodes:
            if node.op == "get_attr" and node.target in merged:
                node.target = merged[node.target]
        for name in merged:
            delattr(gm, name)
        gm.recompile()


MAX_LEAVES = 16  # submodules made leaves before the module counts as untraceable (each costs a new trace)


def trace_around_failures(
    module: nn.Module,
    path: str = "",
    make_tracer: Callable[[str, frozenset[int]], SourceTracer] = SourceTracer,
    keep: frozenset[int] = frozenset(),
) -> tuple[fx.GraphModule, list[tuple[str, nn.Module]]]:
    """:func:`trace` of ``module`` by the tracers ``make_tracer(path, leaves)`` makes, making each submodule
    whose forward fails to trace a leaf and tracing again; the submodules whose ids are in ``keep`` are leaves
    from the start. Returns the graph and the leaves, by qualified name under ``module``. Raises the error of
    the last attempt where ``module``'s own code fails (or after :data:`MAX_LEAVES` leaves)."""
    names = {id(m): name for name, m in module.named_modules() if name}
    leaves: list[nn.Module] = [m for m in module.modules() if id(m) in keep and id(m) in names]
    while True:
        tracer = make_tracer(path, frozenset(id(m) for m in leaves))
        try:
            return _trace(tracer, module), [(names[id(m)], m) for m in leaves]
        except Exception:
            failed = tracer.failed
            if failed is None or id(failed) not in names or failed in leaves or len(leaves) >= MAX_LEAVES:
                raise
            leaves.append(failed)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict))


def _worth_tracing(module: nn.Module) -> bool:
    """False for torch.nn's own leaf layers: alone, a Conv2d or a ReLU holds no chain."""
    return next(module.children(), None) is not None or not type(module).__module__.startswith("torch.nn")


def capture(model: nn.Module) -> Capture:
    """Trace ``model`` (the working copy: tracing can leave proxies in attributes a forward assigns)."""
    result = Capture(root=model)
    _visit(result, model, "")
    return result


def _visit(result: Capture, module: nn.Module, path: str) -> None:
    """Capture ``module`` at ``path`` into ``result``: its graph (and then its leaves'), else its children's."""
    if not _is_container(module):
        try:
            gm, leaves = trace_around_failures(module, path)
        except Exception as error:  # any failure to trace means: try the children instead
            instead = (
                "its submodules were traced and optimized one by one instead"
                if any(_worth_tracing(c) for c in module.children())
                else "it runs as it is"
            )
            reason = f"{explain_trace_failure(error)}; {instead}"
            entry = UntracedModule(path or "(model)", type(module).__name__, reason, _first_line(error))
            result.untraced.append(entry)
        else:
            result.graphs.append(CapturedGraph(path, module, gm))
            for name, leaf in leaves:
                if _worth_tracing(leaf):
                    _visit(result, leaf, f"{path}.{name}" if path else name)
            return
    _visit_children(result, module, path)


def _visit_children(result: Capture, module: nn.Module, path: str) -> None:
    for name, child in module.named_children():
        if _worth_tracing(child):
            _visit(result, child, f"{path}.{name}" if path else name)


def propagate_shapes(model: nn.Module, capture: Capture, example_inputs: tuple[Any, ...]) -> None:
    """Run ``model`` on ``example_inputs``, recording shapes and dtypes on every traced graph's nodes.

    Each traced module runs its graph through a shape recorder for its first call, so one forward pass is
    at once the check that the model accepts the inputs and the shape propagation; the model's buffers and
    the random number generators are put back afterwards (a training-mode BatchNorm would otherwise move
    its running statistics). A traced graph that fails where its module's own forward runs is dropped from
    ``capture.graphs`` (reported in ``capture.untraced``): torch.fx traced something that is not the
    module's function. A module whose forward never runs (its parent iterates over its children, as
    ultralytics' models do over an ``nn.Sequential``) is dropped too, and its children are captured and
    run instead: installing its graph would take away the children its parent uses. An exception that the
    model's own code raises propagates: the model rejects these inputs.
    """
    pending = list(capture.graphs)
    while pending:
        broken, called, unbindable = _record_shapes(model, pending, example_inputs)
        for g in [g for g in pending if id(g) in broken]:
            capture.graphs.remove(g)
            reason = (
                "its traced graph fails where its forward runs (torch.fx recorded something other than what the "
                "forward computes on these inputs); it runs as it is"
            )
            capture.untraced.append(UntracedModule(g.path or "(model)", type(g.module).__name__, reason, broken[id(g)]))
        uncalled = [g for g in pending if g.path and id(g) not in called and id(g) not in broken]
        # A forward taking **kwargs is traced with its named parameters only; a parent that passes it more
        # (transformers' layers get position_ids) could not call the graph
        unbindable_graphs = [g for g in pending if g.path and id(g) in unbindable and id(g) not in broken]
        pending = []
        for g in uncalled + unbindable_graphs:
            if not any(c is g for c in capture.graphs):
                continue  # captured under another module replaced by its children just now
            capture.graphs = [c for c in capture.graphs if c is not g]
            if id(g) in unbindable:
                reason = (
                    f"it is called with keyword arguments ({unbindable[id(g)]}) that its traced forward does not "
                    "take; its submodules were traced and optimized one by one instead"
                )
            else:
                reason = (
                    "its forward does not run when the model runs (its parent uses its submodules directly); "
                    "its submodules were traced and optimized one by one instead"
                )
            # what was captured under it (its leaves) is captured again with the children
            inside = f"{g.path}."
            capture.graphs = [c for c in capture.graphs if not c.path.startswith(inside)]
            capture.untraced = [u for u in capture.untraced if not u.path.startswith(inside)]
            capture.untraced.append(UntracedModule(g.path, type(g.module).__name__, reason))
            start = len(capture.graphs)
            _visit_children(capture, g.module, g.path)
            pending += capture.graphs[start:]


def _record_shapes(
    model: nn.Module, graphs: list[CapturedGraph], example_inputs: tuple[Any, ...]
) -> tuple[dict[int, str], set[int], dict[int, str]]:
    """One example forward recording the shapes of ``graphs``; returns the graphs that failed (by id, with
    the error), those whose module was called, and those whose module was called with keyword arguments
    that the graph's forward does not take (by id, with their names)."""
    saved = save_attributes(model)  # a forward may cache what it computes
    # A training-mode forward moves BN running statistics (and dropout draws random numbers): this run
    # must leave the model's state exactly as it found it.
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    rng_devices = sorted({t.device.index or 0 for t in example_inputs if isinstance(t, torch.Tensor) and t.is_cuda})
    broken: dict[int, str] = {}
    called: set[int] = set()
    unbindable: dict[int, str] = {}
    for g in graphs:
        if g.path == "":
            continue

        def forward(*args: Any, g: CapturedGraph = g, eager: Any = g.module.forward, **kwargs: Any) -> Any:
            called.add(id(g))
            if kwargs and id(g) not in unbindable:
                taken = inspect.signature(g.gm.forward).parameters
                extra = [k for k in kwargs if k not in taken]
                if extra:
                    unbindable[id(g)] = ", ".join(extra)
            if g.example_inputs is None and not kwargs and id(g) not in broken:
                try:
                    result = _ShapeRecorder(g.gm).run(*args)
                    g.example_inputs = args
                    return result
                except Exception as error:
                    broken[id(g)] = _first_line(error)
            return eager(*args, **kwargs)

        object.__setattr__(g.module, "forward", forward)
    # cuDNN's benchmark mode would time every algorithm of each new conv shape in this forward, whose speed
    # nothing uses; a process whose first GPU work is optimize() would pay it for the original model's convs
    cudnn_benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=rng_devices):
            root = next((g for g in graphs if g.path == ""), None)
            if root is not None:
                try:
                    _ShapeRecorder(root.gm).run(*example_inputs)
                    root.example_inputs = example_inputs
                except Exception as error:
                    model(*example_inputs)  # raises if the model itself rejects the inputs
                    broken[id(root)] = _first_line(error)
            else:
                model(*example_inputs)
    finally:
        torch.backends.cudnn.benchmark = cudnn_benchmark
        restore_attributes(saved)
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
    return broken, called, unbindable


class _ShapeRecorder(fx.Interpreter):
    """Runs a graph and stores each tensor result's shape, dtype and layout in ``node.meta["tensor_meta"]``;
    a chunk that returns fewer pieces than the trace took (see the module's docstring) is an error here."""

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        count = n.meta.get("split_count")
        if count is not None and len(result) != count:
            raise ValueError(f"{n.name} ({n.target}) returned {len(result)} pieces, the trace took {count}")
        if isinstance(result, torch.Tensor):
            n.meta["tensor_meta"] = _extract_tensor_metadata(result)
        return result


def install(capture: Capture, graph: CapturedGraph, optimized: fx.GraphModule) -> nn.Module:
    """Put ``optimized`` in place of ``graph``'s module; returns the model's new root (``optimized`` itself
    for the root's graph, whose leaves keep the modules that the graphs installed after it change)."""
    if graph.path == "":
        capture.root = optimized
        return optimized
    module = graph.module
    name = unused_name(module, "fused_graph")
    # What the graph reads it holds itself (the same tensors and submodules); the module's own parameters,
    # buffers and children are dead weight once the graph is its forward (the replaced convs and BNs).
    for dead in [*module._parameters, *module._buffers, *module._modules]:
        delattr(module, dead)
    module.add_module(name, optimized)
    # An instance attribute shadows the class's forward; nn.Module.__call__ then runs the graph.
    object.__setattr__(module, "forward", optimized.forward)
    return capture.root
