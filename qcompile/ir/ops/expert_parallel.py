"""Expert-parallel MoE ops: the routing metadata packed into one array, and dispatch to this device's experts.

Under expert parallelism the expert weights are split along the logical axis `experts`: a device holds E/D experts
and, inside `jax.shard_map`, sees only those. The all-gather/reduce-scatter form of an MoE layer (gqa-sharding,
moe-allgather-rs) gathers every token and its routing, lets each device run the routes that chose its own experts,
and reduce-scatters the partial sums back:

    packed  = pack_routing(weights, ids)          one i32[T,2k] array, so one collective carries both
    gathered = all_gather(packed) ...; weights, ids = unpack_routing(gathered)
    rows, group_sizes, order = moe_dispatch_local(x_all, ids) {num_experts=E, over="experts"}
    ... grouped matmuls over the local experts ...
    partial = moe_combine(out, order, weights)    a partial sum over `experts`
    y = reduce_scatter(partial) {over="experts", split="batch"}

`moe_dispatch_local` remaps global expert ids to local ones (CPU `ragged_dot` rejects `group_offset`, and every
grouped matmul rule takes groups from 0): routes to other devices' experts sort after the local groups, outside
every group, where each grouped-matmul rule returns zero rows — so they add nothing in the combine.
"""

from __future__ import annotations

import attrs
import jax
import jax.numpy as jnp

from qcompile.ir.cost import Cost, cost, nbytes
from qcompile.ir.registry import expect, lowering, op, type_rule
from qcompile.ir.types import Sharding, TensorType, dim_mul


def _names(value) -> tuple[str, ...]:
    return tuple(value)


@op("pack_routing")
@attrs.frozen
class PackRouting:
    """pack_routing(weights[T,k], ids i32[T,k]) -> i32[T,2k]: the weights' f32 bits, then the ids (lossless for f32
    and bf16 weights), so the routing crosses the mesh in one collective."""


@type_rule(PackRouting)
def _pack_type(op_, weights, ids):
    expect(weights.rank == 2 and ids.shape == weights.shape and ids.dtype == "i32",
           f"pack_routing: weights {weights} and ids {ids} must be [T,k] and i32[T,k]")
    expect(weights.dtype in ("f32", "bf16"), f"pack_routing: weights must be f32 or bf16, got {weights}")
    return TensorType("i32", (weights.shape[0], dim_mul(weights.shape[1], 2)), sharding=weights.sharding)


@lowering(PackRouting)
def _pack(op_, weights, ids):
    bits = jax.lax.bitcast_convert_type(weights.astype(jnp.float32), jnp.int32)
    return jnp.concatenate([bits, ids], axis=1)


@op("unpack_routing")
@attrs.frozen
class UnpackRouting:
    """unpack_routing(packed i32[T,2k]) {dtype} -> (weights[T,k] in `dtype`, ids i32[T,k]); inverse of pack_routing."""

    dtype: str


@type_rule(UnpackRouting)
def _unpack_type(op_, packed):
    expect(packed.rank == 2 and packed.dtype == "i32" and isinstance(packed.shape[1], int) and packed.shape[1] % 2 == 0,
           f"unpack_routing wants i32[T,2k], got {packed}")
    shape = (packed.shape[0], packed.shape[1] // 2)
    return TensorType(op_.dtype, shape, sharding=packed.sharding), TensorType("i32", shape, sharding=packed.sharding)


@lowering(UnpackRouting)
def _unpack(op_, packed):
    from qcompile.ir.types import np_dtype

    k = packed.shape[1] // 2
    weights = jax.lax.bitcast_convert_type(packed[:, :k], jnp.float32).astype(np_dtype(op_.dtype))
    return weights, packed[:, k:]


@op("moe_dispatch_local")
@attrs.frozen
class MoeDispatchLocal:
    """moe_dispatch_local(x[T,H], ids i32[T,k]) {num_experts, over, mesh_axes} -> (rows[T*k,H], group_sizes i32[E],
    order i32[T*k]): moe_dispatch onto the E/D experts of this device along logical axis `over` (mesh axes
    `mesh_axes`): routes to local expert j form group j (groups from 0), routes to other devices' experts sort last,
    outside every group. `group_sizes` is split along `over` (each device holds its E/D sizes)."""

    num_experts: int
    over: str
    mesh_axes: tuple[str, ...] = attrs.field(converter=_names)


@type_rule(MoeDispatchLocal)
def _dispatch_local_type(op_, x, ids):
    expect(x.rank == 2 and ids.rank == 2 and ids.shape[0] == x.shape[0] and ids.dtype == "i32",
           f"moe_dispatch_local: {x}, {ids}")
    rows = dim_mul(x.shape[0], ids.shape[1])
    return (TensorType(x.dtype, (rows, x.shape[1])), TensorType("i32", (op_.num_experts,), sharding=Sharding((op_.over,))),
            TensorType("i32", (rows,)))


@lowering(MoeDispatchLocal)
def _dispatch_local(op_, x, ids):
    local = op_.num_experts // jax.lax.axis_size(op_.mesh_axes)
    first = jax.lax.axis_index(op_.mesh_axes) * local
    flat = ids.reshape(-1) - first
    flat = jnp.where((flat >= 0) & (flat < local), flat, local)  # other devices' experts: one group past the end
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    rows = jnp.take(x, order // ids.shape[1], axis=0)
    group_sizes = jnp.bincount(flat, length=local).astype(jnp.int32)
    return rows, group_sizes, order


@cost(PackRouting)
@cost(UnpackRouting)
@cost(MoeDispatchLocal)
def _routing_cost(op_, operands, results, step):
    return Cost(0.0, sum(nbytes(t, shape) for t, shape in results))
