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

The engine runs on its own thread (runtime/serving.py); this module only translates: HTTP ↔ requests, ids ↔ text
(frontend/tokenizer.py's TextStream, with stop strings) and the metrics.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
import uuid
from collections.abc import Callable

import attrs

from qcompile.errors import UsageError
from qcompile.frontend.chat import ChatError, chat_prompt, text_messages
from qcompile.frontend.replies import THINK_OPEN, ReasoningSplit, ToolCallStream
from qcompile.frontend.tokenizer import TextStream
from qcompile.runtime.sampling import Sampling
from qcompile.runtime.scheduler import Request
from qcompile.runtime.serving import EngineLoop, LoopState

__all__ = ["BadRequest", "Completion", "Metrics", "ModelInfo", "bind", "create_app", "parse_chat", "parse_completion",
           "uvicorn_server"]

#: OpenAI completion fields this server reads, and the ones it accepts only at their no-op values (null too).
FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "stop_token_ids",
          "ignore_eos", "stream", "stream_options", "user"}
UNSUPPORTED = {"echo": (False,), "logprobs": (), "best_of": (1,), "suffix": ("",), "presence_penalty": (0,),
               "frequency_penalty": (0,), "logit_bias": ({},)}
#: The same for chat completions: a completion's fields but `prompt`, plus the conversation and its template's
#: options. Tools only where the server parses tool calls (--tool-call-parser): else a call would come back as text.
CHAT_FIELDS = (FIELDS - {"prompt"}) | {"messages", "max_completion_tokens", "chat_template_kwargs",
                                      "add_generation_prompt"}
CHAT_UNSUPPORTED = {"logprobs": (False,), "top_logprobs": (0,), "presence_penalty": (0,), "frequency_penalty": (0,),
                    "logit_bias": ({},), "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False),
                    "response_format": ({"type": "text"},)}


# Request limits: a body, stop strings and stop ids no client needs more of (OpenAI allows 4 stop strings); past
# them a request is refused at once instead of tokenising or matching for seconds on the event loop.
MAX_BODY_BYTES = 4 << 20
MAX_STOP, MAX_STOP_CHARS, MAX_STOP_IDS = 16, 256, 256
# Choices (prompts × n) per request: each is a request in the engine, made and cancelled one by one; 64 000 of them
# (1000 prompts × n 64, a 6 KB body) held the event loop ~2 s and the engine thread ~3 s when the client left.
MAX_CHOICES = 256


def _same_value(value, no_op) -> bool:
    """value == no_op as JSON means it: 0 and 0.0 alike, but a boolean only equals a boolean (True is not 1)."""
    if isinstance(value, bool) or isinstance(no_op, bool):
        return value is no_op
    numbers = isinstance(value, (int, float)) and isinstance(no_op, (int, float))
    return (numbers or type(value) is type(no_op)) and value == no_op


@attrs.frozen
class ModelInfo:
    name: str
    vocab_size: int
    max_context: int
    eos_ids: tuple[int, ...]
    created: int = attrs.Factory(lambda: int(time.time()))


class BadRequest(Exception):
    """A request the server refuses: HTTP `status` with OpenAI's error object naming `param`."""

    def __init__(self, param: str | None, message: str, status: int = 400):
        super().__init__(message)
        self.param, self.message, self.status = param, message, status

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        code = "model_not_found" if self.status == 404 else None
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": code}}


@attrs.frozen
class Completion:
    """A parsed completions request: one choice per (prompt, i < n), in that order."""

    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int
    n: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_ids: tuple[int, ...]
    stream: bool
    include_usage: bool
    thinking_opened: bool = False  # a chat prompt that ends inside a <think> block its template opened
    tools: bool = False  # a chat request that gave the model tools: its replies' tool calls are parsed out

    def sampling(self, choice: int) -> Sampling:
        if self.temperature == 0:
            return Sampling()
        seed = random.getrandbits(32) if self.seed is None else (self.seed + choice) % 2**32
        return Sampling(self.temperature, self.top_k, self.top_p, seed)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict, field: str, default, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(field)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise BadRequest(field, f"'{field}' must be a number, got {json.dumps(value)}")
    if value < low or value > high or (low_open and value == low):
        where = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise BadRequest(field, f"'{field}' must be in {where}, got {value}")
    return float(value)


def _integer(body: dict, field: str, default, low: int, high: int | None = None):
    value = body.get(field)
    if value is None:
        return default
    if not _is_int(value) or value < low or (high is not None and value > high):
        limit = f">= {low}" if high is None else f"in {low}..{high}"
        raise BadRequest(field, f"'{field}' must be an integer {limit}, got {json.dumps(value)}")
    return value


def _prompts(body: dict, info: ModelInfo, tokenizer) -> list[list[int]]:
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("prompt", "'prompt' is required: text, a list of token ids, or a list of either")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest("prompt", "'prompt' must be text, a non-empty list of token ids, or a list of either")
    if len(prompt) > MAX_CHOICES:  # before tokenising them
        raise BadRequest("prompt", f"at most {MAX_CHOICES} prompts a request, got {len(prompt)}")
    texts = [item for item in prompt if isinstance(item, str)]
    if texts and tokenizer is None:
        raise BadRequest("prompt", "this model has no tokenizer.json: send the prompt as token ids")
    try:  # encode_batch releases the GIL while it works (encode holds it: a 4 MB prompt stalled every client 2-3 s)
        encoded = iter([e.ids for e in tokenizer.encode_batch(texts)] if texts else [])
    except (TypeError, ValueError, UnicodeError) as err:  # e.g. a lone surrogate escape
        raise BadRequest("prompt", f"the prompt text cannot be encoded ({type(err).__name__})") from None
    ids: list[list[int]] = []
    for item in prompt:
        if isinstance(item, str):
            item = next(encoded)
        elif not (isinstance(item, list) and all(_is_int(t) for t in item)):
            raise BadRequest("prompt", "'prompt' must be text, a list of token ids, or a list of either")
        if not item:
            raise BadRequest("prompt", "'prompt' is empty (no tokens)")
        bad = [t for t in item if not 0 <= t < info.vocab_size]
        if bad:
            raise BadRequest("prompt", f"token id {bad[0]} is outside the vocabulary (0..{info.vocab_size - 1})")
        ids.append(list(item))
    return ids


def _has_text(body) -> bool:
    """Whether a request body holds text prompts (which need tokenising)."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    return isinstance(prompt, str) or (isinstance(prompt, list) and any(isinstance(p, str) for p in prompt))


def _known_fields(body, fields: set, unsupported: dict) -> None:
    """A JSON object whose every field is read, or given at its no-op value; BadRequest names the first that is not."""
    if not isinstance(body, dict):
        raise BadRequest(None, "the request body must be a JSON object")
    for field in body:
        if field in unsupported:
            value = body[field]
            if value is not None and not any(_same_value(value, no_op) for no_op in unsupported[field]):
                raise BadRequest(field, f"'{field}' is not supported by this server")
        elif field not in fields:
            raise BadRequest(field, f"unknown field '{field}'")


def parse_completion(body, info: ModelInfo, tokenizer=None) -> Completion:
    """Validate a /v1/completions body; BadRequest names the first field that is wrong."""
    _known_fields(body, FIELDS, UNSUPPORTED)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model", f"'model' must be a string, got {json.dumps(model)}")
    if model is not None and model != info.name:
        raise BadRequest("model", f"the model '{model}' does not exist; this server has '{info.name}'", 404)
    n = _integer(body, "n", 1, 1, 64)
    prompts = _prompts(body, info, tokenizer)
    if len(prompts) * n > MAX_CHOICES:
        raise BadRequest("n", f"{len(prompts)} prompts × n {n} is more than {MAX_CHOICES} choices a request")
    max_tokens = _integer(body, "max_tokens", 16, 1)
    longest = max(len(p) for p in prompts)
    if longest >= info.max_context:
        raise BadRequest("prompt", f"the prompt has {longest} tokens; this server's context is {info.max_context}")
    if longest + max_tokens > info.max_context:
        raise BadRequest("max_tokens", f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceed this "
                                       f"server's context of {info.max_context} tokens")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise BadRequest("stop", "'stop' must be a string or a list of strings")
    if stop and tokenizer is None:
        raise BadRequest("stop", "stop strings need the model's tokenizer.json; use stop_token_ids")
    if stop and (len(stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stop)):
        raise BadRequest("stop", f"at most {MAX_STOP} stop strings of at most {MAX_STOP_CHARS} characters")
    stop_ids = [] if body.get("stop_token_ids") is None else body["stop_token_ids"]
    if not (isinstance(stop_ids, list) and len(stop_ids) <= MAX_STOP_IDS
            and all(_is_int(t) and 0 <= t < info.vocab_size for t in stop_ids)):
        raise BadRequest("stop_token_ids", f"'stop_token_ids' must be a list of at most {MAX_STOP_IDS} token ids "
                                           "in the vocabulary")
    flags = {}
    for field in ("ignore_eos", "stream"):
        flags[field] = False if body.get(field) is None else body[field]
        if not isinstance(flags[field], bool):  # 0 or "" too: OpenAI refuses a non-boolean
            raise BadRequest(field, f"'{field}' must be true or false, got {json.dumps(flags[field])}")
    options = {} if body.get("stream_options") is None else body["stream_options"]
    if not isinstance(options, dict) or set(options) - {"include_usage"} or \
            not isinstance(options.get("include_usage", False), bool):
        raise BadRequest("stream_options", "'stream_options' may only hold include_usage: true|false")
    if options and not flags["stream"]:
        raise BadRequest("stream_options", "'stream_options' needs stream: true")
    eos = () if flags["ignore_eos"] else info.eos_ids
    temperature = _number(body, "temperature", 1.0, 0, 2)
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise BadRequest("seed", f"'seed' must be an integer, got {json.dumps(seed)}")
    return Completion(
        prompts=tuple(tuple(p) for p in prompts), max_tokens=max_tokens, n=n,
        temperature=temperature, top_p=_number(body, "top_p", 1.0, 0, 1, low_open=True),
        top_k=min(max(0, _integer(body, "top_k", 0, -1)), info.vocab_size),  # -1 and 0: off; past V: all
        seed=None if seed is None else seed % 2**32, stop=tuple(stop or ()),
        stop_ids=tuple(dict.fromkeys([*eos, *stop_ids])), stream=flags["stream"],
        include_usage=bool(options.get("include_usage")))


def _tools(body: dict) -> list | None:
    """The request's tools (OpenAI's function schemas) for the template, or None: none given, or tool_choice
    "none". A forced choice ("required", a named function) is refused: nothing would make the model comply."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice is not None and choice not in ("auto", "none"):
        raise BadRequest("tool_choice", "'tool_choice' may be \"auto\" or \"none\" on this server (a forced call "
                                        "is not supported)")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) and isinstance(t["function"].get("parameters", {}), dict)
            for t in tools):
        raise BadRequest("tools", "'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": "
                                  "..., \"parameters\": {...}}}")
    return None if choice == "none" else tools


def parse_chat(body, info: ModelInfo, tokenizer, template, tool_calls: bool = False) -> Completion:
    """Validate a /v1/chat/completions body and render its messages with `template` (frontend/chat.py's
    ChatTemplate) into token ids: the completion of those ids, as /v1/completions would serve them. BadRequest names
    the first field that is wrong (`messages` for what the template refuses or a conversation too long).
    `tool_calls` (a server with a tool-call parser): `tools` reach the template and the replies' calls are parsed."""
    unsupported = {k: v for k, v in CHAT_UNSUPPORTED.items() if k not in ("tools", "tool_choice")} if tool_calls \
        else CHAT_UNSUPPORTED
    _known_fields(body, CHAT_FIELDS | ({"tools", "tool_choice"} if tool_calls else set()), unsupported)
    tools = _tools(body) if tool_calls else None
    if template is None:
        raise BadRequest("messages", "this model has no chat template (chat_template.jinja, or tokenizer_config.json's "
                                     "chat_template): send a prompt to /v1/completions, or start the server with "
                                     "--chat-template FILE")
    if tokenizer is None:
        raise BadRequest("messages", "chat needs the model's tokenizer.json: send token ids to /v1/completions")
    try:
        messages = text_messages(body.get("messages"))
    except ChatError as err:
        raise BadRequest("messages", str(err)) from None
    variables = {} if body.get("chat_template_kwargs") is None else body["chat_template_kwargs"]
    if not isinstance(variables, dict):
        raise BadRequest("chat_template_kwargs", "'chat_template_kwargs' must be an object of template variables")
    generation_prompt = True if body.get("add_generation_prompt") is None else body["add_generation_prompt"]
    if not isinstance(generation_prompt, bool):
        raise BadRequest("add_generation_prompt", "'add_generation_prompt' must be true or false")
    try:
        text, ids = chat_prompt(tokenizer, template, messages, generation_prompt, variables, tools)
    except ChatError as err:
        raise BadRequest("messages", str(err)) from None
    except (TypeError, ValueError, UnicodeError) as err:  # e.g. a lone surrogate escape
        raise BadRequest("messages", f"the conversation's text cannot be encoded ({type(err).__name__})") from None
    if not ids:
        raise BadRequest("messages", "the conversation renders to no tokens")
    limit_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    request = {field: value for field, value in body.items() if field in FIELDS and field != "max_tokens"}
    limit = body.get(limit_field)
    request.update(prompt=ids, max_tokens=max(1, info.max_context - len(ids)) if limit is None else limit)
    try:
        completion = parse_completion(request, info, tokenizer)
    except BadRequest as err:  # in the chat request's own terms
        param = {"prompt": "messages", "max_tokens": limit_field}.get(err.param, err.param)
        message = err.message.replace("'max_tokens'", f"'{limit_field}'").replace("the prompt", "the conversation")
        raise BadRequest(param, message, err.status) from None
    return attrs.evolve(completion, thinking_opened=text.rstrip().endswith(THINK_OPEN), tools=tools is not None)


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
            for _ in range(completion.n):
                index = len(self.choices)
                request = Request(list(prompt), completion.max_tokens, stop_ids=completion.stop_ids,
                                  id=f"{self.id}-{index}", sampling=completion.sampling(index))
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
        for choice in self.choices:
            self.state.loop.submit(choice.request,
                                   lambda r, t, i=choice.index: self._post("token", i, t, time.perf_counter()),
                                   lambda r, i=choice.index: self._post("finish", i, r.finish_reason,
                                                                        time.perf_counter()))

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
        """(choice, text, new ids, finish_reason or None) as the engine makes tokens, until every choice ended."""
        metrics, open_ = self.state.metrics, len(self.choices)
        while open_:
            kind, index, value, at = await self.events.get()
            choice = self.choices[index]
            if choice.finish_reason is not None:
                continue  # ended by a stop string; the engine's own finish comes after
            if kind == "token":
                if choice.last_token_at is None:
                    metrics.ttft.observe(at - choice.arrived)
                else:
                    metrics.itl.observe(at - choice.last_token_at)
                choice.last_token_at = at
                choice.token_ids.append(value)
                piece = choice.text.push(value) if choice.text is not None else ""
                if choice.text is not None and choice.text.stopped:
                    self.state.loop.cancel(choice.request)
                    reason = "stop"
                else:
                    yield choice, piece, [value], None
                    continue
            else:
                if value == "error":
                    error = self.state.loop.error
                    raise BadRequest(None, f"the engine failed: {type(error).__name__}: {error}", 500)
                piece = choice.text.finish() if choice.text is not None else ""
                reason = "stop" if choice.text is not None and choice.text.stopped else FINISH.get(value, value)
                value = None
            choice.finish_reason = reason
            metrics.requests.labels(reason).inc()
            metrics.e2e.observe(at - choice.arrived)
            open_ -= 1
            yield choice, piece, [value] if value is not None else [], reason

    def usage(self) -> dict:
        prompt = sum(map(len, self.completion.prompts))  # each prompt once, whatever n (as OpenAI counts)
        made = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}

    def envelope(self, choices: list[dict], chunk: bool = False) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.state.info.name,
                "choices": choices}

    def _reply(self) -> ChatReply:
        return ChatReply(self.completion.thinking_opened, self.reasoning, self.completion.tools)

    def choice_json(self, index: int, text: str, token_ids: list[int], finish_reason: str | None) -> dict:
        """A whole choice: its text (a chat choice: the assistant's message, ChatReply) and ids."""
        if not self.chat:
            return {"index": index, "text": text, "token_ids": token_ids, "logprobs": None,
                    "finish_reason": finish_reason}
        message, finish_reason = self._reply().message(text, finish_reason)
        return {"index": index, "message": message, "token_ids": token_ids, "logprobs": None,
                "finish_reason": finish_reason}

    def chunk_json(self, index: int, text: str, token_ids: list[int], finish_reason: str | None) -> dict:
        """A streamed piece of a choice (a chat choice's: its delta, ChatReply)."""
        if not self.chat:
            return self.choice_json(index, text, token_ids, finish_reason)
        delta, finish_reason = self._replies.setdefault(index, self._reply()).delta(text, finish_reason)
        return {"index": index, "delta": delta, "token_ids": token_ids, "logprobs": None,
                "finish_reason": finish_reason}


@attrs.define
class _AppState:
    loop: EngineLoop
    info: ModelInfo
    tokenizer: object
    metrics: Metrics
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None


def _tool_call_json(call: dict) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": call}


class ChatReply:
    """One chat choice's text as OpenAI's assistant message: whole (`message`) or as streamed deltas (`delta`, one
    reply per instance). With a reasoning parser its <think> block is `reasoning_content`; with tools the calls in it
    are `tool_calls` (finish_reason `tool_calls` where it would be `stop`). The deltas add up to the whole message."""

    def __init__(self, thinking_opened: bool = False, reasoning: bool = False, tools: bool = False):
        self.split = ReasoningSplit(thinking_opened) if reasoning else None
        self.tool_calls = ToolCallStream() if tools else None
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


REASONING_PARSERS = ("think",)  # <think> ... </think> (frontend/replies.py ReasoningSplit)
TOOL_CALL_PARSERS = ("hermes",)  # <tool_call>{"name", "arguments"}</tool_call> (frontend/replies.py ToolCallStream)


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
            elif _has_text(body):
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
        async for choice, piece, _, _ in job.pieces():
            texts[choice.index].append(piece)
        return {**job.envelope([job.choice_json(c.index, "".join(texts[c.index]), c.token_ids, c.finish_reason)
                                for c in job.choices]), "usage": job.usage()}

    async def _stream(job: _Completions):
        try:
            async for choice, piece, ids, reason in job.pieces():
                chunk = job.envelope([job.chunk_json(choice.index, piece, ids, reason)], chunk=True)
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
