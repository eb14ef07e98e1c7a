"""Graph rewriting helpers for passes: rebuild a graph node by node with replacements, then drop dead nodes.

`rewrite(graph, rule)` walks the graph in topological order and asks `rule(builder, node, operands)` for each op
node; the rule returns the Values that replace the node's results (built with `builder`), or None to keep the node
as it is. Unchanged graphs come back as the same object, so a pass can return `PassResult(new, new is not graph)`.
"""

from __future__ import annotations

from collections.abc import Callable

import networkx as nx

from qcompile.ir.builder import Builder
from qcompile.ir.graph import Graph, Node, Value
from qcompile.ir.ops.core import Input, Param

Rule = Callable[[Builder, Node, list[Value]], "tuple[Value, ...] | Value | None"]


def copy_node(builder: Builder, node: Node, operands: list[Value]):
    if isinstance(node.op, Input):
        return builder.input(node.op.name, node.op.type)
    if isinstance(node.op, Param):
        return builder.param(node.op.name, node.op.type)
    return builder.add_typed(node.op, operands, node.types)


def rewrite(graph: Graph, rule: Rule) -> tuple[Graph, int]:
    """(new graph, number of nodes the rule replaced); the same graph object when it replaced none."""
    builder = Builder()
    mapping: dict[Value, Value] = {}
    replaced = 0
    for node in graph.nodes():
        operands = [mapping[v] for v in node.operands]
        new = None if isinstance(node.op, (Input, Param)) else rule(builder, node, operands)
        if new is None:
            new = copy_node(builder, node, operands)
        else:
            replaced += 1
        new = new if isinstance(new, tuple) else (new,)
        if len(new) != len(node.types):
            raise ValueError(f"rule replaced {len(node.types)} results of {node.op.op_name} with {len(new)}")
        mapping.update(zip(node.results, new))
    if not replaced:
        return graph, 0
    for name, value in graph.outputs.items():
        builder.output(name, mapping[value])
    return eliminate_dead_nodes(builder.build(graph.meta)), replaced


def eliminate_dead_nodes(graph: Graph) -> Graph:
    """Keep only nodes that some output depends on (graph inputs stay: they are the step's interface)."""
    live = set()
    for value in graph.outputs.values():
        live.add(value.node)
        live |= nx.ancestors(graph.dag, value.node)
    live |= {node.id for node in graph.find(Input)}
    if len(live) == len(graph):
        return graph
    return Graph(graph.dag.subgraph(live).copy(), graph.outputs, graph.meta)
