"""A chat reply's text taken apart as OpenAI's chat API returns it: the reasoning of a thinking model (its
<think> block) and the tool calls (hermes <tool_call> blocks), a piece at a time for streaming, so that the pieces
always add up to what the whole reply gives. Used by `serve` (runtime/server.py ChatReply) with
--reasoning-parser and --tool-call-parser; pure text in, text and calls out.
"""

from __future__ import annotations

import json

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ReasoningSplit:
    """A reply's text split into its reasoning (inside <think> ... </think>) and its content (after), a piece at a
    time, for `serve --reasoning-parser think` (Qwen3 / Qwen3.5 / Qwen3-Next thinking models; DeepSeek-R1's tags).

    Where the reasoning starts is read from the prompt, not guessed: a template that opened the thinking block
    (the prompt ends with <think>, as Qwen3's thinking templates do) makes the reply reasoning from its first token;
    otherwise the reply is reasoning only if it opens a <think> block itself (leading whitespace allowed). Either
    way the reasoning ends at the first </think>. The newlines just inside the block and just after it are dropped
    (the templates write them as layout). A reply that never closes its block is all reasoning. Text that could
    still turn out to be a tag, or layout, is held back until it cannot."""

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
            if end < 0:
                if final:
                    reasoning, self.pending = self.pending, ""
                    return reasoning, ""
                cut = len(self.pending) - self._held(self.pending, THINK_CLOSE)
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
                return reasoning, ""
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


TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


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


class ToolCallStream:
    """A reply's content with its tool calls taken out, a piece at a time, for `serve --tool-call-parser hermes`
    (Qwen3 and Qwen3-Next write a call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, the
    format of the Hermes function-calling models their templates follow).

    Text outside the blocks is content; a block whose JSON names a function becomes a call (its arguments as JSON
    text, as OpenAI returns them); a block that does not parse, or is never closed, stays text. A block is held back
    until it closes (a call is sent whole), and so is text that could still begin one. The pieces of content add up
    to the reply's text without its calls, layout newlines included (`serve` returns a plain reply's content as null
    when it is only whitespace beside calls)."""

    def __init__(self):
        self.pending = ""

    def push(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """(content, calls) that may be sent now, given the content's next piece."""
        self.pending += text
        content, calls = "", []
        while True:
            start = self.pending.find(TOOL_OPEN)
            if start < 0:
                keep = 0 if final else next((k for k in range(min(len(TOOL_OPEN) - 1, len(self.pending)), 0, -1)
                                             if self.pending.endswith(TOOL_OPEN[:k])), 0)
                content += self.pending[:len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                break
            end = self.pending.find(TOOL_CLOSE, start)
            if end < 0:
                content += self.pending[:start]
                self.pending = self.pending[start:]
                if final:
                    content, self.pending = content + self.pending, ""
                break
            call = _tool_call(self.pending[start + len(TOOL_OPEN):end].strip())
            if call is None:
                content += self.pending[:end + len(TOOL_CLOSE)]
            else:
                content += self.pending[:start]
                calls.append(call)
            self.pending = self.pending[end + len(TOOL_CLOSE):]
        return content, calls

    def finish(self) -> tuple[str, list[dict]]:
        return self.push("", final=True)
