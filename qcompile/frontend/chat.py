"""Chat prompts: a checkpoint's chat template rendered as Hugging Face transformers renders it, for `serve`'s
/v1/chat/completions.

A Hub checkpoint ships its chat template (Jinja) as `chat_template.jinja` beside `tokenizer.json`, or as
tokenizer_config.json's "chat_template" — a string, or a list of named templates of which "default" is the chat
one. The template turns a conversation into the prompt text the model was trained on (turn markers, the system
prompt, the assistant's opening); serving it any other way gives a model text it has never seen.

Rendering follows transformers 5.24's `apply_chat_template`: a sandboxed Jinja environment (templates are untrusted
code) with trim_blocks and lstrip_blocks, loop controls, `{% generation %}` blocks rendered as their body, a `tojson`
filter that does not escape HTML, `raise_exception`, `strftime_now`, `namespace` refusing underscore names; the
template sees `messages` (keys whose value is None dropped), `add_generation_prompt`, the tokenizer's special tokens
(`bos_token`, `eos_token`, ... from tokenizer_config.json) and the caller's extra variables (e.g. `enable_thinking`),
which win over the special tokens. The text is then encoded without adding special tokens: the template wrote them.
Tests compare the text and the ids with transformers' on the same files (tests/test_chat.py).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import attrs

from qcompile.errors import UsageError

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
#: The special tokens transformers hands a template (its SPECIAL_TOKENS_ATTRIBUTES), read from tokenizer_config.json.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

#: init-tiny's template: ChatML's shape with the tiny tokenizer's <s> and </s> as the turn markers (</s> is the
#: generated config's eos, so a reply ends where its turn does). Written for qcompile.
TINY_CHAT_TEMPLATE = """\
{%- for message in messages %}
    {%- if message.role not in ("system", "user", "assistant") %}
        {{- raise_exception("this template knows the roles system, user and assistant, not " ~ message.role) }}
    {%- endif %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = message.content | map(attribute="text") | join("\\n") %}
    {%- endif %}
    {{- bos_token + message.role + "\\n" + content | trim + eos_token + "\\n" }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- bos_token + "assistant\\n" }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- "<think>\\n\\n</think>\\n\\n" }}
    {%- endif %}
{%- endif %}
"""


class ChatError(ValueError):
    """A conversation the template refuses (its raise_exception, or an error while rendering): the caller's fault."""


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers marks the assistant's tokens with it): its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """Jinja's namespace without underscore names (no way into Python's internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            values = dict(*args, **kwargs)
            for name in values:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, values)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot store {name!r} on a namespace")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=lambda *a, **k: dict(*a, **k), namespace=Namespace)
    return env


@attrs.frozen
class ChatTemplate:
    """A compiled chat template, where it came from, and the special tokens it is rendered with."""

    text: str
    source: str
    special_tokens: dict = attrs.field(factory=dict)
    _compiled: object = attrs.field(default=None, eq=False, repr=False)
    reads_parts: bool = False  # it reads a message's content as a list of parts (else parts are joined first)

    @classmethod
    def compile(cls, text: str, source: str, special_tokens: dict | None = None) -> "ChatTemplate":
        """UsageError naming `source` when the text is not a Jinja template (or jinja2 is missing)."""
        try:
            env = _environment()
        except ImportError:
            raise UsageError("chat templates need jinja2: pip install 'qcompile[serve]'") from None
        import jinja2

        try:
            compiled = env.from_string(text)
        except jinja2.TemplateError as err:
            where = f" (line {err.lineno})" if getattr(err, "lineno", None) else ""
            raise UsageError(f"{source}: not a Jinja chat template{where}: {err.message or err}") from None
        return cls(text, source, dict(special_tokens or {}), compiled, _reads_parts(env.parse(text)))

    def render(self, messages: list[dict], add_generation_prompt: bool = True, variables: dict | None = None,
               tools: list | None = None) -> str:
        """The prompt text of `messages` (and the `tools` it may call, JSON schemas in OpenAI's form, as transformers
        hands them to a template); ChatError when the template refuses them or fails on them."""
        import jinja2

        plain = [{key: value if key != "content" or self.reads_parts else _joined(value)
                  for key, value in message.items() if value is not None} for message in messages]
        taken = sorted(set(variables or {}) & {"messages", "add_generation_prompt", "tools", "documents"})
        if taken:
            raise ChatError(f"template variables may not be named {', '.join(taken)}")
        context = {**self.special_tokens, **(variables or {})}
        try:
            return self._compiled.render(messages=plain, add_generation_prompt=add_generation_prompt, tools=tools,
                                         documents=None, **context)
        except jinja2.TemplateError as err:  # raise_exception, undefined names, the sandbox's refusals
            raise ChatError(f"the chat template ({self.source}) refused the messages: {err.message or err}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError,
                RecursionError, OverflowError) as err:
            raise ChatError(f"the chat template ({self.source}) failed on the messages: "
                            f"{type(err).__name__}: {err}") from None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeError, ValueError) as err:
        raise UsageError(f"{path}: not readable JSON ({type(err).__name__}: {err})") from None
    if not isinstance(value, dict):
        raise UsageError(f"{path}: not a JSON object")
    return value


def special_tokens(tokenizer_config: dict) -> dict[str, str]:
    """bos_token, eos_token, ... as strings: tokenizer_config.json holds each as text or as an added token's
    {"content": ...}."""
    tokens = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = tokenizer_config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens


def load_chat_template(directory: Path | None, override: Path | None = None) -> ChatTemplate | None:
    """The chat template of the tokenizer in `directory` (a checkpoint's or an artifact's): `override` (a Jinja file,
    e.g. `serve --chat-template`) when given, else chat_template.jinja, else tokenizer_config.json's; None when
    there is none. UsageError for an unreadable file or a template that does not compile."""
    config_path = None if directory is None else Path(directory) / TOKENIZER_CONFIG_FILE
    config = _read_json(config_path) if config_path is not None and config_path.is_file() else {}
    tokens = special_tokens(config)
    file = override if override is not None else (None if directory is None else Path(directory) / CHAT_TEMPLATE_FILE)
    if file is not None and (override is not None or file.is_file()):
        try:
            text = Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeError) as err:
            raise UsageError(f"{file}: cannot read the chat template ({getattr(err, 'strerror', None) or err})") \
                from None
        return ChatTemplate.compile(text, str(file), tokens)
    template = config.get("chat_template")
    if template is None:
        return None
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: "default" is the chat template
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
        if "default" not in named:
            raise UsageError(f"{config_path}: its chat templates ({', '.join(map(str, named))}) have no 'default'; "
                             "give one with --chat-template FILE")
        template = named["default"]
    if not isinstance(template, str):
        raise UsageError(f"{config_path}: 'chat_template' must be text or a list of named templates")
    return ChatTemplate.compile(template, f"{config_path}'s chat_template", tokens)


def _is_content(node) -> bool:
    """Whether a template expression names a message's content: `content`, `x.content` or `x['content']`."""
    from jinja2 import nodes

    while isinstance(node, nodes.Filter) and node.node is not None:
        node = node.node
    return (isinstance(node, nodes.Name) and node.name == "content") or \
        (isinstance(node, nodes.Getattr) and node.attr == "content") or \
        (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content")


def _reads_parts(tree) -> bool:
    """Whether a template reads content given as OpenAI's list of parts: it loops over content, or maps, joins or
    selects over it (Qwen3.5's renders each part; Qwen3's sets a content that is not text to ""). Such a template
    gets the parts as transformers hands them over; any other gets them joined by newlines, as vLLM does for
    templates that read content as text only."""
    from jinja2 import nodes

    return any(_is_content(loop.iter) for loop in tree.find_all(nodes.For)) or any(
        f.name in ("map", "join", "selectattr", "first", "last") and _is_content(f.node)
        for f in tree.find_all(nodes.Filter))


def _joined(content):
    return "\n".join(part["text"] for part in content) if isinstance(content, list) else content


def text_messages(messages) -> list[dict]:
    """A conversation as a text model's template reads it: each message an object with a string role, its content
    text, null, or OpenAI's text parts (kept as a list: ChatTemplate.render joins them for a template that reads
    text only); past tool calls' arguments decoded from JSON text; other fields as given. ChatError says what is
    wrong."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...}")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatError(f"messages[{i}] must be an object with a string 'role'")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                       for part in content):
                raise ChatError(f"messages[{i}].content: this model reads text only, as a string or parts "
                                '{"type": "text", "text": ...}')
            content = [{"type": "text", "text": part["text"]} for part in content]
        elif content is not None and not isinstance(content, str):
            raise ChatError(f"messages[{i}].content must be text, a list of text parts, or null")
        plain.append({**message, "content": content})
        if isinstance(message.get("tool_calls"), list):
            plain[-1]["tool_calls"] = [_decoded_arguments(call) for call in message["tool_calls"]]
    return plain


def _decoded_arguments(call):
    """A past tool call with its arguments as an object: OpenAI's API returns (and clients send back) them as JSON
    text, and templates that walk them (Qwen3.5's `arguments|items`) need the object — vLLM decodes them the same
    way before rendering. Empty or null arguments are {}; text that is not a JSON object stays as given."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not (function.get("arguments") is None or
                                                isinstance(function["arguments"], str)):
        return call
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}} if isinstance(arguments, dict) else call


def chat_prompt(tokenizer, template: ChatTemplate, messages: list[dict], add_generation_prompt: bool = True,
                variables: dict | None = None, tools: list | None = None) -> tuple[str, list[int]]:
    """The prompt text of a conversation and its token ids: rendered, then encoded without special tokens added
    (the template wrote them), as transformers' apply_chat_template(tokenize=True) gives them."""
    text = template.render(messages, add_generation_prompt, variables, tools)
    return text, tokenizer.encode(text, add_special_tokens=False).ids


def encode_chat(tokenizer, template: ChatTemplate, messages: list[dict], add_generation_prompt: bool = True,
                variables: dict | None = None) -> list[int]:
    """The token ids of a conversation (chat_prompt's)."""
    return chat_prompt(tokenizer, template, messages, add_generation_prompt, variables)[1]

