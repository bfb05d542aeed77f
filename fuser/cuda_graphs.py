"""CUDA graphs for an optimized model: one launch of a recorded graph instead of one launch per kernel.

At batch 1 a CNN's forward is dominated by launch overhead, not arithmetic (ANCHORS.md: every YOLO layer
takes 0.03-0.09 ms at batch 1). :class:`GraphReplay` records the forward once per input signature (shapes,
dtypes, devices) and afterwards replays it: the inputs are copied into the recorded buffers, the graph is
replayed, and the outputs are returned as fresh tensors (a clone each, so a later call never overwrites a
result the caller still holds). Inputs that are not all CUDA tensors run the module normally.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

_MAX_GRAPHS = 4  # distinct input signatures kept; each graph holds its own memory pool


def _signature(inputs: tuple[Any, ...]) -> tuple | None:
    """What a recorded graph is valid for, or None when the inputs are not all CUDA tensors."""
    if not inputs or not all(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs):
        return None
    return tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in inputs)


class _Recorded:
    def __init__(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], warmup: int) -> None:
        self.inputs = tuple(t.clone() for t in inputs)
        stream = torch.cuda.Stream(device=inputs[0].device)
        stream.wait_stream(torch.cuda.current_stream(inputs[0].device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):  # compiles and tunes the kernels: none of that may happen while recording
                module(*self.inputs)
        torch.cuda.current_stream(inputs[0].device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = module(*self.inputs)

    def replay(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        for static, new in zip(self.inputs, inputs, strict=True):
            static.copy_(new)
        self.graph.replay()
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self.outputs)


class GraphReplay:
    """Calls ``module`` by replaying a CUDA graph recorded on the first call with each input signature.

    Replays only under ``torch.no_grad()`` / ``torch.inference_mode()`` (a replayed graph records no
    autograd history); otherwise, and for non-CUDA inputs, it calls the module. The recorded graphs are not
    pickled; a loaded module records them again on first use.
    """

    def __init__(self, module: nn.Module, warmup: int = 2) -> None:
        self.module = module
        self.warmup = warmup
        self._recorded: dict[tuple, _Recorded] = {}

    def __call__(self, *inputs: Any) -> Any:
        key = _signature(inputs)
        if key is None or torch.is_grad_enabled():
            return self.module(*inputs)
        recorded = self._recorded.get(key)
        if recorded is None:
            if len(self._recorded) >= _MAX_GRAPHS:
                self._recorded.pop(next(iter(self._recorded)))
            recorded = self._recorded[key] = _Recorded(self.module, inputs, self.warmup)
        return recorded.replay(inputs)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_recorded"] = {}
        return state
