"""The text form of the IR: one op per line, values numbered in topological order.

    %0 = input "token_ids" : i32[T]
    %7 = rmsnorm(%5, %6) {eps=1e-06, zero_centered=true} : f32[T,96]
    %12, %13 = causal_conv1d(%9, %10, %11, %2, %4) {activation="silu"} : f32[T,192], f32[S,192,3]
    return logits=%90, layers.0.conv_state=%13

Used by `graph.qir`, `--print-ir-after`, dumps, golden tests and error messages alike.
"""

from __future__ import annotations

import re

import attrs

from qcompile.ir.graph import Graph, Node, Value
from qcompile.ir.ops.core import Input, Param


_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_.]+$")


def format_attr(value) -> str:
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy scalars print as Python values
        value = value.item()
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + "".join(_ESCAPES.get(c, c) for c in value) + '"'
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(format_attr(v) for v in value) + "]"
    return repr(value)


def format_op(node: Node, name_of) -> str:
    op = node.op
    results = ", ".join(name_of(v) for v in node.results)
    types = ", ".join(str(t) for t in node.types)
    if isinstance(op, (Input, Param)):
        return f"{results} = {op.op_name} {format_attr(op.name)} : {types}"
    operands = ", ".join(name_of(v) for v in node.operands)
    fields = [f"{f.name}={format_attr(getattr(op, f.name))}" for f in attrs.fields(type(op))]
    attr_text = f" {{{', '.join(fields)}}}" if fields else ""
    return f"{results} = {op.op_name}({operands}){attr_text} : {types}"


class Namer:
    """Sequential %N names in print order."""

    def __init__(self):
        self.names: dict[Value, str] = {}

    def assign(self, node: Node) -> None:
        for value in node.results:
            self.names[value] = f"%{len(self.names)}"

    def __call__(self, value: Value) -> str:
        return self.names.get(value, f"%?{value.node}#{value.index}")


def print_graph(graph: Graph, title: str | None = None) -> str:
    namer = Namer()
    lines = [f"graph @{title or graph.meta.get('name', 'step')} {{"]
    mesh = graph.meta.get("mesh")
    if mesh is not None:
        fields = ", ".join(f"{key}={format_attr(value)}" for key, value in mesh.attributes().items())
        lines.append(f"  mesh {{{fields}}}")
    for node in graph.nodes():
        namer.assign(node)
        lines.append("  " + format_op(node, namer))
    outs = ", ".join(f"{name if _PLAIN_NAME.match(name) else format_attr(name)}={namer(v)}"
                     for name, v in graph.outputs.items())
    lines.append(f"  return {outs}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def describe_node(graph: Graph, node: Node) -> str:
    """One node in text form with stable names (for error messages)."""
    return format_op(node, lambda v: f"%n{v.node}" + (f"#{v.index}" if v.index else ""))
