"""FP8 weights kept FP8: in the graph (f8e4m3 values, a block scale, a dequantize where used), in memory, in the
artifact, through weight preparation (layout ops applied to values and scales, ir/fp8_layout.py), through the passes
and the mesh layout, and in `plan`. Fidelity against transformers is tests/test_fp8.py (it runs the kept path); the
rules that read FP8 weights are compared with the reference in tests/test_target_rules.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from qcompile.frontend.checkpoint import Checkpoint
from qcompile.frontend.safetensors_io import TensorStore
from qcompile.frontend.tiny import write_tiny
from qcompile.ir.abi import CacheConfig
from qcompile.ir.builder import Builder
from qcompile.ir.fp8_layout import kept_dequantizes, sink_dequantize
from qcompile.ir.ops.core import Concat, Param, Reshape, Transpose
from qcompile.ir.ops.quant import Dequantize
from qcompile.ir.printer import print_graph
from qcompile.ir.types import TensorType
from qcompile.ir.weights import fold_weight_preparation
from qcompile.runtime.model import load_model

PROMPT = [5, 9, 14, 3, 27, 8, 11]


@pytest.fixture(scope="module")
def fp8_tiny(tmp_path_factory):
    """The tiny Qwen3.5 preset in Qwen's FP8 format (128 x 128 blocks; bf16 where Qwen keeps bf16)."""
    return write_tiny(tmp_path_factory.mktemp("fp8w") / "m", dtype="fp8")


def _fp8(b: Builder, name: str, shape, block, scale_shape, dtype="f32"):
    w = b.param(name, TensorType("f8e4m3", shape))
    s = b.param(name + ".fp8_scale", TensorType("f32", scale_shape))
    return b.add(Dequantize(block, dtype), w, s)


def _body(graph) -> list[str]:
    return [line.strip() for line in print_graph(graph, "g").splitlines()[1:-1]]


def test_layout_ops_sink_to_the_fp8_values_and_scales():
    """Golden: the importer's expert transposes and swiglu-fusion's concat of gate | up become layout ops on the FP8
    values and on the scales, under one dequantize; a concat whose first operand ends inside a block refines the
    scale along that axis first (to blocks of gcd(16, 40) = 8); a reshape does not sink, so that dequantize is not kept (folded at compile time)."""
    b = Builder()
    gate = b.add(Transpose((0, 2, 1)), _fp8(b, "gate", (4, 256, 64), (1, 128, 128), (4, 2, 1)))
    up = b.add(Transpose((0, 2, 1)), _fp8(b, "up", (4, 256, 64), (1, 128, 128), (4, 2, 1)))
    b.output("fused", b.add(Concat(2), gate, up))
    b.output("cut", b.add(Concat(0), _fp8(b, "a", (40, 64), (16, 64), (3, 1)), _fp8(b, "c", (40, 64), (16, 64), (3, 1))))
    b.output("flat", b.add(Reshape((2560,)), _fp8(b, "r", (40, 64), (16, 64), (3, 1))))
    graph = b.build({})
    assert _body(sink_dequantize(graph)) == [
        '%0 = param "gate" : f8e4m3[4,256,64]',
        '%1 = param "gate.fp8_scale" : f32[4,2,1]',
        '%2 = transpose(%0) {perm=[0, 2, 1]} : f8e4m3[4,64,256]',
        '%3 = transpose(%1) {perm=[0, 2, 1]} : f32[4,1,2]',
        '%4 = param "up" : f8e4m3[4,256,64]',
        '%5 = param "up.fp8_scale" : f32[4,2,1]',
        '%6 = transpose(%4) {perm=[0, 2, 1]} : f8e4m3[4,64,256]',
        '%7 = transpose(%5) {perm=[0, 2, 1]} : f32[4,1,2]',
        '%8 = concat(%2, %6) {axis=2} : f8e4m3[4,64,512]',
        '%9 = concat(%3, %7) {axis=2} : f32[4,1,4]',
        '%10 = param "a" : f8e4m3[40,64]',
        '%11 = param "a.fp8_scale" : f32[3,1]',
        '%12 = param "c" : f8e4m3[40,64]',
        '%13 = param "c.fp8_scale" : f32[3,1]',
        '%14 = refine_scale(%11) {axis=0, block=16, size=40, to=8} : f32[5,1]',
        '%15 = refine_scale(%13) {axis=0, block=16, size=40, to=8} : f32[5,1]',
        '%16 = concat(%10, %12) {axis=0} : f8e4m3[80,64]',
        '%17 = concat(%14, %15) {axis=0} : f32[10,1]',
        '%18 = param "r" : f8e4m3[40,64]',
        '%19 = param "r.fp8_scale" : f32[3,1]',
        '%20 = dequantize(%18, %19) {block=[16, 64], dtype="f32"} : f32[40,64]',
        '%21 = reshape(%20) {shape=[2560]} : f32[2560]',
        '%22 = dequantize(%8, %9) {block=[1, 128, 128], dtype="f32"} : f32[4,64,512]',
        '%23 = dequantize(%16, %17) {block=[8, 64], dtype="f32"} : f32[80,64]',
        'return fused=%22, cut=%23, flat=%21',
    ]
    sunk = sink_dequantize(graph)
    assert sink_dequantize(sunk) is sunk  # nothing left to sink
    reshaped = next(n for n in sunk.nodes() if isinstance(n.op, Dequantize) and n.op.block == (16, 64))
    assert reshaped.id not in kept_dequantizes(sunk)  # feeds a reshape: a compile-time preparation


def test_the_sunk_graph_computes_the_same_weights():
    """Sinking is exact: every output of the golden graph above, evaluated with the reference rules, is equal."""
    import ml_dtypes

    from qcompile.ir.lowering import lower

    b = Builder()
    gate = b.add(Transpose((0, 2, 1)), _fp8(b, "gate", (2, 40, 24), (1, 16, 8), (2, 3, 3)))
    up = b.add(Transpose((0, 2, 1)), _fp8(b, "up", (2, 40, 24), (1, 16, 8), (2, 3, 3)))
    b.output("fused", b.add(Concat(2), gate, up))  # 40 is not a multiple of 16: the scales are refined
    graph = b.build({})
    rng = np.random.default_rng(0)
    params = {}
    for name in ("gate", "up"):
        params[name] = rng.normal(size=(2, 40, 24)).astype(ml_dtypes.float8_e4m3fn)
        params[name + ".fp8_scale"] = rng.uniform(0.5, 2.0, (2, 3, 3)).astype(np.float32)
    sunk = sink_dequantize(graph)
    assert any(n.op.op_name == "refine_scale" for n in sunk.nodes())
    from qcompile.ir.lowering import _evaluate, _rules  # the rules without lower()'s own sinking

    env: dict = {}
    nodes = list(graph.nodes())
    _evaluate(graph, nodes, _rules(graph, nodes, "reference"), env, params, {})
    want = np.asarray(env[graph.outputs["fused"]])
    got = np.asarray(lower(sunk)(params, {})["fused"])
    np.testing.assert_array_equal(got, want)


def test_fp8_weights_stay_fp8_in_memory(fp8_tiny):
    """Every weight the checkpoint stores in FP8 is an f8e4m3 parameter with a dequantize at its use, kept in the
    step; the device parameters hold 1 byte per such weight (plus scales), against 4 when multiplied out."""
    kept = load_model(fp8_tiny, "f32", progress=False)
    plain = load_model(fp8_tiny, "f32", progress=False, fp8="dequantize")
    checkpoint = Checkpoint.open(fp8_tiny)
    stored = {n for n in checkpoint.params if "fp8" in checkpoint.source_dtypes(n)}
    assert stored and {n.op.name for n in kept.graph.find(Param) if n.op.type.dtype == "f8e4m3"} <= {
        *stored, *kept.graph.meta["prepared"]}
    dequantizes = [n for n in kept.graph.nodes() if isinstance(n.op, Dequantize)]
    assert dequantizes and {n.id for n in dequantizes} == kept_dequantizes(kept.graph)
    assert not any(n.op.op_name == "dequantize" for n in plain.graph.nodes())
    kept_bytes = sum(int(v.nbytes) for v in kept.params.values())
    plain_bytes = sum(int(v.nbytes) for v in plain.params.values())
    fp8_weights = sum(int(np.prod(checkpoint.params[n].shape)) for n in stored)
    # the FP8 weights shrink from 4 bytes to 1 (+ a 4-byte scale per block, here per row where blocks are cut)
    assert plain_bytes - kept_bytes > 2.5 * fp8_weights
    outputs = []
    for model in (kept, plain):
        engine = model.engine(CacheConfig(max_seqs=2, max_context=64))
        outputs.append(engine.step([(engine.add_sequence(), PROMPT)], all_logits=True)[0])
    np.testing.assert_allclose(outputs[0], outputs[1], atol=1e-4 * max(1.0, float(np.abs(outputs[1]).max())))


def test_a_compiled_fp8_artifact_holds_fp8_weights_and_runs(fp8_tiny, tmp_path, capsys):
    """`compile --passes swiglu-fusion -o` on an FP8 checkpoint: the fused [gate | up] expert weight
    is prepared in FP8 (the concat of the two FP8 transposes), the artifact's weights are FP8, and `run ARTIFACT`
    gives the tokens of the checkpoint multiplied out."""
    from qcompile.cli import main

    def run(*argv) -> str:
        with pytest.raises(SystemExit) as done:
            main(list(argv))
        captured = capsys.readouterr()
        assert done.value.code == 0, captured.err
        return captured.out

    art = tmp_path / "art"
    run("compile", str(fp8_tiny), "--dtype", "f32", "--passes", "swiglu-fusion", "--verify", "none", "-o", str(art),
        "--max-seqs", "2", "--max-context", "32", "--max-step-tokens", "8")
    store = TensorStore.open(art / "weights.safetensors")
    dtypes = {store.info(n).dtype for n in store.names()}
    assert "F8_E4M3" in dtypes
    graph_text = (art / "graph.qir").read_text()
    fused = [line for line in graph_text.splitlines() if "grouped_matmul_swiglu(" in line]
    assert fused and all("f32[" in line for line in fused)
    assert "dequantize(" in graph_text and "f8e4m3[8,96,80]" in graph_text  # [E, H, 2I] prepared in FP8
    manifest = json.loads((art / "manifest.json").read_text())
    assert {"qcompile_grouped_matmul_swiglu_fp8", "qcompile_linear_fp8"} <= set(manifest["native_kernels"])
    tokens = [int(t) for t in run("run", str(art), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "6").split(",")]
    plain = load_model(fp8_tiny, "f32", progress=False, fp8="dequantize")
    engine = plain.engine(CacheConfig(max_seqs=2, max_context=64))
    seq, want = engine.add_sequence(), []
    step = [5, 6, 7, 8]
    for _ in range(6):
        want += engine.step_tokens([(seq, step)])
        step = [want[-1]]
    assert tokens == want
    plain_bytes = sum(int(v.nbytes) for v in plain.params.values())
    assert (art / "weights.safetensors").stat().st_size < 0.5 * plain_bytes


def test_a_split_fp8_weight_splits_its_values_and_scales():
    """Golden: tensor parallelism's regrouping of an FP8 weight (row slices, one concat: passes/rewrite.py
    `regroup_rows`) and its split over the mesh apply to the values and the scales. Cuts inside a 128-row block (the
    64-row pieces) make the scale as fine as they need first (blocks of 64; one refine_scale for every slice); a
    split whose device share ends on block edges keeps whole blocks (o: 256 of 512 columns per device); one whose
    share ends inside a block (z: 96 of 192 rows) refines to gcd(128, 96) = 32 rows first."""
    import attrs

    from qcompile.ir.mesh import parse_mesh_spec
    from qcompile.ir.types import Sharding
    from qcompile.passes.rewrite import regroup_rows

    mesh = parse_mesh_spec("2")
    b = Builder()
    qkv = regroup_rows(b, _fp8(b, "qkv", (384, 64), (128, 64), (3, 1)), (128, 128, 128), 2)
    b.annotate(qkv, Sharding(("tensor", None)))
    o = _fp8(b, "o", (64, 512), (64, 128), (1, 4))
    b.annotate(o, Sharding((None, "tensor")))
    z = _fp8(b, "z", (192, 64), (128, 64), (2, 1))
    b.annotate(z, Sharding(("tensor", None)))
    for name, value in (("qkv", qkv), ("o", o), ("z", z)):
        b.output(name, value)
    graph = b.build({"mesh": attrs.evolve(mesh, rules={"tensor": tuple(mesh.axes)})})
    body = _body(sink_dequantize(graph))[1:]  # after the mesh line
    assert body[:3] == ['%0 = param "qkv" : f8e4m3[384,64]', '%1 = param "qkv.fp8_scale" : f32[3,1]',
                        '%2 = refine_scale(%1) {axis=0, block=128, size=384, to=64} : f32[6,1]']
    assert body[3:5] == ['%3 = slice(%0) {axis=0, start=0, stop=64} : f8e4m3[64,64]',
                         '%4 = slice(%2) {axis=0, start=0, stop=1} : f32[1,1]']
    assert body[15:] == [
        '%15 = concat(%3, %5, %7, %9, %11, %13) {axis=0} : f8e4m3[384,64]<tensor,_>',
        '%16 = concat(%4, %6, %8, %10, %12, %14) {axis=0} : f32[6,1]<tensor,_>',
        '%17 = param "o" : f8e4m3[64,512]<_,tensor>',
        '%18 = param "o.fp8_scale" : f32[1,4]<_,tensor>',
        '%19 = param "z" : f8e4m3[192,64]<tensor,_>',
        '%20 = param "z.fp8_scale" : f32[2,1]',
        '%21 = dequantize(%15, %16) {block=[64, 64], dtype="f32"} : f32[384,64]<tensor,_>',
        '%22 = dequantize(%17, %18) {block=[64, 128], dtype="f32"} : f32[64,512]<_,tensor>',
        '%23 = refine_scale(%20) {axis=0, block=128, size=192, to=32} : f32[6,1]<tensor,_>',
        '%24 = dequantize(%19, %23) {block=[32, 64], dtype="f32"} : f32[192,64]<tensor,_>',
        'return qkv=%21, o=%22, z=%24',
    ]
    # the regrouped order: device 0 holds rows 0-63 of each section, device 1 rows 64-127
    assert [line.split("start=")[1].split(",")[0] for line in body[3:15:2]] == ["0", "128", "256", "64", "192", "320"]


def test_fp8_weights_on_a_mesh(fp8_tiny):
    """gqa-sharding lays an FP8 graph out dp4×tp2 on 4x2 (expert values and scales split by expert; the projections
    split by heads, the GDN q|k|v projection regrouped first; swiglu-fusion and gdn-conv-fusion on the laid-out
    weights), checked on the simulated mesh against the single-device graph; every prepared weight stays FP8 on its
    devices and every dequantize stays in the step (in the matmul rules)."""
    from qcompile.ir.graph import Graph
    from qcompile.ir.mesh import parse_mesh_spec
    from qcompile.passes.base import PassContext
    from qcompile.passes.equivalence import EquivalenceChecker
    from qcompile.passes.registry import PASSES

    model = load_model(fp8_tiny, "f32", progress=False, layout=False)  # the checkpoint's layout, as passes see it
    graph = Graph(model.graph.dag, model.graph.outputs, {**model.graph.meta, "mesh": parse_mesh_spec("4x2")})
    checker = EquivalenceChecker(graph, model.params, seed=3, target="cpu")
    result = PASSES["gqa-sharding"].run(graph, PassContext(options=(("concurrency", 8), ("layout", "dp4xtp2"))))
    assert result.stats["plan"] == "dp4xtp2+ep"
    laid_out = result.graph
    for name in ("swiglu-fusion", "gdn-conv-fusion"):
        laid_out = PASSES[name].run(laid_out, PassContext()).graph
    sunk = sink_dequantize(laid_out)
    dequantizes = [n for n in sunk.nodes() if isinstance(n.op, Dequantize)]
    assert dequantizes and {n.id for n in dequantizes} == kept_dequantizes(sunk)
    splits = {str(sunk.type_of(n.operands[0]).sharding) for n in dequantizes}  # FP8 values, by device
    assert {"<tensor,_>", "<_,tensor>", "<experts,_,_>"} <= splits, splits
    folded = fold_weight_preparation(laid_out)
    prepared = [n.op.type for n in folded.find(Param) if n.op.name in folded.meta["prepared"]]
    assert any(t.dtype == "f8e4m3" and str(t.sharding) == "<tensor,_>" for t in prepared)  # regrouped q|k|v, gate|up
    text = print_graph(laid_out)
    assert "linear_swiglu(" in text and "groups=2" in text
    check = checker.check(laid_out, PASSES["gqa-sharding"].bound("f32"))
    assert check.ok, check.reason
    assert {"logits", "layers.0.conv_state", "layers.3.k_pages"} <= set(check.errors)


def test_a_fp8_config_is_planned_with_fp8_weights():
    """`plan` of the FP8 flagship config: the routed experts at 1 byte a weight (and a scale per 128 x 128 block),
    about half the bf16 config's bytes per device."""
    from pathlib import Path

    from qcompile.compiler.plan import abstract_graph
    from qcompile.ir.weights import fold_weight_preparation as fold

    examples = Path(__file__).resolve().parents[1] / "examples" / "configs"
    graph, _, _ = abstract_graph(examples / "qwen3.5-397b-a17b-fp8.json")
    folded = fold(graph)
    experts = [n.op for n in folded.find(Param) if ".experts." in n.op.name
               or n.op.name in folded.meta.get("prepared", {}) and ".experts." in folded.meta["prepared"][n.op.name]]
    values = sum(int(np.prod(p.type.shape)) for p in experts if p.type.dtype == "f8e4m3")
    scales = sum(int(np.prod(p.type.shape)) for p in experts if p.type.dtype == "f32")
    assert values == 512 * 3 * 1024 * 4096 * 60
    assert scales == 512 * 3 * (1024 // 128) * (4096 // 128) * 60
    assert not [p for p in experts if p.type.dtype not in ("f8e4m3", "f32")]


def test_compile_rejects_an_unknown_fp8_mode(fp8_tiny, capsys):
    from qcompile.cli import main

    with pytest.raises(SystemExit) as done:
        main(["compile", str(fp8_tiny), "--fp8", "int4"])
    assert done.value.code == 2 and "--fp8" in capsys.readouterr().err


def test_fold_keeps_prepared_fp8_weights_fp8(fp8_tiny):
    """Weight preparation of an FP8 checkpoint makes FP8 prepared weights (the expert transposes) and their scales."""
    from qcompile.ir.importer import build_graph

    folded = fold_weight_preparation(build_graph(Checkpoint.open(fp8_tiny), "f32"))
    recipes = folded.meta["prepared"]
    prepared = {n.op.name: n.op.type for n in folded.find(Param) if n.op.name in recipes}
    assert any(t.dtype == "f8e4m3" for t in prepared.values())
    assert any(t.dtype == "f32" and "fp8_scale" in recipes[name] for name, t in prepared.items())


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_the_pallas_grouped_matmul_reads_fp8_tiles(dtype):
    """The tpu rule's FP8 kernel (interpreted here) equals the reference on the dequantized weight — ragged groups, an
    empty one, padding rows (which come back 0) — and lowers for TPU (a Mosaic custom call in the export); a weight
    whose blocks are not the kernel's tiles is dequantized before the bf16/f32 kernel instead."""
    import jax
    import jax.numpy as jnp
    from jax import export
    from test_target_rules import quantized

    from qcompile.kernels import pallas_gmm
    from qcompile.kernels.fp8 import QuantizedWeight, dequantize
    from qcompile.kernels.grouped_matmul import grouped_matmul_swiglu_reference

    jdtype = jnp.float32 if dtype == "f32" else jnp.bfloat16
    rng = np.random.default_rng(7)
    values, scale = quantized(rng.standard_normal((4, 256, 256)), (1, 128, 128))
    rows = jnp.asarray(rng.standard_normal((40, 256)), jdtype)
    groups = jnp.asarray([7, 0, 20, 9], jnp.int32)  # 36 routed rows of 40
    want = np.asarray(grouped_matmul_swiglu_reference(
        rows, dequantize(jnp.asarray(values), jnp.asarray(scale), (1, 128, 128), jdtype), groups), np.float64)
    rule = jax.jit(lambda r, v, s, g: pallas_gmm.gmm_swiglu_tpu(r, QuantizedWeight(v, s, (1, 128, 128), jdtype), g))
    got = np.asarray(rule(rows, values, scale, groups), np.float64)
    np.testing.assert_allclose(got[:36], want[:36], rtol=0, atol=1e-6 * np.abs(want).max())
    assert not got[36:].any()
    assert pallas_gmm.fp8_tiles_fit(values.shape, (1, 128, 128)) and not pallas_gmm.fp8_tiles_fit(values.shape,
                                                                                                   (1, 16, 128))
    exported = export.export(jax.jit(lambda r, v, s, g: pallas_gmm.gmm_swiglu_fp8_pallas(r, v, s, g)),
                             platforms=["tpu"])(rows, values, scale, groups)
    text = exported.mlir_module()
    assert "tpu_custom_call" in text and "f8E4M3FN" in text  # the FP8 bytes go into the kernel


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_the_pallas_down_projection_reads_fp8_tiles(dtype):
    """grouped_matmul's tpu rule on an FP8 [E, I, H] weight in Qwen's layout runs gmm_fp8_pallas (interpreted here):
    equal to ragged_dot on the dequantized weight over ragged groups with an empty one, every routed row written
    (the output is compared whole, NaN-free), padding rows 0; it exports for TPU as a Mosaic call on FP8 operands;
    a layout that is not the kernel's tiles goes to ragged_dot on the dequantized weight."""
    import jax
    import jax.numpy as jnp
    from jax import export
    from test_target_rules import quantized

    from qcompile.ir.ops.moe import GroupedMatmul
    from qcompile.ir.registry import lowering_rule
    from qcompile.kernels import pallas_gmm
    from qcompile.kernels.fp8 import QuantizedWeight, dequantize
    from qcompile.kernels.grouped_matmul import grouped_matmul_reference

    jdtype = jnp.float32 if dtype == "f32" else jnp.bfloat16
    rng = np.random.default_rng(11)
    rule = lowering_rule(GroupedMatmul, "tpu")
    rows = jnp.asarray(rng.standard_normal((45, 256)), jdtype)
    groups = jnp.asarray([12, 0, 21, 5], jnp.int32)  # 38 routed rows of 45: row tiles straddle the groups
    for block, shape in (((1, 128, 128), (4, 256, 384)), ((1, 64, 128), (4, 256, 384))):
        values, scale = quantized(rng.standard_normal(shape), block)
        want = np.asarray(grouped_matmul_reference(
            rows, dequantize(jnp.asarray(values), jnp.asarray(scale), block, jdtype), groups), np.float64)
        got = np.asarray(jax.jit(lambda r, v, s, g: rule(GroupedMatmul(), r, QuantizedWeight(v, s, block, jdtype), g))(
            rows, values, scale, groups), np.float64)
        assert np.isfinite(got).all() and np.abs(want[:38]).min(axis=1).max() > 0
        tolerance = (1e-6 if dtype == "f32" else 1e-2) * np.abs(want).max()
        np.testing.assert_allclose(got[:38], want[:38], rtol=0, atol=tolerance)
        assert not got[38:].any()
        text = export.export(jax.jit(lambda r, v, s, g: rule(GroupedMatmul(), r, QuantizedWeight(v, s, block, jdtype),
                                                             g)), platforms=["tpu"])(rows, values, scale, groups)
        text = text.mlir_module()
        assert ("tpu_custom_call" in text) == (block == (1, 128, 128)) and "f8E4M3FN" in text
    assert pallas_gmm.fp8_tiles_fit((4, 256, 384), (1, 128, 128), fused=False)
    assert not pallas_gmm.fp8_tiles_fit((4, 256, 384), (1, 128, 128))  # as [gate | up]: 192 is no tile multiple


def test_bench_refuses_to_compare_transformers_on_an_fp8_checkpoint(fp8_tiny, capsys):
    """transformers' FP8 loader needs accelerate and a GPU: a one-line usage error before any work, not a traceback
    after the qcompile measurement."""
    from qcompile.cli import main

    with pytest.raises(SystemExit) as done:
        main(["bench", str(fp8_tiny), "--concurrency", "1", "--compare", "transformers"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "cannot run this FP8 checkpoint" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_the_pallas_linear_reads_fp8_tiles(dtype):
    """The tpu rules of linear, linear_swiglu and linear_f32 (f32 partial sums) on an FP8 [N, K] weight in Qwen's
    layout run linear_fp8_pallas (interpreted here): equal to the reference on the dequantized weight, rows with
    leading dims and a row count that is no tile multiple; the tpu export holds a Mosaic call on FP8 operands;
    another layout is XLA's dot."""
    import jax
    import jax.numpy as jnp
    from jax import export
    from test_target_rules import quantized

    from qcompile.ir.ops.core import Linear, LinearF32, LinearSwiglu
    from qcompile.ir.registry import lowering_rule
    from qcompile.kernels.fp8 import QuantizedWeight, dequantize

    jdtype = jnp.float32 if dtype == "f32" else jnp.bfloat16
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((3, 5, 256)), jdtype)
    tolerance = 1e-6 if dtype == "f32" else 1e-2
    for op in (Linear(), LinearSwiglu(), LinearF32()):
        for block in ((128, 128), (64, 128)):
            values, scale = quantized(rng.standard_normal((384, 256)), block)
            weight = dequantize(jnp.asarray(values), jnp.asarray(scale), block, jdtype)
            want = np.asarray(lowering_rule(type(op), "reference")(op, x, weight), np.float64)
            rule = jax.jit(lambda x, v, s: lowering_rule(type(op), "tpu")(op, x, QuantizedWeight(v, s, block, jdtype)))
            got = np.asarray(rule(x, values, scale), np.float64)
            assert got.shape == want.shape and np.isfinite(got).all()
            assert rule(x, values, scale).dtype == (jnp.float32 if isinstance(op, LinearF32) else jdtype)
            np.testing.assert_allclose(got, want, rtol=0, atol=tolerance * np.abs(want).max())
            text = export.export(rule, platforms=["tpu"])(x, values, scale).mlir_module()
            assert ("tpu_custom_call" in text) == (block == (128, 128)) and "f8E4M3FN" in text
