"""Graph rewriting helpers for passes: rebuild a graph node by node with replacements, then drop dead nodes.

Two levels: `rewrite(graph, rule)` asks a function about every node (below); `apply_rules(graph, rules)` takes
replacement rules written as data — a `Pattern` of producers rooted at a node (with captures, commutative operands
and a single-use check on everything fused away) and a builder of the replacement, each with the one-line algebra
that makes it correct — and applies them to a fixpoint.

`rewrite(graph, rule)` walks the graph in topological order and asks `rule(builder, node, operands)` for each op
node; the rule returns the Values that replace the node's results (built with `builder`), or None to keep the node
as it is. Unchanged graphs come back as the same object, so a pass can return `PassResult(new, new is not graph)`.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
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


# -- patterns and rules as data --------------------------------------------------------------------------------------


@attrs.frozen
class Pattern:
    """A small tree of producers to match at a value: `op` (a class or tuple of classes; `where(op)` narrows it),
    its operands as sub-patterns, capture names (str: binds the operand value; the same name twice must bind the
    same value) or None (anything). `capture` names the matched node's result. `commutative` also tries the two
    operands swapped. Inner nodes of a match must have no user outside it (nothing else needs what is fused away)."""

    op: object
    operands: tuple = ()
    where: Callable | None = None
    capture: str | None = None
    commutative: bool = False


@attrs.frozen
class RewriteRule:
    """A replacement as data: `pattern` rooted at a node, `build(builder, captures)` returning the replacement of the
    root's (single) result, and `algebra`, the one-line identity that makes it correct."""

    name: str
    algebra: str
    pattern: Pattern
    build: Callable
    when: Callable | None = None  # when(graph, captures of original values) -> bool: conditions beyond the shape


def _uses(graph: Graph) -> dict[Value, int]:
    counts: dict[Value, int] = {value: 1 for value in graph.outputs.values()}
    for node in graph.nodes():
        for operand in node.operands:
            counts[operand] = counts.get(operand, 0) + 1
    return counts


def match(graph: Graph, value: Value, pattern: Pattern, uses: dict[Value, int], root: bool = True) -> dict | None:
    """Captures {name: original Value} when `pattern` matches the producers of `value`, else None."""
    node = graph.node(value.node)
    if not isinstance(node.op, pattern.op) or (pattern.where is not None and not pattern.where(node.op)):
        return None
    if not root and uses.get(value, 0) != 1:
        return None
    orders = [pattern.operands]
    if pattern.commutative and len(pattern.operands) == 2:
        orders.append(pattern.operands[::-1])
    for operands in orders:
        if len(operands) != len(node.operands):
            continue
        captures: dict | None = {pattern.capture: value} if pattern.capture else {}
        for sub, operand in zip(operands, node.operands):
            found = {sub: operand} if isinstance(sub, str) else {} if sub is None else match(graph, operand, sub, uses,
                                                                                            root=False)
            if found is None or any(captures.get(k, v) != v for k, v in found.items()):
                captures = None
                break
            captures.update(found)
        if captures is not None:
            return captures
    return None


def apply_rules(graph: Graph, rules: list[RewriteRule], max_rounds: int = 8) -> tuple[Graph, dict[str, int]]:
    """Apply `rules` until none matches (a fixpoint; at most `max_rounds` rebuilds). Returns the graph (the same object
    when nothing matched) and how often each rule fired."""
    fired = {rule.name: 0 for rule in rules}
    for _ in range(max_rounds):
        uses = _uses(graph)
        builder = Builder()
        mapping: dict[Value, Value] = {}
        replaced = 0
        for node in graph.nodes():
            new = None
            if not isinstance(node.op, (Input, Param)) and len(node.results) == 1:
                for rule in rules:
                    captures = match(graph, node.results[0], rule.pattern, uses)
                    if captures is not None and (rule.when is None or rule.when(graph, captures)):
                        # captures translated to the new graph (the root's own capture, if any, is what is replaced)
                        new = rule.build(builder, {k: mapping[v] for k, v in captures.items() if v in mapping})
                        fired[rule.name] += 1
                        replaced += 1
                        break
            if new is None:
                new = copy_node(builder, node, [mapping[v] for v in node.operands])
            new = new if isinstance(new, tuple) else (new,)
            mapping.update(zip(node.results, new))
        if not replaced:
            return graph, fired
        for name, value in graph.outputs.items():
            builder.output(name, mapping[value])
        graph = eliminate_dead_nodes(builder.build(graph.meta))
    raise RuntimeError(f"rewrite rules {[r.name for r in rules]} did not reach a fixpoint in {max_rounds} rounds")
