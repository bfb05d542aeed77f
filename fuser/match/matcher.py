"""The one generic matcher: every pattern of fuser.match.patterns, found with networkx's DiGraphMatcher.

The fx graph becomes a DiGraph of its classified nodes (kinds from fuser.graph_ops) with an edge for each
direct data dependency; each pattern is a small path DiGraph; a match is a subgraph monomorphism whose node
kinds agree. Patterns are tried in priority order and matches in graph order; a match whose nodes are free
and that passes every guard is accepted and claims its nodes. For every conv or linear that heads a candidate
chain and ends up in no accepted chain, the report gets the reason of its highest-priority failed form, and
so does every BatchNorm that stays unfolded (after a concat, say).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import torch.fx as fx
from networkx.algorithms import isomorphism

from fuser.graph_ops import OpInfo, classify, unsupported_successor
from fuser.match.chain import Chain, describe_node
from fuser.match.guards import GUARDS, Guard, first_failure
from fuser.match.patterns import PATTERNS, ChainPattern


@dataclass
class Rejection:
    chain: Chain
    reason: str


@dataclass
class MatchResult:
    accepted: list[Chain] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)


def classified_graph(gm: fx.GraphModule) -> tuple[nx.DiGraph, dict[fx.Node, OpInfo]]:
    """The DiGraph the patterns are matched in: classified nodes, edges along direct data flow."""
    modules = dict(gm.named_modules())
    infos = {n: info for n in gm.graph.nodes if (info := classify(n, modules)) is not None}
    g = nx.DiGraph()
    for node, info in infos.items():
        g.add_node(node, kind=info.kind)
    for node in infos:
        for user in node.users:
            if user in infos:
                g.add_edge(node, user)
    return g, infos


def _unfolded_batchnorms(
    infos: dict[fx.Node, OpInfo], claimed: set[fx.Node], rejected: list[Rejection], graph_path: str
) -> list[Rejection]:
    """A rejection for every BatchNorm that no chain folds and no rejected chain already explains."""
    explained = {n for r in rejected for n in r.chain.nodes}
    found = []
    for node, info in infos.items():
        if info.kind != "batch_norm" or node in claimed or node in explained:
            continue
        producer = info.data
        kind = infos[producer].kind if producer in infos else None
        if kind in ("conv2d", "linear"):
            users = ", ".join(f"`{u.name}`" for u in producer.users)
            reason = (
                f"BatchNorm {describe_node(node)} is not folded: the {kind} {describe_node(producer)} before it "
                f"also feeds other ops ({users}), or is fused in another chain"
            )
        else:
            what = describe_node(producer) if isinstance(producer, fx.Node) else repr(producer)
            reason = (
                f"BatchNorm {describe_node(node)} follows {what}, not a conv or linear it could be folded into: "
                "it runs as its own op"
            )
        chain = Chain(ChainPattern("batch_norm", ("batch_norm",)), [node], [info], graph_path)
        found.append(Rejection(chain, reason))
    return found


def find_chains(
    gm: fx.GraphModule,
    graph_path: str = "",
    patterns: list[ChainPattern] | None = None,
    guards: list[Guard] | None = None,
) -> MatchResult:
    """Every fusable chain of ``gm`` (accepted) and every candidate that is not (rejected, with a reason)."""
    patterns = PATTERNS if patterns is None else patterns
    guards = GUARDS if guards is None else guards
    g, infos = classified_graph(gm)
    modules = dict(gm.named_modules())
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    claimed: set[fx.Node] = set()
    failures: dict[fx.Node, Rejection] = {}
    result = MatchResult()

    for pattern in patterns:
        matcher = isomorphism.DiGraphMatcher(g, pattern.graph(), node_match=lambda a, b: a["kind"] == b["kind"])
        occurrences = [
            [n for n, _ in sorted(mapping.items(), key=lambda item: item[1])]
            for mapping in matcher.subgraph_monomorphisms_iter()
        ]
        for nodes in sorted(occurrences, key=lambda ns: order[ns[0]]):
            if claimed.intersection(nodes):
                continue
            chain = Chain(pattern, nodes, [infos[n] for n in nodes], graph_path)
            reason = first_failure(chain, gm, guards)
            if reason is not None:
                failures.setdefault(nodes[0], Rejection(chain, reason))
                continue
            if nodes[0] in failures:
                longer = failures[nodes[0]]
                chain.notes.append(f"not fused as {' -> '.join(longer.chain.ops)}: {longer.reason}")
            unsupported = unsupported_successor(nodes[-1], modules)
            if unsupported:
                chain.notes.append(f"followed by {unsupported}, which no epilogue implements")
            claimed.update(nodes)
            result.accepted.append(chain)

    result.rejected = [r for head, r in failures.items() if head not in claimed]
    for node, info in infos.items():
        if info.kind in ("conv2d", "linear") and node not in claimed and node not in failures:
            unsupported = unsupported_successor(node, modules)
            if unsupported:
                name = "conv_act" if info.kind == "conv2d" else "gemm_epilogue"
                chain = Chain(ChainPattern(name, (info.kind,)), [node], [info], graph_path)
                result.rejected.append(
                    Rejection(
                        chain,
                        f"{describe_node(node)} is followed by {unsupported}, which no epilogue implements",
                    )
                )
    result.rejected += _unfolded_batchnorms(infos, claimed, result.rejected, graph_path)
    result.accepted.sort(key=lambda c: order[c.head])
    result.rejected.sort(key=lambda r: order[r.chain.head])
    return result
