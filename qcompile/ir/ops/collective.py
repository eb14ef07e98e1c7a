"""Collective ops: all-gather, reduce-scatter, all-reduce, all-to-all over the mesh axes a logical axis maps to.

Shapes in the IR are global, so a collective changes a value's sharding, not its shape:

    all_gather(x)     {axis=d, over=L}                   x split along L in dim d      -> whole in dim d
    reduce_scatter(x) {axis=d, over=L, split=L2}         x a partial sum over L         -> summed, split along L2 in dim d
    all_reduce(x)     {over=L}                           x a partial sum over L         -> summed, whole
    all_to_all(x)     {split_axis=s, concat_axis=c, over=L, split=L2}   split along L in dim c -> split along L2 in dim s

`mesh_axes` are the mesh axes `over` maps to in the graph's mesh (ir/mesh.py); the verifier checks they agree, and
the lowering passes them to JAX's collectives, so the rules run inside `jax.shard_map` over that mesh, where each
operand is one device's block (ir/lowering.py::lower_on_mesh).

`stages` (all_gather and reduce_scatter; set by hierarchical-collectives) runs one collective over several mesh
axes as two, each over a group of them, in the order given — a reduce-scatter over the local (inner) axis first and
then across, an all-gather across first and then over the local axis — with the blocks permuted so that every
device ends with the block the one-stage collective gives it (see `_staged_reduce_scatter`).
"""

from __future__ import annotations

import attrs
import jax
import jax.numpy as jnp

from qcompile.ir.cost import Cost, cost, nbytes
from qcompile.ir.registry import expect, lowering, op, type_rule
from qcompile.ir.types import Sharding, TensorType


def _names(value) -> tuple[str, ...]:
    return tuple(value)


def _stages(value) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(stage) for stage in value)


def _sharding(x: TensorType, what: str) -> Sharding:
    expect(x.sharding is not None, f"{what} needs a sharded operand, got {x}")
    return x.sharding


def _dim(axis: int, x: TensorType, what: str) -> int:
    expect(isinstance(axis, int) and -x.rank <= axis < x.rank, f"{what}: axis {axis} out of range for {x}")
    return axis % x.rank


@op("all_gather")
@attrs.frozen
class AllGather:
    """all_gather(x) {axis, over, mesh_axes}: x, split along logical axis `over` in dim `axis`, made whole in that dim
    on every device (the blocks concatenated in mesh order)."""

    axis: int
    over: str
    mesh_axes: tuple[str, ...] = attrs.field(converter=_names)
    stages: tuple[tuple[str, ...], ...] = attrs.field(default=(), converter=_stages)


@op("reduce_scatter")
@attrs.frozen
class ReduceScatter:
    """reduce_scatter(x) {axis, over, mesh_axes, split}: x, a partial sum over logical axis `over`, summed across it
    and split in dim `axis` (each device keeps its block of the sum) along logical axis `split` ("": `over` itself),
    which must map to the same mesh axes — e.g. an MoE layer's partial sum over `experts` scattered back to the
    tokens' `batch` split."""

    axis: int
    over: str
    mesh_axes: tuple[str, ...] = attrs.field(converter=_names)
    split: str = ""
    stages: tuple[tuple[str, ...], ...] = attrs.field(default=(), converter=_stages)

    @property
    def split_axis(self) -> str:
        return self.split or self.over


@op("all_reduce")
@attrs.frozen
class AllReduce:
    """all_reduce(x) {over, mesh_axes}: x, a partial sum over logical axis `over`, summed across it; every device
    holds the whole sum."""

    over: str
    mesh_axes: tuple[str, ...] = attrs.field(converter=_names)


@op("all_to_all")
@attrs.frozen
class AllToAll:
    """all_to_all(x) {split_axis, concat_axis, over, mesh_axes, split}: x, split along logical axis `over` in dim
    `concat_axis`, re-split in dim `split_axis` (each device sends block j of its split dim to device j) along logical
    axis `split` ("": `over` itself), which must map to the same mesh axes — e.g. expert-parallel dispatch, where
    each device's tokens (split along `batch`) go to the devices that own their experts (split along `experts`)."""

    split_axis: int
    concat_axis: int
    over: str
    mesh_axes: tuple[str, ...] = attrs.field(converter=_names)
    split: str = ""

    @property
    def result_axis(self) -> str:
        return self.split or self.over


@type_rule(AllGather)
def _all_gather_type(op_, x):
    sharding, d = _sharding(x, "all_gather"), _dim(op_.axis, x, "all_gather")
    expect(sharding.dims[d] == op_.over, f"all_gather over {op_.over!r} in dim {d}: {x} is not split that way")
    return x.with_sharding(sharding.with_dim(d, None))


@type_rule(ReduceScatter)
def _reduce_scatter_type(op_, x):
    sharding, d = _sharding(x, "reduce_scatter"), _dim(op_.axis, x, "reduce_scatter")
    expect(op_.over in sharding.partial, f"reduce_scatter over {op_.over!r}: {x} is not a partial sum over it")
    expect(sharding.dims[d] is None, f"reduce_scatter in dim {d}: {x} is already split there")
    dims = list(sharding.dims)
    dims[d] = op_.split_axis
    return x.with_sharding(Sharding(tuple(dims), tuple(a for a in sharding.partial if a != op_.over)))


@type_rule(AllReduce)
def _all_reduce_type(op_, x):
    sharding = _sharding(x, "all_reduce")
    expect(op_.over in sharding.partial, f"all_reduce over {op_.over!r}: {x} is not a partial sum over it")
    return x.with_sharding(Sharding(sharding.dims, tuple(a for a in sharding.partial if a != op_.over)))


@type_rule(AllToAll)
def _all_to_all_type(op_, x):
    sharding = _sharding(x, "all_to_all")
    s, c = _dim(op_.split_axis, x, "all_to_all"), _dim(op_.concat_axis, x, "all_to_all")
    expect(s != c, f"all_to_all splits and concatenates the same dim {s}")
    expect(sharding.dims[c] == op_.over, f"all_to_all over {op_.over!r}: {x} is not split along it in dim {c}")
    expect(sharding.dims[s] is None, f"all_to_all into dim {s}: {x} is already split there")
    dims = list(sharding.dims)
    dims[c], dims[s] = None, op_.result_axis
    return x.with_sharding(Sharding(tuple(dims), sharding.partial))


@lowering(AllGather)
def _all_gather(op_, x):
    d = op_.axis % x.ndim
    if not op_.stages:
        return jax.lax.all_gather(x, op_.mesh_axes, axis=d, tiled=True)
    (across, local) = op_.stages
    # across first: device (a, l) gathers blocks (a', l) in a' order, then over the local axis: blocks in (l', a')
    # order, which a transpose puts back in the one-stage order a'·L + l'
    x = jax.lax.all_gather(x, across, axis=d, tiled=True)
    x = jax.lax.all_gather(x, local, axis=d, tiled=True)
    return _swap_blocks(x, d, jax.lax.axis_size(local), jax.lax.axis_size(across))


@lowering(ReduceScatter)
def _reduce_scatter(op_, x):
    d = op_.axis % x.ndim
    if not op_.stages:
        return jax.lax.psum_scatter(x, op_.mesh_axes, scatter_dimension=d, tiled=True)
    return _staged_reduce_scatter(x, d, *op_.stages)


def _staged_reduce_scatter(x, d: int, local: tuple[str, ...], across: tuple[str, ...]):
    """The one-stage reduce-scatter over across + local (block a·L + l to device (a, l)) as a reduce-scatter over the
    local axes, then one across: the blocks are first reordered to (l, a), so the local stage leaves device l the
    sum of blocks (·, l) — L times fewer bytes to send across — and the across stage gives (a, l) its block."""
    x = _swap_blocks(x, d, jax.lax.axis_size(across), jax.lax.axis_size(local))
    x = jax.lax.psum_scatter(x, local, scatter_dimension=d, tiled=True)
    return jax.lax.psum_scatter(x, across, scatter_dimension=d, tiled=True)


def _swap_blocks(x, d: int, outer: int, inner: int):
    """x with dim d seen as [outer, inner, rest] blocks and re-laid out as [inner, outer, rest]."""
    shape = x.shape
    blocks = x.reshape(shape[:d] + (outer, inner, shape[d] // (outer * inner)) + shape[d + 1:])
    return jnp.swapaxes(blocks, d, d + 1).reshape(shape)


@lowering(AllReduce)
def _all_reduce(op_, x):
    return jax.lax.psum(x, op_.mesh_axes)


@lowering(AllToAll)
def _all_to_all(op_, x):
    return jax.lax.all_to_all(x, op_.mesh_axes, op_.split_axis % x.ndim, op_.concat_axis % x.ndim, tiled=True)


@cost(AllGather)
@cost(ReduceScatter)
@cost(AllReduce)
@cost(AllToAll)
def _collective_cost(op_, operands, results, step):
    """Bytes of the whole (global) value: an upper bound of what one device sends or receives."""
    (out, out_shape), = results
    return Cost(0.0, nbytes(out, out_shape))


#: Each collective op's kind, as XLA and the reports name it (plan's bytes per kind, the lowered step's counts).
COLLECTIVE_KINDS = {AllGather: "all-gather", ReduceScatter: "reduce-scatter", AllReduce: "all-reduce",
                    AllToAll: "all-to-all"}
