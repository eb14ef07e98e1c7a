"""Graph rewriting helpers for passes: rebuild a graph node by node with replacements, then drop dead nodes.

Two levels: `rewrite(graph, rule)` asks a function about every node (below); `apply_rules(graph, rules)` takes
replacement rules written as data — a `Pattern`, a small DAG of producers rooted at a node (with captures,
multi-result producers, commutative operands, and a check that nothing outside the match uses what is fused away)
and a builder of the replacement, each with the one-line algebra that makes it correct — and applies them to a
fixpoint; `apply_rules_pass` makes such rules a pass.

`rewrite(graph, rule)` walks the graph in topological order and asks `rule(builder, node, operands)` for each op
node; the rule returns the Values that replace the node's results (built with `builder`), or None to keep the node
as it is. Unchanged graphs come back as the same object, so a pass can return `PassResult(new, new is not graph)`.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from qcompile.ir.builder import Builder
from qcompile.ir.graph import Graph, Node, Value
from qcompile.ir.ops.core import Concat, Input, Param, Slice
from qcompile.passes.base import PassResult
from qcompile.ir.types import TensorType  # noqa: F401 - in annotations

Rule = Callable[[Builder, Node, list[Value]], "tuple[Value, ...] | Value | None"]


def copy_node(builder: Builder, node: Node, operands: list[Value]):
    if isinstance(node.op, Input):
        return builder.input(node.op.name, node.op.type)
    if isinstance(node.op, Param):
        return builder.param(node.op.name, node.op.type)
    return builder.add_typed(node.op, operands, node.types)


def rewrite(graph: Graph, rule: Rule) -> tuple[Graph, int]:
    """(new graph, number of nodes the rule replaced); the same graph object when it replaced none."""
    new_graph, replaced = rebuild(graph, lambda builder, node, operands, mapping: rule(builder, node, operands))
    return (new_graph, replaced) if replaced else (graph, 0)


def rebuild(graph: Graph, rule, meta: dict | None = None) -> tuple[Graph, int]:
    """`rewrite` for rules that need more than a node's operands: `rule(builder, node, operands, mapping)` also sees
    `mapping` (every earlier node's results -> their replacements), so it can rebuild a producer it skipped past or a
    value it matched elsewhere. Returns the rebuilt graph (with `meta` when given), dead nodes dropped, and the count
    of replaced nodes."""
    builder = Builder()
    mapping: dict[Value, Value] = {}
    replaced = 0
    for node in graph.nodes():
        operands = [mapping[v] for v in node.operands]
        new = None if isinstance(node.op, (Input, Param)) else rule(builder, node, operands, mapping)
        if new is None:
            new = copy_node(builder, node, operands)
        else:
            replaced += 1
        new = new if isinstance(new, tuple) else (new,)
        if len(new) != len(node.types):
            raise ValueError(f"rule replaced {len(node.types)} results of {node.op.op_name} with {len(new)}")
        mapping.update(zip(node.results, new))
    for name, value in graph.outputs.items():
        builder.output(name, mapping[value])
    return eliminate_dead_nodes(builder.build(graph.meta if meta is None else meta)), replaced


def retype_inputs(graph: Graph, types: dict[str, "TensorType"], evolve_op: Callable | None = None,
                  meta: dict | None = None) -> tuple[Graph, int]:
    """`graph` with the named inputs given new types (shardings kept) and every op that (transitively) reads them
    re-typed by its type rule; `evolve_op(op)` may return a changed op for such a node (e.g. a new attribute that the
    new type needs), None to keep it. Returns the graph (with `meta` when given) and the number of ops re-typed."""
    from qcompile.ir.registry import infer_types

    builder = Builder()
    mapping: dict[Value, Value] = {}
    retyped = 0
    for node in graph.nodes():
        operands = [mapping[v] for v in node.operands]
        if isinstance(node.op, Input) and node.op.name in types:
            new = builder.input(node.op.name, types[node.op.name].with_sharding(node.op.type.sharding))
        elif not isinstance(node.op, (Input, Param)) and any(
                builder.type_of(new) != graph.type_of(old) for new, old in zip(operands, node.operands)):
            op_ = (evolve_op(node.op) if evolve_op is not None else None) or node.op
            inferred = infer_types(op_, [builder.type_of(v) for v in operands])  # re-typed by its type rule
            new = builder.add_typed(op_, operands, [t.with_sharding(old.sharding)
                                                    for t, old in zip(inferred, node.types)])
            retyped += 1
        else:
            new = copy_node(builder, node, operands)
        new = new if isinstance(new, tuple) else (new,)
        mapping.update(zip(node.results, new))
    for name, value in graph.outputs.items():
        builder.output(name, mapping[value])
    return eliminate_dead_nodes(builder.build(graph.meta if meta is None else meta)), retyped


def eliminate_dead_nodes(graph: Graph) -> Graph:
    """Keep only nodes that some output depends on (graph inputs stay: they are the step's interface)."""
    live = {value.node for value in graph.outputs.values()}
    stack = list(live)
    while stack:  # one walk back from every output at once: linear in the graph, however many outputs (caches)
        for producer in graph.dag.predecessors(stack.pop()):
            if producer not in live:
                live.add(producer)
                stack.append(producer)
    live |= {node.id for node in graph.find(Input)}
    if len(live) == len(graph):
        return graph
    return Graph(graph.dag.subgraph(live).copy(), graph.outputs, graph.meta)


# -- patterns and rules as data --------------------------------------------------------------------------------------


@attrs.frozen
class Pattern:
    """A small DAG of producers to match at a value: `op` (a class or tuple of classes; `where(op)` narrows it),
    its operands as sub-patterns, capture names (str: binds the operand value; the same name twice must bind the
    same value) or None (anything). `capture` names the matched value; `results` names the node's results by
    position (so a producer reached along several paths — one conv feeding three slices — is one node, and a result
    no operand leads to, like its new state, can be captured and replaced). `index` is the result of the producer
    that the operand must be. `commutative` also tries the two operands swapped. Every user of an inner node's
    results must lie inside the match, unless the rule replaces that result (nothing else needs what is fused away)."""

    op: object
    operands: tuple = ()
    where: Callable | None = None
    capture: str | None = None
    commutative: bool = False
    results: tuple = ()
    index: int = 0


class Captures(dict):
    """{capture name: Value} as a rule's builder sees them (values of the graph being built), plus `ops`: the op of
    the original node that produced each captured value (to copy attributes from)."""

    def __init__(self, values: dict, ops: dict):
        super().__init__(values)
        self.ops = ops


@attrs.frozen
class RewriteRule:
    """A replacement as data: `pattern` rooted at a node, `build(builder, captures)` returning the replacement of the
    root's results (a Value or a tuple), or a dict {capture name: new Value} naming the root's results (through
    `Pattern.results`) and each captured value in `replaces`; and `algebra`, the one-line identity that makes it
    correct."""

    name: str
    algebra: str
    pattern: Pattern
    build: Callable
    when: Callable | None = None  # when(graph, captures of original values) -> bool: conditions beyond the shape
    replaces: tuple[str, ...] = ()  # captured results of inner nodes that the replacement also provides


@attrs.frozen
class Match:
    captures: dict  # name -> original Value
    nodes: frozenset  # ids of every matched node, root included


def _users(graph: Graph) -> dict[Value, set]:
    """Value -> ids of the nodes using it ("output" for a graph output)."""
    users: dict[Value, set] = {value: {"output"} for value in graph.outputs.values()}
    for node in graph.nodes():
        for operand in node.operands:
            users.setdefault(operand, set()).add(node.id)
    return users


def _match_tree(graph: Graph, value: Value, pattern: Pattern, root: bool) -> tuple[dict, set] | None:
    node = graph.node(value.node)
    if not isinstance(node.op, pattern.op) or (pattern.where is not None and not pattern.where(node.op)):
        return None
    if not root and value.index != pattern.index:
        return None
    orders = [pattern.operands]
    if pattern.commutative and len(pattern.operands) == 2:
        orders.append(pattern.operands[::-1])
    own = {name: Value(node.id, i) for i, name in enumerate(pattern.results) if name}
    if pattern.capture:
        own[pattern.capture] = value
    for operands in orders:
        if len(operands) != len(node.operands):
            continue
        captures: dict | None = dict(own)
        nodes = {node.id}
        for sub, operand in zip(operands, node.operands):
            if isinstance(sub, str):
                found, found_nodes = {sub: operand}, set()
            elif sub is None:
                found, found_nodes = {}, set()
            else:
                got = _match_tree(graph, operand, sub, root=False)
                if got is None:
                    captures = None
                    break
                found, found_nodes = got
            if any(captures.get(k, v) != v for k, v in found.items()):
                captures = None
                break
            captures.update(found)
            nodes |= found_nodes
        if captures is not None:
            return captures, nodes
    return None


def match(graph: Graph, value: Value, pattern: Pattern, users: dict | None = None,
          replaces: tuple[str, ...] = ()) -> Match | None:
    """The match of `pattern` at the producers of `value` (captures as original Values), or None. Inner nodes must be
    closed: each of their results is used only inside the match, or is a captured result named in `replaces`."""
    got = _match_tree(graph, value, pattern, root=True)
    if got is None:
        return None
    captures, nodes = got
    users = _users(graph) if users is None else users
    replaced = {captures[name] for name in replaces if name in captures}
    for node_id in nodes - {value.node}:
        for result in graph.node(node_id).results:
            if result not in replaced and not users.get(result, set()) <= nodes:
                return None
    return Match(captures, frozenset(nodes))


def apply_rules(graph: Graph, rules: list[RewriteRule], max_rounds: int = 8) -> tuple[Graph, dict[str, int]]:
    """Apply `rules` until none matches (a fixpoint; at most `max_rounds` rebuilds). Returns the graph (the same object
    when nothing matched) and how often each rule fired.

    Nodes are rebuilt in topological order; a root that matches is replaced where it stands, and the inner results a
    rule replaces are remapped for every later user (the graph's outputs included); the rest of the match dies."""
    fired = {rule.name: 0 for rule in rules}
    for _ in range(max_rounds):
        users = _users(graph)
        builder = Builder()
        mapping: dict[Value, Value] = {}
        replaced = 0
        consumed: set = set()  # nodes already fused into a replacement in this round
        for node in graph.nodes():
            new = None
            if not isinstance(node.op, (Input, Param)) and node.id not in consumed:
                for rule in rules:
                    found = match(graph, node.results[0], rule.pattern, users, rule.replaces)
                    if found is None or found.nodes & consumed:
                        continue
                    if rule.when is not None and not rule.when(graph, found.captures):
                        continue
                    captures = Captures({k: mapping[v] for k, v in found.captures.items() if v in mapping},
                                        {k: graph.node(v.node).op for k, v in found.captures.items()})
                    new = _bind(rule, node, rule.build(builder, captures), found, mapping)
                    _keep_shardings(graph, builder, [*node.results, *(found.captures[n] for n in rule.replaces)],
                                    [*new, *(mapping[found.captures[n]] for n in rule.replaces)])
                    consumed |= found.nodes
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


def _keep_shardings(graph: Graph, builder: Builder, old: list[Value], new: list[Value]) -> None:
    """A replacement keeps the layout of what it replaces: a new result without a sharding takes the old one's."""
    for before, after in zip(old, new):
        sharding = graph.type_of(before).sharding
        if sharding is not None and builder.type_of(after).sharding is None:
            builder.annotate(after, sharding)


def _bind(rule: RewriteRule, root: Node, built, found: Match, mapping: dict) -> tuple:
    """The root's new results from what `build` returned; replaced inner results go into `mapping`."""
    if not isinstance(built, dict):
        return built if isinstance(built, tuple) else (built,)
    for name in rule.replaces:
        mapping[found.captures[name]] = built[name]
    names = rule.pattern.results or ((rule.pattern.capture,) if rule.pattern.capture else ())
    if len(names) != len(root.results) or any(n not in built for n in names):
        raise ValueError(f"rule {rule.name} must return every result of {root.op.op_name} by its capture name")
    return tuple(built[n] for n in names)


def apply_rules_pass(graph: Graph, rules: list[RewriteRule], not_found: str) -> PassResult:
    """A pass made of rules: `apply_rules`, with the rules' fire counts as its stats, or skipped with `not_found`."""
    new, fired = apply_rules(graph, rules)
    if new is graph:
        return PassResult(graph, False, fired, skipped=not_found)
    return PassResult(new, True, fired)


def regroup_rows(builder: Builder, w: Value, sections, groups: int) -> Value:
    """Weight preparation for tensor parallelism: the rows of w [s0 | s1 | ..., ...] regrouped as groups × [s0_j |
    s1_j | ...] (ir/abi.py `grouped_order`), so that each device's contiguous block of rows holds its own part of
    every section — its heads' q, k and v of a fused projection, its gate and up of a fused SwiGLU weight. Params-only
    ops: folded into one prepared weight at compile time. Written as row slices and one concat (not reshapes), so an
    FP8 weight's values and block scales are regrouped alike (ir/fp8_layout.py) and the prepared weight stays FP8."""
    pieces, start = [], 0
    for size in sections:
        pieces.append([(start + j * (size // groups), start + (j + 1) * (size // groups)) for j in range(groups)])
        start += size
    return builder.add(Concat(0), *(builder.add(Slice(0, lo, hi), w) for j in range(groups) for lo, hi in
                                    (section[j] for section in pieces)))
