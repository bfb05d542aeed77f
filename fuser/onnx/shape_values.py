"""Shape arithmetic kept symbolic: small integer vectors whose entries are known now or at run time.

ONNX graphs compute shapes with tensors: ``Shape -> Gather -> Unsqueeze -> Concat -> Reshape`` is how
``x.view(x.size(0), -1)`` is exported. Turned literally into torch, that becomes tensor arithmetic whose
result has to be read back with ``.tolist()`` before ``reshape`` can use it, which hides the batch size from
tracers and exporters (they would bake the traced value in). Instead, the importer keeps such vectors as
a :class:`ShapeValue`: a tuple whose entries are Python numbers (known at import time) or fx nodes that
yield a Python int at run time (``x.size(0)``). Gather, Slice, Concat, arithmetic, Equal and Where on
them run at import time entry by entry, so ``Reshape`` receives ``(x.size(0), -1)``, exactly what a
traced PyTorch model contains. Anything this module cannot do symbolically falls back to a real tensor
(see ``GraphBuilder.as_node``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

# One entry: a number known at import time, or an fx node that yields a Python number at run time.
Item = int | float | bool | fx.Node

# Vectors longer than this stay tensors: shape vectors are short, data vectors are not.
MAX_SYMBOLIC_LENGTH = 16


@dataclass(frozen=True)
class ShapeValue:
    """A 0-d (``scalar``) or 1-d tensor of ``dtype`` given entry by entry; see the module docstring."""

    items: tuple[Item, ...]
    scalar: bool = False
    dtype: torch.dtype = torch.int64

    def __post_init__(self) -> None:
        if self.scalar and len(self.items) != 1:
            raise ValueError(f"a scalar ShapeValue has one item, got {len(self.items)}")

    @property
    def is_constant(self) -> bool:
        return not any(isinstance(i, fx.Node) for i in self.items)

    @property
    def rank(self) -> int:
        return 0 if self.scalar else 1

    def to_tensor(self) -> torch.Tensor:
        """The value as a tensor; only for a constant ShapeValue."""
        if not self.is_constant:
            raise ValueError("a ShapeValue with run-time entries has no import-time tensor")
        t = torch.tensor(list(self.items), dtype=self.dtype)
        return t.reshape(()) if self.scalar else t

    def with_items(self, items: tuple[Item, ...], scalar: bool | None = None) -> ShapeValue:
        return ShapeValue(items, self.scalar if scalar is None else scalar, self.dtype)


def from_tensor(t: torch.Tensor) -> ShapeValue | None:
    """A small constant 0-d/1-d tensor as a ShapeValue, or None when it is too big or not a vector."""
    if t.dim() > 1 or t.numel() > MAX_SYMBOLIC_LENGTH or t.is_complex():
        return None
    return ShapeValue(tuple(t.reshape(-1).tolist()), scalar=t.dim() == 0, dtype=t.dtype)


_OPERATORS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "eq": operator.eq, "mod": operator.mod}


def _trunc_div(a: int | float, b: int | float, integral: bool) -> int | float:
    if not integral:
        return a / b
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


@dataclass
class ItemOps:
    """Entry-wise arithmetic that emits fx nodes for run-time entries.

    ``emit(target, args)`` creates a call_function node; ``is_nonnegative(node)`` says whether a run-time
    entry is known to be >= 0 (sizes are), which makes ``floordiv`` equal ONNX's truncating division and
    decides ``size == -1`` (false) at import time.
    """

    emit: Callable[[Any, tuple[Any, ...]], fx.Node]
    is_nonnegative: Callable[[Item], bool]

    def binary(self, op: str, a: Item, b: Item, integral: bool) -> Item | None:
        """``a op b`` for op in add/sub/mul/div/eq/mod (mod: integers, the divisor's sign, as Python's ``%``); None when
        it cannot stay symbolic."""
        if not isinstance(a, fx.Node) and not isinstance(b, fx.Node):
            if op == "div":
                return _trunc_div(a, b, integral)
            return _OPERATORS[op](a, b)
        if op == "eq":
            for node, other in ((a, b), (b, a)):
                known = not isinstance(other, fx.Node)
                if known and isinstance(node, fx.Node) and self.is_nonnegative(node) and other < 0:
                    return False
            return self.emit(operator.eq, (a, b))
        if op == "div":
            if not integral:
                return self.emit(operator.truediv, (a, b))
            if self.is_nonnegative(a) and (self.is_nonnegative(b) or (not isinstance(b, fx.Node) and b > 0)):
                return self.emit(operator.floordiv, (a, b))
            return None
        if op == "mod" and not integral:
            return None
        if op == "mul" and not isinstance(b, fx.Node) and b == 1:
            return a
        if op == "mul" and not isinstance(a, fx.Node) and a == 1:
            return b
        if op in ("add", "sub") and not isinstance(b, fx.Node) and b == 0:
            return a
        return self.emit(_OPERATORS[op], (a, b))

    def maximum(self, a: Item, b: Item) -> Item:
        """max(a, b) as (a + b + |a - b|) // 2 for run-time entries: operator nodes re-trace (fx, torch.save
        of a GraphModule), the builtins max/min on traced sizes do not."""
        if not isinstance(a, fx.Node) and not isinstance(b, fx.Node):
            return max(a, b)
        if a is b:
            return a
        spread = self.emit(operator.abs, (self.emit(operator.sub, (a, b)),))
        return self.emit(operator.floordiv, (self.emit(operator.add, (self.emit(operator.add, (a, b)), spread)), 2))

    def minimum(self, a: Item, b: Item) -> Item:
        """min(a, b) as (a + b - |a - b|) // 2 for run-time entries (see :meth:`maximum`)."""
        if not isinstance(a, fx.Node) and not isinstance(b, fx.Node):
            return min(a, b)
        if a is b:
            return a
        spread = self.emit(operator.abs, (self.emit(operator.sub, (a, b)),))
        return self.emit(operator.floordiv, (self.emit(operator.sub, (self.emit(operator.add, (a, b)), spread)), 2))


def broadcast_pairs(a: ShapeValue, b: ShapeValue) -> list[tuple[Item, Item]] | None:
    """Entry pairs of a and b under numpy broadcasting of two vectors, or None if they do not broadcast."""
    la, lb = len(a.items), len(b.items)
    if la == lb:
        return list(zip(a.items, b.items, strict=True))
    if la == 1:
        return [(a.items[0], y) for y in b.items]
    if lb == 1:
        return [(x, b.items[0]) for x in a.items]
    return None


def normalize_index(index: int, length: int) -> int:
    """A possibly negative index into a vector of ``length``; IndexError when out of range."""
    if not -length <= index < length:
        raise IndexError(f"index {index} out of range for length {length}")
    return index + length if index < 0 else index


def slice_items(items: tuple[Item, ...], start: int, end: int, step: int) -> tuple[Item, ...]:
    """ONNX Slice semantics (clamping, negative indices, negative steps) on a tuple.

    Python's slice() clamps like ONNX except for a negative step with ``start < -len``, where ONNX
    clamps the start to the first element and Python yields nothing.
    """
    if step == 0:
        raise ValueError("Slice step 0")
    if step < 0 and start < -len(items):
        start = 0
    return items[slice(start, end, step)]


def is_integral(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex)
