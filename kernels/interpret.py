"""Run a ``@triton.jit`` kernel in Triton's interpreter on CPU tensors, without TRITON_INTERPRET.

TRITON_INTERPRET is read when ``@triton.jit`` decorates a function (at import), so it cannot be
switched per call. ``InterpretedFunction(kernel.fn)`` interprets one kernel, but a nested
``@triton.jit`` call inside it (our epilogue helpers, and ``tl.zeros`` / ``tl.sigmoid`` which are
themselves jitted in ``triton.language.standard``) still goes to ``JITFunction.__call__``, which
refuses to run outside a compiled kernel. While an interpreted grid runs we route such nested calls
to the interpreter too, and put ``JITFunction.__call__`` back afterwards. The interpreter has no assembler
either: the kernels' few inline PTX instructions (the epilogue's exponential and reciprocal) run as numpy.
The patches are global to the process, so a lock makes interpreted launches one at a time.

Works with the interpreter API of triton 3.6 and 3.9 (checked on both): ``_patch_lang`` returns a
restorable scope there, and 3.6 needs one more fix under numpy >= 2.5 (see ``_patch_lang_numpy2``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import triton.language as tl
from triton.runtime import interpreter
from triton.runtime.jit import JITFunction

from .epilogue import EX2_APPROX_FTZ, RCP_APPROX_FTZ

_LOCK = threading.RLock()


def _interpret_nested_call(self: JITFunction, *args: Any, **kwargs: Any) -> Any:
    scope = _patch_lang_numpy2(self.fn)
    try:
        return interpreter.InterpretedFunction(self.fn)(*args, **kwargs)
    finally:
        if scope is not None:
            scope.restore()


def _patch_lang_numpy2(fn: Any) -> Any:
    """``_patch_lang`` plus a fix for triton 3.6 under numpy >= 2.5: its ``tensor.__index__`` is
    ``int(data)`` on a 1-element array (what ``range(0, K, BLOCK)`` calls on a runtime ``K``), which
    newer numpy refuses; ``.item()`` takes the same value. Triton 3.9 already does this itself."""
    scope = _original_patch_lang(fn)
    if scope is not None and hasattr(scope, "set_attr"):
        scope.set_attr(tl.core.tensor, "__index__", lambda self: int(self.handle.data.item()))
    return scope


_original_patch_lang = interpreter._patch_lang


class _AsmResult(interpreter.TensorHandle):
    """The interpreter's stand-in for an inline-asm op: ``tl.inline_asm_elementwise`` asks it for result 0."""

    def get_result(self, index: int) -> interpreter.TensorHandle:
        if index != 0:
            raise NotImplementedError("emulated inline PTX has one result")
        return self


# The inline PTX of the kernels (kernels/epilogue.py), as numpy on float32 arrays.
_EMULATED_PTX: dict[str, Callable[..., np.ndarray]] = {
    EX2_APPROX_FTZ.value: np.exp2,
    RCP_APPROX_FTZ.value: np.reciprocal,
}


def _emulated_inline_asm(asm: str, constraints: str, values: list, types: Any, is_pure: bool, pack: int) -> Any:
    """``create_inline_asm`` of the interpreter's builder, which refuses all inline asm: the PTX strings of
    :data:`_EMULATED_PTX` run as numpy (float32 in, float32 out), any other is named in the error."""
    op = _EMULATED_PTX.get(asm)
    if op is None:
        raise NotImplementedError(f"inline asm {asm!r} has no interpreter emulation (kernels/interpret.py)")
    with np.errstate(over="ignore", divide="ignore"):
        data = op(*(v.data.astype(np.float32) for v in values)).astype(np.float32)
    return _AsmResult(data, tl.float32)


def run_interpreted(
    kernel: JITFunction,
    grid: Sequence[int] | Callable[[dict[str, Any]], Sequence[int]],
    *args: Any,
    **kwargs: Any,
) -> None:
    """Launch ``kernel[grid](*args, **kwargs)`` in the interpreter (tensors must live on the CPU).

    Launch options meant for the compiler (``num_warps``, ``num_stages``) are ignored.
    """
    with _LOCK:
        original_call = JITFunction.__call__
        JITFunction.__call__ = _interpret_nested_call
        interpreter._patch_lang = _patch_lang_numpy2
        interpreter.interpreter_builder.create_inline_asm = _emulated_inline_asm
        try:
            interpreter.InterpretedFunction(kernel.fn)[tuple(grid) if not callable(grid) else grid](*args, **kwargs)
        finally:
            JITFunction.__call__ = original_call
            interpreter._patch_lang = _original_patch_lang
            del interpreter.interpreter_builder.create_inline_asm
