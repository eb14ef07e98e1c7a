"""Expert-parallel MoE ops: the two ways an MoE layer's routes reach the devices that hold their experts.

Under expert parallelism the expert weights are split along the logical axis `experts` in D contiguous blocks: a
device holds E/D experts and, inside `jax.shard_map`, sees only those. The tokens are split along `batch`.

Conventional dispatch (what gqa-sharding lays out): each device sends each of its routes to the device that owns
the route's expert, with one all-to-all, and gets the results back with another:

    send, send_ids, slot = moe_send(x, ids)     [D, T*k, H] per-destination blocks, capacity-padded (ids -1)
    recv = all_to_all(send) ...; recv_ids = all_to_all(send_ids)    {split_axis=0, concat_axis=1}
    rows, group_sizes, order = moe_dispatch_received(recv, recv_ids)
    ... grouped matmuls over the local experts ...
    back = all_to_all(moe_return(out, order))     {split_axis=1, concat_axis=0}
    y = moe_combine_returned(back, slot, weights)

A block has room for all of a device's T·k routes (capacity factor D: nothing is ever dropped, so the result is
exact), which is what static shapes cost: the all-to-alls move D times the routes a variable-size exchange would.

All-gather/reduce-scatter (moe-allgather-rs rewrites the first form into this one; design.md §4.2): every device
gathers every token and its routing, runs the routes that chose its own experts, and reduce-scatters the partial
sums back — fixed-size collectives, deterministic latency:

    packed  = pack_routing(weights, ids)          one i32[T,2k] array, so one collective carries both
    gathered = all_gather(packed) ...; weights, ids = unpack_routing(gathered)
    rows, group_sizes, order = moe_dispatch_local(x_all, ids) {num_experts=E, over="experts"}
    ... grouped matmuls over the local experts ...
    partial = moe_combine(out, order, weights)    a partial sum over `experts`
    y = reduce_scatter(partial) {over="experts", split="batch"}

Both dispatches remap global expert ids to local ones (CPU `ragged_dot` rejects `group_offset`, and every grouped
matmul rule takes groups from 0): routes to other devices' experts (and padding) sort after the local groups,
outside every group, where each grouped-matmul rule returns zero rows — so they add nothing.
"""

from __future__ import annotations

import attrs
import jax
import jax.numpy as jnp

from qcompile.ir.cost import Cost, cost, nbytes
from qcompile.ir.registry import expect, lowering, op, type_rule
from qcompile.ir.ops.moe import MoeDispatch, weighted_route_sum
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
    return _local_routes(op_, x, ids)


def _local_routes(op_, x, ids):
    """Rows of x[T,H] for the routes ids[T,k] that chose this device's experts, grouped by local expert."""
    local = op_.num_experts // jax.lax.axis_size(op_.mesh_axes)
    first = jax.lax.axis_index(op_.mesh_axes) * local
    flat = ids.reshape(-1) - first
    flat = jnp.where((flat >= 0) & (flat < local), flat, local)  # other devices' experts: one group past the end
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    rows = jnp.take(x, order // ids.shape[1], axis=0)
    group_sizes = jnp.bincount(flat, length=local).astype(jnp.int32)
    return rows, group_sizes, order


@op("moe_send")
@attrs.frozen
class MoeSend:
    """moe_send(x[T,H], ids i32[T,k]) {num_experts, ways, over, mesh_axes} -> (send[D,T*k,H], send_ids i32[D,T*k],
    slot i32[T*k]): the sending side of conventional expert-parallel dispatch. Each of this device's routes (token t,
    choice j) is written into block d = ids[t,j] // (E/D) — the device that owns its expert along `over` (D = `ways`
    devices) — at the next free row of that block, in token order; the rest of each block is padding (id -1).
    `slot[t*k+j]` = d*C + row says where the route's result comes back (C = the local T*k: no route is ever dropped).
    The tokens' split (x's first dim) carries over to dim 1 of the blocks and to `slot`.

    `column_axes` (tensor parallelism): the devices of a tensor-parallel group hold the same tokens, and the experts
    are split over ways × (the group's size) devices, ordered (rank, column). A device in column c sends only the
    routes whose expert lies in column c, to block d = the rank that holds it; its other routes get the slot one past
    the end (`moe_combine_returned` reads zero there), so each route runs once and the columns' results are partial
    sums over the group, added by an all-reduce."""

    num_experts: int
    ways: int
    over: str
    mesh_axes: tuple[str, ...] = attrs.field(converter=_names)
    column_axes: tuple[str, ...] = attrs.field(default=(), converter=_names)


@type_rule(MoeSend)
def _send_type(op_, x, ids):
    expect(x.rank == 2 and ids.rank == 2 and ids.shape[0] == x.shape[0] and ids.dtype == "i32",
           f"moe_send: {x}, {ids}")
    tokens = x.sharding.dims[0] if x.sharding is not None else None
    expect(tokens is not None, f"moe_send sends each device's own tokens: {x} must be split in dim 0")
    expect(op_.num_experts % op_.ways == 0, f"moe_send: {op_.num_experts} experts do not split over {op_.ways}")
    routes = dim_mul(x.shape[0], ids.shape[1])
    return (TensorType(x.dtype, (op_.ways, routes, x.shape[1]), sharding=Sharding((None, tokens, None))),
            TensorType("i32", (op_.ways, routes), sharding=Sharding((None, tokens))),
            TensorType("i32", (routes,), sharding=Sharding((tokens,))))


@lowering(MoeSend)
def _send(op_, x, ids):
    if not op_.column_axes:
        return send_blocks(x, ids, ids.reshape(-1) // (op_.num_experts // op_.ways), op_.ways)
    columns = jax.lax.axis_size(op_.column_axes)
    owner = ids.reshape(-1) // (op_.num_experts // (op_.ways * columns))
    mine = owner % columns == jax.lax.axis_index(op_.column_axes)
    return send_blocks(x, ids, jnp.where(mine, owner // columns, op_.ways), op_.ways)


def send_blocks(x, ids, dest, ways: int):
    """moe_send's results with route r going to device dest[r]; a route with dest[r] == ways is not sent (its slot
    is one past the end)."""
    flat = ids.reshape(-1)
    capacity = flat.shape[0]
    earlier = jnp.cumsum(dest[:, None] == jnp.arange(ways)[None, :], axis=0, dtype=jnp.int32)
    row = jnp.take_along_axis(earlier, jnp.minimum(dest, ways - 1)[:, None], axis=1)[:, 0] - 1  # earlier routes there
    slot = jnp.where(dest < ways, dest * capacity + row, ways * capacity).astype(jnp.int32)
    send = jnp.zeros((ways * capacity, x.shape[1]), x.dtype).at[slot].set(jnp.repeat(x, ids.shape[1], axis=0))
    send_ids = jnp.full((ways * capacity,), -1, jnp.int32).at[slot].set(flat)
    return send.reshape(ways, capacity, x.shape[1]), send_ids.reshape(ways, capacity), slot


@op("moe_dispatch_received")
@attrs.frozen
class MoeDispatchReceived:
    """moe_dispatch_received(recv[D,R,H], recv_ids i32[D,R]) {num_experts, over, mesh_axes} -> (rows[R,H],
    group_sizes i32[E], order i32[R]): the routes a device received (one block per sender, split along `over` in
    dim 0: each device holds the R rows sent to it), grouped by local expert as moe_dispatch_local groups them;
    padding (id -1) sorts last, outside every group."""

    num_experts: int
    over: str
    mesh_axes: tuple[str, ...] = attrs.field(converter=_names)


@type_rule(MoeDispatchReceived)
def _dispatch_received_type(op_, recv, recv_ids):
    expect(recv.rank == 3 and recv_ids.shape == recv.shape[:2] and recv_ids.dtype == "i32",
           f"moe_dispatch_received: {recv}, {recv_ids}")
    expect(recv.sharding is not None and recv.sharding.dims[0] is not None,
           f"moe_dispatch_received: {recv} must be split in dim 0 (the all-to-all's result)")
    rows = recv.shape[1]
    return (TensorType(recv.dtype, (rows, recv.shape[2])),
            TensorType("i32", (op_.num_experts,), sharding=Sharding((op_.over,))), TensorType("i32", (rows,)))


@lowering(MoeDispatchReceived)
def _dispatch_received(op_, recv, recv_ids):
    return _local_routes(op_, recv.reshape(-1, recv.shape[-1]), recv_ids.reshape(-1, 1))


@op("moe_return")
@attrs.frozen
class MoeReturn:
    """moe_return(out[R,H], order i32[R]) {ways, over} -> back[D,R,H]: the local experts' results put back in the
    order they were received (one block per sender), ready for the all-to-all home; split along `over` in dim 0."""

    ways: int
    over: str


@type_rule(MoeReturn)
def _return_type(op_, out, order):
    expect(out.rank == 2 and order.shape == out.shape[:1], f"moe_return: {out}, {order}")
    return TensorType(out.dtype, (op_.ways, out.shape[0], out.shape[1]), sharding=Sharding((op_.over, None, None)))


@lowering(MoeReturn)
def _return(op_, out, order):
    return jnp.zeros_like(out).at[order].set(out)[None]


@op("moe_combine_returned")
@attrs.frozen
class MoeCombineReturned:
    """moe_combine_returned(back[D,T*k,H], slot i32[T*k], weights[T,k]) -> [T,H]: each route's result read back from
    its `slot` (moe_send) and combined as moe_combine combines, on the tokens' own device; a slot past the end (a
    route another column of a tensor-parallel group sent) reads zero."""


@type_rule(MoeCombineReturned)
def _combine_returned_type(op_, back, slot, weights):
    expect(back.rank == 3 and slot.rank == 1 and back.shape[1] == slot.shape[0] and weights.rank == 2,
           f"moe_combine_returned: {back}, {slot}, {weights}")
    tokens = weights.sharding.dims[0] if weights.sharding is not None else None
    return TensorType(back.dtype, (weights.shape[0], back.shape[2]),
                      sharding=Sharding((tokens, None)) if tokens else None)


@lowering(MoeCombineReturned)
def _combine_returned(op_, back, slot, weights):
    tokens, k = weights.shape
    routes = jnp.take(back.reshape(-1, back.shape[-1]), slot, axis=0, mode="fill", fill_value=0)  # unsent: zero
    routes = routes.reshape(tokens, k, back.shape[-1])
    return weighted_route_sum(routes, weights)


#: every op that groups an MoE layer's routes by expert (each has `num_experts`)
DISPATCH_OPS = (MoeDispatch, MoeDispatchLocal, MoeDispatchReceived)


@cost(PackRouting)
@cost(UnpackRouting)
@cost(MoeDispatchLocal)
@cost(MoeSend)
@cost(MoeDispatchReceived)
@cost(MoeReturn)
@cost(MoeCombineReturned)
def _routing_cost(op_, operands, results, step):
    return Cost(0.0, sum(nbytes(t, shape) for t, shape in results))
