"""Verifier: structural and type invariants of a Graph; runs after every pass that changed the graph.

Checks: acyclic; every operand names an existing result; edges mirror operands; every op is registered and its
stored result types equal what its type rule infers from its operands; inputs and params have unique names;
outputs exist. With shardings: every sharded value fits the graph's mesh (each logical axis has a rule, no mesh axis
is used twice, every integer dim divides by its pieces), each collective runs over the mesh axes its logical axis
maps to, and no output is a partial sum. Failures raise VerificationError (exit code 4) naming the node in text form.
"""

from __future__ import annotations

import networkx as nx

from qcompile.errors import VerificationError
from qcompile.ir.graph import Graph
from qcompile.ir.mesh import sharding_problems
from qcompile.ir.ops.core import Input, Param
from qcompile.ir.printer import describe_node
from qcompile.ir.registry import LOWERINGS, OPS, OpTypeError, infer_types


def verify(graph: Graph) -> None:
    dag = graph.dag
    mesh = graph.meta.get("mesh")
    if not nx.is_directed_acyclic_graph(dag):
        cycle = nx.find_cycle(dag)
        raise VerificationError(f"graph has a cycle through nodes {[u for u, _ in cycle]}")
    leaves: dict[tuple[str, str], int] = {}
    for node in graph.nodes():
        where = describe_node(graph, node)
        if OPS.get(getattr(node.op, "op_name", None)) is not type(node.op):
            raise VerificationError(f"unregistered op {type(node.op).__name__} in: {where}")
        if not isinstance(node.op, (Input, Param)) and (type(node.op), "reference") not in LOWERINGS:
            raise VerificationError(f"op {node.op.op_name} has no lowering rule: {where}")
        for value in node.operands:
            if value.node not in dag or value.index >= len(graph.node(value.node).types):
                raise VerificationError(f"operand {value} is not defined: {where}")
        if set(dag.predecessors(node.id)) != {v.node for v in node.operands}:
            raise VerificationError(f"edges do not match operands: {where}")
        try:
            inferred = infer_types(node.op, [graph.type_of(v) for v in node.operands])
        except OpTypeError as err:
            raise VerificationError(f"type error ({err}): {where}") from None
        if tuple(inferred) != tuple(node.types):
            shown = ", ".join(str(t) for t in inferred)
            raise VerificationError(f"result types do not match the type rule (expected {shown}): {where}")
        for type_ in node.types:
            for problem in sharding_problems(mesh, type_):
                raise VerificationError(f"{problem}: {where}")
        over = getattr(node.op, "over", None)
        if over is not None and hasattr(node.op, "mesh_axes"):
            expected = mesh.rule(over) if mesh is not None and over in dict(mesh.rules) else None
            if tuple(node.op.mesh_axes) != expected:
                raise VerificationError(f"collective over {over!r} runs on mesh axes {list(node.op.mesh_axes)}, "
                                        f"but the mesh maps {over!r} to {list(expected or ())}: {where}")
            split = getattr(node.op, "split", "")
            if split and (split not in dict(mesh.rules) or mesh.rule(split) != expected):
                raise VerificationError(f"{node.op.op_name} splits along {split!r}, which the mesh does not map to the "
                                        f"mesh axes of {over!r} ({list(expected)}): {where}")
            stages = getattr(node.op, "stages", ())
            if stages:
                across_then_local = stages if node.op.op_name == "all_gather" else stages[::-1]
                if len(stages) != 2 or not all(stages) or sum(across_then_local, ()) != tuple(node.op.mesh_axes):
                    raise VerificationError(f"{node.op.op_name} stages {[list(s) for s in stages]} must be two groups "
                                            f"that split its mesh axes {list(node.op.mesh_axes)} into across (outer) "
                                            "and local (inner) — a reduce-scatter local first, an all-gather across "
                                            f"first: {where}")
            ways = getattr(node.op, "ways", None)
            if ways is not None and ways != mesh.ways(over):
                raise VerificationError(f"{node.op.op_name} sends to {ways} devices, but {over!r} splits over "
                                        f"{mesh.ways(over)}: {where}")
        if isinstance(node.op, (Input, Param)):
            key = (node.op.op_name, node.op.name)
            if key in leaves:
                raise VerificationError(f"{key[0]} {key[1]!r} defined twice: {where}")
            leaves[key] = node.id
    for name, value in graph.outputs.items():
        if value.node not in dag or value.index >= len(graph.node(value.node).types):
            raise VerificationError(f"output {name!r} refers to an undefined value {value}")
        sharding = graph.type_of(value).sharding
        if sharding is not None and sharding.partial:
            raise VerificationError(f"output {name!r} is a partial sum over {list(sharding.partial)}; reduce it "
                                    "(all_reduce or reduce_scatter) before it leaves the step")
