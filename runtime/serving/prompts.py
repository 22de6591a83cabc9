"""Request bodies -> prompt token ids: chat messages through the chat template, completion prompts.

Shapes are checked here, failing at the first bad item with its index (pydantic unions over a
huge list would list every item): each message carries OpenAI's fields for its role
(`MESSAGE_FIELDS`), and `chat_template_kwargs` only variables the chat template reads. Length is checked before tokenising where a bound allows it: a
prompt of B UTF-8 bytes has at least B / `Tokenizer.max_token_bytes` tokens, so one that cannot fit
the context is refused without the (slow) tokenizer. Request strings never become control tokens
(`Tokenizer.render_chat`); completion prompts only when the body sets `parse_special_tokens`.
Runs on a worker thread (`runtime/serving/intake.py`), never on the event loop.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from glmc.runtime.engine.tokenizer import ChatPrompt, TemplateError, Tokenizer
from glmc.runtime.serving.glm_output import CALL_START, THINK_END
from glmc.runtime.serving.protocol import APIError, ChatRequest, CompletionRequest
from glmc.runtime.serving.structured import chat_grammar, wants_json

SERVER_SET = {"messages", "tools", "add_generation_prompt"}  # template variables the server sets
ROLES = ("system", "developer", "user", "assistant", "tool")
# The fields a message of each role may carry (OpenAI's, less `name`, which GLM's template has no
# place for; plus `reasoning_content`, an earlier turn's thinking, as vLLM and SGLang take it).
# A field set to null is as if absent; `content` is required except on an assistant's tool calls.
MESSAGE_FIELDS = {"system": {"content"}, "developer": {"content"}, "user": {"content"},
                  "assistant": {"content", "reasoning_content", "tool_calls"},
                  "tool": {"content", "tool_call_id"}}
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for tool names


@dataclass
class Prompts:
    """Token ids of each prompt of one API call, and how its chat output is to be read."""

    ids: list[list[int]]
    thinking: bool = False  # the chat prompt left <think> open: output starts with reasoning
    tools: list[dict] | None = None  # tool definitions whose calls are parsed out of the output
    forced: str = ""  # text appended to the prompt that the output is read as starting with
    grammar: str | None = None  # what the output must follow (`structured.py`); None: free text


def too_long(num_tokens_at_least: int, max_context: int, param: str) -> APIError:
    return APIError(400, f"This model's maximum context length is {max_context} tokens. However, "
                    f"your prompt has at least {num_tokens_at_least} tokens.", param,
                    "context_length_exceeded")


# -- chat ---------------------------------------------------------------------------------------


def chat_prompts(body: ChatRequest, tok: Tokenizer, max_context: int, vocab_size: int) -> Prompts:
    """The chat prompt's ids, how its output is read and the grammar it must follow (the model's
    `vocab_size`: the grammar's token ids)."""
    messages = chat_messages(body.messages, max_context)
    tools = _tools(body)
    grammar = chat_grammar(body, tools, tok, vocab_size)
    kwargs = dict(body.chat_template_kwargs or {})
    bad = sorted(SERVER_SET & kwargs.keys())
    if bad:
        raise APIError(400, f"chat_template_kwargs: {bad[0]!r} is set by the server",
                       "chat_template_kwargs")
    readable = tok.template_variables() - SERVER_SET
    unknown = sorted(kwargs.keys() - readable)
    if unknown:   # the template would never read it: a typo, or another model's option
        raise APIError(400, f"chat_template_kwargs: {unknown[0]!r} is not a variable of this "
                       f"model's chat template (it reads: {', '.join(sorted(readable)) or 'none'})",
                       "chat_template_kwargs")
    try:
        prompt = tok.render_chat(messages, tools=tools, **kwargs)
    except TemplateError as e:
        raise APIError(400, str(e), "messages") from e
    _check_bytes(prompt.num_bytes, tok, max_context, "messages")
    forced = _forced_call(body, tools, prompt.thinking)
    if wants_json(body) and prompt.thinking:  # JSON is the answer: the reasoning is closed first
        forced = THINK_END
    ids = _encode(tok.encode_chat, prompt, "messages") + (tok.encode(forced) if forced else [])
    return Prompts([ids], prompt.thinking, tools, forced, grammar)


def _forced_call(body: ChatRequest, tools: list[dict] | None, thinking: bool) -> str:
    """tool_choice "required" or a named function: the assistant's turn is begun for the model with
    GLM's call marker (and the function's name), closing an open <think> first, so what it writes
    next is the call's name or arguments, which the request's grammar then constrains
    (`structured.tool_call_grammar`). The output parser reads the forced text before the model's
    (`glm_output.ChatOutput(forced=...)`)."""
    choice = body.tool_choice
    if choice is None or choice in ("auto", "none"):
        return ""
    if not tools:
        raise APIError(400, "tool_choice: a call is required but the request has no tools",
                       "tool_choice")
    opening = (THINK_END if thinking else "") + CALL_START
    if choice == "required":
        return opening
    name = choice.function.name
    if name not in {t["function"]["name"] for t in tools}:
        raise APIError(400, f"tool_choice: no tool named {name!r} in tools", "tool_choice")
    return opening + name


def chat_messages(messages, max_context: int) -> list[dict]:
    """The request's messages as the chat template expects them (OpenAI's shapes checked)."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    if len(messages) > max_context:  # every message renders at least one token
        raise too_long(len(messages), max_context, "messages")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise APIError(400, f"{where} must be an object with a string role", where)
    if m["role"] not in ROLES:
        raise APIError(400, f"{where}.role: unknown role {m['role']!r} (one of {', '.join(ROLES)})",
                       f"{where}.role")
    fields = MESSAGE_FIELDS[m["role"]]
    for key, value in m.items():
        if key != "role" and value is not None and key not in fields:
            why = "participant names are not rendered by this model's chat template" \
                if key == "name" else f"a {m['role']} message has {', '.join(sorted(fields))}"
            raise APIError(400, f"{where}.{key}: not supported ({why})", f"{where}.{key}")
    out = {"role": "system" if m["role"] == "developer" else m["role"]}  # OpenAI's newer name
    calls = m.get("tool_calls")
    if m.get("content") is None and not (m["role"] == "assistant" and calls):
        raise APIError(400, f"{where}.content: required, a string or a list of text parts",
                       f"{where}.content")
    out["content"] = _text(m.get("content"), f"{where}.content")
    if m.get("reasoning_content") is not None:
        out["reasoning_content"] = _text(m["reasoning_content"], f"{where}.reasoning_content")
    if m["role"] == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise APIError(400, f"{where}.tool_call_id: required, the id of the call this answers",
                           f"{where}.tool_call_id")
        out["tool_call_id"] = m["tool_call_id"]
    if calls is not None:
        if not isinstance(calls, list):
            raise APIError(400, f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{k}]") for k, c in
                             enumerate(calls)]
    return out


def _text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):  # OpenAI content parts: only text is understood here
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str) or part.keys() != {"type", "text"}:
                raise APIError(400, f"{where}[{k}]: only text parts ({{\"type\": \"text\", "
                               "\"text\": ...}) are supported", where)
        return "".join(c["text"] for c in content)
    raise APIError(400, f"{where} must be a string or a list of text parts", where)


def _tool_call(call, where: str) -> dict:
    """An assistant's earlier tool call, its JSON `arguments` string made a dict for the template."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, f"{where} needs function.name", where)
    extra = sorted(k for k, v in call.items() if v is not None and k not in ("id", "type", "function"))
    extra += sorted(f"function.{k}" for k in fn if k not in ("name", "arguments"))
    if extra:
        raise APIError(400, f"{where}.{extra[0]}: not supported (a tool call has id, type and "
                       "function {name, arguments})", f"{where}.{extra[0]}")
    if call.get("type", "function") != "function":
        raise APIError(400, f"{where}.type: must be 'function'", f"{where}.type")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except (ValueError, RecursionError) as e:
            raise APIError(400, f"{where}.function.arguments is not JSON: {e}", where) from e
    if not isinstance(args, dict):
        raise APIError(400, f"{where}.function.arguments must be a JSON object", where)
    return {**call, "function": {**fn, "arguments": args}}


def _tools(body: ChatRequest) -> list[dict] | None:
    """Tool definitions for the template and the output parser; None when no tool may be called."""
    if not body.tools or body.tool_choice == "none":
        return None
    for k, t in enumerate(body.tools):
        if not FUNCTION_NAME.match(t.function.name):
            raise APIError(400, f"tools[{k}].function.name must match {FUNCTION_NAME.pattern}",
                           f"tools[{k}].function.name")
    return [t.model_dump(exclude_none=True) for t in body.tools]


# -- completions --------------------------------------------------------------------------------


def completion_prompts(body: CompletionRequest, tok: Tokenizer, max_context: int,
                       max_prompts: int) -> Prompts:
    p = body.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and _is_id(p[0])) or p == []:
        p = [p]
    if not isinstance(p, list):
        raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or "
                       "a list of lists of token ids", "prompt")
    if len(p) > max_prompts:
        raise APIError(400, f"prompt: {len(p)} prompts in one request; at most {max_prompts} can "
                       "be queued (--max-waiting)", "prompt", "too_many_prompts")
    encode = tok.encode if body.parse_special_tokens else tok.encode_plain
    return Prompts([_one_prompt(x, k, tok, encode, max_context) for k, x in enumerate(p)])


def _is_id(x) -> bool:
    return type(x) is int  # not bool


def _one_prompt(x, k: int, tok: Tokenizer, encode, max_context: int) -> list[int]:
    if isinstance(x, str):
        _check_bytes(len(x.encode("utf-8", "surrogatepass")), tok, max_context, "prompt")
        return _encode(encode, x, "prompt")
    if isinstance(x, list) and all(map(_is_id, x)):
        if len(x) > max_context:
            raise too_long(len(x), max_context, "prompt")
        return list(x)
    raise APIError(400, f"prompt[{k}] must be a string or a list of token ids", "prompt")


# -- shared -------------------------------------------------------------------------------------


def _check_bytes(num_bytes: int, tok: Tokenizer, max_context: int, param: str) -> None:
    at_least = num_bytes // tok.max_token_bytes
    if at_least > max_context:
        raise too_long(at_least, max_context, param)


def _encode(encode, text: str | ChatPrompt, param: str) -> list[int]:
    try:
        return encode(text)
    except ValueError as e:  # e.g. a lone surrogate that slipped past the body check
        raise APIError(400, f"{param}: {e}", param) from e
