"""Measuring for `qcompile bench`: serving waves on an engine or on transformers, ceilings, and the roofline.

What it measures (design.md §7, metric names as vLLM's benchmark prints them): for each concurrency c, M prompts of
fixed seed are served in waves of c — every wave prefilled together (chunked at `max_step_tokens`), then decoded in
lock-step, greedy (or drawn with `--temperature/--top-k/--top-p`, request i with seed + i, on both engines), for
exactly `output_len` tokens (EOS ignored, as serving benchmarks do), each decode step dispatched on the previous one's
tokens before they are read back (Engine.launch_tokens). Per request: TTFT (wave
start → first token), ITL (gaps between its tokens), TPOT ((latency − TTFT) / (tokens − 1)), end-to-end latency; per
run: request throughput, output and total tok/s, and prefill tok/s and decode tok/s measured apart (time inside
prefill steps and inside decode steps). Compile and warm-up (a full wave of the same shapes, untimed) are reported
apart and excluded.

The roofline (ours, stated in the report): each step's cost from the graph's cost rules (qcompile/ir/cost.py) — the
weights the batch touches (only the experts its tokens chose, probed from a real step's router output), the KV read,
the state read and written, the matmul FLOPs — against ceilings measured in the same run on the same threads: the
memory copy bandwidth and the f32/bf16 matmul rate. Roofline time of a step = max(bytes / bandwidth, FLOPs / peak);
"% of roofline" = Σ roofline time ÷ measured time, for prefill and decode apart.

Peers in the same run: `--compare transformers` runs Hugging Face transformers eager on the same checkpoint, the same
prompts and concurrency (batched, no padding needed: prompts of a wave have equal length) with torch on the same
thread count; `--ablate` builds none, all, all minus each pass and none plus each pass, each equivalence-checked.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from qcompile.errors import UsageError
from qcompile.ir.cost import Cost, StepShape, step_cost
from qcompile.ir.graph import Graph
from qcompile.ir.lowering import is_sharded, lower
from qcompile.ir.ops.expert_parallel import DISPATCH_OPS
from qcompile.ir.ops.moe import RouterTopK
from qcompile.runtime.memory import frozen_heap
from qcompile.runtime.sampling import GREEDY, History, Sampling
from qcompile.kernels import native
from qcompile.kernels.linear import NATIVE_PANELS_AMX, NATIVE_PANELS_BF16_PAIRS, linear_panels_cpu, pack_panels

#: The field's workload shapes at full scale (input, output tokens).
WORKLOADS = {"prefill-heavy": (8192, 1024), "decode-heavy": (1024, 8192)}
SCHEMA_VERSION = 1


def log(text: str) -> None:
    print(f"qcompile bench: {text}", file=sys.stderr, flush=True)


# -- ceilings --------------------------------------------------------------------------------------------------------


def _best_seconds(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - started)
    return best


def peak_rate(ceilings: dict, dtype: str) -> float:
    """The matmul rate a roofline of `dtype` weights is priced at."""
    return ceilings["matmul_flops_per_s"]["bf16" if dtype == "bf16" else "f32"]


def best_ceilings(measured: list[dict]) -> dict:
    """The highest of each ceiling over several measurements (a roofline is a bound no implementation beats: on a
    machine whose speed drifts, the slower measurement would overstate every % of roofline), with each measurement
    kept under "measurements"."""
    best = dict(measured[0])
    for key in ("copy_bytes_per_s", "read_bytes_per_s", "bandwidth_bytes_per_s"):
        best[key] = max(m[key] for m in measured)
    best["matmul_flops_per_s"] = {k: max(m["matmul_flops_per_s"][k] for m in measured)
                                  for k in measured[0]["matmul_flops_per_s"]}
    best["measurements"] = [{k: v for k, v in m.items() if k != "measurements"} for m in measured]
    return best


def threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def measure_ceilings() -> dict:
    """Memory bandwidth and f32 / bf16 matmul rates, through XLA on this process's threads, now.

    copy: a 256 MB array copied into a donated buffer (read + write bytes; a fresh output buffer would measure page
    faults instead). read: a 256 MB reduction. The roofline uses the larger: weights and KV are read far more than
    anything is written, and a roofline must be a bound no implementation beats — so the bf16 rate is also that of
    qcompile's AMX kernel (kernels/native/amx_bf16.cc) on the same product where the CPU has AMX tiles, or of its
    VDPBF16PS pairs kernel where it has AVX512_BF16 (kernels/native/bf16_pairs.h), if higher (XLA's CPU bf16 dot
    uses neither).
    """
    n = 64 << 20
    data = jnp.arange(n, dtype=jnp.float32)
    out = jnp.zeros((n,), jnp.float32)
    copy = jax.jit(lambda x, y: y.at[:].set(x), donate_argnums=1)
    out = jax.block_until_ready(copy(data, out))
    copy_s = math.inf
    for _ in range(5):
        started = time.perf_counter()
        out = jax.block_until_ready(copy(data, out))
        copy_s = min(copy_s, time.perf_counter() - started)
    read_s = _best_seconds(jax.jit(jnp.sum), data)
    del data, out
    size = 2048
    rates = {}
    for name, dtype in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
        a = jnp.ones((size, size), dtype)
        rates[name] = 2.0 * size**3 / _best_seconds(jax.jit(lambda x, y: x @ y), a, a)
    if ((native.amx_bf16() and native.ensure(NATIVE_PANELS_AMX))
            or (native.avx512_bf16() and native.ensure(NATIVE_PANELS_BF16_PAIRS))):
        a = jnp.ones((size, size), jnp.bfloat16)  # qcompile's AMX or VDPBF16PS kernel beats XLA's bf16 dot
        ours = 2.0 * size**3 / _best_seconds(jax.jit(linear_panels_cpu), a, pack_panels(a))
        rates["bf16"] = max(rates["bf16"], ours)
    copy_bw, read_bw = 2 * n * 4 / copy_s, n * 4 / read_s
    return {"threads": threads(), "backend": jax.default_backend(), "copy_bytes_per_s": copy_bw,
            "read_bytes_per_s": read_bw, "bandwidth_bytes_per_s": max(copy_bw, read_bw),
            "matmul_flops_per_s": rates}


# -- measurements ----------------------------------------------------------------------------------------------------


def _stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    arr = np.asarray(values) * 1e3
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "p99": float(np.percentile(arr, 99))}


@attrs.define
class Measurement:
    """What one engine did at one concurrency: per-request timings and per-phase totals."""

    engine: str
    passes: str
    concurrency: int
    input_len: int
    output_len: int
    ttft: list[float] = attrs.Factory(list)
    itl: list[float] = attrs.Factory(list)
    tpot: list[float] = attrs.Factory(list)
    latency: list[float] = attrs.Factory(list)
    requests: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    duration: float = 0.0
    output_tokens: int = 0
    roofline_steps: dict = attrs.Factory(lambda: {"prefill": [], "decode": []})  # each timed step's work
    roofline: "Roofline | None" = None
    roofline_ceilings: tuple | None = None  # (bytes/s, FLOP/s) the roofline seconds are priced at
    _roofline_costs: dict = attrs.Factory(dict)  # phase -> [Cost], computed once, after the timed waves
    warmup_seconds: float = 0.0
    experts_touched: dict = attrs.Factory(dict)
    complete: bool = True
    prefix_cache: dict | None = None  # a run with the scheduler's prefix cache: its hits, hit tokens and snapshots

    def request(self, ttft: float, token_times: list[float], start: float) -> None:
        self.requests += 1
        self.ttft.append(ttft)
        gaps = list(np.diff(token_times))
        self.itl.extend(gaps)
        latency = token_times[-1] - start
        self.latency.append(latency)
        if len(token_times) > 1:
            self.tpot.append((latency - ttft) / (len(token_times) - 1))
        self.output_tokens += len(token_times)

    def add_roofline(self, phase: str, roofline: "Roofline", new_tokens, contexts, rows: int,
                     experts: float | None) -> None:
        """A timed step's work (new tokens and contexts per sequence, logit rows, experts routed to): its least cost
        is computed when reported — walking the graph between two timed steps would count in TPOT and ITL."""
        self.roofline_steps[phase].append((tuple(new_tokens), tuple(contexts), rows, experts))
        self._roofline_costs.pop(phase, None)
        if self.roofline is None:
            self.roofline = roofline
            self.roofline_ceilings = (roofline.bandwidth, roofline.peak)

    def at_ceilings(self, ceilings: dict, dtype: str) -> None:
        """Price the roofline at `ceilings` (bench takes the best of the ceilings measured before and after)."""
        self.roofline_ceilings = (ceilings["bandwidth_bytes_per_s"], peak_rate(ceilings, dtype))

    def roofline_seconds(self, phase: str) -> float:
        if self.roofline_ceilings is None:
            return 0.0
        if phase not in self._roofline_costs:
            self._roofline_costs[phase] = [self.roofline.cost(*step) for step in self.roofline_steps[phase]]
        bandwidth, peak = self.roofline_ceilings
        return sum(cost.seconds(bandwidth, peak) for cost in self._roofline_costs[phase])

    @property
    def roofline_prefill_seconds(self) -> float:
        return self.roofline_seconds("prefill")

    @property
    def roofline_decode_seconds(self) -> float:
        return self.roofline_seconds("decode")

    def to_json(self, machine: dict | None = None, dtype: str = "f32") -> dict:
        def rate(tokens, seconds):
            return tokens / seconds if seconds > 0 else None

        def frac(roof, seconds):
            return roof / seconds if seconds > 0 and roof > 0 else None

        return {
            "engine": self.engine, "passes": self.passes, "concurrency": self.concurrency,
            "input_len": self.input_len, "output_len": self.output_len, "requests": self.requests,
            "complete": self.complete,
            "request_throughput": rate(self.requests, self.duration),
            "output_tok_s": rate(self.output_tokens, self.duration),
            "total_tok_s": rate(self.output_tokens + self.requests * self.input_len, self.duration),
            "prefill_tok_s": rate(self.prefill_tokens, self.prefill_seconds),
            "decode_tok_s": rate(self.decode_tokens, self.decode_seconds),
            "ttft_ms": _stats_ms(self.ttft), "tpot_ms": _stats_ms(self.tpot), "itl_ms": _stats_ms(self.itl),
            "e2el_ms": _stats_ms(self.latency),
            "roofline_prefill": frac(self.roofline_prefill_seconds, self.prefill_seconds),
            "roofline_decode": frac(self.roofline_decode_seconds, self.decode_seconds),
            "roofline_seconds": {"prefill": self.roofline_prefill_seconds, "decode": self.roofline_decode_seconds},
            "measured_seconds": {"prefill": self.prefill_seconds, "decode": self.decode_seconds,
                                 "duration": self.duration, "warmup": self.warmup_seconds},
            "experts_touched": self.experts_touched,
            **({"prefix_cache": self.prefix_cache} if self.prefix_cache is not None else {}),
        }


class Roofline:
    """Roofline seconds of steps of one graph at the measured ceilings; experts touched come from probes."""

    def __init__(self, graph: Graph, sizes: dict[str, int], ceilings: dict, dtype: str):
        self.graph, self.sizes = graph, sizes
        self.bandwidth = ceilings["bandwidth_bytes_per_s"]
        self.peak = peak_rate(ceilings, dtype)
        self.num_experts = max((n.op.num_experts for n in graph.nodes() if isinstance(n.op, DISPATCH_OPS)), default=0)
        self.top_k = max((n.op.k for n in graph.find(RouterTopK)), default=0)

    def expected_experts(self, routed_tokens: int) -> float:
        """Distinct experts hit by `routed_tokens` uniform top-k choices (used until a probe measured them)."""
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** routed_tokens)

    def cost(self, new_tokens, contexts, rows: int, experts: float | None) -> Cost:
        if experts is None:
            experts = self.expected_experts(sum(new_tokens))
        return step_cost(self.graph, self.sizes, StepShape(tuple(new_tokens), tuple(contexts), rows, experts))


def probe_experts(graph: Graph, target: str, params, caches, batch) -> float | None:
    """Mean over MoE layers of the distinct experts the valid tokens of `batch` route to (a non-donating run); None
    on a graph laid out on a mesh (its routers run per rank; the roofline then assumes uniform routing)."""
    routers = graph.find(RouterTopK)
    if not routers:
        return 0.0
    if is_sharded(graph):
        return None
    taps = {f"router.{i}": node.results[1] for i, node in enumerate(routers)}
    lowered = lower(graph, target, taps)
    fn = jax.jit(lambda p, c, b: {k: v for k, v in lowered(p, {**c, **b}).items() if k in taps})
    out = fn(params, caches, batch)
    valid = int(batch["query_start"][-1])
    return float(np.mean([np.unique(np.asarray(ids)[:valid]).size for ids in out.values()]))


def penalty_pairs(sampling: Sampling, concurrency: int, prompt_len: int, made: int) -> int:
    """At most how many (request, token) pairs a step's penalties send (runtime/sampling.py), `concurrency`
    requests of prompts up to `prompt_len` that make up to `made` tokens: what is compiled before a run is timed."""
    if not (sampling.uses_history or sampling.logit_bias):
        return 0
    per = (made if sampling.uses_history else 0) + (prompt_len if sampling.repetition_penalty != 1 else 0)
    return concurrency * (per + len(sampling.logit_bias))


def request_sampling(sampling: Sampling, index: int) -> Sampling:
    """What request `index` of a run draws with: `sampling` with seed + index (as `qcompile run` does)."""
    return sampling if sampling.greedy else attrs.evolve(sampling, seed=(sampling.seed + index) % 2**32)


def bench_engine(engine, label: str, passes: str, prompts: list[list[int]], output_len: int, concurrency: int,
                 roofline: Roofline | None, graph: Graph | None, target: str, stop,
                 sampling: Sampling = GREEDY) -> Measurement:
    """Serve `prompts` in waves of `concurrency` on `engine`; the first wave of the same shapes is a warm-up."""
    input_len = len(prompts[0])
    m = Measurement(label, passes, concurrency, input_len, output_len)
    probes: dict[str, float | None] = {"prefill": None, "decode": None}
    warm_started = time.perf_counter()
    pairs = penalty_pairs(sampling, concurrency, input_len, output_len)
    if pairs:  # the sampler's programs for every size of pairs the run will send (the warm-up wave makes 3 tokens)
        engine.compile_all_buckets(sampling=True, pairs=pairs)
    _serve_wave(engine, prompts[:concurrency], min(output_len, 3), None, None, probes, graph, target, stop,
                [request_sampling(sampling, i) for i in range(min(concurrency, len(prompts)))])
    m.warmup_seconds = time.perf_counter() - warm_started
    started = time.perf_counter()
    try:
        with frozen_heap():  # as a server runs (runtime/memory.py)
            for first in range(0, len(prompts), concurrency):
                wave = range(first, min(first + concurrency, len(prompts)))
                _serve_wave(engine, [prompts[i] for i in wave], output_len, m, roofline, probes, graph, target, stop,
                            [request_sampling(sampling, i) for i in wave])
    except KeyboardInterrupt:
        m.complete = False
        raise
    finally:
        m.duration = time.perf_counter() - started
        m.experts_touched = {k: v for k, v in probes.items() if v is not None}
    return m


def arrival_times(num: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each of `num` requests arrives: a Poisson process of `rate` requests/s (the
    first at 0); all at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, num)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def follow_up_len(input_len: int) -> int:
    """New tokens a later turn of a conversation adds after the reply (`bench --turns`): an eighth of the first
    prompt, at least 8."""
    return max(8, input_len // 8)


def conversation_len(input_len: int, output_len: int, turns: int, reasoning: int = 0) -> int:
    """Tokens of a conversation's last turn, prompt and reply (`bench --turns`): the first prompt, each turn's reply
    (less `reasoning` tokens but the last's) and each later turn's new tokens."""
    return input_len + turns * output_len + (turns - 1) * (follow_up_len(input_len) - reasoning)


def next_turn(prompt: list[int], reply: list[int], first: list[int], rng, reasoning: int = 0) -> list[int]:
    """A conversation's next prompt (`bench --turns`): the last prompt, the reply without its first `reasoning`
    tokens (a thinking model's template drops them), and follow_up_len new tokens drawn by `rng` from the
    conversation's first prompt."""
    return prompt + reply[reasoning:] + rng.choice(first, follow_up_len(len(first))).tolist()


def bench_engine_rate(engine, label: str, passes: str, prompts: list[list[int]], output_len: int, concurrency: int,
                      rate: float, seed: int, stop, sampling: Sampling = GREEDY, n: int = 1,
                      share: bool = True, turns: int = 1, prefix_cache: bool = False,
                      max_running: int | None = None, reasoning: int = 0) -> Measurement:
    """Serve `prompts` as requests arriving at `rate` per second (Poisson, seeded) through the continuous-batching
    scheduler (runtime/scheduler.py): at most `concurrency` run at once, the others wait; each request's TTFT runs
    from its arrival. Every token bucket is compiled first (untimed), and the sampler's programs for the penalties'
    pairs (`penalty_pairs`), so no compile lands inside the run. Steps mix
    prefill chunks and decode tokens, so prefill and decode tok/s are not separable here (reported as null).
    `n`: each prompt arrives as n requests (choice j of prompt i draws with seed + n·i + j), the later ones sharing
    the first's prefill (`share`, as `serve` does for a request's n) or fed on their own.
    `turns`: each prompt opens a conversation of that many requests, each sent when the one before finishes, its
    prompt the one before's, its reply and follow_up_len new (seeded random) tokens — served with the scheduler's
    prefix cache on (`prefix_cache`, as `serve` runs; it also snapshots prefixes prompts share) or off.
    `reasoning`: the next turn's prompt leaves out each reply's first that many tokens, as a thinking model's chat
    template drops earlier turns' reasoning (Qwen3.5's does): the conversation's ids agree up to the last prompt's end.
    `max_running`: requests run at once, below the engine's slots where it has prefix-cache slots (as serve's)."""
    from qcompile.runtime.scheduler import Request, Scheduler

    m = Measurement(label, passes, concurrency, len(prompts[0]), output_len)
    warm_started = time.perf_counter()
    longest = conversation_len(len(prompts[0]), output_len, turns, reasoning)
    engine.compile_all_buckets(sampling=not sampling.argmax,
                               pairs=penalty_pairs(sampling, max_running or concurrency, longest, output_len))
    m.warmup_seconds = time.perf_counter() - warm_started
    arrivals = [at for at in arrival_times(len(prompts), rate, seed) for _ in range(n)]
    requests = [Request(list(p), output_len, id=(n * i + j) * turns, sampling=request_sampling(sampling, n * i + j))
                for i, p in enumerate(prompts) for j in range(n)]  # request id: conversation · turns + turn
    if share:
        for index, request in enumerate(requests):
            request.parent = requests[index - index % n] if index % n else None
    scheduler = Scheduler(engine, prefix_cache=prefix_cache, max_running=max_running)
    follow = np.random.default_rng(seed + 1)  # a later turn's new tokens: drawn from its conversation's first prompt
    later: list = []  # later turns, made as the turns before them finish
    token_times: dict[int, list[float]] = {}
    arrived: dict[int, float] = {}
    start = time.perf_counter()
    submitted = 0
    try:
        with frozen_heap():  # as a server runs (runtime/memory.py)
            while submitted < len(requests) or scheduler.waiting or scheduler.running:
                now = time.perf_counter() - start
                while submitted < len(requests) and arrivals[submitted] <= now:
                    scheduler.submit(requests[submitted])
                    arrived[requests[submitted].id] = start + arrivals[submitted]
                    submitted += 1
                if not scheduler.waiting and not scheduler.running:
                    time.sleep(max(0.0, min(arrivals[submitted] - now, 1.0)))
                    continue
                for request, _ in scheduler.step():
                    token_times.setdefault(request.id, []).append(time.perf_counter())
                    if request.finish_reason == "length" and request.id % turns < turns - 1:
                        first = prompts[request.id // turns]
                        turn = Request(next_turn(request.prompt, request.tokens, first, follow, reasoning), output_len,
                                       id=request.id + 1,
                                       sampling=request_sampling(sampling, len(prompts) + request.id))
                        scheduler.submit(turn)
                        arrived[turn.id] = time.perf_counter()
                        later.append(turn)
                stop()
    except KeyboardInterrupt:
        m.complete = False
        raise
    finally:
        m.duration = time.perf_counter() - start
        if prefix_cache:
            m.prefix_cache = {"hits": scheduler.prefix_hits, "hit_tokens": scheduler.prefix_hit_tokens,
                              "snapshots": scheduler.snapshots}
        scheduler.release_kept()  # the engine serves the next run with every slot and page
        for request in [*requests, *later]:
            times = token_times.get(request.id)
            if request.finish_reason is not None and times:
                m.request(times[0] - arrived[request.id], times, arrived[request.id])
    return m


def _record_step(engine, phase: str, seconds: float, new: list[int], contexts: list[int], m: Measurement | None,
                 roofline: Roofline | None, probes: dict, graph: Graph | None, target: str) -> None:
    """Adds a step of `phase` (prefill | decode) that took `seconds` for `new` tokens a row to `m`, with its roofline
    time at `contexts`. The first step of each phase also probes the experts its batch (`engine.last_batch`, so the
    step just run) routes to, after its time was taken."""
    if graph is not None and probes[phase] is None:
        probes[phase] = probe_experts(graph, target, engine.params, engine.caches, engine.last_batch)
    if m is not None:
        setattr(m, f"{phase}_seconds", getattr(m, f"{phase}_seconds") + seconds)
        setattr(m, f"{phase}_tokens", getattr(m, f"{phase}_tokens") + sum(new))
        if roofline is not None:
            m.add_roofline(phase, roofline, new, contexts, len(new), probes[phase])


def _timed_step(engine, work, phase: str, m: Measurement | None, roofline: Roofline | None, probes: dict,
                graph: Graph | None, target: str, sampling: list[Sampling] | None = None,
                counters: list[int] | None = None, histories: list | None = None) -> tuple[list[int], float]:
    """One engine step of `phase`, run to its tokens and recorded (`_record_step`). Returns the next tokens (greedy,
    or drawn with sampling[i] as the counters[i]-th token of its request, penalised over histories[i]) and the
    step's end time."""
    new = [len(tokens) for _, tokens in work]
    contexts = [seq.length + n for (seq, _), n in zip(work, new)]
    started = time.perf_counter()
    nexts = engine.launch_tokens(work, sampling, counters, histories=histories).tokens()
    ended = time.perf_counter()
    _record_step(engine, phase, ended - started, new, contexts, m, roofline, probes, graph, target)
    return nexts, ended


def _serve_wave(engine, prompts, output_len, m: Measurement | None, roofline: Roofline | None, probes: dict,
                graph: Graph | None, target: str, stop, sampling: list[Sampling]) -> None:
    seqs = [engine.add_sequence() for _ in prompts]
    greedy = all(p.argmax for p in sampling)
    made: list[list[int]] = [[] for _ in prompts]  # what each request's penalties count
    histories = [History.of(prompt, tokens, p) if p.uses_history else None
                 for prompt, tokens, p in zip(prompts, made, sampling)]
    budget = engine.cache_cfg.max_step_tokens
    try:
        start = time.perf_counter()
        pending = [list(p) for p in prompts]
        token_times: list[list[float]] = [[] for _ in prompts]
        last = [0] * len(prompts)
        ttft = [0.0] * len(prompts)
        while any(pending):
            work, owners, left = [], [], budget
            for i, rest in enumerate(pending):
                if rest and left > 0:
                    take = rest[:left]
                    del rest[:len(take)]
                    work.append((seqs[i], take))
                    owners.append(i)
                    left -= len(take)
            nexts, t1 = _timed_step(engine, work, "prefill", m, roofline, probes, graph, target,
                                    None if greedy else [sampling[i] for i in owners], [0] * len(owners),
                                    [histories[i] for i in owners])
            for i, tok in zip(owners, nexts):
                if not pending[i]:
                    last[i] = tok
                    made[i].append(tok)
                    token_times[i].append(t1)
                    ttft[i] = t1 - start
            stop()
        # Decode pipelined (Engine.launch_tokens): step N + 1 goes to the device on step N's tokens before they are
        # read; a step's time runs from the previous step's tokens being back to its own. The first decode step is
        # read before the next is launched, so that the expert probe runs untimed on its batch.
        mark = time.perf_counter()

        def read(step, contexts) -> None:
            nonlocal last, mark
            last = step.tokens()
            t1 = time.perf_counter()
            for tokens, token in zip(made, last):
                tokens.append(token)
            for times in token_times:
                times.append(t1)
            _record_step(engine, "decode", t1 - mark, [1] * len(seqs), contexts, m, roofline, probes, graph, target)
            mark = time.perf_counter()
            stop()

        launched, launched_contexts = None, None
        for count in range(1, output_len):
            if launched is not None and graph is not None and probes["decode"] is None:
                read(launched, launched_contexts)
                launched = None
            work = [(s, [launched.token(i) if launched else last[i]]) for i, s in enumerate(seqs)]
            contexts = [s.length + 1 for s in seqs]
            following = engine.launch_tokens(work, None if greedy else sampling, [count] * len(seqs),
                                             histories=histories)
            if launched is not None:
                read(launched, launched_contexts)
            launched, launched_contexts = following, contexts
        if launched is not None:
            read(launched, launched_contexts)
        if m is not None:
            for i in range(len(prompts)):
                m.request(ttft[i], token_times[i], start)
    finally:
        for seq in seqs:
            engine.release(seq)


# -- transformers ----------------------------------------------------------------------------------------------------


def transformers_available() -> str | None:
    """None when transformers and torch import, else the reason."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as err:
        return (f"--compare transformers needs transformers and torch ({err.name} is not installed); install the "
                "test extra: pip install 'qcompile[test]'")
    return None


def bench_transformers(checkpoint_dir: Path, dtype: str, prompts: list[list[int]], output_len: int, concurrency: int,
                       roofline: Roofline | None, experts: dict, stop, model=None,
                       sampling: Sampling = GREEDY) -> Measurement:
    """Transformers eager, batched waves of `concurrency` equal-length prompts, greedy — or sampled as
    `generate(do_sample=True)` samples: its temperature, top-k and top-p logits warpers, then torch.multinomial —
    with its own KV cache."""
    import torch

    choose, penalised = _transformers_chooser(sampling), sampling.uses_history
    torch.set_num_threads(threads())
    if model is None:
        model = load_transformers(checkpoint_dir, dtype)
    input_len = len(prompts[0])
    m = Measurement("transformers", "eager", concurrency, input_len, output_len)

    @torch.no_grad()
    def wave(batch_prompts, out_len, record):
        ids = torch.tensor(batch_prompts, dtype=torch.long)
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        seen = ids  # the prompts and what was made: what transformers' penalties read
        nxt = choose(seen, out.logits[:, -1], input_len)
        t1 = time.perf_counter()
        times = [[t1] for _ in batch_prompts]
        if record:
            m.prefill_seconds += t1 - start
            m.prefill_tokens += ids.numel()
            if roofline is not None:  # the whole wave as one step: the least work the prefill can cost
                n = len(batch_prompts)
                m.add_roofline("prefill", roofline, [input_len] * n, [input_len] * n, n, experts.get("prefill"))
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        for step in range(out_len - 1):
            t0 = time.perf_counter()
            out = model(input_ids=nxt[:, None], cache=cache, use_cache=True)
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            if penalised:
                seen = torch.cat([seen, nxt[:, None]], 1)
            nxt = choose(seen, out.logits[:, -1], input_len)
            t1 = time.perf_counter()
            for t in times:
                t.append(t1)
            if record:
                m.decode_seconds += t1 - t0
                m.decode_tokens += len(batch_prompts)
                if roofline is not None:
                    ctx = [input_len + step + 1] * len(batch_prompts)
                    m.add_roofline("decode", roofline, [1] * len(batch_prompts), ctx, len(batch_prompts),
                                   experts.get("decode"))
            stop()
        if record:
            for t in times:
                m.request(t[0] - start, t, start)

    warm = time.perf_counter()
    wave(prompts[:concurrency], min(output_len, 3), False)
    m.warmup_seconds = time.perf_counter() - warm
    started = time.perf_counter()
    try:
        with frozen_heap():  # the same conditions as qcompile's waves: an eager loop allocates Python objects too
            for first in range(0, len(prompts), concurrency):
                wave(prompts[first:first + concurrency], output_len, True)
    except KeyboardInterrupt:
        m.complete = False
        raise
    finally:
        m.duration = time.perf_counter() - started
    return m


def _transformers_chooser(sampling: Sampling):
    """next_token(input_ids, last_logits [n, V], prompt_len) for transformers' waves: the argmax, or transformers' own
    sampling warpers (as `generate(do_sample=True)` applies them) and a multinomial draw from a generator seeded once.
    Penalties first, as qcompile applies them (runtime/sampling.py): transformers' repetition penalty over
    input_ids (the prompt and what was made), then OpenAI's frequency and presence penalties over what was made
    (input_ids past prompt_len; transformers has none: a few tensor operations); min-p after the temperature."""
    import torch
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    def penalised(ids, logits, prompt_len):
        logits = logits.float()
        if sampling.repetition_penalty != 1:
            logits = RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty)(ids, logits)
        if (sampling.presence_penalty or sampling.frequency_penalty) and ids.shape[1] > prompt_len:
            made = ids[:, prompt_len:]
            times = torch.zeros_like(logits).scatter_add_(1, made, torch.ones(made.shape, dtype=logits.dtype))
            logits = logits - sampling.frequency_penalty * times - sampling.presence_penalty * (times > 0)
        return logits

    if sampling.greedy:
        return lambda ids, logits, prompt_len=0: penalised(ids, logits, prompt_len).argmax(-1)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(sampling.temperature)]
                                  + ([MinPLogitsWarper(sampling.min_p)] if sampling.min_p > 0 else [])
                                  + ([TopKLogitsWarper(sampling.top_k)] if sampling.top_k > 0 else [])
                                  + ([TopPLogitsWarper(sampling.top_p)] if sampling.top_p < 1 else []))
    generator = torch.Generator().manual_seed(sampling.seed)

    def draw(ids, logits, prompt_len=0):
        probs = torch.softmax(warpers(ids, penalised(ids, logits, prompt_len)), dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    return draw


def load_transformers(checkpoint_dir: Path, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    return AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), dtype=torch_dtype).eval()


# -- prompts and reporting -------------------------------------------------------------------------------------------


def make_prompts(num: int, input_len: int, vocab: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    """Random prompts of a fixed seed (ids 3.. vocab-1: clear of the usual special ids 0-2); every one starts with
    the first's first `shared_prefix` tokens (bench --shared-prefix-len)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, input_len).tolist() for _ in range(num)]
    for prompt in prompts[1:]:
        prompt[:shared_prefix] = prompts[0][:shared_prefix]
    return prompts


def workload_shape(workload: str, input_len: int | None, output_len: int | None, scale: int) -> tuple[int, int, str]:
    if workload not in WORKLOADS:
        raise UsageError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")
    if scale < 1:
        raise UsageError(f"--scale must be at least 1, got {scale}")
    full_in, full_out = WORKLOADS[workload]
    scaled_in, scaled_out = max(1, full_in // scale), max(1, full_out // scale)
    inp = input_len if input_len is not None else scaled_in
    out = output_len if output_len is not None else scaled_out
    for flag, value in (("--input-len", inp), ("--output-len", out)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    note = (f"{workload} {full_in}/{full_out} scaled by 1/{scale} → {scaled_in}/{scaled_out}"
            if input_len is None and output_len is None else f"input {inp} / output {out} tokens (given)")
    return inp, out, note


