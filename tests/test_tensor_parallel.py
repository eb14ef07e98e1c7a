"""Tensor parallelism (gqa-sharding's DP×TP plans): the layout, its numerics against the single-device graph, the
collectives XLA compiles, and the mistakes the checks catch.

The small checkpoint has 4 query heads, 2 KV heads, GDN 2 key / 4 value heads, 8 experts: on `--mesh 4x2`, dp4xtp2
splits every head group in two over the inner axis and the experts over all 8 devices; `--mesh 2` with tp2 is tensor
parallelism alone.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from conftest import write_small
from qcompile.errors import UsageError
from qcompile.frontend.checkpoint import Checkpoint
from qcompile.ir.abi import CHANNEL_GROUPS, from_cache_layout, grouped_order, to_cache_layout
from qcompile.ir.graph import Graph
from qcompile.ir.importer import build_graph
from qcompile.ir.mesh import parse_mesh_spec
from qcompile.ir.printer import print_graph
from qcompile.ir.verifier import verify
from qcompile.ir.weights import load_params
from qcompile.passes.base import PassContext
from qcompile.passes.equivalence import EquivalenceChecker
from qcompile.passes.gdn_conv_fusion import GDN_CONV_FUSION
from qcompile.passes.gqa_sharding import GQA_SHARDING, choose, model_facts, plans, tp_problem
from qcompile.passes.moe_allgather_rs import MOE_ALLGATHER_RS
from qcompile.passes.swiglu_fusion import SWIGLU_FUSION


def _on_mesh(graph: Graph, spec: str) -> Graph:
    return Graph(graph.dag, graph.outputs, {**graph.meta, "mesh": parse_mesh_spec(spec)})


def _tp(graph: Graph, spec: str, layout: str, gathered: bool = False, fused: bool = False) -> Graph:
    result = GQA_SHARDING.run(_on_mesh(graph, spec), PassContext(options=(
        ("concurrency", 8), ("max_context", 64), ("layout", layout))))
    assert result.changed and result.stats["plan"] == layout + "+ep"
    laid_out = result.graph
    if gathered:
        laid_out = MOE_ALLGATHER_RS.run(laid_out, PassContext()).graph
    if fused:
        laid_out = GDN_CONV_FUSION.run(SWIGLU_FUSION.run(laid_out, PassContext()).graph, PassContext()).graph
    verify(laid_out)
    return laid_out


def test_golden_tensor_parallel_layout(small):
    _, graph, _ = small
    laid_out = _tp(graph, "4x2", "dp4xtp2")
    text = print_graph(laid_out)
    assert 'rules=[["batch", "data"], ["experts", "data", "model"], ["tensor", "model"]]' in text
    # column-parallel projections, row-parallel output projections completed by an all-reduce
    assert 'param "layers.1.self_attn.q_proj" : f32[512,96]<tensor,_>' in text
    assert 'param "layers.1.self_attn.o_proj" : f32[96,256]<_,tensor>' in text
    assert 'param "layers.0.linear_attn.out_proj" : f32[96,128]<_,tensor>' in text
    assert 'param "layers.0.mlp.shared_expert.down_proj" : f32[96,56]<_,tensor>' in text
    assert 'param "layers.0.linear_attn.A_log" : f32[4]<tensor>' in text
    assert 'param "layers.1.self_attn.q_norm" : f32[64]\n' in text  # per-head-dim weights stay whole
    assert text.count('all_reduce(') == 6  # per layer: attention/GDN output, shared expert, MoE columns
    assert ': f32[T,96]<batch,_|tensor>' in text  # the partial sums before them
    # caches split by heads: KV pages along kv_heads, GDN conv channels and state heads
    assert 'input "layers.1.k_pages" : f32[P,16,2,64]<batch,_,tensor,_>' in text
    assert 'input "layers.0.conv_state" : f32[S,192,3]<batch,tensor,_>' in text
    assert 'input "layers.0.recurrent_state" : f32[S,4,16,32]<batch,tensor,_,_>' in text
    assert laid_out.meta[CHANNEL_GROUPS] == {"layers.0.conv_state": (1, (32, 32, 128), 2)}
    # the fused q|k|v projection and the conv weight regrouped by weight preparation, then split
    assert 'concat(' in text and ': f32[192,96]<tensor,_>' in text and ': f32[192,4]<tensor,_>' in text
    # the conv output read as [T, groups, C/groups], q | k | v cut from every group
    assert 'reshape(' in text and ': f32[T,2,96]<batch,tensor,_>' in text
    assert '{axis=2, start=0, stop=16} : f32[T,2,16]<batch,tensor,_>' in text
    # the MoE: all-to-all over the data-parallel axis, each column sending the routes to its own experts
    assert ('{num_experts=8, ways=4, over="batch", mesh_axes=["data"], column_axes=["model"]} : '
            'f32[4,T*2,96]<_,batch,_>' in text)
    assert 'moe_combine_returned(' in text and 'f32[T,96]<batch,_|tensor>' in text


@pytest.mark.parametrize("family, spec, layout, form", [
    ("qwen3_5_moe", "4x2", "dp4xtp2", "all-to-all"), ("qwen3_next", "4x2", "dp4xtp2", "gathered"),
    ("qwen3_5_moe", "2x4", "dp4xtp2", "fused"), ("qwen3_next", "2", "tp2", "fused")])
def test_the_tensor_parallel_graph_equals_the_single_device_graph(tmp_path, family, spec, layout, form):
    """Prefill, decode and a continuation in one ragged batch (the checker's), every cache compared — the conv
    state through its regrouped channel order."""
    checkpoint = Checkpoint.open(write_small(tmp_path / "ckpt", family))
    graph = build_graph(checkpoint, None, 16)
    params = load_params(checkpoint, graph, progress=False)
    if spec == "2x4":  # dp4xtp2 does not fit 2x4 (its inner axis has 4 devices): the plan says so
        with pytest.raises(UsageError, match="tp2 is not the size of the mesh's innermost axes"):
            _tp(graph, spec, layout)
        return
    laid_out = _tp(graph, spec, layout, gathered=form == "gathered", fused=form == "fused")
    if form == "fused":
        text = print_graph(laid_out)
        assert "groups=2" in text and "linear_swiglu(" in text  # both fusions apply to the regrouped weights
    result = EquivalenceChecker(_on_mesh(graph, spec), params, target="cpu").check(laid_out, 5e-5)
    assert result.ok, result.reason
    assert set(result.errors) >= {"logits", "layers.0.conv_state", "layers.0.recurrent_state", "layers.1.k_pages"}


def test_bf16_tensor_parallelism_sums_its_partials_in_f32(tmp_path):
    """In bf16 each row-parallel product and each MoE column's share is kept in f32, all-reduced and rounded once,
    as one device rounds its whole product once: the laid-out bf16 graph then matches the single-device one to
    bf16 rounding (measured 6.1e-3 here, about one bf16 step of the largest logit, and 0 on the tiny preset; rounding
    each partial to bf16 first measured 2.6e-2 on the tiny preset's logits, over the 1e-2 bound)."""
    checkpoint = Checkpoint.open(write_small(tmp_path / "ckpt"))
    graph = build_graph(checkpoint, "bf16", 16)
    params = load_params(checkpoint, graph, progress=False)
    laid_out = _tp(graph, "4x2", "dp4xtp2")
    text = print_graph(laid_out)
    assert text.count("linear_f32(") == 4 and text.count('cast(') >= 8  # 2 layers x (output proj, shared down)
    assert ": f32[T,96]<batch,_|tensor>" in text and ": bf16[T,96]<batch,_|tensor>" not in text
    for form in (laid_out, MOE_ALLGATHER_RS.run(laid_out, PassContext()).graph):
        result = EquivalenceChecker(_on_mesh(graph, "4x2"), params, target="cpu").check(form, 1e-2)
        assert result.ok and result.max_error < 8e-3, result.reason


def test_mistakes_in_the_tensor_parallel_lowering_are_caught(small, monkeypatch):
    """Row-parallel partial sums never all-reduced, a fused GDN op that keeps its global group count inside the
    shard_map, a conv state compared in the wrong channel order: each fails the check by name."""
    from qcompile.ir import registry
    from qcompile.ir.ops.collective import AllReduce
    from qcompile.ir.ops.gdn import GatedDeltaNet
    from qcompile.passes.rewrite import rewrite

    _, graph, params = small
    checker = EquivalenceChecker(_on_mesh(graph, "4x2"), params)
    laid_out = _tp(graph, "4x2", "dp4xtp2")
    assert checker.check(laid_out, 1e-5).ok

    def no_all_reduce(builder, node, operands):  # each device keeps its own partial sums
        if isinstance(node.op, AllReduce):
            return operands[0]
        return None

    wrong, replaced = rewrite(laid_out, no_all_reduce)
    assert replaced == 6
    result = checker.check(wrong, 1e-5)
    assert not result.ok and result.errors["logits"] > 1e-2

    no_groups = Graph(laid_out.dag, laid_out.outputs, {k: v for k, v in laid_out.meta.items() if k != CHANNEL_GROUPS})
    result = checker.check(no_groups, 1e-5)
    assert not result.ok and result.errors["layers.0.conv_state"] > 1e-2  # its warm-up state fed in the wrong order too

    fused = GDN_CONV_FUSION.run(laid_out, PassContext()).graph
    assert checker.check(fused, 1e-5).ok
    monkeypatch.delitem(registry.LOCAL_FORMS, GatedDeltaNet)
    result = EquivalenceChecker(_on_mesh(graph, "4x2"), params).check(Graph(fused.dag, fused.outputs, fused.meta),
                                                                        1e-5)
    assert not result.ok and result.errors["logits"] > 1e-2


def test_grouped_channels_round_trip_and_a_grouped_gdn_op_equals_the_plain_one():
    """Outside a mesh a gated_delta_net with groups > 1 computes on the grouped channel order exactly what the plain
    op computes on the plain order (its rules regroup around the kernel)."""
    import jax
    import jax.numpy as jnp

    from qcompile.ir.ops.gdn import GatedDeltaNet
    from qcompile.ir.registry import lowering_rule

    order = grouped_order((4, 4, 8), 2)
    assert order.tolist() == [0, 1, 4, 5, 8, 9, 10, 11, 2, 3, 6, 7, 12, 13, 14, 15]
    meta = {CHANNEL_GROUPS: {"c": (1, (4, 4, 8), 2)}}
    graph = SimpleNamespace(meta=meta)
    x = np.arange(2 * 16 * 3).reshape(2, 16, 3)
    assert np.array_equal(from_cache_layout(graph, "c", to_cache_layout(graph, "c", x)), x)
    rng = np.random.default_rng(0)
    t, s, hv, dk, dv = 5, 2, 4, 2, 2  # Hk = 2: q | k | v = 4 | 4 | 8 channels
    c = 2 * 2 * dk + hv * dv
    args = dict(x=rng.normal(size=(t, c)), a=rng.normal(size=(t, hv)), b=rng.normal(size=(t, hv)),
                conv_state=rng.normal(size=(s, c, 3)), conv_w=rng.normal(size=(c, 4)), a_log=rng.normal(size=hv),
                dt_bias=rng.normal(size=hv), state=rng.normal(size=(s, hv, dk, dv)))
    args = {k: jnp.asarray(v, jnp.float32) for k, v in args.items()}
    query_start, slots = jnp.array([0, 3, 5], jnp.int32), jnp.array([1, 0], jnp.int32)
    order = grouped_order((4, 4, 8), 2)
    for target in ("reference", "cpu"):
        plain = lowering_rule(GatedDeltaNet, target)(GatedDeltaNet(), *args.values(), query_start, slots)
        grouped_args = dict(args, x=args["x"][:, order], conv_state=args["conv_state"][:, order],
                            conv_w=args["conv_w"][order])
        grouped = lowering_rule(GatedDeltaNet, target)(GatedDeltaNet(groups=2), *grouped_args.values(), query_start,
                                                        slots)
        np.testing.assert_allclose(np.asarray(grouped[0]), np.asarray(plain[0]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(grouped[1]), np.asarray(plain[1])[:, order], rtol=1e-6)
        np.testing.assert_allclose(np.asarray(grouped[2]), np.asarray(plain[2]), rtol=1e-5, atol=1e-6)
    jax.clear_caches()


def test_what_cannot_be_laid_out_is_said(small):
    _, graph, _ = small
    facts = model_facts(graph)
    assert tp_problem(graph, facts, parse_mesh_spec("2x4"), 4).startswith("2 KV heads do not split 4 ways")
    assert "innermost axes [4, 2]" in tp_problem(graph, facts, parse_mesh_spec("4x2"), 4)
    assert tp_problem(graph, facts, parse_mesh_spec("4x2"), 2) == ""
    assert tp_problem(graph, facts, parse_mesh_spec("4x2"), 8) == "4 query heads do not split 8 ways"
    fused = SWIGLU_FUSION.run(graph, PassContext()).graph
    assert "before the fusion passes" in tp_problem(fused, facts, parse_mesh_spec("4x2"), 2)
    by_name = {p.name: p for p in plans(facts, 8, 8, 64, {2: "", 4: "no", 8: "no"})}
    assert by_name["dp4xtp2+ep"].lowered and not by_name["dp2xtp4+ep"].lowered and "tp8+ep" not in by_name
    assert by_name["dp2xtp4+ep"].to_json()["not_lowered_because"] == "no"
    # the applied plan is the best of those that can be laid out, by the same rule (not merely the first of them)
    candidates = plans(facts, 8, 8, 64, {2: "", 4: "replicated KV heads", 8: "no"})
    best, applied, why = choose(candidates)
    assert best.name == "dp2xtp4+ep" and applied.name == "dp4xtp2+ep"
    assert applied.total < next(p for p in candidates if p.name == "dp8+ep").total
    assert "dp2xtp4+ep cannot be laid out (replicated KV heads), so dp4xtp2+ep is applied" in why
    with pytest.raises(UsageError, match=r"not a plan .* \(plans: dp8\+ep, dp4xtp2\+ep, dp2xtp4\+ep\)"):
        _tp(graph, "4x2", "tp8")
    with pytest.raises(UsageError, match="--layout dp2xtp4: 2 KV heads do not split 4 ways"):
        _tp(graph, "2x4", "dp2xtp4")


def test_the_compiled_step_holds_the_collectives_the_plan_predicts(small):
    """Counted in the HLO XLA compiled for dp4xtp2 on 4x2: per layer two all-reduces over the tensor-parallel pair
    (attention or GDN output, shared expert) and one for the MoE columns; the MoE's all-to-alls (or all-gathers and
    reduce-scatter) over the 4 data-parallel ranks only. Bytes equal the plan's prediction."""
    from qcompile.compiler.hlo import collective_stats
    from qcompile.ir.weights import fold_weight_preparation
    from qcompile.runtime.engine import CacheConfig, Engine

    checkpoint, graph, _ = small
    (plan,) = [p for p in plans(model_facts(graph), 8, 16, 32) if p.name == "dp4xtp2+ep"]
    found = {}
    for form in ("all-to-all", "gathered"):
        laid_out = fold_weight_preparation(_tp(graph, "4x2", "dp4xtp2", gathered=form == "gathered"))
        params = load_params(checkpoint, laid_out, progress=False)
        engine = Engine(laid_out, params, CacheConfig(max_seqs=16, max_context=32, max_step_tokens=16))
        work = [(engine.add_sequence(), [3 + i]) for i in range(16)]
        engine.step_tokens(work)
        found[form] = collective_stats(
            engine.program.executable(engine.params, engine.caches, engine.last_batch, False).as_text())
    a2a, gathered = found["all-to-all"], found["gathered"]
    assert set(a2a) == {"all-to-all", "all-reduce"} and a2a["all-to-all"]["count"] == 6
    # (XLA's all-reduce combiner may merge a layer's MoE and shared-expert all-reduces: 4-6 ops, the same bytes)
    assert a2a["all-to-all"]["group"] == 4 and a2a["all-reduce"]["group"] == 2 and 4 <= a2a["all-reduce"]["count"] <= 6
    moe_allreduce = plan.moe_a2a_bytes - a2a["all-to-all"]["sent_bytes"]
    assert a2a["all-reduce"]["sent_bytes"] == plan.tp_allreduce_bytes + moe_allreduce
    assert set(gathered) == {"all-gather", "reduce-scatter", "all-reduce"}
    assert gathered["all-gather"]["count"] == 4 and gathered["reduce-scatter"]["count"] == 2
    assert gathered["all-gather"]["group"] == gathered["reduce-scatter"]["group"] == 4
    assert (gathered["all-gather"]["sent_bytes"] + gathered["reduce-scatter"]["sent_bytes"]
            + gathered["all-reduce"]["sent_bytes"] - plan.tp_allreduce_bytes) == plan.moe_bytes


@pytest.mark.slow
def test_a_tensor_parallel_artifact_runs_like_the_single_device_model(tmp_path, capsys):
    """compile --mesh 4x2 --layout dp4xtp2 with every lossless pass (the fusions on the regrouped weights), then
    run the artifact: the same greedy tokens as the unoptimized model on one device. (Slow tier: the default suite
    checks the same laid-out graphs against the single-device one in-process, above.)"""
    import json

    from qcompile.cli import main

    path = write_small(tmp_path / "ckpt")
    art = tmp_path / "tp"
    with pytest.raises(SystemExit) as done:
        main([str(path), "--mesh", "4x2", "--layout", "dp4xtp2", "--passes", "all,-bf16-state", "-o", str(art),
              "--max-seqs", "8", "--max-context", "32", "--max-step-tokens", "8", "--verify", "final"])
    compiled = capsys.readouterr()
    assert done.value.code == 0, compiled.err
    assert "plan=dp4xtp2+ep" in compiled.out and "gdn_layer_grouped=1" in compiled.out
    assert "dense_split=2" in compiled.out
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["mesh"]["rules"] == [["batch", "data"], ["experts", "data", "model"], ["tensor", "model"]]
    assert manifest["cache_types"]["layers.1.k_pages"].endswith("<batch,_,tensor,_>")
    outputs = []
    for source in (art, path):
        with pytest.raises(SystemExit) as done:
            main(["run", str(source), "--prompt-ids", "1,2,3", "--prompt-ids", "4,5,6,7,8,9,10,11,12,13",
                  "--max-new-tokens", "6", "--ignore-eos"])
        assert done.value.code == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and len(outputs[0].splitlines()) == 2


def test_a_purely_tensor_parallel_artifact_runs(tmp_path, capsys):
    """--mesh 2 --layout tp2 (one data-parallel rank split over two devices): the artifact's executables are exported
    for 2 devices, so its weights and caches must be placed on the mesh too — they stayed on one device and every
    run, check and bench of such an artifact failed ("exported for 2 devices ... called in a context with 1")."""
    from qcompile.cli import main

    path = write_small(tmp_path / "ckpt")
    art = tmp_path / "tp2"
    with pytest.raises(SystemExit) as done:
        main([str(path), "--mesh", "2", "--layout", "tp2", "--passes", "gqa-sharding", "-o", str(art),
              "--max-seqs", "2", "--max-context", "16", "--max-step-tokens", "4", "--verify", "none"])
    assert done.value.code == 0, capsys.readouterr().err
    capsys.readouterr()
    outputs = []
    for source in (art, path):
        with pytest.raises(SystemExit) as done:
            main(["run", str(source), "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--ignore-eos"])
        assert done.value.code == 0, capsys.readouterr().err
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].strip()


def test_bad_layouts_are_usage_errors(tmp_path, capsys):
    """--layout without --mesh, without gqa-sharding, or naming a plan the heads cannot take: exit 2 with why."""
    from qcompile.cli import main

    path = write_small(tmp_path / "ckpt")
    for argv, message in ((["--layout", "dp4xtp2"], "--layout needs --mesh"),
                          (["--mesh", "4x2", "--layout", "dp4xtp2", "--passes", "none"], "do not include gqa-sharding"),
                          (["--mesh", "2x4", "--layout", "dp2xtp4"], "2 KV heads do not split 4 ways")):
        with pytest.raises(SystemExit) as done:
            main([str(path), *argv, "--verify", "none"])
        assert done.value.code == 2
        assert message in capsys.readouterr().err

