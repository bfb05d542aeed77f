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
