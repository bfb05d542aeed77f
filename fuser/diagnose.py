"""Per-layer accuracy of an optimized model: each fused op against its own float64 reference.

A whole-model error says whether something is off; this says where. Each fused module's inputs are
recorded during one forward pass, then its output (on the backend it ran on) is compared with the same
folded computation done in float64 by the torch reference.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fuser.lower import ops
from fuser.lower.fused_modules import FusedConv2d, FusedLinear


@dataclass(frozen=True)
class LayerError:
    name: str
    source: str
    epilogue: str
    rel_error: float


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out64).all():
        return float("inf")
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-300)).item()


Inputs = tuple[tuple[Any, ...], dict[str, Any]]


def recorded_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Inputs:
    """A fused module's call inputs as a forward hook (``with_kwargs=True``) sees them, detached, for a
    float64 re-run: the keywords that say what it computes (a virtual concatenation's ``cat_with``, a
    channel scale), not ``out``, the cat buffer slot it stored into, which the re-run must not write."""
    detach = lambda v: v.detach() if isinstance(v, torch.Tensor) else v
    return tuple(detach(a) for a in args), {k: detach(v) for k, v in kwargs.items() if k != "out"}


def run_in_float64(module: nn.Module, inputs: Inputs) -> torch.Tensor:
    """``module``'s float64 copy on ``inputs`` (see :func:`recorded_inputs`), with the torch reference."""
    double = lambda v: v.cpu().double() if isinstance(v, torch.Tensor) else v
    args, kwargs = inputs
    reference = copy.deepcopy(module).cpu().double()
    with torch.no_grad(), ops.decomposed():
        return reference(*(double(a) for a in args), **{k: double(v) for k, v in kwargs.items()})


@torch.no_grad()
def layer_errors(optimized: nn.Module, *inputs: Any) -> list[LayerError]:
    """Relative error of every fused module's output against its float64 reference, in execution order."""
    fused = [(n, m) for n, m in optimized.named_modules() if isinstance(m, (FusedConv2d, FusedLinear))]
    seen: dict[str, tuple[Inputs, torch.Tensor]] = {}
    handles = []
    for name, module in fused:

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor, name: str = name) -> None:
            seen.setdefault(name, (recorded_inputs(args, kwargs), output.detach()))

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        optimized(*inputs)
    finally:
        for h in handles:
            h.remove()
    errors = []
    modules = dict(fused)
    for name, (inputs, output) in seen.items():
        expected = run_in_float64(modules[name], inputs)
        m = modules[name]
        errors.append(LayerError(name, m.source, m.epilogue.describe(m.bias is not None), _rel_error(output, expected)))
    return errors
