"""Weights in the layout a target's rules read fastest, chosen per target before weight preparation is folded.

Why: the checkpoint's layout is not always the one a target's kernel streams best. On CPU a decode step multiplies
a few rows by every dense weight once; the Hugging Face [N, K] layout forces either dot products of rows (the input
re-read from L2 for every few weight rows) or outer products over rows one page apart (the hardware prefetchers do
not follow them). Column panels — w[N, K] cut into [N/64, K, 64], each panel k-major — are contiguous, and the
native panel kernel streams them (kernels/linear.py, docs/cpu_rules.md). This is a property of the target, not an
optimization a user would toggle, so it is not a pass: `fold_weight_preparation(graph, target)` applies it before
folding (the packing becomes a prepared weight, computed once) and the equivalence checker applies it to every
candidate it runs with the target's rules, so the layout and its kernel are checked on the user's graph.

    before:  %3 = param "layers.0.self_attn.o_proj.weight" : f32[1024,1024]
             %9 = linear(%8, %3) : f32[T,1024]
    after:   %4 = reshape(%3) {shape=[16, 64, 1024]} : f32[16,64,1024]
             %5 = transpose(%4) {perm=[0, 2, 1]} : f32[16,1024,64]       (params-only: folded at compile time)
             %9 = linear_panels(%8, %5) {swiglu=false} : f32[T,1024]

The routed experts likewise (grouped_matmul and grouped_matmul_swiglu in f32 or bf16 — on a CPU with AMX tiles too,
whose kernel reads panels at prefill — over weights w[E, K, Nout] known at compile time, Nout a multiple of 64):
w[E, K, Nout] -> [E, Nout/64, K, 64], read by grouped_matmul_panels. FP8 experts (f32 or bf16) too, when one scale
spans each panel's 64 columns (Qwen's 128 x 128 blocks: a block is two panels): the reshape and transpose sink into
the FP8 values and the scale (ir/fp8_layout.py), so the prepared panels stay FP8 and the kernel dequantizes each panel
row in registers (c=32 experts of a bench-preset step 47 -> 16 ms, docs/cpu_rules.md "FP8 experts in panels").
In the [E, K, Nout] layout a decode step's few-row items read 256-byte pieces of weight rows one page apart; in
panels each expert's panel is one sequential stream (the c=32 decode step's experts 37 → 22 ms on a 2-core AMD EPYC,
docs/cpu_rules.md "Experts in column panels").

Rewritten (cpu): linear and linear_swiglu in f32, or in bf16 with bf16 weights (the kernel widens them), whose weight
is known at compile time (params-only, or an FP8 weight, f32 or bf16, whose scale spans 64 output rows — it stays
FP8 in panels, dequantized a k block at a time in the kernel), unsharded, with N a multiple of 64. Everything else keeps its op. A graph on a
device mesh is left as it is (its weights are laid out by their shardings), and so is every graph when the native
panel kernel cannot be built here or QCOMPILE_NATIVE=off: without the kernel, XLA's dot is faster on the
checkpoint's layout than on panels (1.5× at 128 rows, docs/cpu_rules.md).
"""

from __future__ import annotations

from qcompile.ir.builder import Builder
from qcompile.ir.fp8_layout import sink_dequantize
from qcompile.ir.graph import Graph, Value
from qcompile.ir.ops.core import Input, Linear, LinearPanels, LinearSwiglu, Param, Reshape, Transpose
from qcompile.ir.ops.quant import Dequantize
from qcompile.ir.ops.moe import GroupedMatmul, GroupedMatmulPanels, GroupedMatmulSwiglu
from qcompile.kernels import native
from qcompile.kernels import grouped_matmul as gm, linear as lin
from qcompile.kernels.grouped_matmul import panel_kernel
from qcompile.kernels.linear import NATIVE_PANELS, NATIVE_PANELS_BF16, NATIVE_PANELS_FP8, PANEL

#: targets whose rules want linear weights in column panels
PANEL_TARGETS = ("cpu",)
#: the kernels that read bf16 panels in pair order, all needed for that layout (AMX from a few rows, VDPBF16PS below)
LINEAR_PAIR_KERNELS = (lin.NATIVE_PAIR_PANELS_AMX, lin.NATIVE_PAIR_PANELS_BF16)
EXPERT_PAIR_KERNELS = (gm.NATIVE_PAIR_PANELS_AMX, gm.NATIVE_PAIR_PANELS_BF16, gm.NATIVE_SWIGLU_PAIR_PANELS_BF16)


def _pair_order(xt, wt, k, kernels: tuple[str, ...]) -> bool:
    """Whether a bf16 product's panels go in pair order: bf16 activations and weights (not FP8), K a multiple of 32,
    on a CPU with AMX tiles, whose kernel then reads them in place (VDPBF16PS's for a few rows, too). Not without
    AMX: there the VDPBF16PS kernel ran as fast on k order (docs/cpu_rules.md "Pair order without AMX")."""
    return (xt.dtype == wt.dtype == "bf16" and isinstance(k, int) and k % 32 == 0 and native.amx_bf16()
            and all(native.ensure(kernel) for kernel in kernels))


def _panel_weights(graph: Graph) -> dict[int, tuple[bool, bool]]:
    """Ids of the linear / linear_swiglu nodes to rewrite -> (whether the node is linear_swiglu, pair order)."""
    from qcompile.ir.weights import params_only

    pure = params_only(graph)
    chosen: dict[int, bool] = {}
    for node in graph.nodes():
        if not isinstance(node.op, (Linear, LinearSwiglu)):
            continue
        x, w = node.operands
        xt, wt = graph.type_of(x), graph.type_of(w)
        known = w.node in pure or isinstance(graph.node(w.node).op, Param)
        dtype_ok = (xt.dtype == wt.dtype == "f32"
                    or (xt.dtype == wt.dtype == "bf16" and native.ensure(NATIVE_PANELS_BF16)))
        if _dequantized(graph, w):  # FP8 stays FP8: only where the FP8 panel kernel reads it
            known = _known_fp8(graph, w, pure)
            dtype_ok = xt.dtype == wt.dtype and _fp8_panels(graph, w, 0) and native.ensure(NATIVE_PANELS_FP8)
        if (known and dtype_ok and wt.sharding is None and xt.sharding is None
                and isinstance(wt.shape[0], int) and wt.shape[0] % PANEL == 0 and isinstance(wt.shape[1], int)):
            pairs = not _dequantized(graph, w) and _pair_order(xt, wt, wt.shape[1], LINEAR_PAIR_KERNELS)
            chosen[node.id] = (isinstance(node.op, LinearSwiglu), pairs)
    return chosen


def _dequantized(graph: Graph, value: Value) -> bool:
    """Whether an FP8 dequantize produces `value` (through weight preparation): such experts stay FP8 in the step."""
    stack, seen = [value], set()
    while stack:
        node = graph.node(stack.pop().node)
        if node.id in seen:
            continue
        seen.add(node.id)
        if isinstance(node.op, Dequantize):
            return True
        stack.extend(node.operands)
    return False


def _known_fp8(graph: Graph, w: Value, pure: set[int]) -> bool:
    """Whether the dequantize producing `w` reads values and a scale known at compile time."""
    return all(v.node in pure or isinstance(graph.node(v.node).op, Param) for v in graph.node(w.node).operands)


def _fp8_panels(graph: Graph, w: Value, out_axis: int) -> bool:
    """Whether `w` is an FP8 weight the FP8 panel kernels can read in panels: dequantized to f32 or bf16 directly
    (layout ops already sunk into its values and scale) with one scale across every 64 columns of `out_axis` (a
    linear's [N, K]: 0; stacked experts' [E, K, Nout]: 2)."""
    op = graph.node(w.node).op
    return (isinstance(op, Dequantize) and op.dtype in ("f32", "bf16") and len(op.block) == graph.type_of(w).rank
            and op.block[out_axis] % PANEL == 0)


def _panel_experts(graph: Graph) -> dict[int, tuple[bool, bool]]:
    """Ids of the grouped_matmul / grouped_matmul_swiglu nodes to rewrite -> (whether the node is the swiglu one, pair
    order).
    `graph` has its dequantizes sunk (ir/fp8_layout.py), so an FP8 expert weight is a dequantize's result."""
    from qcompile.ir.weights import params_only

    pure = params_only(graph)
    chosen: dict[int, bool] = {}
    for node in graph.nodes():
        if not isinstance(node.op, (GroupedMatmul, GroupedMatmulSwiglu)):
            continue
        swiglu = isinstance(node.op, GroupedMatmulSwiglu)
        rows, w, _ = node.operands
        rt, wt = graph.type_of(rows), graph.type_of(w)
        known = w.node in pure or isinstance(graph.node(w.node).op, Param)
        nout = wt.shape[2]
        pairs = False
        if _dequantized(graph, w):  # FP8 stays FP8: only where the FP8 panel kernel reads it
            kernel = panel_kernel(wt.dtype, swiglu, fp8=True) if _fp8_panels(graph, w, 2) else None
            known = _known_fp8(graph, w, pure)
        else:
            kernel = panel_kernel(wt.dtype, swiglu)
            pairs = _pair_order(rt, wt, wt.shape[1], EXPERT_PAIR_KERNELS)
        if (known and kernel is not None and rt.dtype == wt.dtype and wt.sharding is None and rt.sharding is None
                and isinstance(nout, int) and nout % (2 * PANEL if swiglu else PANEL) == 0
                and all(isinstance(d, int) for d in wt.shape) and native.ensure(kernel)):
            chosen[node.id] = (swiglu, pairs)
    return chosen


def in_target_layout(graph: Graph, target: str | None) -> Graph:
    """`graph` with its weights in `target`'s layout (module docstring); the same graph object when nothing changes."""
    if target not in PANEL_TARGETS or graph.meta.get("mesh") is not None or not native.ensure(NATIVE_PANELS):
        return graph
    original, graph = graph, sink_dequantize(graph)  # FP8 experts: their blocks as the kernel would see them
    chosen = _panel_weights(graph)
    experts = _panel_experts(graph)
    if not chosen and not experts:
        return original
    b = Builder()
    mapping: dict[Value, Value] = {}
    # a weight (and whether in pair order) -> its panels: a weight shared by two linears is packed once
    panels: dict[tuple[Value, bool], Value] = {}
    for node in graph.nodes():
        op = node.op
        if isinstance(op, Input):
            new = b.input(op.name, op.type)
        elif isinstance(op, Param):
            new = b.param(op.name, op.type)
        elif node.id in chosen:
            x, w = node.operands
            swiglu, pairs = chosen[node.id]
            if (w, pairs) not in panels:
                n, k = graph.type_of(w).shape
                rows = b.add(Reshape((n // PANEL, PANEL, k)), mapping[w])
                if pairs:  # [P, 64, K/2, 2] -> [P, K/2, 64, 2], read as [P, K, 64]
                    split = b.add(Transpose((0, 2, 1, 3)), b.add(Reshape((n // PANEL, PANEL, k // 2, 2)), rows))
                    panels[w, pairs] = b.add(Reshape((n // PANEL, k, PANEL)), split)
                else:
                    panels[w, pairs] = b.add(Transpose((0, 2, 1)), rows)
            new = b.add(LinearPanels(swiglu=swiglu, pair_order=pairs), mapping[x], panels[w, pairs])
        elif node.id in experts:
            rows, w, sizes = node.operands
            swiglu, pairs = experts[node.id]
            if (w, pairs) not in panels:
                e, k, n = graph.type_of(w).shape
                if pairs:  # [E, K/2, 2, P, 64] -> [E, P, K/2, 64, 2], read as [E, P, K, 64]
                    split = b.add(Reshape((e, k // 2, 2, n // PANEL, PANEL)), mapping[w])
                    paired = b.add(Transpose((0, 3, 1, 4, 2)), split)
                    panels[w, pairs] = b.add(Reshape((e, n // PANEL, k, PANEL)), paired)
                else:
                    split = b.add(Reshape((e, k, n // PANEL, PANEL)), mapping[w])
                    panels[w, pairs] = b.add(Transpose((0, 2, 1, 3)), split)
            new = b.add(GroupedMatmulPanels(swiglu=swiglu, pair_order=pairs), mapping[rows], panels[w, pairs],
                        mapping[sizes])
        else:
            new = b.add_typed(op, [mapping[v] for v in node.operands], node.types)
        mapping.update(zip(node.results, new if isinstance(new, tuple) else (new,)))
    for name, v in graph.outputs.items():
        b.output(name, mapping[v])
    return b.build(graph.meta)
