"""A matched chain: the fx nodes of one pattern occurrence, and what they say about the fused op."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from fuser.activations import Activation
from fuser.epilogue import Epilogue
from fuser.graph_ops import OpInfo, bind
from fuser.match.patterns import ChainPattern


def describe_node(node: fx.Node) -> str:
    """``node`` (module path) for messages, e.g. "`bn1` (layer1.0.bn1)"."""
    source = node.meta.get("source_module")
    return f"`{node.name}` ({source})" if source else f"`{node.name}`"


# Reads of a tensor's metadata, not of its values: x.ndim, x.shape, x.dtype, x.size(), x.dim(), ...
_METADATA_ATTRIBUTES = frozenset({"ndim", "shape", "dtype", "device", "is_cuda", "layout"})
_METADATA_METHODS = frozenset({"size", "dim", "ndimension", "numel", "get_device"})


def is_metadata_read(user: fx.Node, value: fx.Node) -> bool:
    """True when ``user`` reads only ``value``'s metadata (timm's ``_assert(x.ndim == 4, ...)``), so fusing
    the op that computes ``value`` does not need ``value`` stored: any tensor of the same metadata will do."""
    if user.args[:1] != (value,) or any(value is a for a in (*user.args[1:], *user.kwargs.values())):
        return False
    if user.op == "call_function" and user.target is getattr:
        return len(user.args) == 2 and user.args[1] in _METADATA_ATTRIBUTES
    return user.op == "call_method" and user.target in _METADATA_METHODS


def value_users(node: fx.Node) -> list[fx.Node]:
    """The users of ``node`` that read its values (every user but the metadata reads)."""
    return [u for u in node.users if not is_metadata_read(u, node)]


@dataclass
class Chain:
    pattern: ChainPattern
    nodes: list[fx.Node]
    infos: list[OpInfo]
    graph_path: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def head(self) -> fx.Node:
        return self.nodes[0]

    @property
    def last(self) -> fx.Node:
        return self.nodes[-1]

    def step(self, kind: str) -> tuple[fx.Node, OpInfo] | None:
        """The node of the given kind in this chain, with its classification."""
        for node, info in zip(self.nodes, self.infos, strict=True):
            if info.kind == kind:
                return node, info
        return None

    @property
    def metadata_readers(self) -> list[tuple[fx.Node, fx.Node]]:
        """(interior node, user) for each metadata read of a value inside the chain. Every interior value has
        the shape, dtype and device of the chain's output (the guards see to it), so after the rewrite these
        users read the fused node instead."""
        return [(n, u) for n in self.nodes[:-1] for u in n.users if is_metadata_read(u, n)]

    @property
    def input(self) -> fx.Node:
        """The chain's input, read from the live graph (an earlier rewrite may have replaced its producer)."""
        head = self.head
        return head.args[0] if head.args else head.kwargs["input"]

    @property
    def residual(self) -> fx.Node | None:
        """The add's operand that does not come from the chain, read from the live graph."""
        found = self.step("add")
        if found is None:
            return None
        add = found[0]
        previous = self.nodes[self.nodes.index(add) - 1]
        a, b = add.args[0], add.args[1]
        return b if a is previous else a

    @property
    def epilogue(self) -> Epilogue:
        """The fused epilogue: the activation and scale as the matched nodes give them, the residual's
        place as the pattern declares it."""
        act = self.step("act")
        scale = self.step("scale")
        return Epilogue(
            act=act[1].act if act else Activation.NONE,
            alpha=act[1].alpha if act else 0.0,
            residual=self.pattern.residual,
            scale=scale[1].scale if scale else 1.0,
        )

    @property
    def has_bias(self) -> bool:
        """Whether the fused op adds a bias: a folded BatchNorm's shift always, else the conv's or linear's own."""
        builds = self.pattern.builds
        if self.step("batch_norm") is not None or builds is None or self.head.op != "call_function":
            return True  # a leaf module is left unfused: no epilogue to describe
        return bind(self.head, builds.args, builds.defaults)["bias"] is not None

    @property
    def ops(self) -> list[str]:
        """Display names of the steps: conv2d, batch_norm, silu, add, scale."""
        return [info.act.name.lower() if info.kind == "act" else info.kind for info in self.infos]

    @property
    def modules(self) -> list[str]:
        """The source modules of the chain's nodes (qualified names in the user's model), in order."""
        seen: list[str] = []
        for node in self.nodes:
            # folded_modules: modules a canonical rule folded into this node (an identity-branch BatchNorm)
            for source in [node.meta.get("source_module") or node.name, *node.meta.get("folded_modules", [])]:
                if source not in seen:
                    seen.append(source)
        return seen
