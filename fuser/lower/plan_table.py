"""The launch plans a fused module keeps, by call signature: bounded, and never pickled.

A plan (fuser.kernels: checks done, tile chosen, compiled kernel bound) belongs to one process and device, so
a saved module carries none and a loaded one rebuilds them on its first call. The pool pyramid, the max pool
and the detect head keep theirs here.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch


def input_signature(x: torch.Tensor) -> tuple[Any, ...]:
    """What a plan's direct launch pins about its input (kernels/launch.py, LaunchOptions): shape, strides,
    dtype, device and 16-byte alignment."""
    return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16 == 0)


class PlanTable:
    """Plans by key, at most ``limit`` of them (emptied when full: a model sees a handful of signatures)."""

    __slots__ = ("_limit", "_plans")

    def __init__(self, limit: int = 8) -> None:
        self._limit = limit
        self._plans: dict[Hashable, Any] = {}

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The plan under ``key``, made by ``build()`` on its first use (it may be None: no plan applies)."""
        plans = self._plans
        if key in plans:
            return plans[key]
        if len(plans) >= self._limit:
            plans.clear()
        plan = plans[key] = build()
        return plan

    def __len__(self) -> int:
        return len(self._plans)

    def values(self) -> list[Any]:
        return list(self._plans.values())

    def __getstate__(self) -> int:
        return self._limit

    def __setstate__(self, limit: int) -> None:
        self._limit, self._plans = limit, {}


class KeepsPlans:
    """Mixin of the modules with a :class:`PlanTable` named ``_plans``: a module saved before it had one (its
    ``_plans`` a plain dict) loads with an empty table."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        if not isinstance(state.get("_plans"), PlanTable):
            state["_plans"] = PlanTable()
        super().__setstate__(state)  # type: ignore[misc]
