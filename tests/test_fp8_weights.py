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
    scale along that axis first; a reshape does not sink, so that dequantize is not kept (folded at compile time)."""
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
        '%14 = refine_scale(%11) {axis=0, block=16, size=40} : f32[40,1]',
        '%15 = refine_scale(%13) {axis=0, block=16, size=40} : f32[40,1]',
        '%16 = concat(%10, %12) {axis=0} : f8e4m3[80,64]',
        '%17 = concat(%14, %15) {axis=0} : f32[80,1]',
        '%18 = param "r" : f8e4m3[40,64]',
        '%19 = param "r.fp8_scale" : f32[3,1]',
        '%20 = dequantize(%18, %19) {block=[16, 64], dtype="f32"} : f32[40,64]',
        '%21 = reshape(%20) {shape=[2560]} : f32[2560]',
        '%22 = dequantize(%8, %9) {block=[1, 128, 128], dtype="f32"} : f32[4,64,512]',
        '%23 = dequantize(%16, %17) {block=[1, 64], dtype="f32"} : f32[80,64]',
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


def test_fp8_weights_on_a_mesh(fp8_tiny):
    """gqa-sharding lays an FP8 graph out data- and expert-parallel (values and scales split by expert), checked on
    the simulated mesh; a tensor-parallel plan says why it cannot be laid out."""
    from qcompile.ir.mesh import parse_mesh_spec
    from qcompile.passes.base import PassContext
    from qcompile.passes.equivalence import EquivalenceChecker
    from qcompile.passes.registry import PASSES

    model = load_model(fp8_tiny, "f32", progress=False)
    model.graph.meta["mesh"] = parse_mesh_spec("2")
    checker = EquivalenceChecker(model.graph, model.params, seed=3)
    result = PASSES["gqa-sharding"].run(model.graph, PassContext(options=(("concurrency", 8),)))
    assert result.stats["plan"] == "dp2+ep"
    from qcompile.passes.gqa_sharding import model_facts, tp_problem

    assert "keeps FP8 weights" in tp_problem(model.graph, model_facts(model.graph), model.graph.meta["mesh"], 2)
    from qcompile.ir.ops.moe import GroupedMatmul

    graph = result.graph
    weights = [graph.node(n.operands[1].node) for n in graph.find(GroupedMatmul)]
    assert weights and all(isinstance(w.op, Dequantize) for w in weights)
    for w in weights:  # values and scale split by expert
        for operand in w.operands:
            sharding = graph.type_of(operand).sharding
            assert sharding is not None and sharding.dims[0] == "experts", graph.type_of(operand)
    check = checker.check(result.graph, PASSES["gqa-sharding"].bound("f32"))
    assert check.ok, check.reason


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


def test_bench_refuses_to_compare_transformers_on_an_fp8_checkpoint(fp8_tiny, capsys):
    """transformers' FP8 loader needs accelerate and a GPU: a one-line usage error before any work, not a traceback
    after the qcompile measurement."""
    from qcompile.cli import main

    with pytest.raises(SystemExit) as done:
        main(["bench", str(fp8_tiny), "--concurrency", "1", "--compare", "transformers"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "cannot run this FP8 checkpoint" in err and len(err.strip().splitlines()) == 1
