"""Activations written out over several calls: every tree pattern of the table (fuser.activations, column
``written_out``) becomes one rule that writes the row's canonical call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fuser.activations import ACTIVATIONS, ActivationSpec
from fuser.canonicalize.driver import Rule, pattern_rule
from fuser.match.tree_patterns import Match


def _builder(row: ActivationSpec) -> Callable[[Match], tuple[Any, tuple, dict]]:
    return lambda found: row.canonical_call(found["x"])


# Rows in table order: a form that is built on another row's canonical call (x * hardsigmoid(x)) still fires
# after it, because the driver repeats its sweeps until nothing changes.
RULES: list[Rule] = [
    pattern_rule(form.name, form.description, form.pattern, _builder(row))
    for row in ACTIVATIONS
    for form in row.written_out
]
