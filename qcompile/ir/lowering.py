"""Reference lowering: a Graph becomes one JAX function `fn(params, inputs) -> outputs` built from the ops' jnp rules.

The function is pure and traceable: the runtime jits it (donating the cache inputs) and `jax.export` can serialise
it. Weights are arguments, not constants, so one compiled executable serves any checkpoint of the same shape.
"""

from __future__ import annotations

from collections.abc import Callable

from qcompile.ir.graph import Graph, Value
from qcompile.ir.ops.core import Input, Param
from qcompile.ir.printer import describe_node
from qcompile.ir.registry import lowering_rule


class LoweringError(Exception):
    pass


def lower(graph: Graph, target: str = "reference") -> Callable[[dict, dict], dict]:
    """`fn(params, inputs) -> outputs` with each op lowered by `target`'s rule (the reference rule where it has none)."""
    nodes = list(graph.nodes())
    rules = {type(node.op): lowering_rule(type(node.op), target) for node in nodes
             if not isinstance(node.op, (Input, Param))}
    outputs = dict(graph.outputs)

    def step(params: dict, inputs: dict) -> dict:
        env: dict[Value, object] = {}
        for node in nodes:
            op = node.op
            if isinstance(op, Input):
                results = (inputs[op.name],)
            elif isinstance(op, Param):
                results = (params[op.name],)
            else:
                try:
                    out = rules[type(op)](op, *(env[v] for v in node.operands))
                except Exception as err:
                    raise LoweringError(f"while lowering {describe_node(graph, node)}: {err}") from err
                results = out if isinstance(out, tuple) else (out,)
            for value, result in zip(node.results, results):
                env[value] = result
        return {name: env[value] for name, value in outputs.items()}

    return step
