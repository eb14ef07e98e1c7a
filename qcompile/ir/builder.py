"""Builder: the one way to make a Graph. Each `add` infers result types with the op's type rule."""

from __future__ import annotations

import networkx as nx

from qcompile.ir import ops as _ops  # noqa: F401  (registers the op catalogue)
from qcompile.ir.graph import Graph, Node, Value
from qcompile.ir.ops.core import Input, Param
from qcompile.ir.registry import OpTypeError, infer_types
from qcompile.ir.types import TensorType


class Builder:
    def __init__(self):
        self._dag = nx.DiGraph()
        self._outputs: dict[str, Value] = {}
        self._leaves: dict[tuple[type, str], Value] = {}

    def type_of(self, value: Value) -> TensorType:
        return self._dag.nodes[value.node]["node"].types[value.index]

    def add(self, op, *operands: Value):
        """Append `op` applied to `operands`; returns its Value, or a tuple of Values for multi-result ops."""
        try:
            types = infer_types(op, [self.type_of(v) for v in operands])
        except OpTypeError as err:
            raise OpTypeError(f"{op.op_name}: {err}") from None
        return self.add_typed(op, operands, types)

    def add_typed(self, op, operands, types) -> Value | tuple[Value, ...]:
        """Append a node with given result types (used by copies and parsers; the verifier re-checks them)."""
        node_id = self._dag.number_of_nodes()
        node = Node(node_id, op, tuple(operands), tuple(types))
        self._dag.add_node(node_id, node=node)
        for operand in node.operands:
            self._dag.add_edge(operand.node, node_id)
        results = node.results
        return results[0] if len(results) == 1 else results

    def annotate(self, value: Value, sharding) -> None:
        """Give an already added result a sharding (a rewrite keeping the layout of the value it replaces); a param's
        or input's declared type changes with it."""
        import attrs

        node = self._dag.nodes[value.node]["node"]
        types = list(node.types)
        types[value.index] = types[value.index].with_sharding(sharding)
        op = node.op
        if isinstance(op, (Input, Param)):
            op = attrs.evolve(op, type=types[value.index])
        self._dag.nodes[value.node]["node"] = attrs.evolve(node, op=op, types=tuple(types))

    def _leaf(self, cls, name: str, type_: TensorType) -> Value:
        key = (cls, name)
        if key not in self._leaves:
            self._leaves[key] = self.add(cls(name, type_))
        elif self.type_of(self._leaves[key]) != type_:
            raise OpTypeError(f"{cls.op_name} {name!r} declared twice with different types")
        return self._leaves[key]

    def input(self, name: str, type_: TensorType) -> Value:
        return self._leaf(Input, name, type_)

    def param(self, name: str, type_: TensorType) -> Value:
        return self._leaf(Param, name, type_)

    def output(self, name: str, value: Value) -> None:
        if name in self._outputs:
            raise OpTypeError(f"output {name!r} set twice")
        self._outputs[name] = value

    def build(self, meta: dict | None = None) -> Graph:
        return Graph(self._dag.copy(), self._outputs, meta)
