"""A chat reply's text taken apart as OpenAI's chat API returns it: the reasoning of a thinking model (its
<think> block) and the tool calls (hermes <tool_call> JSON blocks, or Qwen3.5 / Qwen3-Coder XML <function=...>
blocks), a piece at a time for streaming, so that the pieces always add up to what the whole reply gives. Used by
`serve` (runtime/server.py ChatReply) with --reasoning-parser and --tool-call-parser (TOOL_CALL_STREAMS); pure text
in, text and calls out.
"""

from __future__ import annotations

import ast
import json
import re

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
_XML_CALL = re.compile(r"<tool_call>\s*<function=")  # where an XML tool call starts (ends a thinking block)


class ReasoningSplit:
    """A reply's text split into its reasoning (inside <think> ... </think>) and its content (after), a piece at a
    time, for `serve --reasoning-parser think` (Qwen3 / Qwen3.5 / Qwen3-Next thinking models; DeepSeek-R1's tags).

    Where the reasoning starts is read from the prompt, not guessed: a template that opened the thinking block
    (the prompt ends with <think>, as Qwen3's thinking templates do) makes the reply reasoning from its first token;
    otherwise the reply is reasoning only if it opens a <think> block itself (leading whitespace allowed). Either
    way the reasoning ends at the first </think> — or where an XML tool call starts (`<tool_call>`, whitespace,
    `<function=`): Qwen3.5 may open a call inside its thinking without closing the block (vLLM's qwen3 reasoning
    parser ends the reasoning there too), and the call then belongs to the content, where the tool-call parser
    reads it. The newlines just inside the block and just after it are dropped (the templates write them as
    layout). A reply that never closes its block is all reasoning. Text that could still turn out to be a tag, or
    layout, is held back until it cannot."""

    def __init__(self, prompt_opened: bool):
        self.state = "opened" if prompt_opened else "start"  # start → opened | content; opened → reasoning → after
        self.pending = ""

    @staticmethod
    def _held(text: str, tag: str) -> int:
        """The length of the longest end of `text` that may still turn out to be layout newlines and the start of
        `tag` ("\\n\\n</thi"), so is not sent yet."""
        for k in range(min(len(tag) - 1, len(text)), -1, -1):
            if text.endswith(tag[:k]):
                rest = text[:len(text) - k]
                return k + len(rest) - len(rest.rstrip("\n"))
        return 0

    @classmethod
    def _call_held(cls, text: str) -> int:
        """The same for the start of an XML tool call: `<tool_call>` and whitespace, then part of `<function=`."""
        at = text.rfind(TOOL_OPEN)
        if at >= 0 and FUNCTION_OPEN.startswith(text[at + len(TOOL_OPEN):].lstrip()):
            return len(text) - len(text[:at].rstrip("\n"))
        return cls._held(text, TOOL_OPEN)

    def push(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) that may be sent now, given the reply's next piece of text."""
        self.pending += text
        reasoning = ""
        if self.state == "start":
            stripped = self.pending.lstrip()
            if stripped.startswith(THINK_OPEN):
                self.state, self.pending = "opened", stripped[len(THINK_OPEN):]
            elif final or not THINK_OPEN.startswith(stripped):
                self.state = "content"
            else:
                return "", ""  # still possibly "<think"
        if self.state == "opened":  # the newlines just inside the block are layout
            self.pending = self.pending.lstrip("\n")
            if not self.pending and not final:
                return "", ""
            self.state = "reasoning"
        if self.state == "reasoning":
            end = self.pending.find(THINK_CLOSE)
            call = _XML_CALL.search(self.pending)
            if call is not None and (end < 0 or call.start() < end):  # a call ends the reasoning; it is content
                reasoning, self.pending = self.pending[:call.start()].rstrip("\n"), self.pending[call.start():]
                self.state = "content"
            elif end < 0:
                if final:
                    reasoning, self.pending = self.pending, ""
                    return reasoning, ""
                cut = len(self.pending) - max(self._held(self.pending, THINK_CLOSE), self._call_held(self.pending))
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
                return reasoning, ""
            else:
                reasoning, self.pending = self.pending[:end].rstrip("\n"), self.pending[end + len(THINK_CLOSE):]
                self.state = "after"
        if self.state == "after":  # the newlines after the block are layout
            self.pending = self.pending.lstrip("\n")
            if not self.pending and not final:
                return reasoning, ""
            self.state = "content"
        content, self.pending = self.pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is left once the reply has ended."""
        return self.push("", final=True)



class _BlockStream:
    """What the tool-call parsers share: a reply's content with its call blocks taken out, a piece at a time.

    A subclass names its blocks (BLOCKS: opening tag → closing tag) and reads one (`_parse_block`). A block runs
    from its opening tag to the first closing tag after it; a block that reads as calls is taken out, one that does
    not, or is never closed, stays text. A block is held back until it closes (its calls are sent whole), and so is
    text that could still begin one, so the pieces of content add up, over any cut of the reply, to the content of
    the whole reply read at once, and the calls are the same."""

    BLOCKS: dict[str, str] = {}

    def __init__(self):
        self.pending = ""

    def _parse_block(self, opener: str, body: str) -> list[dict] | None:
        """The calls ({"name", "arguments" as JSON text}) in the text between `opener` and its closing tag; None
        when it is not calls (then the block stays text)."""
        raise NotImplementedError

    def _next_block(self) -> tuple[int, str | None]:
        """Where the first opening tag in the pending text starts, and which it is (None when there is none)."""
        found = [(at, tag) for tag in self.BLOCKS if (at := self.pending.find(tag)) >= 0]
        return min(found) if found else (-1, None)

    def _held(self) -> int:
        """The length of the longest end of the pending text that may still turn out to begin an opening tag."""
        return max((k for tag in self.BLOCKS for k in range(min(len(tag) - 1, len(self.pending)), 0, -1)
                    if self.pending.endswith(tag[:k])), default=0)

    def push(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """(content, calls) that may be sent now, given the content's next piece (`final` with the last one)."""
        self.pending += text
        content, calls = "", []
        while True:
            start, opener = self._next_block()
            if opener is None:
                cut = len(self.pending) - (0 if final else self._held())
                content, self.pending = content + self.pending[:cut], self.pending[cut:]
                return content, calls
            end = self.pending.find(self.BLOCKS[opener], start + len(opener))
            if end < 0:  # open: held back until it closes, text if it never does
                content, self.pending = content + self.pending[:start], self.pending[start:]
                if final:
                    content, self.pending = content + self.pending, ""
                return content, calls
            found = self._parse_block(opener, self.pending[start + len(opener):end])
            after = end + len(self.BLOCKS[opener])
            if found is None:
                content += self.pending[:after]
            else:
                content, calls = content + self.pending[:start], calls + found
            self.pending = self.pending[after:]

    def finish(self) -> tuple[str, list[dict]]:
        """What is left once the reply has ended."""
        return self.push("", final=True)


def _tool_call(block: str) -> dict | None:
    """A hermes tool call's {"name", "arguments"} as OpenAI's function call (arguments as JSON text); None when the
    block is not one (then it stays text)."""
    try:
        call = json.loads(block)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"name": call["name"], "arguments": arguments}


class ToolCallStream(_BlockStream):
    """A reply's content with its tool calls taken out, a piece at a time, for `serve --tool-call-parser hermes`
    (Qwen3 and Qwen3-Next write a call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, the
    format of the Hermes function-calling models their templates follow).

    Text outside the blocks is content; a block whose JSON names a function becomes a call (its arguments as JSON
    text, as OpenAI returns them); a block that does not parse, or is never closed, stays text. A block is held back
    until it closes (a call is sent whole), and so is text that could still begin one. The pieces of content add up
    to the reply's text without its calls, layout newlines included (`serve` returns a plain reply's content as null
    when it is only whitespace beside calls)."""

    BLOCKS = {TOOL_OPEN: TOOL_CLOSE}

    def __init__(self, tools: list | None = None):
        """`tools` is taken for the same interface as XmlToolCallStream and not used: the JSON carries its types."""
        super().__init__()

    def _parse_block(self, opener: str, body: str) -> list[dict] | None:
        call = _tool_call(body.strip())
        return None if call is None else [call]


#: Parameter types (lower case) whose values are text as written, as vLLM's qwen3_coder parser reads them.
_TEXT_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
_BOOLEAN_TYPES = frozenset({"boolean", "bool", "binary"})
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_NUMBER_PREFIXES = ("num", "float")
_JSON_TYPES = frozenset({"object", "array", "arr"})
_JSON_PREFIXES = ("dict", "list")
_NULLS = frozenset({"null", "none"})  # JSON's null and Python's None (the Qwen3.5 template writes `None|string`)

_FUNCTION = re.compile(r"([^\s<>{}\"'=]+)>(.*)", re.S)  # what follows "<function=": NAME>parameters
_NEXT_FUNCTION = re.compile(r"\s*<function=(.*?)</function>(?=\s*(?:<function=|\Z))", re.S)
_NEXT_PARAMETER = re.compile(r"\s*<parameter=([^<>\s]+)>(.*?)</parameter>(?=\s*(?:<parameter=|\Z))", re.S)


def _parameter_schemas(tools: list | None) -> dict[str, dict]:
    """Each function's parameter schemas by name (`parameters.properties`) from a request's OpenAI tool list."""
    schemas = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            schemas[function["name"]] = properties if isinstance(properties, dict) else {}
    return schemas


def _schema_type(schema: dict | None) -> tuple[str, bool]:
    """A parameter's type (its first that is not null, lower case; "string" when it declares none) and whether it
    may be null, from `type` (a name or a list of names) and the alternatives in `anyOf` / `oneOf`."""
    schema = schema if isinstance(schema, dict) else {}
    options = [schema, *(option for key in ("anyOf", "oneOf") if isinstance(schema.get(key), list)
                         for option in schema[key])]
    declared = []
    for option in options:
        kind = option.get("type") if isinstance(option, dict) else None
        declared += kind if isinstance(kind, list) else [] if kind is None else [kind]
    names = [str(kind).strip().lower() for kind in declared]
    return next((name for name in names if name != "null"), "null" if names else "string"), "null" in names


def _number(value: str) -> int | float:
    """A JSON number's value: an int when it is whole ("3.0" is 3), as vLLM's qwen3_coder parser gives it."""
    number = float(value)
    return int(number) if number.is_integer() else number


def _json_or_literal(value: str):
    """A JSON value, or failing that a Python literal (the template writes some values with Python's `str`)."""
    try:
        return json.loads(value)
    except ValueError:
        return ast.literal_eval(value)


def _converter(kind: str):
    """The function that reads a value of the (non-text, non-boolean) parameter type `kind`."""
    if kind.startswith(_INTEGER_PREFIXES):
        return int
    if kind.startswith(_NUMBER_PREFIXES):
        return _number
    if kind in _JSON_TYPES or kind.startswith(_JSON_PREFIXES):
        return _json_or_literal
    return ast.literal_eval  # another type (null, or one not named above): literals only, never code


def _jsonable(value) -> bool:
    """Whether `value` is JSON (no sets or bytes from a Python literal, no infinities or NaN)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def _convert(value: str, schema: dict | None):
    """A parameter's value as its schema types it, as vLLM's qwen3_coder parser does: a parameter the function's
    schema does not name (None) is typed as one without a type, that is as text (vLLM's choice: with no type to go
    by, text is what was written, so "007" is not read as 7); text types keep the text, and so does a value that
    does not read as its type; `null` / `None` (any case) is null unless the type is text and not nullable; a
    boolean is true exactly when its text is `true` (any case: the
    template writes Python's `True`), false otherwise; a number is an int when whole."""
    kind, nullable = _schema_type(schema)
    if kind in _TEXT_TYPES and not nullable:
        return value
    if value.strip().lower() in _NULLS:
        return None
    if kind in _TEXT_TYPES:
        return value
    if kind in _BOOLEAN_TYPES:
        return value.strip().lower() == "true"
    try:
        converted = _converter(kind)(value)
    except Exception:  # int, float, json and ast raise a handful of kinds on text that is not their type
        return value
    return converted if _jsonable(converted) else value


def _layout_stripped(value: str) -> str:
    """A parameter's value without the one newline the format puts after `<parameter=NAME>` and the one before
    `</parameter>`; any other whitespace is the value's."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class XmlToolCallStream(_BlockStream):
    """A reply's content with its tool calls taken out, a piece at a time, for `serve --tool-call-parser
    qwen3_coder`: Qwen3.5 (Qwen3.5-397B-A17B and its smaller sizes) and Qwen3-Coder write a call in XML, one
    parameter a block, its value as plain text between layout newlines:

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        </function>
        </tool_call>

    Values are typed by the request's `tools` (OpenAI's list: `{"type": "function", "function": {"name",
    "parameters": JSON schema}}`), as vLLM's qwen3_coder parser types them (see _convert), and a call's arguments
    are the JSON text of its parameters in the order written. A `<tool_call>` block may hold one or more function
    blocks and only whitespace besides; a bare `<function=...>...</function>` block outside one is a call too (vLLM
    reads a reply without <tool_call> tags that way). A function block is its name (no whitespace, quotes, braces or
    angle brackets, so a template's `<function={{ name }}>` is not one), then parameter blocks and whitespace only.
    A value ends at the first `</parameter>` followed by another parameter or the function's end, so it may hold
    that tag itself. Any block not in this form (a missing `</parameter>` or `</function>` included; vLLM guesses
    there) stays text, like a block that never closes, and so does text around and between the calls."""

    BLOCKS = {TOOL_OPEN: TOOL_CLOSE, FUNCTION_OPEN: FUNCTION_CLOSE}

    def __init__(self, tools: list | None = None):
        super().__init__()
        self.schemas = _parameter_schemas(tools)

    def _parse_block(self, opener: str, body: str) -> list[dict] | None:
        if opener == FUNCTION_OPEN:
            call = self._function(body)
            return None if call is None else [call]
        calls, at = [], 0
        while match := _NEXT_FUNCTION.match(body, at):
            calls.append(self._function(match[1]))
            at = match.end()
        return calls if calls and None not in calls and not body[at:].strip() else None

    def _function(self, text: str) -> dict | None:
        """The call in the text after `<function=` (`NAME>` and its parameter blocks); None when it is not one."""
        match = _FUNCTION.fullmatch(text)
        if match is None:
            return None
        name, parameters, at = match[1], {}, match.start(2)
        schemas = self.schemas.get(name, {})
        while parameter := _NEXT_PARAMETER.match(text, at):
            parameters[parameter[1]] = _convert(_layout_stripped(parameter[2]), schemas.get(parameter[1]))
            at = parameter.end()
        if text[at:].strip():
            return None
        return {"name": name, "arguments": json.dumps(parameters, ensure_ascii=False)}


#: The tool-call parsers `serve --tool-call-parser` may name: each makes the stream of one reply from the request's
#: `tools` (hermes does not use them).
TOOL_CALL_STREAMS = {"hermes": ToolCallStream, "qwen3_coder": XmlToolCallStream}
