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

The layout applied (`lay_out_plan`): tensor parallelism over the mesh's innermost axes whose sizes multiply to TP
(the fast local axes: `--mesh 4x2` gives dp4×tp2, `--mesh 2x4` dp2×tp4), attention data parallelism over the rest,
the MoE expert-parallel over all of them. The mesh's rules map `batch` to the data-parallel axes, `experts` to every
axis and `tensor` to the tensor-parallel ones; the batch inputs, the KV pages and the GDN state slots are split along
`batch` (each rank its own page pool and state slots, ir/abi.py); the routed experts' weights along `experts`.
Under tensor parallelism (TP_WEIGHTS, TP_CACHES) the q/k/v, GDN in_proj and conv, and gate/up projections are split
by output columns (whole heads, whole FFN columns per device), the output projections (o_proj, out_proj, down_proj) by
input rows — their products are partial sums, completed by an `all_reduce` over `tensor` — and the caches by heads:
KV pages along kv_heads, the GDN recurrent state along its value heads, the conv state along its channels. A GDN
layer's fused [q | k | v] projection, its conv weight and conv state are regrouped (weight preparation, ir/abi.py
`grouped_order`: groups × [q_j | k_j | v_j]) so that each device's contiguous block holds its own heads' q, k and v;
the graph records the cache's regrouping (meta `channel_groups`) and the checker compares the conv state through it.
An FP8 weight is laid out as its dequantized value (regrouped, split); ir/fp8_layout.py applies both to the FP8 values
and the block scales, so each device holds its own rows in FP8.
Ops whose attributes name global sizes along a split dim have a local form inside the shard_map (a reshape's target
shape, gated_delta_net's groups; registry LOCAL_FORMS). Everything else is replicated.

Each MoE layer becomes conventional expert-parallel dispatch: each device sends its routes to the devices that own
their experts with an all-to-all over the data-parallel axes (capacity-padded blocks, nothing dropped), runs its
local experts, and an all-to-all brings the results home (ir/ops/expert_parallel.py); under tensor parallelism the
devices of a group hold the same tokens, so each column sends only the routes to its own column's experts and an
all-reduce over `tensor` adds the columns' shares (tensor parallelism alone: every device runs its experts on every
token, then the all-reduce). moe-allgather-rs then rewrites the all-to-alls into all-gather → local experts →
reduce-scatter. A plan that cannot be laid out (`tp_problem`: TP wider than the KV heads — replicating KV heads is
not laid out —, heads that do not split, TP not the size of the innermost axes, fusions already applied) is costed
and reported with its reason; the best plan that can is applied. `--layout PLAN` (compile) picks one by name.

Why (design.md §4.1): Qwen3.5-397B has 32 query heads and 2 KV heads, so 8-way head parallelism cannot split the
KV cache — it replicates each KV head 4 times. Skipped on one device.
"""

from __future__ import annotations

import math

import attrs

from qcompile.errors import UsageError
from qcompile.ir.abi import CHANNEL_GROUPS
from qcompile.ir.builder import Builder
from qcompile.ir.graph import Graph, Value
from qcompile.ir.ops.attention import PagedAttention
from qcompile.ir.ops.collective import AllReduce, AllToAll
from qcompile.ir.ops.core import Cast, Input, Linear, LinearF32, Param, Reshape, Slice
from qcompile.ir.ops.expert_parallel import (MoeCombineReturned, MoeDispatchLocal, MoeDispatchReceived, MoeReturn,
                                             MoeSend)
from qcompile.ir.ops.gdn import CausalConv1d
from qcompile.ir.ops.moe import GroupedMatmul, GroupedMatmulSwiglu, MoeCombine, MoeDispatch
from qcompile.ir.ops.quant import Dequantize
from qcompile.ir.types import Sharding, TensorType, np_dtype
from qcompile.passes.base import Pass, PassContext, PassResult
from qcompile.passes.rewrite import copy_node, eliminate_dead_nodes, regroup_rows

BATCH, EXPERTS, TENSOR = "batch", "experts", "tensor"

#: Tensor parallelism, by the end of a weight's checkpoint name: the dim split along `tensor`. 0 — output features
#: (column-parallel: each device computes its own heads, its own FFN columns); 1 — input features (row-parallel: each
#: device's product is a partial sum, completed by an all-reduce). Routed experts are split along `experts` instead.
TP_WEIGHTS = {
    "self_attn.q_proj": 0, "self_attn.k_proj": 0, "self_attn.v_proj": 0, "self_attn.o_proj": 1,
    "linear_attn.in_proj_qkv": 0, "linear_attn.in_proj_z": 0, "linear_attn.in_proj_b": 0,
    "linear_attn.in_proj_a": 0, "linear_attn.conv1d": 0, "linear_attn.A_log": 0, "linear_attn.dt_bias": 0,
    "linear_attn.out_proj": 1,
    "gate_proj": 0, "up_proj": 0, "down_proj": 1,  # the shared expert and dense MLPs
}
#: Caches tensor parallelism splits by heads: the dim split along `tensor`.
TP_CACHES = {".k_pages": 2, ".v_pages": 2, ".conv_state": 1, ".recurrent_state": 1}
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
    gdn_key_heads: int = 0


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
    not_lowered: str = ""  # why qcompile cannot lay it out (empty when it can)

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
                "lowered": self.lowered, **({"not_lowered_because": self.not_lowered} if self.not_lowered else {})}


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
    recurrences = [node for node in graph.nodes() if node.op.op_name in ("gdn_recurrence", "gated_delta_net")]
    key_heads = 0
    if recurrences and recurrences[0].op.op_name == "gdn_recurrence":
        key_heads = int(graph.type_of(recurrences[0].operands[0]).shape[1])
    elif recurrences:  # fused: x [T, 2·Hk·dk + Hv·dv], state [S, Hv, dk, dv]
        x, state = graph.type_of(recurrences[0].operands[0]), graph.type_of(recurrences[0].operands[7])
        key_heads = (int(x.shape[1]) - int(state.shape[1]) * int(state.shape[3])) // (2 * int(state.shape[2]))
    embed = next(node.op.type for node in graph.find(Param) if node.op.name.endswith("embed_tokens"))
    return ModelFacts(
        query_heads=int(graph.type_of(attention[0].results[0]).shape[1]) if attention else 0,
        kv_heads=int(kv[0].shape[2]) if kv else 0, head_dim=int(kv[0].shape[3]) if kv else 0,
        kv_itemsize=np_dtype(kv[0].dtype)(0).itemsize if kv else 0, attention_layers=len(kv),
        state_bytes_per_seq=sum(_nbytes(t) for t in states), gdn_heads=int(recurrent[0].shape[1]) if recurrent else 0,
        num_experts=dispatch[0].op.num_experts if dispatch else 0, expert_bytes=expert, split_bytes=split,
        replicated_bytes=replicated, hidden=int(embed.shape[1]), layers=len(kv) + len(recurrent),
        act_itemsize=np_dtype(embed.dtype)(0).itemsize, moe_layers=len(dispatch),
        top_k=int(graph.type_of(dispatch[0].operands[1]).shape[1]) if dispatch else 0, gdn_key_heads=key_heads)


def expert_weights(graph: Graph) -> tuple[set[Value], set[int]]:
    """The routed experts' parameters (checkpoint tensors [E, ...]; FP8 values and their block scales) and the
    weight-preparation nodes between them and the grouped matmuls (slices of a fused gate_up, transposes, concats,
    dequantizes)."""
    params: set[Value] = set()
    prep: set[int] = set()
    stack = [node.operands[1] for node in graph.nodes() if isinstance(node.op, (GroupedMatmul, GroupedMatmulSwiglu))]
    while stack:
        value = stack.pop()
        node = graph.node(value.node)
        if isinstance(node.op, Param):
            params.add(value)
        elif node.id not in prep and node.op.op_name in ("transpose", "slice", "concat", "dequantize",
                                                         "refine_scale"):
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


def plans(facts: ModelFacts, devices: int, concurrency: int, context: int,
          not_lowered: dict[int, str] | None = None) -> list[Plan]:
    """Every DP×TP plan on `devices` whose heads split, costed per device at `concurrency` sequences of `context`.
    `not_lowered`: tensor-parallel degree -> why it cannot be laid out (default: every TP degree, no reason)."""
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
        partial_rows = facts.hidden * 4  # tensor-parallel partial sums are all-reduced in f32 (LinearF32)
        allreduce = 2 * facts.layers * 2 * (tp - 1) * seqs * partial_rows // tp  # ring: 2(n-1)/n of the value
        # every token (and its k routes, 2 i32 each) gathered over the data-parallel ranks, the [C, H] partial sums
        # scattered back; under tensor parallelism the group's columns' shares are then all-reduced
        moe_allreduce = 2 * (tp - 1) * seqs * partial_rows // tp
        gathered = concurrency * (rows + 8 * facts.top_k) * (dp - 1) // dp
        moe = facts.moe_layers * (gathered + concurrency * rows * (dp - 1) // dp + moe_allreduce)
        # all-to-all: a rank's C/dp tokens' k routes sent in dp blocks of C/dp·k rows (+ an i32 id each), and back
        routes = seqs * facts.top_k * (dp - 1)
        a2a = facts.moe_layers * (routes * (2 * rows + 4) + moe_allreduce)
        why_not = "" if tp == 1 else (not_lowered or {}).get(tp, "" if not_lowered is not None else "not lowered")
        found.append(Plan(dp, tp, weights, kv, state, lowered=not why_not, tp_allreduce_bytes=allreduce, moe_bytes=moe,
                          moe_a2a_bytes=a2a, not_lowered=why_not))
    return found


def _ranked(candidates: list[Plan]) -> list[Plan]:
    """Fewest bytes per device first; within 1% of the fewest, fewer collective bytes first."""
    least = min(p.total for p in candidates)
    return sorted(candidates, key=lambda p: (p.total > least * 1.01, p.tp_allreduce_bytes + p.moe_bytes, p.total))


def choose(candidates: list[Plan]) -> tuple[Plan, Plan, str]:
    """(the best plan, the plan applied, why): least bytes per device; within 1% of it, fewest collective bytes."""
    ranked = _ranked(candidates)
    best = ranked[0]
    applied = _ranked([p for p in candidates if p.lowered])[0]
    runner_up = ranked[1] if len(ranked) > 1 else None
    why = f"{best.name} holds the fewest bytes per device ({best.total / 2**20:.2f} MiB"
    why += f"; next {runner_up.name} {runner_up.total / 2**20:.2f} MiB)" if runner_up else ")"
    if applied is not best:
        why += (f"; {best.name} cannot be laid out ({best.not_lowered}), so {applied.name} is applied "
                f"({(applied.total - best.total) / 2**20:.2f} MiB more per device)")
    return best, applied, why


def tensor_axes(mesh, tp: int) -> tuple[str, ...] | None:
    """The innermost mesh axes whose sizes multiply to `tp` — tensor parallelism runs over the fast local axes, data
    parallelism over the rest — or None when no suffix of the mesh's axes has that size."""
    product, axes = 1, []
    for name, size in reversed(list(zip(mesh.axes, mesh.shape))):
        if product == tp:
            break
        product *= size
        axes.insert(0, name)
    return tuple(axes) if product == tp else None


def tp_weight_dim(name: str) -> int | None:
    """The dim tensor parallelism splits of the weight named `name` (TP_WEIGHTS), None when it stays whole."""
    if ".experts." in name:
        return None
    return next((dim for suffix, dim in TP_WEIGHTS.items() if name.endswith(suffix)), None)


def _quantized_tp_dim(graph: Graph, node) -> int | None:
    """The dim tensor parallelism splits of the FP8 weight a dequantize node reads (None: not a TP_WEIGHTS one)."""
    values = graph.node(node.operands[0].node).op
    return tp_weight_dim(values.name) if isinstance(values, Param) else None


def _users(graph: Graph) -> dict[Value, list]:
    users: dict[Value, list] = {}
    for node in graph.nodes():
        for value in node.operands:
            users.setdefault(value, []).append(node)
    return users


def _conv_sections(graph: Graph, conv, users) -> list | None:
    """The slices cutting a GDN conv's output into [q | k | v] (axis 1, contiguous, in order), or None."""
    cuts = sorted(users.get(conv.results[0], []), key=lambda n: getattr(n.op, "start", -1))
    width = graph.type_of(conv.results[0]).shape[1]
    if not cuts or not all(isinstance(n.op, Slice) and n.op.axis in (1, -1) for n in cuts):
        return None
    if [n.op.start for n in cuts] != [0] + [n.op.stop for n in cuts[:-1]] or cuts[-1].op.stop != width:
        return None
    return cuts


def tp_problem(graph: Graph, facts: ModelFacts, mesh, tp: int) -> str:
    """Why the tensor-parallel degree `tp` cannot be laid out on `mesh` (empty when it can)."""
    if tp == 1:
        return ""
    if tensor_axes(mesh, tp) is None:
        return (f"tp{tp} is not the size of the mesh's innermost axes {list(mesh.shape)} "
                f"(a mesh like --mesh {mesh.size // tp}x{tp} gives it)")
    for what, heads in (("query heads", facts.query_heads), ("KV heads", facts.kv_heads),
                        ("GDN key heads", facts.gdn_key_heads), ("GDN value heads", facts.gdn_heads)):
        if heads and heads % tp:
            extra = " (replicating KV heads across a tensor-parallel group is not laid out)" if "KV" in what else ""
            return f"{heads} {what} do not split {tp} ways{extra}"
    fused = sorted({n.op.op_name for n in graph.nodes() if n.op.op_name in ("gated_delta_net", "linear_swiglu")})
    if fused:
        return f"the graph has {', '.join(fused)} already (gqa-sharding must run before the fusion passes)"
    for node in graph.find(Param):
        dim = tp_weight_dim(node.op.name)
        if dim is not None and node.op.type.rank > dim and node.op.type.shape[dim] % tp:
            return f"{node.op.name} {list(node.op.type.shape)} does not split {tp} ways in dim {dim}"
    users = _users(graph)
    for conv in graph.find(CausalConv1d):
        if _conv_sections(graph, conv, users) is None:
            return "a GDN conv's output is not cut into q | k | v by three slices"
    return ""


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
    not_lowered = {tp: tp_problem(graph, facts, mesh, tp) for tp in range(2, devices + 1) if devices % tp == 0}
    candidates = plans(facts, devices, concurrency, context, not_lowered)
    best, applied, why = choose(candidates)
    wanted = ctx.option("layout")
    if wanted:
        forced = next((p for p in candidates if p.name in (wanted, wanted + "+ep")), None)
        if forced is None:
            names = ", ".join(p.name for p in candidates)
            raise UsageError(f"--layout {wanted}: not a plan for {devices} devices with these heads (plans: {names})")
        if not forced.lowered:
            raise UsageError(f"--layout {wanted}: {forced.not_lowered}")
        applied, why = forced, f"{forced.name} was asked for (--layout); the automatic choice: {why}"
    new_graph, layers = lay_out_plan(graph, mesh, applied.tp)
    stats = {"plan": applied.name, "why": why, "devices": devices, "concurrency": concurrency, "context": context,
             "moe_layers": layers, "best_plan": best.name, "plans": [p.to_json() for p in candidates]}
    if applied.tp > 1:
        stats["tensor_axes"] = list(tensor_axes(mesh, applied.tp))
    return PassResult(new_graph, True, stats)


def lay_out_plan(graph: Graph, mesh, tp: int = 1) -> tuple[Graph, int]:
    """`graph` laid out on `mesh` with tensor parallelism `tp` over its innermost axes and attention data
    parallelism over the rest (the MoE expert-parallel over all of them); the number of MoE layers laid out."""
    tp_axes = tensor_axes(mesh, tp)
    dp_axes = tuple(a for a in mesh.axes if a not in tp_axes)
    rules = {BATCH: dp_axes, EXPERTS: tuple(mesh.axes)} if dp_axes else {EXPERTS: tuple(mesh.axes)}
    if tp_axes:
        rules[TENSOR] = tp_axes
    return _lay_out(graph, attrs.evolve(mesh, rules=rules))


def _lay_out(graph: Graph, mesh) -> tuple[Graph, int]:
    """The graph with the layout of `mesh`'s rules: `batch` (attention data parallelism: per-sequence inputs, KV
    pages, state slots), `experts` (the routed experts), and `tensor` when the plan has tensor parallelism (heads and
    FFN columns, TP_WEIGHTS / TP_CACHES; row-parallel products completed by an all-reduce). Each MoE layer becomes
    conventional all-to-all dispatch (ir/ops/expert_parallel.py) — or, under tensor parallelism, all-gather over the
    data-parallel axes → local experts → reduce-scatter over them → all-reduce over `tensor` (see `_gathered_moe`)."""
    rules = dict(mesh.rules)
    tensor = TENSOR in rules
    ranks = mesh.ways(BATCH) if BATCH in rules else 1
    caches = set(graph.meta.get("caches", ()))
    expert_params, prep_nodes = expert_weights(graph)
    combine_of = {}  # dispatch node -> its combine node (through the order result)
    for node in graph.find(MoeCombine):
        combine_of[node.operands[1].node] = node
    users = _users(graph)
    regroup: dict[int, tuple] = {}  # GDN layers under TP: conv node id -> (sections, slice nodes)
    if tensor:
        for conv in graph.find(CausalConv1d):
            cuts = _conv_sections(graph, conv, users)
            regroup[conv.id] = ([n.op.stop - n.op.start for n in cuts], cuts)
    grouped_params: dict[Value, list] = {}  # weights whose rows follow a regrouped conv's channels -> sections
    grouped_caches: dict[str, list] = {}
    cut_of: dict[int, tuple] = {}  # slice node id -> (sections, index)
    for conv_id, (sections, cuts) in regroup.items():
        conv = graph.node(conv_id)
        x_producer = graph.node(conv.operands[0].node)
        if not isinstance(x_producer.op, Linear):
            raise UsageError("tensor parallelism: a GDN conv's input is not a projection")
        grouped_params[x_producer.operands[1]] = sections
        grouped_params[conv.operands[2]] = sections
        grouped_caches[graph.node(conv.operands[1].node).op.name] = sections
        for index, cut in enumerate(cuts):
            cut_of[cut.id] = (sections, index)
    groups = mesh.ways(TENSOR) if tensor else 1
    builder = Builder()
    mapping: dict[Value, Value] = {}
    slots: dict[int, Value] = {}  # combine node id -> where its routes' results come back (moe_send's slot)
    gathered: dict[int, Value] = {}  # combine node id -> the gathered routing weights (tensor-parallel MoE)
    grouped_rows: dict[Value, Value] = {}  # regrouped conv output -> its [T, groups, C/groups] view
    layers = 0
    for node in graph.nodes():
        op = node.op
        operands = [mapping[v] for v in node.operands]
        if isinstance(op, Input) and op.name == "query_start":  # B/D+1 offsets per rank: B+D in all
            if ranks > 1:
                new = builder.input(op.name, TensorType("i32", (f"B+{ranks}",), sharding=Sharding((BATCH,))))
            else:
                new = builder.input(op.name, op.type)
        elif isinstance(op, Input) and (op.name in RANKED_INPUTS or op.name in caches):
            dims = [BATCH if ranks > 1 else None] + [None] * (op.type.rank - 1)
            split = next((dim for suffix, dim in TP_CACHES.items() if op.name.endswith(suffix)), None)
            if tensor and op.name in caches and split is not None:
                dims[split] = TENSOR
            new = builder.input(op.name, op.type.with_sharding(Sharding(tuple(dims)) if any(dims) else None))
        elif isinstance(op, Param) and node.results[0] in expert_params and op.type.shape[0] == 1:
            new = builder.param(op.name, op.type)  # a scale over all the experts at once (one per tensor): whole
        elif isinstance(op, Param) and node.results[0] in expert_params:
            new = builder.param(op.name, op.type.with_sharding(Sharding((EXPERTS,) + (None,) * (op.type.rank - 1))))
        elif node.id in prep_nodes:  # weight preparation: its type rule carries the experts split through
            new = builder.add(op, *operands)
        elif isinstance(op, Param) and tensor and tp_weight_dim(op.name) is not None and op.type.dtype != "f8e4m3":
            dims = [None] * op.type.rank
            dims[tp_weight_dim(op.name)] = TENSOR
            if node.results[0] in grouped_params:  # whole, then regrouped by weight preparation, then split
                new = regroup_rows(builder, builder.param(op.name, op.type), grouped_params[node.results[0]],
                                      groups)
                builder.annotate(new, Sharding(tuple(dims)))
            else:
                new = builder.param(op.name, op.type.with_sharding(Sharding(tuple(dims))))
        elif isinstance(op, Dequantize) and tensor and _quantized_tp_dim(graph, node) is not None:
            # an FP8 weight: laid out dequantized (regrouped, split); ir/fp8_layout.py applies the regrouping and the
            # split to its values and block scales, so each device holds its own rows in FP8
            dims = [None] * len(op.block)
            dims[_quantized_tp_dim(graph, node)] = TENSOR
            new = builder.add(op, *operands)
            if node.results[0] in grouped_params:
                new = regroup_rows(builder, new, grouped_params[node.results[0]], groups)
            builder.annotate(new, Sharding(tuple(dims)))
        elif isinstance(op, MoeDispatch) and node.id in combine_of and ranks == 1:  # tensor parallelism alone
            x, ids = operands
            new = _gathered_dispatch(builder, mesh, op, x, ids, mapping[combine_of[node.id].operands[2]],
                                     gathered, combine_of[node.id].id)
            layers += 1
        elif isinstance(op, MoeCombine) and node.id in gathered:
            new = _gathered_combine(builder, mesh, graph.type_of(node.results[0]), operands, gathered[node.id])
        elif isinstance(op, MoeDispatch) and node.id in combine_of:
            # all-to-all dispatch over the data-parallel axes; under tensor parallelism each column of a group sends
            # only the routes to its column's experts (moe_send's column_axes)
            x, ids = operands
            axes = mesh.rule(BATCH)
            arrives = BATCH if tensor else EXPERTS  # the axis the received blocks are split along
            send, send_ids, slot = builder.add(MoeSend(op.num_experts, ranks, arrives, axes,
                                                       mesh.rule(TENSOR) if tensor else ()), x, ids)
            recv = builder.add(AllToAll(0, 1, BATCH, axes, split=arrives), send)
            recv_ids = builder.add(AllToAll(0, 1, BATCH, axes, split=arrives), send_ids)
            new = builder.add(MoeDispatchReceived(op.num_experts, EXPERTS, mesh.rule(EXPERTS)), recv, recv_ids)
            slots[combine_of[node.id].id] = slot
            layers += 1
        elif isinstance(op, MoeCombine) and node.id in slots:
            out, order, weights = operands
            arrives = BATCH if tensor else EXPERTS
            returned = builder.add(MoeReturn(ranks, arrives), out, order)
            back = builder.add(AllToAll(1, 0, arrives, mesh.rule(BATCH), split=BATCH), returned)
            if tensor:  # each column's share: a partial sum over the tensor-parallel group, kept in f32 (LinearF32)
                t = graph.type_of(node.results[0])
                if t.dtype != "f32":
                    back = builder.add(Cast("f32"), back)
                new = builder.add_typed(MoeCombineReturned(), [back, slots[node.id], weights],
                                        [t.with_dtype("f32").with_sharding(
                                            Sharding((BATCH,) + (None,) * (t.rank - 1), (TENSOR,)))])
                new = builder.add(AllReduce(TENSOR, mesh.rule(TENSOR)), new)
                if t.dtype != "f32":
                    new = builder.add(Cast(t.dtype), new)
            else:
                new = builder.add(MoeCombineReturned(), back, slots[node.id], weights)
        elif node.id in cut_of:  # q, k or v of a regrouped conv output: the same section of every group
            sections, index = cut_of[node.id]
            (y,) = operands
            width = sum(sections)
            t = builder.type_of(y)
            if y not in grouped_rows:  # one [T, groups, C/groups] view, shared by the three cuts
                grouped_rows[y] = builder.add(Reshape((t.shape[0], groups, width // groups)), y)
                builder.annotate(grouped_rows[y], Sharding((_dim0(t), TENSOR, None)))
            rows = grouped_rows[y]
            start = sum(sections[:index]) // groups
            new = builder.add(Slice(2, start, start + sections[index] // groups), rows)
        else:
            # the op's type rule carries a split where it knows how (slices, transposes, collectives); `_propagate`
            # fills in the rest
            new = copy_node(builder, node, operands) if isinstance(op, (Input, Param)) else builder.add(op, *operands)
            if not isinstance(op, (Input, Param)):
                for value, sharding in zip(new if isinstance(new, tuple) else (new,),
                                           _propagate(builder, op, operands, new)):
                    if sharding is not None:
                        builder.annotate(value, sharding)
                partial = builder.type_of(new).sharding if isinstance(op, Linear) else None
                if partial is not None and partial.partial:  # row-parallel: complete the partial sum
                    dtype = builder.type_of(new).dtype
                    if dtype != "f32":  # summed in f32 and rounded once, as the whole product is (LinearF32)
                        new = builder.add(LinearF32(), *operands)
                        builder.annotate(new, partial)
                    new = builder.add(AllReduce(TENSOR, mesh.rule(TENSOR)), new)
                    if dtype != "f32":
                        new = builder.add(Cast(dtype), new)
        new = new if isinstance(new, tuple) else (new,)
        mapping.update(zip(node.results, new))
    for name, value in graph.outputs.items():
        builder.output(name, mapping[value])
    meta = {**graph.meta, "mesh": mesh}
    if grouped_caches:
        meta[CHANNEL_GROUPS] = {**graph.meta.get(CHANNEL_GROUPS, {}),
                                **{name: (1, tuple(sections), groups) for name, sections in grouped_caches.items()}}
    return eliminate_dead_nodes(builder.build(meta)), layers


def _dim0(t: TensorType):
    return t.sharding.dims[0] if t.sharding is not None else None


def _gathered_dispatch(builder: Builder, mesh, op: MoeDispatch, x: Value, ids: Value, weights: Value,
                       gathered: dict, combine_id: int):
    """The MoE under tensor parallelism alone (no data-parallel ranks): every device holds every token, so there is
    nothing to exchange — each runs the routes that chose its own experts (experts split over every axis)."""
    gathered[combine_id] = weights
    return builder.add(MoeDispatchLocal(op.num_experts, EXPERTS, mesh.rule(EXPERTS)), x, ids)


def _gathered_combine(builder: Builder, mesh, t: TensorType, operands: list, weights: Value) -> Value:
    """... and each device's combine is a partial sum over its experts, added by an all-reduce over `tensor`."""
    out, order, _ = operands
    if t.dtype != "f32":  # the partial sums in f32, rounded once after the all-reduce (LinearF32)
        out = builder.add(Cast("f32"), out)
    partial = builder.add_typed(MoeCombine(), [out, order, weights],
                                [t.with_dtype("f32").with_sharding(Sharding((None,) * t.rank, (TENSOR,)))])
    total = builder.add(AllReduce(TENSOR, mesh.rule(TENSOR)), partial)
    return total if t.dtype == "f32" else builder.add(Cast(t.dtype), total)


def _propagate(builder: Builder, op, operands: list[Value], results) -> list:
    """The shardings of a copied op's results from its operands' (None: leave as is). A linear: the rows' split and
    the weight's output split, a partial sum over `tensor` when both split the contracted dim; a reshape: each split
    dim moves to the result dim that starts at the same element offset; any other op: an operand of the same shape
    lends its split, else a result indexed by the tokens (symbolic first dim) keeps the tokens' `batch` split."""
    results = results if isinstance(results, tuple) else (results,)
    types = [builder.type_of(v) for v in operands]
    found = []
    for value in results:
        t = builder.type_of(value)
        found.append(None if t.sharding is not None or not t.rank else _result_sharding(op, types, t))
    return found


def _result_sharding(op, types: list[TensorType], t: TensorType) -> Sharding | None:
    if isinstance(op, (Linear, LinearF32)):
        x, w = types
        rows = x.sharding.dims[:-1] if x.sharding is not None else (None,) * (x.rank - 1)
        wdims = w.sharding.dims if w.sharding is not None else (None, None)
        contracted = x.sharding is not None and x.sharding.dims[-1] is not None
        if contracted and wdims[1] != x.sharding.dims[-1]:  # a weight TP_WEIGHTS does not know (a prepared one?)
            raise ValueError(f"a linear over {x} split in its last dim has a weight {w} not split the same way")
        partial = (wdims[1],) if contracted and wdims[1] == x.sharding.dims[-1] else ()
        dims = (*rows, wdims[0])
        return Sharding(dims, partial) if any(dims) or partial else None
    if isinstance(op, Reshape):
        (x,) = types
        if x.sharding is None:
            return None
        dims = [None] * t.rank
        dims[0] = x.sharding.dims[0]
        for index, axis in enumerate(x.sharding.dims[1:], start=1):
            if axis is None:
                continue
            offset = math.prod(int(d) for d in x.shape[1:index])
            target = next((j for j in range(1, t.rank) if math.prod(int(d) for d in t.shape[1:j]) == offset), None)
            if target is None:
                return None
            dims[target] = axis
        return Sharding(tuple(dims)) if any(dims) else None
    same = next((x.sharding for x in types if x.sharding is not None and x.shape == t.shape), None)
    if same is not None:
        return Sharding(same.dims) if any(same.dims) else None
    if any(_batch_split(x) for x in types) and not isinstance(t.shape[0], int):
        return Sharding((BATCH,) + (None,) * (t.rank - 1))
    return None


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
