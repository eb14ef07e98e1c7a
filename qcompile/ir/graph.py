"""Graph: the IR container. Owns a networkx.DiGraph whose nodes are ops with ordered operands.

Each node stores its op (a frozen attrs instance: attributes only, semantics live in side tables), its operands as an
ordered tuple of `Value`s (so `add(x, x)` keeps two operands even though it has one edge) and its result types. Edges
mirror operand use and serve the topological order. Graph outputs are named values. A graph is built by `Builder` and
then treated as immutable: passes return new graphs.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import networkx as nx

from qcompile.ir.types import TensorType


@attrs.frozen(order=True)
class Value:
    """Result `index` of node `node`."""

    node: int
    index: int = 0


@attrs.frozen
class Node:
    id: int
    op: object
    operands: tuple[Value, ...]
    types: tuple[TensorType, ...]

    @property
    def results(self) -> tuple[Value, ...]:
        return tuple(Value(self.id, i) for i in range(len(self.types)))


class Graph:
    """A step graph: nodes in a DiGraph, named outputs. Read-only API; see builder.Builder to make one."""

    def __init__(self, dag: nx.DiGraph, outputs: dict[str, Value], meta: dict | None = None):
        self._dag = dag
        self.outputs = dict(outputs)
        self.meta = dict(meta or {})
        self._order: list[int] | None = None

    @property
    def dag(self) -> nx.DiGraph:
        return self._dag

    def node(self, node_id: int) -> Node:
        return self._dag.nodes[node_id]["node"]

    def order(self) -> list[int]:
        """Node ids in a deterministic topological order (ties broken by id)."""
        if self._order is None:
            self._order = list(nx.lexicographical_topological_sort(self._dag))
        return self._order

    def nodes(self) -> Iterator[Node]:
        for node_id in self.order():
            yield self.node(node_id)

    def type_of(self, value: Value) -> TensorType:
        return self.node(value.node).types[value.index]

    def __len__(self) -> int:
        return self._dag.number_of_nodes()

    def find(self, op_class) -> list[Node]:
        return [n for n in self.nodes() if isinstance(n.op, op_class)]
