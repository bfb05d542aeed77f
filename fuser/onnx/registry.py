"""The converter registry: which function turns an ONNX node of (domain, op_type, opset) into fx nodes.

Every ONNX operator has schema versions: Relu has versions 1, 6, 13 and 14, and a model at opset 22 runs
Relu version 14, the newest at or below its opset. onnx itself says which version that is
(``onnx.defs.get_schema(op, max_inclusive_version=opset, domain=...).since_version``), so a converter
registers for the schema versions it implements, e.g. ``@converter("Split", versions=(13,))`` for the
form whose split sizes are an input and ``@converter("Split", versions=(18,))`` for the form that adds
``num_outputs``. A converter for version v covers every opset from v until the op's schema changes, with
no upper bound written anywhere: a model at an opset newer than any converter imports as long as its ops
have not changed, and an op whose schema changed after the newest converted version is refused with its
name, opset, schema version and node (a new version may mean new semantics; someone has to check it).

The registry is keyed by (domain, op_type, schema version), like onnx2torch's; a second converter for a
key already taken is refused at registration (the result would depend on import order). Ops of domains
onnx has no schemas for resolve to the newest registered version at or below the model's opset.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import onnx

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


def schema_versions(domain: str, op_type: str) -> list[int] | None:
    """Every schema version (since_version) onnx knows of the op, ascending; None when onnx has no schema
    of it at all (an op of another library's domain)."""
    return _schema_index().get((normalize_domain(domain), op_type))


def schema_version(domain: str, op_type: str, opset: int) -> int | None:
    """The op's schema version in force at ``opset``: the newest since_version at or below it. None when
    onnx has no schema of the op, or none at or below that opset (the op does not exist there yet)."""
    try:
        schema = onnx.defs.get_schema(op_type, max_inclusive_version=opset, domain=normalize_domain(domain))
    except onnx.defs.SchemaError:
        return None
    return schema.since_version


@functools.cache
def _schema_index() -> dict[tuple[str, str], list[int]]:
    index: dict[tuple[str, str], list[int]] = {}
    for s in onnx.defs.get_all_schemas_with_history():
        index.setdefault((normalize_domain(s.domain), s.name), []).append(s.since_version)
    return {key: sorted(set(versions)) for key, versions in index.items()}


class DuplicateConverterError(ValueError):
    """A converter was registered for a (domain, op_type, schema version) another converter already has."""


@dataclass(frozen=True)
class ConverterEntry:
    """One registered converter: ``fn`` handles schema ``version`` of ``domain``'s ``op_type``."""

    domain: str
    op_type: str
    version: int
    fn: ConverterFn

    def describe(self) -> str:
        return f"{domain_label(self.domain)}::{self.op_type} version {self.version}"


class ConverterRegistry:
    """Converters keyed by (domain, op_type, schema version); see the module docstring."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str, int], ConverterEntry] = {}

    def converter(
        self,
        op_type: str,
        versions: Iterable[int] | None = None,
        domain: str = ONNX_DOMAIN,
        *,
        opsets: tuple[int, int] | None = None,
    ) -> Callable[[ConverterFn], ConverterFn]:
        """Decorator: register the decorated function for each schema version in ``versions``.

        ``opsets=(first, last)`` instead registers every schema version onnx knows that starts within
        first..last (the versions the converter was checked against), which covers later opsets too
        until the op changes. Raises :class:`DuplicateConverterError` for a key already registered, and
        ValueError for a version that is not one of the op's schema versions in the installed onnx.
        """
        key_domain = normalize_domain(domain)
        if (versions is None) == (opsets is None):
            raise ValueError(f"converter for {op_type!r}: give exactly one of versions= and opsets=")
        if opsets is not None:
            versions = self._versions_in(key_domain, op_type, opsets)
        chosen = sorted(set(versions))
        if not chosen or not all(isinstance(v, int) and v >= 1 for v in chosen):
            raise ValueError(f"converter for {op_type!r}: versions must be schema versions >= 1, got {chosen}")
        known = schema_versions(key_domain, op_type)
        if known is not None:
            newest_opset = onnx.defs.onnx_opset_version()
            wrong = [v for v in chosen if v not in known and v <= newest_opset]
            if wrong:
                raise ValueError(
                    f"converter for {domain_label(key_domain)}::{op_type}: {wrong} are not schema versions "
                    f"of the op (onnx {onnx.__version__} has versions {known})"
                )

        def register(fn: ConverterFn) -> ConverterFn:
            for version in chosen:
                new = ConverterEntry(key_domain, op_type, version, fn)
                old = self._entries.get((key_domain, op_type, version))
                if old is not None:
                    raise DuplicateConverterError(
                        f"converter {fn.__module__}.{fn.__qualname__} for {new.describe()}: "
                        f"{old.fn.__module__}.{old.fn.__qualname__} is already registered for it"
                    )
            for version in chosen:
                self._entries[(key_domain, op_type, version)] = ConverterEntry(key_domain, op_type, version, fn)
            return fn

        return register

    @staticmethod
    def _versions_in(domain: str, op_type: str, opsets: tuple[int, int]) -> list[int]:
        first, last = opsets
        if not (isinstance(first, int) and isinstance(last, int) and 1 <= first <= last):
            raise ValueError(f"converter for {op_type!r}: opsets must be (first, last), 1 <= first <= last")
        known = schema_versions(domain, op_type)
        if known is None:
            return [first]
        # The version in force at ``first`` may have started before it.
        start = schema_version(domain, op_type, first) or first
        return [v for v in known if start <= v <= last]

    def find(self, domain: str, op_type: str, opset: int) -> ConverterEntry | None:
        """The entry for the op's schema version in force at ``opset``, or None."""
        version = self._resolve(domain, op_type, opset)
        if version is None:
            return None
        return self._entries.get((normalize_domain(domain), op_type, version))

    def _resolve(self, domain: str, op_type: str, opset: int) -> int | None:
        if schema_versions(domain, op_type) is not None:
            return schema_version(domain, op_type, opset)
        registered = [v for d, o, v in self._entries if (d, o) == (normalize_domain(domain), op_type) and v <= opset]
        return max(registered, default=None)

    def missing_reason(self, domain: str, op_type: str, opset: int) -> str:
        """Why no converter handles the op at ``opset``, in words: the op is unknown at that opset, or its
        schema there is a version no converter handles (with the versions that are handled)."""
        key_domain = normalize_domain(domain)
        handled = sorted(v for d, o, v in self._entries if (d, o) == (key_domain, op_type))
        version = self._resolve(domain, op_type, opset)
        if schema_versions(domain, op_type) is not None and version is None:
            return f"onnx has no schema of it at or below opset {opset}"
        if not handled:
            return "fuser has no converter for this op"
        listed = ", ".join(map(str, handled))
        if version is not None and version > handled[-1]:
            return (
                f"its schema changed in version {version}, after the newest version fuser converts ({listed}); "
                "the change needs a converter checked against it"
            )
        return f"its schema at that opset is version {version}; fuser converts versions {listed}"

    def lookup(self, domain: str, op_type: str, opset: int, node_name: str) -> ConverterFn:
        """The converter for a node; NotImplementedError naming op_type, domain, opset, node and why."""
        entry = self.find(domain, op_type, opset)
        if entry is not None:
            return entry.fn
        raise NotImplementedError(
            f"no converter for ONNX op {op_type!r} of domain {domain_label(domain)!r} at opset {opset} "
            f"(node {node_name!r}): {self.missing_reason(domain, op_type, opset)}"
        )

    def entries(self) -> list[ConverterEntry]:
        """Every registered entry, sorted by (domain, op_type, version)."""
        return [self._entries[k] for k in sorted(self._entries)]


# The registry the importer uses; the converter modules register into it when imported.
REGISTRY = ConverterRegistry()
converter = REGISTRY.converter
