"""`qcompile bench --url`: measure a running server (`qcompile serve`, or any OpenAI-compatible completions server
that returns `token_ids`) with the same metrics as the in-process bench.

The same seeded random prompts as the in-process bench (ids, sent as token ids), arriving at `--request-rate` per
second (Poisson, seeded; inf: all at once) with at most `--concurrency` in flight; each is a streamed
/v1/completions request for exactly output_len tokens (ignore_eos, greedy). With `--turns K` each prompt opens a
conversation of K requests, each sent when the one before has finished, its prompt the last one, the reply's ids as
the server streamed them (less `--reasoning-len` first ones) and new tokens — whatever prefix caching the server
does. With `--n N` each request asks for N choices (the server's `n`; each choice's tokens timed and counted as a
request of the in-process bench's, and `--concurrency` counts requests in flight). Times are taken when each
server-sent
event arrives: TTFT from the request's arrival, ITL between events, E2E latency, and output tok/s over the whole run;
with `qcompile serve`, the prefix cache's hits, hit tokens and snapshots during the run (its /metrics before and
after).
Prefill and decode are not separable through the API (null in the report), and there is no roofline: the client
does not know the model's graph. Comparing this with the in-process bench at the same concurrency is the HTTP
server's overhead (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np

from qcompile.compiler.measure import (Measurement, arrival_times, conversation_len, log, make_prompts, next_turn,
                                       request_sampling)
from qcompile.errors import UsageError
from qcompile.runtime.sampling import GREEDY, Sampling


def _client():
    try:
        import httpx
    except ImportError:
        raise UsageError("bench --url needs httpx: pip install 'qcompile[serve]'") from None
    return httpx


#: `qcompile serve`'s Prometheus gauges of its prefix cache, by the in-process run record's prefix_cache keys.
PREFIX_GAUGES = {"hits": "qcompile_prefix_cache_hits", "hit_tokens": "qcompile_prefix_cache_hit_tokens",
                 "snapshots": "qcompile_prefix_cache_snapshots"}


def prefix_counters(url: str) -> dict[str, int] | None:
    """The server's prefix-cache counters so far (GET /metrics, PREFIX_GAUGES), or None where it gives none (another
    server, or none with the prefix cache's gauges)."""
    httpx = _client()
    try:
        from prometheus_client.parser import text_string_to_metric_families

        response = httpx.get(url.rstrip("/") + "/metrics", timeout=30)
        response.raise_for_status()
        values = {sample.name: sample.value for family in text_string_to_metric_families(response.text)
                  for sample in family.samples}
    except (ImportError, httpx.HTTPError, ValueError):
        return None
    if not all(name in values for name in PREFIX_GAUGES.values()):
        return None
    return {key: int(values[name]) for key, name in PREFIX_GAUGES.items()}


def server_model(url: str) -> dict:
    """The served model's entry of GET /v1/models (a usage error when nothing answers there)."""
    httpx = _client()
    try:
        response = httpx.get(url.rstrip("/") + "/v1/models", timeout=30)
        response.raise_for_status()
        return response.json()["data"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as err:
        raise UsageError(f"--url {url}: no OpenAI-compatible server answers GET /v1/models there ({err})") from None


async def _one(client, prompt: list[int], output_len: int, model: str, sampling: Sampling, n: int = 1
               ) -> list[tuple[list[float], list[int]]]:
    """Stream one request of `n` choices; for each choice, the arrival time of each token's event and the token ids."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": sampling.temperature,
            "top_k": sampling.top_k, "top_p": sampling.top_p, "seed": sampling.seed, "ignore_eos": True,
            "stream": True, **({"n": n} if n > 1 else {}), **sampling.adjustments()}
    choices: list[tuple[list[float], list[int]]] = [([], []) for _ in range(n)]
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:200]
            raise UsageError(f"the server refused a request: HTTP {response.status_code} {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise UsageError(f"the server failed a request: {event['error'].get('message')}")
            for choice in event.get("choices", []):
                ids, index = choice.get("token_ids"), choice.get("index", 0)
                if ids is None:
                    raise UsageError("the server's choices carry no token_ids; bench --url needs them to count tokens")
                if not 0 <= index < n:
                    raise UsageError(f"the server answered a choice index {index} for a request of {n} choices")
                times, made = choices[index]
                times.extend([now] * len(ids))
                made.extend(ids)
    return choices


async def _run(url: str, model: str, prompts: list[list[int]], output_len: int, concurrency: int,
               arrivals: list[float], m: Measurement, sampling: Sampling, turns: int, reasoning: int,
               seed: int, n: int) -> None:
    httpx = _client()
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=None, limits=limits) as client:
        start = time.perf_counter()

        async def request(index: int, prompt: list[int], arrival: float) -> None:
            await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
            first, follow = prompt, np.random.default_rng((seed + 1, index))  # a conversation's new tokens
            for turn in range(turns):
                arrived = time.perf_counter()
                async with gate:  # (choice j of request i draws with seed + n·i + j, as in-process)
                    choices = await _one(client, prompt, output_len, model,
                                         request_sampling(sampling, n * (index * turns + turn)), n)
                for times, _ in choices:
                    if times:
                        m.request(times[0] - arrived, times, arrived)
                if turn + 1 < turns:
                    prompt = next_turn(prompt, choices[0][1], first, follow, reasoning)

        try:
            await asyncio.gather(*(request(i, p, a) for i, (p, a) in enumerate(zip(prompts, arrivals))))
        finally:
            m.duration = time.perf_counter() - start


def bench_url(url: str, input_len: int, output_len: int, concurrency: int, num: int, rate: float | None,
              seed: int, sampling: Sampling = GREEDY, shared_prefix: int = 0, turns: int = 1,
              reasoning: int = 0, n: int = 1) -> dict:
    """One run at one concurrency (requests in flight) against the server at `url`: the in-process bench's run
    record. `shared_prefix`: every prompt starts with the first's first that many tokens; `turns`, `reasoning`:
    conversations (module docstring); `n`: each request asks for n choices (each counted as a request in the
    latencies, as in-process)."""
    entry = server_model(url)
    vocab, context = entry.get("vocab_size"), entry.get("max_model_len")
    if vocab is None:
        raise UsageError(f"--url {url}: /v1/models does not give vocab_size; bench --url needs it to make prompts")
    longest = conversation_len(input_len, output_len, turns, reasoning)
    if context is not None and longest > context:
        raise UsageError(f"{longest} tokens ({input_len}+{output_len}" + (f" over {turns} turns" if turns > 1 else "")
                         + f") exceed the server's context of {context}")
    prompts = make_prompts(num, input_len, int(vocab), seed, shared_prefix)
    arrivals = arrival_times(num, float("inf") if rate is None else rate, seed)
    m = Measurement("qcompile-http", entry["id"], concurrency, input_len, output_len)
    log(f"{url}: {num} requests" + (f" of {n} choices" if n > 1 else "") + f" at concurrency {concurrency}")
    before = prefix_counters(url)
    try:
        asyncio.run(_run(url, entry["id"], prompts, output_len, concurrency, arrivals, m, sampling, turns, reasoning,
                         seed, n))
    except KeyboardInterrupt:
        m.complete = False
        raise
    except _client().HTTPError as err:
        raise UsageError(f"--url {url}: {type(err).__name__}: {err}") from None
    after = prefix_counters(url) if before is not None else None
    if after is not None:  # what this run's requests hit (the server's counters count since it started)
        m.prefix_cache = {key: after[key] - before[key] for key in PREFIX_GAUGES}
    return m.to_json()
