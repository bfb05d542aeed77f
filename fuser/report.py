"""The fusion report: for every candidate chain, fused or not, what it is and why.

``optimize`` attaches one to the module it returns (``.fusion_report``) and ``explain`` returns one. It
prints as a table; ``.fused`` and ``.rejected`` are lists of :class:`ChainReport`; ``.untraced`` lists the
modules torch.fx could not trace.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from fuser.activations import Activation
from fuser.capture.tracing import UntracedModule
from fuser.epilogue import Epilogue, Residual
from fuser.match.chain import Chain


@dataclass
class ChainReport:
    """One candidate chain. ``reason`` is None for fused chains and says why in plain words otherwise."""

    pattern: str
    ops: list[str]
    nodes: list[str]
    modules: list[str]
    graph: str
    epilogue: Epilogue
    fused: bool
    reason: str | None = None
    kernel: str | None = None
    notes: list[str] = field(default_factory=list)
    has_bias: bool = True  # False: a bias-free conv or linear with no BatchNorm folded in

    @property
    def activation(self) -> str | None:
        """Lower-case activation name ("silu", "gelu_tanh", ...), or None."""
        return None if self.epilogue.act == Activation.NONE else self.epilogue.act.name.lower()

    @property
    def residual(self) -> bool:
        return self.epilogue.residual != Residual.NONE

    @property
    def scale(self) -> float | None:
        return None if self.epilogue.scale == 1.0 else self.epilogue.scale

    @property
    def location(self) -> str:
        """The chain's modules, compacted to their common parent: ``model.2.cv1.{conv,bn,act}``."""
        return compact_paths(self.modules, has_add="add" in self.ops)

    @classmethod
    def from_chain(cls, chain: Chain, fused: bool, reason: str | None = None, kernel: str | None = None) -> ChainReport:
        return cls(
            pattern=chain.pattern.name,
            ops=chain.ops,
            nodes=[n.name for n in chain.nodes],
            modules=chain.modules,
            graph=chain.graph_path,
            epilogue=chain.epilogue,
            fused=fused,
            reason=reason,
            kernel=kernel,
            notes=list(chain.notes),
            has_bias=chain.has_bias,
        )


@dataclass
class GraphRewrite:
    """A fusion outside the conv/GEMM chains (a pool pyramid, say): what it became and which nodes went."""

    kind: str
    location: str
    detail: str
    eliminated: list[str] = field(default_factory=list)
    # fused chains (by their first module) that the rewrite moved onto another kernel, and that kernel's name
    kernels: dict[str, str] = field(default_factory=dict)


# The kinds of graph rewrite (fuser.rewrite.batchnorm_prologue) of a BatchNorm outside the chains: folded into
# the operand prologue or the weights of the layer after it (the optimized model no longer runs it), or kept.
BATCH_NORM_PROLOGUE = "batch_norm_prologue"
BATCH_NORM_INTO_WEIGHTS = "batch_norm_into_weights"
BATCH_NORM_FOLDS = (BATCH_NORM_PROLOGUE, BATCH_NORM_INTO_WEIGHTS)
BATCH_NORM_KEPT = "batch_norm_kept"


def settle_batch_norms(entries: list[ChainReport], rewrites: list[GraphRewrite]) -> list[ChainReport]:
    """One graph's entries after the passes that fold BatchNorms outside the chains
    (fuser.rewrite.batchnorm_prologue): the matcher's entry for a lone BatchNorm that one of them then removed
    (:data:`BATCH_NORM_FOLDS`) is dropped, and one that stayed gets the pass's reason as well
    (:data:`BATCH_NORM_KEPT`, matched by module)."""
    gone = {n for r in rewrites if r.kind in BATCH_NORM_FOLDS for n in r.eliminated}
    kept = {r.location: r.detail for r in rewrites if r.kind == BATCH_NORM_KEPT}
    settled = []
    for e in entries:
        lone = e.pattern == "batch_norm" and not e.fused
        if lone and e.nodes[0] in gone:
            continue
        if lone and e.modules and e.modules[0] in kept and e.reason and kept[e.modules[0]] not in e.reason:
            e.reason = f"{e.reason}; {kept[e.modules[0]]}"
        settled.append(e)
    return settled


def settle_kernels(entries: list[ChainReport], rewrites: list[GraphRewrite]) -> list[ChainReport]:
    """One graph's entries with the kernel each fused chain runs after the passes that rewrite fused convs (a
    virtual concatenation moves a conv onto the implicit GEMM's channel blocks, fuser.rewrite.virtual_cat): the
    report names the kernel that launches, not the one the chain was matched for. Entries on the torch reference
    (no Triton here) keep it."""
    moved = {module: kernel for r in rewrites for module, kernel in r.kernels.items()}
    for e in entries:
        if e.fused and e.modules and e.modules[0] in moved and not (e.kernel or "").startswith("torch reference"):
            e.kernel = moved[e.modules[0]]
    return entries


@dataclass
class SkippedRewrite:
    """A candidate for such a fusion that stays as it is, and why (a detect head that overrides its tail)."""

    kind: str
    location: str
    reason: str


def compact_paths(paths: list[str], has_add: bool = True) -> str:
    """``a.b.{conv,bn,act}`` for paths under one parent; in a chain with a residual add, a path that is a
    parent of the others (the module whose forward does the add) is named after them:
    ``a.b.cv2.{conv,bn,act} + add in a.b``."""
    if not has_add:
        return _compact(paths)
    parents = [p for p in paths if any(q.startswith(p + ".") for q in paths)]
    leaves = [p for p in paths if p not in parents]
    text = _compact(leaves)
    return text + "".join(f" + add in {p}" for p in parents)


def _compact(paths: list[str]) -> str:
    if len(paths) <= 1:
        return paths[0] if paths else ""
    split = [p.split(".") for p in paths]
    common: list[str] = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    rests = [".".join(p[len(common) :]) for p in split]
    if not common or any(not r for r in rests):
        return ", ".join(paths)
    return f"{'.'.join(common)}.{{{','.join(rests)}}}"


@dataclass
class FusionReport:
    entries: list[ChainReport] = field(default_factory=list)
    untraced: list[UntracedModule] = field(default_factory=list)
    rewrites: list[GraphRewrite] = field(default_factory=list)
    skipped: list[SkippedRewrite] = field(default_factory=list)
    precision: str = "tf32"
    backend: str = "auto"
    # canonicalization rules that fired, summed over the traced graphs: {rule name: count} (fuser.canonicalize)
    rules_fired: dict[str, int] = field(default_factory=dict)
    # the input shapes the model's graph was specialized to ("(*, 3, 67, 61)"), or "" (fuser.capture.specialize)
    specialized: str = ""

    def add_rules_fired(self, fired: dict[str, int]) -> None:
        for name, count in fired.items():
            self.rules_fired[name] = self.rules_fired.get(name, 0) + count

    @property
    def fused(self) -> list[ChainReport]:
        return [e for e in self.entries if e.fused]

    @property
    def rejected(self) -> list[ChainReport]:
        return [e for e in self.entries if not e.fused]

    def counts_by_pattern(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for e in self.fused:
            counts[e.pattern] = counts.get(e.pattern, 0) + 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        def entry(e: ChainReport) -> dict[str, Any]:
            d = asdict(e)
            d["epilogue"] = e.epilogue.describe(e.has_bias)
            d["activation"], d["residual"], d["scale"] = e.activation, e.residual, e.scale
            return d

        return {
            "precision": self.precision,
            "backend": self.backend,
            "fused": [entry(e) for e in self.fused],
            "rejected": [entry(e) for e in self.rejected],
            "untraced": [asdict(u) for u in self.untraced],
            "rules_fired": dict(self.rules_fired),
            "specialized": self.specialized,
            "rewrites": [asdict(r) for r in self.rewrites],
            "skipped": [asdict(s) for s in self.skipped],
        }

    def __str__(self) -> str:
        counts = ", ".join(f"{n} {p}" for p, n in sorted(self.counts_by_pattern().items()))
        lines = [
            f"fuser: {len(self.fused)} chains fused ({counts or 'none'}), {len(self.rejected)} not fused; "
            f"precision {self.precision}, backend {self.backend}"
        ]
        if self.specialized:
            lines.append(
                f"Traced for inputs of shape {self.specialized}: the model's forward reads its input sizes; inputs of "
                "other shapes run the original model, unoptimized (with a warning)."
            )
        if self.fused:
            rows = [
                [str(i), e.pattern, " -> ".join(e.ops), e.location, e.epilogue.describe(e.has_bias), e.kernel or ""]
                for i, e in enumerate(self.fused, 1)
            ]
            lines += ["", "Fused:", *_table(["#", "pattern", "ops", "modules", "epilogue", "kernel"], rows)]
            notes = [f"  #{i}: {note}" for i, e in enumerate(self.fused, 1) for note in e.notes]
            if notes:
                lines += ["", "Notes:", *notes]
        if self.rewrites:
            rows = [[r.kind, r.location, r.detail, ", ".join(r.eliminated)] for r in self.rewrites]
            lines += ["", "Also fused:", *_table(["kind", "where", "what", "nodes eliminated"], rows)]
        if self.skipped:
            lines += ["", "Left as they are:", *(f"  {s.kind} {s.location}: {s.reason}" for s in self.skipped)]
        if self.rejected:
            rows = [[str(i), " -> ".join(e.ops), e.location, e.reason or ""] for i, e in enumerate(self.rejected, 1)]
            lines += ["", "Not fused:", *_table(["#", "ops", "modules", "reason"], rows)]
        if self.rules_fired:
            fired = ", ".join(f"{name} x{count}" for name, count in self.rules_fired.items())
            lines += ["", f"Rewritten to canonical forms: {fired}"]
        if self.untraced:
            lines += ["", "Not traced as a whole (their traceable parts were fused):"]
            lines += [
                f"  {u.path} ({u.type_name}): {u.reason}" + (f" [{u.detail}]" if u.detail else "")
                for u in self.untraced
            ]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"FusionReport(fused={len(self.fused)}, rejected={len(self.rejected)}, untraced={len(self.untraced)})"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]
    fmt = lambda cells: "  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
    return [fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)]
