"""The bodies of `qcompile serve`'s requests, validated: /v1/completions (`parse_completion`) and
/v1/chat/completions (`parse_chat`: the conversation rendered with the chat template, frontend/chat.py, into the
completion of its ids) become a `Completion`, or a `BadRequest` naming the first field that is wrong with OpenAI's
error object. Pure functions of the body, the model's ModelInfo, its tokenizer and template: no HTTP here
(runtime/server.py serves them).
"""

from __future__ import annotations

import json
import random
import re
import time

import attrs

from qcompile.frontend.chat import ChatError, chat_prompt, text_messages
from qcompile.frontend.replies import THINK_OPEN
from qcompile.kernels.logprobs import TOP_LOGPROBS
from qcompile.runtime.sampling import Sampling

__all__ = ["BadRequest", "Completion", "ModelInfo", "parse_chat", "parse_completion", "request_defaults"]

#: OpenAI completion fields this server reads, and the ones it accepts only at their no-op values (null too).
FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "stop_token_ids",
          "ignore_eos", "stream", "stream_options", "user", "logprobs", "echo", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "min_p", "logit_bias"}
UNSUPPORTED = {"best_of": (1,), "suffix": ("",)}
#: The same for chat completions: a completion's fields but `prompt`, plus the conversation and its template's
#: options. Tools only where the server parses tool calls (--tool-call-parser): else a call would come back as text.
CHAT_FIELDS = (FIELDS - {"prompt", "echo"}) | {"messages", "max_completion_tokens", "chat_template_kwargs",
                                              "add_generation_prompt", "top_logprobs"}
CHAT_UNSUPPORTED = {"tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False),
                    "response_format": ({"type": "text"},)}


# Request limits: a body, stop strings and stop ids no client needs more of (OpenAI allows 4 stop strings); past
# them a request is refused at once instead of tokenising or matching for seconds on the event loop.
MAX_BODY_BYTES = 4 << 20
MAX_STOP, MAX_STOP_CHARS, MAX_STOP_IDS = 16, 256, 256
# Choices (prompts × n) per request: each is a request in the engine, made and cancelled one by one; 64 000 of them
# (1000 prompts × n 64, a 6 KB body) held the event loop ~2 s and the engine thread ~3 s when the client left.
MAX_CHOICES = 256
MAX_LOGIT_BIAS = 1024  # token ids a request's logit_bias may name (OpenAI's limit is 300)


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
    # what a request that leaves out temperature, top_p, top_k, min_p or repetition_penalty gets instead of OpenAI's
    # defaults (serve --generation-config auto: the model's generation_config.json)
    defaults: dict = attrs.Factory(dict)


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
    tools: list | None = None  # a chat request's tools (OpenAI's function schemas): its replies' calls are parsed
    logprobs: int | None = None  # score each made token, with this many of the most likely beside it
    echo: bool = False  # a completion's text starts with its prompt (scored too, with logprobs); max_tokens may be 0
    # min_p, presence_penalty, frequency_penalty, repetition_penalty and logit_bias: Sampling's fields of those names
    adjust: dict = attrs.Factory(dict)

    def sampling(self, choice: int) -> Sampling:
        if self.temperature == 0:  # greedy: penalties and biases still move the argmax; min-p cannot
            return Sampling(**{k: v for k, v in self.adjust.items() if k != "min_p"})
        seed = random.getrandbits(32) if self.seed is None else (self.seed + choice) % 2**32
        return Sampling(self.temperature, self.top_k, self.top_p, seed, **self.adjust)


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


def request_defaults(defaults: dict) -> tuple[dict, list[str]]:
    """The sampling defaults (e.g. a generation_config.json's) a request can take — each in the range a request's own
    field must be in — and a note for each one that is not (left out)."""
    ranges = {"temperature": (0, 2), "top_p": (0, 1), "top_k": (-1, None), "min_p": (0, 1),
              "repetition_penalty": (0, 100)}
    kept, notes = {}, []
    for field, value in defaults.items():
        low, high = ranges.get(field, (None, None))
        open_low = field in ("top_p", "repetition_penalty")
        fits = field in ranges and (value > low if open_low else value >= low) and (high is None or value <= high)
        if fits:
            kept[field] = value
        else:
            notes.append(f"{field} {value!r}")
    return kept, notes


def _adjustments(body: dict, info: ModelInfo) -> dict:
    """The request's penalties, min-p and logit bias, in OpenAI's (and vLLM's) ranges, as Sampling's fields (those
    at their no-op values left out)."""
    defaults = info.defaults
    adjust = {"min_p": _number(body, "min_p", defaults.get("min_p", 0.0), 0, 1),
              "presence_penalty": _number(body, "presence_penalty", 0.0, -2, 2),
              "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2, 2),
              "repetition_penalty": _number(body, "repetition_penalty", defaults.get("repetition_penalty", 1.0), 0,
                                            100, low_open=True)}
    adjust = {field: value for field, value in adjust.items() if value != (1.0 if field == "repetition_penalty" else 0)}
    bias = body.get("logit_bias")
    if bias is None or bias == {}:
        return adjust
    shape = "'logit_bias' must map token ids (as strings) to biases in [-100, 100]"
    if not isinstance(bias, dict):
        raise BadRequest("logit_bias", shape)
    if len(bias) > MAX_LOGIT_BIAS:
        raise BadRequest("logit_bias", f"'logit_bias' may name at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
    pairs = []
    for key, value in bias.items():
        token = int(key) if re.fullmatch(r"\s*[0-9]{1,12}\s*", key) else None  # (a 5000-digit id: no int())
        if token is None or not isinstance(value, (int, float)) or isinstance(value, bool) or not -100 <= value <= 100:
            raise BadRequest("logit_bias", f"{shape}; got {json.dumps(key)}: {json.dumps(value)}")
        if token >= info.vocab_size:
            raise BadRequest("logit_bias", f"logit_bias token id {token} is outside the vocabulary "
                                           f"(0..{info.vocab_size - 1})")
        pairs.append((token, float(value)))
    return {**adjust, "logit_bias": tuple(pairs)}


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


def has_text_prompts(body) -> bool:
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
    echo = _flag(body, "echo")
    logprobs = _integer(body, "logprobs", None, 0, TOP_LOGPROBS)
    max_tokens = _integer(body, "max_tokens", 16, 0 if echo else 1)  # 0: score the prompt (echo), make nothing
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
    flags = {field: _flag(body, field) for field in ("ignore_eos", "stream")}
    options = {} if body.get("stream_options") is None else body["stream_options"]
    if not isinstance(options, dict) or set(options) - {"include_usage"} or \
            not isinstance(options.get("include_usage", False), bool):
        raise BadRequest("stream_options", "'stream_options' may only hold include_usage: true|false")
    if options and not flags["stream"]:
        raise BadRequest("stream_options", "'stream_options' needs stream: true")
    eos = () if flags["ignore_eos"] else info.eos_ids
    temperature = _number(body, "temperature", info.defaults.get("temperature", 1.0), 0, 2)
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise BadRequest("seed", f"'seed' must be an integer, got {json.dumps(seed)}")
    return Completion(
        prompts=tuple(tuple(p) for p in prompts), max_tokens=max_tokens, n=n,
        temperature=temperature, top_p=_number(body, "top_p", info.defaults.get("top_p", 1.0), 0, 1, low_open=True),
        top_k=min(max(0, _integer(body, "top_k", info.defaults.get("top_k", 0), -1)), info.vocab_size),  # -1 and 0:
        # off; past V: all
        seed=None if seed is None else seed % 2**32, stop=tuple(stop or ()),
        stop_ids=tuple(dict.fromkeys([*eos, *stop_ids])), stream=flags["stream"],
        include_usage=bool(options.get("include_usage")), logprobs=logprobs, echo=echo,
        adjust=_adjustments(body, info))


def _flag(body: dict, field: str) -> bool:
    value = False if body.get(field) is None else body[field]
    if not isinstance(value, bool):  # 0 or "" too: OpenAI refuses a non-boolean
        raise BadRequest(field, f"'{field}' must be true or false, got {json.dumps(value)}")
    return value


def _chat_logprobs(body: dict) -> int | None:
    """A chat request's `logprobs` (true: score each made token) and `top_logprobs` (how many of the most likely
    beside it; needs logprobs) as a completion's logprobs count, or None."""
    wanted, top = _flag(body, "logprobs"), _integer(body, "top_logprobs", None, 0, TOP_LOGPROBS)
    if top and not wanted:  # 0 is the no-op some clients send beside logprobs false
        raise BadRequest("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return (top or 0) if wanted else None


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
    logprobs = _chat_logprobs(body)
    request = {field: value for field, value in body.items()
               if field in FIELDS and field not in ("max_tokens", "logprobs")}
    limit = body.get(limit_field)
    request.update(prompt=ids, max_tokens=max(1, info.max_context - len(ids)) if limit is None else limit)
    try:
        completion = parse_completion(request, info, tokenizer)
    except BadRequest as err:  # in the chat request's own terms
        param = {"prompt": "messages", "max_tokens": limit_field}.get(err.param, err.param)
        message = re.sub(r"\bmax_tokens\b", limit_field, err.message)
        message = re.sub(r"\b(the )?prompt\b", lambda m: f"{m.group(1) or ''}conversation", message)
        raise BadRequest(param, message, err.status) from None
    return attrs.evolve(completion, thinking_opened=text.rstrip().endswith(THINK_OPEN), tools=tools,
                        logprobs=logprobs)
