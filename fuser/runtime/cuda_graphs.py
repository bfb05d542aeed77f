"""CUDA graphs for an optimized model: one launch of a recorded graph instead of one launch per kernel.

At batch 1 a CNN's forward is dominated by launch overhead, not arithmetic (every YOLO layer takes
0.03-0.09 ms at batch 1 on an H200). :class:`GraphReplay` records the forward once per input signature
(shapes, strides, dtypes, devices) and afterwards replays it: the inputs are copied into the recorded
buffers, the graph is replayed, and the outputs are returned as fresh tensors (a clone each, so a later call
never overwrites a result the caller still holds).

It replays only CUDA inputs under ``torch.no_grad()`` / ``torch.inference_mode()`` (a replayed graph records
no autograd history); everything else calls the module. At most :data:`MAX_GRAPHS` signatures are kept, each
graph with its memory, the least recently used dropped first; once as many have been dropped, a model whose
input shapes keep changing replays the kept ones and runs new ones plainly (recording each would cost more
than it saves). A graph is valid only for the tensors it was recorded with and on the device it was
recorded on: the signature holds the device, and moving or casting the model (``.to()``, ``.half()``, ...)
drops every graph, which are recorded again on the next call.

Forward hooks and pre-hooks are Python, which a replay does not run: a model with hooks on any of its
modules runs plainly. The hooks are looked for when the model was built, moved or recorded, and whenever a
hook is added to or removed from a fused module (as fuser's own diagnostics do); a hook added afterwards to
another submodule of an already recorded model is not seen (``cuda_graphs=False`` then).

A forward that cannot be recorded (a host sync, a copy from pageable CPU memory, ...) is not an error: the
model runs with plain launches from then on, after one warning that names the reason. An exception the
forward itself raises is the caller's, as it would be without graphs.

The recording itself goes through a :class:`CudaCapture`, the only code here that touches ``torch.cuda``'s
graph API, so a test can put a stub in its place and check the replay logic on the CPU.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.modules import module as _module
from torch.utils._pytree import tree_map

MAX_GRAPHS = 4  # distinct input signatures kept; each graph holds its own memory pool

_generation = 0


def invalidate() -> None:
    """Every graph recorded so far is stale: called when a fused module's tensors are replaced (moved,
    cast, repacked), since a graph replays the addresses it recorded, and when its hooks change."""
    global _generation
    _generation += 1


def _has_hooks(module: nn.Module) -> bool:
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


class Graph(Protocol):
    def replay(self) -> None: ...


class CudaCapture:
    """Warms up and records a forward on CUDA."""

    def accepts(self, inputs: tuple[Any, ...]) -> bool:
        """Whether a graph can replay a call with these inputs: all of them CUDA tensors on one device."""
        if not inputs or not all(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs):
            return False
        return len({t.device for t in inputs}) == 1

    def warm_up(self, forward: Callable[[], Any], device: torch.device, runs: int) -> None:
        """Run ``forward`` on a side stream: compiling and tuning kernels may not happen while recording."""
        with torch.cuda.device(device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(runs):
                    forward()
            torch.cuda.current_stream().wait_stream(stream)

    def record(self, forward: Callable[[], Any], device: torch.device) -> tuple[Graph, Any]:
        """The graph of one call of ``forward`` and that call's outputs (the buffers a replay writes)."""
        with torch.cuda.device(device):
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    outputs = forward()
            except BaseException:
                _unmark_random_generator(torch.cuda.current_device())
                raise
        return _OnDevice(graph, device), outputs


def _unmark_random_generator(index: int) -> None:
    """Put back, unmarked, the default random generator of device ``index`` after a recording that failed.

    torch marks the generator as capturing when a recording begins and unmarks it only when the recording ends
    cleanly; after a failed one (a host sync in the forward, say) every later random op on that device, the
    user's ``torch.randn`` included, fails with "Offset increment outside graph capture encountered
    unexpectedly" (seen on torch 2.11). A clone of the generator's state has the same seed and offset and is
    not marked. Graphs recorded earlier keep the old state object, which matters only to graphs that draw
    random numbers, and an inference forward draws none."""
    generator = torch.cuda.default_generators[index]
    if hasattr(generator, "clone_state"):  # torch 2.2 and later
        generator.graphsafe_set_state(generator.clone_state())


class _OnDevice:
    """A CUDA graph replayed on the device it was recorded on, whatever the current device is."""

    def __init__(self, graph: torch.cuda.CUDAGraph, device: torch.device) -> None:
        self.graph, self.device = graph, device

    def replay(self) -> None:
        with torch.cuda.device(self.device):
            self.graph.replay()


def _signature(inputs: tuple[torch.Tensor, ...]) -> tuple:
    return tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in inputs)


def _fresh(outputs: Any) -> Any:
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, outputs)


class _Recorded:
    """One recorded call: its input buffers, its graph and its output buffers."""

    def __init__(self, inputs: tuple[torch.Tensor, ...], graph: Graph, outputs: Any) -> None:
        self.inputs, self.graph, self.outputs = inputs, graph, outputs
        self.generation = _generation

    def replay(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        for static, new in zip(self.inputs, inputs, strict=True):
            static.copy_(new)
        self.graph.replay()
        return _fresh(self.outputs)


class GraphReplay:
    """Calls ``module`` by replaying a CUDA graph recorded on the first call with each input signature.

    ``capture`` records the graphs (:class:`CudaCapture` unless a test gives a stub); ``warmup`` calls run
    before each recording. After a failed recording, :attr:`failure` holds the reason and every call runs
    the module directly. The recorded graphs are not pickled; a loaded module records them again.
    """

    def __init__(self, module: nn.Module, warmup: int = 2, capture: CudaCapture | None = None) -> None:
        self.module = module
        self.warmup = warmup
        self.capture = CudaCapture() if capture is None else capture
        self.failure: str | None = None
        self._recorded: OrderedDict[tuple, _Recorded] = OrderedDict()
        self._hooked: tuple[int, bool] | None = None  # (generation, whether the module had hooks then)
        self._evictions = 0

    def __call__(self, *inputs: Any) -> Any:
        if self.failure is not None or torch.is_grad_enabled() or not self.capture.accepts(inputs):
            return self.module(*inputs)
        hooked = self._hooked
        if hooked is None or hooked[0] != _generation:
            hooked = self._hooked = (_generation, _has_hooks(self.module))
        if hooked[1]:
            return self.module(*inputs)
        key = _signature(inputs)
        recorded = self._recorded.get(key)
        if recorded is not None and recorded.generation != _generation:
            self.clear()
            recorded = None
        if recorded is None:
            if len(self._recorded) >= MAX_GRAPHS and self._evictions >= MAX_GRAPHS:
                return self.module(*inputs)  # the shapes keep changing: a recording would cost more than it saves
            recorded = self._record(key, inputs)
            if recorded is None:
                return self.module(*inputs)
        else:
            self._recorded.move_to_end(key)
        return recorded.replay(inputs)

    def _record(self, key: tuple, inputs: tuple[torch.Tensor, ...]) -> _Recorded | None:
        with torch.inference_mode(False):  # buffers a later call, in or out of inference mode, can write into
            static = tuple(t.clone() for t in inputs)
        device = inputs[0].device

        def forward() -> Any:
            return self.module(*static)

        self.capture.warm_up(forward, device, self.warmup)  # the forward's own errors are the caller's
        try:
            graph, outputs = self.capture.record(forward, device)
        except Exception as error:
            self.failure = f"{type(error).__name__}: {error}"
            warnings.warn(
                f"fuser: the forward of {type(self.module).__name__} cannot be recorded as a CUDA graph "
                f"({self.failure}); it runs with plain kernel launches from now on. "
                "fuser.optimize(..., cuda_graphs=False) skips the attempt.",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        while len(self._recorded) >= MAX_GRAPHS:
            self._recorded.popitem(last=False)
            self._evictions += 1
        recorded = self._recorded[key] = _Recorded(static, graph, outputs)
        return recorded

    def clear(self) -> None:
        """Forget every recorded graph (they are recorded again on the next calls)."""
        self._recorded.clear()
        self._hooked = None
        self._evictions = 0

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_recorded"] = OrderedDict()
        state["_hooked"] = None
        return state
