"""Small tree patterns over fx nodes, with declared commutativity, and the one function that matches them.

A written-out form such as ``x * sigmoid(x)`` or ``0.5 * x * (1 + erf(x / sqrt(2)))`` is declared as a tree:

    mul(X, sigmoid(X))                     # X = Var("x"): the same node wherever it appears
    any_of(div(Y, 6), mul(Y, 1 / 6))       # alternatives; a number leaf compares within NUMBER_RTOL

An :class:`Op` names an :class:`OpFamily` (the fx targets and method names that compute it, its arity, and
whether it is commutative); :func:`match` tries both operand orders of a commutative op, every alternative,
and binds each variable to one node. The idea is tinygrad's UPat / PatternMatcher: forms are data, and one
driver (fuser.canonicalize) matches all of them, instead of a hand-walked tree and a commutativity loop per form.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

# Number leaves match within this relative tolerance: float32-stored constants (ONNX, 6e-8) and constants
# written with six or more digits match; a near miss (0.04 for 0.044715) does not. The rewrite replaces the
# written constant by the exact one, so the tolerance also bounds how far the result moves (below the 1e-5 of
# float32 accuracy).
NUMBER_RTOL = 1e-5


def is_number(value: Any) -> bool:
    """A finite Python int or float (not a bool): what an fx node holds for a literal in the source."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _plain_operands(node: fx.Node, arity: int) -> tuple[Any, ...] | None:
    return tuple(node.args) if len(node.args) == arity and not node.kwargs else None


@dataclass(frozen=True)
class OpFamily:
    """One operation however it is written: fx ``call_function`` targets and ``call_method`` names.

    ``operands`` reads a matching node's operands (None when its other arguments change the meaning, e.g.
    ``torch.add(x, y, alpha=2)``); by default exactly ``arity`` positional arguments and no keywords.
    """

    name: str
    functions: frozenset = frozenset()
    methods: frozenset = frozenset()
    arity: int = 1
    commutative: bool = False
    operands: Callable[[fx.Node, int], tuple[Any, ...] | None] = _plain_operands

    def read(self, node: Any) -> tuple[Any, ...] | None:
        """The operands of ``node`` when it computes this operation, else None."""
        if not isinstance(node, fx.Node):
            return None
        if node.op == "call_function" and node.target in self.functions:
            return self.operands(node, self.arity)
        if node.op == "call_method" and node.target in self.methods:
            return self.operands(node, self.arity)
        return None


def _softplus_operands(node: fx.Node, arity: int) -> tuple[Any, ...] | None:
    """F.softplus(x) with the defaults beta=1, threshold=20 only (other values are another function)."""
    names = ("input", "beta", "threshold")
    bound = {"beta": 1.0, "threshold": 20.0, **dict(zip(names, node.args, strict=False)), **node.kwargs}
    if set(bound) - set(names) or bound["beta"] != 1.0 or bound["threshold"] != 20.0:
        return None
    return (bound.get("input"),)


ADD = OpFamily("add", frozenset({operator.add, torch.add}), frozenset({"add"}), arity=2, commutative=True)
MUL = OpFamily("mul", frozenset({operator.mul, torch.mul}), frozenset({"mul"}), arity=2, commutative=True)
DIV = OpFamily("div", frozenset({operator.truediv, torch.div}), frozenset({"div"}), arity=2)
POW = OpFamily("pow", frozenset({operator.pow, torch.pow}), frozenset({"pow"}), arity=2)
ERF = OpFamily("erf", frozenset({torch.erf, torch.special.erf}), frozenset({"erf"}))
SOFTPLUS = OpFamily("softplus", frozenset({F.softplus}), operands=_softplus_operands)


class Pattern:
    """A node of a tree pattern (see the subclasses)."""


@dataclass(frozen=True)
class Var(Pattern):
    """Any fx node, bound to ``name``; a second occurrence of the name must be the same node."""

    name: str


@dataclass(frozen=True)
class Num(Pattern):
    """A Python number within ``rtol`` of ``value``."""

    value: float
    rtol: float = NUMBER_RTOL


@dataclass(frozen=True)
class Op(Pattern):
    """A node computing ``family`` whose operands match ``src`` (in either order if it is commutative)."""

    family: OpFamily
    src: tuple[Pattern | float, ...]


@dataclass(frozen=True)
class AnyOf(Pattern):
    """The first of the alternatives that matches (each is tried, with backtracking)."""

    alternatives: tuple[Pattern, ...]


@dataclass
class Match:
    """A successful match: the variables' nodes, and every node the pattern's ops covered (root first)."""

    bindings: dict[str, fx.Node] = field(default_factory=dict)
    nodes: list[fx.Node] = field(default_factory=list)

    def __getitem__(self, name: str) -> fx.Node:
        return self.bindings[name]


def op(family: OpFamily, *src: Pattern | float) -> Op:
    """``Op(family, src)``; plain numbers in ``src`` become :class:`Num` leaves."""
    if len(src) != family.arity:
        raise ValueError(f"{family.name} takes {family.arity} operands, the pattern gives {len(src)}")
    return Op(family, src)


def any_of(*alternatives: Pattern) -> AnyOf:
    return AnyOf(tuple(alternatives))


def add(a: Pattern | float, b: Pattern | float) -> Op:
    return op(ADD, a, b)


def mul(a: Pattern | float, b: Pattern | float) -> Op:
    return op(MUL, a, b)


def div(a: Pattern | float, b: Pattern | float) -> Op:
    return op(DIV, a, b)


def power(a: Pattern | float, b: Pattern | float) -> Op:
    return op(POW, a, b)


def _search(pattern: Pattern | float, value: Any, found: Match) -> Iterator[Match]:
    """Every way ``value`` matches ``pattern`` given the bindings so far (fresh Match objects)."""
    if isinstance(pattern, (int, float)):
        pattern = Num(float(pattern))
    if isinstance(pattern, Var):
        bound = found.bindings.get(pattern.name)
        if bound is None and isinstance(value, fx.Node):
            yield Match({**found.bindings, pattern.name: value}, list(found.nodes))
        elif bound is not None and bound is value:
            yield found
    elif isinstance(pattern, Num):
        if is_number(value) and math.isclose(float(value), pattern.value, rel_tol=pattern.rtol):
            yield found
    elif isinstance(pattern, AnyOf):
        for alternative in pattern.alternatives:
            yield from _search(alternative, value, found)
    elif isinstance(pattern, Op):
        operands = pattern.family.read(value)
        if operands is None or len(operands) != len(pattern.src):
            return
        orders = [operands]
        if pattern.family.commutative and operands[0] is not operands[1]:
            orders.append(operands[::-1])
        here = Match(found.bindings, [*found.nodes, value])
        for order in orders:
            yield from _search_all(pattern.src, order, here)
    else:
        raise TypeError(f"not a pattern: {pattern!r}")


def _search_all(patterns: tuple, values: tuple, found: Match) -> Iterator[Match]:
    if not patterns:
        yield found
        return
    for first in _search(patterns[0], values[0], found):
        yield from _search_all(patterns[1:], values[1:], first)


def matches(pattern: Pattern, node: fx.Node) -> Iterator[Match]:
    """Every match of ``pattern`` rooted at ``node`` (operand orders and alternatives in declaration order), for
    a rule whose own checks may reject one match and accept another."""
    return _search(pattern, node, Match())


def match(pattern: Pattern, node: fx.Node) -> Match | None:
    """The first match of ``pattern`` rooted at ``node``, or None."""
    return next(matches(pattern, node), None)
