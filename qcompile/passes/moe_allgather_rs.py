"""moe-allgather-rs: conventional expert-parallel dispatch (all-to-all) becomes all-gather → local experts →
reduce-scatter, with the top-k weights and ids packed into one array so one collective carries both.

Pattern, per MoE layer, as gqa-sharding lays it out (ir/ops/expert_parallel.py shows both forms):

    send, send_ids, slot = moe_send(x, ids); recv = all_to_all(send); recv_ids = all_to_all(send_ids)
    rows, groups, order = moe_dispatch_received(recv, recv_ids)      ... experts(rows, groups) -> out ...
    y = moe_combine_returned(all_to_all(moe_return(out, order)), slot, weights)
becomes
    x_all = all_gather(x); weights_all, ids_all = unpack_routing(all_gather(pack_routing(weights, ids)))
    rows, groups, order = moe_dispatch_local(x_all, ids_all)         ... the same experts(rows, groups) -> out ...
    y = reduce_scatter(moe_combine(out, order, weights_all)) {over=experts, split=batch}

Under tensor parallelism (gqa-sharding's DP×TP plans) the all-to-alls run over the data-parallel axes and each
column of a tensor-parallel group sends only its own column's routes; the gathered form gathers over the
data-parallel axes, reduce-scatters over them, and the all-reduce over `tensor` that follows the combine stays.

Correct because both forms give each device the same routes — the ones whose expert it holds — in the same order
(token order, grouped by local expert), run them through the same expert ops, and add each token's k weighted
results in the same order; only where the sum happens moves (on the token's device vs a reduce-scatter of partial
sums that are zero except on the devices that ran a route). Three all-to-alls per layer become two all-gathers and
one reduce-scatter of fixed size. Class: reassociating (the reduce-scatter adds the zero partials in mesh order).

Why (design.md §4.2): the all-to-all is variable-size in a real dispatch (or, with static shapes, padded to a
capacity — here every route fits, a factor D of padding); the gathered form moves fixed, predictable bytes with
deterministic latency. vLLM made it its default expert-parallel backend; Megatron recommends it up to EP 8;
tpu-inference packs the routing into one collective (#2174). Skipped when the graph has no all-to-all dispatch (one
device, or gqa-sharding did not lay the model out).
"""

from __future__ import annotations

import attrs

from qcompile.ir.builder import Builder
from qcompile.ir.graph import Graph, Node, Value
from qcompile.ir.ops.collective import AllGather, AllToAll, ReduceScatter
from qcompile.ir.ops.expert_parallel import (MoeCombineReturned, MoeDispatchLocal, MoeDispatchReceived, MoeReturn,
                                             MoeSend, PackRouting, UnpackRouting)
from qcompile.ir.ops.core import Cast
from qcompile.ir.ops.moe import MoeCombine
from qcompile.ir.types import Sharding
from qcompile.passes.base import Pass, PassContext, PassResult
from qcompile.passes.rewrite import rebuild


@attrs.frozen
class _Layer:
    """One MoE layer's all-to-all dispatch: the nodes replaced and the values the gathered form needs."""

    send: Node
    dispatch: Node  # moe_dispatch_received
    combine: Node  # moe_combine_returned
    out: Value  # the experts' result rows (moe_return's operand)
    weights: Value  # the router weights (moe_combine_returned's operand)


def _producer(graph: Graph, value: Value, kind: type, index: int | None = None) -> Node | None:
    node = graph.node(value.node)
    if not isinstance(node.op, kind) or (index is not None and value.index != index):
        return None
    return node


def _match(graph: Graph, combine: Node, position: dict[int, int]) -> _Layer | None:
    """The layer whose combine is `combine`, or None when its producers are not the all-to-all dispatch."""
    back, slot, weights = combine.operands
    widened = _producer(graph, back, Cast)  # tensor parallelism combines in f32
    home = _producer(graph, widened.operands[0] if widened else back, AllToAll)
    returned = home and _producer(graph, home.operands[0], MoeReturn)
    dispatch = returned and _producer(graph, returned.operands[1], MoeDispatchReceived, index=2)
    send = _producer(graph, slot, MoeSend, index=2)
    if not (dispatch and send):
        return None
    sent = [_producer(graph, v, AllToAll) for v in dispatch.operands]
    if not all(sent) or [a.operands[0] for a in sent] != [send.results[0], send.results[1]]:
        return None
    if position[weights.node] > position[dispatch.id]:  # the packed routing is built where the dispatch was
        return None
    return _Layer(send, dispatch, combine, returned.operands[0], weights)


def run(graph: Graph, ctx: PassContext) -> PassResult:
    position = {node.id: i for i, node in enumerate(graph.nodes())}
    layers = [layer for node in graph.find(MoeCombineReturned) if (layer := _match(graph, node, position))]
    if not layers:
        return PassResult(graph, False, {}, skipped="no all-to-all expert dispatch in the graph (gqa-sharding lays "
                                                     "one out on a mesh of 2+ devices with 2+ data-parallel ranks)")
    by_dispatch = {layer.dispatch.id: layer for layer in layers}
    by_combine = {layer.combine.id: layer for layer in layers}
    gathered_weights: dict[int, Value] = {}

    def gather(builder: Builder, node: Node, operands: list[Value], mapping: dict[Value, Value]):
        if node.id in by_dispatch:
            layer = by_dispatch[node.id]
            send: MoeSend = layer.send.op
            x, ids = (mapping[v] for v in layer.send.operands)
            weights = mapping[layer.weights]
            tokens = builder.type_of(x).sharding.dims[0]
            x_all = builder.add(AllGather(0, tokens, send.mesh_axes), x)
            packed = builder.add(AllGather(0, tokens, send.mesh_axes), builder.add(PackRouting(), weights, ids))
            weights_all, ids_all = builder.add(UnpackRouting(builder.type_of(weights).dtype), packed)
            gathered_weights[layer.combine.id] = weights_all
            dispatch = layer.dispatch.op  # its experts' mesh axes (every axis, under tensor parallelism too)
            return builder.add(MoeDispatchLocal(send.num_experts, dispatch.over, dispatch.mesh_axes), x_all, ids_all)
        if node.id in by_combine:
            layer = by_combine[node.id]
            send = layer.send.op
            t = graph.type_of(node.results[0])
            order = mapping[layer.dispatch.results[2]]
            tokens = t.sharding.dims[0]
            # a partial sum over every device's experts: reduce-scattered over the tokens' (data-parallel) axes;
            # under tensor parallelism what stays is the combine's own partial sum over the group (its all-reduce
            # follows, unchanged)
            over = send.over if not send.column_axes else tokens
            out = mapping[layer.out]
            if builder.type_of(out).dtype != t.dtype:  # tensor parallelism keeps the partial sums in f32
                out = builder.add(Cast(t.dtype), out)
            partial = builder.add_typed(MoeCombine(), [out, order, gathered_weights[node.id]],
                                        [t.with_sharding(Sharding((None,) * t.rank, (over, *t.sharding.partial)))])
            return builder.add_typed(ReduceScatter(0, over, send.mesh_axes, tokens), [partial], [t])
        return None  # the all-to-alls, moe_send and moe_return are copied, then dropped as dead

    new_graph, _ = rebuild(graph, gather)
    n = len(layers)
    return PassResult(new_graph, True, {"moe_layers": n, "all_to_all_removed": 3 * n, "all_gather_added": 2 * n,
                                        "reduce_scatter_added": n})


MOE_ALLGATHER_RS = Pass(
    name="moe-allgather-rs",
    summary="expert-parallel MoE as all-gather (tokens + packed routing) -> local experts -> reduce-scatter",
    run=run,
    tolerance="reassociating",
    requires=("gqa-sharding on 2+ devices (--mesh)", "MoE layers"),
    cpu_note="cost structure only on the cpu target (simulated devices share the host's cores)",
)
