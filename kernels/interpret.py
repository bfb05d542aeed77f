"""Run a ``@triton.jit`` kernel in Triton's interpreter on CPU tensors, without TRITON_INTERPRET.

TRITON_INTERPRET is read when ``@triton.jit`` decorates a function (at import), so it cannot be
switched per call. ``InterpretedFunction(kernel.fn)`` interprets one kernel, but a nested
``@triton.jit`` call inside it (our epilogue helpers, and ``tl.zeros`` / ``tl.sigmoid`` which are
themselves jitted in ``triton.language.standard``) still goes to ``JITFunction.__call__``, which
refuses to run outside a compiled kernel. While an interpreted grid runs we route such nested calls
to the interpreter too, and put ``JITFunction.__call__`` back afterwards. The patch is global to the
process, so a lock makes interpreted launches one at a time.

Works with the interpreter API of triton 3.6 and 3.9 (checked on both): ``_patch_lang`` returns a
restorable scope there, and 3.6 needs one more fix under numpy >= 2.5 (see ``_patch_lang_numpy2``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import triton.language as tl
from triton.runtime import interpreter
from triton.runtime.jit import JITFunction

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
        try:
            interpreter.InterpretedFunction(kernel.fn)[tuple(grid) if not callable(grid) else grid](*args, **kwargs)
        finally:
            JITFunction.__call__ = original_call
            interpreter._patch_lang = _original_patch_lang
