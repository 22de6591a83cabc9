"""The OpenAI wire format: request bodies in, responses, SSE chunks and errors out.

Pydantic models for `/v1/chat/completions` and `/v1/completions` bodies (unknown fields ignored,
as OpenAI does), their translation to `SamplingParams` and prompt token ids, and `Formatter`, which
renders engine output (choices, logprobs, usage) in OpenAI's shapes. No engine, no HTTP here.
"""
from __future__ import annotations

import itertools
import json
import re
import time

from fastapi.responses import JSONResponse
from glmc.runtime.engine.sampling import SamplingError, SamplingParams
from glmc.runtime.engine.tokenizer import TemplateError, Tokenizer
from pydantic import BaseModel, ConfigDict


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error", headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type, self.headers = type, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


ENGINE_FAILED = APIError(500, "the engine failed while running this request (see server log)",
                         None, "engine_error", "server_error")


class _SamplingFields(BaseModel):
    """Fields common to both generation endpoints; unknown fields are ignored, as OpenAI does."""

    model_config = ConfigDict(extra="ignore")
    model: str
    n: int | None = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict | None = None  # OpenAI: {"token id": bias in [-100, 100]}; see logit_bias()
    stop: str | list[str | int] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None


class ChatRequest(_SamplingFields):
    messages: list[dict]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False


def sampling_params(body: _SamplingFields, max_tokens: int | None, logprobs: bool, top: int,
                    seed: int | None) -> SamplingParams:
    """The body's sampling fields, defaults where absent (raises `SamplingError` when validated)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    d = SamplingParams()
    pick = lambda name: v if (v := getattr(body, name)) is not None else getattr(d, name)  # noqa
    return SamplingParams(
        max_tokens=max_tokens, **{k: pick(k) for k in (
            "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty")},
        stop=[s for s in stop if isinstance(s, str)],
        stop_token_ids=[s for s in stop if isinstance(s, int)] + list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos, seed=seed, logprobs=logprobs, top_logprobs=top,
        logit_bias=logit_bias(body.logit_bias))


def logit_bias(raw: dict | None) -> dict[int, float]:
    """OpenAI's logit_bias, {"token id": number}, as {token id: bias}; raises `SamplingError`
    (param "logit_bias") on a key that is not a token id or a value that is not a number. The
    range checks (ids below the vocabulary size, values in [-100, 100]) are SamplingParams.validate's."""
    out = {}
    for key, value in (raw or {}).items():
        if not (isinstance(key, str) and re.fullmatch(r"-?[0-9]+", key)):
            raise SamplingError("logit_bias", f"logit_bias: keys must be token ids, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SamplingError("logit_bias", f"logit_bias[{key!r}]: must be a number, got {value!r}")
        out[int(key)] = float(value)
    return out


def prompt_ids(body: ChatRequest | CompletionRequest, tok: Tokenizer) -> list[list[int]]:
    """Token ids of each prompt: the chat template over the messages, or the completion prompts."""
    if isinstance(body, ChatRequest):
        if not body.messages:
            raise APIError(400, "messages must be a non-empty list", "messages")
        messages = [_message(m, i) for i, m in enumerate(body.messages)]
        try:
            return [tok.encode(tok.apply_chat_template(messages))]
        except TemplateError as e:
            raise APIError(400, str(e), "messages") from e
    p = body.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)) or not p:
        p = [p]
    return [tok.encode(x) if isinstance(x, str) else list(x) for x in p]


def _message(m: dict, i: int) -> dict:
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts: only text is understood here
        if any(not isinstance(c, dict) or c.get("type") != "text" for c in content):
            raise APIError(400, f"messages[{i}].content: only text parts are supported",
                           f"messages[{i}].content")
        content = "".join(c.get("text", "") for c in content)
    if not isinstance(m.get("role"), str) or not isinstance(content, (str, type(None))):
        raise APIError(400, f"messages[{i}] needs a string role and string content",
                       f"messages[{i}]")
    return {**m, "content": content or ""}


class Formatter:
    """Responses and SSE chunks of one model, in OpenAI's chat or legacy completions layout."""

    def __init__(self, model_name: str, tokenizer: Tokenizer):
        self.model_name, self.tokenizer = model_name, tokenizer

    def head(self, rid: str, chat: bool, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else \
            "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name}

    def chunk(self, rid, chat, index, delta, finish_reason, lp) -> str:
        choice = {"index": index, "finish_reason": finish_reason,
                  "logprobs": self.logprobs(lp, chat)}
        choice |= {"delta": delta} if chat else {"text": delta}
        return sse_data({**self.head(rid, chat, True), "choices": [choice]})

    def response(self, rid, chat, reqs, choices, counts, n) -> dict:
        out = []
        for i, c in enumerate(choices):
            choice = {"index": i, "finish_reason": c["finish_reason"],
                      "logprobs": self.logprobs(c["logprobs"] if reqs[i].params.logprobs
                                                else None, chat)}
            choice |= ({"message": {"role": "assistant", "content": c["text"]}} if chat
                       else {"text": c["text"]})
            out.append(choice)
        return {**self.head(rid, chat, False), "choices": out, "usage": usage(counts, n)}

    def logprobs(self, items, chat: bool):
        """OpenAI logprobs: chat's `content` list, or the legacy completions layout."""
        if items is None:
            return None
        tok = self.tokenizer
        name = tok.id_to_token

        def entry(t, lp):
            return {"token": name(t), "logprob": lp, "bytes": list(tok.token_bytes(t))}
        if chat:
            return {"content": [entry(t, lp.logprob) | {"top_logprobs": [
                entry(a, b) for a, b in lp.top]} for t, lp in items]}
        tokens = [name(t) for t, _ in items]
        offsets = [0, *itertools.accumulate(len(x) for x in tokens)][:len(tokens)]
        return {"tokens": tokens, "token_logprobs": [lp.logprob for _, lp in items],
                "top_logprobs": [{name(a): b for a, b in lp.top} for _, lp in items],
                "text_offset": offsets}


def sse_data(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def usage(counts: list, n: int) -> dict:
    """Token counts; a prompt shared by `n` choices counts once, as OpenAI does."""
    done = [c for c in counts if c is not None]
    firsts = [c for i, c in enumerate(counts) if i % n == 0 and c is not None]
    prompt = sum(c.num_prompt_tokens for c in firsts)
    completion = sum(c.num_output_tokens for c in done)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in firsts)}}
