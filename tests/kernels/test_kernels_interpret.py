"""The interpreter shim: nested @triton.jit calls work inside, and nothing stays patched after."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from fuser.kernels.epilogue import apply_activation
from fuser.kernels.interpret import run_interpreted


@triton.jit
def _silu_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + offs, apply_activation(x, 0.0, 4), mask=offs < n)


@triton.jit
def _failing_kernel(x_ptr, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), tl.load(x_ptr + tl.arange(0, BLOCK + 1)))


def test_nested_jit_call_runs_and_patch_is_undone() -> None:
    original = JITFunction.__call__
    x = torch.randn(37)
    y = torch.empty(37)
    run_interpreted(_silu_kernel, (3,), x, y, 37, BLOCK=16)
    torch.testing.assert_close(y, torch.nn.functional.silu(x), rtol=1e-6, atol=1e-6)
    assert JITFunction.__call__ is original


def test_patch_is_undone_after_an_error() -> None:
    original = JITFunction.__call__
    with pytest.raises(Exception):  # noqa: B017  (the interpreter's error type differs across versions)
        run_interpreted(_failing_kernel, (1,), torch.randn(16), BLOCK=16)
    assert JITFunction.__call__ is original


@triton.jit
def _unknown_asm_kernel(x_ptr, BLOCK: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, BLOCK))
    y = tl.inline_asm_elementwise("sqrt.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    tl.store(x_ptr + tl.arange(0, BLOCK), y)


def test_inline_ptx_of_the_epilogue_runs_as_numpy_and_is_unpatched_after() -> None:
    """The epilogue's exponential and reciprocal are inline PTX, which the interpreter refuses: the shim runs them as
    numpy during an interpreted launch (SiLU at both ends of float32's range, where a wrong emulation would give
    inf or NaN), names any PTX it does not know, and leaves the interpreter's builder as it found it."""
    from triton.runtime import interpreter

    x = torch.tensor([-100.0, -88.5, -87.0, -3.7, -1e-3, 0.0, 2e-3, 5.3, 87.0, 100.0, 3e38, -3e38] + [1.5] * 4)
    y = torch.empty_like(x)
    run_interpreted(_silu_kernel, (1,), x, y, x.numel(), BLOCK=16)
    torch.testing.assert_close(y.double(), torch.nn.functional.silu(x.double()), rtol=1e-6, atol=1e-30)
    assert "create_inline_asm" not in vars(interpreter.interpreter_builder)
    # the interpreter wraps the error in its own type, which differs across versions
    with pytest.raises(Exception, match=r"sqrt\.approx\.f32 .* no interpreter emulation"):
        run_interpreted(_unknown_asm_kernel, (1,), torch.randn(16), BLOCK=16)
    assert "create_inline_asm" not in vars(interpreter.interpreter_builder)
