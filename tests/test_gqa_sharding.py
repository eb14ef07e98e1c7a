"""gqa-sharding: the plan choice (every plan costed, the switch from tensor to data parallelism as concurrency grows),
the layout it applies (golden IR), the cases it leaves alone, the sharded graph against the single-device graph on
8, 2x4 and 4 simulated CPU devices (both families, prefill + decode + mixed in one check batch), a wrong expert
remapping caught, the engine and the scheduler on data-parallel ranks, the rank-local step ABI, and `--mesh`.

The suite's JAX has 8 CPU devices (tests/conftest.py).
"""

from __future__ import annotations

import attrs
import jax
import numpy as np
import pytest

from conftest import write_small
from qcompile.ir.abi import WorkItem, data_parallel_ranks, pack_batch, pack_ranked
from qcompile.ir.importer import build_graph
from qcompile.ir.mesh import Mesh, parse_mesh_spec
from qcompile.ir.ops.expert_parallel import MoeDispatchLocal, MoeSend
from qcompile.ir.printer import print_graph
from qcompile.ir.registry import LOWERINGS
from qcompile.ir.verifier import verify
from qcompile.ir.weights import fold_weight_preparation, load_params
from qcompile.passes.base import PassContext
from qcompile.passes.equivalence import EquivalenceChecker
from qcompile.passes.gqa_sharding import GQA_SHARDING, ModelFacts, choose, plans
from qcompile.passes.moe_allgather_rs import MOE_ALLGATHER_RS
from qcompile.frontend.checkpoint import Checkpoint

FLAGSHIP = ModelFacts(  # Qwen3.5-397B-A17B in bf16 (shared/spec): 15 attention + 45 GDN layers, 512 experts
    query_heads=32, kv_heads=2, head_dim=256, kv_itemsize=2, attention_layers=15,
    state_bytes_per_seq=45 * (64 * 128 * 128 * 4 + 8192 * 3 * 4), gdn_heads=64, num_experts=512,
    expert_bytes=750 * 2**30, split_bytes=40 * 2**30, replicated_bytes=4 * 2**30, hidden=4096, layers=60,
    act_itemsize=2, moe_layers=60, top_k=10)


def _laid_out(graph, spec: str = "8", **options):
    """gqa-sharding's result (MoE layers as all-to-all dispatch)."""
    graph.meta["mesh"] = parse_mesh_spec(spec)
    return GQA_SHARDING.run(graph, PassContext(options=tuple(options.items())))


def _gathered(graph, spec: str = "8", **options):
    """gqa-sharding, then moe-allgather-rs: the graph laid out as `--passes all` lays it out."""
    return MOE_ALLGATHER_RS.run(_laid_out(graph, spec, **options).graph, PassContext())


def test_every_plan_is_costed_and_the_plan_follows_the_concurrency():
    low = plans(FLAGSHIP, 8, concurrency=4, context=8192)
    assert [p.name for p in low] == ["dp8+ep", "dp4xtp2+ep", "dp2xtp4+ep", "tp8+ep"]
    by_name = {p.name: p for p in low}
    # 2 KV heads: beyond TP2 each device still keeps one whole head, so TP8 (4 sequences per device) holds 4x the KV
    # of DP4xTP2 (one sequence per rank)
    assert by_name["tp8+ep"].kv_bytes == 4 * by_name["dp4xtp2+ep"].kv_bytes == 4 * 8192 * 2 * 256 * 2 * 15
    assert by_name["dp8+ep"].weight_bytes > by_name["dp4xtp2+ep"].weight_bytes > by_name["tp8+ep"].weight_bytes
    best, applied, why = choose(low)
    assert best.tp > 1 and applied.name == "dp8+ep" and "cannot be laid out" in why  # weights dominate at 4 requests
    assert best.name == "tp8+ep"
    best, applied, why = choose(plans(FLAGSHIP, 8, concurrency=512, context=8192))
    assert best.name == "dp4xtp2+ep" and "cannot be laid out" in why  # the replicated KV of TP8 dominates
    chosen = [choose(plans(FLAGSHIP, 8, c, 8192))[0].tp for c in (1, 4, 8, 16, 32, 64, 128, 256, 512)]
    assert chosen == sorted(chosen, reverse=True) and chosen[0] == 8 and chosen[-1] == 2  # narrower TP as C grows
    # one KV head per device fits TP8 with 8 KV heads: no replication, so TP8 keeps winning at 512
    assert choose(plans(attrs.evolve(FLAGSHIP, kv_heads=8), 8, 512, 8192))[0].name == "tp8+ep"
    # a tie in bytes goes to the plan whose collectives move less: no weights to split, DP needs no all-reduce
    flat = attrs.evolve(FLAGSHIP, split_bytes=0)
    assert choose(plans(flat, 8, 64, 8192))[0].name == "dp8+ep"
    assert by_name["dp8+ep"].tp_allreduce_bytes == 0 < by_name["dp4xtp2+ep"].tp_allreduce_bytes


def test_golden_layout_of_an_moe_layer(small):
    _, graph, _ = small
    result = _laid_out(graph, concurrency=8, max_context=64)
    assert result.changed and result.stats["plan"] == "dp8+ep" and result.stats["moe_layers"] == 2
    assert {p["plan"] for p in result.stats["plans"]} >= {"dp8+ep", "dp4xtp2+ep"}
    verify(result.graph)
    text = print_graph(result.graph)
    assert 'mesh {axes=["model"], shape=[8], devices=[0, 1, 2, 3, 4, 5, 6, 7], rules=[["batch", "model"], ' \
           '["experts", "model"]]}' in text
    assert 'input "query_start" : i32[B+8]<batch>' in text
    assert 'input "token_ids" : i32[T]<batch>' in text
    assert 'input "layers.1.k_pages" : f32[P,16,2,64]<batch,_,_,_>' in text
    assert 'input "layers.0.recurrent_state" : f32[S,4,16,32]<batch,_,_,_>' in text
    assert "<experts,_,_>" in text and "all_gather" not in text and "reduce_scatter" not in text
    assert _moe_ops(text)[:8] == ["moe_send", "all_to_all", "all_to_all", "moe_dispatch_received", "moe_return",
                                  "all_to_all", "moe_combine_returned", "moe_send"]
    assert ('all_to_all(%' in text and '{split_axis=0, concat_axis=1, over="batch", mesh_axes=["model"], '
            'split="experts"} : f32[8,T*2,96]<experts,_,_>' in text)
    assert ('moe_send(%' in text and '{num_experts=8, ways=8, over="experts", mesh_axes=["model"], column_axes=[]} : '
            'f32[8,T*2,96]<_,batch,_>, i32[8,T*2]<_,batch>, i32[T*2]<batch>' in text)
    assert data_parallel_ranks(result.graph) == 8 and data_parallel_ranks(graph) == 1


def _moe_ops(text: str) -> list[str]:
    return [line.split(" = ", 1)[1].split("(")[0] for line in text.splitlines()
            if any(k in line for k in ("all_gather", "all_to_all", "routing", "moe_", "reduce_scatter"))]


def test_golden_moe_allgather_rs(small):
    _, graph, _ = small
    result = _gathered(graph, concurrency=8, max_context=64)
    assert result.changed and result.stats == {"moe_layers": 2, "all_to_all_removed": 6, "all_gather_added": 4,
                                               "reduce_scatter_added": 2}
    verify(result.graph)
    text = print_graph(result.graph)
    assert "all_to_all" not in text and "moe_send" not in text
    assert _moe_ops(text)[:8] == ["all_gather", "pack_routing", "all_gather", "unpack_routing", "moe_dispatch_local",
                                  "moe_combine", "reduce_scatter", "all_gather"]
    assert ('reduce_scatter(%' in text and '{axis=0, over="experts", mesh_axes=["model"], split="batch", stages=[]} : '
            'f32[T,96]<batch,_>' in text)
    assert 'pack_routing(%' in text and ': i32[T,4]<batch,_>' in text  # weights and ids of top-2 in one i32[T,4]
    # not transformed: no all-to-all dispatch (one device, or the gathered form already)
    assert MOE_ALLGATHER_RS.run(graph, PassContext()).skipped.startswith("no all-to-all expert dispatch")
    assert MOE_ALLGATHER_RS.run(result.graph, PassContext()).skipped.startswith("no all-to-all expert dispatch")


def test_not_transformed_without_devices_or_when_experts_do_not_split(small):
    _, graph, _ = small
    graph = graph.__class__(graph.dag, graph.outputs, {**graph.meta})
    graph.meta.pop("mesh", None)
    assert GQA_SHARDING.run(graph, PassContext()).skipped.startswith("one device")
    assert _laid_out(graph, "1").skipped.startswith("one device")
    skipped = _laid_out(graph, "3").skipped
    assert skipped == "8 experts do not split over 3 devices"
    laid_out = _laid_out(graph).graph
    assert GQA_SHARDING.run(laid_out, PassContext()).skipped == "the graph is laid out on its mesh already"


@pytest.mark.parametrize("family, spec, moe", [("qwen3_5_moe", "8", "all-to-all"), ("qwen3_next", "2x4", "gathered"),
                                               ("qwen3_5_moe", "4", "gathered")])
def test_the_sharded_graph_equals_the_single_device_graph(tmp_path, family, spec, moe):
    path = write_small(tmp_path / "ckpt", family)
    checkpoint = Checkpoint.open(path)
    graph = build_graph(checkpoint, None, 16)
    params = load_params(checkpoint, graph, progress=False)
    laid_out = (_laid_out if moe == "all-to-all" else _gathered)(graph, spec).graph
    checker = EquivalenceChecker(graph, params, target="cpu")  # 3 sequences on 3 ranks: decode, continuation, prefill
    result = checker.check(laid_out, 5e-5)
    assert result.ok, result.reason
    assert set(result.errors) >= {"logits", "next_tokens", "layers.0.recurrent_state", "layers.1.k_pages"}
    assert 0 < result.errors["logits"] < 5e-5


def test_a_wrong_expert_remapping_is_caught(small, monkeypatch):
    import jax.numpy as jnp

    _, graph, params = small
    laid_out = _gathered(graph).graph  # the reference graph now has the mesh: the checker spreads sequences on it
    assert EquivalenceChecker(graph, params).check(laid_out, 1e-5).ok

    def forgets_the_first_local_expert(op_, x, ids):  # every device takes global ids 0..E/D-1 as its own
        local = op_.num_experts // jax.lax.axis_size(op_.mesh_axes)
        flat = ids.reshape(-1)
        flat = jnp.where(flat < local, flat, local)
        order = jnp.argsort(flat, stable=True).astype(jnp.int32)
        return jnp.take(x, order // ids.shape[1], axis=0), jnp.bincount(flat, length=local).astype(jnp.int32), order

    monkeypatch.setitem(LOWERINGS, (MoeDispatchLocal, "reference"), forgets_the_first_local_expert)
    wrong = _gathered(build_graph(small[0], None, 16)).graph
    result = EquivalenceChecker(graph, params).check(wrong, 1e-5)
    assert not result.ok and result.errors["logits"] > 1e-2

    def sends_round_robin(op_, x, ids):  # expert e to device e % D: the owner of a block of E/D is e // (E/D)
        from qcompile.ir.ops.expert_parallel import send_blocks

        return send_blocks(x, ids, ids.reshape(-1) % op_.ways, op_.ways)

    monkeypatch.setitem(LOWERINGS, (MoeSend, "reference"), sends_round_robin)
    wrong = _laid_out(build_graph(small[0], None, 16), "4").graph  # 2 experts per device (on 8, e // 1 == e % 8)
    result = EquivalenceChecker(graph, params).check(wrong, 1e-5)
    assert not result.ok and result.errors["logits"] > 1e-2


def test_the_engine_and_the_scheduler_on_data_parallel_ranks_give_the_single_device_tokens(small):
    from qcompile.runtime.engine import CacheConfig, Engine
    from qcompile.runtime.scheduler import Request, Scheduler

    checkpoint, graph, params = small
    folded = fold_weight_preparation(graph)
    laid_out = _gathered(fold_weight_preparation(build_graph(checkpoint, None, 16))).graph
    prepared = load_params(checkpoint, folded, progress=False)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 30)), [3], [5, 6], [20, 21, 22], [4, 4], [9, 8, 7, 6]]
    cache = CacheConfig(max_seqs=8, max_context=48, max_step_tokens=16)
    single = Engine(folded, prepared, cache).generate(prompts, 6)
    engine = Engine(laid_out, prepared, cache)
    assert engine.ranks == 8
    sharded = engine.generate(prompts, 6)
    assert sharded["tokens"] == single["tokens"]
    leaf = jax.tree_util.tree_leaves(engine.caches)[0]
    assert len(leaf.sharding.device_set) == 8  # each rank's slots and pages on its own device
    # 2 slots and 2 pages of 16 tokens per rank: the two requests of a rank start in one page each and cannot both
    # grow into a second; the younger is preempted, recomputed later, and still makes the single-device tokens
    tight = Engine(laid_out, prepared, CacheConfig(max_seqs=16, max_context=48, max_step_tokens=16, num_pages=16))
    requests = [Request(p[:3], 20, id=i) for i, p in enumerate(prompts + prompts)]
    list(Scheduler(tight).stream(requests))
    alone = Engine(folded, prepared, cache).generate([p[:3] for p in prompts], 20)["tokens"]
    assert [r.tokens for r in requests] == alone + alone
    assert all(r.finish_reason == "length" for r in requests)
    assert sum(r.preemptions for r in requests) > 0 and len(tight.free_slots) == 16 and len(tight.free_pages) == 16
    # a prompt's second choice forks the first's cache on its rank (slot and pages copied across the sharded caches);
    # the 20-token prompt's two choices need 4 pages together, more than a rank's 2: its second is fed on its own
    forks, fork = [], tight.fork
    tight.fork = lambda source: forks.append(tight.rank_of(source)) or fork(source)
    pairs = [Request(p, 6, id=i) for p in prompts[:3] for i in range(2)]
    for first, second in zip(pairs[::2], pairs[1::2]):
        second.parent = first
    Scheduler(tight).run(pairs)
    assert [r.tokens for r in pairs] == [t for t in single["tokens"][:3] for _ in range(2)]
    assert len(forks) == 2 and len(tight.free_slots) == 16 and len(tight.free_pages) == 16
    # the prefix cache on ranks: one request and one kept slot per rank; prompts sharing a 16-token page, one at a
    # time: the second snapshots it on its rank (a copy within that rank's slots and pages), later ones copy it there
    roomy = Engine(laid_out, prepared, CacheConfig(max_seqs=16, max_context=48, max_step_tokens=16, num_pages=32))
    scheduler = Scheduler(roomy, prefix_cache=True, max_running=8)
    shared = [Request(prompts[2][:16] + [k], 4) for k in (1, 2, 3, 4)]
    for request in shared:
        scheduler.run([request])
    alone = Engine(folded, prepared, cache).generate([r.prompt for r in shared], 4)["tokens"]
    assert [r.tokens for r in shared] == alone
    assert scheduler.snapshots == 1 and scheduler.prefix_hits == 2 and scheduler.prefix_hit_tokens == 32
    scheduler.release_kept()
    assert len(roomy.free_slots) == 16 and len(roomy.free_pages) == 32


def test_rank_local_packing():
    work = [WorkItem(slot=5, pages=(10, 11), start=3, tokens=(7, 8)), WorkItem(slot=0, pages=(0,), start=0, tokens=(9,))]
    batch, rows = pack_ranked(work, num_tokens=8, rows=4, max_seqs=8, pages_per_seq=2, pool_pages=16,
                              all_logits=False, ranks=4)
    # rank 2 (slots 4-5, pages 8-11) has item 0 as its slot 1 with pages 2, 3; rank 0 has item 1
    assert batch["query_start"].tolist() == [0, 1, 1, 0, 0, 0, 0, 2, 2, 0, 0, 0]
    assert batch["state_slots"].tolist() == [0, 2, 2, 2, 1, 2, 2, 2]
    assert batch["page_table"][4].tolist() == [2, 3] and batch["token_ids"].tolist()[4:6] == [7, 8]
    assert batch["positions"].tolist()[4:6] == [3, 4] and rows == [[2], [0]]
    assert batch["logits_indices"].tolist()[2] == 1  # rank-local index of item 0's last token
    one, rows_one = pack_ranked(work, num_tokens=8, rows=4, max_seqs=8, pages_per_seq=2, pool_pages=16,
                                all_logits=False, ranks=1)
    assert rows_one == [[0], [1]] and all(np.array_equal(one[k], v) for k, v in pack_batch(
        work, num_tokens=8, rows=4, max_seqs=8, pages_per_seq=2, all_logits=False).items())
    with pytest.raises(ValueError, match="outside rank 2's"):
        pack_ranked([WorkItem(5, (1,), 0, (1,))], num_tokens=8, rows=4, max_seqs=8, pages_per_seq=2, pool_pages=16,
                    all_logits=False, ranks=4)


def test_run_on_a_mesh_gives_the_single_device_tokens(tmp_path, capsys):
    """`run CHECKPOINT --mesh`: data parallel (2x4) and with tensor parallelism (4x2: dp4 x tp2, which regroups the
    GDN projections' rows — so the graph is laid out before the host's column-panel layout, as a compiled build is;
    laid out after it, the run failed: "a GDN conv's input is not a projection"). Sampled, so the sampler runs on the
    ranks' logits too (prompt i drawn with seed + i: the same tokens on every layout)."""
    from qcompile.cli import main

    path = write_small(tmp_path / "ckpt", "qwen3_next")
    outputs = []
    for extra in ([], ["--mesh", "2x4"], ["--mesh", "4x2"]):
        with pytest.raises(SystemExit) as done:
            main(["run", str(path), "--prompt-ids", "1,2,3", "--prompt-ids", "4,5,6,7,8", "--max-new-tokens", "5",
                  "--ignore-eos", "--temperature", "0.9", "--top-p", "0.9", "--seed", "3", *extra])
        assert done.value.code == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] == outputs[2] and len(outputs[0].splitlines()) == 2


def test_a_laid_out_artifact_records_its_mesh_and_runs_like_the_single_device_one(tmp_path, capsys):
    import json

    from qcompile.cli import main

    path = write_small(tmp_path / "ckpt")
    outputs = []
    for name, extra in (("one", []), ("eight", ["--mesh", "8"])):
        with pytest.raises(SystemExit) as done:
            main([str(path), "-o", str(tmp_path / name), "--max-seqs", "8", "--max-context", "32",
                  "--max-step-tokens", "8", "--verify", "none", *extra])
        compiled = capsys.readouterr()
        assert done.value.code == 0, compiled.err
        with pytest.raises(SystemExit) as done:
            main(["run", str(tmp_path / name), "--prompt-ids", "1,2,3", "--prompt-ids", "4,5,6,7,8,9,10,11,12,13",
                  "--max-new-tokens", "6", "--ignore-eos"])
        assert done.value.code == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and len(outputs[0].splitlines()) == 2
    manifest = json.loads((tmp_path / "eight" / "manifest.json").read_text())
    assert manifest["mesh"]["shape"] == [8] and manifest["mesh"]["rules"][0] == ["batch", "model"]
    assert manifest["cache_types"]["layers.0.recurrent_state"].endswith("<batch,_,_,_>")
    assert {(b["tokens"], b["rows"]) for b in manifest["buckets"]} >= {(8, 8), (64, 8), (64, 64)}
    assert json.loads((tmp_path / "one" / "manifest.json").read_text())["mesh"] is None


def test_mesh_rules_come_from_the_pass(small):
    laid_out = _laid_out(small[1]).graph
    mesh: Mesh = laid_out.meta["mesh"]
    assert mesh.rule("batch") == ("model",) and mesh.ways("experts") == 8


def test_mesh_on_the_command_line(tmp_path, capsys):
    from qcompile.cli import main

    path = write_small(tmp_path / "ckpt")
    report = tmp_path / "r.json"
    with pytest.raises(SystemExit) as done:
        main(["--mesh", "8", str(path), "--passes", "gqa-sharding", "--report", str(report)])
    assert done.value.code == 0
    out = capsys.readouterr()
    assert "--max-seqs 4 rounded up to 8" in out.err
    assert "gqa-sharding               applied   plan=dp8+ep" in out.out
    import json

    data = json.loads(report.read_text())
    assert data["mesh"]["shape"] == [8] and data["mesh"]["rules"] == [["batch", "model"], ["experts", "model"]]
    for argv, message in ((["--mesh", "3"], "the 8 routed experts do not split over 3 devices"),
                          (["--mesh", "2y"], "expected sizes like 8, 4x2 or 2x4"),
                          (["--mesh", "16"], "--mesh needs 16 devices, but JAX started with 8"),
                          (["--mesh", "8", "--target", "tpu", "-o", str(tmp_path / "out")], "cpu target only")):
        with pytest.raises(SystemExit) as done:
            main([*argv, str(path), "--passes", "gqa-sharding"])
        assert done.value.code == 2
        assert message in capsys.readouterr().err



@pytest.mark.slow
def test_a_numerics_failure_on_the_mesh_writes_a_reproducer_that_replays_it(tmp_path, capsys, monkeypatch):
    import jax.numpy as jnp

    from qcompile.cli import main
    from qcompile.ir.parser import parse_mesh_statement

    def forgets_the_first_local_expert(op_, x, ids):
        local = op_.num_experts // jax.lax.axis_size(op_.mesh_axes)
        flat = jnp.where(ids.reshape(-1) < local, ids.reshape(-1), local)
        order = jnp.argsort(flat, stable=True).astype(jnp.int32)
        return jnp.take(x, order // ids.shape[1], axis=0), jnp.bincount(flat, length=local).astype(jnp.int32), order

    path = write_small(tmp_path / "ckpt")
    monkeypatch.setitem(LOWERINGS, (MoeDispatchLocal, "reference"), forgets_the_first_local_expert)
    with pytest.raises(SystemExit) as done:
        main(["--mesh", "8", str(path), "--passes", "gqa-sharding,moe-allgather-rs", "--repro-dir",
              str(tmp_path / "repro")])
    assert done.value.code == 3 and "pass moe-allgather-rs" in capsys.readouterr().err
    (repro,) = (tmp_path / "repro").iterdir()
    mesh = parse_mesh_statement((repro / "input.qir").read_text())
    assert mesh is not None and mesh.size == 8 and mesh.rule("experts") == ("model",)  # gqa-sharding's layout
    with pytest.raises(SystemExit) as done:
        main(["reproduce", str(repro)])
    assert done.value.code == 3 and "still failing" in capsys.readouterr().err
    monkeypatch.undo()
    with pytest.raises(SystemExit) as done:
        main(["reproduce", str(repro)])
    assert done.value.code == 0 and "no longer fails" in capsys.readouterr().out


def test_the_compiled_step_holds_the_collectives_each_moe_form_names(small):
    """Counted in the optimized HLO XLA compiled, per MoE layer: gqa-sharding's dispatch, three all-to-alls (tokens,
    their expert ids, the results home); after moe-allgather-rs, one all-gather of the tokens, one of the packed
    routing (ids and weights in one collective) and one reduce-scatter, no all-to-all. The bytes sent equal the plan's
    prediction for each form."""
    from qcompile.compiler.hlo import collective_stats
    from qcompile.passes.gqa_sharding import model_facts
    from qcompile.runtime.engine import CacheConfig, Engine

    checkpoint, _, _ = small
    graph = fold_weight_preparation(build_graph(checkpoint, None, 16))
    params = load_params(checkpoint, graph, progress=False)
    (dp8,) = [p for p in plans(model_facts(graph), 8, 16, 32) if p.name == "dp8+ep"]
    found = {}
    for form, lay_out in (("all-to-all", _laid_out), ("gathered", _gathered)):
        laid_out = lay_out(fold_weight_preparation(build_graph(checkpoint, None, 16))).graph
        engine = Engine(laid_out, params, CacheConfig(max_seqs=16, max_context=32, max_step_tokens=16))
        work = [(engine.add_sequence(), [3 + i]) for i in range(16)]
        engine.step_tokens(work)
        found[form] = collective_stats(
            engine.program.executable(engine.params, engine.caches, engine.last_batch, False).as_text())
    a2a, gathered = found["all-to-all"], found["gathered"]
    assert set(a2a) == {"all-to-all"} and a2a["all-to-all"]["count"] == 6 and a2a["all-to-all"]["group"] == 8
    assert a2a["all-to-all"]["sent_bytes"] == dp8.moe_a2a_bytes
    assert set(gathered) == {"all-gather", "reduce-scatter"}
    assert gathered["all-gather"]["count"] == 4 and gathered["reduce-scatter"]["count"] == 2  # 2 MoE layers
    assert gathered["all-gather"]["group"] == gathered["reduce-scatter"]["group"] == 8
    assert gathered["all-gather"]["sent_bytes"] + gathered["reduce-scatter"]["sent_bytes"] == dp8.moe_bytes
