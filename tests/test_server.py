"""`qcompile serve`: OpenAI's completions API over the continuous-batching engine, on a real uvicorn server on
127.0.0.1 (a thread of this process; one test starts the command itself).

What must hold: concurrent requests of different lengths get exactly the greedy tokens each gets alone, also under
preemption in a deliberately small page pool; streaming sends the same tokens and text as a plain request; stop
strings cut the text before them; a client that goes away — streaming or not — gets its slot and pages freed; bad
requests get 400 (404 for an unknown model) with an error naming the field; /health, /v1/models, /metrics answer;
a chat request is the completion of its messages rendered by the chat template, in OpenAI's chat shapes (with
reasoning and tool calls parsed out when the server is asked to).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from qcompile.errors import UsageError  # noqa: E402
from qcompile.frontend.tokenizer import TOKENIZER_FILE, train_tiny_tokenizer  # noqa: E402
from qcompile.ir.abi import CacheConfig  # noqa: E402
from qcompile.runtime.server import BadRequest, ModelInfo, create_app, parse_completion  # noqa: E402
from server_harness import Server  # noqa: E402

PROMPTS = [[3, 17, 42, 9, 250], [(7 * i + 5) % 500 + 3 for i in range(23)], [11, 12], [400, 3, 99, 7, 7, 7, 2],
           [(11 * i + 1) % 480 + 9 for i in range(14)]]
NEW = [6, 3, 9, 4, 18]


@pytest.fixture(scope="module")
def model(tmp_path_factory, qc_model):
    from conftest import write_small

    path = write_small(tmp_path_factory.mktemp("serve") / "m", seed=5)
    train_tiny_tokenizer(512).save(str(path / TOKENIZER_FILE))
    return qc_model(path)


@pytest.fixture(scope="module")
def tokenizer(model):
    from qcompile.frontend.tokenizer import load_tokenizer

    return load_tokenizer(model.checkpoint.path, "test")


@pytest.fixture(scope="module")
def alone(model):
    """Each prompt's greedy tokens, generated on its own by the engine."""
    engine = model.engine(CacheConfig(max_seqs=1, max_context=64, max_step_tokens=8))
    return [engine.generate([p], n)["tokens"][0] for p, n in zip(PROMPTS, NEW)]


@pytest.fixture(scope="module")
def chat_template():
    from qcompile.frontend.chat import TINY_CHAT_TEMPLATE, ChatTemplate

    return ChatTemplate.compile(TINY_CHAT_TEMPLATE, "init-tiny's", {"bos_token": "<s>", "eos_token": "</s>"})


@pytest.fixture(scope="module")
def server(model, tokenizer, chat_template):
    """Three slots and 5 pages of 16 tokens: the five prompts queue for slots, and their decodes outgrow the pool;
    finished sequences are kept for prompts that continue them (released whenever a request needs the room)."""
    srv = Server(model.engine(CacheConfig(max_seqs=3, max_context=48, num_pages=5, max_step_tokens=8)), tokenizer,
                 chat_template=chat_template, prefix_cache=True)  # as `serve` runs by default
    yield srv
    srv.close()


async def _post_all(url, bodies):
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        responses = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
    return responses


def _sse(text: str) -> list:
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_concurrent_requests_get_their_own_greedy_tokens(server, alone):
    bodies = [{"prompt": p, "max_tokens": n, "temperature": 0} for p, n in zip(PROMPTS, NEW)]
    responses = asyncio.run(_post_all(server.url, bodies))
    assert [r.status_code for r in responses] == [200] * len(PROMPTS)
    got = [r.json()["choices"][0] for r in responses]
    assert [c["token_ids"] for c in got] == alone
    assert all(c["finish_reason"] == "length" for c in got)
    usage = responses[1].json()["usage"]
    assert usage == {"prompt_tokens": 23, "completion_tokens": 3, "total_tokens": 26}
    server.wait_pool_full()
    metrics = httpx.get(server.url + "/metrics").text
    # the five requests did not fit three slots at once (some waited), and the histograms saw every request and
    # every gap between tokens
    assert re.search(r"^qcompile_time_to_first_token_seconds_count (\d+)", metrics, re.M)
    assert float(re.search(r"^qcompile_inter_token_latency_seconds_count (\S+)", metrics, re.M).group(1)) >= \
        sum(n - 1 for n in NEW)
    assert float(re.search(r'^qcompile_requests_finished_total\{finish_reason="length"\} (\S+)', metrics,
                           re.M).group(1)) >= len(PROMPTS)
    assert re.search(r"^qcompile_kv_pages_used 0\.0$", metrics, re.M)
    assert re.search(r"^qcompile_kv_pages_total 5\.0$", metrics, re.M)


def _preemptions(server) -> float:
    return _metric(server, "qcompile_preemptions")


def test_requests_preempted_for_pages_still_get_their_own_tokens(server, model):
    """Three requests of 10 + 12 tokens in 5 pages of 16: all run at once on one page each, and when their decodes
    cross into a second page only two fit, so one is preempted and recomputed (the server's preemption count says
    so) — and each still gets exactly the tokens it gets alone."""
    prompts = [[(13 * i + 7 * r) % 490 + 5 for i in range(10)] for r in range(3)]
    single = model.engine(CacheConfig(max_seqs=1, max_context=48, max_step_tokens=8))
    alone = [single.generate([p], 12)["tokens"][0] for p in prompts]
    for _ in range(3):  # preempted only if the three overlap: a request that arrives late may find pages free
        before = _preemptions(server)
        responses = asyncio.run(_post_all(server.url, [{"prompt": p, "max_tokens": 12, "temperature": 0}
                                                       for p in prompts]))
        assert [r.json()["choices"][0]["token_ids"] for r in responses] == alone
        server.wait_pool_full()
        if _preemptions(server) > before:
            break
    else:
        pytest.fail("three requests sent at once never overlapped enough to preempt one (tried three times)")


def test_streaming_sends_the_same_tokens_and_text_with_usage_last(server, alone, tokenizer):
    body = {"prompt": PROMPTS[4], "max_tokens": NEW[4], "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        chunks = _sse(response.read().decode())
    *tokens, last, usage = chunks
    assert [c["choices"][0]["token_ids"] for c in tokens] == [[t] for t in alone[4]]
    assert last["choices"][0]["finish_reason"] == "length" and usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == NEW[4]
    text = "".join(c["choices"][0]["text"] for c in [*tokens, last])
    plain = httpx.post(server.url + "/v1/completions", json={**body, "stream": False, "stream_options": None},
                       timeout=60).json()["choices"][0]
    assert text == plain["text"] == tokenizer.decode(alone[4], skip_special_tokens=True)


def test_text_prompts_and_stop_strings(server, tokenizer):
    text = "Serving such a model means keeping many sequences in flight"
    body = {"prompt": text, "max_tokens": 16, "temperature": 0}
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert full["token_ids"] and full["text"] == tokenizer.decode(full["token_ids"], skip_special_tokens=True)
    # a stop string from the middle of what it generates: the text ends just before it, finish_reason stop
    cut = len(full["text"]) // 2
    stop = full["text"][cut:cut + 2]
    assert stop.strip() and full["text"].find(stop) >= 0
    stopped = httpx.post(server.url + "/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == full["text"][:full["text"].find(stop)]
    assert choice["token_ids"] == full["token_ids"][:len(choice["token_ids"])] and len(choice["token_ids"]) < 16
    # a stop token id ends the choice after it, as the engine's eos does
    stop_id = full["token_ids"][3]
    by_id = httpx.post(server.url + "/v1/completions", json={**body, "stop_token_ids": [stop_id]},
                       timeout=60).json()["choices"][0]
    assert by_id["finish_reason"] == "stop"
    assert by_id["token_ids"] == full["token_ids"][:full["token_ids"].index(stop_id) + 1]
    server.wait_pool_full()


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return float(re.search(rf"^{name} (\S+)", text, re.M).group(1))


def test_n_choices_and_seeded_sampling_are_reproducible(server):
    body = {"prompt": [PROMPTS[0], PROMPTS[2]], "max_tokens": 5, "temperature": 0.9, "top_p": 0.95, "seed": 11,
            "n": 2}
    forks, shared = _metric(server, "qcompile_prefill_forks"), _metric(server, "qcompile_prompt_tokens_shared")
    first, again = (httpx.post(server.url + "/v1/completions", json=body, timeout=60).json() for _ in range(2))
    # each prompt's second choice forked its first's prefill (all but the last token), in both requests
    assert _metric(server, "qcompile_prefill_forks") == forks + 4
    assert _metric(server, "qcompile_prompt_tokens_shared") == shared + 2 * (len(PROMPTS[0]) - 1 + len(PROMPTS[2]) - 1)
    assert [c["index"] for c in first["choices"]] == [0, 1, 2, 3]
    # usage counts each prompt once, whatever n (as OpenAI does), and every choice's tokens
    assert first["usage"]["prompt_tokens"] == len(PROMPTS[0]) + len(PROMPTS[2])
    assert first["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in first["choices"])
    assert [c["token_ids"] for c in first["choices"]] == [c["token_ids"] for c in again["choices"]]
    # choice i draws with seed + i: two samples of one prompt differ (5 tokens from a flat random model)
    assert first["choices"][0]["token_ids"] != first["choices"][1]["token_ids"]
    # a prompt's second choice forks the first's prefill: the tokens it gets as a request of its own, seeded 11 + 1
    alone = httpx.post(server.url + "/v1/completions", json={**body, "prompt": PROMPTS[0], "n": 1, "seed": 12},
                       timeout=60).json()
    assert alone["choices"][0]["token_ids"] == first["choices"][1]["token_ids"]
    # so with penalties (each choice counts its own tokens, the forked one too)
    penalised = {**body, "prompt": PROMPTS[0], "presence_penalty": 1.5, "repetition_penalty": 1.3, "max_tokens": 8}
    choices = httpx.post(server.url + "/v1/completions", json=penalised, timeout=60).json()["choices"]
    second = httpx.post(server.url + "/v1/completions", json={**penalised, "n": 1, "seed": 12}, timeout=60).json()
    assert second["choices"][0]["token_ids"] == choices[1]["token_ids"] != choices[0]["token_ids"]
    assert _metric(server, "qcompile_prefill_forks") == forks + 5


def test_a_prompt_continuing_a_finished_reply_feeds_only_its_new_tokens(server, model):
    """The prefix cache (on, as `serve` runs): a second request whose prompt is the first's prompt, its reply and
    two more tokens continues the first's kept sequence — one hit, the prompt tokens it held not fed again — and
    gets the tokens the engine makes for that prompt from scratch."""
    prompt = PROMPTS[4]
    first = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0},
                       timeout=60).json()["choices"][0]["token_ids"]
    hits, tokens = _metric(server, "qcompile_prefix_cache_hits"), _metric(server, "qcompile_prefix_cache_hit_tokens")
    follow = prompt + first + [5, 6]
    second = httpx.post(server.url + "/v1/completions", json={"prompt": follow, "max_tokens": 3, "temperature": 0},
                        timeout=60).json()["choices"][0]["token_ids"]
    assert _metric(server, "qcompile_prefix_cache_hits") == hits + 1
    # the kept sequence held the prompt and three of the four reply tokens (the last is made, never fed)
    assert _metric(server, "qcompile_prefix_cache_hit_tokens") == tokens + len(prompt) + 3
    scratch = model.engine(CacheConfig(max_seqs=1, max_context=48, max_step_tokens=8))
    assert second == scratch.generate([follow], 3)["tokens"][0]
    server.wait_pool_full()  # kept sequences are not counted as used


def test_prompts_sharing_a_prefix_start_from_its_snapshot(server, model):
    """Three requests whose prompts share 20 tokens (a 16-token page) and differ after: the second snapshots the
    page, the third starts from a copy of it (one hit of 16 tokens) and gets the tokens made from scratch."""
    prefix = [(13 * i + 101) % 400 + 3 for i in range(20)]  # no other test sends these
    snapshots, hits = _metric(server, "qcompile_prefix_cache_snapshots"), _metric(server, "qcompile_prefix_cache_hits")
    tokens = _metric(server, "qcompile_prefix_cache_hit_tokens")
    scratch = model.engine(CacheConfig(max_seqs=1, max_context=48, max_step_tokens=8))
    for tail in ([1, 2], [3], [4, 5, 6]):
        got = httpx.post(server.url + "/v1/completions", json={"prompt": prefix + tail, "max_tokens": 3,
                                                               "temperature": 0}, timeout=60).json()
        assert got["choices"][0]["token_ids"] == scratch.generate([prefix + tail], 3)["tokens"][0]
    assert _metric(server, "qcompile_prefix_cache_snapshots") == snapshots + 1
    assert _metric(server, "qcompile_prefix_cache_hits") == hits + 1
    assert _metric(server, "qcompile_prefix_cache_hit_tokens") == tokens + 16
    server.wait_pool_full()  # kept sequences are not counted as used


def test_an_artifacts_prefix_slots_come_out_of_its_slots():
    from qcompile.cli import _artifact_request_slots

    assert _artifact_request_slots(8, 0, 1) == 8 and _artifact_request_slots(8, 2, 2) == 6
    for slots, prefix, ranks in ((8, 8, 1), (8, 1, 2)):
        with pytest.raises(UsageError, match="--prefix-slots"):
            _artifact_request_slots(slots, prefix, ranks)


def _generated(server) -> float:
    return _metric(server, "qcompile_generation_tokens_total")


def _aborted(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    found = re.search(r'^qcompile_requests_finished_total\{finish_reason="abort"\} (\S+)', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_client_that_goes_away_frees_its_pages(server):
    """A client that hangs up is cancelled between steps: its pages are free and it stopped generating long before
    its 40 tokens (the engine counts every token it makes)."""
    body = {"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "stream": True}
    before, aborted = _generated(server), _aborted(server)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    server.wait_pool_full()
    assert _generated(server) - before < 40
    # the same without streaming: a raw connection that sends the request and hangs up
    payload = json.dumps({**body, "stream": False}).encode()
    port = int(server.url.rsplit(":", 1)[1])
    before = _generated(server)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        deadline = time.monotonic() + 30
        while server.loop.state().running == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
    server.wait_pool_full()
    assert _generated(server) - before < 40
    metrics = httpx.get(server.url + "/metrics").text
    assert re.search(r"^qcompile_requests_running 0\.0$", metrics, re.M)
    assert _aborted(server) - aborted == 2  # both hung-up choices finished as abort in the metrics


def test_cancelling_half_of_many_streams_leaves_the_pool_full(server):
    async def one(client, i):
        body = {"prompt": [(5 * i + j) % 400 + 3 for j in range(3 + i % 5)], "max_tokens": 10, "temperature": 0,
                "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            made = 0
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    made += 1
                    if i % 2 and made == 2:
                        return "cancelled"
        return "done"

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(10)))

    assert asyncio.run(main()) == ["done", "cancelled"] * 5
    server.wait_pool_full()


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": [1, 2], "max_token": 3}, 400, "max_token"),
    ({"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": 47}, 400, "max_tokens"),
    ({"prompt": list(range(48))}, 400, "prompt"),
    ({"prompt": [1, 99999]}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": [1], "temperature": -1}, 400, "temperature"),
    ({"prompt": [1], "top_p": 0}, 400, "top_p"),
    ({"prompt": [1], "stream": "yes"}, 400, "stream"),
    ({"prompt": [1], "stream": 0}, 400, "stream"),  # not a boolean: OpenAI refuses it (it passed as false)
    ({"prompt": [1], "ignore_eos": 1}, 400, "ignore_eos"),
    ({"prompt": [1], "echo": 1}, 400, "echo"),
    ({"prompt": [1], "logprobs": 21}, 400, "logprobs"),  # past TOP_LOGPROBS
    ({"prompt": [1], "logprobs": True}, 400, "logprobs"),
    ({"prompt": [1], "model": "gpt-4"}, 404, "model"),
    ({"prompt": [1], "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ({"prompt": [1], "stop_token_ids": list(range(257))}, 400, "stop_token_ids"),
    # a false-like value of the wrong type is not "absent" (they passed), nor a non-string model "not found"
    ({"prompt": [1], "stop_token_ids": 0}, 400, "stop_token_ids"),
    ({"prompt": [1], "stream_options": False}, 400, "stream_options"),
    ({"prompt": [1], "model": 5}, 400, "model"),
    # prompts × n past 256 choices (64 000 held the event loop for seconds)
    ({"prompt": [[1]] * 257}, 400, "prompt"),
    ({"prompt": [[1]] * 5, "n": 64}, 400, "n"),
])
def test_bad_requests_get_an_error_naming_the_field(server, body, status, param):
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


def test_bodies_too_deep_or_too_large_are_refused_at_once(server):
    """JSON nested past Python's recursion limit is a 400 (a plain-text 500 before); a body past 4 MiB is a 413
    before it is parsed or tokenised (a 20 MB text prompt held the event loop for 15 s)."""
    deep = httpx.post(server.url + "/v1/completions", content=b"[" * 100000 + b"]" * 100000, timeout=30)
    assert deep.status_code == 400 and "not valid JSON" in deep.json()["error"]["message"]
    big = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "' + b"x" * (5 << 20) + b'"}', timeout=60)
    assert big.status_code == 413 and "larger than" in big.json()["error"]["message"]
    surrogate = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "a\\ud800b"}', timeout=30)
    assert surrogate.status_code == 400 and surrogate.json()["error"]["param"] == "prompt"  # cannot be encoded
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_a_huge_top_k_keeps_every_token_and_the_engine_alive(server):
    """top_k past the vocabulary means no top-k filter (it overflowed int32 on the engine thread and stopped the
    engine for every client)."""
    body = {"prompt": [5, 6], "max_tokens": 2, "temperature": 1.0, "top_k": 2**31, "seed": 3}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    again = httpx.post(server.url + "/v1/completions", json={**body, "top_k": 0}, timeout=120)
    assert again.json()["choices"][0]["token_ids"] == response.json()["choices"][0]["token_ids"]
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_malformed_bodies_and_the_other_endpoints(server):
    response = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=30)
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    assert httpx.post(server.url + "/v1/completions", json=[1, 2]).status_code == 400
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["small"] and models[0]["max_model_len"] == 48
    assert httpx.get(server.url + "/v1/completions").status_code == 405


def test_unknown_routes_and_methods_answer_with_openais_error_object(server):
    """A client parses every error as OpenAI's {"error": {...}} (plain-text 404 / 405 before)."""
    for response, status, words in ((httpx.get(server.url + "/v1/chat/complete"), 404, "/v1/chat/completions"),
                                    (httpx.get(server.url + "/v1/chat/completions"), 405, "GET"),
                                    (httpx.get(server.url + "/v1/completions"), 405, "GET"),
                                    (httpx.delete(server.url + "/v1/models"), 405, "DELETE")):
        assert response.status_code == status
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and words in error["message"]
    assert "POST" in httpx.get(server.url + "/v1/completions").headers["allow"]


def test_text_prompts_are_tokenised_off_the_event_loop(server, tokenizer, monkeypatch):
    """A body with text prompts is parsed on a worker thread, its texts encoded with one encode_batch, which lets go
    of the GIL (encode holds it: a 4 MB prompt stalled every client for 2-3 s) — the same ids as encode."""
    import qcompile.runtime.server as server_module

    threads = []
    real_parse = server_module.parse_completion

    def parse(*args, **kwargs):
        threads.append(threading.current_thread())
        return real_parse(*args, **kwargs)

    monkeypatch.setattr(server_module, "parse_completion", parse)
    texts = ["keeping many sequences", "in flight"]
    body = {"prompt": [texts[0], [5, 6], texts[1]], "max_tokens": 2, "temperature": 0}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert len(threads) == 1 and threads[0] is not server.thread  # uvicorn's event loop runs on server.thread
    assert response.json()["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(t).ids) for t in texts) + 2
    server.wait_pool_full()

    class Recording:
        def __init__(self):
            self.batches = []

        def encode_batch(self, batch):
            self.batches.append(list(batch))
            return tokenizer.encode_batch(batch)

    recording = Recording()
    parsed = real_parse(body, server.info, recording)
    assert recording.batches == [texts]
    assert parsed.prompts == (tuple(tokenizer.encode(texts[0]).ids), (5, 6), tuple(tokenizer.encode(texts[1]).ids))


def test_an_engine_failure_ends_streams_with_an_error_and_done(model, capsys):
    """The engine raising mid-request: a stream gets OpenAI's error object and then [DONE] (a client waiting for
    [DONE] hung before), a plain request a 500 with the error object, /health a 503 naming the error, and the
    operator the reason on stderr."""
    engine = model.engine(CacheConfig(max_seqs=2, max_context=48, max_step_tokens=8))
    real, calls = engine.launch_tokens, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("the accelerator fell over")
        return real(*args, **kwargs)

    engine.launch_tokens = failing  # what the scheduler calls (step_tokens launches too)
    srv = Server(engine, None)
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 20, "temperature": 0}
        stream = httpx.post(srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
        events = _sse(stream.text)  # asserts the last event is [DONE]
        assert events[-1]["error"]["type"] == "server_error" and "fell over" in events[-1]["error"]["message"]
        assert all("choices" in e for e in events[:-1]) and len(events) > 1  # the tokens made before it
        plain = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert plain.status_code == 503 and plain.json()["error"]["message"]
        health = httpx.get(srv.url + "/health", timeout=30)
        assert health.status_code == 503 and "fell over" in health.json()["error"]
    finally:
        srv.close()
    assert "the engine stopped: RuntimeError: the accelerator fell over" in capsys.readouterr().err


def test_the_tokens_per_second_gauge_falls_to_zero_when_idle(server):
    """The gauge is set after engine steps; a scrape reads it fresh, so an idle server reports 0 after the window
    (it kept the last busy value before)."""
    response = httpx.post(server.url + "/v1/completions", json={"prompt": [4, 5], "max_tokens": 4,
                                                                 "temperature": 0}, timeout=60)
    assert response.status_code == 200
    server.wait_pool_full()

    def gauge() -> float:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        return float(re.search(r"^qcompile_generation_tokens_per_second (\S+)", text, re.M).group(1))

    window = server.loop.window
    try:
        assert gauge() > 0
        server.loop.window = 0.2
        time.sleep(0.3)
        assert gauge() == 0.0
    finally:
        server.loop.window = window


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a compiler?"}]


def test_a_chat_request_is_the_completion_of_its_rendered_messages(server, tokenizer, chat_template):
    """The messages rendered by the template and encoded give the same greedy tokens and text as /v1/completions
    on those ids, in OpenAI's chat shape; without a limit a reply may run to the end of the context."""
    from qcompile.frontend.chat import encode_chat

    ids = encode_chat(tokenizer, chat_template, CHAT)
    plain = httpx.post(server.url + "/v1/completions", json={"prompt": ids, "max_tokens": 7, "temperature": 0},
                       timeout=60).json()
    chat = httpx.post(server.url + "/v1/chat/completions",
                      json={"messages": CHAT, "max_completion_tokens": 7, "temperature": 0}, timeout=60).json()
    assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-") and chat["model"] == "small"
    choice = chat["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": plain["choices"][0]["text"]}
    assert choice["token_ids"] == plain["choices"][0]["token_ids"] and choice["finish_reason"] == "length"
    assert chat["usage"] == plain["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 7,
                                               "total_tokens": len(ids) + 7}
    # max_tokens (the older name) is the same limit; none given: the rest of the 48-token context
    old_name = httpx.post(server.url + "/v1/chat/completions",
                          json={"messages": CHAT, "max_tokens": 7, "temperature": 0}, timeout=60).json()
    assert old_name["choices"][0]["token_ids"] == choice["token_ids"]
    whole = httpx.post(server.url + "/v1/chat/completions", json={"messages": CHAT, "temperature": 0},
                       timeout=60).json()
    assert whole["usage"]["completion_tokens"] == 48 - len(ids) and whole["choices"][0]["finish_reason"] == "length"
    assert whole["choices"][0]["token_ids"][:7] == choice["token_ids"]
    # the template's options: no generation prompt, or a variable it reads, change the prompt it gets
    short = [{"role": "user", "content": "Hi"}]
    kwargs = httpx.post(server.url + "/v1/chat/completions",
                        json={"messages": short, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}},
                        timeout=60).json()
    thinking = encode_chat(tokenizer, chat_template, short, variables={"enable_thinking": False})
    assert kwargs["usage"]["prompt_tokens"] == len(thinking) > len(encode_chat(tokenizer, chat_template, short))
    closed = httpx.post(server.url + "/v1/chat/completions",
                        json={"messages": CHAT, "max_tokens": 2, "add_generation_prompt": False}, timeout=60).json()
    assert closed["usage"]["prompt_tokens"] == len(encode_chat(tokenizer, chat_template, CHAT, False)) < len(ids)
    server.wait_pool_full()


def test_a_streamed_chat_names_the_role_first_and_adds_up_to_the_reply(server):
    body = {"messages": CHAT, "max_completion_tokens": 9, "temperature": 0, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        chunks = _sse(response.read().decode())
    *pieces, usage = chunks
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 18
    plain = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False, "stream_options": None},
                       timeout=60).json()
    for index in (0, 1):
        mine = [c["choices"][0] for c in pieces if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant" and all("role" not in c["delta"] for c in mine[1:])
        assert "".join(c["delta"].get("content", "") for c in mine) == \
            plain["choices"][index]["message"]["content"]
        assert sum((c["token_ids"] for c in mine), []) == plain["choices"][index]["token_ids"]
        assert [c["finish_reason"] for c in mine][-1] == "length" and mine[-1]["delta"].keys() <= {"content"}
    server.wait_pool_full()


@pytest.mark.parametrize("body, param, words", [
    ({}, "messages", "non-empty list"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"content": "hi"}]}, "messages", "string 'role'"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "must be text"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages",
     "text only"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages", "not tool"),  # the template refuses it
    ({"messages": [{"role": "user", "content": "word " * 60}]}, "messages", "context"),
    ({"messages": CHAT, "max_completion_tokens": 40}, "max_completion_tokens", "max_completion_tokens (40) exceed"),
    ({"messages": CHAT, "max_tokens": 40}, "max_tokens", "conversation ("),
    ({"messages": CHAT, "max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"messages": CHAT, "prompt": "hi"}, "prompt", "unknown field"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
    ({"messages": CHAT, "logprobs": 1}, "logprobs", "true or false"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "needs 'logprobs': true"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "in 0..20"),
    ({"messages": CHAT, "echo": True}, "echo", "unknown field"),
    ({"messages": CHAT, "response_format": {"type": "json_object"}}, "response_format", "not supported"),
    ({"messages": CHAT, "chat_template_kwargs": [1]}, "chat_template_kwargs", "object"),
    ({"messages": CHAT, "chat_template_kwargs": {"messages": []}}, "messages", "may not be named"),
    ({"messages": CHAT, "add_generation_prompt": "yes"}, "add_generation_prompt", "true or false"),
    ({"messages": CHAT, "model": "gpt-4o"}, "model", "does not exist"),
])
def test_bad_chat_requests_get_an_error_naming_the_field(server, body, param, words):
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == (404 if param == "model" else 400)
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_reasoning_parser_returns_the_think_block_apart(model, tokenizer, chat_template):
    """serve --reasoning-parser think: the reply's text — the same tokens as without the parser — comes back split
    (frontend/replies.py ReasoningSplit) into reasoning_content and content, plain and streamed alike; whether the
    reply starts inside the block is read from the prompt (a template that opened <think>). The random model never
    writes </think>, so an opened block holds the whole reply, and an unopened one none of it."""
    from qcompile.frontend.chat import TINY_CHAT_TEMPLATE, ChatTemplate, encode_chat
    from qcompile.frontend.replies import ReasoningSplit

    thinking = ChatTemplate.compile(TINY_CHAT_TEMPLATE + "{%- if add_generation_prompt and think is defined %}"
                                    "<think>\n{%- endif %}", "thinking", chat_template.special_tokens)
    srv = Server(model.engine(CacheConfig(max_seqs=2, max_context=64, max_step_tokens=8)), tokenizer,
                 chat_template=thinking, reasoning_parser="think")
    url = srv.url
    try:
        for variables, opened in (({"think": True}, True), ({}, False)):
            ids = encode_chat(tokenizer, thinking, CHAT, variables=variables)
            plain = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 8, "temperature": 0},
                               timeout=60).json()
            assert "choices" in plain, plain
            text = plain["choices"][0]["text"]
            reasoning, content = ReasoningSplit(opened).push(text, final=True)
            assert (reasoning, content) == ((text.lstrip("\n"), "") if opened else ("", text))
            body = {"messages": CHAT, "max_tokens": 8, "temperature": 0, "chat_template_kwargs": variables}
            message = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
            assert message == {"role": "assistant", "content": content, "reasoning_content": reasoning or None}
            with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True},
                              timeout=60) as response:
                deltas = [c["choices"][0]["delta"] for c in _sse(response.read().decode())]
            assert deltas[0]["role"] == "assistant"
            assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
            assert "".join(d.get("content", "") for d in deltas) == content
        with pytest.raises(UsageError, match="unknown reasoning parser"):
            create_app(srv.loop, srv.info, tokenizer, srv.metrics, thinking, reasoning_parser="r1")
    finally:
        srv.close()


def test_a_chat_reply_streams_the_message_it_gives_whole():
    """ChatReply (a chat choice as OpenAI's message): with a reasoning parser and tools, a reply's <think> block is
    reasoning_content, its calls tool_calls (finish_reason tool_calls where it was stop; content null when only
    whitespace is left), and its deltas — at any cut — add up to the same message."""
    from qcompile.runtime.server import ChatReply

    reply = ('<think>\nthe user wants weather\n</think>\n\n<tool_call>\n{"name": "weather", "arguments": '
             '{"city": "Bern"}}\n</tool_call>\n<tool_call>{"name": "now"}</tool_call>')
    message, reason = ChatReply(reasoning=True, tools=[]).message(reply, "stop")
    calls = [{"type": "function", "function": {"name": "weather", "arguments": '{"city": "Bern"}'}},
             {"type": "function", "function": {"name": "now", "arguments": "{}"}}]
    assert reason == "tool_calls" and message["content"] is None
    assert message["reasoning_content"] == "the user wants weather"
    assert [{k: v for k, v in c.items() if k != "id"} for c in message["tool_calls"]] == calls
    assert all(c["id"].startswith("call_") for c in message["tool_calls"])
    assert ChatReply(tools=[]).message(reply, "length")[1] == "length"  # cut short: not a finished call turn
    plain, reason = ChatReply(reasoning=True, tools=[]).message("Just text.", "stop")
    assert plain == {"role": "assistant", "content": "Just text.", "reasoning_content": None} and reason == "stop"
    for step in (1, 3, 7, 40):
        chat, deltas, reason = ChatReply(reasoning=True, tools=[]), [], None
        pieces = [reply[i:i + step] for i in range(0, len(reply), step)]
        for i, piece in enumerate(pieces):
            delta, reason = chat.delta(piece, "stop" if i == len(pieces) - 1 else None)
            deltas.append(delta)
        assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:]) and reason == "tool_calls"
        assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
        assert "".join(d.get("content", "") for d in deltas).strip() == ""
        streamed = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [c["index"] for c in streamed] == [0, 1]
        assert [{k: v for k, v in c.items() if k not in ("id", "index")} for c in streamed] == calls


def test_a_qwen3_coder_chat_reply_types_its_arguments_by_the_requests_tools():
    """ChatReply with the qwen3_coder parser (Qwen3.5's XML calls, after the thinking block its template opened): the call's
    parameters come back typed by the request's tool schema (days an integer, city text even where it looks like
    a number), and the deltas at any cut add up to the same message. The hermes parser leaves such a reply text."""
    from qcompile.runtime.server import ChatReply

    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}}}}]
    reply = ("weather, then\n</think>\n\nChecking.\n\n<tool_call>\n<function=weather>\n<parameter=city>\n"
             "10115\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
             "</function>\n</tool_call>")
    message, reason = ChatReply(True, reasoning=True, tools=tools, parser="qwen3_coder").message(reply, "stop")
    assert reason == "tool_calls" and message["reasoning_content"] == "weather, then"
    assert message["content"].strip() == "Checking."
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": '{"city": "10115", "days": 3, "metric": true}'}
    hermes, _ = ChatReply(True, reasoning=True, tools=tools).message(reply, "stop")
    assert "tool_calls" not in hermes and "<function=weather>" in hermes["content"]
    for step in (1, 5, 64):
        chat, deltas = ChatReply(True, reasoning=True, tools=tools, parser="qwen3_coder"), []
        pieces = [reply[i:i + step] for i in range(0, len(reply), step)]
        for i, piece in enumerate(pieces):
            deltas.append(chat.delta(piece, "stop" if i == len(pieces) - 1 else None)[0])
        assert "".join(d.get("content", "") for d in deltas) == message["content"]
        assert [c["function"] for d in deltas for c in d.get("tool_calls", [])] == [call["function"]]


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder"])
def test_tools_reach_the_template_with_a_tool_call_parser(model, tokenizer, chat_template, parser):
    """serve --tool-call-parser hermes or qwen3_coder: `tools` are rendered by the template (tool_choice "none": not), a forced
    choice or malformed tools are refused naming the field; the random model calls nothing, so its reply is the
    plain text. Without the parser `tools` are refused (test_bad_chat_requests_...)."""
    from qcompile.frontend.chat import TINY_CHAT_TEMPLATE, ChatTemplate, encode_chat

    with_tools = ChatTemplate.compile("{%- if tools %}<s>tools\n{%- for tool in tools %}{{ tool | tojson }}\n"
                                      "{%- endfor %}</s>\n{%- endif %}" + TINY_CHAT_TEMPLATE, "tools",
                                      chat_template.special_tokens)
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    srv = Server(model.engine(CacheConfig(max_seqs=2, max_context=128, max_step_tokens=16)), tokenizer,
                 chat_template=with_tools, tool_call_parser=parser)
    try:
        short = [{"role": "user", "content": "Time?"}]
        plain_ids = encode_chat(tokenizer, with_tools, short)
        tool_ids = len(tokenizer.encode(with_tools.render(short, tools=tools), add_special_tokens=False).ids)
        for extra, prompt_tokens in (({"tools": tools}, tool_ids), ({"tools": tools, "tool_choice": "none"},
                                                                    len(plain_ids)), ({}, len(plain_ids))):
            body = {"messages": short, "max_tokens": 4, "temperature": 0, **extra}
            reply = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()
            assert "usage" in reply and reply["usage"]["prompt_tokens"] == prompt_tokens, (extra, reply)
            assert "tool_calls" not in reply["choices"][0]["message"] and reply["choices"][0]["finish_reason"] == "length"
        assert tool_ids > len(plain_ids)
        for extra, param in (({"tools": tools, "tool_choice": "required"}, "tool_choice"),
                             ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
                             ({"tools": "now"}, "tools")):
            response = httpx.post(srv.url + "/v1/chat/completions", json={"messages": short, **extra}, timeout=30)
            assert response.status_code == 400 and response.json()["error"]["param"] == param
        with pytest.raises(UsageError, match="unknown tool-call parser"):
            create_app(srv.loop, srv.info, tokenizer, srv.metrics, with_tools, tool_call_parser="mistral")
    finally:
        srv.close()


def test_parse_chat_without_a_template_or_tokenizer_says_what_to_do(tokenizer, chat_template):
    from qcompile.runtime.server import parse_chat

    info = ModelInfo("m", 512, 64, (2,))
    defaults = {"logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none", "parallel_tool_calls": True,
                "response_format": {"type": "text"}, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}}
    parsed = parse_chat({"messages": CHAT, **defaults}, info, tokenizer, chat_template)
    assert parsed.stop_ids == (2,) and parsed.max_tokens == 64 - len(parsed.prompts[0])
    for tokenizer_, template, words in ((tokenizer, None, "--chat-template FILE"), (None, chat_template, "token ids")):
        with pytest.raises(BadRequest) as err:
            parse_chat({"messages": CHAT}, info, tokenizer_, template)
        assert err.value.param == "messages" and words in err.value.message


def test_parse_completion_defaults_and_refusals():
    info = ModelInfo("m", 100, 64, (2,))
    parsed = parse_completion({"prompt": [5, 6]}, info)
    assert (parsed.max_tokens, parsed.temperature, parsed.n, parsed.stop_ids) == (16, 1.0, 1, (2,))
    assert parse_completion({"prompt": [5], "ignore_eos": True, "stop_token_ids": [7]}, info).stop_ids == (7,)
    assert parse_completion({"prompt": [5], "temperature": 0}, info).sampling(0).greedy
    seeded = parse_completion({"prompt": [5], "seed": 4, "top_k": -1}, info)
    assert seeded.sampling(1).seed == 5 and seeded.sampling(1).top_k == 0
    for body, param in (({"prompt": "text"}, "prompt"), ({"prompt": [5], "stop": "x"}, "stop"),
                        ({"prompt": [5], "stream_options": {"include_usage": True}}, "stream_options")):
        with pytest.raises(BadRequest) as err:
            parse_completion(body, info)  # no tokenizer: text and stop strings are refused
        assert err.value.param == param


def test_unsupported_fields_pass_at_their_no_op_values_only():
    """OpenAI clients send the fields this server does not implement at their defaults — null, {}, "", 0 or 0.0,
    false, 1 — and those must pass; anything that would change the result is refused, naming the field."""
    info = ModelInfo("m", 100, 64, (2,))
    defaults = {"best_of": 1, "suffix": "", "presence_penalty": 0.0, "frequency_penalty": 0, "logit_bias": {},
                "min_p": 0, "repetition_penalty": 1}
    assert parse_completion({"prompt": [5], **defaults}, info).adjust == {}
    assert parse_completion({"prompt": [5], **{field: None for field in defaults}}, info).max_tokens == 16
    for field, value in (("best_of", 2), ("best_of", True), ("suffix", " end")):
        with pytest.raises(BadRequest) as err:
            parse_completion({"prompt": [5], field: value}, info)
        assert err.value.param == field, (field, value)


def test_penalties_min_p_and_logit_bias_reach_each_choices_sampling(tokenizer, chat_template):
    """Qwen3.5's model card asks for presence_penalty 1.5 (and top_k 20, min_p 0, repetition_penalty 1): those and
    OpenAI's frequency_penalty and logit_bias (token ids as string keys) become each choice's Sampling, greedy too;
    values out of OpenAI's and vLLM's ranges are refused, naming the field."""
    from qcompile.runtime.sampling import Sampling
    from qcompile.runtime.server import parse_chat

    info = ModelInfo("m", 100, 64, (2,))
    body = {"prompt": [5], "temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "presence_penalty": 1.5,
            "frequency_penalty": -0.25, "repetition_penalty": 1.1, "logit_bias": {"7": -100, "12": 2.5}, "seed": 9}
    choice = parse_completion(body, info).sampling(1)
    assert choice == Sampling(0.7, 20, 0.8, 10, min_p=0.05, presence_penalty=1.5, frequency_penalty=-0.25,
                              repetition_penalty=1.1, logit_bias=((7, -100.0), (12, 2.5)))
    greedy = parse_completion({**body, "temperature": 0}, info).sampling(0)
    assert greedy.greedy and not greedy.argmax and greedy.min_p == 0 and greedy.presence_penalty == 1.5
    chat = parse_chat({"messages": CHAT, **{k: v for k, v in body.items() if k != "prompt"}},
                      ModelInfo("m", 512, 64, (2,)), tokenizer, chat_template)
    assert chat.sampling(1) == choice
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -2.1), ("min_p", 1.2), ("min_p", "0.1"),
                         ("repetition_penalty", 0), ("repetition_penalty", -1), ("logit_bias", {"x": 1}),
                         ("logit_bias", {"5": 101}), ("logit_bias", {"100": 1}), ("logit_bias", {"5": True}),
                         ("logit_bias", [5, 1]), ("logit_bias", {str(i): 1 for i in range(1025)}),
                         ("logit_bias", {"9" * 5000: 1})):
        with pytest.raises(BadRequest) as err:
            parse_completion({"prompt": [5], field: value}, info)
        assert err.value.param == field and err.value.status == 400, (field, value)


def test_a_presence_penalty_over_http_stops_greedy_repeats(server):
    """A greedy request with presence_penalty 2 and the model card's other fields: 200, and no token made twice where
    the same request without it repeats (a tiny random model loops)."""
    body = {"prompt": [3, 4, 5], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]
    card = {"top_k": 20, "top_p": 0.8, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 2.0}
    response = httpx.post(server.url + "/v1/completions", json={**body, **card}, timeout=120)
    assert response.status_code == 200, response.text
    tokens = response.json()["choices"][0]["token_ids"]
    assert len(set(plain)) < len(plain) and len(set(tokens)) == len(tokens) == 24
    server.wait_pool_full()


def test_a_signal_ends_requests_in_flight_with_abort(model):
    """SIGTERM while streams run: the engine stops first, so every stream ends with a finish_reason and [DONE]
    (uvicorn cut them off after its 5 s grace before, and non-streaming requests got a plain-text 500)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "qcompile.cli", "serve", str(model.checkpoint.path), "--port", "0",
               "--passes", "none", "--verify", "none", "--no-warmup", "--max-seqs", "2", "--max-context", "512"]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url, deadline = None, time.monotonic() + 240
        while url is None:
            assert time.monotonic() < deadline and proc.poll() is None
            found = re.search(r"http://[\d.]+:\d+", proc.stderr.readline())
            url = found.group(0) if found else None
        ends: list = []
        started = threading.Event()

        def stream(i):
            body = {"prompt": [5, 6, 7 + i], "max_tokens": 480, "stream": True, "ignore_eos": True, "seed": i}
            events = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()
            ends.append(events)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]  # 2 run, 2 wait for a slot
        for thread in threads:
            thread.start()
        assert started.wait(120)
        proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(120)
        assert proc.wait(60) == 0 and "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(ends) == 4
    for events in ends:
        assert events[-1] == "[DONE]", events[-3:]
        reasons = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1] if json.loads(e).get("choices")]
        assert reasons[-1] in ("abort", "length"), reasons[-3:]
    assert any(json.loads(e[-2])["choices"][0]["finish_reason"] == "abort" for e in ends if e[-2].startswith("{"))


def test_the_serve_command_starts_answers_and_stops_on_ctrl_c(model, tmp_path):
    """The real command (with the reasoning and tool-call parsers as vLLM's commands for Qwen3.5 name them): port
    0, the address printed on stderr; SIGINT stops it with exit 0. A taken port, a
    missing checkpoint and an unreadable --chat-template are one-line errors (exit 2, 65 and 2)."""
    from qcompile.frontend.chat import TINY_CHAT_TEMPLATE

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    # the checkpoint has no template, nor a tokenizer_config.json naming its special tokens
    (tmp_path / "chat.jinja").write_text('{%- set bos_token, eos_token = "<s>", "</s>" %}\n' + TINY_CHAT_TEMPLATE)
    checkpoint = tmp_path / "ckpt"  # with a generation_config.json whose sampling defaults requests take
    source = Path(model.checkpoint.path)
    shutil.copytree(source if source.is_dir() else source.parent, checkpoint)
    (checkpoint / "generation_config.json").write_text(json.dumps({"temperature": 0.5, "top_k": 1, "top_p": 2.0}))
    command = [sys.executable, "-m", "qcompile.cli", "serve", str(checkpoint), "--port", "0",
               "--passes", "none", "--verify", "none", "--no-warmup", "--max-seqs", "2", "--max-context", "32",
               "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder", "--enable-auto-tool-choice",
               "--chat-template", str(tmp_path / "chat.jinja")]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url, seen = None, []
        deadline = time.monotonic() + 240
        while url is None:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
            line = proc.stderr.readline()
            seen.append(line)
            match = re.search(r"serving \S+ on (http://\S+)", line)
            url = match and match.group(1)
        got = httpx.post(url + "/v1/completions", json={"prompt": "A compiler", "max_tokens": 3, "temperature": 0},
                         timeout=120).json()
        assert len(got["choices"][0]["token_ids"]) == 3
        defaults = httpx.post(url + "/v1/completions", json={"prompt": "A compiler", "max_tokens": 3},
                              timeout=120).json()  # generation_config.json's top_k 1: the greedy tokens
        assert defaults["choices"][0]["token_ids"] == got["choices"][0]["token_ids"]
        said = "".join(seen)
        assert "generation_config.json's temperature 0.5, top_k 1 " in said and "top_p 2.0 left out" in said
        chat = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                              "max_tokens": 2, "logprobs": True}, timeout=120).json()
        assert chat["choices"][0]["message"]["role"] == "assistant" and len(chat["choices"][0]["token_ids"]) == 2
        assert len(chat["choices"][0]["logprobs"]["content"]) == 2
        assert "2 sequences x 32 tokens" in "".join(seen) and "1 prefix-cache slot)" in "".join(seen)
        port = int(url.rsplit(":", 1)[1])
        taken = subprocess.run([*command[:5], "--port", str(port)], capture_output=True, text=True, env=env,
                               timeout=120)
        assert taken.returncode == 2 and "pick another --port" in taken.stderr
        assert len(taken.stderr.strip().splitlines()) == 1
        slots = subprocess.run([*command[:5], "--no-prefix-cache", "--prefix-slots", "1"], capture_output=True,
                               text=True, env=env, timeout=120)
        assert slots.returncode == 2 and "--prefix-slots are the prefix cache's" in slots.stderr
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    missing = subprocess.run([*command[:4], str(tmp_path / "nothing")], capture_output=True, text=True, env=env,
                             timeout=120)
    assert missing.returncode == 65 and "no such file or directory" in missing.stderr  # bad input, as everywhere
    template = subprocess.run([*command[:-1], str(tmp_path / "absent.jinja")], capture_output=True, text=True,
                              env=env, timeout=120)
    assert template.returncode == 2 and "cannot read the chat template" in template.stderr
    assert len(template.stderr.strip().splitlines()) == 1


def test_generation_config_sets_the_sampling_defaults_of_requests_that_leave_them_out(tmp_path):
    """As vLLM's --generation-config auto: the fields of generation_config.json that differ from transformers'
    defaults (Qwen3.5's temperature, top_k, top_p) become what a request that leaves them out samples with; a field
    the request gives wins; a default out of a request's range is left out, said."""
    from qcompile.frontend.config import generation_defaults, load_config
    from qcompile.runtime.requests import request_defaults
    from qcompile.runtime.sampling import Sampling

    qwen = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.0,
            "eos_token_id": [248046, 248044], "max_new_tokens": 100}
    assert generation_defaults(qwen) == (("temperature", 0.6), ("top_p", 0.95), ("top_k", 20))
    assert generation_defaults({"top_k": 50, "temperature": True, "top_p": "0.9", "min_p": float("nan"),
                                "repetition_penalty": 1.05}) == (("repetition_penalty", 1.05),)
    assert request_defaults({"temperature": 3.0, "top_k": 20, "top_p": 0.0}) == ({"top_k": 20},
                                                                                ["temperature 3.0", "top_p 0.0"])
    info = ModelInfo("m", 100, 64, (2,), defaults={"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05})
    assert parse_completion({"prompt": [5], "seed": 1}, info).sampling(0) == Sampling(0.6, 20, 0.95, 1, min_p=0.05)
    explicit = parse_completion({"prompt": [5], "temperature": 0, "top_k": -1, "min_p": 0}, info)
    assert explicit.sampling(0).argmax and explicit.top_k == 0
    from conftest import write_small

    path = write_small(tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({**qwen, "eos_token_id": 2}))
    assert dict(load_config(path / "config.json").generation_defaults) == {"temperature": 0.6, "top_p": 0.95,
                                                                           "top_k": 20}


def test_bench_url_measures_the_server_with_the_in_process_metrics(server):
    from qcompile.compiler.bench import BenchOptions, run_bench
    from qcompile.compiler.bench_http import prefix_counters
    from qcompile.errors import UsageError
    from qcompile.runtime.sampling import Sampling

    lines = []
    report = run_bench(BenchOptions(source=None, url=server.url, input_len=6, output_len=4, concurrency=(2,),
                                    num_prompts=5, request_rate=50.0), emit=lines.append)
    (run,) = report["runs"]
    assert run["engine"] == "qcompile-http" and run["passes"] == "small" and run["concurrency"] == 2
    assert run["requests"] == 5 and run["complete"]
    assert run["ttft_ms"]["mean"] > 0 and run["output_tok_s"] > 0 and run["itl_ms"]["p99"] is not None
    assert run["measured_seconds"]["duration"] > 0 and run["prefill_tok_s"] is None
    assert any(line.startswith("qcompile-http") for line in "\n".join(lines).splitlines())
    server.wait_pool_full()
    # prompts sharing 18 of their 20 tokens: the server snapshots the shared page and later prompts start from it
    hits = _metric(server, "qcompile_prefix_cache_hits")
    report = run_bench(BenchOptions(source=None, url=server.url, input_len=20, output_len=2, concurrency=(1,),
                                    num_prompts=4, request_rate=math.inf, shared_prefix=18, seed=3),
                       emit=lambda line: None)
    assert report["runs"][0]["shared_prefix_len"] == 18 and report["runs"][0]["requests"] == 4
    assert _metric(server, "qcompile_prefix_cache_hits") >= hits + 2
    # the run record holds what the server's /metrics counted during the run
    assert report["runs"][0]["prefix_cache"]["hits"] == _metric(server, "qcompile_prefix_cache_hits") - hits
    server.wait_pool_full()
    # conversations: two of three turns, each later turn the last prompt, the streamed reply and new tokens; every
    # later turn continues its last turn's kept sequence (4 hits)
    hits = _metric(server, "qcompile_prefix_cache_hits")
    report = run_bench(BenchOptions(source=None, url=server.url, input_len=6, output_len=3, concurrency=(2,),
                                    num_prompts=2, turns=3, seed=4), emit=lambda line: None)
    assert (report["runs"][0]["turns"], report["runs"][0]["requests"]) == (3, 6) and report["runs"][0]["complete"]
    assert _metric(server, "qcompile_prefix_cache_hits") == hits + 4
    assert report["runs"][0]["prefix_cache"]["hits"] == 4 and report["runs"][0]["prefix_cache"]["hit_tokens"] > 0
    server.wait_pool_full()
    # n choices a request (sampled): each choice's tokens timed and counted as a request, every token made
    made = _metric(server, "qcompile_generation_tokens_total")
    report = run_bench(BenchOptions(source=None, url=server.url, input_len=6, output_len=4, concurrency=(1,),
                                    num_prompts=2, n=3, sampling=Sampling(1.0, 0, 1.0, 5)), emit=lambda line: None)
    assert (report["runs"][0]["n"], report["runs"][0]["requests"]) == (3, 6) and report["runs"][0]["complete"]
    run = report["runs"][0]  # every choice's tokens counted by the client, as many as the server made
    assert run["output_tok_s"] * run["measured_seconds"]["duration"] == pytest.approx(2 * 3 * 4)
    assert _metric(server, "qcompile_generation_tokens_total") == made + 2 * 3 * 4
    server.wait_pool_full()
    assert prefix_counters("http://127.0.0.1:9") is None  # nothing answers: the run record has no prefix_cache
    with pytest.raises(UsageError, match="context"):  # 6 + 3 × 12 + 2 × 8 tokens
        run_bench(BenchOptions(source=None, url=server.url, input_len=6, output_len=12, concurrency=(1,), turns=3))
    with pytest.raises(UsageError, match="no OpenAI-compatible server"):
        run_bench(BenchOptions(source=None, url="http://127.0.0.1:9", input_len=4, output_len=2, concurrency=(1,)))
    with pytest.raises(UsageError, match="context"):
        run_bench(BenchOptions(source=None, url=server.url, input_len=40, output_len=20, concurrency=(1,)))


@pytest.mark.slow
def test_a_soak_of_many_short_requests_over_http_loses_and_leaks_nothing(server):
    """600 short sampled requests, every fifth with n = 3 (choices forking one prefill), every fourth starting with
    one of two shared prefixes (snapshots), every sixth penalised, 24 in flight at a time, every third client hanging
    up after its first
    token: every other request gets all its tokens, and the pool is
    full at the end (the in-process soak is tests/test_scheduler.py)."""
    async def one(client, gate, i):
        prompt = [(7 * i + j) % 450 + 5 for j in range(2 + i % 7)]
        if i % 4 == 1:  # one of two 16-token prefixes: snapshots made, copied, released under the churn
            prompt = [(11 * j + i % 8 // 4) % 450 + 5 for j in range(16)] + prompt
        body = {"prompt": prompt, "max_tokens": 2 + i % 4,
                "temperature": 0.7, "seed": i, "n": 3 if i % 5 == 0 else 1, "stream": True}
        if i % 6 == 1:  # penalised: pairs and pending tokens under the churn
            body.update(presence_penalty=1.0, repetition_penalty=1.2, logit_bias={"7": -5})
        async with gate, client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            tokens = 0
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    tokens += len(json.loads(line[6:])["choices"][0]["token_ids"])
                    if i % 3 == 2:
                        return None
            return tokens == body["max_tokens"] * body["n"]

    async def main():
        gate = asyncio.Semaphore(24)
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=32)) as client:
            return await asyncio.gather(*(one(client, gate, i) for i in range(600)))

    snapshots = _metric(server, "qcompile_prefix_cache_snapshots")
    outcomes = asyncio.run(main())
    assert outcomes.count(True) == 400 and outcomes.count(None) == 200
    assert _metric(server, "qcompile_prefix_cache_snapshots") > snapshots
    server.wait_pool_full(60)
