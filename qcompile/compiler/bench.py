"""`qcompile bench`: throughput, latency and % of roofline of a compiled model beside its peers, in one run.

What a run does: reads the checkpoint (or artifact), builds the selected pipeline (with `--ablate`: none, all, all
minus each pass and none plus each pass; every build equivalence-checked against the unoptimized graph, target rules
against reference rules), measures the machine's ceilings, then for each concurrency serves the same seeded prompts
on every build — and on transformers with `--compare transformers` — and prints one table: prefill and decode tok/s
measured apart, TTFT / TPOT / ITL, output tok/s and % of roofline; then the ratios to transformers. `--json` writes
the schema documented in docs/benchmarks.md; `--plot` a bar chart. Ctrl-C prints what was measured so far.
How each number is measured: qcompile/compiler/measure.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import attrs
import numpy as np

import qcompile
from qcompile.compiler.builds import Build, builds_from_checkpoint
from qcompile.compiler.measure import (SCHEMA_VERSION, Roofline, bench_engine, bench_engine_rate, bench_transformers,
                                       best_ceilings, conversation_len, load_transformers, log, make_prompts,
                                       measure_ceilings, transformers_available, workload_shape)
from qcompile.errors import UsageError
from qcompile.ir.abi import CacheConfig
from qcompile.ir.lowering import host_target
from qcompile.passes.registry import PASSES
from qcompile.runtime.memory import reset_peak
from qcompile.runtime.sampling import GREEDY, Sampling

COMPARE_CHOICES = ("transformers",)


@attrs.frozen
class BenchOptions:
    source: Path
    workload: str = "decode-heavy"
    input_len: int | None = None
    output_len: int | None = None
    scale: int = 64  # full-size workload shapes divided by this on a machine that cannot hold them
    concurrency: tuple[int, ...] = (1, 8, 32)
    num_prompts: int | None = None  # per concurrency; default one wave (= the concurrency)
    passes: str | None = None  # None: "all" for a checkpoint; not allowed for an artifact
    compare: tuple[str, ...] = ()
    ablate: bool = False
    json_path: Path | None = None
    plot_path: Path | None = None
    seed: int = 0
    dtype: str | None = None
    max_step_tokens: int = 512
    verify: str = "final"
    memory_budget: int | None = None  # bytes; each engine refuses a cache configuration that would not fit
    request_rate: float | None = None  # requests/s arriving (Poisson) through the scheduler; None: waves
    mesh: object = None  # ir.mesh.Mesh: lay the builds out on it (gqa-sharding); None: one device
    url: str | None = None  # measure the server there (compiler/bench_http.py) instead of a build in this process
    sampling: Sampling = GREEDY  # temperature / top-k / top-p of every request; request i draws with seed + i
    n: int = 1  # choices per prompt (scheduler only): measured sharing the prompt's prefill and without
    turns: int = 1  # requests per conversation (scheduler only): measured with the prefix cache and without
    shared_prefix: int = 0  # tokens every prompt starts with (scheduler or --url): with the prefix cache and without
    reasoning: int = 0  # with turns: each reply's first tokens, which the next turn's prompt leaves out (thinking)
    prefix_slots: int | None = None  # slots beyond the concurrency for the prefix cache (None: 1 per rank, as serve)


def sampling_note(sampling: Sampling) -> str:
    adjusted = "".join(f", {name.replace('_', ' ')} {value:g}" for name, value in sampling.adjustments().items())
    if sampling.greedy:
        return "greedy" + adjusted
    return (f"sampled: temperature {sampling.temperature:g}, top-k {sampling.top_k or 'off'}, top-p "
            f"{sampling.top_p:g}{adjusted}, request i seeded {sampling.seed} + i")


def _sampling_json(sampling: Sampling) -> dict:
    return {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
            "seed": sampling.seed, **sampling.adjustments()}


def ablation_specs(names: list[str]) -> list[str]:
    specs = ["none", "all"]
    specs += [f"all,-{n}" for n in names]
    specs += [n for n in names]
    return specs


# Upper bounds checked before anything is built (a mistyped 100000000 would otherwise make that many prompts first).
MAX_CONCURRENCY = 65536
MAX_PROMPTS = 1_000_000


def _check_outputs(opts: BenchOptions) -> None:
    for flag, path in (("--json", opts.json_path), ("--plot", opts.plot_path)):
        if path is not None and not Path(path).parent.resolve().is_dir():
            raise UsageError(f"{flag} {path}: directory {Path(path).parent} does not exist")
    if opts.plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib; install the bench extra: pip install 'qcompile[bench]'") from None
    for c in opts.concurrency:
        if not 1 <= c <= MAX_CONCURRENCY:
            raise UsageError(f"--concurrency values must be in 1..{MAX_CONCURRENCY}, got {c}")
    if opts.num_prompts is not None and not 1 <= opts.num_prompts <= MAX_PROMPTS:
        raise UsageError(f"--num-prompts must be in 1..{MAX_PROMPTS}, got {opts.num_prompts}")
    unknown = [c for c in opts.compare if c not in COMPARE_CHOICES]
    if unknown:
        raise UsageError(f"--compare {unknown[0]!r} is not supported; choose {', '.join(COMPARE_CHOICES)}")
    if "transformers" in opts.compare and (reason := transformers_available()):
        raise UsageError(reason)
    if not 1 <= opts.n <= 64:
        raise UsageError(f"--n must be in 1..64, got {opts.n}")
    if not 1 <= opts.turns <= 64:
        raise UsageError(f"--turns must be in 1..64, got {opts.turns}")
    if opts.shared_prefix < 0:
        raise UsageError(f"--shared-prefix-len must be at least 0, got {opts.shared_prefix}")
    if opts.shared_prefix and opts.request_rate is None and opts.url is None:
        raise UsageError("--shared-prefix-len serves through the scheduler: give --request-rate (inf: all at once), or "
                         "--url of a running server")
    if opts.n > 1 and opts.request_rate is None and opts.url is None:
        raise UsageError("--n serves through the scheduler: give --request-rate (inf: all at once), or --url of a "
                         "running server")
    if opts.turns > 1 and opts.request_rate is None and opts.url is None:
        raise UsageError("--turns serves through the scheduler: give --request-rate (inf: all at once), or --url of a "
                         "running server")
    if opts.prefix_slots is not None:
        if opts.prefix_slots < 0:
            raise UsageError(f"--prefix-slots must be at least 0, got {opts.prefix_slots}")
        if opts.url is not None or opts.request_rate is None or (opts.turns < 2 and not opts.shared_prefix):
            raise UsageError("--prefix-slots sizes the prefix cache of this process's scheduler: give it with "
                             "--request-rate and --turns or --shared-prefix-len, without --url")
    if opts.reasoning and opts.turns < 2:
        raise UsageError("--reasoning-len shapes the later turns of a conversation: give --turns 2 or more")
    if opts.n > 1 and (opts.turns > 1 or opts.shared_prefix):
        raise UsageError("--n measures shared prefills, --turns and --shared-prefix-len the prefix cache; give --n "
                         "alone")
    if opts.request_rate is not None:
        if not opts.request_rate > 0:
            raise UsageError(f"--request-rate must be positive (or inf), got {opts.request_rate}")
        if opts.compare:
            raise UsageError("--compare transformers serves in lock-step waves (transformers eager has no continuous "
                             "batching here); measure it without --request-rate")


def _check_transformers_loads(source) -> None:
    """An FP8 checkpoint is refused for --compare before any work: transformers loads FP8 through its fine-grained FP8
    quantizer, which needs `accelerate` (not a dependency here) and runs its FP8 matmuls on GPUs."""
    from qcompile.frontend.checkpoint import resolve_paths
    from qcompile.frontend.config import load_config

    config_path, _ = resolve_paths(source)
    if load_config(config_path).quantization is not None:
        raise UsageError("--compare transformers: transformers cannot run this FP8 checkpoint here (its FP8 loader "
                         "needs accelerate and a GPU); bench it without --compare, and compare transformers on a float "
                         "checkpoint of the same shapes")


def run_bench(opts: BenchOptions, emit=print) -> dict:
    """Run the benchmark; returns the report (the --json content)."""
    from qcompile.runtime.artifact import is_artifact

    _check_outputs(opts)
    input_len, output_len, shape_note = workload_shape(opts.workload, opts.input_len, opts.output_len, opts.scale)
    if opts.shared_prefix >= input_len:
        raise UsageError(f"--shared-prefix-len {opts.shared_prefix} must be below the prompt length {input_len} (each "
                         "prompt needs a token of its own)")
    if opts.shared_prefix:
        shape_note += f", every prompt starting with the same {opts.shared_prefix} tokens"
    if not 0 <= opts.reasoning <= output_len:
        raise UsageError(f"--reasoning-len must be in 0..{output_len} (the --output-len), got {opts.reasoning}")
    if opts.reasoning:
        shape_note += f", each reply's first {opts.reasoning} tokens left out of the next turn's prompt"
    if opts.url is not None:
        return _bench_server(opts, emit, input_len, output_len, shape_note)
    artifact = is_artifact(opts.source)
    if artifact and (opts.passes is not None or opts.ablate):
        raise UsageError("--passes and --ablate need a checkpoint: an artifact's passes were fixed when it was compiled")
    if artifact and opts.compare:
        raise UsageError("--compare transformers needs the checkpoint (transformers cannot load an artifact)")
    if opts.compare and not artifact:
        _check_transformers_loads(opts.source)
    if artifact and opts.dtype:
        raise UsageError("--dtype does not apply to an artifact: its dtype was fixed when it was compiled")
    if artifact and opts.prefix_slots is not None:
        raise UsageError("--prefix-slots does not apply to an artifact: its slots were fixed when it was compiled")
    if artifact and opts.mesh is not None:
        raise UsageError("--mesh does not apply to an artifact: its layout was fixed when it was compiled")
    started = time.perf_counter()
    if artifact:
        from qcompile.runtime.artifact import load_artifact

        art = load_artifact(opts.source)
        if art.weights_note:
            print(art.weights_note, file=sys.stderr)
        graph = art.graph()
        builds = [Build(str(art.manifest.get("pipeline", "artifact")), [], graph, art.manifest.get("equivalence"))]
        params, vocab, dtype = art.params, int(art.config_json["vocab_size"]), graph.meta["dtype"]
        target, ckpt = art.manifest.get("lowering", host_target()), None
        limit = art.cache_config
        too_big = [c for c in opts.concurrency if c > limit.max_seqs]
        if too_big or input_len + output_len > limit.max_context:
            raise UsageError(f"the artifact serves at most {limit.max_seqs} sequences of {limit.max_context} tokens; "
                             f"concurrency {max(opts.concurrency)} with {input_len}+{output_len} tokens does not fit — "
                             "recompile with larger --max-seqs / --max-context")
    else:
        specs = ablation_specs(list(PASSES)) if opts.ablate else [opts.passes if opts.passes is not None else "all"]
        ckpt, params, builds, target = builds_from_checkpoint(
            opts.source, specs, dtype=opts.dtype, mesh=opts.mesh, verify=opts.verify, seed=opts.seed, emit=emit,
            options=(("concurrency", max(opts.concurrency)), ("max_context", input_len + output_len)))
        vocab, dtype = ckpt.config.vocab_size, builds[0].graph.meta["dtype"]
        ckpt.warn_context(input_len + output_len, "--input-len + --output-len")
    setup_seconds = time.perf_counter() - started
    log("measuring the machine's ceilings (copy bandwidth, matmul rate)")
    ceilings = measure_ceilings()
    emit(f"machine: {ceilings['backend']}, {ceilings['threads']} threads; copy {ceilings['copy_bytes_per_s'] / 1e9:.1f} "
         f"GB/s, read {ceilings['read_bytes_per_s'] / 1e9:.1f} GB/s; matmul f32 {ceilings['matmul_flops_per_s']['f32'] / 1e9:.0f} GFLOP/s, bf16 "
         f"{ceilings['matmul_flops_per_s']['bf16'] / 1e9:.0f} GFLOP/s")
    emit(f"workload: {shape_note}; concurrency {', '.join(map(str, opts.concurrency))}; seed {opts.seed}; "
         f"{sampling_note(opts.sampling)}")
    runs: list[dict] = []
    measured: list = []  # the Measurement behind each run, to price its roofline at the run's best ceilings
    report = {
        "schema_version": SCHEMA_VERSION, "qcompile_version": qcompile.__version__, "command": sys.argv[1:],
        "source": str(opts.source), "workload": opts.workload, "shape": shape_note, "input_len": input_len,
        "output_len": output_len, "request_rate": opts.request_rate, "sampling": _sampling_json(opts.sampling),
        "dtype": dtype, "lowering": target,
        "machine": ceilings,
        "setup_seconds": round(setup_seconds, 3),
        "builds": [{"label": b.label, "passes": b.passes, "check": b.check} for b in builds], "runs": runs}
    hf_model = None

    cached = opts.turns > 1 or opts.shared_prefix > 0  # measured with the prefix cache and without

    def measure() -> None:
        nonlocal hf_model
        for concurrency in opts.concurrency:
            num = opts.num_prompts or concurrency
            prompts = make_prompts(num, input_len, vocab, opts.seed, opts.shared_prefix)
            ranks = opts.mesh.size if opts.mesh is not None else 1  # whole slots per data-parallel rank
            context = conversation_len(input_len, output_len, opts.turns, opts.reasoning)
            requests = -(-concurrency // ranks) * ranks
            # prefix-cache slots, rounded up to whole ones on each rank (default: one on each, as serve gives)
            slots = 1 if opts.prefix_slots is None else opts.prefix_slots
            kept = -(-slots // ranks) * ranks if cached else 0
            cache = CacheConfig(max_seqs=requests + kept, max_context=context, max_step_tokens=opts.max_step_tokens)
            experts: dict = {}
            for build in builds:
                log(f"qcompile [{build.label}] at concurrency {concurrency}: compiling and warming up, then "
                    f"{num} requests")
                reset_peak()
                engine = _engine(art if artifact else None, build, params, cache, target, opts.memory_budget)
                roofline = Roofline(build.graph, engine.sizes, ceilings, dtype)
                if opts.n > 1 or cached:  # with the sharing (the prefix cache), then without, same build
                    off = "qcompile-unshared" if opts.n > 1 else "qcompile-no-prefix-cache"
                    done = [bench_engine_rate(engine, "qcompile" if share else off, build.label, prompts, output_len,
                                              concurrency, opts.request_rate, opts.seed, lambda: None, opts.sampling,
                                              opts.n, share, opts.turns, prefix_cache=share and cached,
                                              max_running=requests, reasoning=opts.reasoning)
                            for share in (True, False)]
                elif opts.request_rate is not None:
                    done = [bench_engine_rate(engine, "qcompile", build.label, prompts, output_len, concurrency,
                                              opts.request_rate, opts.seed, lambda: None, opts.sampling)]
                else:
                    done = [bench_engine(engine, "qcompile", build.label, prompts, output_len, concurrency, roofline,
                                         build.graph, target, lambda: None, opts.sampling)]
                extra = {**_workload_keys(opts), **({"prefix_slots": kept} if cached else {})}
                for m in done:
                    experts = experts or m.experts_touched
                    runs.append({**m.to_json(), **extra, "memory": engine.memory(build.graph)})
                    measured.append(m)
                    _progress(runs[-1])
                del engine
            if "transformers" in opts.compare:
                log(f"transformers eager at concurrency {concurrency}")
                if hf_model is None:
                    hf_model = load_transformers(_hf_dir(ckpt), dtype)
                roofline = Roofline(builds[0].graph, cache.sizes(int(builds[0].graph.meta["page_size"])), ceilings,
                                    dtype)
                m = bench_transformers(_hf_dir(ckpt), dtype, prompts, output_len, concurrency, roofline, experts,
                                       lambda: None, model=hf_model, sampling=opts.sampling)
                runs.append(m.to_json())
                measured.append(m)
                _progress(runs[-1])
        _reprice(report, measured, dtype, ceilings, emit)

    return _reported(report, opts, emit, measure)


def _reprice(report: dict, measured: list, dtype: str, ceilings: dict, emit) -> None:
    """Measure the ceilings again after the runs and price every run's roofline at the best of both (the machine's
    speed can drift during a bench: a slow first measurement would overstate every % of roofline)."""
    log("measuring the machine's ceilings again")
    report["machine"] = best = best_ceilings([ceilings, measure_ceilings()])
    emit(f"machine, best of before and after the runs: read {best['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; matmul "
         f"f32 {best['matmul_flops_per_s']['f32'] / 1e9:.0f} GFLOP/s, bf16 {best['matmul_flops_per_s']['bf16'] / 1e9:.0f} "
         "GFLOP/s (the rooflines below are priced at these)")
    for run, m in zip(report["runs"], measured):
        m.at_ceilings(best, dtype)
        fresh = m.to_json()
        for key in ("roofline_prefill", "roofline_decode", "roofline_seconds"):
            run[key] = fresh[key]


def _reported(report: dict, opts: BenchOptions, emit, measure) -> dict:
    """Run `measure()` (which appends to report["runs"]); the report is printed and written when it finishes and when
    it is interrupted (Ctrl-C: what was measured so far)."""
    try:
        measure()
    except KeyboardInterrupt:
        report["interrupted"] = True
        emit("interrupted: what was measured so far")
        _finish(report, opts, emit)
        raise
    _finish(report, opts, emit)
    return report


def _bench_server(opts: BenchOptions, emit, input_len: int, output_len: int, shape_note: str) -> dict:
    """bench --url: the same prompts, arrivals and metrics against a running server."""
    from qcompile.compiler.bench_http import bench_url

    given = [flag for flag, value in (("CHECKPOINT", opts.source), ("--passes", opts.passes),
                                      ("--compare", opts.compare), ("--ablate", opts.ablate), ("--dtype", opts.dtype),
                                      ("--mesh", opts.mesh), ("--memory-budget", opts.memory_budget)) if value]
    if given:
        raise UsageError(f"{', '.join(given)} do not apply to --url: the server's build is fixed (bench it "
                         "in-process to compare builds)")
    emit(f"server: {opts.url}")
    emit(f"workload: {shape_note}; concurrency {', '.join(map(str, opts.concurrency))}; seed {opts.seed}; "
         f"{sampling_note(opts.sampling)}")
    runs: list[dict] = []
    report = {"schema_version": SCHEMA_VERSION, "qcompile_version": qcompile.__version__, "command": sys.argv[1:],
              "source": opts.url, "workload": opts.workload, "shape": shape_note, "input_len": input_len,
              "output_len": output_len, "request_rate": opts.request_rate, "sampling": _sampling_json(opts.sampling),
              "runs": runs}

    def measure() -> None:
        for concurrency in opts.concurrency:
            runs.append(bench_url(opts.url, input_len, output_len, concurrency, opts.num_prompts or concurrency,
                                  opts.request_rate, opts.seed, opts.sampling, opts.shared_prefix, opts.turns,
                                  opts.reasoning, opts.n))
            runs[-1].update(_workload_keys(opts))
            _progress(runs[-1])

    return _reported(report, opts, emit, measure)


def _hf_dir(ckpt) -> Path:
    return ckpt.path if ckpt.path.is_dir() else ckpt.path.parent


def _engine(art, build: Build, params, cache: CacheConfig, target: str, memory_budget: int | None):
    from qcompile.runtime.engine import Engine

    if art is not None:
        return Engine(art.program, art.params, art.cache_config, memory_budget=memory_budget)
    return Engine(build.graph, build.params, cache, target, memory_budget)


def _workload_keys(opts: BenchOptions) -> dict:
    """The run record's keys for the workload options given (docs/benchmarks.md): n, turns, shared_prefix_len,
    reasoning_len."""
    given = {"n": opts.n > 1, "turns": opts.turns > 1, "shared_prefix_len": opts.shared_prefix > 0,
             "reasoning_len": opts.reasoning > 0}
    values = {"n": opts.n, "turns": opts.turns, "shared_prefix_len": opts.shared_prefix,
              "reasoning_len": opts.reasoning}
    return {key: values[key] for key, on in given.items() if on}


def _progress(run: dict) -> None:
    cache = run.get("prefix_cache")
    hits = f"; prefix cache: {cache['hits']} hits, {cache['hit_tokens']} prompt tokens not fed again, " \
        f"{cache['snapshots']} snapshots" if cache else ""
    log(f"  {run['engine']} [{run['passes']}] c={run['concurrency']}: prefill {_fmt(run['prefill_tok_s'])} tok/s, "
        f"decode {_fmt(run['decode_tok_s'])} tok/s{hits}")


def _finish(report: dict, opts: BenchOptions, emit) -> None:
    runs = report["runs"]
    report["ratios"] = ratios(runs)
    if runs:
        emit(table(runs))
        for line in report["ratios"]:
            emit(line)
    if opts.json_path is not None:
        Path(opts.json_path).write_text(json.dumps(report, indent=2, default=str) + "\n")
        emit(f"wrote {opts.json_path}")
    if opts.plot_path is not None and runs:
        plot(runs, Path(opts.plot_path))
        emit(f"wrote {opts.plot_path}")


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _peak_gib(run: dict) -> float | None:
    """A qcompile run's peak resident set (reset before its engine was made); None for transformers, which runs in
    the same process beside qcompile's weights (benchmarks/memory.py measures each in its own process)."""
    peak = (run.get("memory") or {}).get("peak_rss_bytes")
    return None if peak is None else peak / 2**30


def table(runs: list[dict]) -> str:
    head = (f"{'engine':<22} {'passes':<14} {'conc':>4} {'prefill tok/s':>13} {'decode tok/s':>12} "
            f"{'TTFT ms':>9} {'TPOT ms':>9} {'ITL p99':>8} {'out tok/s':>9} {'roof pre':>8} {'roof dec':>8} "
            f"{'peak GiB':>8}")
    lines = [head, "-" * len(head)]
    for r in runs:
        lines.append(
            f"{r['engine']:<22} {r['passes'][:14]:<14} {r['concurrency']:>4} {_fmt(r['prefill_tok_s']):>13} "
            f"{_fmt(r['decode_tok_s']):>12} {_fmt(r['ttft_ms']['mean']):>9} {_fmt(r['tpot_ms']['mean'], '.2f'):>9} "
            f"{_fmt(r['itl_ms']['p99'], '.2f'):>8} {_fmt(r['output_tok_s']):>9} "
            f"{_fmt(None if r['roofline_prefill'] is None else 100 * r['roofline_prefill'], '.0f') + '%':>8} "
            f"{_fmt(None if r['roofline_decode'] is None else 100 * r['roofline_decode'], '.0f') + '%':>8} "
            f"{_fmt(_peak_gib(r), '.2f'):>8}")
    return "\n".join(lines)


def ratios(runs: list[dict], baseline: str = "transformers") -> list[str]:
    """qcompile ÷ baseline per concurrency, prefill and decode."""
    base = {r["concurrency"]: r for r in runs if r["engine"] == baseline}
    lines = []
    for r in runs:
        b = base.get(r["concurrency"])
        if r["engine"] == baseline or b is None:
            continue
        parts = []
        for key, name in (("prefill_tok_s", "prefill"), ("decode_tok_s", "decode")):
            if r[key] and b[key]:
                parts.append(f"{name} {r[key] / b[key]:.2f}×")
        lines.append(f"{r['engine']} ({r['passes']}) vs {baseline} at concurrency {r['concurrency']}: "
                     + ", ".join(parts))
    return lines


def plot(runs: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib; install the bench extra: pip install 'qcompile[bench]'") from None
    labels = [f"{r['engine']}\n{r['passes']}\nc={r['concurrency']}" for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 2.0 * len(runs)), 4.5))
    x = np.arange(len(runs))
    for ax, key, roof, title in ((axes[0], "prefill_tok_s", "roofline_prefill", "prefill"),
                                 (axes[1], "decode_tok_s", "roofline_decode", "decode")):
        values = [r[key] or 0.0 for r in runs]
        bars = ax.bar(x, values, color=["#888888" if r["engine"] == "transformers" else "#3366cc" for r in runs])
        for bar, r in zip(bars, runs):
            if r[roof] is not None:
                ax.annotate(f"{100 * r[roof]:.0f}%", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel("tok/s")
        ax.set_title(f"{title} tok/s (label: % of roofline)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
