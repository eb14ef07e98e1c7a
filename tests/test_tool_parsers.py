"""Tool-call parsers (frontend/replies.py TOOL_CALL_STREAMS): Qwen3.5's XML calls (`--tool-call-parser
qwen3_coder`, XmlToolCallStream) taken out of a reply's content with their values typed by the request's tool
schemas as vLLM types them, malformed blocks left as text, and the same content and calls whichever pieces the reply
arrives in; the parsers picked by name (hermes's own cases are in test_chat.py).
"""

from __future__ import annotations

import itertools
import json

import pytest

from qcompile.frontend.replies import TOOL_CALL_STREAMS, ReasoningSplit, ToolCallStream, XmlToolCallStream

#: The tool of RENDERED's conversation.
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get weather", "parameters": {
    "type": "object", "required": ["city"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"}}}}}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "now"}}]


def xml_call(name: str, *parameters: tuple[str, str]) -> str:
    """A call as Qwen3.5's template writes one: each value between layout newlines."""
    blocks = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"<tool_call>\n<function={name}>\n{blocks}</function>\n</tool_call>"


def call(name: str, arguments: str) -> dict:
    return {"name": name, "arguments": arguments}


PARIS = xml_call("get_weather", ("city", "Paris"), ("days", "3"))
PARIS_CALL = call("get_weather", '{"city": "Paris", "days": 3}')
REPLIES = [  # (a reply's content, that content without its calls, the calls)
    (PARIS, "", [PARIS_CALL]),
    ("Let me check.\n\n" + PARIS + "\n" + xml_call("get_weather", ("city", "Zürich")) + "\nDone.",
     "Let me check.\n\n\n\nDone.", [PARIS_CALL, call("get_weather", '{"city": "Zürich"}')]),
    ("<tool_call>\n<function=now>\n</function>\n<function=now>\n</function>\n</tool_call>", "",
     [call("now", "{}"), call("now", "{}")]),  # one block, two functions
    ("x <function=now>\n</function> y", "x  y", [call("now", "{}")]),  # a bare function block, as vLLM reads one
    ("cut short " + PARIS[:-5], "cut short " + PARIS[:-5], []),  # never closed
    ("a < b, <tool_c", "a < b, <tool_c", []),
    ("a <function=now>", "a <function=now>", []),
    ('<tool_call>\n{"name": "now"}\n</tool_call> hermes', '<tool_call>\n{"name": "now"}\n</tool_call> hermes', []),
]
MALFORMED = [  # blocks that are not calls, so stay text
    "<tool_call>\n</tool_call>",  # no function
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",  # no </parameter>
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",  # no </function>
    "<tool_call>\nSure:\n<function=now>\n</function>\n</tool_call>",  # text beside the function
    "<tool_call>\n<function=now>\nhello\n</function>\n</tool_call>",  # text beside the parameters
    "<tool_call>\n<function={{ name }}>\n</function>\n</tool_call>",  # a template's placeholder
    "<tool_call>\n<function=now>\n</function>\n<function={{ name }}>\n</function>\n</tool_call>",
    "<tool_call>\n<function=now>\n</function>\n<function=now>\n</tool_call>",  # the second never closed
    "<function=>\n</function>",  # no name
    "<function=get weather>\n</function>",
]


def read(stream, reply: str, points=()) -> tuple[str, list[dict]]:
    """The content and calls of `reply` pushed to `stream` in the pieces between `points`, then finished."""
    content, calls = "", []
    for a, b in zip([0, *points], [*points, len(reply)]):
        text, new = stream.push(reply[a:b])
        content, calls = content + text, calls + new
    text, new = stream.finish()
    return content + text, calls + new


@pytest.mark.parametrize("reply, content, calls", REPLIES + [(text, text, []) for text in MALFORMED])
def test_xml_calls_are_taken_out_whatever_the_pieces(reply, content, calls):
    """Qwen3.5's calls: each well-formed block is a call (its arguments as JSON text, typed by the tools), text
    around and between them is content, anything else stays text. Cut at every point, and one character a piece,
    the reply gives the same content and calls as whole."""
    assert XmlToolCallStream(TOOLS).push(reply, final=True) == (content, calls)
    for points in [*([cut] for cut in range(1, len(reply))), range(1, len(reply))]:
        assert read(XmlToolCallStream(TOOLS), reply, points) == (content, calls), points


@pytest.mark.parametrize("reply, content, calls", [REPLIES[3], REPLIES[6], (MALFORMED[8], MALFORMED[8], [])])
def test_xml_calls_are_the_same_at_every_pair_of_cuts(reply, content, calls):
    for points in itertools.combinations(range(1, len(reply)), 2):
        assert read(XmlToolCallStream(TOOLS), reply, points) == (content, calls), points


def value(text: str, schema: dict | None):
    """The value a parameter written as `text` takes in a function whose only parameter has `schema` (None: a
    parameter the schema does not name)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {} if schema is None else {"v": schema}}}}
    content, calls = XmlToolCallStream([tool]).push(xml_call("f", ("v", text)), final=True)
    assert content == "" and len(calls) == 1
    return json.loads(calls[0]["arguments"])["v"]


NULLABLE_STRING = {"anyOf": [{"type": "string"}, {"type": "null"}]}


@pytest.mark.parametrize("schema, text, expected", [
    ({"type": "string"}, "Paris", "Paris"),
    ({"type": "string"}, "42", "42"),  # text that looks like a number stays text
    ({"type": "string"}, "true", "true"),
    ({"type": "string"}, "None", "None"),
    ({"type": "string"}, "  indented\nsecond line\n\n  last  ", "  indented\nsecond line\n\n  last  "),
    ({"type": "string"}, "\nblank lines kept\n", "\nblank lines kept\n"),  # one layout newline a side only
    ({"type": "string"}, "", ""),
    ({}, "42", "42"),  # a named parameter without a type is text
    ({"enum": ["C", "F"]}, "C", "C"),
    ({"type": "integer"}, "3", 3),
    ({"type": "integer"}, "-12", -12),
    ({"type": "integer"}, "3.5", "3.5"),  # not its type: stays text
    ({"type": "integer"}, "three", "three"),
    ({"type": "number"}, "2.5", 2.5),
    ({"type": "number"}, "3.0", 3),  # whole: an int
    ({"type": "number"}, "1e400", "1e400"),  # no JSON number
    ({"type": "number"}, "n/a", "n/a"),
    ({"type": "boolean"}, "true", True),
    ({"type": "boolean"}, "True", True),  # the template writes Python's True
    ({"type": "boolean"}, "False", False),
    ({"type": "boolean"}, "yes", False),  # vLLM: only true is true
    ({"type": "object"}, '{"unit": "C", "max": null}', {"unit": "C", "max": None}),
    ({"type": "object"}, "{'unit': 'C', 'ok': True}", {"unit": "C", "ok": True}),  # a Python literal
    ({"type": "object"}, "{unit: C}", "{unit: C}"),
    ({"type": "object"}, "{1, 2}", "{1, 2}"),  # a Python set is no JSON
    ({"type": "array"}, "[1, 2]", [1, 2]),
    ({"type": "array"}, "[\n  1,\n  2\n]", [1, 2]),
    ({"type": "array"}, "__import__('os')", "__import__('os')"),  # literals only, never code
    ({"type": "integer"}, "None", None),  # the template writes Python's None
    ({"type": "object"}, "null", None),
    ({"type": ["integer", "null"]}, "NULL", None),
    (NULLABLE_STRING, "None", None),  # text, but it may be null
    (NULLABLE_STRING, "42", "42"),
    ({"type": "null"}, "None", None),
    ({"type": "any"}, "42", 42),  # a type vLLM does not name: a Python literal, else text
    ({"type": "any"}, "hello there", "hello there"),
    ({"type": "array"}, 'x = "</parameter>"', 'x = "</parameter>"'),  # the tag inside a value is the value's
    (None, "42", "42"),  # a parameter the schema does not name keeps its text
    (None, " spaced ", " spaced "),
])
def test_values_are_typed_by_the_schema(schema, text, expected):
    got = value(text, schema)
    assert got == expected and type(got) is type(expected)


def test_a_function_not_in_the_tools_keeps_its_values_as_text():
    reply = xml_call("lookup", ("id", "7"), ("flags", "[1]"))
    assert XmlToolCallStream(TOOLS).push(reply, final=True) == ("", [call("lookup", '{"id": "7", "flags": "[1]"}')])
    untyped = call("get_weather", '{"city": "Paris", "days": "3"}')
    assert XmlToolCallStream(None).push(PARIS, final=True) == XmlToolCallStream([]).push(PARIS, final=True) == (
        "", [untyped])


def test_arguments_keep_the_order_written_and_the_last_of_a_repeated_parameter():
    reply = xml_call("get_weather", ("days", "1"), ("city", "Oslo"), ("days", "2"))
    assert XmlToolCallStream(TOOLS).push(reply, final=True)[1] == [call("get_weather", '{"days": 2, "city": "Oslo"}')]


#: An assistant turn with reasoning, content and two calls (tools: WEATHER) as Qwen3.5's chat template (transformers'
#: jinja2 settings) writes it, after its generation prompt `<|im_start|>assistant\n<think>\n`, up to <|im_end|>.
RENDERED = """\
User wants weather.
</think>

Let me check.

<tool_call>
<function=get_weather>
<parameter=city>
Paris
</parameter>
<parameter=days>
3
</parameter>
<parameter=opts>
{"unit": "C"}
</parameter>
<parameter=flag>
True
</parameter>
<parameter=none>
None
</parameter>
<parameter=lst>
[1, 2]
</parameter>
</function>
</tool_call>
<tool_call>
<function=get_weather>
<parameter=city>
Lyon
</parameter>
</function>
</tool_call>"""
TYPED = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    **WEATHER["function"]["parameters"]["properties"], "flag": {"type": "boolean"},
    "none": {"type": ["integer", "null"]}, "lst": {"type": "array", "items": {"type": "integer"}}}}}}


@pytest.mark.parametrize("tools, arguments", [
    ([WEATHER], '{"city": "Paris", "days": 3, "opts": {"unit": "C"}, "flag": "True", "none": "None", "lst": "[1, 2]"}'),
    ([TYPED], '{"city": "Paris", "days": 3, "opts": {"unit": "C"}, "flag": true, "none": null, "lst": [1, 2]}'),
])
def test_a_reply_in_the_qwen35_templates_form(tools, arguments):
    """The template's own rendering of a turn with two calls (Python's True and None written by `|string`,
    mappings and lists by `tojson`) reads back as those calls, after the reasoning is split off as `serve` does."""
    reasoning, content = ReasoningSplit(prompt_opened=True).push(RENDERED, final=True)
    assert reasoning == "User wants weather."
    expected = ("Let me check.\n\n\n", [call("get_weather", arguments), call("get_weather", '{"city": "Lyon"}')])
    assert XmlToolCallStream(tools).push(content, final=True) == expected
    assert read(XmlToolCallStream(tools), content, range(1, len(content), 7)) == expected


def test_the_parsers_by_name():
    """`serve --tool-call-parser NAME` makes each reply's stream from the request's tools; each reads only its own
    format."""
    hermes = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    assert set(TOOL_CALL_STREAMS) == {"hermes", "qwen3_coder"}
    assert isinstance(TOOL_CALL_STREAMS["hermes"](TOOLS), ToolCallStream)
    assert TOOL_CALL_STREAMS["hermes"](TOOLS).push(hermes + PARIS, final=True) == (PARIS, [call("now", "{}")])
    assert TOOL_CALL_STREAMS["qwen3_coder"](TOOLS).push(hermes + PARIS, final=True) == (hermes, [PARIS_CALL])
