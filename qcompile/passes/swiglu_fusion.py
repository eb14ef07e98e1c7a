"""swiglu-fusion: an MLP's gate and up projections become one matmul over a fused [gate | up] weight, with SwiGLU
applied to its result — routed experts (grouped_matmul → grouped_matmul_swiglu), the shared expert and dense MLPs
(linear → linear_swiglu).

Pattern (two rules as data, `RULES`, applied by passes/rewrite.py's `apply_rules`): mul(activation[silu](P(x, W_gate,
...)), P(x, W_up, ...)) (either operand order), where both P are grouped_matmul over the same rows and group sizes,
or both linear over the same input, with gate and up weights of one type, and neither projection nor the activation
has another user. The fused weight is concat(W_gate, W_up) along the output axis — a params-only op that weight
preparation folds into one prepared tensor at compile time (for routed experts, concat of the two [E,K,I] prepared
transposes into [E,K,2I]), so no step concatenates anything.

Why (design.md §4 item 4): one sweep over the experts' weights reads the routed rows once and issues one kernel call
instead of two, and the kernels apply silu(gate)·up in their epilogue (the native CPU grouped matmul: per work item,
from an L2-resident [rows, 2I] product; no [N, 2I] intermediate). Class: reassociating — the same products, the
activation applied to the same values, up to how a target rule orders its sums.
"""

from __future__ import annotations

from qcompile.ir.graph import Graph
from qcompile.ir.ops.core import Activation, Concat, Linear, LinearSwiglu, Mul
from qcompile.ir.ops.moe import GroupedMatmul, GroupedMatmulSwiglu
from qcompile.passes.base import Pass, PassContext, PassResult
from qcompile.passes.rewrite import Pattern, RewriteRule, apply_rules_pass, regroup_rows


def _silu(op) -> bool:
    return op.fn == "silu"


def _swiglu_pattern(projection: type) -> Pattern:
    """mul(silu(P(x, W_gate, ...)), P(x, W_up, ...)), operands either way round; x (and the group sizes) shared."""
    extra = ("groups",) if projection is GroupedMatmul else ()
    return Pattern(Mul, (Pattern(Activation, (Pattern(projection, ("x", "w_gate", *extra)),), where=_silu),
                         Pattern(projection, ("x", "w_up", *extra))), commutative=True)


def _same_weight_types(graph: Graph, c: dict) -> bool:
    """Gate and up of one width (a mul that broadcasts one projection over the other is not a SwiGLU MLP)."""
    return graph.type_of(c["w_gate"]) == graph.type_of(c["w_up"])


RULES = [
    RewriteRule("routed_experts", "silu(x·Wg[e]) ⊙ (x·Wu[e]) = swiglu(x·[Wg | Wu][e]) for every expert e",
                _swiglu_pattern(GroupedMatmul),
                lambda b, c: b.add(GroupedMatmulSwiglu(), c["x"], b.add(Concat(2), c["w_gate"], c["w_up"]),
                                   c["groups"]), when=_same_weight_types),
    RewriteRule("dense", "silu(x·Wgᵀ) ⊙ (x·Wuᵀ) = swiglu(x·[Wg ; Wu]ᵀ)",
                _swiglu_pattern(Linear),
                lambda b, c: b.add(LinearSwiglu(), c["x"], b.add(Concat(0), c["w_gate"], c["w_up"])),
                when=_same_weight_types),
]


def _dense_split(mesh):
    """The dense rule on a tensor-parallel graph: gate and up split by rows along a logical axis are fused as
    [Wg_j ; Wu_j] per device (passes/rewrite.py `regroup_rows`), so each device's block of the fused weight is its
    own gate and up columns and the kernel's halves stay its own."""

    def build(b, c):
        split = b.type_of(c["w_gate"]).sharding
        fused = regroup_rows(b, b.add(Concat(0), c["w_gate"], c["w_up"]), (b.type_of(c["w_gate"]).shape[0],) * 2,
                             mesh.ways(split.dims[0]))
        b.annotate(fused, split)
        return b.add(LinearSwiglu(), c["x"], fused)

    def split_by_rows(graph: Graph, c: dict) -> bool:
        sharding = graph.type_of(c["w_gate"]).sharding
        return _same_weight_types(graph, c) and sharding is not None and sharding.dims[0] is not None

    return RewriteRule("dense_split", "[Wg ; Wu] regrouped as [Wg_j ; Wu_j] per device: the same rows, each device's "
                       "block its own gate and up", _swiglu_pattern(Linear), build, when=split_by_rows)


def run(graph: Graph, ctx: PassContext) -> PassResult:
    mesh = graph.meta.get("mesh")
    rules = RULES if mesh is None or not mesh.rules else [RULES[0], _dense_split(mesh), RULES[1]]
    return apply_rules_pass(graph, rules, not_found="no SwiGLU MLP (silu(gate) · up over one input) in the graph")


SWIGLU_FUSION = Pass(
    name="swiglu-fusion",
    summary="gate and up projections as one matmul over a fused [gate | up] weight, SwiGLU in the epilogue",
    run=run,
    tolerance="reassociating",
    requires=("SwiGLU MLPs",),
    cpu_note="equal to the unfused matmuls within noise (a weight-bandwidth-bound step reads the same bytes); kept "
             "for TPU, where the Pallas kernel reads the routed rows once for gate and up",
)
