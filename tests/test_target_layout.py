"""Weights in the target's layout (ir/target_layout.py): on cpu, f32 linear and linear_swiglu weights known at compile
time become column panels read by linear_panels; the packing folds into a prepared weight; the checker runs the
laid-out graph with the target's rules; nothing else changes."""

from __future__ import annotations

import numpy as np
import pytest

from qcompile.frontend.checkpoint import Checkpoint
from qcompile.ir.builder import Builder
from qcompile.ir.importer import build_graph
from qcompile.ir.ops.core import Linear, LinearPanels, LinearSwiglu, Param, Transpose
from qcompile.ir.printer import print_graph
from qcompile.ir.target_layout import in_target_layout
from qcompile.ir.types import TensorType
from qcompile.ir.verifier import verify
from qcompile.ir.weights import fold_weight_preparation, load_params, prepared_names
from qcompile.kernels import native
from qcompile.kernels.grouped_matmul import AMX_MIN_ROWS_PER_EXPERT, AMX_PAIR_MIN_ROWS_PER_EXPERT

GOLDEN_AFTER = """\
graph @step {
  %0 = input "x" : f32[T,32]
  %1 = param "proj" : f32[128,32]
  %2 = reshape(%1) {shape=[2, 64, 32]} : f32[2,64,32]
  %3 = transpose(%2) {perm=[0, 2, 1]} : f32[2,32,64]
  %4 = linear_panels(%0, %3) {swiglu=false, pair_order=false} : f32[T,128]
  %5 = param "mlp" : f32[64,128]
  %6 = reshape(%5) {shape=[1, 64, 128]} : f32[1,64,128]
  %7 = transpose(%6) {perm=[0, 2, 1]} : f32[1,128,64]
  %8 = linear_panels(%4, %7) {swiglu=true, pair_order=false} : f32[T,32]
  %9 = param "odd" : f32[40,32]
  %10 = linear(%8, %9) : f32[T,40]
  %11 = input "x2" : f32[T,32]
  %12 = linear_panels(%11, %3) {swiglu=false, pair_order=false} : f32[T,128]
  return y=%8, odd=%10, shared=%12
}
"""


def _small_graph():
    """A linear (N = 128: two panels), a linear_swiglu (N = 64: one), a linear with N = 40 (not a multiple of 64:
    kept) and a second linear over the first one's weight (packed once, shared)."""
    b = Builder()
    x = b.input("x", TensorType("f32", ("T", 32)))
    h = b.add(Linear(), x, b.param("proj", TensorType("f32", (128, 32))))
    mlp = b.param("mlp", TensorType("f32", (64, 128)))
    y = b.add(LinearSwiglu(), h, mlp)
    b.output("y", y)
    b.output("odd", b.add(Linear(), y, b.param("odd", TensorType("f32", (40, 32)))))
    b.output("shared", b.add(Linear(), b.input("x2", TensorType("f32", ("T", 32))), b.param("proj", TensorType("f32", (128, 32)))))
    return b.build()


def test_golden_cpu_layout_and_what_it_keeps():
    """linear and linear_swiglu with N a multiple of 64 read panels (a weight two linears share is packed once);
    N = 40 stays a linear."""
    graph = _small_graph()
    after = in_target_layout(graph, "cpu")
    verify(after)
    assert print_graph(after) == GOLDEN_AFTER


@pytest.mark.parametrize("target", ["reference", "tpu", "gpu", None])
def test_other_targets_keep_the_checkpoint_layout(target):
    graph = _small_graph()
    assert in_target_layout(graph, target) is graph


def test_without_the_native_kernel_cpu_keeps_the_checkpoint_layout(monkeypatch):
    """QCOMPILE_NATIVE=off (or no compiler): XLA's dot on [N, K] is the faster rule, so no panels."""
    graph = _small_graph()
    monkeypatch.setenv("QCOMPILE_NATIVE", "off")
    assert in_target_layout(graph, "cpu") is graph
    monkeypatch.delenv("QCOMPILE_NATIVE")
    assert in_target_layout(graph, "cpu") is not graph


def test_bf16_weights_go_into_bf16_panels():
    """A bf16 checkpoint's projection becomes linear_panels over bf16 panels (the kernel widens them: two bytes a
    weight from memory), and the rule matches the reference on it."""
    b = Builder()
    x = b.input("x", TensorType("bf16", ("T", 32)))
    b.output("y", b.add(Linear(), x, b.param("w", TensorType("bf16", (128, 32)))))
    laid = in_target_layout(b.build(), "cpu")
    panels = [n for n in laid.nodes() if type(n.op).__name__ == "LinearPanels"]
    assert len(panels) == 1 and str(laid.type_of(panels[0].operands[1])) == "bf16[2,32,64]"


def test_not_rewritten_uneven_n_or_a_weight_computed_in_the_step_or_a_mesh():
    from qcompile.ir.mesh import Mesh

    b = Builder()
    x = b.input("x", TensorType("bf16", ("T", 32)))
    b.output("bf16", b.add(Linear(), x, b.param("w", TensorType("bf16", (48, 32)))))  # N not a multiple of 64
    xf = b.input("xf", TensorType("f32", ("T", 32)))
    step_weight = b.input("w_in_step", TensorType("f32", (64, 32)))  # a runtime value, not a weight
    b.output("runtime", b.add(Linear(), xf, step_weight))
    graph = b.build()
    assert in_target_layout(graph, "cpu") is graph
    f32 = Builder()
    x = f32.input("x", TensorType("f32", ("T", 32)))
    f32.output("y", f32.add(Linear(), x, f32.param("w", TensorType("f32", (64, 32)))))
    meshed = f32.build({"mesh": Mesh(("model",), (1,), (0,))})
    assert in_target_layout(meshed, "cpu") is meshed


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from conftest import write_small

    return write_small(tmp_path_factory.mktemp("layout") / "m", family="qwen3_5_moe", seed=11)


def test_folded_cpu_graph_streams_panels_and_computes_the_same_logits(ckpt):
    """On a tiny checkpoint: every f32 projection whose N is a multiple of 64 becomes linear_panels over a prepared
    [N/64, K, 64] weight (the packing runs once, in load_params), and the folded cpu build's logits match the
    unoptimized graph's reference rules in the reassociating class."""
    from qcompile.passes.equivalence import EquivalenceChecker, outputs_by_item, run_graph

    checkpoint = Checkpoint.open(ckpt)
    graph = build_graph(checkpoint)
    folded = fold_weight_preparation(graph, "cpu")
    verify(folded)
    linears = [n for n in graph.find(Linear) + graph.find(LinearSwiglu)
               if graph.type_of(n.operands[1]).shape[0] % 64 == 0]
    assert linears and len(folded.find(LinearPanels)) == len(linears)
    assert not folded.find(Transpose)  # packing and the experts' transposes are all prepared weights
    for node in folded.find(LinearPanels):
        w = folded.node(node.operands[1].node).op
        assert isinstance(w, Param) and w.name in prepared_names(folded) and w.type.shape[2] == 64
    raw = load_params(checkpoint, graph, progress=False)
    prepared = load_params(checkpoint, folded, progress=False, loaded=raw)
    checker = EquivalenceChecker(graph, raw)
    want = checker.outputs(graph, "reference")
    got = outputs_by_item(checker.comparable(folded, run_graph(folded, prepared, checker.caches, checker.batch, "cpu")),
                          checker.rows)
    for key in want:
        scale = max(float(np.abs(want[key]).max()), 1e-30)
        assert np.abs(np.asarray(got[key], np.float64) - want[key]).max() / scale < 1e-5, key


def test_checker_runs_candidates_in_the_target_layout(ckpt, monkeypatch):
    """The checker lays out the graph it runs with cpu rules, so the panel kernel is what the check compares: a wrong
    panel rule is caught."""
    import jax.numpy as jnp

    from qcompile.ir import registry
    from qcompile.passes import equivalence
    from qcompile.passes.equivalence import EquivalenceChecker

    checkpoint = Checkpoint.open(ckpt)
    graph = build_graph(checkpoint)
    raw = load_params(checkpoint, graph, progress=False)
    checker = EquivalenceChecker(graph, raw, target="cpu")
    assert checker.check(graph, 1e-5).ok
    rule = registry.lowering_rule(LinearPanels, "cpu")
    monkeypatch.setattr(equivalence, "_RUNNERS", type(equivalence._RUNNERS)())  # no step compiled with the right rule
    broken = lambda op_, x, w: rule(op_, x, jnp.flip(w, axis=2))  # noqa: E731  (each panel's columns reversed)
    monkeypatch.setitem(registry.LOWERINGS, (LinearPanels, "cpu"), broken)
    assert not EquivalenceChecker(graph, raw, target="cpu").check(graph, 1e-5).ok


def test_panel_weights_stream_in_slabs_of_panels(ckpt):
    """The artifact writer makes a prepared weight a slab of rows at a time: a panel recipe (reshape splitting axis 0,
    transpose) is row-wise with 64 source rows per panel, so slabs of panels read only their own source rows and
    together equal the whole packed weight."""
    import jax.numpy as jnp

    from qcompile.frontend.checkpoint import Checkpoint as Ckpt
    from qcompile.ir.weights import weight_pieces
    from qcompile.kernels.linear import pack_panels

    checkpoint = Ckpt.open(ckpt)
    folded = fold_weight_preparation(build_graph(checkpoint), "cpu")
    name = next(n for n in prepared_names(folded) if '"lm_head"' in folded.meta["prepared"][n])
    assert folded.meta["prepared"][name].count("reshape") == 1  # the panel recipe, not a plain copy
    vocab, hidden = checkpoint.params["lm_head"].shape
    panel_bytes = 64 * hidden * 4
    pieces = list(weight_pieces(checkpoint, folded, name, piece_bytes=3 * panel_bytes))
    assert len(pieces) == -(-vocab // 64 // 3) > 1 and all(p.shape[0] <= 3 for p in pieces)
    whole = np.concatenate(pieces)
    np.testing.assert_array_equal(whole, np.asarray(pack_panels(jnp.asarray(checkpoint.load("lm_head")))))


def _experts_graph():
    """Routed experts: f32 [gate | up] [4, 32, 128] (two panels, SwiGLU), an f32 down projection with Nout = 32 (not a
    multiple of 64: kept), FP8 experts dequantized to f32 with one scale per 64 columns (FP8 panels) and with one per
    32 (a panel would need two scales: kept), and bf16 experts (panels, with or without AMX)."""
    from qcompile.ir.ops.moe import GroupedMatmul, GroupedMatmulSwiglu
    from qcompile.ir.ops.quant import Dequantize

    b = Builder()
    rows = b.input("rows", TensorType("f32", ("N", 32)))
    sizes = b.input("group_sizes", TensorType("i32", (4,)))
    h = b.add(GroupedMatmulSwiglu(), rows, b.param("gate_up", TensorType("f32", (4, 32, 128))), sizes)
    b.output("down", b.add(GroupedMatmul(), h, b.param("down", TensorType("f32", (4, 64, 32))), sizes))
    fp8 = b.add(Dequantize((1, 32, 64), "f32"), b.param("fp8", TensorType("f8e4m3", (4, 32, 64))),
                b.param("fp8_scale", TensorType("f32", (4, 1, 1))))
    b.output("fp8", b.add(GroupedMatmul(), rows, fp8, sizes))
    fine = b.add(Dequantize((1, 32, 32), "f32"), b.param("fp8_fine", TensorType("f8e4m3", (4, 32, 64))),
                 b.param("fp8_fine_scale", TensorType("f32", (4, 1, 2))))
    b.output("fp8_fine", b.add(GroupedMatmul(), rows, fine, sizes))
    rows16 = b.input("rows16", TensorType("bf16", ("N", 32)))
    b.output("bf16", b.add(GroupedMatmul(), rows16, b.param("w16", TensorType("bf16", (4, 32, 64))), sizes))
    return b.build()


GOLDEN_EXPERTS = """\
graph @step {
  %0 = input "rows" : f32[N,32]
  %1 = input "group_sizes" : i32[4]
  %2 = param "gate_up" : f32[4,32,128]
  %3 = reshape(%2) {shape=[4, 32, 2, 64]} : f32[4,32,2,64]
  %4 = transpose(%3) {perm=[0, 2, 1, 3]} : f32[4,2,32,64]
  %5 = grouped_matmul_panels(%0, %4, %1) {swiglu=true, pair_order=false} : f32[N,64]
  %6 = param "down" : f32[4,64,32]
  %7 = grouped_matmul(%5, %6, %1) : f32[N,32]
  %8 = param "fp8" : f8e4m3[4,32,64]
  %9 = param "fp8_scale" : f32[4,1,1]
  %10 = dequantize(%8, %9) {block=[1, 32, 64], dtype="f32"} : f32[4,32,64]
  %11 = reshape(%10) {shape=[4, 32, 1, 64]} : f32[4,32,1,64]
  %12 = transpose(%11) {perm=[0, 2, 1, 3]} : f32[4,1,32,64]
  %13 = grouped_matmul_panels(%0, %12, %1) {swiglu=false, pair_order=false} : f32[N,64]
  %14 = param "fp8_fine" : f8e4m3[4,32,64]
  %15 = param "fp8_fine_scale" : f32[4,1,2]
  %16 = dequantize(%14, %15) {block=[1, 32, 32], dtype="f32"} : f32[4,32,64]
  %17 = grouped_matmul(%0, %16, %1) : f32[N,64]
  %18 = input "rows16" : bf16[N,32]
  %19 = param "w16" : bf16[4,32,64]
  %20 = reshape(%19) {shape=[4, 32, 1, 64]} : bf16[4,32,1,64]
  %21 = transpose(%20) {perm=[0, 2, 1, 3]} : bf16[4,1,32,64]
  %22 = grouped_matmul_panels(%18, %21, %1) {swiglu=false, pair_order=false} : bf16[N,64]
  return down=%7, fp8=%13, fp8_fine=%17, bf16=%22
}
"""
GOLDEN_BF16_EXPERTS = """\
  %20 = reshape(%19) {shape=[4, 32, 1, 64]} : bf16[4,32,1,64]
  %21 = transpose(%20) {perm=[0, 2, 1, 3]} : bf16[4,1,32,64]
  %22 = grouped_matmul_panels(%18, %21, %1) {swiglu=false, pair_order=false} : bf16[N,64]
  return down=%7, fp8=%13, fp8_fine=%17, bf16=%22
"""
#: with AMX tiles, the bf16 experts' panels in pair order (their kernel reads them in place)
GOLDEN_BF16_EXPERTS_PAIRED = """\
  %20 = reshape(%19) {shape=[4, 16, 2, 1, 64]} : bf16[4,16,2,1,64]
  %21 = transpose(%20) {perm=[0, 3, 1, 4, 2]} : bf16[4,1,16,64,2]
  %22 = reshape(%21) {shape=[4, 1, 32, 64]} : bf16[4,1,32,64]
  %23 = grouped_matmul_panels(%18, %22, %1) {swiglu=false, pair_order=true} : bf16[N,64]
  return down=%7, fp8=%13, fp8_fine=%17, bf16=%23
"""
#: the FP8 panels once the layout ops sink into the values and the scale (ir/fp8_layout.py): still FP8 in the step
GOLDEN_FP8_PANELS_SUNK = """\
  %10 = reshape(%8) {shape=[4, 32, 1, 64]} : f8e4m3[4,32,1,64]
  %11 = reshape(%9) {shape=[4, 1, 1, 1]} : f32[4,1,1,1]
  %12 = transpose(%10) {perm=[0, 2, 1, 3]} : f8e4m3[4,1,32,64]
  %13 = transpose(%11) {perm=[0, 2, 1, 3]} : f32[4,1,1,1]
  %14 = dequantize(%12, %13) {block=[1, 1, 32, 64], dtype="f32"} : f32[4,1,32,64]
  %15 = grouped_matmul_panels(%0, %14, %1) {swiglu=false, pair_order=false} : f32[N,64]
"""


GOLDEN_PAIR_ORDER = """\
graph @step {
  %0 = input "x" : bf16[T,32]
  %1 = param "w" : bf16[128,32]
  %2 = reshape(%1) {shape=[2, 64, 32]} : bf16[2,64,32]
  %3 = reshape(%2) {shape=[2, 64, 16, 2]} : bf16[2,64,16,2]
  %4 = transpose(%3) {perm=[0, 2, 1, 3]} : bf16[2,16,64,2]
  %5 = reshape(%4) {shape=[2, 32, 64]} : bf16[2,32,64]
  %6 = linear_panels(%0, %5) {swiglu=false, pair_order=true} : bf16[T,128]
  %7 = input "x48" : bf16[T,48]
  %8 = param "w48" : bf16[64,48]
  %9 = reshape(%8) {shape=[1, 64, 48]} : bf16[1,64,48]
  %10 = transpose(%9) {perm=[0, 2, 1]} : bf16[1,48,64]
  %11 = linear_panels(%7, %10) {swiglu=false, pair_order=false} : bf16[T,64]
  %12 = input "rows" : bf16[N,32]
  %13 = input "group_sizes" : i32[4]
  %14 = param "gu" : bf16[4,32,128]
  %15 = reshape(%14) {shape=[4, 16, 2, 2, 64]} : bf16[4,16,2,2,64]
  %16 = transpose(%15) {perm=[0, 3, 1, 4, 2]} : bf16[4,2,16,64,2]
  %17 = reshape(%16) {shape=[4, 2, 32, 64]} : bf16[4,2,32,64]
  %18 = grouped_matmul_panels(%12, %17, %13) {swiglu=true, pair_order=true} : bf16[N,64]
  return y=%6, k48=%11, h=%18
}
"""


def _bf16_products():
    from qcompile.ir.ops.moe import GroupedMatmulSwiglu

    b = Builder()
    x = b.input("x", TensorType("bf16", ("T", 32)))
    b.output("y", b.add(Linear(), x, b.param("w", TensorType("bf16", (128, 32)))))
    b.output("k48", b.add(Linear(), b.input("x48", TensorType("bf16", ("T", 48))),
                          b.param("w48", TensorType("bf16", (64, 48)))))
    rows = b.input("rows", TensorType("bf16", ("N", 32)))
    sizes = b.input("group_sizes", TensorType("i32", (4,)))
    b.output("h", b.add(GroupedMatmulSwiglu(), rows, b.param("gu", TensorType("bf16", (4, 32, 128))), sizes))
    return b.build()


def test_golden_bf16_panels_in_pair_order_on_amx(monkeypatch):
    """On a CPU with AMX tiles a bf16 product whose K is a multiple of 32 gets its panels in pair order — the weights
    of k = 2i and 2i + 1 side by side, as the tiles read them, so no kernel repacks them — (a reshape splitting K into
    pairs, a transpose, a reshape back to [.., K, 64]: all folded into the prepared weight); K = 48 keeps k order.
    Without AMX, k order everywhere."""
    from qcompile.kernels import native

    monkeypatch.setattr(native, "amx_bf16", lambda: True)
    after = in_target_layout(_bf16_products(), "cpu")
    verify(after)
    assert print_graph(after) == GOLDEN_PAIR_ORDER
    monkeypatch.setattr(native, "amx_bf16", lambda: False)
    plain = print_graph(in_target_layout(_bf16_products(), "cpu"))
    assert "pair_order=true" not in plain and plain.count("pair_order=false") == 3


@pytest.mark.skipif(not native.amx_bf16(), reason="this CPU has no AMX bf16 tiles")
def test_pair_order_bf16_build_matches_the_reference(tmp_path):
    """A bf16 tiny checkpoint (moe_intermediate_size 64) on a CPU with AMX: its dense and expert panels in pair
    order, read in place by the AMX kernels at the checker's 16-token batches, the folded cpu build's outputs against
    the unoptimized graph's reference rules within the bf16 class (the bound the pass checks use)."""
    import copy

    from qcompile.frontend.tiny import full_config, write_checkpoint
    from qcompile.ir.ops.moe import GroupedMatmulPanels

    config = copy.deepcopy(full_config("tiny", "qwen3_5_moe", "bf16"))
    config["text_config"].update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                 moe_intermediate_size=64)
    checkpoint = Checkpoint.open(write_checkpoint(tmp_path / "m", config, seed=5))
    raw, checker, want, candidates = _unfused_and_fused(checkpoint)
    for candidate, _ in candidates:
        folded = fold_weight_preparation(candidate, "cpu")
        verify(folded)
        paired = [n for n in folded.find(LinearPanels) + folded.find(GroupedMatmulPanels) if n.op.pair_order]
        assert len(paired) >= 4
        got = _folded_outputs(checker, checkpoint, raw, folded)
        for key in want:
            scale = max(float(np.abs(want[key]).max()), 1e-30)
            assert np.abs(np.asarray(got[key], np.float64) - want[key]).max() / scale < 0.1, key


def test_pair_order_weights_stream_in_slabs(tmp_path, monkeypatch):
    """The pair-order recipes stay row-wise — the dense one splits axis 0 into panels, then regroups each panel
    (reshapes keeping the new axis 0, a transpose keeping it); the experts' keep axis 0 throughout —, so slabs read
    only their own source rows and together equal the whole prepared weight, in pair order."""
    import copy

    import jax.numpy as jnp

    from qcompile.frontend.tiny import full_config, write_checkpoint
    from qcompile.ir.weights import weight_pieces
    from qcompile.kernels import native
    from qcompile.kernels.grouped_matmul import to_pair_order
    from qcompile.kernels.linear import pack_panels

    monkeypatch.setattr(native, "amx_bf16", lambda: True)
    config = copy.deepcopy(full_config("tiny", "qwen3_5_moe", "bf16"))
    config["text_config"].update(num_hidden_layers=1, layer_types=["full_attention"], moe_intermediate_size=64)
    checkpoint = Checkpoint.open(write_checkpoint(tmp_path / "m", config, seed=2))
    folded = fold_weight_preparation(build_graph(checkpoint), "cpu")
    types = param_types_of(folded)
    head = next(n for n in prepared_names(folded) if '"lm_head"' in folded.meta["prepared"][n])
    assert "perm=[0, 2, 1, 3]" in folded.meta["prepared"][head]  # the pair-order recipe
    panels, k, width = types[head].shape
    pieces = list(weight_pieces(checkpoint, folded, head, piece_bytes=3 * k * width * 2))
    assert len(pieces) == -(-panels // 3) > 1
    want = to_pair_order(pack_panels(jnp.asarray(checkpoint.load("lm_head"), jnp.bfloat16)))
    np.testing.assert_array_equal(np.concatenate(pieces).view(np.uint16), np.asarray(want).view(np.uint16))
    experts = next(n for n in prepared_names(folded) if len(types[n].shape) == 4
                   and "perm=[0, 3, 1, 4, 2]" in folded.meta["prepared"][n])
    e, p, k, width = types[experts].shape
    pieces = list(weight_pieces(checkpoint, folded, experts, piece_bytes=2 * p * k * width * 2))
    assert len(pieces) == -(-e // 2) > 1
    source = next(s for s in checkpoint.params if "experts" in s and s in folded.meta["prepared"][experts])
    stacked = jnp.asarray(checkpoint.load(source), jnp.bfloat16).transpose(0, 2, 1)  # [E, K, Nout]
    want = to_pair_order(stacked.reshape(e, k, p, width).transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(np.concatenate(pieces).view(np.uint16), np.asarray(want).view(np.uint16))


@pytest.mark.parametrize("amx", [True, False])
def test_golden_cpu_layout_of_the_experts_and_what_it_keeps(monkeypatch, amx):
    """f32 and bf16 experts whose Nout is a multiple of 64 read [E, Nout/64, K, 64] panels — bf16 ones on a CPU with
    AMX tiles too (its AMX kernel reads panels at prefill) —, and so do FP8 experts with one scale across each
    panel's columns (the FP8 panel kernel reads them as FP8); Nout = 32 and FP8 experts with finer scales (read as FP8
    by the [E, K, Nout] kernel) keep [E, K, Nout]."""
    from qcompile.ir.fp8_layout import sink_dequantize
    from qcompile.kernels import native

    monkeypatch.setattr(native, "amx_bf16", lambda: amx)
    after = in_target_layout(_experts_graph(), "cpu")
    verify(after)
    assert print_graph(after) == (GOLDEN_EXPERTS.replace(GOLDEN_BF16_EXPERTS, GOLDEN_BF16_EXPERTS_PAIRED) if amx
                                  else GOLDEN_EXPERTS)
    sunk = sink_dequantize(after)
    verify(sunk)
    assert GOLDEN_FP8_PANELS_SUNK in print_graph(sunk)


@pytest.mark.parametrize("amx", [False, True])
def test_bf16_experts_go_into_panels(monkeypatch, amx):
    """With or without AMX tiles, bf16 experts read bf16 panels (decode-sized rows: on VDPBF16PS pairs, or widened in
    registers), and the panel rule matches the reference on them (SwiGLU's halves after the bf16 rounding, as the
    reference takes them)."""
    import jax
    import jax.numpy as jnp

    from qcompile.ir.lowering import lower
    from qcompile.ir.ops.moe import GroupedMatmulPanels, GroupedMatmulSwiglu
    from qcompile.kernels import native

    monkeypatch.setattr(native, "amx_bf16", lambda: amx)  # 16 rows over 4 experts: below AMX's rows either way
    assert 16 < 4 * min(AMX_PAIR_MIN_ROWS_PER_EXPERT, AMX_MIN_ROWS_PER_EXPERT)  # (no AMX kernel runs without AMX)
    b = Builder()
    rows = b.input("rows", TensorType("bf16", (16, 32)))
    sizes = b.input("group_sizes", TensorType("i32", (4,)))
    b.output("h", b.add(GroupedMatmulSwiglu(), rows, b.param("w", TensorType("bf16", (4, 32, 128))), sizes))
    graph = b.build()
    laid = in_target_layout(graph, "cpu")
    (node,) = laid.find(GroupedMatmulPanels)
    assert node.op.swiglu and str(laid.type_of(node.operands[1])) == "bf16[4,2,32,64]"
    rng = np.random.default_rng(4)
    inputs = {"rows": jnp.asarray(rng.standard_normal((16, 32)), jnp.bfloat16),
              "group_sizes": jnp.asarray([4, 0, 7, 4], jnp.int32)}
    params = {"w": jnp.asarray(rng.standard_normal((4, 32, 128)) / 6, jnp.bfloat16)}
    want = np.asarray(jax.jit(lower(graph, "reference"))(params, inputs)["h"], np.float64)[:15]
    got = np.asarray(jax.jit(lower(laid, "cpu"))(params, inputs)["h"], np.float64)[:15]
    assert np.abs(want).max() > 0 and np.abs(got - want).max() <= 1e-2 * np.abs(want).max()


def test_folded_cpu_graph_streams_expert_panels_and_computes_the_same_logits(tmp_path):
    """A tiny checkpoint with moe_intermediate_size 64: gate and up (unfused, Nout 64) and [gate | up] (swiglu-fusion,
    Nout 128) become grouped_matmul_panels over prepared weights; the down projection (Nout 96) keeps its layout; the
    folded cpu build's logits match the unoptimized graph's reference rules in the reassociating class."""
    import copy

    from qcompile.frontend.tiny import full_config, write_checkpoint
    from qcompile.ir.ops.moe import GroupedMatmul, GroupedMatmulPanels

    config = copy.deepcopy(full_config("tiny", "qwen3_5_moe", "f32"))
    text = config["text_config"]
    text.update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], moe_intermediate_size=64)
    checkpoint = Checkpoint.open(write_checkpoint(tmp_path / "m", config, seed=5))
    raw, checker, want, candidates = _unfused_and_fused(checkpoint)
    for candidate, panels_per_layer in candidates:
        folded = fold_weight_preparation(candidate, "cpu")
        verify(folded)
        layers = len(folded.find(GroupedMatmul))  # the down projections, kept
        assert layers == 2 and len(folded.find(GroupedMatmulPanels)) == panels_per_layer * layers
        for node in folded.find(GroupedMatmulPanels):
            w = folded.node(node.operands[1].node).op
            assert isinstance(w, Param) and w.name in prepared_names(folded) and w.type.shape[3] == 64
        _assert_same_outputs(checker, checkpoint, raw, folded, want)


def _unfused_and_fused(checkpoint, dtype: str | None = None):
    """The checkpoint's params, a checker of its unoptimized graph, the reference outputs, and the candidates (the
    unoptimized graph, 2 expert products a layer; the swiglu-fused one, 1)."""
    from qcompile.passes.base import PassContext
    from qcompile.passes.equivalence import EquivalenceChecker
    from qcompile.passes.manager import run_pipeline
    from qcompile.passes.registry import parse_spec

    graph = build_graph(checkpoint, dtype)
    raw = load_params(checkpoint, graph, progress=False)
    checker = EquivalenceChecker(graph, raw)
    fused = run_pipeline(graph, parse_spec("swiglu-fusion"), PassContext(), verify_mode="none").graph
    return raw, checker, checker.outputs(graph, "reference"), ((graph, 2), (fused, 1))


def _folded_outputs(checker, checkpoint, raw, folded) -> dict:
    """The folded cpu build's outputs on the checker's batch, comparable with the checker's reference outputs."""
    from qcompile.passes.equivalence import outputs_by_item, run_graph

    prepared = load_params(checkpoint, folded, progress=False, loaded=raw)
    return outputs_by_item(checker.comparable(folded, run_graph(folded, prepared, checker.caches, checker.batch,
                                                                "cpu")), checker.rows)


def _assert_same_outputs(checker, checkpoint, raw, folded, want) -> None:
    """Every output of the folded cpu build within 1e-5 (relative to its largest magnitude) of `want` (f32)."""
    got = _folded_outputs(checker, checkpoint, raw, folded)
    for key in want:
        scale = max(float(np.abs(want[key]).max()), 1e-30)
        assert np.abs(np.asarray(got[key], np.float64) - want[key]).max() / scale < 1e-5, key


def test_expert_panel_weights_stream_in_slabs_of_experts(tmp_path):
    """The expert panel recipe (the importer's transpose, a reshape keeping axis 0, a transpose keeping it) is row-wise
    over the experts: slabs of experts read only their own experts' rows and together equal the whole packed weight."""
    import copy

    import jax.numpy as jnp

    from qcompile.frontend.tiny import full_config, write_checkpoint
    from qcompile.ir.weights import weight_pieces

    config = copy.deepcopy(full_config("tiny", "qwen3_5_moe", "f32"))
    config["text_config"].update(num_hidden_layers=1, layer_types=["full_attention"], moe_intermediate_size=64)
    checkpoint = Checkpoint.open(write_checkpoint(tmp_path / "m", config, seed=2))
    folded = fold_weight_preparation(build_graph(checkpoint), "cpu")
    name = next(n for n in prepared_names(folded) if "reshape" in folded.meta["prepared"][n]
                and len(param_types_of(folded)[n].shape) == 4)
    experts, panels, k, width = param_types_of(folded)[name].shape
    pieces = list(weight_pieces(checkpoint, folded, name, piece_bytes=3 * panels * k * width * 4))
    assert len(pieces) == -(-experts // 3) > 1 and all(p.shape[0] <= 3 for p in pieces)
    whole = np.concatenate(pieces)
    source = next(s for s in checkpoint.params if "experts" in s and s in folded.meta["prepared"][name])
    stacked = np.asarray(checkpoint.load(source))  # [E, Nout, K] as the checkpoint stores it
    want = jnp.asarray(stacked).transpose(0, 2, 1).reshape(experts, k, panels, width).transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(whole, np.asarray(want))


def param_types_of(graph):
    from qcompile.ir.weights import param_types

    return param_types(graph)


def _fp8_tiny(tmp_path):
    """A two-layer FP8 tiny checkpoint (Qwen's 128 x 128 blocks) with moe_intermediate_size 128: gate and up split out
    of the stored gate_up_proj on a block edge, so their blocks stay 128 columns wide (two panels)."""
    import copy

    from qcompile.frontend.tiny import full_config, write_checkpoint

    config = copy.deepcopy(full_config("tiny", "qwen3_5_moe", "fp8"))
    config["text_config"].update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                 moe_intermediate_size=128)
    return Checkpoint.open(write_checkpoint(tmp_path / "m", config, seed=7))


def test_fp8_experts_stay_fp8_in_panels_and_compute_the_same_logits(tmp_path):
    """An FP8 checkpoint (Qwen's 128 x 128 blocks) with moe_intermediate_size 128, computed in f32: the routed experts
    become grouped_matmul_panels over FP8 panels — prepared values f8e4m3[E, P, K, 64] and their scale, dequantized
    in the step (the kernel reads one byte a weight), the 128-column blocks split into pairs of panels — unfused and
    swiglu-fused; so do the dense FP8 projections (linear_panels over FP8 [P, K, 64]); the folded cpu build's logits
    match the unoptimized graph's reference rules."""

    from qcompile.ir.ops.moe import GroupedMatmulPanels
    from qcompile.ir.ops.quant import Dequantize

    checkpoint = _fp8_tiny(tmp_path)
    raw, checker, want, candidates = _unfused_and_fused(checkpoint, "f32")
    for candidate, panels_per_layer in candidates:
        folded = fold_weight_preparation(candidate, "cpu")
        verify(folded)
        nodes = folded.find(GroupedMatmulPanels)
        assert len(nodes) == panels_per_layer * 2
        for node in nodes:
            dq = folded.node(node.operands[1].node)
            assert isinstance(dq.op, Dequantize) and dq.op.block[1:] == (2, 128, 64)  # K = 96: one block of rows
            values = folded.node(dq.operands[0].node).op
            assert isinstance(values, Param) and values.type.dtype == "f8e4m3" and values.type.shape[3] == 64
        # the dense FP8 projections whose N is a multiple of 64 (in_proj_qkv, q/k/v/o...) read FP8 panels too
        fp8_linears = [n for n in folded.find(LinearPanels)
                       if isinstance(folded.node(n.operands[1].node).op, Dequantize)]
        assert len(fp8_linears) >= 4 and not [n for n in folded.find(Linear)
                                              if isinstance(folded.node(n.operands[1].node).op, Dequantize)
                                              and folded.type_of(n.results[0]).shape[-1] % 64 == 0]
        _assert_same_outputs(checker, checkpoint, raw, folded, want)


def test_fp8_panels_in_a_bf16_graph(tmp_path):
    """The same FP8 checkpoint in its own compute dtype (bf16, as Qwen's FP8 releases declare): experts and dense
    projections read FP8 panels (each weight rounded to bf16 in the kernel, as the reference's dequantize rounds it),
    and the folded cpu build passes the bf16 check against the reference rules (the class bound, widened to 3 x the
    unoptimized graph's own rounding noise as every bf16 check is)."""

    from qcompile.ir.ops.moe import GroupedMatmulPanels
    from qcompile.ir.ops.quant import Dequantize
    from qcompile.passes.equivalence import EquivalenceChecker, compare

    checkpoint = _fp8_tiny(tmp_path)
    graph = build_graph(checkpoint)
    assert graph.meta["dtype"] == "bf16"
    raw = load_params(checkpoint, graph, progress=False)
    checker = EquivalenceChecker(graph, raw, target="cpu")
    folded = fold_weight_preparation(graph, "cpu")
    verify(folded)
    fp8_reads = [n for n in (*folded.find(GroupedMatmulPanels), *folded.find(LinearPanels))
                 if isinstance(folded.node(n.operands[1].node).op, Dequantize)]
    assert len(folded.find(GroupedMatmulPanels)) == 4 and len(fp8_reads) >= 8
    result = compare(checker.reference_outputs, _folded_outputs(checker, checkpoint, raw, folded), 3e-2,
                     noise=checker.noise)
    assert result.ok, result.reason
