"""swiglu-fusion: an MLP's gate and up projections become one matmul over a fused [gate | up] weight, with SwiGLU
applied to its result — routed experts (grouped_matmul → grouped_matmul_swiglu), the shared expert and dense MLPs
(linear → linear_swiglu).

Pattern: mul(activation[silu](P(x, W_gate, ...)), P(x, W_up, ...)) (either operand order), where both P are
grouped_matmul over the same rows and group sizes, or both linear over the same input, and neither projection has
another user. The fused weight is concat(W_gate, W_up) along the output axis — a params-only op that weight
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
from qcompile.passes.rewrite import rewrite


def _single_use(graph: Graph, value) -> bool:
    """Only one op reads `value` (and no graph output): fusing it away leaves nothing that still needs it."""
    return (graph.dag.out_degree(value.node) == 1 and len(graph.node(value.node).results) == 1
            and value not in graph.outputs.values())


def run(graph: Graph, ctx: PassContext) -> PassResult:
    counts = {"routed_experts": 0, "dense": 0}

    def rule(b, node, ops):
        if not isinstance(node.op, Mul):
            return None
        for side in (0, 1):
            act_value, up_value = ops[side], ops[1 - side]
            act = b.producer(act_value)
            if not (isinstance(act.op, Activation) and act.op.fn == "silu"):
                continue
            gate, up = b.producer(act.operands[0]), b.producer(up_value)
            original_act = graph.node(node.operands[side].node)
            if not (_single_use(graph, node.operands[side]) and _single_use(graph, original_act.operands[0])
                    and _single_use(graph, node.operands[1 - side])):
                continue
            if b.type_of(act_value) != b.type_of(up_value) or b.type_of(up_value) != node.types[0]:
                continue  # a broadcasting mul is not an MLP
            if (isinstance(gate.op, GroupedMatmul) and isinstance(up.op, GroupedMatmul)
                    and gate.operands[0] == up.operands[0] and gate.operands[2] == up.operands[2]):
                counts["routed_experts"] += 1
                fused = b.add(Concat(2), gate.operands[1], up.operands[1])
                return b.add(GroupedMatmulSwiglu(), gate.operands[0], fused, gate.operands[2])
            if isinstance(gate.op, Linear) and isinstance(up.op, Linear) and gate.operands[0] == up.operands[0]:
                counts["dense"] += 1
                fused = b.add(Concat(0), gate.operands[1], up.operands[1])
                return b.add(LinearSwiglu(), gate.operands[0], fused)
        return None

    new, replaced = rewrite(graph, rule)
    if not replaced:
        return PassResult(graph, False, counts, skipped="no SwiGLU MLP (silu(gate) · up over one input) in the graph")
    return PassResult(new, True, counts)


SWIGLU_FUSION = Pass(
    name="swiglu-fusion",
    summary="gate and up projections as one matmul over a fused [gate | up] weight, SwiGLU in the epilogue",
    run=run,
    tolerance="reassociating",
    requires=("SwiGLU MLPs",),
)
