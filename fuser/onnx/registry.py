"""The converter registry: which function turns an ONNX node of (domain, op_type, opset) into fx nodes.

Every ONNX operator has versions; a model names one opset per domain, and the operator's meaning is the
newest version at or below that opset. A converter therefore registers for a closed range of opsets
over which the semantics it implements hold, e.g. ``@converter("Split", opsets=(13, 17))`` for the form
whose split sizes are an input and ``@converter("Split", opsets=(18, 21))`` for the form that adds
``num_outputs``. Ranges of one (domain, op_type) may not overlap: two converters claiming the same
node would make the result depend on import order, so a second claim is refused at registration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fuser.onnx.builder import NodeContext

ONNX_DOMAIN = ""

# A converter reads its node through the context and returns one value per ONNX output it produces.
ConverterFn = Callable[["NodeContext"], Any]


def normalize_domain(domain: str) -> str:
    """``"ai.onnx"`` and ``""`` are the same (default) domain."""
    return ONNX_DOMAIN if domain in ("", "ai.onnx") else domain


def domain_label(domain: str) -> str:
    """The domain as a person reads it in an error message."""
    return normalize_domain(domain) or "ai.onnx"


class DuplicateConverterError(ValueError):
    """A converter was registered for an opset range another converter of the same op already covers."""


@dataclass(frozen=True)
class ConverterEntry:
    """One registered converter: ``fn`` handles ``op_type`` of ``domain`` for opsets first..last."""

    domain: str
    op_type: str
    first: int
    last: int
    fn: ConverterFn

    def covers(self, opset: int) -> bool:
        return self.first <= opset <= self.last

    def describe(self) -> str:
        return f"{domain_label(self.domain)}::{self.op_type} opsets {self.first}..{self.last}"


class ConverterRegistry:
    """Converters keyed by (domain, op_type, opset range); see the module docstring."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], list[ConverterEntry]] = {}

    def converter(
        self, op_type: str, opsets: tuple[int, int], domain: str = ONNX_DOMAIN
    ) -> Callable[[ConverterFn], ConverterFn]:
        """Decorator: register the decorated function for ``op_type`` over the inclusive ``opsets`` range.

        Raises :class:`DuplicateConverterError` when the range overlaps one already registered for the
        same (domain, op_type), and ValueError for a malformed range.
        """
        first, last = opsets
        if not (isinstance(first, int) and isinstance(last, int) and 1 <= first <= last):
            raise ValueError(f"converter for {op_type!r}: opsets must be (first, last), 1 <= first <= last")
        key = (normalize_domain(domain), op_type)

        def register(fn: ConverterFn) -> ConverterFn:
            new = ConverterEntry(key[0], op_type, first, last, fn)
            for old in self._entries.get(key, []):
                if old.first <= last and first <= old.last:
                    raise DuplicateConverterError(
                        f"converter {fn.__module__}.{fn.__qualname__} for {new.describe()} overlaps "
                        f"{old.fn.__module__}.{old.fn.__qualname__} registered for {old.describe()}"
                    )
            self._entries.setdefault(key, []).append(new)
            return fn

        return register

    def find(self, domain: str, op_type: str, opset: int) -> ConverterEntry | None:
        """The entry covering ``opset`` for (domain, op_type), or None."""
        for entry in self._entries.get((normalize_domain(domain), op_type), []):
            if entry.covers(opset):
                return entry
        return None

    def lookup(self, domain: str, op_type: str, opset: int, node_name: str) -> ConverterFn:
        """The converter for a node; NotImplementedError naming op_type, domain, opset and the node."""
        entry = self.find(domain, op_type, opset)
        if entry is not None:
            return entry.fn
        known = [e.describe() for e in self._entries.get((normalize_domain(domain), op_type), [])]
        hint = f" (converters exist for {', '.join(known)})" if known else ""
        raise NotImplementedError(
            f"no converter for ONNX op {op_type!r} of domain {domain_label(domain)!r} at opset {opset} "
            f"(node {node_name!r}){hint}"
        )

    def entries(self) -> list[ConverterEntry]:
        """Every registered entry, sorted by (domain, op_type, first opset)."""
        return sorted((e for es in self._entries.values() for e in es), key=lambda e: (e.domain, e.op_type, e.first))


# The registry the importer uses; the converter modules register into it when imported.
REGISTRY = ConverterRegistry()
converter = REGISTRY.converter
