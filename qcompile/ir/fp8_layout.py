"""Layout ops on FP8 weights: applied to the values and the block scales, so a prepared weight stays FP8.

Why: weight preparation changes a weight's layout — the importer transposes the routed experts, swiglu-fusion
concatenates gate and up — and a dequantized weight is no longer FP8. Dequantization is elementwise, so a layout op
commutes with it when the scale moves with the values:

    transpose(dequantize(w, s){block})        = dequantize(transpose(w), transpose(s)){block permuted}
    slice(dequantize(w, s)) on block edges    = dequantize(slice(w), slice(s))
    concat(dequantize(w_i, s_i)), blocks whole = dequantize(concat(w_i), concat(s_i))
    reshape(dequantize(w, s)) splitting one axis d -> (d/m, m), m | block or block | m
                                              = dequantize(reshape(w), reshape(s)){the block split alike}
    cast(dequantize(w, s){dtype})             = dequantize(w, s){new dtype}
    dequantize(w, s) split along a mesh axis  = dequantize(w split alike, s split alike)


A cut inside a block (a slice, a concat operand whose size is not a multiple of the block, a device's share of a split
dim) first makes the scale finer along that axis (`refine_scale`: blocks of the gcd of the block and the cuts), so
every layout op above sinks; a scale then costs more
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
from qcompile.ir.ops.core import Cast, Concat, Input, Param, Reshape, Slice, Transpose
from qcompile.ir.ops.quant import Dequantize, RefineScale
from qcompile.ir.types import Sharding

#: ops that only move or convert a weight's elements: preparation when their operands are parameters
LAYOUT_OPS = (Transpose, Slice, Concat, Cast, Reshape)


def has_dequantize(graph: Graph) -> bool:
    return any(isinstance(node.op, Dequantize) for node in graph.nodes())


def _refined(b: Builder, w: Value, s: Value, block: tuple, axis: int, memo: dict, to: int = 1) -> tuple[Value, tuple]:
    """The scale in blocks of `to` (a divisor of the block) along `axis` (one refine_scale per scale, axis and
    size: `memo`)."""
    if block[axis] == to:
        return s, block
    key = (s, axis, to)
    if key not in memo:
        memo[key] = b.add(RefineScale(axis, block[axis], b.type_of(w).shape[axis], to), s)
    return memo[key], tuple(to if i == axis else x for i, x in enumerate(block))


def _sink(b: Builder, op, parts: list[tuple[Value, Value, Dequantize]],
          memo: dict) -> tuple[Value, Value, Dequantize] | None:
    """`op` applied to dequantized operands, as (values, scale, dequantize) of `op` applied to the values and scales
    (None: it does not commute — operands quantized to different dtypes). A cut inside a block makes the blocks
    along its axis as fine as the cuts need (the gcd of the block and the cut offsets)."""
    w0, s0, dq = parts[0]
    block = tuple(dq.block)
    if isinstance(op, Cast):
        return w0, s0, Dequantize(block, op.dtype)
    if isinstance(op, Transpose):
        return b.add(op, w0), b.add(Transpose(op.perm), s0), Dequantize(tuple(block[i] for i in op.perm), dq.dtype)
    rank = len(block)
    if isinstance(op, Reshape):
        return _sink_split(b, op, w0, s0, dq, memo)
    if isinstance(op, Slice):
        axis = op.axis % rank
        size = b.type_of(w0).shape[axis]
        s0, block = _refined(b, w0, s0, block, axis, memo,
                             math.gcd(block[axis], op.start, op.stop if op.stop != size else 0))
        step = block[axis]
        return (b.add(op, w0), b.add(Slice(axis, op.start // step, math.ceil(op.stop / step)), s0),
                Dequantize(block, dq.dtype))
    if isinstance(op, Concat):
        axis = op.axis % rank
        if any(len(p[2].block) != rank or p[2].dtype != dq.dtype for p in parts):
            return None
        # per axis the blocks every operand can be cut into: the gcd of their blocks (and, along the concat axis, of
        # every operand's size but the last, so each one starts on a block edge)
        common = [math.gcd(*(p[2].block[i] for p in parts)) for i in range(rank)]
        common[axis] = math.gcd(common[axis], *(b.type_of(w).shape[axis] for w, _, _ in parts[:-1]))
        scales = []
        for w, s, part in parts:
            part_block = tuple(part.block)
            for i in range(rank):
                s, part_block = _refined(b, w, s, part_block, i, memo, common[i])
            scales.append(s)
        return b.add(op, *(w for w, _, _ in parts)), b.add(Concat(axis), *scales), Dequantize(tuple(common), dq.dtype)
    return None


def _split_axis(shape: tuple, new_shape: tuple) -> int | None:
    """The axis a reshape from `shape` to `new_shape` splits in two (every other axis kept), else None."""
    if len(new_shape) != len(shape) + 1 or not all(isinstance(d, int) for d in (*shape, *new_shape)):
        return None
    axis = next((i for i, (d, n) in enumerate(zip(shape, new_shape)) if d != n), len(shape) - 1)
    ok = (new_shape[:axis] == shape[:axis] and new_shape[axis + 2:] == shape[axis + 1:]
          and new_shape[axis] * new_shape[axis + 1] == shape[axis])
    return axis if ok else None


def _sink_split(b: Builder, op: Reshape, w: Value, s: Value, dq: Dequantize,
                memo: dict) -> tuple[Value, Value, Dequantize] | None:
    """A reshape splitting one axis d of a dequantized weight into (d/m, m): the block b along it becomes (b/m, m)
    when m divides b (the scale gains a unit axis), (1, b) when b divides m (the scale's d/b entries become
    [d/m, m/b]); otherwise the scale is first made as fine as gcd(b, m). Any other reshape does not sink (None)."""
    shape, new_shape = tuple(b.type_of(w).shape), tuple(op.shape)
    axis = _split_axis(shape, new_shape)
    if axis is None:
        return None
    inner = new_shape[axis + 1]
    block = tuple(dq.block)
    if block[axis] % inner and inner % block[axis]:
        s, block = _refined(b, w, s, block, axis, memo, math.gcd(block[axis], inner))
    scale_shape = list(b.type_of(s).shape)
    if block[axis] % inner == 0:
        split = (block[axis] // inner, inner)
        scale_shape[axis + 1:axis + 1] = [1]
    else:
        split = (1, block[axis])
        scale_shape[axis:axis + 1] = [new_shape[axis], inner // block[axis]]
    new_block = (*block[:axis], *split, *block[axis + 1:])
    return b.add(op, w), b.add(Reshape(tuple(scale_shape)), s), Dequantize(new_block, dq.dtype)


def _split(b: Builder, w: Value, s: Value, dq: Dequantize, sharding, mesh,
           memo: dict) -> tuple[Value, Value, Dequantize]:
    """The values and scale of a dequantized weight given `sharding` (a tensor-parallel layout annotated on the
    dequantized weight): each device holds its rows' values and their blocks' scales — whole blocks when a device's
    share is a block multiple, else blocks made as fine as the share needs (gcd of block and share) first."""
    block = tuple(dq.block)
    shape = b.type_of(w).shape
    for axis, name in enumerate(sharding.dims):
        if name is not None:
            s, block = _refined(b, w, s, block, axis, memo, math.gcd(block[axis], shape[axis] // mesh.ways(name)))
    dims = Sharding(sharding.dims)
    b.annotate(w, dims)
    b.annotate(s, dims)
    return w, s, Dequantize(block, dq.dtype)


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
    mesh = graph.meta.get("mesh")
    refined: dict = {}  # (scale, axis, to) -> the scale in blocks of `to` along the axis (_refined)

    def value(v: Value) -> Value:
        nonlocal changed
        if v not in mapping:
            w, s, dq, sharding = pending[v]
            if sharding is not None and mesh is not None and sharding.dims != (b.type_of(w).sharding or
                                                                                Sharding((None,) * len(dq.block))).dims:
                w, s, dq = _split(b, w, s, dq, sharding, mesh, refined)
                changed = True
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
            sunk = _sink(b, op, [pending[v][:3] for v in node.operands], refined)
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
