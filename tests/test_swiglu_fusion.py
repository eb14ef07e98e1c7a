"""The swiglu-fusion pass: what it rewrites, that the checker holds it to the reassociating bound, that a fused
weight in the wrong order is caught, and that its kernels match a float64 oracle."""

from __future__ import annotations

import json

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qcompile.errors import NumericsError
from qcompile.frontend.checkpoint import Checkpoint
from qcompile.ir.importer import build_graph
from qcompile.ir.ops.attention import PagedAttention
from qcompile.ir.ops.core import Activation, Concat, Linear, LinearSwiglu
from qcompile.ir.ops.gdn import GdnRecurrence
from qcompile.ir.ops.moe import GroupedMatmul, GroupedMatmulSwiglu
from qcompile.ir.verifier import verify
from qcompile.ir.weights import fold_weight_preparation, load_params
from qcompile.kernels import grouped_matmul as gm
from qcompile.kernels import native
from qcompile.kernels import pallas_gmm as pl_gmm
from qcompile.passes.base import PassContext, PassResult
from qcompile.passes.equivalence import EquivalenceChecker, structural_hash
from qcompile.passes.manager import run_pipeline
from qcompile.passes.registry import PASSES
from qcompile.passes.rewrite import rewrite
from qcompile.passes.swiglu_fusion import SWIGLU_FUSION


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def model(request, tmp_path_factory):
    from conftest import write_small

    path = write_small(tmp_path_factory.mktemp(request.param) / "m", family=request.param, seed=5)
    ckpt = Checkpoint.open(path)
    graph = build_graph(ckpt)  # unfolded, as the compile driver checks passes
    return path, graph, EquivalenceChecker(graph, load_params(ckpt, graph, progress=False), seed=0, target="cpu")


def test_it_is_in_the_pipeline():
    assert PASSES["swiglu-fusion"] is SWIGLU_FUSION and SWIGLU_FUSION.tolerance == "reassociating"


def test_every_swiglu_mlp_is_fused(model):
    """Each MoE layer's routed experts and shared expert (and any dense MLP) become one fused op; nothing of the
    unfused form is left: the only grouped matmuls are the down projections, no silu remains, and every fused
    weight is a concat of two parameters-only values (folded into one prepared weight)."""
    _, graph, _ = model
    moe_layers = len(graph.find(GroupedMatmul)) // 3
    silu = [n for n in graph.find(Activation) if n.op.fn == "silu"]
    result = SWIGLU_FUSION.run(graph, PassContext())
    new = result.graph
    verify(new)
    assert result.changed and result.stats == {"routed_experts": moe_layers, "dense": len(silu) - moe_layers}
    assert len(new.find(GroupedMatmulSwiglu)) == moe_layers and len(new.find(GroupedMatmul)) == moe_layers
    assert len(new.find(LinearSwiglu)) == len(silu) - moe_layers > 0
    assert not [n for n in new.find(Activation) if n.op.fn == "silu"]
    assert len(new.find(Linear)) == len(graph.find(Linear)) - 2 * (len(silu) - moe_layers)
    assert len(new.find(Concat)) == len(silu)
    folded = fold_weight_preparation(new)
    assert not folded.find(Concat)  # every fused weight is prepared once, not concatenated per step


def test_pure_and_idempotent(model):
    _, graph, _ = model
    before = structural_hash(graph)
    once = SWIGLU_FUSION.run(graph, PassContext())
    assert structural_hash(graph) == before
    twice = SWIGLU_FUSION.run(once.graph, PassContext())
    assert not twice.changed and twice.graph is once.graph and twice.skipped


def test_checked_within_the_reassociating_bound(model):
    """The checker (cpu rules: the native fused kernel) against the unoptimized graph on reference rules."""
    _, graph, checker = model
    result = run_pipeline(graph, [SWIGLU_FUSION], PassContext(), checker=checker)
    (record,) = result.records
    assert record.status == "applied" and record.check["max_error"] <= 1e-5
    assert result.final_check.ok


def _swapped_fusion(graph, ctx):
    """BROKEN on purpose: the fused weight as [up | gate] — silu applied to the up projection."""
    fused = SWIGLU_FUSION.run(graph, ctx).graph

    def rule(b, node, ops):
        if isinstance(node.op, Concat):
            return b.add(Concat(node.op.axis), ops[1], ops[0])
        return None

    new, count = rewrite(fused, rule)
    return PassResult(new, count > 0, {"swapped": count})


def test_a_swapped_gate_and_up_is_caught(model):
    _, graph, checker = model
    broken = attrs.evolve(SWIGLU_FUSION, name="swapped-swiglu", run=_swapped_fusion)
    with pytest.raises(NumericsError, match="after pass swapped-swiglu"):
        run_pipeline(graph, [broken], PassContext(), checker=checker)


def test_fused_weights_are_prepared_from_the_checkpoint(model):
    """load_params computes each fused weight from its two checkpoint tensors: experts [E, K, 2I] = [gate | up]
    (each transposed from the checkpoint's [E, I, K]), dense [2I, K] = [gate ; up]."""
    path, graph, _ = model
    fused = fold_weight_preparation(SWIGLU_FUSION.run(graph, PassContext()).graph)
    ckpt = Checkpoint.open(path)
    params = load_params(ckpt, fused, progress=False)
    first_moe = fused.find(GroupedMatmulSwiglu)[0]
    weight = np.asarray(params[fused.node(first_moe.operands[1].node).op.name])
    gate_name = sorted(n for n in ckpt.params if n.endswith("mlp.experts.gate_proj"))[0]
    gate = np.swapaxes(ckpt.load(gate_name), 1, 2)
    up = np.swapaxes(ckpt.load(gate_name.replace("gate_proj", "up_proj")), 1, 2)
    assert np.array_equal(weight, np.concatenate([gate, up], axis=2).astype(weight.dtype))
    first_dense = fused.find(LinearSwiglu)[0]
    weight = np.asarray(params[fused.node(first_dense.operands[1].node).op.name])
    gate_name = sorted(n for n in ckpt.params if n.endswith("shared_expert.gate_proj"))[0]
    up = ckpt.load(gate_name.replace("gate_proj", "up_proj"))
    assert np.array_equal(weight, np.concatenate([ckpt.load(gate_name), up], axis=0).astype(weight.dtype))


def swiglu_oracle(rows, w, gs):
    """silu(x·Wg)·(x·Wu) per group in float64 (groups clipped to ≥ 0 and to the rows that exist); padding rows 0."""
    rows, w = np.asarray(rows, np.float64), np.asarray(w, np.float64)
    half = w.shape[2] // 2
    want, start = np.zeros((rows.shape[0], half)), 0
    for e, g in enumerate(np.asarray(gs)):
        g = min(max(int(g), 0), rows.shape[0] - start)
        y = rows[start:start + g] @ w[e]
        want[start:start + g] = y[:, :half] / (1 + np.exp(-y[:, :half])) * y[:, half:]
        start += g
    return want, start


def _draw(rng, n, e, k, half, negative=True):
    gs = rng.integers(-1 if negative else 0, max(n // 2, 1) + 1, e).astype(np.int32)
    rows = rng.standard_normal((n, k)).astype(np.float32)
    w = (rng.standard_normal((e, k, 2 * half)) / np.sqrt(k)).astype(np.float32)
    return rows, w, gs


def _assert_matches(got, rows, w, gs, what):
    want, total = swiglu_oracle(rows, w, gs)
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, what
    if total and np.abs(want).max() > 0:
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= 1e-5, f"{what}: {err:.2e}"
    assert not got[total:].any(), f"{what}: padding rows must be 0"


@pytest.mark.skipif(not native.ensure(gm.NATIVE_SWIGLU_F32), reason="native kernels unavailable")
def test_native_fused_kernel_and_jnp_rule_match_a_float64_oracle():
    """The native kernel with its epilogue and the jnp CPU rule (the bf16 path, here in f32): random groups (empty,
    negative, past N), padding rows, K split into k blocks, I with panel tails."""
    rng = np.random.default_rng(3)
    for n, e, k, half in ((0, 3, 16, 8), (37, 5, 300, 40), (120, 9, 64, 200), (7, 2, 1, 1)):
        rows, w, gs = _draw(rng, n, e, k, half)
        for name, rule in (("native", gm.grouped_matmul_swiglu_native),
                           ("jnp", lambda *a: gm.swiglu_halves(gm.grouped_matmul_jnp(*a)))):
            got = jax.jit(rule)(jnp.asarray(rows), jnp.asarray(w), jnp.asarray(gs))
            _assert_matches(got, rows, w, gs, f"{name} n={n} e={e} k={k} I={half}")


def test_group_visits_cover_each_tile_and_group_overlap_once():
    """Visits (tile, group): every overlap of a row tile with a non-empty group exactly once, in order; a tile
    without routed rows gets exactly one visit; each tile's first visit is flagged; the rest are invalid."""
    rng = np.random.default_rng(8)
    visits = jax.jit(pl_gmm.group_visits, static_argnums=(1, 2))  # one compile per shape, not one per op and shape
    for _ in range(30):
        n, e, tm = int(rng.integers(1, 90)), int(rng.integers(1, 7)), int(rng.choice([8, 16]))
        gs = rng.integers(-1, 30, e).astype(np.int32)
        (tile, group, first, valid), _ = (tuple(np.asarray(a) for a in part)
                                          for part in visits(jnp.asarray(gs), n, tm))
        sizes = np.clip(gs, 0, None)
        ends = np.minimum(np.cumsum(sizes), n)
        starts = np.concatenate([[0], ends[:-1]])
        want = []
        for t in range(-(-n // tm)):
            hits = [g for g in range(e) if ends[g] > starts[g] and starts[g] < (t + 1) * tm and ends[g] > t * tm]
            want += [(t, g, i == 0) for i, g in enumerate(hits)] or [(t, None, True)]
        got = [(int(t), int(g), bool(f)) for t, g, f, v in zip(tile, group, first, valid) if v]
        assert len(got) == len(want) and len(tile) == -(-n // tm) + e
        for (t, g, f), (wt, wg, wf) in zip(got, want):
            assert t == wt and f == wf and (wg is None or g == wg)


@pytest.mark.parametrize("interpret", ["plain", "tpu"])
def test_pallas_kernel_matches_a_float64_oracle(interpret):
    """The Pallas kernel in Pallas' interpreter (plain, and with TPU semantics: pltpu.InterpretParams) on shapes that
    hit every path: tiles straddling group boundaries, empty and negative groups, rows past Σg, all groups empty,
    K and I not multiples of the block (padded), several k blocks and column blocks, a decode-sized N."""
    from jax.experimental.pallas import tpu as pltpu

    mode = True if interpret == "plain" else pltpu.InterpretParams()
    rng = np.random.default_rng(5)
    for n, e, k, half, tm in ((37, 5, 64, 40, 16), (8, 3, 16, 8, 128), (64, 4, 32, 16, 16), (300, 6, 256, 256, 128),
                              (5, 4, 200, 136, 128), (20, 3, 8, 4, 8)):
        rows, w, gs = _draw(rng, n, e, k, half)
        if n == 8:
            gs[:] = 0
        fn = jax.jit(lambda a, b, c: pl_gmm.gmm_swiglu_pallas(a, b, c, interpret=mode, tm=tm))
        got = fn(jnp.asarray(rows), jnp.asarray(w), jnp.asarray(gs))
        _assert_matches(got, rows, w, gs, f"pallas n={n} e={e} k={k} I={half} tm={tm}")


def test_tpu_rule_exports_the_kernel_for_tpu():
    """Lowered for platform tpu on this host, the tpu rule holds the compiled Pallas kernel (a tpu_custom_call), f32
    and bf16; run here, the same rule interprets it."""
    from jax import export

    rng = np.random.default_rng(2)
    rows, w, gs = _draw(rng, 48, 4, 256, 128, negative=False)
    for dtype in (jnp.float32, jnp.bfloat16):
        args = (jnp.asarray(rows, dtype), jnp.asarray(w, dtype), jnp.asarray(gs))
        exported = export.export(jax.jit(pl_gmm.gmm_swiglu_tpu), platforms=["tpu"])(*args)
        assert "tpu_custom_call" in exported.mlir_module()
    _assert_matches(jax.jit(pl_gmm.gmm_swiglu_tpu)(*(jnp.asarray(a) for a in (rows, w, gs))), rows, w, gs, "tpu rule")


def _mlp_graph(routed: bool, shared_input: bool = True, gate_reused: bool = False):
    """A small SwiGLU MLP: dense (linear) or routed (grouped_matmul over 4 experts)."""
    from qcompile.ir.builder import Builder
    from qcompile.ir.ops.core import Add, Mul
    from qcompile.ir.types import TensorType

    b = Builder()
    x = b.input("x", TensorType("f32", ("N", 8)))
    other = b.input("x2", TensorType("f32", ("N", 8))) if not shared_input else x
    if routed:
        groups = b.input("groups", TensorType("i32", (4,)))
        w = lambda name, k, n: b.param(name, TensorType("f32", (4, k, n)))  # noqa: E731
        gate = b.add(GroupedMatmul(), x, w("experts.gate", 8, 6), groups)
        up = b.add(GroupedMatmul(), other, w("experts.up", 8, 6), groups)
    else:
        gate = b.add(Linear(), x, b.param("mlp.gate_proj", TensorType("f32", (6, 8))))
        up = b.add(Linear(), other, b.param("mlp.up_proj", TensorType("f32", (6, 8))))
    h = b.add(Mul(), b.add(Activation("silu"), gate), up)
    if gate_reused:
        h = b.add(Add(), h, gate)
    b.output("h", h)
    return b.build({"name": "mlp"})


GOLDEN_ROUTED_AFTER = """graph @mlp {
  %0 = input "x" : f32[N,8]
  %1 = input "groups" : i32[4]
  %2 = param "experts.gate" : f32[4,8,6]
  %3 = param "experts.up" : f32[4,8,6]
  %4 = concat(%2, %3) {axis=2} : f32[4,8,12]
  %5 = grouped_matmul_swiglu(%0, %4, %1) : f32[N,6]
  return h=%5
}"""

GOLDEN_DENSE_AFTER = """graph @mlp {
  %0 = input "x" : f32[N,8]
  %1 = param "mlp.gate_proj" : f32[6,8]
  %2 = param "mlp.up_proj" : f32[6,8]
  %3 = concat(%1, %2) {axis=0} : f32[12,8]
  %4 = linear_swiglu(%0, %3) : f32[N,6]
  return h=%4
}"""


@pytest.mark.parametrize("routed, golden", [(True, GOLDEN_ROUTED_AFTER), (False, GOLDEN_DENSE_AFTER)])
def test_golden_before_and_after(routed, golden):
    from qcompile.ir.printer import print_graph

    before = _mlp_graph(routed)
    result = SWIGLU_FUSION.run(before, PassContext())
    assert print_graph(result.graph).strip() == golden
    assert "silu" in print_graph(before) and "mul(" in print_graph(before)


@pytest.mark.parametrize("routed", [True, False])
def test_not_transformed_when_gate_and_up_differ_or_gate_has_another_user(routed):
    """Gate and up over different inputs is not one matmul; a gate projection that something else also reads would
    have to be computed twice."""
    for graph in (_mlp_graph(routed, shared_input=False), _mlp_graph(routed, gate_reused=True)):
        result = SWIGLU_FUSION.run(graph, PassContext())
        assert not result.changed and result.graph is graph and "no SwiGLU MLP" in result.skipped


def test_tpu_export_of_passes_all_holds_one_pallas_kernel_per_moe_and_gdn_layer(tmp_path, capsys):
    """`--passes all --target tpu`: every exported bucket calls the compiled Pallas kernels (Mosaic tpu_custom_calls)
    once per MoE layer (grouped matmul + SwiGLU), once per GDN layer (the fused delta rule) and once per attention
    layer (ragged paged attention) — counted in the serialized programs."""
    from jax import export

    from conftest import write_small
    from test_cli import cli

    path = write_small(tmp_path / "m", family="qwen3_5_moe", seed=6)
    out = tmp_path / "tpu"
    code, _, err = cli(capsys, "--passes", "all", path, "--target", "tpu", "-o", out, "--max-seqs", "2",
                       "--max-context", "32", "--max-step-tokens", "8", "--verify", "none")  # rules: test_target_rules
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    graph = build_graph(Checkpoint.open(path))
    moe_layers = len(graph.find(GroupedMatmul)) // 3
    gdn_layers = len(graph.find(GdnRecurrence))
    attention_layers = len(graph.find(PagedAttention))
    assert moe_layers > 0 and gdn_layers > 0 and attention_layers > 0
    for bucket in manifest["buckets"]:
        program = export.deserialize(bytearray((out / bucket["file"]).read_bytes())).mlir_module()
        assert program.count("@tpu_custom_call") == moe_layers + gdn_layers + attention_layers, bucket["file"]


def test_gate_and_up_of_different_widths_are_not_fused():
    """mul(silu(x·Wg), x·Wu) with Wu one row wide broadcasts: not a SwiGLU MLP (the rule's `when`)."""
    from qcompile.ir.builder import Builder
    from qcompile.ir.ops.core import Mul
    from qcompile.ir.types import TensorType

    b = Builder()
    x = b.input("x", TensorType("f32", ("N", 8)))
    gate = b.add(Linear(), x, b.param("g", TensorType("f32", (6, 8))))
    up = b.add(Linear(), x, b.param("u", TensorType("f32", (1, 8))))
    b.output("h", b.add(Mul(), b.add(Activation("silu"), gate), up))
    graph = b.build({"name": "mlp"})
    result = SWIGLU_FUSION.run(graph, PassContext())
    assert not result.changed and result.graph is graph


def test_patterns_capture_consistently_commute_and_respect_other_users():
    """apply_rules: a repeated capture name must bind one value; an inner node with a user outside the pattern blocks
    the match; rules run to a fixpoint (a rule whose output matches again is applied again)."""
    from qcompile.ir.builder import Builder
    from qcompile.ir.ops.core import Add, Mul
    from qcompile.ir.types import TensorType
    from qcompile.passes.rewrite import Pattern, RewriteRule, apply_rules

    t = TensorType("f32", ("N", 4))
    square = RewriteRule("x+x", "test only: add(x, x) → mul(x, x) (captures must agree)",
                         Pattern(Add, ("x", "x")), lambda b, c: b.add(Mul(), c["x"], c["x"]))
    b = Builder()
    x, y = b.input("x", t), b.input("y", t)
    b.output("same", b.add(Add(), x, x))
    b.output("different", b.add(Add(), x, y))
    graph = b.build({})
    new, fired = apply_rules(graph, [square])
    assert fired == {"x+x": 1} and len(new.find(Mul)) == 1 and len(new.find(Add)) == 1

    right = RewriteRule("reassociate", "(a + b) + c = a + (b + c)",
                        Pattern(Add, (Pattern(Add, ("a", "b")), "c")),
                        lambda b, c: b.add(Add(), c["a"], b.add(Add(), c["b"], c["c"])))
    b = Builder()
    x, y, z, w = (b.input(n, t) for n in "xyzw")
    b.output("chain", b.add(Add(), b.add(Add(), b.add(Add(), x, y), z), w))  # ((x + y) + z) + w
    graph = b.build({})
    new, fired = apply_rules(graph, [right])
    adds = new.find(Add)
    assert fired["reassociate"] >= 2 and len(adds) == 3  # needed a second round: a fixpoint, not one sweep
    assert not any(isinstance(new.node(n.operands[0].node).op, Add) for n in adds)  # x + (y + (z + w))
    nested = RewriteRule("mul-under-add", "(a·b) + c = c + (a·b)",
                         Pattern(Add, (Pattern(Mul, ("a", "b")), "c"), commutative=True),
                         lambda b, c: b.add(Add(), c["c"], b.add(Mul(), c["a"], c["b"])))
    b = Builder()
    x, y, z = b.input("x", t), b.input("y", t), b.input("z", t)
    m = b.add(Mul(), x, y)
    b.output("sum", b.add(Add(), m, z))
    b.output("product", m)                       # the mul has another user: no match
    graph = b.build({})
    assert apply_rules(graph, [nested])[0] is graph
