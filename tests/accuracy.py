"""Shared accuracy helpers: one tolerance table, a float64 reference, named odd shapes.

Every numerical test compares against a float64 reference by ||out - ref|| / ||ref|| within the
tolerance table (fuser.verification.TOLERANCE). NaN never passes. Shapes are odd and unaligned on purpose:
power-of-two sizes hide masking and indexing bugs.
"""

from __future__ import annotations

import copy

import torch

from fuser.models.common import randomize_batchnorm  # noqa: F401  (re-exported for tests)
from fuser.verification import TOLERANCE

# Odd, unaligned sizes (the test matrix); power-of-two sizes only where a real model has them.
CHANNELS = [3, 5, 19]
IMAGE_SIZES = [(7, 7), (13, 13), (21, 19)]
GEMM_M = [1, 7, 33]
GEMM_KN = [(19, 21), (45, 13), (64, 37)]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out holds a NaN or inf that ref does not."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if out64.shape != ref64.shape:
        raise AssertionError(f"shape mismatch: {tuple(out64.shape)} vs reference {tuple(ref64.shape)}")
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / (denom if denom > 0 else 1.0)


def assert_close(out: torch.Tensor, ref: torch.Tensor, precision: str = "ieee", what: str = "") -> None:
    """Fail unless rel_error(out, ref) is under TOLERANCE[precision]."""
    err = rel_error(out, ref)
    bound = TOLERANCE[precision]
    assert err < bound, f"{what}: relative error {err:.3e} >= {bound:.0e} ({precision})"


def reference64(model: torch.nn.Module, *inputs: torch.Tensor):
    """The original model run in float64 on a copy: the oracle every optimized output is compared with."""
    with torch.no_grad():
        return copy.deepcopy(model).double()(*(t.double() if t.is_floating_point() else t for t in inputs))


def optimize_and_compare(model: torch.nn.Module, *inputs: torch.Tensor):
    """``fuser.optimize(model)`` (torch backend), its output (or each of a tuple's) checked against
    :func:`reference64` within the ieee tolerance; returns the optimized module."""
    import fuser

    opt = fuser.optimize(model, inputs, backend="torch")
    with torch.no_grad():
        out, ref = opt(*inputs), reference64(model, *inputs)
    for o, r in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,), strict=True):
        assert_close(o, r, "ieee")
    return opt


def fused_ops(opt) -> list[list[str]]:
    """The ops of each fused chain of an optimized module, in the report's order."""
    return [e.ops for e in opt.fusion_report.fused]
