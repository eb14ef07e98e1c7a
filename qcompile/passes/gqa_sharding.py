"""gqa-sharding: choose how the model is laid out over the device mesh, and lay it out.

What: from the KV heads, the KV dtype, the device count and the expected concurrency, every plan DP×TP = D (attention
data parallelism × tensor parallelism; the MoE always expert-parallel over all D devices) is costed per device —
weights, KV cache and GDN state at the expected concurrency and context, and the bytes its collectives move per
decode step — and the one holding the fewest bytes per device wins (what decides how many sequences fit); near ties
(within 1%) go to the plan that moves fewer collective bytes. The report lists every plan and says why one won.
At low concurrency the weights dominate and wide tensor parallelism (which splits the attention and GDN weights)
wins; as concurrency grows the KV cache dominates, and a plan that replicates KV heads (TP wider than the KV heads)
loses to one that does not — the switch tpu-inference makes by hand (TP8+EP at 4–8 requests, DP4TP2+EP at 16–32;
design.md §4.1). This byte count does not reproduce its DP8+EP at 64 and above with a bf16 KV cache: with 2 KV heads
DP8 and DP4×TP2 hold the same KV per device and TP2 halves the attention weights, so what favours DP8 there is time
(TP's per-layer all-reduces), which `plan` (issue 10) will model with the target's figures.

The layout applied is attention data parallelism over every mesh axis with expert parallelism over the same axes:
the mesh's rules map the logical axes `batch` and `experts` to all of its axes; the batch inputs, the KV pages and
the GDN state slots are split along `batch` (each rank its own page pool and state slots, ir/abi.py); the routed
experts' weights along `experts`; everything else is replicated. Each MoE layer becomes conventional expert-parallel
dispatch: each device sends its routes to the devices that own their experts with an all-to-all (capacity-padded
blocks, nothing dropped), runs its local experts, and an all-to-all brings the results home
(ir/ops/expert_parallel.py); moe-allgather-rs then rewrites that into all-gather → local experts → reduce-scatter.
Plans with tensor parallelism are costed and reported but not yet lowered: when one wins, the best data-parallel
plan is applied and the report says so.

Why (design.md §4.1): Qwen3.5-397B has 32 query heads and 2 KV heads, so 8-way head parallelism cannot split the
KV cache — it replicates each KV head 4 times. Skipped on one device.
"""

from __future__ import annotations

import math

import attrs

from qcompile.ir.builder import Builder
from qcompile.ir.graph import Graph, Value
from qcompile.ir.ops.attention import PagedAttention
from qcompile.ir.ops.collective import AllToAll
from qcompile.ir.ops.core import Input, Param
from qcompile.ir.ops.expert_parallel import MoeCombineReturned, MoeDispatchReceived, MoeReturn, MoeSend
from qcompile.ir.ops.moe import GroupedMatmul, GroupedMatmulSwiglu, MoeCombine, MoeDispatch
from qcompile.ir.types import Sharding, TensorType, np_dtype
from qcompile.passes.base import Pass, PassContext, PassResult
from qcompile.passes.rewrite import copy_node, eliminate_dead_nodes

BATCH, EXPERTS = "batch", "experts"
#: The step ABI's per-sequence inputs (split along `batch` on their first dim).
RANKED_INPUTS = ("token_ids", "positions", "page_table", "state_slots", "logits_indices")


@attrs.frozen
class ModelFacts:
    """What the plan costs depend on, read off the step graph."""

    query_heads: int
    kv_heads: int
    head_dim: int
    kv_itemsize: int
    attention_layers: int
    state_bytes_per_seq: int  # every GDN state cache, one slot
    gdn_heads: int  # value heads of the GDN layers (0: none)
    num_experts: int  # 0: no MoE
    expert_bytes: int
    split_bytes: int  # attention, GDN and dense/shared MLP matrices: what tensor parallelism divides
    replicated_bytes: int  # embeddings, head, norms, router
    hidden: int = 0
    layers: int = 0
    act_itemsize: int = 4
    moe_layers: int = 0
    top_k: int = 0


@attrs.frozen
class Plan:
    dp: int
    tp: int
    weight_bytes: int
    kv_bytes: int
    state_bytes: int
    lowered: bool  # whether qcompile can lay it out today
    tp_allreduce_bytes: int = 0  # per device per decode step: two all-reduces per layer over the TP group
    moe_bytes: int = 0  # per device per decode step: the MoE layers' all-gathers (tokens + routing), reduce-scatter
    moe_a2a_bytes: int = 0  # the same layers as conventional all-to-all dispatch (capacity-padded blocks)

    @property
    def name(self) -> str:
        return "x".join(part for part in (f"dp{self.dp}" if self.dp > 1 else "",
                                          f"tp{self.tp}" if self.tp > 1 else "") if part) + "+ep"

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.state_bytes

    def to_json(self) -> dict:
        return {"plan": self.name, "dp": self.dp, "tp": self.tp, "weight_bytes_per_device": self.weight_bytes,
                "kv_bytes_per_device": self.kv_bytes, "state_bytes_per_device": self.state_bytes,
                "total_bytes_per_device": self.total, "tp_allreduce_bytes_per_step": self.tp_allreduce_bytes,
                "moe_collective_bytes_per_step": self.moe_bytes, "moe_all_to_all_bytes_per_step": self.moe_a2a_bytes,
                "lowered": self.lowered}


def _nbytes(t: TensorType) -> int:
    return math.prod(d for d in t.shape if isinstance(d, int)) * np_dtype(t.dtype)(0).itemsize


def model_facts(graph: Graph) -> ModelFacts:
    caches = set(graph.meta.get("caches", ()))
    inputs = {node.op.name: node.op.type for node in graph.find(Input)}
    kv = [t for name, t in inputs.items() if name in caches and name.endswith(".k_pages")]
    states = [t for name, t in inputs.items() if name in caches and name.endswith(("_state",))]
    attention = list(graph.find(PagedAttention))
    dispatch = list(graph.find(MoeDispatch))
    expert_params, _ = expert_weights(graph)
    expert = split = replicated = 0
    for node in graph.find(Param):
        size = _nbytes(node.op.type)
        if node.results[0] in expert_params:
            expert += size
        elif node.op.type.rank == 2 and not node.op.name.endswith(("embed_tokens", "lm_head", "mlp.gate")):
            split += size
        else:
            replicated += size
    recurrent = [t for name, t in inputs.items() if name in caches and name.endswith(".recurrent_state")]
    embed = next(node.op.type for node in graph.find(Param) if node.op.name.endswith("embed_tokens"))
    return ModelFacts(
        query_heads=int(graph.type_of(attention[0].results[0]).shape[1]) if attention else 0,
        kv_heads=int(kv[0].shape[2]) if kv else 0, head_dim=int(kv[0].shape[3]) if kv else 0,
        kv_itemsize=np_dtype(kv[0].dtype)(0).itemsize if kv else 0, attention_layers=len(kv),
        state_bytes_per_seq=sum(_nbytes(t) for t in states), gdn_heads=int(recurrent[0].shape[1]) if recurrent else 0,
        num_experts=dispatch[0].op.num_experts if dispatch else 0, expert_bytes=expert, split_bytes=split,
        replicated_bytes=replicated, hidden=int(embed.shape[1]), layers=len(kv) + len(recurrent),
        act_itemsize=np_dtype(embed.dtype)(0).itemsize, moe_layers=len(dispatch),
        top_k=int(graph.type_of(dispatch[0].operands[1]).shape[1]) if dispatch else 0)


def expert_weights(graph: Graph) -> tuple[set[Value], set[int]]:
    """The routed experts' parameters (checkpoint tensors [E, ...]) and the weight-preparation nodes between them
    and the grouped matmuls (slices of a fused gate_up, transposes, concats)."""
    params: set[Value] = set()
    prep: set[int] = set()
    stack = [node.operands[1] for node in graph.nodes() if isinstance(node.op, (GroupedMatmul, GroupedMatmulSwiglu))]
    while stack:
        value = stack.pop()
        node = graph.node(value.node)
        if isinstance(node.op, Param):
            params.add(value)
        elif node.id not in prep and node.op.op_name in ("transpose", "slice", "concat"):
            prep.add(node.id)
            stack.extend(node.operands)
    return params, prep


def _tp_fits(facts: ModelFacts, tp: int) -> bool:
    """Heads split whole: query and GDN heads divide; KV heads divide or are replicated evenly."""
    if tp == 1:
        return True
    heads_ok = all(h % tp == 0 for h in (facts.query_heads, facts.gdn_heads) if h)
    kv_ok = not facts.kv_heads or facts.kv_heads % tp == 0 or tp % facts.kv_heads == 0
    return heads_ok and kv_ok


def plans(facts: ModelFacts, devices: int, concurrency: int, context: int) -> list[Plan]:
    """Every DP×TP plan on `devices` whose heads split, costed per device at `concurrency` sequences of `context`."""
    found = []
    for dp in range(devices, 0, -1):
        if devices % dp or not _tp_fits(facts, devices // dp):
            continue
        tp = devices // dp
        seqs = math.ceil(concurrency / dp)
        kv_heads = max(1, facts.kv_heads // tp) if facts.kv_heads else 0  # tp > KV heads: each device keeps one
        kv = seqs * context * 2 * kv_heads * facts.head_dim * facts.kv_itemsize * facts.attention_layers
        state = seqs * facts.state_bytes_per_seq // tp
        weights = facts.expert_bytes // devices + facts.split_bytes // tp + facts.replicated_bytes
        rows = facts.hidden * facts.act_itemsize
        allreduce = 2 * facts.layers * 2 * (tp - 1) * seqs * rows // tp  # ring all-reduce: 2(n-1)/n of the value
        # every token (and its k routes, 2 i32 each) gathered to each device, the [C, H] partial sums scattered back
        gathered = concurrency * (rows + 8 * facts.top_k) * (devices - 1) // devices
        moe = facts.moe_layers * (gathered + concurrency * rows * (devices - 1) // devices)
        # all-to-all: a device's T/D tokens' k routes sent in D blocks of T/D·k rows (+ an i32 id each), and back
        routes = math.ceil(concurrency / devices) * facts.top_k * (devices - 1)
        a2a = facts.moe_layers * routes * (2 * rows + 4)
        found.append(Plan(dp, tp, weights, kv, state, lowered=tp == 1, tp_allreduce_bytes=allreduce, moe_bytes=moe,
                          moe_a2a_bytes=a2a))
    return found


def choose(candidates: list[Plan]) -> tuple[Plan, Plan, str]:
    """(the best plan, the plan applied, why): least bytes per device; within 1% of it, fewest collective bytes."""
    least = min(p.total for p in candidates)
    ranked = sorted(candidates, key=lambda p: (p.total > least * 1.01, p.tp_allreduce_bytes + p.moe_bytes, p.total))
    best = ranked[0]
    applied = next(p for p in ranked if p.lowered)
    runner_up = ranked[1] if len(ranked) > 1 else None
    why = f"{best.name} holds the fewest bytes per device ({best.total / 2**20:.2f} MiB"
    why += f"; next {runner_up.name} {runner_up.total / 2**20:.2f} MiB)" if runner_up else ")"
    if applied is not best:
        why += (f"; tensor-parallel layouts are not lowered yet, so {applied.name} is applied "
                f"({(applied.total - best.total) / 2**20:.2f} MiB more per device)")
    return best, applied, why


def _first_dim_split(t: TensorType) -> TensorType:
    return t.with_sharding(Sharding((BATCH,) + (None,) * (t.rank - 1)))


def run(graph: Graph, ctx: PassContext) -> PassResult:
    mesh = graph.meta.get("mesh")
    if mesh is None or mesh.size == 1:
        return PassResult(graph, False, {}, skipped="one device (compile with --mesh N to lay the model out on N)")
    if mesh.rules:
        return PassResult(graph, False, {}, skipped="the graph is laid out on its mesh already")
    devices = mesh.size
    facts = model_facts(graph)
    if facts.num_experts and facts.num_experts % devices:
        return PassResult(graph, False, {}, skipped=f"{facts.num_experts} experts do not split over {devices} devices")
    concurrency = int(ctx.option("concurrency", devices))
    context = int(ctx.option("max_context", 512))
    candidates = plans(facts, devices, concurrency, context)
    best, applied, why = choose(candidates)
    axes = tuple(mesh.axes)
    new_mesh = attrs.evolve(mesh, rules={BATCH: axes, EXPERTS: axes})
    new_graph, layers = _lay_out(graph, new_mesh)
    stats = {"plan": applied.name, "why": why, "devices": devices, "concurrency": concurrency, "context": context,
             "moe_layers": layers, "best_plan": best.name, "plans": [p.to_json() for p in candidates]}
    return PassResult(new_graph, True, stats)


def _lay_out(graph: Graph, mesh) -> tuple[Graph, int]:
    """The graph with the DP-attention + EP-MoE layout of `mesh` (rules for `batch` and `experts`); each MoE layer
    as conventional all-to-all dispatch (ir/ops/expert_parallel.py)."""
    ranks = mesh.ways(BATCH)
    axes = mesh.rule(BATCH)
    caches = set(graph.meta.get("caches", ()))
    expert_params, prep_nodes = expert_weights(graph)
    combine_of = {}  # dispatch node -> its combine node (through the order result)
    for node in graph.find(MoeCombine):
        combine_of[node.operands[1].node] = node
    builder = Builder()
    mapping: dict[Value, Value] = {}
    ways = mesh.ways(EXPERTS)
    slots: dict[int, Value] = {}  # combine node id -> where its routes' results come back (moe_send's slot)
    layers = 0
    for node in graph.nodes():
        op = node.op
        operands = [mapping[v] for v in node.operands]
        if isinstance(op, Input) and op.name == "query_start":  # B/D+1 offsets per rank: B+D in all
            new = builder.input(op.name, TensorType("i32", (f"B+{ranks}",), sharding=Sharding((BATCH,))))
        elif isinstance(op, Input) and (op.name in RANKED_INPUTS or op.name in caches):
            new = builder.input(op.name, _first_dim_split(op.type))
        elif isinstance(op, Param) and node.results[0] in expert_params:
            new = builder.param(op.name, op.type.with_sharding(Sharding((EXPERTS,) + (None,) * (op.type.rank - 1))))
        elif node.id in prep_nodes:  # weight preparation: its type rule carries the experts split through
            new = builder.add(op, *operands)
        elif isinstance(op, MoeDispatch) and node.id in combine_of:
            x, ids = operands
            send, send_ids, slot = builder.add(MoeSend(op.num_experts, ways, EXPERTS, axes), x, ids)
            recv = builder.add(AllToAll(0, 1, BATCH, axes, split=EXPERTS), send)
            recv_ids = builder.add(AllToAll(0, 1, BATCH, axes, split=EXPERTS), send_ids)
            new = builder.add(MoeDispatchReceived(op.num_experts, EXPERTS, axes), recv, recv_ids)
            slots[combine_of[node.id].id] = slot
            layers += 1
        elif isinstance(op, MoeCombine) and node.id in slots:
            out, order, weights = operands
            returned = builder.add(MoeReturn(ways, EXPERTS), out, order)
            back = builder.add(AllToAll(1, 0, EXPERTS, axes, split=BATCH), returned)
            new = builder.add(MoeCombineReturned(), back, slots[node.id], weights)
        else:
            new = copy_node(builder, node, operands)
            results = new if isinstance(new, tuple) else (new,)
            # Per-token values stay on their rank: a result whose first dim is symbolic, computed from a value split
            # along `batch` in its first dim, is split the same way.
            if not isinstance(op, (Input, Param)) and any(_batch_split(builder.type_of(v)) for v in operands):
                for value in results:
                    t = builder.type_of(value)
                    if t.rank and not isinstance(t.shape[0], int) and t.sharding is None:
                        builder.annotate(value, Sharding((BATCH,) + (None,) * (t.rank - 1)))
        new = new if isinstance(new, tuple) else (new,)
        mapping.update(zip(node.results, new))
    for name, value in graph.outputs.items():
        builder.output(name, mapping[value])
    return eliminate_dead_nodes(builder.build({**graph.meta, "mesh": mesh})), layers


def _batch_split(t: TensorType) -> bool:
    return t.sharding is not None and bool(t.sharding.dims) and t.sharding.dims[0] == BATCH


GQA_SHARDING = Pass(
    name="gqa-sharding",
    summary="lays the model out on the mesh: plan from KV heads, dtype, devices, concurrency; DP attention + EP MoE",
    run=run,
    tolerance="reassociating",
    requires=("2+ devices (--mesh)",),
    cpu_note="cost structure only on the cpu target (simulated devices share the host's cores)",
)
