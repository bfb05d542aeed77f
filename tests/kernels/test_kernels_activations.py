"""The activation table (fuser.activations) on the kernel side: every row has its Triton function and named
constexpr, computes its formula in Triton's interpreter against float64, and is in every epilogue test."""

from __future__ import annotations

import pytest
import test_kernels_conv
import test_kernels_gemm
import test_kernels_gpu
import torch
import triton
import triton.language as tl
from accuracy import assert_close
from kernels_reference import EPILOGUES
from triton.runtime.jit import JITFunction

from fuser.activations import ACTIVATIONS, Activation
from fuser.kernels import epilogue as kernel_epilogue
from fuser.kernels.epilogue import apply_activation
from fuser.kernels.interpret import run_interpreted


@triton.jit
def _activation_kernel(x_ptr, y_ptr, n, alpha, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + offs, apply_activation(x, alpha, ACT), mask=offs < n)


def _inputs() -> torch.Tensor:
    """An odd-length vector over every regime: the bulk, the kinks (0, +-3), saturation (+-25) and tiny values."""
    g = torch.Generator().manual_seed(7)
    bulk = torch.randn(1013, generator=g) * 4
    edges = torch.tensor([0.0, -3.0, 3.0, -3.0001, 2.9999, 6.0, -25.0, 25.0, 19.9, 20.1, 1e-4, -1e-4, -87.0])
    return torch.cat([bulk, edges]).float()


ROWS = [pytest.param(row, id=row.name) for row in ACTIVATIONS]


@pytest.mark.parametrize("row", ROWS)
def test_row_has_its_triton_function_and_constexpr(row) -> None:
    function = getattr(kernel_epilogue, row.triton, None)
    assert isinstance(function, JITFunction), f"{row.name}: fuser.kernels.epilogue.{row.triton} is no @triton.jit"
    constexpr = getattr(kernel_epilogue, row.constexpr, None)
    assert isinstance(constexpr, tl.constexpr) and constexpr.value == int(row.act), row.constexpr


def test_table_has_one_row_per_member() -> None:
    assert [row.act for row in ACTIVATIONS] == list(Activation)
    for row in ACTIVATIONS:
        assert row.formula and callable(row.reference) and row.triton, row
        if row.act != Activation.NONE:
            assert row.modules and row.functions, f"{row.name}: no module or function form"


@pytest.mark.parametrize("row", ROWS)
def test_interpreted_activation_matches_float64(row) -> None:
    x = _inputs()
    alpha = 0.13 if row.alpha_arg else 0.0
    y = torch.empty_like(x)
    run_interpreted(
        _activation_kernel, (triton.cdiv(x.numel(), 256),), x, y, x.numel(), alpha, ACT=int(row.act), BLOCK=256
    )
    ref = row.reference(x.double(), alpha)
    assert_close(y, ref, "ieee", row.name)
    # elementwise too: a norm over 1026 values could hide a wrong regime of a few
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6, msg=row.name)


@pytest.mark.gpu
@pytest.mark.parametrize("row", ROWS)
def test_compiled_activation_matches_float64(row) -> None:
    """The same on a GPU: the named constexprs and the dispatch compile (triton 3.6 and newer)."""
    x = _inputs().cuda()
    alpha = 0.13 if row.alpha_arg else 0.0
    y = torch.empty_like(x)
    _activation_kernel[(triton.cdiv(x.numel(), 256),)](x, y, x.numel(), alpha, ACT=int(row.act), BLOCK=256)
    ref = row.reference(x.double(), alpha)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6, msg=row.name)


def test_unknown_constexpr_is_refused() -> None:
    x = _inputs()
    with pytest.raises(Exception, match="no Activation"):
        run_interpreted(
            _activation_kernel, (5,), x, torch.empty_like(x), x.numel(), 0.0, ACT=len(Activation), BLOCK=256
        )


def _epilogue_params(module) -> list[list]:
    """The value lists of every ``epilogue`` parametrization in a test module."""
    found = []
    for name in dir(module):
        for mark in getattr(getattr(module, name), "pytestmark", []):
            if mark.name == "parametrize" and mark.args[0] == "epilogue":
                found.append(list(mark.args[1]))
    return found


def test_epilogue_parameters_cover_the_table() -> None:
    assert sorted(e.act for e in EPILOGUES) == sorted(Activation)
    for module in (test_kernels_conv, test_kernels_gemm, test_kernels_gpu):
        params = _epilogue_params(module)
        assert params, f"{module.__name__} has no epilogue parametrization"
        assert all(p == EPILOGUES for p in params), module.__name__
