"""The kv-page-resize pass: the target's page size (256 on tpu, capped at the build's context; cpu keeps its 16),
a user's --page-size kept, the checker comparing KV caches across page sizes through each layout's logical view
(and still catching a wrong cache), the engine generating the same tokens with resized pages, and the capacity it
reports for a memory budget."""

from __future__ import annotations

import json

import attrs
import pytest

from qcompile.frontend.checkpoint import Checkpoint
from qcompile.ir.abi import CacheConfig
from qcompile.ir.graph import Graph
from qcompile.ir.importer import build_graph
from qcompile.ir.ops.attention import PagedAttention
from qcompile.ir.printer import print_graph
from qcompile.ir.verifier import verify
from qcompile.ir.weights import load_params
from qcompile.passes.base import PassContext
from qcompile.passes.equivalence import EquivalenceChecker
from qcompile.passes.kv_page_resize import KV_PAGE_RESIZE, CacheFacts, kv_inputs, target_page_size
from qcompile.passes.registry import PASSES


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def model(request, tmp_path_factory):
    from conftest import write_small

    path = write_small(tmp_path_factory.mktemp(request.param) / "m", family=request.param, seed=4)
    ckpt = Checkpoint.open(path)
    graph = build_graph(ckpt)
    params = load_params(ckpt, graph, progress=False)
    return ckpt, graph, params, EquivalenceChecker(graph, params, seed=0, target="cpu")


def _tpu(context: int | None = None, **options) -> PassContext:
    opts = {"max_context": context, **options} if context else options
    return PassContext(target="tpu", options=tuple(opts.items()))


def test_it_is_last_in_all_and_picks_a_power_of_two_per_target():
    assert list(PASSES)[-1] == "kv-page-resize" and KV_PAGE_RESIZE.in_all
    assert target_page_size("tpu", None) == 256 and target_page_size("tpu", 8192) == 256
    assert target_page_size("tpu", 100) == 128 and target_page_size("tpu", 64) == 64  # never past the context
    assert target_page_size("cpu", 4096) == 16 and target_page_size("reference", 64) == 0


def test_golden_and_not_transformed(model):
    _, graph, _, _ = model
    result = KV_PAGE_RESIZE.run(graph, _tpu(64))
    verify(result.graph)
    before, after = print_graph(graph), print_graph(result.graph)
    layer = next(iter(kv_inputs(graph))).split(".")[1]
    assert f'input "layers.{layer}.k_pages" : f32[P,16,2,64]' in before
    assert f'input "layers.{layer}.k_pages" : f32[P,64,2,64]' in after
    assert f'input "layers.{layer}.v_pages" : f32[P,64,2,64]' in after
    assert "page_size=16}" in before and "page_size=64}" in after and "page_size=16}" not in after
    assert result.graph.meta["page_size"] == 64 and graph.meta["page_size"] == 16
    assert "kv_cache_write(" in after and ": f32[P,16,2,64]" not in after
    # everything but the pages, their writes and the attention ops is the same text

    def rest(text):
        return [line for line in text.splitlines() if not any(w in line for w in ("pages", "paged_attention",
                                                                                 "kv_cache_write"))]

    assert rest(before) == rest(after)
    assert result.stats["page_size"] == "16 -> 64" and result.stats["ops"] == 3 * len(graph.find(PagedAttention))  # 2 writes + attention
    # not transformed: cpu keeps 16; a user's --page-size is kept on any target, and the report says why
    cpu = KV_PAGE_RESIZE.run(graph, PassContext(target="cpu"))
    assert not cpu.changed and cpu.graph is graph and "16 already" in cpu.skipped
    fixed = KV_PAGE_RESIZE.run(graph, _tpu(4096, page_size=16))
    assert not fixed.changed and "fixed by --page-size 16" in fixed.skipped


def test_resized_graphs_are_checked_through_the_logical_kv(model):
    """Page sizes 64 (one page per check sequence) and 128 (pages longer than the check's 64-token context) match
    the 16-token graph within the reassociating bound, caches included (32 in the engine test below); a candidate
    whose K and V caches are swapped (its logits untouched) fails, naming the cache."""
    _, graph, _, checker = model
    for context in (64, 128):
        resized = KV_PAGE_RESIZE.run(graph, _tpu(context)).graph
        result = checker.check(resized, KV_PAGE_RESIZE.bound("f32"))
        assert result.ok, result.reason
        kv = [name for name in result.errors if name.endswith("_pages")]
        assert kv and all(result.errors[name] <= 1e-5 for name in kv)
    outputs = dict(resized.outputs)
    k, v = sorted(name for name in outputs if name.endswith(("k_pages", "v_pages")))[:2]
    outputs[k], outputs[v] = outputs[v], outputs[k]
    swapped = Graph(resized.dag, outputs, resized.meta)
    result = checker.check(swapped, KV_PAGE_RESIZE.bound("f32"))
    assert not result.ok and k in result.reason


@pytest.mark.parametrize("model", ["qwen3_5_moe"], indirect=True)  # the same for both families: one is enough
def test_the_engine_generates_the_same_tokens_with_resized_pages(model):
    _, graph, params, _ = model
    prompts = [[5, 9, 200, 31, 7, 7, 40, 2, 9, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [3, 4]]
    from qcompile.runtime.engine import Engine

    cache = CacheConfig(max_seqs=2, max_context=48, max_step_tokens=8)
    base = Engine(graph, params, cache).generate(prompts, 12)["tokens"]
    resized = KV_PAGE_RESIZE.run(graph, _tpu(32)).graph
    engine = Engine(resized, params, cache)
    assert engine.page_size == 32 and engine.sizes["P"] == 2 * 2  # two 32-token pages per 48-token sequence
    assert engine.generate(prompts, 12)["tokens"] == base


def test_capacity_for_a_memory_budget(model):
    """Hand-computed: KV bytes per token = 2 (K, V) x attention layers x Hkv x hd x 4; a budget of weights + 1 MiB
    at concurrency 4 gives each sequence 1 MiB / 4 minus its state, in whole pages."""
    _, graph, _, _ = model
    facts = CacheFacts.of(graph)
    layers = len(graph.find(PagedAttention))
    assert facts.kv_bytes_per_token == 2 * layers * 2 * 64 * 4
    budget = facts.weight_bytes + 2**20
    result = KV_PAGE_RESIZE.run(graph, _tpu(512, concurrency=4, memory_budget=budget))
    capacity = result.stats["capacity"]
    for side, page in (("before", 16), ("after", 256)):
        per_seq = 2**18 - facts.state_bytes_per_sequence
        tokens = per_seq // (page * facts.kv_bytes_per_token) * page
        assert capacity[side]["context_at_concurrency"] == {"concurrency": 4, "tokens": tokens}
        per_seq_bytes = facts.state_bytes_per_sequence + -(-512 // page) * page * facts.kv_bytes_per_token
        assert capacity[side]["sequences_at_context"] == {"context": 512, "sequences": 2**20 // per_seq_bytes}
    assert capacity["before"]["context_at_concurrency"]["tokens"] > capacity["after"]["context_at_concurrency"]["tokens"]
    json.dumps(result.stats)  # the report is JSON


@pytest.mark.parametrize("model", ["qwen3_5_moe"], indirect=True)
def test_compile_reports_the_page_size_and_a_fixed_one_wins(tmp_path, model):
    """Through the compile driver: the tpu build has 256-token pages (capped at --max-context), recorded in the
    artifact's manifest; --page-size 32 is kept by the pass on the same target."""
    from qcompile.compiler.driver import CompileOptions, compile_checkpoint

    ckpt, _, _, _ = model
    out = tmp_path / "tpu"
    report = compile_checkpoint(CompileOptions(checkpoint=ckpt.path, passes="kv-page-resize", output=out,
                                               target="tpu", verify="final",
                                               cache=CacheConfig(max_seqs=2, max_context=128, max_step_tokens=16)),
                                emit=lambda line: None)
    assert json.loads((out / "manifest.json").read_text())["page_size"] == 128
    assert report["passes"]["passes"][0]["stats"]["page_size"] == "16 -> 128"
    fixed = compile_checkpoint(attrs.evolve(CompileOptions(checkpoint=ckpt.path, passes="kv-page-resize",
                                                           target="tpu", verify="none"), page_size=32),
                               emit=lambda line: None)
    assert "fixed by --page-size 32" in fixed["passes"]["passes"][0]["reason"]
