"""gdn-conv-fusion: a Gated DeltaNet layer's causal conv, SiLU, q/k split and L2 norm, decay/β gates and delta rule
become one `gated_delta_net` op.

Pattern (one rule as data, `RULES`): gdn_recurrence(reshape(slice(y)), reshape(slice(y)), reshape(slice(y)),
gdn_gates(a, b, A_log, dt_bias)[0], gdn_gates(...)[1], state, query_start, slots) where (y, new conv state) =
causal_conv1d[silu](x, conv state, w, query_start, slots) — the same query_start and slots — and the three slices cut
y's columns into [q: Hk·dk | k: Hk·dk | v: Hv·dv] in that order. The conv's new state is replaced too (the fused op
returns it); nothing else may use the conv output, the slices or the gates.

Why (design.md §4 item 5): in the unfused graph the conv output, the normalised and head-repeated q/k and the gates
are [T, ·] intermediates written and read again between five kernels, and a decode step calls them all per layer.
The fused op reads x and both states once per step and writes o and both states once: on CPU the native kernel
(kernels/native/gdn_fused_f32.cc) does conv, norm, gates and the delta rule per (sequence, key head) in one pass per
token; on TPU a Pallas kernel keeps each sequence's state in VMEM across its tokens (kernels/pallas_gdn.py). It is
also the op the bf16-state pass demotes in one place. Class: reassociating (the same arithmetic, summed in another
order by the fused kernels).
"""

from __future__ import annotations

from qcompile.ir.graph import Graph
from qcompile.ir.ops.core import Reshape, Slice
from qcompile.ir.ops.gdn import CausalConv1d, GatedDeltaNet, GdnGates, GdnRecurrence
from qcompile.passes.base import Pass, PassContext, PassResult
from qcompile.passes.rewrite import Pattern, RewriteRule, apply_rules_pass

_CONV = Pattern(CausalConv1d, ("x", "conv_state", "conv_w", "query_start", "slots"),
                where=lambda op: op.activation == "silu", results=("y", "conv_state_new"))


def _columns(name: str) -> Pattern:
    return Pattern(Reshape, (Pattern(Slice, (_CONV,), capture=name),))


def _grouped_columns(name: str) -> Pattern:
    """q, k or v of a conv output regrouped for tensor parallelism: y viewed as [T, groups, C/groups], the same
    section cut from every group (passes/gqa_sharding.py)."""
    return Pattern(Reshape, (Pattern(Slice, (Pattern(Reshape, (_CONV,), capture="rows"),), capture=name),))


def _gate(index: int) -> Pattern:
    return Pattern(GdnGates, ("a", "b", "a_log", "dt_bias"), index=index)


PATTERN = Pattern(GdnRecurrence, (_columns("q_cols"), _columns("k_cols"), _columns("v_cols"), _gate(0), _gate(1),
                                  "state", "query_start", "slots"), results=("o", "state_new"))


GROUPED_PATTERN = Pattern(GdnRecurrence, (_grouped_columns("q_cols"), _grouped_columns("k_cols"),
                                          _grouped_columns("v_cols"), _gate(0), _gate(1), "state", "query_start",
                                          "slots"), results=("o", "state_new"))


def _groups(graph: Graph, c: dict) -> int:
    return int(graph.type_of(c["rows"]).shape[1]) if "rows" in c else 1


def _splits_q_k_v(graph: Graph, c: dict) -> bool:
    """The slices are y[:, 0:kd], y[:, kd:2kd], y[:, 2kd:C] with kd = Hk·dk (the recurrence's q heads) — or, with y
    regrouped as [T, g, C/g], the same cuts divided by g along axis 2."""
    q_type = graph.node(c["o"].node).types[0]  # o [T, Hv, dv]
    q_in = graph.type_of(graph.node(c["o"].node).operands[0])  # q [T, Hk, dk]
    kd = q_in.shape[1] * q_in.shape[2]
    width = graph.type_of(c["y"]).shape[1]
    g = _groups(graph, c)
    if g > 1 and tuple(graph.type_of(c["rows"]).shape[1:]) != (g, width // g):
        return False
    expected = {"q_cols": (0, kd), "k_cols": (kd, 2 * kd), "v_cols": (2 * kd, width)}
    for name, (start, stop) in expected.items():
        op = graph.node(c[name].node).op
        if (op.axis, op.start, op.stop) != ((1, start, stop) if g == 1 else (2, start // g, stop // g)):
            return False
    return width - 2 * kd == q_type.shape[1] * q_type.shape[2]


def _build(b, c):
    recurrence = c.ops["o"]
    groups = int(b.type_of(c["rows"]).shape[1]) if "rows" in c else 1
    o, conv_state, state = b.add(GatedDeltaNet(recurrence.mode, recurrence.chunk_size, groups), c["x"], c["a"], c["b"],
                                 c["conv_state"], c["conv_w"], c["a_log"], c["dt_bias"], c["state"], c["query_start"],
                                 c["slots"])
    return {"o": o, "state_new": state, "conv_state_new": conv_state}


RULES = [
    RewriteRule("gdn_layer", "recurrence(split(silu(conv(x))), gates(a, b)) = gated_delta_net(x, a, b)", PATTERN,
                _build, when=_splits_q_k_v, replaces=("conv_state_new",)),
    RewriteRule("gdn_layer_grouped", "the same with x's channels in groups × [q_j | k_j | v_j] (tensor parallelism) "
                "= gated_delta_net{groups}(x, a, b)", GROUPED_PATTERN, _build, when=_splits_q_k_v,
                replaces=("conv_state_new",)),
]


def run(graph: Graph, ctx: PassContext) -> PassResult:
    return apply_rules_pass(graph, RULES,
                            not_found="no Gated DeltaNet layer (conv → split → gdn_recurrence) in the graph")


GDN_CONV_FUSION = Pass(
    name="gdn-conv-fusion",
    summary="GDN conv, SiLU, q/k norm, gates and delta rule as one gated_delta_net op (native CPU / Pallas TPU kernel)",
    run=run,
    tolerance="reassociating",
    requires=("Gated DeltaNet layers",),
    cpu_note="1.4-1.9x the unfused ops at B=1-8 decode and multi-sequence prefill, equal at B=32 decode, 0.6x for "
             "one long prefill (4 work items); kept for TPU: state in VMEM, prefill chunks on the MXU",
)
