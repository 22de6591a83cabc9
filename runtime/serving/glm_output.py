"""GLM-5 chat output -> OpenAI fields: `reasoning_content`, `content` and `tool_calls`.

GLM-4.5/4.7/5 write their reasoning as `<think>...</think>` (with thinking on, the chat template
already opened `<think>`, so the output starts inside it) and call tools as

    <tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>...</tool_call>

(zai-org's chat template; SGLang's `glm47` detector and vLLM's `glm47` tool parser read the same).
A value is raw text when the tool's JSON schema says the argument is a string, else JSON (`3`,
`true`, `{"a": 1}`), falling back to the raw text. Both parsers are incremental: `feed` takes the
next piece of text and returns what is certain now, holding back a tail that may begin a marker;
`finish` returns the rest (an unclosed tool call comes back as content). Feeding the whole text at
once gives the non-streaming answer.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _held(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1)
                 if text.endswith(marker[:k])), 0)


class ReasoningParser:
    """Splits output text into reasoning (inside `<think>...</think>`) and content."""

    def __init__(self, thinking: bool):
        self.state = "reasoning" if thinking else "start"
        self.buf = ""
        self.strip_next = False  # drop whitespace right after </think>

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that follow from `text`."""
        self.buf += text
        reasoning, content = "", ""
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(THINK_START):
                self.state, self.buf = "reasoning", head[len(THINK_START):]
            elif not THINK_START.startswith(head):
                self.state = "content"
        if self.state == "reasoning":
            end = self.buf.find(THINK_END)
            if end < 0:
                keep = _held(self.buf, THINK_END)
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return reasoning, ""
            reasoning, self.buf = self.buf[:end], self.buf[end + len(THINK_END):]
            self.state, self.strip_next = "content", True
        if self.state == "content":
            content, self.buf = self._content(self.buf), ""
        return reasoning, content

    def _content(self, text: str) -> str:
        if self.strip_next:
            text = text.lstrip()
            self.strip_next = not text
        return text

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        return (rest, "") if self.state == "reasoning" else ("", self._content(rest))


@dataclass
class ToolCall:
    """One parsed call, as OpenAI's `tool_calls` entry."""

    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


class ToolCallParser:
    """Takes GLM tool calls out of content text; `tools` are the request's tool definitions."""

    def __init__(self, tools: list[dict]):
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") or {}
                        for t in tools}
        self.buf = ""
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content outside calls, calls completed) that follow from `text`."""
        self.buf += text
        content, calls = "", []
        while True:
            start = self.buf.find(CALL_START)
            if start < 0:
                keep = _held(self.buf, CALL_START)
                content += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            content += self.buf[:start]
            end = self.buf.find(CALL_END, start)
            if end < 0:
                self.buf = self.buf[start:]
                break
            calls.append(self.parse_call(self.buf[start + len(CALL_START):end]))
            self.buf = self.buf[end + len(CALL_END):]
        self.num_calls += len(calls)
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self.buf = self.buf, ""  # an unclosed call stays text: the model stopped mid-call
        return rest, []

    def parse_call(self, inner: str) -> ToolCall:
        """One call's text between <tool_call> and </tool_call>."""
        first = inner.find("<arg_key>")
        name = (inner if first < 0 else inner[:first]).strip()
        schema = self.schemas.get(name, {})
        args = {k.strip(): self._value(schema, k.strip(), v) for k, v in ARG.findall(inner)}
        return ToolCall(name, json.dumps(args, ensure_ascii=False))

    @staticmethod
    def _value(schema: dict, key: str, text: str):
        props = schema.get("properties") if isinstance(schema, dict) else None
        kind = props.get(key, {}).get("type") if isinstance(props, dict) and \
            isinstance(props.get(key), dict) else None
        if kind == "string" or kind == ["string"]:
            return text
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            return text


class ChatOutput:
    """One chat choice's output read as GLM-5 writes it: reasoning, content and tool calls."""

    def __init__(self, thinking: bool, tools: list[dict] | None, forced: str = ""):
        """`forced`: text the server put at the start of the assistant's turn (a forced tool call's
        opening), read before the model's output; it is never sent back as content."""
        self.reasoning = ReasoningParser(thinking)
        self.tools = ToolCallParser(tools) if tools else None
        if forced and self.feed(forced):
            raise ValueError(f"forced output {forced!r} must open a tool call")

    def feed(self, text: str) -> dict:
        """The delta (OpenAI's keys, only those with something new) that `text` brings."""
        return self._delta(*self.reasoning.feed(text), final=False)

    def finish(self) -> dict:
        return self._delta(*self.reasoning.finish(), final=True)

    def _delta(self, reasoning: str, content: str, final: bool) -> dict:
        calls: list[dict] = []
        if self.tools is not None:
            first = self.tools.num_calls
            content, found = self.tools.feed(content)
            if final:
                rest, more = self.tools.finish()
                content, found = content + rest, found + more
            calls = [c.to_openai(first + k) for k, c in enumerate(found)]
        delta = {"reasoning_content": reasoning, "content": content, "tool_calls": calls}
        return {k: v for k, v in delta.items() if v}

    @property
    def called_tools(self) -> bool:
        return self.tools is not None and self.tools.num_calls > 0
