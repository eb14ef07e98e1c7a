"""`qcompile serve`: an OpenAI-compatible completions server (Starlette on uvicorn) over the continuous-batching engine.

Endpoints: `POST /v1/completions` (OpenAI's completions API: a prompt as text, token ids, or a list of either;
max_tokens, temperature, top_p, top_k, seed, n, stop, stop_token_ids, ignore_eos, stream as server-sent events with
stream_options.include_usage), `POST /v1/chat/completions` (OpenAI's chat API: `messages` rendered with the model's
chat template, frontend/chat.py, then served as a completion of those ids; max_completion_tokens or max_tokens,
default the rest of the context; vLLM's chat_template_kwargs and add_generation_prompt; with a reasoning parser
the reply's <think> block as reasoning_content, with a tool-call parser `tools` and the reply's calls as tool_calls:
ChatReply), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text format).
Every choice carries `token_ids`, the generated ids, so a checkpoint without a tokenizer is fully usable (its `text`
is ""). Fields follow the OpenAI reference; where it is silent, vLLM's server: `top_k`, `stop_token_ids`,
`ignore_eos`, `token_ids`, and `max_model_len` in /v1/models. Defaults are OpenAI's (max_tokens 16, temperature 1:
send temperature 0 for greedy); without a seed a sampled choice draws a fresh one; choice i of a request with a seed
draws with seed + i.

Errors: a malformed request gets 400 with OpenAI's error object, `param` naming the field (an unknown field too: a
misspelled option must not be silently ignored); a request that does not fit the context or the page pool gets 400;
an unknown model or path 404, a wrong method 405 (OpenAI's error object too); a server whose engine stopped 503; a
stream whose step failed gets the error as an event, then [DONE]. A client that disconnects — streaming or not —
cancels its requests between steps, so their slots and pages go back at once. Text prompts are tokenised off the
event loop.

The engine runs on its own thread (runtime/serving.py); this module only translates: HTTP ↔ requests (their
bodies validated by runtime/requests.py), ids ↔ text (frontend/tokenizer.py's TextStream, with stop strings;
ChatReply for chat) and the metrics.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from collections.abc import Callable

import attrs

from qcompile.errors import UsageError
from qcompile.frontend.replies import TOOL_CALL_STREAMS, ReasoningSplit
from qcompile.frontend.tokenizer import TextStream, TokenStrings, decode
from qcompile.runtime.logprobs import chat_logprobs, completion_logprobs
from qcompile.runtime.requests import (MAX_BODY_BYTES, BadRequest, Completion, ModelInfo, has_text_prompts, parse_chat,
                                       parse_completion)
from qcompile.runtime.scheduler import Request
from qcompile.runtime.serving import EngineLoop, LoopState

__all__ = ["BadRequest", "Completion", "Metrics", "ModelInfo", "bind", "create_app", "parse_chat", "parse_completion",
           "uvicorn_server"]

class Metrics:
    """The server's Prometheus metrics, in a registry of its own (several servers may share a process)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry = CollectorRegistry()
        latency = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.running = Gauge("qcompile_requests_running", "Requests in the running batch", registry=registry)
        self.waiting = Gauge("qcompile_requests_waiting", "Requests waiting for a slot or pages", registry=registry)
        self.kv_pages_used = Gauge("qcompile_kv_pages_used", "KV cache pages in use", registry=registry)
        self.kv_pages_total = Gauge("qcompile_kv_pages_total", "KV cache pages in the pool", registry=registry)
        self.slots_used = Gauge("qcompile_sequence_slots_used", "GDN state slots in use", registry=registry)
        self.tokens_per_s = Gauge("qcompile_generation_tokens_per_second",
                                  "Generated tokens per second over the last 10 s", registry=registry)
        self.prompt_tokens = Counter("qcompile_prompt_tokens", "Prompt tokens received", registry=registry)
        self.generation_tokens = Counter("qcompile_generation_tokens", "Tokens generated", registry=registry)
        self._counted = 0
        self.preemptions = Gauge("qcompile_preemptions", "Requests preempted for KV pages (and recomputed) so far",
                                 registry=registry)
        self.forks = Gauge("qcompile_prefill_forks", "Choices forked from their prompt's prefill (a request's n) so far",
                           registry=registry)
        self.shared_prompt_tokens = Gauge("qcompile_prompt_tokens_shared",
                                          "Prompt tokens those forks did not compute again, so far", registry=registry)
        self.prefix_cached = Gauge("qcompile_prefix_cache_sequences", "Sequences kept for a prompt that continues "
                                   "one (finished ones) or starts with one (shared prefixes' snapshots)",
                                   registry=registry)
        self.prefix_hits = Gauge("qcompile_prefix_cache_hits",
                                 "Requests that continued a kept sequence or started from a snapshot, so far",
                                 registry=registry)
        self.prefix_snapshots = Gauge("qcompile_prefix_cache_snapshots",
                                      "Prefixes that prompts shared snapshotted, so far", registry=registry)
        self.prefix_hit_tokens = Gauge("qcompile_prefix_cache_hit_tokens",
                                       "Prompt tokens those requests did not compute again, so far", registry=registry)
        self.requests = Counter("qcompile_requests_finished", "Finished choices by reason", ["finish_reason"],
                                registry=registry)
        self.ttft = Histogram("qcompile_time_to_first_token_seconds", "Time to first token", buckets=latency,
                              registry=registry)
        self.itl = Histogram("qcompile_inter_token_latency_seconds", "Time between tokens of a request",
                             buckets=latency, registry=registry)
        self.e2e = Histogram("qcompile_e2e_request_latency_seconds", "Arrival to last token", buckets=latency,
                             registry=registry)

    def on_state(self, state: LoopState) -> None:
        self.running.set(state.running)
        self.waiting.set(state.waiting)
        self.kv_pages_used.set(state.kv_pages_used)
        self.kv_pages_total.set(state.kv_pages_total)
        self.slots_used.set(state.slots_used)
        self.tokens_per_s.set(state.tokens_per_s)
        self.preemptions.set(state.preemptions)
        self.forks.set(state.forks)
        self.shared_prompt_tokens.set(state.shared_prompt_tokens)
        self.prefix_cached.set(state.prefix_cached)
        self.prefix_hits.set(state.prefix_hits)
        self.prefix_hit_tokens.set(state.prefix_hit_tokens)
        self.prefix_snapshots.set(state.prefix_snapshots)
        if state.tokens_made > self._counted:  # made by the engine, whether or not a client was still there
            self.generation_tokens.inc(state.tokens_made - self._counted)
            self._counted = state.tokens_made

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


FINISH = {"stop": "stop", "length": "length", "cancelled": "abort"}


@attrs.define(eq=False)
class _Choice:
    index: int
    request: Request
    text: TextStream | None
    arrived: float
    token_ids: list[int] = attrs.Factory(list)
    last_token_at: float | None = None
    finish_reason: str | None = None
    started: bool = False  # its first piece went out (with echo, the prompt leads it)
    text_offset: int = 0  # where its next token's text starts in its text (completions' logprobs.text_offset)


class _Completions:
    """One /v1/completions (or, `chat`, /v1/chat/completions) request: its choices in the engine, their events back
    on the event loop."""

    def __init__(self, app_state, completion: Completion, chat: bool = False):
        self.state, self.completion, self.chat = app_state, completion, chat
        self.reasoning = chat and app_state.reasoning_parser is not None  # replies split at </think>
        self._replies: dict[int, ChatReply] = {}  # each streamed chat choice's deltas so far
        self.id, self.created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        self.events: asyncio.Queue = asyncio.Queue()
        aloop, now = asyncio.get_running_loop(), time.perf_counter()
        tokenizer = app_state.tokenizer
        self.choices: list[_Choice] = []
        for prompt in completion.prompts:
            first = None  # a prompt's later choices fork from its first's prefill (runtime/scheduler.py), unless
            # each scores the prompt (echo with logprobs)
            for _ in range(completion.n):
                index = len(self.choices)
                scored = completion.logprobs is not None
                request = Request(list(prompt), max(1, completion.max_tokens), stop_ids=completion.stop_ids,
                                  id=f"{self.id}-{index}", sampling=completion.sampling(index), logprobs=scored,
                                  prompt_logprobs=scored and completion.echo, parent=first)
                if first is None and not request.prompt_logprobs:
                    first = request
                stream = TextStream(tokenizer, completion.stop) if tokenizer is not None else None
                self.choices.append(_Choice(index, request, stream, now))

        def post(*event):
            try:
                aloop.call_soon_threadsafe(self.events.put_nowait, event)
            except RuntimeError:  # the event loop has closed (server shutting down)
                pass

        self._post = post

    def start(self) -> None:
        metrics = self.state.metrics
        for choice in self.choices:
            self.state.loop.check(choice.request)  # before any is queued: all or nothing
        metrics.prompt_tokens.inc(sum(map(len, self.completion.prompts)))  # each prompt once, as usage counts
        self.state.loop.submit_all([
            (choice.request, lambda r, t, i=choice.index: self._post("token", i, t, time.perf_counter(), _scores(r)),
             lambda r, i=choice.index: self._post("finish", i, r.finish_reason, time.perf_counter(), None))
            for choice in self.choices])

    def cancel_unfinished(self) -> None:
        """Cancel the choices still running (the client went away, or the stream ended on an error): they finish
        as `abort` in the metrics — nothing reads their engine events any more."""
        metrics, now = self.state.metrics, time.perf_counter()
        for choice in self.choices:
            if choice.finish_reason is None:
                self.state.loop.cancel(choice.request)
                choice.finish_reason = "abort"
                metrics.requests.labels("abort").inc()
                metrics.e2e.observe(now - choice.arrived)

    async def pieces(self):
        """(choice, text, new ids, finish_reason or None, scored) as the engine makes tokens, until every choice
        ended. `scored` (None without logprobs): the (token id, TokenLogprob or None) the piece reports — with echo,
        the first piece's prompt tokens lead (the first unscored), then the piece's new ids."""
        metrics, open_ = self.state.metrics, len(self.choices)
        making = self.completion.max_tokens > 0  # max_tokens 0 (echo): the one token the engine makes is dropped
        while open_:
            kind, index, value, at, scores = await self.events.get()
            choice = self.choices[index]
            if choice.finish_reason is not None:
                continue  # ended by a stop string; the engine's own finish comes after
            lead, scored = self._lead(choice, scores)
            if kind == "token" and making:
                if choice.last_token_at is None:
                    metrics.ttft.observe(at - choice.arrived)
                else:
                    metrics.itl.observe(at - choice.last_token_at)
                choice.last_token_at = at
                choice.token_ids.append(value)
                if scored is not None:
                    scored.append((value, scores[1]))
                piece = lead + (choice.text.push(value) if choice.text is not None else "")
                if choice.text is not None and choice.text.stopped:
                    self.state.loop.cancel(choice.request)
                    reason = "stop"
                else:
                    yield choice, piece, [value], None, scored
                    continue
            elif kind == "token":
                if lead or scored:
                    yield choice, lead, [], None, scored
                continue
            else:
                if value == "error":
                    error = self.state.loop.error
                    raise BadRequest(None, f"the engine failed: {type(error).__name__}: {error}", 500)
                piece = lead + (choice.text.finish() if choice.text is not None else "")
                reason = "stop" if choice.text is not None and choice.text.stopped else FINISH.get(value, value)
                value = None
            choice.finish_reason = reason
            metrics.requests.labels(reason).inc()
            metrics.e2e.observe(at - choice.arrived)
            open_ -= 1
            yield choice, piece, [value] if value is not None else [], reason, scored

    def _lead(self, choice: _Choice, scores) -> tuple[str, list | None]:
        """What leads a choice's piece: with echo, its first piece starts with the prompt's text (and, with
        logprobs, its tokens scored from the second on); then the list the piece's own scores join."""
        scored = [] if self.completion.logprobs is not None else None
        if choice.started or not self.completion.echo:
            choice.started = True
            return "", scored
        choice.started = True
        prompt = choice.request.prompt
        tokenizer = self.state.tokenizer
        lead = decode(tokenizer, prompt) if tokenizer is not None else ""
        if scored is not None:
            prompt_scores = scores[0] if scores is not None else ()
            scored += [(prompt[0], None)] + [(t, s) for t, s in zip(prompt[1:], prompt_scores)]
        return lead, scored

    def usage(self) -> dict:
        prompt = sum(map(len, self.completion.prompts))  # each prompt once, whatever n (as OpenAI counts)
        made = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}

    def envelope(self, choices: list[dict], chunk: bool = False) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.state.info.name,
                "choices": choices}

    def _reply(self) -> ChatReply:
        return ChatReply(self.completion.thinking_opened, self.reasoning, self.completion.tools,
                         self.state.tool_call_parser or "hermes")

    def choice_json(self, index: int, text: str, token_ids: list[int], finish_reason: str | None,
                    scored: list | None = None) -> dict:
        """A whole choice: its text (a chat choice: the assistant's message, ChatReply), ids and logprobs."""
        if not self.chat:
            return {"index": index, "text": text, "token_ids": token_ids, "logprobs": self._logprobs(index, scored),
                    "finish_reason": finish_reason}
        message, finish_reason = self._reply().message(text, finish_reason)
        return {"index": index, "message": message, "token_ids": token_ids, "logprobs": self._logprobs(index, scored),
                "finish_reason": finish_reason}

    def chunk_json(self, index: int, text: str, token_ids: list[int], finish_reason: str | None,
                   scored: list | None = None) -> dict:
        """A streamed piece of a choice (a chat choice's: its delta, ChatReply)."""
        if not self.chat:
            return self.choice_json(index, text, token_ids, finish_reason, scored)
        delta, finish_reason = self._replies.setdefault(index, self._reply()).delta(text, finish_reason)
        return {"index": index, "delta": delta, "token_ids": token_ids, "logprobs": self._logprobs(index, scored),
                "finish_reason": finish_reason}

    def _logprobs(self, index: int, scored: list | None) -> dict | None:
        """The `logprobs` of a choice or chunk reporting `scored`, in OpenAI's shape for completions or chat."""
        if scored is None:
            return None
        top, strings = self.completion.logprobs, self.state.token_strings
        if self.chat:
            return {"content": chat_logprobs(scored, top, strings), "refusal": None}
        choice = self.choices[index]
        body = completion_logprobs(scored, top, strings, choice.text_offset)
        choice.text_offset += sum(len(strings(t)[0]) for t, _ in scored)
        return body


def _scores(request: Request) -> tuple | None:
    """What a token event carries for logprobs (read on the engine thread, when the token is made): with the first
    token the prompt's scores (complete by then; only a choice's first piece reports them), and the token's own;
    None without logprobs."""
    if not request.logprobs:
        return None
    return tuple(request.prompt_scores) if len(request.tokens) == 1 else (), request.token_logprobs[-1]


@attrs.define
class _AppState:
    loop: EngineLoop
    info: ModelInfo
    tokenizer: object
    metrics: Metrics
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    token_strings: Callable = attrs.field(init=False)

    def __attrs_post_init__(self):
        self.token_strings = TokenStrings(self.tokenizer) if self.tokenizer is not None else \
            lambda token: (f"token_id:{token}", None)


def _tool_call_json(call: dict) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": call}


class ChatReply:
    """One chat choice's text as OpenAI's assistant message: whole (`message`) or as streamed deltas (`delta`, one
    reply per instance). With a reasoning parser its <think> block is `reasoning_content`; with tools the calls in it
    are `tool_calls` (finish_reason `tool_calls` where it would be `stop`). The deltas add up to the whole message."""

    def __init__(self, thinking_opened: bool = False, reasoning: bool = False, tools: list | None = None,
                 parser: str = "hermes"):
        self.split = ReasoningSplit(thinking_opened) if reasoning else None
        self.tool_calls = TOOL_CALL_STREAMS[parser](tools) if tools is not None else None
        self.opened = False  # the first delta, which names the role, was made
        self.calls = 0  # calls streamed so far

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole reply's message and finish_reason (a fresh instance: it reads the text from the start)."""
        message = {"role": "assistant", "content": text}
        if self.split is not None:
            reasoning, message["content"] = self.split.push(text, final=True)
            message["reasoning_content"] = reasoning or None
        if self.tool_calls is not None:
            content, calls = self.tool_calls.push(message["content"], final=True)
            if calls:
                message["content"] = content if content.strip() else None
                message["tool_calls"] = [_tool_call_json(call) for call in calls]
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return message, finish_reason

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The delta of the reply's next piece of text (finish_reason given with the last piece) and the
        finish_reason to send with it."""
        final, reasoning, calls = finish_reason is not None, "", []
        if self.split is not None:
            reasoning, text = self.split.push(text, final)
        if self.tool_calls is not None:
            text, calls = self.tool_calls.push(text, final)
        delta = {**({"reasoning_content": reasoning} if reasoning else {}), **({"content": text} if text else {})}
        if calls:
            delta["tool_calls"] = [{"index": self.calls + i, **_tool_call_json(call)} for i, call in enumerate(calls)]
            self.calls += len(calls)
        if final and self.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        if not self.opened:
            self.opened = True
            delta = {"role": "assistant", "content": text, **delta}
        return delta, finish_reason


async def _disconnected(receive) -> None:
    """Returns when the client has gone (the request body was read already, so the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


#: <think> ... </think> (frontend/replies.py ReasoningSplit), under its own name and the names vLLM's commands give it
#: for these models (Qwen3.5's model card: qwen3; Qwen3-Next-Thinking's: deepseek_r1): one parser.
REASONING_PARSERS = ("think", "qwen3", "deepseek_r1")
#: hermes: <tool_call>{"name", "arguments"}</tool_call> (Qwen3, Qwen3-Next); qwen3_coder: <tool_call><function=NAME>
#: <parameter=K>value</parameter>... (Qwen3.5, Qwen3-Coder), values typed by the request's tools (frontend/replies.py)
TOOL_CALL_PARSERS = tuple(TOOL_CALL_STREAMS)


def create_app(loop: EngineLoop, info: ModelInfo, tokenizer=None, metrics: Metrics | None = None,
               chat_template=None, reasoning_parser: str | None = None, tool_call_parser: str | None = None):
    """The ASGI application; `loop` must be started (and stopped) by the caller. Pass the Metrics whose `on_state`
    the loop reports to, the model's ChatTemplate (frontend/chat.py) for /v1/chat/completions (without one, a
    chat request gets 400 saying so), and a reasoning parser (REASONING_PARSERS) to return chat replies' reasoning
    as `reasoning_content` apart from their content, and a tool-call parser (TOOL_CALL_PARSERS) to accept `tools`
    and return the calls in replies as `tool_calls`."""
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise UsageError(f"unknown reasoning parser {reasoning_parser!r}; choose {', '.join(REASONING_PARSERS)}")
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise UsageError(f"unknown tool-call parser {tool_call_parser!r}; choose {', '.join(TOOL_CALL_PARSERS)}")
    from starlette.applications import Starlette
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    state = _AppState(loop, info, tokenizer, metrics or Metrics(), reasoning_parser, tool_call_parser)

    def error(err: BadRequest) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    async def health(_request):
        if loop.alive:
            return JSONResponse({"status": "ok"})
        why = f"{type(loop.error).__name__}: {loop.error}" if loop.error else "the engine is not running"
        return JSONResponse({"status": "error", "error": why}, status_code=503)

    async def models(_request):
        return JSONResponse({"object": "list", "data": [
            {"id": info.name, "object": "model", "created": info.created, "owned_by": "qcompile",
             "max_model_len": info.max_context, "vocab_size": info.vocab_size}]})

    async def prometheus(_request):
        from prometheus_client import CONTENT_TYPE_LATEST

        state.metrics.tokens_per_s.set(loop.tokens_per_s())  # the engine reports it per step: stale when idle
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def completions(http: HttpRequest):
        return await _serve(http, chat=False)

    async def chat_completions(http: HttpRequest):
        return await _serve(http, chat=True)

    async def _serve(http: HttpRequest, chat: bool):
        try:
            declared = http.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
                raise BadRequest(None, f"the request body is larger than {MAX_BODY_BYTES} bytes", 413)
            raw = await http.body()
            if len(raw) > MAX_BODY_BYTES:
                raise BadRequest(None, f"the request body is larger than {MAX_BODY_BYTES} bytes", 413)
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):
                raise BadRequest(None, "the request body is not valid JSON") from None
            if chat:  # rendering and tokenising may take seconds: off the event loop, which serves every client
                completion = await asyncio.to_thread(parse_chat, body, info, tokenizer, chat_template,
                                                     tool_call_parser is not None)
            elif has_text_prompts(body):
                completion = await asyncio.to_thread(parse_completion, body, info, tokenizer)
            else:
                completion = parse_completion(body, info, tokenizer)
            if not loop.alive:
                raise BadRequest(None, "the engine is not running", 503)
            job = _Completions(state, completion, chat)
            try:
                job.start()
            except UsageError as err:  # pages: the pool could never hold it
                raise BadRequest("max_tokens", str(err)) from None
        except BadRequest as err:
            return error(err)
        if completion.stream:
            return StreamingResponse(_stream(job), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        collect = asyncio.ensure_future(_collect(job))
        gone = asyncio.ensure_future(_disconnected(http.receive))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client went away: free its slots and pages now
                collect.cancel()
                job.cancel_unfinished()
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)
        try:
            return JSONResponse(collect.result())
        except BadRequest as err:
            return error(err)

    async def _collect(job: _Completions) -> dict:
        texts = {c.index: [] for c in job.choices}
        scored = {c.index: [] if job.completion.logprobs is not None else None for c in job.choices}
        async for choice, piece, _, _, scores in job.pieces():
            texts[choice.index].append(piece)
            if scores:
                scored[choice.index] += scores
        return {**job.envelope([job.choice_json(c.index, "".join(texts[c.index]), c.token_ids, c.finish_reason,
                                                scored[c.index]) for c in job.choices]), "usage": job.usage()}

    async def _stream(job: _Completions):
        try:
            async for choice, piece, ids, reason, scored in job.pieces():
                chunk = job.envelope([job.chunk_json(choice.index, piece, ids, reason, scored)], chunk=True)
                if job.completion.include_usage:
                    chunk["usage"] = None
                yield f"data: {json.dumps(chunk)}\n\n"
            if job.completion.include_usage:
                yield f"data: {json.dumps({**job.envelope([], chunk=True), 'usage': job.usage()})}\n\n"
            yield "data: [DONE]\n\n"
        except BadRequest as err:  # the engine failed mid-stream: the error event, then the end of the stream
            yield f"data: {json.dumps(err.body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # normal end, or the client disconnected (this generator is closed or cancelled)
            job.cancel_unfinished()

    async def http_error(request: HttpRequest, exc):
        """Unknown paths and wrong methods answer with OpenAI's error object too (clients parse it)."""
        status = getattr(exc, "status_code", 500)
        if status == 404:
            message = (f"no route {request.url.path}; this server has /v1/completions, /v1/chat/completions, "
                       "/v1/models, /health, /metrics")
        elif status == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(getattr(exc, "detail", "")) or "error"
        headers = getattr(exc, "headers", None)
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": None}}, status_code=status, headers=headers)

    from starlette.exceptions import HTTPException

    return Starlette(routes=[Route("/health", health), Route("/v1/models", models), Route("/metrics", prometheus),
                             Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat_completions, methods=["POST"])],
                     exception_handlers={HTTPException: http_error})


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free port); a usage error when it cannot be had."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as err:
        raise UsageError(f"--host {host}: not an address this machine can listen on ({err.strerror})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port} ({err.strerror or err}); pick another --port") from None
    sock.listen(2048)
    return sock


def uvicorn_server(app, sock: socket.socket, on_exit: Callable[[], None] | None = None):
    """A uvicorn server for `app` on a bound socket (run it with `.run(sockets=[sock])`; stop: `.should_exit`).
    Ctrl-C or SIGTERM stops it gracefully and `run` returns (uvicorn would raise the signal again afterwards, making
    a normal stop look like a crash); a second Ctrl-C stops it at once. `on_exit` runs at the first signal, before
    uvicorn closes the connections: the engine loop's request_stop, so requests in flight end with finish_reason
    `abort` (and streams with [DONE]) instead of being cut off after uvicorn's grace period."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:
                self.force_exit = True
            elif on_exit is not None:
                on_exit()
            self.should_exit = True

    host, port = sock.getsockname()[:2]
    return Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                                 timeout_graceful_shutdown=5))
