"""Chat templates (frontend/chat.py): the prompt text and ids of a conversation equal Hugging Face transformers'
`apply_chat_template` on the same tokenizer files — init-tiny's template and one that uses every helper
transformers gives a template (tojson without HTML escaping, namespace, loop controls, {% generation %},
raise_exception); where a template comes from (chat_template.jinja, tokenizer_config.json as text or as named
templates, an override file); what is refused (a template that does not compile, one that refuses the messages,
the sandbox's refusals, variables that would replace the conversation); and a reply's <think> block split from its
content, and its <tool_call> blocks taken out as calls, the same whichever pieces the text arrives in.
"""

from __future__ import annotations

import json

import pytest

from qcompile.errors import UsageError
from qcompile.frontend.chat import (CHAT_TEMPLATE_FILE, TINY_CHAT_TEMPLATE, ChatError, ChatTemplate, encode_chat,
                                    load_chat_template)
from qcompile.frontend.replies import ReasoningSplit, ToolCallStream
from qcompile.frontend.tiny import write_tiny
from qcompile.frontend.tokenizer import load_tokenizer

#: Every helper transformers' environment has, used the way Hub templates use them (written for this test).
RICH_TEMPLATE = """\
{%- set ns = namespace(system="", turns=0) %}
{%- for message in messages %}
    {%- if message.role == "system" %}{% set ns.system = message.content %}{% continue %}{% endif %}
    {%- if message.role not in ["user", "assistant"] %}{{ raise_exception("no role " ~ message.role) }}{% endif %}
    {%- set ns.turns = ns.turns + 1 %}
{%- endfor %}
{{- bos_token }}{% if ns.system %}[sys {{ ns.system | tojson }}]{% endif %}
{% for message in messages if message.role != "system" %}
<{{ message.role }} n={{ loop.index }}{% if loop.last %} last{% endif %}>
{% if message.role == "assistant" %}{% generation %}{{ message.content }}{% endgeneration %}{% else %}{{ message.content }}{% endif %}
{% if message.reasoning_content is defined %}(thinking: {{ message.reasoning_content }}){% endif %}
    {% if loop.first %}first{% endif %}
{{ eos_token }}
{% if loop.index >= 3 %}{% break %}{% endif %}
{% endfor %}
meta {{ {"turns": ns.turns, "note": "<b>&amp; é</b>"} | tojson }}
{% if add_generation_prompt %}<assistant>{% if style is defined %} style={{ style }}{% endif %}
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is a compiler?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  What is a compiler? "},
     {"role": "assistant", "content": "A program that translates."}, {"role": "user", "content": "And a pass?"}],
    [{"role": "user", "content": [{"type": "text", "text": "Two"}, {"type": "text", "text": "parts"}]}],
    [{"role": "system", "content": "Grüße, 世界 🙂 \"quoted\" <tag>"}, {"role": "user", "content": "héllo"},
     {"role": "assistant", "content": "wörld", "reasoning_content": None}],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("chat") / "tiny")


@pytest.fixture(scope="module")
def hf_tokenizer(tiny):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tiny))


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("options", [{}, {"add_generation_prompt": False}, {"variables": {"enable_thinking": False}}])
def test_text_and_ids_equal_transformers_with_the_tiny_template(tiny, hf_tokenizer, conversation, options):
    messages = CONVERSATIONS[conversation]
    template = load_chat_template(tiny)
    generation_prompt = options.get("add_generation_prompt", True)
    variables = options.get("variables", {})
    want = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                            **variables)
    assert template.render(messages, generation_prompt, variables) == want
    want_ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                                return_dict=False, **variables)
    ids = encode_chat(load_tokenizer(tiny, "test"), template, messages, generation_prompt, variables)
    assert ids == list(want_ids)
    assert ids[0] == 1 and ids.count(2) == len(messages)  # <s> opens each turn, </s> closes each: special ids
    if generation_prompt and variables:
        assert want.endswith("<s>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_every_helper_renders_as_in_transformers(tiny, hf_tokenizer, conversation):
    messages = [{**m, "content": m["content"] if isinstance(m["content"], str)  # parts joined, as the server does
                 else "\n".join(part["text"] for part in m["content"])} for m in CONVERSATIONS[conversation]]
    template = ChatTemplate.compile(RICH_TEMPLATE, "rich", {"bos_token": "<s>", "eos_token": "</s>"})
    for generation_prompt, variables in ((True, {}), (False, {}), (True, {"style": "terse"})):
        want = hf_tokenizer.apply_chat_template(messages, chat_template=RICH_TEMPLATE, tokenize=False,
                                                add_generation_prompt=generation_prompt, **variables)
        assert template.render(messages, generation_prompt, variables) == want
    text = template.render(messages)
    assert '"<b>&amp; é</b>"' in text  # tojson: no HTML escaping, no \\u escapes
    if conversation == 1:
        assert '[sys "Be brief."]' in text and "<assistant n=2>" in text and "<user n=3 last>" in text


def test_ids_get_no_special_tokens_beyond_the_templates(tiny, tmp_path):
    """A tokenizer whose post-processor adds <s> to every encoding (as Llama's does) must not add it to a chat
    prompt: the template wrote the special tokens already (transformers encodes with add_special_tokens=False)."""
    transformers = pytest.importorskip("transformers")
    import shutil

    from tokenizers import Tokenizer, processors

    bos = tmp_path / "bos"
    shutil.copytree(tiny, bos, ignore=shutil.ignore_patterns("*.safetensors"))
    tokenizer = Tokenizer.from_file(str(bos / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(bos / "tokenizer.json"))
    messages = CONVERSATIONS[1]
    want = transformers.AutoTokenizer.from_pretrained(str(bos)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = encode_chat(load_tokenizer(bos, "test"), load_chat_template(bos), messages)
    assert ids == list(want) and ids[:2] != [1, 1] and load_tokenizer(bos, "test").encode("hi").ids[0] == 1


def test_a_template_that_refuses_the_messages_is_a_chat_error(tiny):
    template = load_chat_template(tiny)
    with pytest.raises(ChatError, match="roles system, user and assistant, not tool"):
        template.render([{"role": "tool", "content": "42"}])
    with pytest.raises(ChatError, match="may not be named messages"):
        template.render([{"role": "user", "content": "hi"}], variables={"messages": []})
    escape = ChatTemplate.compile("{{ messages.__class__.__mro__[1].__subclasses__() }}", "escape")
    with pytest.raises(ChatError, match="escape"):  # the sandbox refuses; nothing of Python's internals renders
        escape.render([{"role": "user", "content": "hi"}])
    stash = ChatTemplate.compile("{% set ns = namespace() %}{% set ns._x = 1 %}ok", "stash")
    with pytest.raises(ChatError, match="_x"):
        stash.render([{"role": "user", "content": "hi"}])


def test_where_a_template_comes_from(tmp_path, tiny):
    from qcompile.frontend.tokenizer import TINY_TOKENIZER_CONFIG

    config = dict(TINY_TOKENIZER_CONFIG, bos_token={"content": "<s>", "special": True})  # an added token's form
    user = [{"role": "user", "content": "hi"}]

    def directory(name, chat_template=None, jinja=None):
        d = tmp_path / name
        d.mkdir()
        (d / "tokenizer_config.json").write_text(json.dumps({**config, **({"chat_template": chat_template}
                                                                        if chat_template is not None else {})}))
        if jinja is not None:
            (d / CHAT_TEMPLATE_FILE).write_text(jinja)
        return d

    assert load_chat_template(directory("none")) is None and load_chat_template(tmp_path / "missing") is None
    assert load_chat_template(directory("text", "{{ bos_token }}config")).render(user) == "<s>config"
    named = directory("named", [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "chat"}])
    assert load_chat_template(named).render(user) == "chat"
    both = directory("both", "config", jinja="{{ eos_token }}file")
    assert load_chat_template(both).render(user) == "</s>file"  # chat_template.jinja wins, as in transformers
    override = tmp_path / "mine.jinja"
    override.write_text("mine {{ messages[0].content }}")
    assert load_chat_template(both, override).render(user) == "mine hi"
    assert load_chat_template(None, override).render(user) == "mine hi"
    for bad, words in ((directory("nodefault", [{"name": "tool_use", "template": "t"}]), "no 'default'"),
                       (directory("broken", jinja="{% for m in messages %}unclosed"), "not a Jinja chat template"),
                       (directory("number", 3), "must be text")):
        with pytest.raises(UsageError, match=words):
            load_chat_template(bad)
    with pytest.raises(UsageError, match="cannot read the chat template"):
        load_chat_template(both, tmp_path / "absent.jinja")
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "tokenizer_config.json").write_text("{nope")
    with pytest.raises(UsageError, match="not readable JSON"):
        load_chat_template(tmp_path / "badjson")
    assert (tiny / CHAT_TEMPLATE_FILE).read_text() == TINY_CHAT_TEMPLATE


REPLIES = [  # (reply, the prompt opened the block, reasoning, content)
    ("<think>\nplan\n</think>\n\nanswer", False, "plan", "answer"),
    ("\nplan\nmore\n\n</think>\n\nanswer\n", True, "plan\nmore", "answer\n"),
    ("answer only, <think> in the middle", False, "", "answer only, <think> in the middle"),
    ("  <think>x</think>y", False, "x", "y"),
    ("never closes\n", True, "never closes\n", ""),
    ("<thin", False, "", "<thin"),
    ("<think>abc</thi", False, "abc</thi", ""),
    ("a</think>", True, "a", ""),
    ("a</th\nb</think>c</think>", True, "a</th\nb", "c</think>"),
    ("\n\n", True, "", ""),
    ("<think></think>", False, "", ""),
    ("", False, "", ""),
    # Qwen3.5 may start an XML call inside its thinking: the reasoning ends there and the call is content
    ("plan\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>", True, "plan",
     "<tool_call>\n<function=f>\n</function>\n</tool_call>"),
    ('plan <tool_call>{"name": "f"}</tool_call></think>x', True, 'plan <tool_call>{"name": "f"}</tool_call>', "x"),
    ("a<tool_call> <functio", True, "a<tool_call> <functio", ""),
]


@pytest.mark.parametrize("reply, opened, reasoning, content", REPLIES)
def test_a_reply_splits_at_its_think_block_whatever_its_pieces(reply, opened, reasoning, content):
    """Cut into pieces every way (for a reply of more than 13 characters: at every pair of points, and one
    character a piece), the reply splits as it does whole: text is never sent and then taken back (a held tag that
    turns out not to be one is sent later, in order)."""
    assert ReasoningSplit(opened).push(reply, final=True) == (reasoning, content)
    import itertools

    cuts = list(range(1, len(reply)))
    if len(cuts) <= 12:
        ways = [c for n in range(len(cuts) + 1) for c in itertools.combinations(cuts, n)]
    else:
        ways = [*itertools.combinations(cuts, 2), tuple(cuts)]
    for way in ways:
        points = [0, *way, len(reply)]
        split, got = ReasoningSplit(opened), ["", ""]
        for a, b in zip(points, points[1:]):
            for i, piece in enumerate(split.push(reply[a:b])):
                got[i] += piece
        for i, piece in enumerate(split.finish()):
            got[i] += piece
        assert tuple(got) == (reasoning, content), points


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>'
TOOL_REPLIES = [  # (content of a reply, content without its calls, the calls)
    (CALL, "", [{"name": "get_weather", "arguments": '{"city": "Zürich", "days": 2}'}]),
    ("Let me check.\n" + CALL + '\n<tool_call>{"name": "now"}</tool_call>', "Let me check.\n\n",
     [{"name": "get_weather", "arguments": '{"city": "Zürich", "days": 2}'}, {"name": "now", "arguments": "{}"}]),
    ('<tool_call>{"name": "f", "arguments": "{\\"raw\\": 1}"}</tool_call>', "", [{"name": "f", "arguments": '{"raw": 1}'}]),
    ("<tool_call>{not json}</tool_call> after", "<tool_call>{not json}</tool_call> after", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ('cut short <tool_call>{"name": "f"', 'cut short <tool_call>{"name": "f"', []),
    ("a < b, <tool_c", "a < b, <tool_c", []),
]


@pytest.mark.parametrize("reply, content, calls", TOOL_REPLIES)
def test_tool_calls_are_taken_out_whatever_the_pieces(reply, content, calls):
    """Hermes-style calls (Qwen3, Qwen3-Next): each closed block whose JSON names a function is a call, its
    arguments as JSON text; anything else stays text. Cut at every pair of points and one character a piece, the
    reply gives the same content and calls as whole."""
    import itertools

    assert ToolCallStream().push(reply, final=True) == (content, calls)
    ways = [*itertools.combinations(range(1, len(reply)), 2), tuple(range(1, len(reply)))]
    for way in ways:
        points = [0, *way, len(reply)]
        stream, got, made = ToolCallStream(), "", []
        for a, b in zip(points, points[1:]):
            text, new = stream.push(reply[a:b])
            got, made = got + text, made + new
        text, new = stream.finish()
        assert (got + text, made + new) == (content, calls), points


# A template that renders content parts itself (as Qwen3.5's does: each text part in turn, no separator) and one
# that reads content as text only (as Qwen3's and Qwen3-Next's: anything else becomes "").
PARTS_TEMPLATE = """\
{%- macro show(content) %}{% if content is string %}{{ content }}{% else %}{% for item in content %}\
{% if item.type == "text" %}[{{ item.text }}]{% endif %}{% endfor %}{% endif %}{% endmacro %}
{%- for message in messages %}<{{ message.role }}>{{ show(message.content) }}</{{ message.role }}>{% endfor %}"""
TEXT_TEMPLATE = """\
{%- for message in messages %}{% if message.content is string %}{% set content = message.content %}\
{% else %}{% set content = "" %}{% endif %}<{{ message.role }}>{{ content }}</{{ message.role }}>{% endfor %}"""


def test_content_parts_reach_a_template_that_reads_them_and_are_joined_for_one_that_does_not(hf_tokenizer):
    """OpenAI's content parts: a template that loops over them gets the list, rendering as transformers does; one
    that reads text only gets them joined by newlines (vLLM's choice; transformers would hand it the list, and a
    Qwen3-style template would render an empty turn). A mistake either way changes the text."""
    from qcompile.frontend.chat import text_messages

    messages = text_messages([{"role": "user", "content": [{"type": "text", "text": "Two"},
                                                          {"type": "text", "text": "parts"}]},
                              {"role": "assistant", "content": "plain"}])
    parts = ChatTemplate.compile(PARTS_TEMPLATE, "parts")
    text_only = ChatTemplate.compile(TEXT_TEMPLATE, "text")
    assert parts.reads_parts and not text_only.reads_parts
    want = hf_tokenizer.apply_chat_template(messages, chat_template=PARTS_TEMPLATE, tokenize=False)
    assert parts.render(messages, False) == want == "<user>[Two][parts]</user><assistant>plain</assistant>"
    assert text_only.render(messages, False) == "<user>Two\nparts</user><assistant>plain</assistant>"
    assert hf_tokenizer.apply_chat_template(messages, chat_template=TEXT_TEMPLATE, tokenize=False).startswith(
        "<user></user>")  # what handing the list over would do
    for template, reads in (("{{ messages[0].content | map(attribute='text') | join(' ') }}", True),
                            ("{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
                             True),
                            ("{% for m in messages %}{{ m.content }}{% endfor %}", False)):
        assert ChatTemplate.compile(template, "t").reads_parts is reads, template


def test_past_tool_calls_reach_the_template_with_their_arguments_as_objects():
    """OpenAI clients send an assistant turn's tool calls back with the arguments as JSON text; a template that walks
    them (Qwen3.5's `arguments|items`) needs the object, as vLLM hands it over. Text that is not a JSON object stays
    text; null or empty arguments are {}."""
    from qcompile.frontend.chat import text_messages

    template = ChatTemplate.compile(
        "{% for m in messages %}{% for c in m.tool_calls or [] %}<{{ c.function.name }}>"
        "{% if c.function.arguments is mapping %}{% for k, v in c.function.arguments | items %}{{ k }}={{ v }};"
        "{% endfor %}{% else %}raw {{ c.function.arguments }}{% endif %}{% endfor %}{% endfor %}", "calls")
    calls = [{"id": "a", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Bern", "days": 2}'}},
             {"id": "b", "type": "function", "function": {"name": "now", "arguments": ""}},
             {"id": "c", "type": "function", "function": {"name": "odd", "arguments": "not json"}},
             {"id": "d", "type": "function", "function": {"name": "list", "arguments": "[1, 2]"}}]
    messages = text_messages([{"role": "user", "content": "?"}, {"role": "assistant", "content": None,
                                                                  "tool_calls": calls}])
    assert template.render(messages, False) == "<weather>city=Bern;days=2;<now><odd>raw not json<list>raw [1, 2]"
    assert calls[0]["function"]["arguments"] == '{"city": "Bern", "days": 2}'  # the request is not modified
