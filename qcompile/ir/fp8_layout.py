"""Layout ops on FP8 weights: applied to the values and the block scales, so a prepared weight stays FP8.

Why: weight preparation changes a weight's layout — the importer transposes the routed experts, swiglu-fusion
concatenates gate and up — and a dequantized weight is no longer FP8. Dequantization is elementwise, so a layout op
commutes with it when the scale moves with the values:

    transpose(dequantize(w, s){block})        = dequantize(transpose(w), transpose(s)){block permuted}
    slice(dequantize(w, s)) on block edges    = dequantize(slice(w), slice(s))
    concat(dequantize(w_i, s_i)), blocks whole = dequantize(concat(w_i), concat(s_i))
    cast(dequantize(w, s){dtype})             = dequantize(w, s){new dtype}

A cut inside a block (a slice, or a concat operand whose size is not a multiple of the block) first makes the scale
finer along that axis (`refine_scale`: blocks of 1 there), so every layout op above sinks; a scale then costs more
bytes, never the weight. `sink_dequantize` rewrites a graph so; `fold_weight_preparation` (ir/weights.py) calls it
first, then folds the FP8 layout ops into prepared FP8 parameters, and `lower` calls it so an unfolded graph (the
checker's) runs its dequantizes where the folded one will, inside the matmul rules.

A dequantize is kept in the step (`kept_dequantizes`) when every user is a step op; one still used by a params-only
op that does not sink (a reshape) is params-only itself, so weight preparation dequantizes it once, at compile time.
"""

from __future__ import annotations

import math

from qcompile.ir.builder import Builder
from qcompile.ir.graph import Graph, Value
from qcompile.ir.ops.core import Cast, Concat, Input, Param, Slice, Transpose
from qcompile.ir.ops.quant import Dequantize, RefineScale

#: ops that only move or convert a weight's elements: preparation when their operands are parameters
LAYOUT_OPS = (Transpose, Slice, Concat, Cast)


def has_dequantize(graph: Graph) -> bool:
    return any(isinstance(node.op, Dequantize) for node in graph.nodes())


def _refined(b: Builder, w: Value, s: Value, block: tuple, axis: int) -> tuple[Value, tuple]:
    """The scale in blocks of 1 along `axis`."""
    if block[axis] == 1:
        return s, block
    size = b.type_of(w).shape[axis]
    s = b.add(RefineScale(axis, block[axis], size), s)
    return s, tuple(1 if i == axis else x for i, x in enumerate(block))


def _sink(b: Builder, op, parts: list[tuple[Value, Value, Dequantize]]) -> tuple[Value, Value, Dequantize] | None:
    """`op` applied to dequantized operands, as (values, scale, dequantize) of `op` applied to the values and scales
    (None: it does not commute — operands quantized in different blocks or to different dtypes)."""
    w0, s0, dq = parts[0]
    block = tuple(dq.block)
    if isinstance(op, Cast):
        return w0, s0, Dequantize(block, op.dtype)
    if isinstance(op, Transpose):
        return b.add(op, w0), b.add(Transpose(op.perm), s0), Dequantize(tuple(block[i] for i in op.perm), dq.dtype)
    rank = len(block)
    if isinstance(op, Slice):
        axis = op.axis % rank
        size = b.type_of(w0).shape[axis]
        if op.start % block[axis] or (op.stop % block[axis] and op.stop != size):
            s0, block = _refined(b, w0, s0, block, axis)
        step = block[axis]
        return (b.add(op, w0), b.add(Slice(axis, op.start // step, math.ceil(op.stop / step)), s0),
                Dequantize(block, dq.dtype))
    if isinstance(op, Concat):
        axis = op.axis % rank
        if any(tuple(p[2].block) != block or p[2].dtype != dq.dtype for p in parts):
            return None
        aligned = all(b.type_of(w).shape[axis] % block[axis] == 0 for w, _, _ in parts[:-1])
        scales = [s if aligned else _refined(b, w, s, block, axis)[0] for w, s, _ in parts]
        block = block if aligned else tuple(1 if i == axis else x for i, x in enumerate(block))
        return b.add(op, *(w for w, _, _ in parts)), b.add(Concat(axis), *scales), Dequantize(block, dq.dtype)
    return None


def sink_dequantize(graph: Graph) -> Graph:
    """The graph with every layout op over dequantized weights applied to their values and scales (module docstring);
    the same graph object when there is nothing to sink. A dequantize is emitted only where its result is used as
    it is, so the rewrite leaves no dead nodes."""
    if not has_dequantize(graph):
        return graph
    b = Builder()
    mapping: dict[Value, Value] = {}
    pending: dict[Value, tuple] = {}  # a dequantized value not emitted yet -> (values, scale, op, sharding)
    changed = False

    def value(v: Value) -> Value:
        if v not in mapping:
            w, s, dq, sharding = pending[v]
            mapping[v] = b.add(dq, w, s)
            if sharding is not None:
                b.annotate(mapping[v], sharding)
        return mapping[v]

    for node in graph.nodes():
        op = node.op
        if isinstance(op, Dequantize):
            pending[node.results[0]] = (value(node.operands[0]), value(node.operands[1]), op,
                                        node.types[0].sharding)
            continue
        if isinstance(op, LAYOUT_OPS) and node.operands and all(v in pending for v in node.operands):
            sunk = _sink(b, op, [pending[v][:3] for v in node.operands])
            if sunk is not None:
                pending[node.results[0]] = (*sunk, node.types[0].sharding)
                changed = True
                continue
        if isinstance(op, Input):
            new = b.input(op.name, op.type)
        elif isinstance(op, Param):
            new = b.param(op.name, op.type)
        else:
            new = b.add_typed(op, [value(v) for v in node.operands], node.types)
        mapping.update(zip(node.results, new if isinstance(new, tuple) else (new,)))
    if not changed:
        return graph
    for name, v in graph.outputs.items():
        b.output(name, value(v))
    return b.build(graph.meta)


def kept_dequantizes(graph: Graph) -> set[int]:
    """Ids of the dequantize nodes that stay in the step: no user is itself a params-only computation (a layout op
    that did not sink — the dequantized weight is then a compile-time preparation) and it is not an output."""
    pure: set[int] = set()
    for node in graph.nodes():
        if isinstance(node.op, Param) or (not isinstance(node.op, Input) and node.operands
                                          and all(v.node in pure for v in node.operands)):
            pure.add(node.id)
    prepared_users = {v.node for node in graph.nodes() if node.id in pure and not isinstance(node.op, Param)
                      for v in node.operands}
    outputs = {v.node for v in graph.outputs.values()}
    return {node.id for node in graph.nodes() if isinstance(node.op, Dequantize)
            and node.id not in prepared_users and node.id not in outputs}
