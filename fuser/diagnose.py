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


@torch.no_grad()
def layer_errors(optimized: nn.Module, *inputs: Any) -> list[LayerError]:
    """Relative error of every fused module's output against its float64 reference, in execution order."""
    fused = [(n, m) for n, m in optimized.named_modules() if isinstance(m, (FusedConv2d, FusedLinear))]
    seen: dict[str, tuple[tuple[Any, ...], torch.Tensor]] = {}
    handles = []
    for name, module in fused:

        def hook(module: nn.Module, args: tuple, output: torch.Tensor, name: str = name) -> None:
            seen.setdefault(name, (tuple(a.detach() for a in args), output.detach()))

        handles.append(module.register_forward_hook(hook))
    try:
        optimized(*inputs)
    finally:
        for h in handles:
            h.remove()
    errors = []
    modules = dict(fused)
    for name, (args, output) in seen.items():
        reference = copy.deepcopy(modules[name]).cpu().double()
        with ops.decomposed():
            expected = reference(*(a.cpu().double() for a in args))
        m = modules[name]
        errors.append(LayerError(name, m.source, m.epilogue.describe(), _rel_error(output, expected)))
    return errors
