"""`qcompile bench` on a tiny checkpoint: the report's schema, the transformers peer, the roofline's cost rules,
Ctrl-C, and the usage errors. Numbers are not asserted to be fast (no timed tests); they are asserted to be
consistent (tokens counted, fractions in range, ratios computed from the rows)."""

from __future__ import annotations

import json
import math

import attrs
import numpy as np
import pytest

from qcompile.cli import main
from qcompile.compiler import bench as bench_mod
from qcompile.compiler.bench import BenchOptions, ablation_specs, run_bench
from qcompile.compiler.measure import workload_shape
from qcompile.errors import UsageError
from qcompile.frontend.checkpoint import Checkpoint
from qcompile.frontend.tiny import write_tiny
from qcompile.ir.cost import StepShape, step_cost
from qcompile.ir.importer import build_graph
from qcompile.ir.ops.moe import GroupedMatmul
from qcompile.runtime.engine import Engine
from qcompile.runtime.sampling import Sampling

RUN_KEYS = {"engine", "passes", "concurrency", "input_len", "output_len", "prefill_tok_s", "decode_tok_s", "ttft_ms",
            "tpot_ms", "itl_ms", "roofline_prefill", "roofline_decode", "request_throughput", "output_tok_s",
            "total_tok_s"}


FAKE_CEILINGS = {"threads": 2, "backend": "cpu", "copy_bytes_per_s": 1e10, "read_bytes_per_s": 1e10,
                 "bandwidth_bytes_per_s": 1e10, "matmul_flops_per_s": {"f32": 1e11, "bf16": 1e11}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("bench") / "ckpt", family="qwen3_5_moe", seed=3)


SAMPLING = Sampling(temperature=0.9, top_k=5, top_p=0.8, seed=7)


def _recording_steps(patch, seen: list) -> None:
    """Record (seeds, counters) of every engine step launched (seeds None when greedy; `step_tokens` launches too)."""
    real = Engine.launch_tokens

    def recording(self, work, sampling=None, counters=None, *rest, **named):
        seen.append((tuple(p.seed for p in sampling) if sampling else None, tuple(counters or ())))
        return real(self, work, sampling, counters, *rest, **named)

    patch.setattr(Engine, "launch_tokens", recording)


@pytest.fixture(scope="module")
def report(tiny, tmp_path_factory):
    """One sampled run at concurrency 1 and 2 (one wave each) beside transformers; qcompile's steps recorded."""
    out = tmp_path_factory.mktemp("bench_out")
    opts = BenchOptions(source=tiny, input_len=12, output_len=4, concurrency=(1, 2), num_prompts=None,
                        compare=("transformers",), json_path=out / "b.json", sampling=SAMPLING)
    lines: list[str] = []
    seen: list[tuple] = []
    with pytest.MonkeyPatch.context() as patch:
        _recording_steps(patch, seen)
        result = run_bench(opts, emit=lines.append)
    return result, lines, out / "b.json", seen


def test_report_schema_and_counts(report):
    result, lines, path, _ = report
    assert json.loads(path.read_text()) == json.loads(json.dumps(result, default=str))
    assert result["input_len"] == 12 and result["output_len"] == 4
    machine = result["machine"]
    assert machine["threads"] >= 1 and machine["copy_bytes_per_s"] > 1e8
    assert machine["matmul_flops_per_s"]["f32"] > 1e8 and machine["matmul_flops_per_s"]["bf16"] > 1e7
    engines = [(r["engine"], r["concurrency"]) for r in result["runs"]]
    assert engines == [("qcompile", 1), ("transformers", 1), ("qcompile", 2), ("transformers", 2)]
    for run in result["runs"]:
        assert RUN_KEYS <= set(run)
        c = run["concurrency"]
        assert run["requests"] == c
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert set(run[key]) == {"mean", "median", "p99"} and run[key]["mean"] > 0
        assert run["prefill_tok_s"] > 0 and run["decode_tok_s"] > 0
        # decode tok/s is tokens over the time spent in decode steps: (output_len - 1) tokens per request
        seconds = run["measured_seconds"]["decode"]
        assert math.isclose(run["decode_tok_s"] * seconds, c * 3, rel_tol=1e-9)
        assert 0 < run["roofline_decode"] and 0 < run["roofline_prefill"]
        if run["engine"] == "qcompile":  # where the memory went (tests/test_memory.py checks the figures)
            memory = run["memory"]
            assert memory["weights"]["bytes"] > 0 and memory["peak_rss_bytes"] >= memory["weights"]["bytes"]
            assert memory["caches"]["kv_pages"] > 0 and memory["caches"]["gdn_state"] > 0
            assert memory["temporaries"]["largest_bytes"] > 0
    assert result["builds"][0]["check"]["ok"] is True
    assert any("vs transformers at concurrency 2" in line for line in result["ratios"])
    table = "\n".join(lines)
    assert "prefill tok/s" in table and "transformers" in table and "peak GiB" in table


def test_experts_touched_are_probed(report):
    result, _, _, _ = report
    run = result["runs"][0]
    # tiny preset: 8 experts, top-2; one decode token routes to exactly 2 experts per layer
    assert run["experts_touched"]["decode"] == 2.0
    assert 2.0 <= run["experts_touched"]["prefill"] <= 8.0


def test_cost_rules_count_what_must_move(tiny):
    graph = build_graph(Checkpoint.open(tiny))
    sizes = {"B": 2, "M": 4, "P": 8, "S": 2}
    one = step_cost(graph, sizes, StepShape((1,), (10,), 1, experts_touched=2.0))
    more = step_cost(graph, sizes, StepShape((1,), (10,), 1, experts_touched=4.0))
    gmms = graph.find(GroupedMatmul)
    per_expert = sum(int(np.prod(graph.type_of(n.operands[1]).shape[1:])) * 4 for n in gmms)
    assert math.isclose(more.bytes - one.bytes, 2.0 * per_expert)  # only the touched experts' weights count
    longer = step_cost(graph, sizes, StepShape((1,), (20,), 1, experts_touched=2.0))
    kv_row = 2 * 64 * 4  # Hkv 2 × head_dim 64 × f32, for k and for v
    assert math.isclose(longer.bytes - one.bytes, 10 * 2 * kv_row)  # KV read follows the live context
    assert StepShape((3, 1), (3, 5), 2, 0.0).attended_keys() == (1 + 2 + 3) + 5


def test_workload_scaling_and_ablation_specs():
    assert workload_shape("prefill-heavy", None, None, 64)[:2] == (128, 16)
    assert workload_shape("decode-heavy", None, None, 64)[:2] == (16, 128)
    assert workload_shape("decode-heavy", 128, 32, 64)[:2] == (128, 32)
    assert ablation_specs(["a", "b"]) == ["none", "all", "all,-a", "all,-b", "a", "b"]
    with pytest.raises(UsageError):
        workload_shape("decode-heavy", 0, None, 64)


def test_rooflines_are_priced_at_the_best_ceilings_measured_before_and_after(tiny, monkeypatch):
    """The ceilings are measured before the runs and again after; every run's roofline (qcompile's and transformers')
    is priced at the higher of each: with the second measurement 4x the first, the roofline seconds are a quarter of
    what the first alone gives, and the report keeps both measurements."""
    slow = {**FAKE_CEILINGS, "matmul_flops_per_s": dict(FAKE_CEILINGS["matmul_flops_per_s"])}
    fast = {**slow, "copy_bytes_per_s": 4e10, "read_bytes_per_s": 4e10, "bandwidth_bytes_per_s": 4e10,
            "matmul_flops_per_s": {"f32": 4e11, "bf16": 4e11}}
    opts = BenchOptions(source=tiny, input_len=8, output_len=3, concurrency=(1,), verify="none",
                        compare=("transformers",))
    seconds = {}
    for name, sequence in (("same", [slow, slow]), ("drifted", [slow, fast])):
        given = iter(sequence)
        monkeypatch.setattr(bench_mod, "measure_ceilings", lambda: next(given))
        result = run_bench(opts, emit=lambda line: None)
        seconds[name] = [(run["roofline_seconds"]["prefill"], run["roofline_seconds"]["decode"])
                         for run in result["runs"]]
    assert result["machine"]["bandwidth_bytes_per_s"] == 4e10 and result["machine"]["matmul_flops_per_s"]["f32"] == 4e11
    assert [m["bandwidth_bytes_per_s"] for m in result["machine"]["measurements"]] == [1e10, 4e10]
    assert len(seconds["same"]) == 2 and all(p > 0 and d > 0 for p, d in seconds["same"])
    for (p1, d1), (p4, d4) in zip(seconds["same"], seconds["drifted"]):
        assert p4 == pytest.approx(p1 / 4) and d4 == pytest.approx(d1 / 4)


def test_ctrl_c_prints_what_was_measured(tiny, monkeypatch, tmp_path):
    real = bench_mod.bench_engine
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_mod, "bench_engine", interrupted)
    monkeypatch.setattr(bench_mod, "measure_ceilings", lambda: FAKE_CEILINGS)
    lines: list[str] = []
    opts = BenchOptions(source=tiny, input_len=8, output_len=2, concurrency=(1, 1), json_path=tmp_path / "p.json",
                        verify="none")
    with pytest.raises(KeyboardInterrupt):
        run_bench(opts, emit=lines.append)
    partial = json.loads((tmp_path / "p.json").read_text())
    assert partial["interrupted"] is True and len(partial["runs"]) == 1
    assert any("interrupted" in line for line in lines) and any("qcompile" in line for line in lines)


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "0"], "must be in 1..65536"),
    (["--concurrency", "1,x"], "comma-separated"),
    (["--json", "/nonexistent-dir/x.json"], "does not exist"),
    (["--input-len", "0"], "at least 1"),
])
def test_bench_usage_errors(tiny, capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", str(tiny), *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_compare_without_transformers_is_a_clear_line(tiny, capsys, monkeypatch):
    monkeypatch.setattr(bench_mod, "transformers_available", lambda: "--compare transformers needs transformers")
    with pytest.raises(SystemExit) as exit_:
        main(["bench", str(tiny), "--compare", "transformers"])
    assert exit_.value.code == 2 and "needs transformers" in capsys.readouterr().err


def test_requests_arriving_at_a_rate_are_served_by_continuous_batching(tiny):
    """--request-rate: 5 requests arriving at 50/s, at most 2 at once, through the scheduler; every request completes
    with output_len tokens, TTFT counts from its arrival, and prefill/decode tok/s are not claimed (mixed steps)."""
    opts = BenchOptions(source=tiny, input_len=6, output_len=5, concurrency=(2,), num_prompts=5, request_rate=50.0,
                        verify="none", max_step_tokens=16)
    result = run_bench(opts, emit=lambda line: None)
    (run,) = result["runs"]
    assert result["request_rate"] == 50.0
    assert run["requests"] == 5 and run["complete"]
    assert run["output_tok_s"] * run["measured_seconds"]["duration"] == pytest.approx(5 * 5)
    assert run["prefill_tok_s"] is None and run["decode_tok_s"] is None
    assert run["ttft_ms"]["mean"] > 0 and run["tpot_ms"]["mean"] > 0
    assert run["measured_seconds"]["warmup"] > 0  # every bucket compiled before the first arrival


def test_choices_per_prompt_are_measured_sharing_the_prefill_and_without(tiny):
    """--n 3: two prompts, each asking for three sampled choices, through the scheduler: one run whose choices share
    their prompt's prefill (as serve's n does) and one feeding each choice on its own; both make every token (the
    same ones: tested in test_scheduler.py). Without --request-rate it is refused."""
    opts = BenchOptions(source=tiny, input_len=12, output_len=3, concurrency=(6,), num_prompts=2, request_rate=math.inf,
                        verify="none", max_step_tokens=16, n=3, sampling=SAMPLING)
    result = run_bench(opts, emit=lambda line: None)
    shared, separate = result["runs"]
    assert (shared["engine"], separate["engine"]) == ("qcompile", "qcompile-unshared")
    for run in (shared, separate):
        assert run["n"] == 3 and run["requests"] == 6 and run["complete"]
        assert run["output_tok_s"] * run["measured_seconds"]["duration"] == pytest.approx(6 * 3)
    for changes in ({"request_rate": None}, {"n": 65}):
        with pytest.raises(UsageError, match="--n"):
            run_bench(BenchOptions(**{**attrs.asdict(opts, recurse=False), **changes}), emit=lambda line: None)


def test_conversations_are_measured_with_the_prefix_cache_and_without(tiny):
    """--turns 3: two conversations of three requests each, every later turn sent when the one before finishes (its
    prompt: the last prompt, the reply, new tokens): one run with the prefix cache, one without; every turn makes
    its tokens. --turns with --n, or without --request-rate, is refused."""
    opts = BenchOptions(source=tiny, input_len=12, output_len=3, concurrency=(2,), num_prompts=2, request_rate=math.inf,
                        verify="none", max_step_tokens=16, turns=3)
    cached, uncached = run_bench(opts, emit=lambda line: None)["runs"]
    assert (cached["engine"], uncached["engine"]) == ("qcompile", "qcompile-no-prefix-cache")
    for run in (cached, uncached):
        assert run["turns"] == 3 and run["requests"] == 6 and run["complete"]
        assert run["output_tok_s"] * run["measured_seconds"]["duration"] == pytest.approx(6 * 3)
    for changes in ({"request_rate": None}, {"n": 2}, {"turns": 0}):
        with pytest.raises(UsageError, match="--turns|--n"):
            run_bench(BenchOptions(**{**attrs.asdict(opts, recurse=False), **changes}), emit=lambda line: None)


def test_conversations_that_leave_the_reasoning_out_are_measured(tiny):
    """--turns 3 --reasoning-len 2: each later turn's prompt leaves the reply's first 2 tokens out (a thinking model's
    template), so no turn continues a finished sequence; each second turn snapshots its own prompt's end (16 tokens
    of 32) and each third turn starts there (two prefix-cache slots beside the two running). The run records the
    reasoning length and the prefix-cache slots; --reasoning-len without --turns or past --output-len, and
    --prefix-slots without a prefix-cache workload, are refused."""
    opts = BenchOptions(source=tiny, input_len=20, output_len=6, concurrency=(2,), num_prompts=2,
                        request_rate=math.inf, verify="none", max_step_tokens=16, turns=3, reasoning=2, prefix_slots=2)
    result = run_bench(opts, emit=lambda line: None)
    cached, uncached = result["runs"]
    assert "each reply's first 2 tokens left out of the next turn's prompt" in result["shape"]
    assert cached["prefix_cache"] == {"hits": 2, "hit_tokens": 2 * 16, "snapshots": 4}
    for run in (cached, uncached):
        assert (run["reasoning_len"], run["prefix_slots"], run["requests"]) == (2, 2, 6) and run["complete"]
    for changes, flag in (({"turns": 1, "prefix_slots": None}, "--reasoning-len"),
                          ({"reasoning": 7}, "--reasoning-len"), ({"turns": 1, "reasoning": 0}, "--prefix-slots")):
        with pytest.raises(UsageError, match=flag):
            run_bench(BenchOptions(**{**attrs.asdict(opts, recurse=False), **changes}), emit=lambda line: None)


def test_prompts_sharing_a_prefix_are_measured_with_the_prefix_cache_and_without(tiny):
    """--shared-prefix-len 40: five prompts of 48 tokens that start with the same 40, two at a time (and a prefix-cache
    slot beside them): with the prefix cache the second prompt snapshots the prefix's two whole 16-token pages and
    the three later ones start from it (reported in the run); without it each is fed whole; every request makes
    its tokens. A shared prefix as long as the prompt, or with --n, is refused."""
    opts = BenchOptions(source=tiny, input_len=48, output_len=3, concurrency=(2,), num_prompts=5,
                        request_rate=math.inf, verify="none", max_step_tokens=16, shared_prefix=40)
    result = run_bench(opts, emit=lambda line: None)
    cached, uncached = result["runs"]
    assert "every prompt starting with the same 40 tokens" in result["shape"]
    assert (cached["engine"], uncached["engine"]) == ("qcompile", "qcompile-no-prefix-cache")
    assert cached["prefix_cache"]["snapshots"] == 1 and "prefix_cache" not in uncached
    # the first is fed whole, the second makes the snapshot, the other three wait for it and start from it
    assert cached["prefix_cache"] == {"hits": 3, "hit_tokens": 3 * 32, "snapshots": 1}
    for run in (cached, uncached):
        assert run["shared_prefix_len"] == 40 and run["requests"] == 5 and run["complete"]
        assert run["output_tok_s"] * run["measured_seconds"]["duration"] == pytest.approx(5 * 3)
    for changes in ({"shared_prefix": 48}, {"n": 2}, {"request_rate": None}):
        with pytest.raises(UsageError, match="--shared-prefix-len|--n"):
            run_bench(BenchOptions(**{**attrs.asdict(opts, recurse=False), **changes}), emit=lambda line: None)


def test_arrivals_are_a_seeded_poisson_process():
    from qcompile.compiler.measure import arrival_times

    times = arrival_times(20000, 4.0, seed=1)
    assert times[0] == 0.0 and times == arrival_times(20000, 4.0, seed=1) != arrival_times(20000, 4.0, seed=2)
    gaps = np.diff(times)
    assert gaps.min() >= 0 and gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert np.std(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: the spread equals the mean
    assert arrival_times(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("changes, message", [({"request_rate": 0.0}, "must be positive"),
                                              ({"request_rate": 5.0, "compare": ("transformers",)}, "lock-step")])
def test_request_rate_options_are_checked(tiny, changes, message):
    with pytest.raises(UsageError, match=message):
        run_bench(BenchOptions(source=tiny, **changes), emit=lambda line: None)


def test_builds_whose_pipelines_make_the_same_graph_are_measured_once(tiny):
    """On one device the mesh passes have no work, so `gqa-sharding` alone builds the unoptimized graph and
    `all,-gqa-sharding` builds `all`'s: --ablate measures each distinct graph once, under every label that made it
    (and says why), instead of timing the same executable again."""
    from qcompile.compiler.builds import builds_from_checkpoint

    lines: list[str] = []
    _, _, builds, _ = builds_from_checkpoint(tiny, ["none", "all", "gqa-sharding", "all,-gqa-sharding", "swiglu-fusion"],
                                             verify="none", emit=lines.append, progress=lambda _: None)
    assert [b.label for b in builds] == ["none = gqa-sharding", "all = all,-gqa-sharding", "swiglu-fusion"]
    assert builds[1].passes and "gqa-sharding" in builds[1].passes  # the first spec's pass list
    for spec, twin in (("gqa-sharding", "none"), ("all,-gqa-sharding", "all")):
        assert f"build {spec}: the same graph as build {twin} (gqa-sharding had no work here); measured once" in lines


def test_sampled_runs_draw_each_request_with_its_own_seed_on_both_engines(report, tiny, monkeypatch):
    """--temperature/--top-k/--top-p: qcompile's steps draw request i with seed + i (waves and arrivals alike), the
    n-th generated token as the n-th draw; the report says how it sampled; transformers draws through its own
    warpers (top-k 2 never leaves the best two, top-k 1 is the argmax; a greedy run stays the argmax)."""
    import torch

    from qcompile.compiler import measure

    result, lines, _, seen = report
    assert result["sampling"] == {"temperature": 0.9, "top_k": 5, "top_p": 0.8, "seed": 7}
    assert any("sampled: temperature 0.9, top-k 5, top-p 0.8" in line for line in lines)
    decode = [step for step in seen if step[1] and step[1][0] > 0]
    assert {step[0] for step in decode} == {(7,), (7, 8)}  # c=1: request 0; c=2: requests 0 and 1
    assert {step[1] for step in decode} == {(1,), (2,), (3,), (1, 1), (2, 2), (3, 3)}
    seen.clear()
    _recording_steps(monkeypatch, seen)
    monkeypatch.setattr(Engine, "compile_all_buckets", lambda self, sampling=False, pairs=0: None)  # (time) compile on use
    run_bench(BenchOptions(source=tiny, input_len=6, output_len=3, concurrency=(2,), num_prompts=3, request_rate=100.0,
                           verify="none", sampling=SAMPLING), emit=lambda line: None)
    assert {seed for step in seen if step[0] for seed in step[0]} == {7, 8, 9}
    seen.clear()  # fewer prompts than the concurrency: the warm-up wave samples as many requests as there are
    run_bench(BenchOptions(source=tiny, input_len=6, output_len=3, concurrency=(4,), num_prompts=3, verify="none",
                           sampling=SAMPLING), emit=lambda line: None)
    assert {step[0] for step in seen if step[1] and step[1][0] > 0} == {(7, 8, 9)}

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 400)
    drawn = measure._transformers_chooser(Sampling(temperature=1.0, top_k=2, seed=1))(None, logits)
    assert set(drawn.tolist()) == {0, 1}
    for greedy in (Sampling(temperature=1.0, top_k=1), Sampling()):
        assert set(measure._transformers_chooser(greedy)(None, logits).tolist()) == {0}


def test_penalties_apply_alike_on_both_engines_and_in_waves_as_through_the_scheduler(tiny, qc_model, monkeypatch):
    """--presence-penalty / --frequency-penalty / --repetition-penalty / --min-p: transformers' chooser adjusts its
    logits as qcompile's sampler does (the same argmax over random rows with made tokens); bench's waves (pipelined:
    each step counts the token still on the device) make the scheduler's tokens; a run says and records them."""
    import torch

    from qcompile.compiler import measure
    from qcompile.ir.abi import CacheConfig
    from qcompile.runtime.sampling import History, sample
    from qcompile.runtime.scheduler import Request, Scheduler

    param = Sampling(presence_penalty=1.2, frequency_penalty=0.6, repetition_penalty=1.5)
    rng = np.random.default_rng(5)
    prompt, made = [3, 9, 27], [9, 14, 14, 30]
    logits = (rng.standard_normal((64, 40)) * 2).astype(np.float32)
    logits[:, [9, 14, 30]] += 3  # the made tokens are often the raw argmax
    ours = np.asarray(sample(logits, list(range(64)), [param] * 64, [0] * 64,
                             [History.of(prompt, list(made), param) for _ in range(64)]))[:64]
    ids = torch.tensor([prompt + made] * 64)
    theirs = measure._transformers_chooser(param)(ids, torch.tensor(logits), len(prompt)).numpy()
    assert np.array_equal(ours, theirs) and not np.array_equal(ours, logits.argmax(-1))

    engine = qc_model(tiny).engine(CacheConfig(max_seqs=2, max_context=32, max_step_tokens=16))
    prompts = [[9, 10, 11], [300, 301, 302]]  # greedy repeats made tokens (not the first) after 6 to 14 steps
    expected = [Request(p, 16, sampling=param) for p in prompts]
    Scheduler(engine).run(expected)
    launched = []
    real = Engine.launch_tokens
    monkeypatch.setattr(Engine, "launch_tokens", lambda *a, **k: launched.append(real(*a, **k)) or launched[-1])
    measure._serve_wave(engine, prompts, 16, None, None, {"prefill": None, "decode": None}, None, "cpu",
                        lambda: None, [param, param])
    assert [[step.tokens()[i] for step in launched] for i in range(2)] == [r.tokens for r in expected]
    monkeypatch.undo()

    lines: list[str] = []
    sampled = Sampling(0.9, 5, 0.8, 7, min_p=0.05, presence_penalty=1.0)
    result = run_bench(BenchOptions(source=tiny, input_len=6, output_len=3, concurrency=(2,), num_prompts=2,
                                    verify="none", compare=("transformers",), sampling=sampled), emit=lines.append)
    assert result["sampling"] == {"temperature": 0.9, "top_k": 5, "top_p": 0.8, "seed": 7, "min_p": 0.05,
                                  "presence_penalty": 1.0}
    assert any("top-p 0.8, min p 0.05, presence penalty 1, request i seeded 7" in line for line in lines)
    assert {run["engine"] for run in result["runs"]} >= {"qcompile", "transformers"}


def test_bench_on_a_mesh_with_bf16_states(tiny, capsys, monkeypatch, tmp_path):
    """`bench --mesh 2` with `all` (a tensor-parallel plan, bf16-state): the GDN states are split over two devices,
    and every new wave zeroes slots of them — by XLA's partitioner, not the native zero-slot kernel, whose custom call
    returned a replicated array that the compiled step refused (an internal error before)."""
    monkeypatch.setattr(bench_mod, "measure_ceilings", lambda: FAKE_CEILINGS)
    with pytest.raises(SystemExit) as exit_:
        main(["bench", str(tiny), "--mesh", "2", "--input-len", "4", "--output-len", "2", "--concurrency", "2",
              "--num-prompts", "4", "--verify", "none", "--json", str(tmp_path / "m.json")])
    assert exit_.value.code == 0, capsys.readouterr().err
    (run,) = json.loads((tmp_path / "m.json").read_text())["runs"]
    assert run["passes"] == "all" and run["decode_tok_s"] > 0
