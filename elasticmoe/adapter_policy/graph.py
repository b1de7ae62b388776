"""What depends on what among the things that occupy a memory tier: CoServe's expert dependency
graph (§4.3), over our adapters.

A node is anything a tier holds: a LoRA adapter, an ESFT adapter, a learned LoRA router, a
per-token routing table and, where base experts are offloaded, a base MoE expert; each with its
footprint in the tier's unit (bytes, or slots where every slot has the same size). An edge
`p -> s` says that `s` runs only after, or together with, its predecessor `p`, as CoServe's
"subsequent" experts run after their "preliminary" ones:

- a learned router (or a per-token table) -> each adapter it mixes into a token;
- an ESFT adapter -> the base experts its tokens still reach, when experts are offloaded.

A successor none of whose predecessors is resident cannot run until one of them is loaded
first: it only holds memory (CoServe's stage-1 eviction candidates, `stranded`). A node with
no predecessor (something requested by name) is never stranded.

The graph is immutable; residency is an argument of the queries, so one graph serves every
eviction decision until adapters are loaded or unloaded.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    kind: str  # "lora", "esft", "router", "table", "expert", ...: the profile's latency model key
    footprint: int  # in the tier's unit (bytes, or slots)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("node: name must be non-empty")
        if not self.kind:
            raise ValueError(f"node {self.name!r}: kind must be non-empty")
        if self.footprint < 0:
            raise ValueError(f"node {self.name!r}: footprint must be >= 0, got {self.footprint}")


@dataclass(frozen=True, slots=True)
class DependencyGraph:
    """Nodes by name and predecessor -> successor edges.

    Invariants (checked at construction): every edge joins two known nodes, no node depends on
    itself, and `predecessors` / `successors` are the two directions of the same edge set.
    """

    nodes: Mapping[str, Node]
    edges: frozenset[tuple[str, str]] = frozenset()
    _preds: Mapping[str, frozenset[str]] = field(init=False, repr=False, compare=False)
    _succs: Mapping[str, frozenset[str]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for key, node in self.nodes.items():
            if key != node.name:
                raise ValueError(f"graph: node {node.name!r} is filed under {key!r}")
        preds: dict[str, set[str]] = {n: set() for n in self.nodes}
        succs: dict[str, set[str]] = {n: set() for n in self.nodes}
        for p, s in self.edges:
            if p not in self.nodes or s not in self.nodes:
                raise ValueError(f"graph: edge {p!r} -> {s!r} names an unknown node")
            if p == s:
                raise ValueError(f"graph: node {p!r} cannot depend on itself")
            preds[s].add(p)
            succs[p].add(s)
        object.__setattr__(self, "_preds", {n: frozenset(v) for n, v in preds.items()})
        object.__setattr__(self, "_succs", {n: frozenset(v) for n, v in succs.items()})

    @classmethod
    def build(cls, nodes: Iterable[Node], edges: Iterable[tuple[str, str]] = ()) -> DependencyGraph:
        """A graph of `nodes` (unique names) and `edges` (predecessor, successor)."""
        by_name: dict[str, Node] = {}
        for node in nodes:
            if node.name in by_name:
                raise ValueError(f"graph: node {node.name!r} given twice")
            by_name[node.name] = node
        return cls(by_name, frozenset(edges))

    def __contains__(self, name: object) -> bool:
        return name in self.nodes

    def footprint(self, name: str) -> int:
        return self.nodes[name].footprint

    def predecessors(self, name: str) -> frozenset[str]:
        return self._preds[name]

    def successors(self, name: str) -> frozenset[str]:
        return self._succs[name]

    def is_stranded(self, name: str, resident: Collection[str]) -> bool:
        """`name` runs only after a predecessor and none of its predecessors is resident."""
        preds = self._preds[name]
        return bool(preds) and not any(p in resident for p in preds)

    def stranded(self, resident: Collection[str]) -> list[str]:
        """The resident nodes that are stranded (CoServe §4.3 stage 1), in name order."""
        return sorted(n for n in resident if self.is_stranded(n, resident))
